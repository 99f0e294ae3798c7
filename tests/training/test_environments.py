"""A run with an environment: resets' observations start the prompts, replies come between turns (masked from the
loss), and an environment that fails stops the run naming it, with the steps done kept and the failed step redone on
resume exactly as an uninterrupted run does it."""

import json
from pathlib import Path

import pytest

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.rollout.episodes import EnvironmentFailure
from grpokit.tasks.tiny_model import build_model, build_tokenizer
from helpers import TOOL_ROWS, TOOL_SPEC, approx_scores


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(tool_tags=True)


class Talk:
    """Shows a board at reset; replies to each turn until the third; scores the turns played. ``fail_at``: the
    reset (counted over the class) that raises."""

    resets, fail_at = 0, None

    def reset(self, answer, **row):
        type(self).resets += 1
        if type(self).resets == type(self).fail_at:
            raise ConnectionError("the environment server went away")
        self.answer, self.turns, self.last = answer, [], "not told"
        return f"board {answer}"

    def reply(self, turn: str) -> str | None:
        self.turns.append(turn)
        return None if len(self.turns) >= 3 else f"again ({len(self.turns)})"

    def end(self, turn):
        self.last = turn

    def get_reward(self) -> float:
        return float(len(self.turns))


def trainer(tok, out, **overrides):
    config = GRPOConfig(**{**dict(output_dir=str(out), prompts_per_step=4, num_generations=4, max_completion_length=40,
                                  max_steps=2, progress_bar=False, learning_rate=1e-3, temperature=1.5,
                                  reward_funcs=["format"], log_completions=16), **overrides})
    return GRPOTrainer(config, model=build_model(tok, TOOL_SPEC, seed=0), tokenizer=tok, train_dataset=TOOL_ROWS,
                       environment_factory=Talk)


def test_a_multi_turn_environment_trains(tok, tmp_path, monkeypatch):
    monkeypatch.setattr(Talk, "resets", 0)
    history = trainer(tok, tmp_path).train()
    assert sum(m.get("env_replies", 0) for m in history) > 0  # the random model ends turns now and then
    assert all("rewards/Talk" in m for m in history)
    records = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert any("again (1)" in r["completion"] for r in records)  # replies are part of the trajectory
    box = trainer(tok, tmp_path / "b").sampler.toolbox
    session = box.session(TOOL_ROWS[:1], 2, 10)
    assert session.prompts == [f"{TOOL_ROWS[0]['prompt']}\n\nboard {TOOL_ROWS[0]['answer']}"] * 2


def test_a_failing_environment_is_named_and_the_resumed_run_matches_an_uninterrupted_one(tok, tmp_path,
                                                                                          monkeypatch):
    monkeypatch.setattr(Talk, "resets", 0)
    whole = trainer(tok, tmp_path / "whole", max_steps=3).train()
    monkeypatch.setattr(Talk, "resets", 0)
    monkeypatch.setattr(Talk, "fail_at", 16 * 2 + 5)  # during step 3's resets
    with pytest.raises(EnvironmentFailure, match=r"Talk.reset raised ConnectionError: the environment server went "
                                                 r"away \(completion 4\); checkpoint .*step-000002 \(step 2\)"):
        trainer(tok, tmp_path / "cut", max_steps=3).train()
    monkeypatch.setattr(Talk, "fail_at", None)
    resumed = trainer(tok, tmp_path / "cut", max_steps=3, resume="latest").train()
    drop = ("time", "memory", "tokens_per_sec", "wait_steps")  # wait_steps: how long calls took
    keep = lambda m: {k: v for k, v in m.items() if not k.startswith(drop)}  # noqa: E731
    assert [keep(m) for m in resumed] == approx_scores([keep(m) for m in whole])


def test_every_openenv_environment_arg_is_documented():
    """docs/environments.md's table lists each key of the OpenEnv adapter's environment_args, with its default."""
    from grpokit.tasks.openenv import OPTIONS
    page = (Path(__file__).parents[2] / "docs" / "environments.md").read_text()
    rows = {line.split("|")[1].strip(" `"): line.split("|")[2].strip(" `") for line in page.splitlines()
            if line.startswith("| `")}
    def shown(value):  # as YAML writes it
        return "null" if value is None else str(value).lower() if isinstance(value, bool) else json.dumps(value) \
            if isinstance(value, (str, dict)) else str(value)

    assert {key: rows.get(key) for key in OPTIONS} == {key: shown(value) for key, value in OPTIONS.items()}
