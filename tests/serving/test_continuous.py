"""grpokit.serving.continuous: requests join a running decode at its next step and leave it as they finish; a joined
row samples what it would alone (greedy, or seeded), with the log-probs generate records; budgets are each request's
own; the engine's generate (training's rollouts) is left as it was; other engines keep batching between calls."""

import asyncio
import subprocess
import sys
import time

import openai
import pytest
import torch

from grpokit.rollout.engines import NativeEngine
from grpokit.rollout.sampling_options import SamplingOptions
from grpokit.serving import PolicyServer
from grpokit.serving.batcher import Job, Sampling
from grpokit.serving.continuous import ContinuousBatcher, serves_continuously

NEVER = 10**9  # a stop id no token has: rows decode their whole budget


def engine_for(model, tok, stop=True, **options):
    engine = NativeEngine(model, tok, SamplingOptions(**options))
    if not stop:
        engine.stop_ids = [NEVER]
    return engine


def alone(engine, tok, text, max_tokens, n=1, seed=None):
    """What generate samples for ``text`` by itself: greedy, or from ``seed``; each row's tokens and log-probs."""
    encoded = tok([text], return_tensors="pt")
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    rollout = engine.generate(encoded["input_ids"], encoded["attention_mask"], num_generations=n,
                              max_new_tokens=max_tokens, greedy=seed is None, generator=generator)
    return [(rollout.completion_ids[k, :int(rollout.lengths[k])].tolist(),
             rollout.logp[k, :int(rollout.lengths[k])].tolist()) for k in range(n)]


def wait_for(condition, seconds=60):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_a_request_arriving_mid_decode_is_answered_before_the_long_one_ends(model, tok):
    batcher = ContinuousBatcher(engine_for(model, tok, stop=False), batch_wait=0)
    long = batcher.submit(Job([tok("Count 1:")["input_ids"]], 1, 600, Sampling(greedy=True)))
    wait_for(lambda: batcher.steps >= 3)  # the long one is decoding
    [short] = batcher.submit(Job([tok("Hello there")["input_ids"]], 1, 4, Sampling(greedy=True))).result(timeout=60)
    assert not long.done() and batcher.batches == 2  # it joined the running decode: a second prefill, no new call
    assert len(short.completion_ids) == 4 and not short.stopped
    [sample] = long.result(timeout=120)
    batcher.close()
    assert len(sample.completion_ids) == 600 and batcher.rows == 2


def test_rows_joining_at_different_steps_sample_what_they_would_alone(model, tok):
    engine = engine_for(model, tok)
    batcher = ContinuousBatcher(engine, batch_wait=0)
    texts = ["Count 7:", "a b c d e f g h i j k l", "x", "Hello there, how are you today?", "Question 3"]
    futures = []
    for k, text in enumerate(texts):
        futures.append((text, 12 + 5 * k, batcher.submit(Job([tok(text)["input_ids"]], 2, 12 + 5 * k,
                                                              Sampling(greedy=True)))))
        wait_for(lambda k=k: batcher.steps >= 2 * (k + 1))  # each joins a decode already running
    for text, budget, future in futures:
        expected = alone(engine, tok, text, budget)[0]
        for sample in future.result(timeout=60):
            assert sample.completion_ids == expected[0] and sample.prompt_ids == tok(text)["input_ids"]
            assert sample.logp == pytest.approx(expected[1], abs=1e-5)  # generate's log-probs
            assert sample.stopped == (len(expected[0]) < budget or expected[0][-1] in engine.stop_ids)
    batcher.close()
    assert batcher.batches > 1 and batcher.rows == 2 * len(texts)


def test_a_seeded_request_samples_what_generate_does_with_its_seed(model, tok):
    engine = engine_for(model, tok)
    batcher = ContinuousBatcher(engine, batch_wait=0)
    other = batcher.submit(Job([tok("noise")["input_ids"]], 2, 40, Sampling(temperature=0.7)))  # decoding too
    seeded = batcher.submit(Job([tok("Count")["input_ids"]], 3, 10, Sampling(temperature=0.8, top_p=0.9, seed=5)))
    encoded = tok(["Count"], return_tensors="pt")
    rollout = engine.generate(encoded["input_ids"], encoded["attention_mask"], num_generations=3, max_new_tokens=10,
                              temperature=0.8, top_p=0.9, generator=torch.Generator().manual_seed(5))
    expected = [rollout.completion_ids[k, :int(rollout.lengths[k])].tolist() for k in range(3)]
    assert [s.completion_ids for s in seeded.result(timeout=60)] == expected
    assert len(other.result(timeout=60)) == 2
    batcher.close()


