"""Iterative RL (grpokit.algorithms.iterative): the reward model retrained between iterations on the policy's samples
with replay, the reference reset to the policy (KL exactly 0 at each iteration's first step), bit-exact resume."""

import json
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

from grpokit import GRPOConfig, GRPOTrainer, OutcomeRewardModel
from grpokit.config import ConfigError
from grpokit.tasks.tiny_model import build_model, build_tokenizer
from helpers import TINY, save_classifier

ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(16)]


@pytest.fixture(scope="module")
def reward_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("iterative")
    tokenizer = build_tokenizer()
    first = [{"prompt": row["prompt"], "response": f"{j}", "score": float(j % 2)} for row in ROWS for j in range(2)]
    (root / "first.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first))
    # The user's own column names: the replayed rows are renamed to grpokit sample's.
    (root / "reward.yaml").write_text(yaml.safe_dump({
        "dataset": str(root / "first.jsonl"), "completion_column": "response", "label_column": "score",
        "learning_rate": 1e-3, "max_steps": 2, "batch_size": 8, "eval_fraction": 0.25}))
    return {"orm": save_classifier(root / "orm", tokenizer), "config": root / "reward.yaml",
            "prm": save_classifier(root / "prm", tokenizer, head="token")}


def config_for(dirs, output_dir, **overrides):
    values = dict(output_dir=str(output_dir), reward_funcs=[f"model:{dirs['orm']}"], rl_iterations=3, max_steps=6,
                  reward_model_labels=["accuracy", "format"], reward_model_prompts=4,
                  reward_model_config=str(dirs["config"]), prompts_per_step=2, num_generations=4,
                  max_completion_length=8, learning_rate=1e-2, progress_bar=False, mixed_precision="no",
                  device="cpu", save_every=2, keep_checkpoints=5)
    return GRPOConfig(**{**values, **overrides})


def trainer_for(config, rows=ROWS):
    tokenizer = build_tokenizer()
    return GRPOTrainer(config, model=build_model(tokenizer, TINY, seed=0), tokenizer=tokenizer, train_dataset=rows)


def untimed(history):
    return [{k: v for k, v in m.items() if not k.startswith("time_") and k != "tokens_per_sec"} for m in history]


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_iteration_retrains_the_reward_model_and_resets_the_reference(reward_dirs, tmp_path):
    trainer = trainer_for(config_for(reward_dirs, tmp_path / "run"))
    start = {k: v.clone() for k, v in trainer.iterations.reward_model.model.state_dict().items()}
    kls, weights = [], []
    for step in range(1, 7):
        kls.append(trainer.training_step()["kl"])
        assert trainer.history[-1]["rl_iteration"] == (step - 1) // 2 + 1
        reward_weights = trainer.iterations.reward_model.model.state_dict()
        weights.append({k: v.clone() for k, v in reward_weights.items()})
        if step in (2, 4):  # the iteration ended: π_ref is now the policy, weight for weight
            policy = trainer.model.state_dict()
            for name, tensor in trainer.reference.model.state_dict().items():
                assert torch.equal(tensor, policy[name]), name
    # KL exactly 0 at each iteration's first step (π_θ = π_ref), not after it.
    assert [kl == 0.0 for kl in kls] == [True, False, True, False, True, False]
    changed = [any(not torch.equal(w[k], start[k]) for k in start) for w in weights]
    assert changed == [False, True, True, True, True, True]
    assert any(not torch.equal(weights[3][k], weights[1][k]) for k in start)  # retrained again after step 4

    root = tmp_path / "run" / "reward_model"
    log = lines(root / "iterations.jsonl")
    first_rows = 32
    assert [(e["iteration"], e["step"], e["new_rows"]) for e in log] == [(1, 2, 4 * 4), (2, 4, 4 * 4)]
    # Replay: 10 % of the older rows (the first data, then also iteration 1's samples).
    assert [e["replayed_rows"] for e in log] == [round(0.1 * first_rows), round(0.1 * (first_rows + 16))]
    samples = lines(root / "iteration-1" / "samples.jsonl")
    assert len(samples) == 16 and all({"prompt", "completion", "label"} <= set(s) for s in samples)
    assert all(s["label"] == s["rewards"]["accuracy_reward"] + s["rewards"]["format_reward"] for s in samples)
    assert not (root / "iteration-1" / "checkpoints").exists()
    # The reward model saved by iteration 1 is the one in use from step 3 on, and loads with plain transformers.
    saved = load_file(str(root / "iteration-1" / "model" / "model.safetensors"))
    assert all(torch.equal(saved[k], weights[2][k]) for k in saved)


def test_the_rewards_after_an_iteration_are_the_new_reward_models(reward_dirs, tmp_path):
    trainer = trainer_for(config_for(reward_dirs, tmp_path / "run", log_completions=8))
    trainer.train()
    records = [r for r in lines(tmp_path / "run" / "completions.jsonl") if r["step"] == 3]
    retrained = OutcomeRewardModel(tmp_path / "run" / "reward_model" / "iteration-1" / "model")
    expected = retrained(prompts=[r["prompt"] for r in records], completions=[r["completion"] for r in records])
    assert [r["reward"] for r in records] == pytest.approx(expected, abs=1e-4)
    original = OutcomeRewardModel(reward_dirs["orm"])(prompts=[r["prompt"] for r in records],
                                                       completions=[r["completion"] for r in records])
    assert [r["reward"] for r in records] != pytest.approx(original, abs=1e-4)


def test_a_resumed_iterative_run_is_bit_exact(reward_dirs, tmp_path):
    whole = trainer_for(config_for(reward_dirs, tmp_path / "whole"))
    whole.train()
    # A run that stopped after step 3 (its checkpoint at step 2 was written after iteration 1's end).
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "step-000002", resumed_dir / "checkpoints" / "step-000002")
    shutil.copytree(tmp_path / "whole" / "reward_model" / "iteration-1", resumed_dir / "reward_model" / "iteration-1")
    shutil.copy(tmp_path / "whole" / "run.json", resumed_dir)  # the run's id: resume reads only that run's checkpoints
    resumed = trainer_for(config_for(reward_dirs, resumed_dir, resume="latest"))
    resumed.train()
    assert untimed(resumed.history) == untimed(whole.history)
    for a, b in ((whole.model, resumed.model), (whole.reference.model, resumed.reference.model),
                 (whole.iterations.reward_model.model, resumed.iterations.reward_model.model)):
        for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(x, y), name
    assert lines(resumed_dir / "reward_model" / "iterations.jsonl")[0]["iteration"] == 2


