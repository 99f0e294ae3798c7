"""The policy server on vLLM (grpokit.serving.vllm_backend): the openai SDK drives a server whose engine is a
VLLMEngine, each request added to vLLM's engine as it arrives. Chats, completions with log-probs, a tool call the
model writes, n, seeds, stop strings and context errors as on the native engine; the recorded log-probs are the
policy's own (recomputed by a forward pass) at each request's temperature; greedy output is the native server's;
concurrent requests share vLLM's running batch, and a request sent during a long decode joins it and ends first.

Deselected by default (marker ``vllm``): ``bash scripts/test_vllm.sh`` runs them in vLLM's environment. vLLM's CPU
attention needs heads of 64 dimensions, so the model is tests/rollout/test_vllm_engine.py's shape, with the Hermes
template's context; it is first taught (a few seconds of SGD) to answer the weather question with a tool call, so
that the call comes from the model through vLLM, not from a script."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
import torch

from grpokit.models.logprobs import sequence_logprobs
from grpokit.rollout.engines import SamplingOptions, build_engine
from grpokit.serving import PolicyServer
from grpokit.serving.chat import render_chat
from grpokit.tasks.tiny_model import TinyModelSpec, build_model
from helpers import HERMES, kill_tree, tokenizer_with

pytestmark = pytest.mark.vllm
SPEC = TinyModelSpec(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256, max_positions=1536)
OPTIONS = SamplingOptions(engine="vllm", vllm_gpu_memory_utilization=0.05)  # a small KV cache: ~1 GB here
MODEL = "tiny"
SRC = Path(__file__).resolve().parents[2] / "src"
CALL = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


def learn_the_call(model, tok, steps=200):
    """Fit the model (in place) to answer QUESTION, with WEATHER listed, by CALL and EOS."""
    prompt = tok(render_chat(tok, QUESTION, [WEATHER]))["input_ids"]
    target = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids, labels = torch.tensor([prompt + target]), torch.tensor([[-100] * len(prompt) + target])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        if loss.item() < 0.01:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


@pytest.fixture(scope="module")
def served():
    pytest.importorskip("vllm")
    torch.set_num_threads(2)
    tok = tokenizer_with(HERMES)
    model = build_model(tok, SPEC, seed=0)
    learn_the_call(model, tok)
    engine = build_engine(OPTIONS, model, tok, seed=0)  # after the fit: vLLM loads the fitted weights
    with PolicyServer(model, tok, engine=engine, model_name=MODEL, max_context=1024) as server:
        yield server, model, tok


def client(server, episode=None):
    return openai.OpenAI(base_url=server.episode_url(episode) if episode else server.base_url, api_key="none",
                         max_retries=0)


def policy_logp(model, turn, temperature=1.0):
    """The policy's log-probs (float32, a forward pass) of a recorded turn's tokens at ``temperature``."""
    ones = lambda ids: torch.ones(1, len(ids), dtype=torch.long)  # noqa: E731
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, torch.tensor([turn.prompt_ids]), ones(turn.prompt_ids),
                                    torch.tensor([turn.completion_ids]), ones(turn.completion_ids),
                                    temperature=temperature, fast=False)
    return logp[0].tolist()


def test_the_server_runs_on_vllms_engine(served):
    from grpokit.rollout.vllm_engine import VLLMEngine
    from grpokit.serving.vllm_backend import VLLMBackend

    server, _, _ = served
    assert isinstance(server.engine, VLLMEngine) and isinstance(server._batcher, VLLMBackend)
    assert [m.id for m in client(server).models.list().data] == [MODEL]


def test_completions_and_chats_are_the_recorded_tokens_at_the_policys_logprobs(served):
    server, model, tok = served
    ai = client(server, "shape")
    out = ai.completions.create(model=MODEL, prompt="Count 1:", max_tokens=8, n=2, temperature=0.8, logprobs=0)
    chat = ai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                      logprobs=True)
    turns = server.pop_episode("shape")
    assert [(t.kind, t.choice) for t in turns] == [("completion", 0), ("completion", 1), ("chat", 0)]
    for choice, turn in zip(out.choices, turns):
        assert turn.prompt_ids == tok("Count 1:")["input_ids"] and 1 <= len(turn.completion_ids) <= 8
        assert choice.text == tok.decode(turn.completion_ids, skip_special_tokens=True)
        assert choice.logprobs.token_logprobs == turn.logp and choice.finish_reason == turn.finish_reason
        assert turn.logp == pytest.approx(policy_logp(model, turn, 0.8), abs=2e-4)  # at the request's temperature
    assert out.usage.completion_tokens == sum(len(t.completion_ids) for t in turns[:2])
    turn = turns[2]
    assert turn.prompt_ids == tok(render_chat(tok, [{"role": "user", "content": "Hi"}], None))["input_ids"]
    assert chat.choices[0].message.content == tok.decode(turn.completion_ids, skip_special_tokens=True)
    assert [c.logprob for c in chat.choices[0].logprobs.content] == turn.logp
    assert turn.logp == pytest.approx(policy_logp(model, turn), abs=2e-4)


def test_with_top_p_the_logprobs_are_after_vllms_cut(served):
    """vLLM's processed log-probs come after top-p: renormalised over the tokens kept, so above the policy's."""
    server, model, _ = served
    client(server, "top-p").completions.create(model=MODEL, prompt="Count 1:", max_tokens=6, top_p=0.5)
    [turn] = server.pop_episode("top-p")
    pairs = list(zip(turn.logp, policy_logp(model, turn)))
    assert all(ours >= policy - 2e-4 for ours, policy in pairs) and any(ours > policy + 0.01 for ours, policy in pairs)


def test_greedy_output_equals_the_native_servers(served):
    """The same tokens as the native engine's server, and the same log-probs (temperature 1) to float rounding."""
    server, model, tok = served
    requests = [("completions", dict(prompt="Count 7:", max_tokens=12, n=2)),  # vLLM: n > 1 greedy is refused
                ("chat", dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=10)),
                ("chat", dict(messages=QUESTION, tools=[WEATHER], max_tokens=120))]
    with PolicyServer(model, tok, model_name=MODEL) as native:
        for route, body in requests:
            for each in (server, native):
                api = client(each, "greedy").completions if route == "completions" else \
                    client(each, "greedy").chat.completions
                api.create(model=MODEL, temperature=0, **body)
        ours, theirs = server.pop_episode("greedy"), native.pop_episode("greedy")
    assert [t.completion_ids for t in ours] == [t.completion_ids for t in theirs] and len(ours) == 4
    for a, b in zip(ours, theirs):
        assert a.finish_reason == b.finish_reason and a.logp == pytest.approx(b.logp, abs=2e-4)
    assert tok.decode(ours[-1].completion_ids, skip_special_tokens=True) == CALL  # the fitted answer