def test_many_concurrent_requests_with_their_own_max_tokens(model, tok):
    engine = engine_for(model, tok, stop=False)
    budgets = [1, 17, 3, 9, 30, 2, 12, 5, 25, 8, 1, 14, 6, 20, 4, 11]

    async def ask(server, k):
        ai = openai.AsyncOpenAI(base_url=server.episode_url(f"ep-{k}"), api_key="none", max_retries=0)
        await asyncio.sleep(0.002 * k)  # at different times
        reply = await ai.completions.create(model="tiny", prompt=f"Question {k}", max_tokens=budgets[k],
                                            temperature=0)
        await ai.close()
        return reply

    async def run(server):
        return await asyncio.gather(*(ask(server, k) for k in range(len(budgets))))

    with PolicyServer(model, tok, engine=engine, model_name="tiny") as server:
        assert server.continuous
        replies = asyncio.run(run(server))
        for k, reply in enumerate(replies):
            [turn] = server.pop_episode(f"ep-{k}")
            assert reply.usage.completion_tokens == budgets[k] and reply.choices[0].finish_reason == "length"
            assert turn.completion_ids == alone(engine, tok, f"Question {k}", budgets[k])[0][0]
        assert server.batches < len(budgets)  # requests shared prefills


def test_the_engines_generate_is_unchanged_by_serving(model, tok):
    engine = engine_for(model, tok)
    before = alone(engine, tok, "Count 3:", 16, n=2, seed=3)
    model.train()
    with PolicyServer(model, tok, engine=engine, model_name="tiny") as server:
        openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0).completions.create(
            model="tiny", prompt="a", max_tokens=3)
        assert server.batches == 1
    assert model.training  # served in eval mode, given back as it was
    model.eval()
    assert alone(engine, tok, "Count 3:", 16, n=2, seed=3) == before


def test_the_repetition_penalty_and_top_k_apply_as_in_generate(model, tok):
    engine = engine_for(model, tok, repetition_penalty=1.5, top_k=5)
    batcher = ContinuousBatcher(engine, batch_wait=0)
    futures = [batcher.submit(Job([tok(t)["input_ids"]], 1, 15, Sampling(greedy=True))) for t in ("a a a", "b")]
    for text, future in zip(("a a a", "b"), futures):
        assert future.result(timeout=60)[0].completion_ids == alone(engine, tok, text, 15)[0][0]
    batcher.close()


def test_which_engines_serve_continuously(model, tok):
    class Spy(NativeEngine):
        def generate(self, *args, **kwargs):
            return super().generate(*args, **kwargs)

    assert serves_continuously(NativeEngine(model, tok))
    assert not serves_continuously(Spy(model, tok))  # its own generate is called, between calls
    assert not serves_continuously(engine_for(model, tok, fast_path=False))
    assert not serves_continuously(engine_for(model, tok, rollout_precision="int8"))
    with pytest.raises(ValueError, match="continuous batching needs"):
        PolicyServer(model, tok, engine=Spy(model, tok), continuous=True)


def test_release_openmp_pool_frees_the_calling_threads_helpers():
    code = """
import os, torch
from grpokit.runtime.openmp import release_openmp_pool
torch.set_num_threads(2)
torch.randn(2000, 2000).exp_()  # a parallel region: the main thread's helper starts
before = len(os.listdir('/proc/self/task'))
assert release_openmp_pool()
after = len(os.listdir('/proc/self/task'))
torch.randn(2000, 2000).exp_()  # and comes back when needed
print(before - after, len(os.listdir('/proc/self/task')) - after)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1"]


def test_a_failing_decode_fails_its_requests_and_the_next_decode_runs(model, tok, monkeypatch):
    from grpokit.serving import continuous

    batcher = ContinuousBatcher(engine_for(model, tok), batch_wait=0)
    step = continuous._Decode.step

    def broken(self):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(continuous._Decode, "step", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        batcher.submit(Job([[1, 2]], 2, 3, Sampling())).result(timeout=60)
    monkeypatch.setattr(continuous._Decode, "step", step)
    assert len(batcher.submit(Job([[1, 2]], 2, 3, Sampling())).result(timeout=60)) == 2
    batcher.close()
