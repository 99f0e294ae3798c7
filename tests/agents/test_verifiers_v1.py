"""verifiers 0.4 (v1) environments as agents (grpokit.agents.verifiers_v1): episodes run by verifiers' own rollout
code against grpokit's policy server on the tiny model, the turns the server recorded, and the rewards the agent
returns equal to verifiers' own scoring of the same traces (rescored with the task's reward functions, and
verifiers' Trace.reward as the weighted total); the errors that name what is wrong.

The environments are tests/agents/vf_v1_env's two packages, found by module name as verifiers finds an installed
environment: vf-v1-arith (single turn, a keyed reward, train and eval splits) and vf-v1-dialog (multi-turn, driven by
its own Env's scripted user; a taskset that never ends). Offline. Run in verifiers 0.4's own environment: bash
scripts/test_verifiers_v1.sh (these tests are marked ``verifiers_v1``)."""

import asyncio
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.verifiers_v1
pytest.importorskip("verifiers.v1", reason="verifiers 0.4 is not installed: bash scripts/test_verifiers_v1.sh")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

import torch  # noqa: E402

from grpokit.agents import verifiers_v1  # noqa: E402
from grpokit.agents.verifiers_v1 import (  # noqa: E402
    VerifiersV1EpisodeError,
    VerifiersV1Error,
    verifiers_v1_task,
)
from grpokit.rollout.served_samples import episode_samples  # noqa: E402
from grpokit.serving import PolicyServer  # noqa: E402
from grpokit.tasks.tiny_model import build_model  # noqa: E402
from helpers import HERMES, TEMPLATE_SPEC, tokenizer_with  # noqa: E402

MODEL = "tiny"
KEYS = {"shape": ["brevity", "digits"]}  # vf-v1-arith's keyed reward function
ENVS = str(Path(__file__).parent / "vf_v1_env")


@pytest.fixture(scope="module", autouse=True)
def envs():
    """The test environments importable by name, installed or not (scripts/test_verifiers_v1.sh installs them)."""
    sys.path.insert(0, ENVS)
    yield
    sys.path.remove(ENVS)


@pytest.fixture(scope="module")
def tok():
    return tokenizer_with(HERMES)


@pytest.fixture(scope="module")
def server(tok):
    torch.set_num_threads(2)
    with PolicyServer(build_model(tok, TEMPLATE_SPEC, seed=0), tok, model_name=MODEL) as served:
        yield served


def run_rows(task, server, rows, prefix):
    """Each row's episode, concurrently, each against its own episode URL: verifiers' episodes and the turns the
    server recorded for each."""

    async def one(i, row):
        async with openai.AsyncOpenAI(base_url=server.episode_url(f"{prefix}{i}"), api_key="none") as client:
            return await task.run_episode(client, MODEL, **row)

    async def main():
        return await asyncio.gather(*(one(i, row) for i, row in enumerate(rows)))

    episodes = asyncio.run(main())
    return episodes, [server.pop_episode(f"{prefix}{i}") for i in range(len(rows))]


def rescored(task, row, trace):
    """verifiers' own scoring of the trace again: a fresh task from the row, its reward functions on a copy."""
    copy = trace.model_copy(deep=True)
    copy.rewards = {}
    fresh = task._task(row["task"], row["split"])
    asyncio.run(fresh.score(copy))
    return copy


def test_rows_eval_rows_and_reward_names():
    task = verifiers_v1_task("vf-v1-arith", {"taskset": {"num_tasks": 4}}, eval_args={"split": "eval"},
                             sampling={"max_tokens": 8, "temperature": 1.0}, reward_keys=KEYS)
    assert len(task.rows) == 4 and len(task.eval_rows) == 2
    assert task.rows[1] == {"task": {"idx": 1, "prompt": "What is 3+4?", "system_prompt": "Answer with the number "
                                     "only.", "answer": "7"}, "split": "train"}
    assert task.eval_rows[1]["task"]["prompt"] == "What is 2*3?" and task.eval_rows[1]["split"] == "eval"
    assert json.loads(json.dumps(task.rows)) == task.rows  # plain JSON
    assert task.reward_names == ["exact", "brevity", "digits"] and task.reward_weights == [1.0, 0.5, 0.5]
    assert task.sampling == {"temperature": 1.0, "max_tokens": 8}
    assert task.env_config.agent.harness.id == "null" and task.env_config.agent.runtime.type == "subprocess"
    endless = verifiers_v1_task("vf-v1-dialog", max_rows=5)
    assert [row["task"]["words"][0] for row in endless.rows] == ["apple", "river", "stone", "cloud", "amber"]
    assert endless.eval_rows is None and endless.reward_names == ["echoed", "verbosity"]
    assert endless.reward_weights == [2.0, -0.25]
    assert len(verifiers_v1_task("vf-v1-dialog").rows) == verifiers_v1.INFINITE_ROWS
    from_args = verifiers_v1_task("vf-v1-arith", {"taskset": {"num_tasks": 4}, "eval_taskset": {"split": "eval"},
                                                  "reward_keys": KEYS, "max_rows": 3, "on_error": "zero"})
    assert from_args.rows == task.rows[:3] and from_args.eval_rows == task.eval_rows
    assert from_args.reward_names == task.reward_names and from_args.on_error == "zero"
    pinned = verifiers_v1_task("vf-v1-arith", {"agent": {"harness": {"id": "bash"}, "max_turns": 3}}, reward_keys=KEYS)
    assert pinned.env_config.agent.harness.id == "bash" and pinned.env_config.agent.max_turns == 3


