"""grpokit.serving.batcher: requests that arrive together become rows of one generate call, grouped by their
sampling settings; 16 concurrent episodes driven by openai.AsyncOpenAI are all answered, recorded per episode, and
batched."""

import asyncio
import threading

import openai
import pytest

from grpokit.rollout.engines import NativeEngine
from grpokit.serving import PolicyServer
from grpokit.serving.batcher import Batcher, Job, Sampling

MODEL = "tiny"


class Counting(NativeEngine):
    """The native engine, noting each generate call's rows and settings."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls, self.threads = [], set()

    def generate(self, prompt_ids, prompt_mask, **kwargs):
        self.calls.append((prompt_ids.shape[0], kwargs["temperature"], kwargs["greedy"], kwargs["max_new_tokens"]))
        self.threads.add(threading.current_thread().name)
        return super().generate(prompt_ids, prompt_mask, **kwargs)


def test_jobs_waiting_together_run_as_one_call_per_sampling_setting(model, tok):
    engine = Counting(model, tok)
    batcher = Batcher(engine, batch_wait=0.3)  # every job below is queued before the worker looks
    ids = lambda text: tok(text)["input_ids"]  # noqa: E731
    jobs = [Job([ids("a b"), ids("longer prompt")], 2, 4, Sampling()),  # 4 rows
            Job([ids("c")], 1, 7, Sampling()),  # same settings: same call, its own budget
            Job([ids("d")], 1, 3, Sampling(greedy=True)),  # another setting: another call
            Job([ids("e")], 1, 3, Sampling(seed=1)), Job([ids("e")], 1, 3, Sampling(seed=1))]  # seeded: alone
    futures = [batcher.submit(job) for job in jobs]
    results = [future.result(timeout=60) for future in futures]
    batcher.close()
    assert sorted(engine.calls) == sorted([(5, 1.0, False, 7), (1, 1.0, True, 3), (1, 1.0, False, 3),
                                           (1, 1.0, False, 3)])
    assert [len(samples) for samples in results] == [4, 1, 1, 1, 1]
    assert all(len(s.completion_ids) <= 4 for s in results[0]) and len(results[1][0].completion_ids) <= 7
    assert results[0][0].prompt_ids == ids("a b") and results[0][2].prompt_ids == ids("longer prompt")
    assert results[3][0].completion_ids == results[4][0].completion_ids  # the seed alone decides


def test_a_row_cut_at_its_own_budget_stops_for_length(model, tok):
    batcher = Batcher(Counting(model, tok), batch_wait=0.3)
    short = batcher.submit(Job([tok("x")["input_ids"]], 1, 2, Sampling(greedy=True)))
    batcher.submit(Job([tok("y")["input_ids"]], 1, 9, Sampling(greedy=True)))
    [sample] = short.result(timeout=60)
    batcher.close()
    assert len(sample.completion_ids) <= 2 and (sample.stopped or len(sample.completion_ids) == 2)


def test_a_failing_generate_fails_its_requests_only(model, tok):
    class Broken(Counting):
        def generate(self, *args, **kwargs):
            raise RuntimeError("out of memory")

    batcher = Batcher(Broken(model, tok), batch_wait=0)
    with pytest.raises(RuntimeError, match="out of memory"):
        batcher.submit(Job([[1, 2]], 1, 2, Sampling())).result(timeout=60)
    batcher.close()


def test_16_concurrent_episodes_are_answered_recorded_and_batched(model, tok):
    episodes = 16

    async def episode(server, k):
        ai = openai.AsyncOpenAI(base_url=server.episode_url(f"ep-{k}"), api_key="none", max_retries=0)
        messages = [{"role": "user", "content": f"Question {k}"}]
        first = await ai.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Again"}]
        second = await ai.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
        await ai.close()
        return [first.choices[0].message.content, second.choices[0].message.content]

    async def run(server):
        return await asyncio.gather(*(episode(server, k) for k in range(episodes)))

    with PolicyServer(model, tok, engine=Counting(model, tok), model_name=MODEL) as server:
        texts = asyncio.run(run(server))
        requests = 2 * episodes
        assert server.batches == len(server.engine.calls) and sum(c[0] for c in server.engine.calls) == requests
        assert server.batches <= requests // 4, server.engine.calls  # batched, not one by one
        assert server.engine.threads == {"grpokit-serving-batcher"}  # the model is touched from one thread
        for k in range(episodes):
            turns = server.pop_episode(f"ep-{k}")
            assert [tok.decode(t.completion_ids, skip_special_tokens=True) for t in turns] == texts[k]
            assert tok.decode(turns[1].prompt_ids).count(f"Question {k}") == 1  # its own conversation
            assert turns[0].request < turns[1].request
        assert server.log.episodes() == []