def test_a_process_reward_model_retrains_on_step_labels(reward_dirs, tmp_path):
    rows = [{"prompt": "12+34=", "answer": "46"}] * 8
    config = config_for(reward_dirs, tmp_path / "run", reward_funcs=[f"process_model:{reward_dirs['prm']}"],
                        supervision="process", rl_iterations=2, max_steps=2, reward_model_config=None,
                        reward_model_labels=["arithmetic_steps", "format"])
    trainer = trainer_for(config, rows)
    trainer.train()
    samples = lines(tmp_path / "run" / "reward_model" / "iteration-1" / "samples.jsonl")
    assert samples and all(s["steps"] for s in samples)
    assert lines(tmp_path / "run" / "reward_model" / "iterations.jsonl")[0]["replayed_rows"] == 0


def test_ppo_runs_iterations_too(reward_dirs, tmp_path):
    """PPO's per-token KL penalty reads the same reference: reset at the iteration's end, 0 on the next step."""
    trainer = trainer_for(config_for(reward_dirs, tmp_path / "run", algorithm="ppo", rl_iterations=2, max_steps=4))
    history = trainer.train()
    assert [m["kl"] == 0.0 for m in history] == [True, False, True, False]
    assert len(lines(tmp_path / "run" / "reward_model" / "iterations.jsonl")) == 1