def test_single_turn_episodes_are_recorded_and_scored_as_verifiers_scores_them(server, tok):
    task = verifiers_v1_task("vf-v1-arith", eval_args={"split": "eval"}, sampling={"max_tokens": 8},
                             reward_keys=KEYS)
    rows = task.rows[:3] + task.eval_rows[:1]
    episodes, turns = run_rows(task, server, rows, "arith-")
    weights = dict(zip(task.reward_names, task.reward_weights))
    for row, episode, recorded in zip(rows, episodes, turns):
        reward = task.rewards(episode)
        assert episode.ok and len(episode.traces) == 1
        [trace] = episode.traces
        assert trace.task.data.prompt == row["task"]["prompt"]
        # one model call, recorded by the server: the reply verifiers saw is the decode of the tokens sampled
        assert len(recorded) == 1 == trace.num_turns and recorded[0].kind == "chat"
        assert 0 < len(recorded[0].completion_ids) <= 8  # the sampling's max_tokens reached the server
        reply = tok.decode(recorded[0].completion_ids, skip_special_tokens=True)
        assert trace.last_reply == reply
        assert "What is" in tok.decode(recorded[0].prompt_ids)
        # the agent's rewards: verifiers' Trace.rewards, its rescoring, and (by hand) the environment's functions
        assert reward == {name: r.score for name, r in trace.rewards.items()}
        again = rescored(task, row, trace)
        assert reward == {name: r.score for name, r in again.rewards.items()}
        assert reward == {"exact": float(reply.strip() == row["task"]["answer"]), "brevity": 1 / (1 + len(reply)),
                          "digits": sum(c.isdigit() for c in reply) / max(1, len(reply))}
        total = sum(weights[name] * value for name, value in reward.items())
        assert total == pytest.approx(trace.reward, abs=1e-12) and total == pytest.approx(again.reward, abs=1e-12)
        assert reward["brevity"] > 0 and trace.metrics["length"] == len(reply)


def test_the_agent_entry_point_returns_the_rewards_and_shows_the_episode(server):
    """task.agent, as the trainer calls it, with a column of its own; on two event loops, one after the other."""
    task = verifiers_v1_task("vf-v1-arith", {"taskset": {"num_tasks": 2}}, sampling={"max_tokens": 4},
                             reward_keys=KEYS)
    seen = []
    task.on_episode = lambda episode, rewards: seen.append((episode, rewards))

    async def main():
        async with openai.AsyncOpenAI(base_url=server.episode_url("entry"), api_key="none") as client:
            return await task.agent(client, MODEL, **task.rows[0], other_column="ignored")

    rewards = [asyncio.run(main()) for _ in range(2)]  # a second event loop: verifiers' serving comes up again
    assert len(seen) == 2
    for (episode, given), returned in zip(seen, rewards):
        assert given == returned == {name: r.score for name, r in episode.traces[0].rewards.items()}
    assert len(server.pop_episode("entry")) == 2


def test_multi_turn_episodes_driven_by_the_environment(server, tok):
    task = verifiers_v1_task("vf-v1-dialog", {"taskset": {"turns": 2}}, sampling={"max_tokens": 6}, max_rows=3)
    episodes, turns = run_rows(task, server, task.rows[:2], "dialog-")
    for row, episode, recorded in zip(task.rows, episodes, turns):
        reward = task.rewards(episode)
        assert episode.ok
        [trace] = episode.traces
        # the environment's scripted user spoke twice: two model calls, both recorded under the episode
        assert len(recorded) == 2 == trace.num_turns
        assert f"Say the word {row['task']['words'][1]}." in tok.decode(recorded[1].prompt_ids)
        replies = [m.content or "" for m in trace.assistant_messages]
        assert replies == [tok.decode(t.completion_ids, skip_special_tokens=True) for t in recorded]
        # what training would take from the episode: exactly the tokens sampled, in order
        samples, _ = episode_samples(recorded)
        trained = [t for sample in samples for t, m in zip(sample.completion_ids, sample.loss_mask) if m]
        assert trained == [t for turn in recorded for t in turn.completion_ids]
        again = rescored(task, row, trace)
        assert reward == {name: r.score for name, r in again.rewards.items()}
        assert reward["verbosity"] == sum(len(r) for r in replies) / 10 > 0
        total = sum(w * reward[n] for n, w in zip(task.reward_names, task.reward_weights))
        assert total == pytest.approx(trace.reward, abs=1e-12)


