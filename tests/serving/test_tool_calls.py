"""Chat requests with tools: the tools are listed by the chat template, a call the model writes in the template's own
format comes back as OpenAI's tool_calls (finish_reason tool_calls), the tool's reply goes back through the template;
a template with no tool-call format grpokit reads refuses tools, saying so. The model's output is scripted: an engine
that writes given text (its log-probs the model's own for those tokens), as a fine-tuned tool user would."""

import json

import openai
import pytest
import torch

from grpokit.models.logprobs import sequence_logprobs
from grpokit.rollout.engines import NativeEngine
from grpokit.rollout.generate import Rollout
from grpokit.serving import PolicyServer
from grpokit.tasks.tiny_model import build_model
from helpers import HERMES, tokenizer_with
from helpers import TEMPLATE_SPEC as SPEC

MODEL = "tiny"
CALL = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class Scripted(NativeEngine):
    """Writes the next of ``texts`` (then EOS) for every row; the log-probs are the model's for those tokens."""

    def __init__(self, model, tokenizer, texts):
        super().__init__(model, tokenizer)
        self.model, self.tokenizer, self.texts, self.prompts = model, tokenizer, list(texts), []

    def generate(self, prompt_ids, prompt_mask, *, num_generations, max_new_tokens, **kwargs):
        self.prompts.append(prompt_ids[prompt_mask.bool()].tolist())
        ids = self.tokenizer(self.texts.pop(0), add_special_tokens=False)["input_ids"] + self.stop_ids[:1]
        completion = torch.tensor([ids[:max_new_tokens]]).repeat(prompt_ids.shape[0], 1)
        mask = torch.ones_like(completion)
        logp, _ = sequence_logprobs(self.model, prompt_ids, prompt_mask, completion, mask)
        return Rollout(prompt_ids, prompt_mask, completion, mask, logp,
                       truncated=torch.tensor([len(ids) > max_new_tokens] * len(completion)))


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(2)
    return build_model(tokenizer_with(HERMES), SPEC, seed=0)


def test_a_call_in_the_templates_format_comes_back_as_tool_calls(model):
    tok = tokenizer_with(HERMES)
    engine = Scripted(model, tok, [CALL, "It is sunny in Paris."])
    with PolicyServer(model, tok, engine=engine, model_name=MODEL) as server:
        ai = openai.OpenAI(base_url=server.episode_url("tools"), api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        reply = ai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=200)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        assert '"name": "get_weather"' in tok.decode(engine.prompts[0])  # the template listed the tool

        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
        final = ai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=200)
        assert final.choices[0].message.content == "It is sunny in Paris." and not final.choices[0].message.tool_calls
        assert final.choices[0].finish_reason == "stop"
        second_prompt = tok.decode(engine.prompts[1])
        assert "<tool_response>\nsunny, 24 C\n</tool_response>" in second_prompt
        assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in second_prompt  # arguments as an object

        first, last = server.pop_episode("tools")
        assert first.finish_reason == "tool_calls" and last.finish_reason == "stop"
        assert tok.decode(first.completion_ids, skip_special_tokens=True) == CALL  # the tokens sampled, as sampled
        assert first.completion_ids[-1] in engine.stop_ids


def test_a_template_without_a_tool_format_refuses_tools_saying_so(model):
    tok = tokenizer_with(CHATML)
    with PolicyServer(model, tok, model_name=MODEL) as server:
        ai = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            ai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=[WEATHER])
        assert caught.value.param == "tools" and "no tool-call format" in str(caught.value)
        plain = ai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert plain.choices[0].message.tool_calls is None  # without tools: served


def test_a_served_tool_episode_becomes_one_sample_of_exactly_the_sampled_tokens(model):
    """Token in, token out: where the model ends its turn with the template's end-of-turn token, each later prompt
    extends the earlier turns token for token, and the episode is one sample whose unmasked tokens are the sampled
    ones, byte for byte (grpokit.rollout.served_samples)."""
    from grpokit.rollout.served_samples import MERGED, episode_samples

    tok = tokenizer_with(HERMES)
    engine = Scripted(model, tok, [CALL, "It is sunny in Paris."])
    engine.stop_ids = [tok.convert_tokens_to_ids("<|im_end|>")]  # as a chat model's generation config says
    with PolicyServer(model, tok, engine=engine, model_name=MODEL) as server:
        ai = openai.OpenAI(base_url=server.episode_url("tio"), api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        reply = ai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=200)
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": reply.choices[0].message.tool_calls[0].id, "content": "sunny"}]
        ai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=200)
        turns = server.pop_episode("tio")
    [sample], mode = episode_samples(turns)
    assert mode == MERGED and sample.prompt_ids == turns[0].prompt_ids
    trained = [t for t, m in zip(sample.completion_ids, sample.loss_mask) if m]
    assert trained == turns[0].completion_ids + turns[1].completion_ids
    assert [p for p, m in zip(sample.logprobs, sample.loss_mask) if m] == turns[0].logp + turns[1].logp
