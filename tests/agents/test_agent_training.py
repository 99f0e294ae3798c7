"""Agents as the rollout: an agent written with the openai SDK drives its own episodes against the served policy,
and the trainer trains exactly the tokens the server recorded, with the reward the agent returned."""

import json

import pytest
import torch

from grpokit.agents.calling import AgentError
from grpokit.config import ConfigError
from grpokit.rollout.served_samples import MERGED, episode_samples
from helpers import documented_metrics, logged_keys

ROWS = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 6), (7, 1)]]


async def two_turns(client, model, question, answer):
    """Asks, then asks again after its own reply with a user message between: two requests, context between."""
    messages = [{"role": "user", "content": question}]
    first = await client.chat.completions.create(model=model, messages=messages, max_tokens=4)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Are you sure?"}]
    second = await client.chat.completions.create(model=model, messages=messages, max_tokens=4)
    return {"right": float(answer in second.choices[0].message.content),
            "short": len(first.choices[0].message.content) / 10}


async def completions(client, model, question, **row):
    """Plain /v1/completions, prompt by prompt: each prompt extends the last one and its tokens."""
    text = question
    for _ in range(2):
        out = await client.completions.create(model=model, prompt=text, max_tokens=3)
        text += out.choices[0].text + " Next:"
    return len(text) / 100


def test_an_agents_episodes_train_the_tokens_sampled_with_its_rewards(agent_trainer):
    trainer = agent_trainer(completions, ROWS)
    [metrics] = trainer.train()
    episodes = trainer.sampler.episodes
    assert len(episodes) == 2 * 4 and all(len(e.turns) == 2 for e in episodes)
    assert metrics["agent_episodes"] == 8 and metrics["agent_turns"] == 16
    assert metrics["rewards/completions"] == pytest.approx(sum(e.rewards["completions"] for e in episodes) / 8)
    assert metrics["reward"] == pytest.approx(metrics["rewards/completions"])
    # the served tokens' log-probs against the policy's own: the same model, float32, so all but equal
    assert 0 <= metrics["sampler_kl"] < 1e-5 and metrics["is_capped_frac"] == 0
    records = [json.loads(line) for line in open(f"{trainer.config.output_dir}/completions.jsonl")]
    assert len(records) == 4 and {r["episode"] for r in records} <= {e.id for e in episodes}  # log_completions: 4
    assert all(len(r["turns"]) == 2 for r in records)
    documented, _ = documented_metrics(lowered=True, agents=True)
    assert logged_keys(metrics) <= documented, logged_keys(metrics) - documented


def test_tokens_trained_are_the_tokens_sampled_byte_for_byte(agent_trainer, monkeypatch):
    import grpokit.algorithms.grpo as grpo

    trained = []
    real = grpo.update
    monkeypatch.setattr(grpo, "update",
                        lambda learners, fixed, **kw: trained.append(fixed) or real(learners, fixed, **kw))
    trainer = agent_trainer(completions, ROWS)
    trainer.train()
    [fixed] = trained
    rollout, row = fixed.rollout, 0
    modes = set()
    for episode in trainer.sampler.episodes:
        mode = episode_samples(episode.turns)[1]
        modes.add(mode)
        if mode == MERGED:  # the first prompt as sent, every sampled token, what came between them masked
            first = episode.turns[0].prompt_ids
            assert rollout.prompt_ids[row][rollout.prompt_mask[row].bool()].tolist() == first
            assert trained_tokens(fixed, row) == [t for turn in episode.turns for t in turn.completion_ids]
            assert rollout.logp[row][fixed.loss_mask[row].bool()].tolist() == [v for t in episode.turns for v in t.logp]
            between = episode.turns[1].prompt_ids[len(first) + len(episode.turns[0].completion_ids):]
            assert rollout.completion_ids[row][rollout.tool_mask[row].bool()].tolist() == between
            row += 1
            continue
        for turn in episode.turns:  # each request its own sample: its prompt, its sampled tokens
            assert rollout.prompt_ids[row][rollout.prompt_mask[row].bool()].tolist() == turn.prompt_ids
            assert trained_tokens(fixed, row) == turn.completion_ids
            assert rollout.logp[row][fixed.loss_mask[row].bool()].tolist() == turn.logp
            row += 1
    assert row == len(rollout) and MERGED in modes
    # every sample of an episode carries the episode's one advantage on each of its tokens
    assert all((fixed.advantages[r][fixed.loss_mask[r].bool()] == fixed.advantages[r, 0]).all() for r in range(row))


def trained_tokens(fixed, row):
    return fixed.rollout.completion_ids[row][fixed.loss_mask[row].bool()].tolist()