def test_a_call_the_model_writes_comes_back_as_tool_calls(served):
    server, model, tok = served
    ai = client(server, "tools")
    reply = ai.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER], max_tokens=200,
                                       temperature=0)  # sampled, the fitted model does not always write it whole
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    messages = [*QUESTION, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    final = ai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=20)
    first, second = server.pop_episode("tools")
    assert first.finish_reason == "tool_calls" and first.completion_ids[-1] == tok.eos_token_id
    assert first.logp == pytest.approx(policy_logp(model, first), abs=2e-4)
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in tok.decode(second.prompt_ids)
    assert final.choices[0].finish_reason == second.finish_reason


def test_n_choices_with_a_seed_are_what_the_vllm_engine_samples_for_it(served):
    server, _, tok = served
    ai = client(server, "seed")
    first = ai.completions.create(model=MODEL, prompt="Count", max_tokens=8, n=3, seed=5)
    again = ai.completions.create(model=MODEL, prompt="Count", max_tokens=8, n=3, seed=5)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    turns = server.pop_episode("seed")
    assert all(len(t.completion_ids) == 8 or t.finish_reason == "stop" for t in turns)
    encoded = tok(["Count"], return_tensors="pt")  # the engine's own generate, seeded by the same seed
    rollout = server.engine.generate(encoded["input_ids"], encoded["attention_mask"], num_generations=3,
                                     max_new_tokens=8, generator=torch.Generator().manual_seed(5))
    assert [t.completion_ids for t in turns[:3]] == \
        [row[:length].tolist() for row, length in zip(rollout.completion_ids, rollout.lengths)]


def test_a_stop_string_and_the_context_limit(served):
    server, _, tok = served
    ai = client(server, "stop")
    free = ai.completions.create(model=MODEL, prompt="Count 3:", max_tokens=10, temperature=0).choices[0].text
    stop = free[3:5]
    cut = ai.completions.create(model=MODEL, prompt="Count 3:", max_tokens=10, temperature=0, stop=[stop]).choices[0]
    assert cut.text == free[:free.find(stop)] and cut.finish_reason == "stop"
    assert stop in tok.decode(server.pop_episode("stop")[-1].completion_ids)
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).completions.create(model=MODEL, prompt="x" * 1000, max_tokens=100)
    assert caught.value.code == "context_length_exceeded" and "maximum context length is 1024" in str(caught.value)


