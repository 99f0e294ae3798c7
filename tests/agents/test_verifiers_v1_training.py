"""A verifiers 0.4 environment trains (``environment: verifiers:NAME`` with verifiers 0.4 installed: its episodes run
as an agent against the served policy), and the rewards it logs are verifiers' own for the same traces. Run in
verifiers 0.4's own environment: bash scripts/test_verifiers_v1.sh (marked ``verifiers_v1``)."""

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.verifiers_v1
pytest.importorskip("verifiers.v1", reason="verifiers 0.4 is not installed: bash scripts/test_verifiers_v1.sh")
pytest.importorskip("openai")
pytest.importorskip("fastapi")

import torch  # noqa: E402

import grpokit.agents.verifiers_v1 as verifiers_v1  # noqa: E402
from grpokit import GRPOConfig, GRPOTrainer  # noqa: E402
from grpokit.tasks.tiny_model import build_model  # noqa: E402
from helpers import HERMES, TEMPLATE_SPEC, tokenizer_with  # noqa: E402

ENVS = str(Path(__file__).parent / "vf_v1_env")


@pytest.fixture(autouse=True)
def envs():
    sys.path.insert(0, ENVS)
    yield
    sys.path.remove(ENVS)


def test_a_verifiers_environment_trains_with_verifiers_own_rewards(tmp_path, monkeypatch):
    seen = []  # every episode verifiers returned, with the rewards the agent gave for it
    real = verifiers_v1.VerifiersV1Task.agent

    async def spied(self, *args, **kwargs):
        self.on_episode = lambda episode, rewards: seen.append((episode, rewards))
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(verifiers_v1.VerifiersV1Task, "agent", spied)
    torch.set_num_threads(2)
    tok = tokenizer_with(HERMES)
    config = GRPOConfig(environment="verifiers:vf-v1-arith",
                        environment_args={"taskset": {"num_tasks": 4}, "reward_keys": {"shape": ["brevity", "digits"]}},
                        output_dir=str(tmp_path / "run"), prompts_per_step=2, num_generations=4,
                        max_completion_length=8, max_steps=2, micro_batch_size=8, learning_rate=1e-2,
                        progress_bar=False, mixed_precision="no", log_completions=8)
    trainer = GRPOTrainer(config, model=build_model(tok, TEMPLATE_SPEC, seed=0), tokenizer=tok)
    history = trainer.train()
    assert len(history) == 2 and len(seen) == 16
    steps = [seen[:8], seen[8:]]
    weights = {"exact": 1.0, "brevity": 0.5, "digits": 0.5}  # verifiers' weights, as the environment gives them
    for metrics, episodes in zip(history, steps):
        [trace] = episodes[0][0].traces
        for name in weights:  # the logged mean of each reward: verifiers' Trace.rewards' scores
            own = [episode.traces[0].rewards[name].score for episode, _ in episodes]
            assert metrics[f"rewards/{name}"] == pytest.approx(sum(own) / len(own), abs=1e-6)
        # the total reward: verifiers' own weighted Trace.reward
        assert metrics["reward"] == pytest.approx(sum(e.traces[0].reward for e, _ in episodes) / 8, abs=1e-6)
        assert metrics["agent_episodes"] == 8 and metrics["agent_turns"] == 8
    records = [json.loads(line) for line in open(tmp_path / "run" / "completions.jsonl")]
    by_reply = {}
    for episode, _ in seen:
        by_reply.setdefault(episode.traces[0].last_reply.strip(), set()).add(round(episode.traces[0].reward, 6))
    for record in records:  # each record's reward is verifiers' for an episode that replied so
        assert round(record["reward"], 6) in by_reply[record["messages"][-1]["content"].strip()]