def test_a_failed_episode_raises_or_scores_zero(server):
    task = verifiers_v1_task("vf-v1-arith", {"taskset": {"num_tasks": 1}}, sampling={"max_tokens": 4},
                             reward_keys=KEYS)
    row = {**task.rows[0], "task": {**task.rows[0]["task"], "broken": True}}  # its setup raises
    [episode], [recorded] = run_rows(task, server, [row], "fail-")
    assert not episode.ok and recorded == []
    with pytest.raises(VerifiersV1EpisodeError, match=r"'vf-v1-arith': the episode failed: .*the board broke"):
        task.rewards(episode)
    task.on_error = "zero"
    assert task.rewards(episode) == {"exact": 0.0, "brevity": 0.0, "digits": 0.0}
    assert episode.traces[0].reward == 0.0  # verifiers' own total of a failed trace: it was not scored


def test_a_refused_model_call_ends_the_episode_as_verifiers_ends_it(server):
    """More tokens than the tiny model's context: the server refuses the call (400). verifiers' chat harness ends
    its run there, the trace stays ok and is scored on a conversation without a reply, and the server recorded no
    turn: the rewards are verifiers' own all the same."""
    task = verifiers_v1_task("vf-v1-arith", {"taskset": {"num_tasks": 1}}, sampling={"max_tokens": 5000},
                             reward_keys=KEYS)
    [episode], [recorded] = run_rows(task, server, task.rows, "refused-")
    [trace] = episode.traces
    rewards = task.rewards(episode)
    assert episode.ok and recorded == [] and trace.num_turns == 0
    assert "context_length_exceeded" in json.dumps(trace.model_dump(mode="json")["calls"])
    assert rewards == {name: r.score for name, r in trace.rewards.items()} == {"exact": 0.0, "brevity": 1.0,
                                                                              "digits": 0.0}


def test_keyed_rewards_must_be_named(server):
    task = verifiers_v1_task("vf-v1-arith", {"taskset": {"num_tasks": 1}}, sampling={"max_tokens": 4})
    assert task.reward_names == ["exact", "shape"]
    [episode], _ = run_rows(task, server, task.rows, "keys-")
    with pytest.raises(VerifiersV1Error, match=r"recorded rewards \['brevity', 'digits'\].*reward_keys="):
        task.rewards(episode)


def test_errors_name_the_fix(monkeypatch):
    with pytest.raises(VerifiersV1Error, match=r"'no-such-env' is not installed.*no_such_env.*pip install"):
        verifiers_v1_task("no-such-env")
    with pytest.raises(VerifiersV1Error, match=r"'json' is not a verifiers 0\.4 taskset.*verifiers 0\.3"):
        verifiers_v1_task("json")
    with pytest.raises(VerifiersV1Error, match=r"(?s)vf-v1-arith: its config \(args\) does not validate.*"
                                               r"no_such_field"):
        verifiers_v1_task("vf-v1-arith", {"taskset": {"no_such_field": 1}})
    with pytest.raises(VerifiersV1Error, match=r"args name another taskset \('other'\)"):
        verifiers_v1_task("vf-v1-arith", {"taskset": {"id": "other"}})
    with pytest.raises(VerifiersV1Error, match=r"(?s)eval_args do not validate.*split"):
        verifiers_v1_task("vf-v1-arith", eval_args={"split": "test"})
    with pytest.raises(VerifiersV1Error, match=r"max_rows is given twice \(as max_rows= and as args' 'max_rows'\)"):
        verifiers_v1_task("vf-v1-arith", {"max_rows": 2}, max_rows=3)
    task = verifiers_v1_task("vf-v1-arith", reward_keys=KEYS)  # no eval_args: no eval rows
    unused = openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="none")
    with pytest.raises(VerifiersV1Error, match=r"a row of split 'eval', which it has not \(eval rows need eval_args"):
        asyncio.run(task.agent(unused, MODEL, **{**task.rows[0], "split": "eval"}))
    monkeypatch.setattr(verifiers_v1, "verifiers_major_minor", lambda: (0, 3))
    with pytest.raises(VerifiersV1Error, match=r"verifiers 0\.3 is installed.*verifiers>=0\.4,<0\.5.*"
                                               r"grpokit\.tasks\.verifiers"):
        verifiers_v1_task("vf-v1-arith")
    monkeypatch.setattr(verifiers_v1, "verifiers_major_minor", lambda: None)
    with pytest.raises(VerifiersV1Error, match=r"verifiers is not installed: pip install 'grpokit\[verifiers_v1\]'"):
        verifiers_v1_task("vf-v1-arith")