def test_a_chat_agent_with_named_rewards_and_reward_funcs_on_its_transcript(agent_trainer):
    seen = []

    def says_something(prompts, completions, **kw):
        seen.append((prompts, completions))
        return [float(bool(c[-1]["content"])) for c in completions]

    trainer = agent_trainer(two_turns, ROWS, reward_funcs=[says_something], reward_weights=[1.0, 0.5, 2.0])
    [metrics] = trainer.train()
    for name in ("right", "short", "says_something"):
        assert metrics[f"rewards/{name}"] is not None
    episodes = trainer.sampler.episodes
    expected = [e.rewards["right"] + 0.5 * e.rewards["short"] for e in episodes]
    prompts, transcripts = seen[0]
    assert [p[0]["content"] for p in prompts] == [ROWS[0]["question"]] * 4 + [ROWS[1]["question"]] * 4 or \
        len(prompts) == 8
    assert [m["role"] for m in transcripts[0]] == ["assistant", "user", "assistant"]
    scores = [1.0 if t[-1]["content"] else 0.0 for t in transcripts]
    assert metrics["reward"] == pytest.approx(sum(e + 2 * s for e, s in zip(expected, scores)) / 8, rel=1e-5)


def test_an_agent_that_raises_is_named_with_its_row_and_episode(agent_trainer):
    async def broken(client, model, question, answer):
        raise KeyError("no tool")

    with pytest.raises(AgentError, match=r"agent 'broken' raised KeyError: 'no tool' \(row \d of train_dataset, "
                                         r"episode \w+-\d-\d\)"):
        agent_trainer(broken, ROWS).train()


def test_an_agent_past_its_timeout_or_returning_the_wrong_type_is_named(agent_trainer):
    import asyncio

    async def slow(client, model, **row):
        await asyncio.sleep(30)

    with pytest.raises(AgentError, match=r"agent 'slow' did not finish within agent_timeout=0.2 s \(row"):
        agent_trainer(slow, ROWS, agent_timeout=0.2).train()

    async def wordy(client, model, **row):
        await client.completions.create(model=model, prompt="Hi", max_tokens=2)
        return "good"

    with pytest.raises(AgentError, match=r"agent 'wordy' returned str 'good' \(row \d of train_dataset, episode"):
        agent_trainer(wordy, ROWS).train()


def test_an_agent_that_never_calls_the_model_is_told_so(agent_trainer):
    async def idle(client, model, **row):
        return 1.0

    with pytest.raises(AgentError, match="made no request to the policy"):
        agent_trainer(idle, ROWS).train()


def test_a_plain_def_agent_gets_a_sync_client(agent_trainer):
    def sync_agent(client, model, question, **row):
        out = client.completions.create(model=model, prompt=question, max_tokens=2)
        return float(len(out.choices[0].text) > 0)

    [metrics] = agent_trainer(sync_agent, ROWS).train()
    assert metrics["agent_episodes"] == 8


def test_settings_an_agent_cannot_run_with_are_refused(agent_trainer):
    with pytest.raises(ConfigError, match="algorithm: ppo with an agent"):
        agent_trainer(completions, ROWS, algorithm="ppo")
    with pytest.raises(ConfigError, match="agent 'needs' takes 'missing'"):
        async def needs(client, model, missing):
            return 0.0
        agent_trainer(needs, ROWS)
    with pytest.raises(ConfigError, match="reward_weights has 3 values"):
        agent_trainer(completions, ROWS, reward_weights=[1.0, 2.0, 3.0]).train()


def test_dynamic_sampling_keeps_whole_episodes(agent_trainer):
    rewards = iter(range(1000))

    async def varied(client, model, question, **row):
        await client.completions.create(model=model, prompt=question, max_tokens=2)
        value = next(rewards)
        return float(value % 3 == 0) if "1 + 2" in question else 0.0  # only the first row's group has signal

    trainer = agent_trainer(varied, ROWS, dynamic_sampling=True, max_sampling_rounds=2)
    [metrics] = trainer.train()
    assert metrics["sampling_rounds"] >= 1
    assert torch.isfinite(torch.tensor(metrics["loss"]))


def test_requests_are_sampled_at_the_runs_temperature_and_what_was_asked_is_said(agent_trainer, capsys):
    async def picky(client, model, question, **row):
        await client.completions.create(model=model, prompt=question, max_tokens=2, temperature=0.2)
        return 0.0

    agent_trainer(picky, ROWS, temperature=0.9).train()
    assert "asked for other sampling settings (temperature=0.2); training samples every request at the run's " \
           "temperature=0.9" in capsys.readouterr().err
    agent_trainer(completions, ROWS, temperature=0.9).train()  # asks for nothing: nothing to say
    assert "asked for other sampling settings" not in capsys.readouterr().err
