"""grpokit.serving: the openai SDK's own client drives the policy server on the tiny model: /v1/models, completions
and chats in OpenAI's shape; every request recorded per episode with exactly the tokens sampled and the log-probs
the engine computed; greedy output equal to the native engine's; errors as OpenAI's API gives them."""

import openai
import pytest
import torch

from grpokit.models.logprobs import sequence_logprobs
from grpokit.rollout.engines import NativeEngine
from grpokit.serving import PolicyServer, Turn

MODEL = "tiny"


class Spy(NativeEngine):
    """The native engine, keeping every Rollout it returned (what the engine computed)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rollouts = []

    def generate(self, *args, **kwargs):
        self.rollouts.append(super().generate(*args, **kwargs))
        return self.rollouts[-1]


@pytest.fixture(scope="module")
def server(model, tok):
    with PolicyServer(model, tok, engine=Spy(model, tok), model_name=MODEL, max_context=256) as server:
        yield server


def client(server, episode=None, key="none"):
    return openai.OpenAI(base_url=server.episode_url(episode) if episode else server.base_url, api_key=key,
                         max_retries=0)


def test_models_lists_the_served_model(server):
    assert [m.id for m in client(server).models.list().data] == [MODEL]


def test_a_completion_in_openai_shape_is_the_decode_of_the_recorded_tokens(server, tok):
    out = client(server, "completion").completions.create(model=MODEL, prompt="Count 1:", max_tokens=6, logprobs=0)
    [turn] = server.pop_episode("completion")
    assert turn.kind == "completion" and turn.prompt_ids == tok("Count 1:")["input_ids"]
    assert out.choices[0].text == tok.decode(turn.completion_ids, skip_special_tokens=True)
    assert out.choices[0].logprobs.token_logprobs == turn.logp and len(turn.logp) == len(turn.completion_ids)
    assert out.choices[0].finish_reason == turn.finish_reason
    assert out.usage.prompt_tokens == len(turn.prompt_ids) and out.usage.completion_tokens == len(turn.completion_ids)
    assert len(turn.completion_ids) == 6 or turn.finish_reason == "stop"


def test_several_requests_of_an_episode_are_recorded_in_order_with_the_engines_tokens(server, model, tok):
    ai = client(server, "ep-1")
    asked = []
    for k in range(3):
        messages = [{"role": "user", "content": f"Question {k}"}]
        reply = ai.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, logprobs=True)
        asked.append((messages, reply))
        rollout = server.engine.rollouts[-1]  # this request's batch (the only client of this server now)
        turn = server.episode_turns("ep-1")[-1]
        length = len(turn.completion_ids)
        assert turn.completion_ids == rollout.completion_ids[0, :length].tolist()
        assert turn.logp == rollout.logp[0, :length].tolist()  # exactly what the engine computed
        assert reply.choices[0].message.content == tok.decode(turn.completion_ids, skip_special_tokens=True)
        assert [c.logprob for c in reply.choices[0].logprobs.content] == turn.logp
    turns = server.pop_episode("ep-1")
    assert [t.kind for t in turns] == ["chat"] * 3 and [t.request for t in turns] == sorted(t.request for t in turns)
    for (messages, _), turn in zip(asked, turns):  # the prompt is the chat template's render, with its prompt
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert turn.prompt_ids == tok(rendered)["input_ids"]
    # and they are the policy's log-probs: recomputed by a forward pass over the recorded tokens
    turn = turns[0]
    logp, _ = sequence_logprobs(model, torch.tensor([turn.prompt_ids]), torch.ones(1, len(turn.prompt_ids)).long(),
                                torch.tensor([turn.completion_ids]), torch.ones(1, len(turn.completion_ids)).long())
    assert logp[0].tolist() == pytest.approx(turn.logp, abs=1e-4)
    assert server.episode_turns("ep-1") == []


def test_greedy_output_equals_the_native_engines(server, model, tok):
    prompt = "Count 7:"
    out = client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    encoded = tok([prompt], return_tensors="pt")  # as grpokit sample tokenizes its prompts
    rollout = NativeEngine(model, tok).generate(encoded["input_ids"], encoded["attention_mask"], num_generations=1,
                                                max_new_tokens=12, greedy=True)
    assert out.choices[0].text == rollout.decode(tok)[0]
    assert server.pop_episode(None)[-1].completion_ids == rollout.completion_ids[0, :int(rollout.lengths[0])].tolist()


def test_the_api_key_names_an_episode_where_the_url_does_not(server):
    client(server, key="episode:by-key").completions.create(model=MODEL, prompt="a", max_tokens=2)
    assert len(server.pop_episode("by-key")) == 1


def test_n_choices_and_a_seed(server):
    ai = client(server, "n")
    first = ai.completions.create(model=MODEL, prompt="Count", max_tokens=8, n=3, seed=5)
    again = ai.completions.create(model=MODEL, prompt="Count", max_tokens=8, n=3, seed=5)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # a seeded request runs alone
    turns = server.pop_episode("n")
    assert [(t.request, t.choice) for t in turns] == [(turns[0].request, k) for k in range(3)] + \
        [(turns[3].request, k) for k in range(3)]


def test_a_stop_string_ends_the_text_before_it(server, tok):
    ai = client(server, "stop")
    free = ai.completions.create(model=MODEL, prompt="Count 3:", max_tokens=10, temperature=0).choices[0].text
    stop = free[3:5]
    cut = ai.completions.create(model=MODEL, prompt="Count 3:", max_tokens=10, temperature=0, stop=[stop]).choices[0]
    assert cut.text == free[:free.find(stop)] and cut.finish_reason == "stop"
    turn = server.pop_episode("stop")[-1]
    assert stop in tok.decode(turn.completion_ids) and not turn.completion_ids == []  # recorded up to the stop


def test_context_length_exceeded_is_openais_error(server):
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).completions.create(model=MODEL, prompt="x" * 250, max_tokens=10)
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "max_tokens"
    assert "maximum context length is 256 tokens" in str(caught.value)
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               max_completion_tokens=300)
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "max_completion_tokens"


@pytest.mark.parametrize("bad, param", [(dict(temperature=3), "temperature"), (dict(top_p=0), "top_p"),
                                        (dict(n=0), "n"), (dict(max_tokens=0), "max_tokens"),
                                        (dict(presence_penalty=1.0), "presence_penalty")])
def test_a_bad_parameter_is_a_400_naming_it(server, bad, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).completions.create(model=MODEL, prompt="a", **{"max_tokens": 2, **bad})
    assert caught.value.param == param and caught.value.body["type"] == "invalid_request_error"


def test_an_unknown_model_is_a_404(server):
    with pytest.raises(openai.NotFoundError) as caught:
        client(server).chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.code == "model_not_found" and "'tiny'" in str(caught.value)


def test_turn_is_a_plain_record():
    turn = Turn("chat", [1, 2], [3], [-0.5], "stop")
    assert (turn.request, turn.choice) == (0, 0)


def test_an_engine_failure_is_a_500_and_the_server_stays_up(model, tok):
    class Failing(NativeEngine):
        def generate(self, *args, **kwargs):
            raise RuntimeError("out of memory")

    with PolicyServer(model, tok, engine=Failing(model, tok), model_name=MODEL) as failing:
        with pytest.raises(openai.InternalServerError, match="out of memory"):
            client(failing).completions.create(model=MODEL, prompt="a", max_tokens=2)
        assert [m.id for m in client(failing).models.list().data] == [MODEL]


def test_serving_needs_fastapi_only_when_a_server_starts():
    import subprocess
    import sys

    code = "import sys, grpokit, grpokit.serving; assert 'fastapi' not in sys.modules and 'uvicorn' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