def test_concurrent_requests_share_vllms_running_batch(served):
    """16 requests at once, greedy and sampled at two temperatures, with their own max_tokens: every one answered
    and recorded in its episode, at the policy's log-probs for its own temperature, in fewer busy spells than
    requests, with several rows in vLLM's engine at once."""
    server, model, _ = served
    temperatures = [0, 0.7, 1.0, 1.3]
    batches, most = server.batches, server._batcher.most_rows

    async def episode(k):
        ai = openai.AsyncOpenAI(base_url=server.episode_url(f"c{k}"), api_key="none", max_retries=0)
        reply = await ai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Q {k}"}],
                                                 max_tokens=16 + k, temperature=temperatures[k % 4])
        await ai.close()
        return reply

    async def all_at_once():
        return await asyncio.gather(*(episode(k) for k in range(16)))

    replies = asyncio.run(all_at_once())
    assert len(replies) == 16
    for k in range(16):
        [turn] = server.pop_episode(f"c{k}")
        assert 1 <= len(turn.completion_ids) <= 16 + k
        assert turn.logp == pytest.approx(policy_logp(model, turn, temperatures[k % 4] or 1.0), abs=2e-4)
    assert server.batches - batches < 16 and max(server._batcher.most_rows, most) > 1


def test_a_request_sent_during_a_long_decode_joins_it_and_ends_first(served, monkeypatch):
    """Continuous batching: a 3-token request sent while a 400-token one decodes is answered while that one still
    runs (between-call batching would have it wait for the whole decode)."""
    server, _, _ = served
    monkeypatch.setitem(server.engine.extra_sampling, "ignore_eos", True)  # both run to their max_tokens
    monkeypatch.setattr(server.engine, "stop_ids", [])  # (vLLM's ignore_eos leaves stop_token_ids stopping)
    backend, done = server._batcher, {}

    def long():
        done["long"] = client(server).completions.create(model=MODEL, prompt="Count", max_tokens=400)

    thread = threading.Thread(target=long)
    thread.start()
    start = backend.steps
    deadline = time.time() + 120
    while backend.steps < start + 5 and time.time() < deadline:  # the long decode is under way
        time.sleep(0.01)
    short = client(server).completions.create(model=MODEL, prompt="Count 2:", max_tokens=3)
    still_running = "long" not in done
    thread.join()
    assert still_running and backend.most_rows >= 2
    assert short.usage.completion_tokens == 3 and done["long"].usage.completion_tokens == 400


def test_an_engine_failure_is_a_500_and_the_server_stays_up(served, monkeypatch):
    server, _, _ = served
    engine = server.engine.llm.llm_engine
    real = engine.step

    def failing():
        monkeypatch.setattr(engine, "step", real)  # once
        raise RuntimeError("out of memory")

    monkeypatch.setattr(engine, "step", failing)
    with pytest.raises(openai.InternalServerError, match="out of memory"):
        client(server).completions.create(model=MODEL, prompt="a", max_tokens=2)
    assert client(server).completions.create(model=MODEL, prompt="a", max_tokens=2).usage.completion_tokens >= 1
    assert not engine.has_unfinished_requests()


def test_grpokit_serve_with_generation_engine_vllm(tmp_path):
    pytest.importorskip("vllm")
    tok = tokenizer_with(HERMES)
    build_model(tok, SPEC, seed=0).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "grpokit", "serve", str(tmp_path), "--generation_engine", "vllm",
               "--vllm_gpu_memory_utilization", "0.05", "--port", "0", "--model_name", MODEL, "--progress_bar",
               "false", "--device", "cpu", "--mixed_precision", "no"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        for line in process.stdout:  # vLLM's own lines come first
            lines.append(line)
            if found := re.search(r"at (http://127\.0\.0\.1:\d+/v1)", line):
                break
        assert found, "".join(lines)
        ai = openai.OpenAI(base_url=found.group(1), api_key="none", max_retries=0)
        reply = ai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, logprobs=True)
        assert len(reply.choices[0].logprobs.content) == reply.usage.completion_tokens
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=120) == 0
        assert "stopped" in process.stdout.read()
    finally:
        if process.poll() is None:
            kill_tree(process.pid)