@pytest.mark.parametrize("overrides, message", [
    (dict(rl_iterations=4), "max_steps=6 does not divide into rl_iterations=4"),
    (dict(steps_per_iteration=3), "rl_iterations × steps_per_iteration = 3 × 3 = 9; set max_steps: 9"),
    (dict(rl_iterations=1, steps_per_iteration=3), "steps_per_iteration is set but rl_iterations is 1"),
    (dict(reward_model_labels=[]), "needs reward_model_labels"),
    (dict(reward_model_label_weights=[1.0]), "reward_model_label_weights has 1 values"),
    (dict(lora_rank=4), "with lora_rank"),
    (dict(parallelism="fsdp"), "with parallelism: fsdp"),
])
def test_bad_iteration_settings_name_the_key(reward_dirs, tmp_path, overrides, message):
    with pytest.raises(ConfigError) as error:
        config_for(reward_dirs, tmp_path, **overrides)
    assert message in str(error.value)


@pytest.mark.parametrize("overrides, message", [
    (dict(reward_funcs=["accuracy"]), "exactly one ('model:DIR' or 'process_model:DIR'); found 0"),
    (dict(reward_model_labels=["accuracy", "{orm}"]), "reward_model_labels: the labels must come from rule rewards"),
    (dict(reward_funcs=["process_model:{prm}"], supervision="process"),
     "its rows are of the form 'labelled', but the reward model in reward_funcs is a process model"),
    (dict(reward_model_config="{config}.missing"), "does not exist"),
])
def test_bad_iteration_setups_fail_before_training(reward_dirs, tmp_path, overrides, message):
    paths = {"orm": reward_dirs["orm"], "prm": reward_dirs["prm"], "config": reward_dirs["config"]}
    overrides = {k: [x.format(**paths) for x in v] if isinstance(v, list) else v.format(**paths)
                 if isinstance(v, str) else v for k, v in overrides.items()}
    with pytest.raises(ValueError) as error:
        trainer_for(config_for(reward_dirs, tmp_path / "run", **overrides))
    assert message in str(error.value)
    assert not (tmp_path / "run").exists()


def test_a_label_the_rows_cannot_feed_fails_at_start_up(reward_dirs, tmp_path):
    """The labelling rewards first run after an iteration's steps: their signatures are checked before any."""
    (tmp_path / "labels.py").write_text("def by_level(completions, level, **kwargs):\n"
                                        "    return [0.0] * len(completions)\n")
    config = config_for(reward_dirs, tmp_path / "run", reward_model_labels=[f"{tmp_path}/labels.py:by_level"])
    with pytest.raises(ValueError, match=r"by_level.*'level'"):
        trainer_for(config)
    assert not (tmp_path / "run").exists()


def test_with_tools_the_reward_models_rows_are_sampled_with_them(reward_dirs, tmp_path, monkeypatch):
    """The reward model retrains on trajectories like those it scores in training: tool results included."""
    import grpokit.algorithms.iterative
    from helpers import TOOL_SPEC as SPEC

    boxes, real = [], grpokit.algorithms.iterative.sample_rows
    monkeypatch.setattr(grpokit.algorithms.iterative, "sample_rows", lambda *a, toolbox=None, **k: boxes.append(toolbox)
                        or real(*a, toolbox=toolbox, **k))
    tokenizer = build_tokenizer(tool_tags=True)
    config = config_for(reward_dirs, tmp_path / "run", rl_iterations=2, max_steps=2, tools=["calculator"],
                        max_completion_length=40)
    trainer = GRPOTrainer(config, model=build_model(tokenizer, SPEC, seed=0), tokenizer=tokenizer, train_dataset=ROWS)
    trainer.train()
    assert boxes == [trainer.sampler.toolbox]
    samples = lines(tmp_path / "run" / "reward_model" / "iteration-1" / "samples.jsonl")
    assert samples and all("tool_calls" in r for r in samples) and any(r["tool_calls"] for r in samples)
