"""Checkpoints: a run killed with SIGKILL (between steps, while a checkpoint is written, at a random
moment) and resumed ends bit-identical to an uninterrupted one; bad checkpoints are refused by name."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpokit.training.checkpoint import CheckpointError, find_checkpoint, verify
from helpers import make_trainer

TESTS = Path(__file__).parents[1]
STEPS = 8

# One training run in its own process, so that it can be killed. KILL=step:N kills it as step N+1
# starts; KILL=write:N while checkpoint N is being written (model and state on disk, no manifest yet).
SCRIPT = textwrap.dedent(f"""
    import os, signal, sys
    sys.path.insert(0, {str(TESTS)!r})
    import torch
    torch.set_num_threads(1)
    import grpokit.training.checkpoint
    from helpers import TINY
    from grpokit import GRPOConfig, GRPOTrainer
    from grpokit.tasks.tiny_model import build_model, build_tokenizer
    from helpers import ROWS, ones

    out, resume, kill = sys.argv[1], sys.argv[2] or None, os.environ.get("KILL", "")
    tokenizer = build_tokenizer()
    config = GRPOConfig(output_dir=out, prompts_per_step=2, num_generations=4, max_completion_length=8,
                        max_steps={STEPS}, save_every=1, keep_checkpoints=2, learning_rate=1e-2,
                        progress_bar=False, resume=resume, micro_batch_size=5)
    trainer = GRPOTrainer(config, model=build_model(tokenizer, TINY, seed=0), tokenizer=tokenizer,
                            train_dataset=ROWS, reward_funcs=[ones])
    kind, _, at = kill.partition(":")
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    if kind == "step":
        step = trainer.training_step
        trainer.training_step = lambda: (die() if trainer.step == int(at) else None) or step()
    if kind == "write":
        manifest = grpokit.training.checkpoint._write_manifest
        grpokit.training.checkpoint._write_manifest = (
            lambda d: (die() if trainer.step == int(at) else None) or manifest(d))
    print("started", flush=True)
    trainer.train()
""")


def run(tmp_path: Path, out: Path, resume: str = "", kill: str = "", kill_after: float | None = None):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "KILL": kill}
    process = subprocess.Popen([sys.executable, str(script), str(out), resume], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    if kill_after is not None:
        assert process.stdout.readline().strip() == "started"
        time.sleep(kill_after)
        process.send_signal(signal.SIGKILL)
    _, stderr = process.communicate(timeout=300)
    return process.returncode, stderr


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model" / "model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    code, stderr = run(tmp, tmp / "run")
    assert code == 0, stderr
    return tmp / "run"


@pytest.mark.parametrize("kill", ["step:3", "write:5"], ids=["between-steps", "during-checkpoint-write"])
def test_killed_and_resumed_run_is_bit_identical(tmp_path, uninterrupted, kill):
    out = tmp_path / "run"
    code, _ = run(tmp_path, out, kill=kill)
    assert code == -signal.SIGKILL
    # nothing half-written looks complete
    for path in (out / "checkpoints").glob("step-*"):
        verify(path)
    resume = "auto"  # the newest checkpoint, or (killed before the first) the run again from step 0
    code, stderr = run(tmp_path, out, resume=resume)
    assert code == 0, stderr
    expected, got = final_weights(uninterrupted), final_weights(out)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))  # each step once
    reference = [json.loads(line) for line in (uninterrupted / "metrics.jsonl").read_text().splitlines()]
    assert [m["reward"] for m in metrics] == [m["reward"] for m in reference]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step-{STEPS - 1:06d}", f"step-{STEPS:06d}"]


def test_random_kill_points(tmp_path, uninterrupted):
    """Several kills at seeded random moments, each resumed, still end where the uninterrupted run does."""
    out, rng = tmp_path / "run", random.Random(0)
    code = None
    for _ in range(3):
        resume = "auto"  # the newest checkpoint, or (killed before the first) the run again from step 0
        code, stderr = run(tmp_path, out, resume=resume, kill_after=rng.uniform(0.05, 0.6))
        if code == 0:  # the kill came after the run had finished
            break
        assert code == -signal.SIGKILL, stderr
        for path in (out / "checkpoints").glob("step-*"):
            verify(path)  # nothing half-written looks complete
    if code != 0:  # (on a loaded machine every kill may come before the first checkpoint)
        code, stderr = run(tmp_path, out, resume="auto")
        assert code == 0, stderr
    expected, got = final_weights(uninterrupted), final_weights(out)
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_sigterm_writes_a_checkpoint_and_says_how_to_resume(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT.replace("max_steps=8", "max_steps=400"))
    process = subprocess.Popen([sys.executable, str(script), str(tmp_path / "run"), ""], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "started"
    time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert "stopped by SIGTERM after step" in stderr and "--resume latest" in stderr
    path = find_checkpoint(tmp_path / "run", "latest")
    assert json.loads((path / "state.json").read_text())["step"] >= 1
    verify(path)


# ---- bad checkpoints are refused, naming what is wrong ------------------------------------------------


@pytest.fixture
def checkpoint(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, max_steps=2, save_every=1)
    trainer.train()
    return find_checkpoint(tmp_path / "run", "latest")


def fresh_trainer(tokenizer, tmp_path, **overrides):
    from grpokit.tasks.tiny_model import build_model
    from helpers import TINY

    return make_trainer(tokenizer, build_model(tokenizer, TINY, seed=0), tmp_path, **{"max_steps": 2, **overrides})


def test_resume_restores_the_step_and_the_metrics(tokenizer, checkpoint, tmp_path):
    trainer = fresh_trainer(tokenizer, tmp_path)
    trainer.resume(checkpoint)
    assert trainer.step == 2 and [m["step"] for m in trainer.history] == [1, 2]


def test_truncated_file_is_refused(tokenizer, checkpoint, tmp_path):
    weights = checkpoint / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model/model.safetensors has \d+ bytes, the manifest says \d+"):
        fresh_trainer(tokenizer, tmp_path).resume(checkpoint)


def test_corrupted_file_is_refused(tokenizer, checkpoint, tmp_path):
    state = checkpoint / "state.json"
    state.write_text(state.read_text().replace('"step": 2', '"step": 3'))
    with pytest.raises(CheckpointError, match="state.json does not match its SHA-256"):
        fresh_trainer(tokenizer, tmp_path).resume(checkpoint)


def test_missing_file_and_missing_manifest_are_refused(tokenizer, checkpoint, tmp_path):
    (checkpoint / "trainer_state.pt").unlink()
    with pytest.raises(CheckpointError, match="trainer_state.pt is missing"):
        fresh_trainer(tokenizer, tmp_path).resume(checkpoint)
    (checkpoint / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no manifest.json, so it is incomplete"):
        fresh_trainer(tokenizer, tmp_path).resume(checkpoint)


def test_checkpoint_of_another_config_is_refused(tokenizer, checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match=r"different config \(beta: 0.04 in the checkpoint, 0.1 now"):
        fresh_trainer(tokenizer, tmp_path, beta=0.1).resume(checkpoint)


def test_a_checkpoint_from_before_a_key_existed_resumes(tokenizer, checkpoint, tmp_path):
    """A config written by an older grpokit lacks the keys added since (here the dataset_* keys): each counts as its
    default, the behaviour that run had; a value other than the default is still a different config."""
    import hashlib

    state = checkpoint / "state.json"
    saved = json.loads(state.read_text())
    for key in ("dataset_config", "dataset_train_split", "dataset_test_split", "dataset_columns"):
        del saved["config"][key]
    state.write_text(json.dumps(saved))
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"]["state.json"] = {"bytes": state.stat().st_size,
                                       "sha256": hashlib.sha256(state.read_bytes()).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    trainer = fresh_trainer(tokenizer, tmp_path)
    trainer.resume(checkpoint)
    assert trainer.step == 2
    with pytest.raises(CheckpointError, match=r"dataset_train_split: 'train' in the checkpoint, 'all' now"):
        fresh_trainer(tokenizer, tmp_path, dataset_train_split="all").resume(checkpoint)


def test_checkpoint_of_another_model_is_refused(tokenizer, checkpoint, tmp_path):
    from grpokit.tasks.tiny_model import TinyModelSpec, build_model

    other = build_model(tokenizer, TinyModelSpec(hidden_size=48, num_layers=2, num_heads=2, intermediate_size=64,
                                                 max_positions=64))
    trainer = make_trainer(tokenizer, other, tmp_path, max_steps=2)
    with pytest.raises(CheckpointError, match=r"has shape \(103, 32\) in the checkpoint but \(103, 48\) in the model"):
        trainer.resume(checkpoint)


def test_a_pickled_object_is_never_executed(tokenizer, checkpoint, tmp_path):
    """A trainer_state.pt that would run code when unpickled is refused (weights_only=True)."""
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"optimizer": Exploit()}, checkpoint / "trainer_state.pt")
    from grpokit.training.checkpoint import _write_manifest

    _write_manifest(checkpoint)  # a consistent manifest: only the unpickler stands in the way
    with pytest.raises(CheckpointError, match="trainer_state.pt cannot be read safely"):
        fresh_trainer(tokenizer, tmp_path).resume(checkpoint)
    assert not marker.exists()


def test_latest_without_checkpoints_is_a_clear_error(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, resume="latest")
    with pytest.raises(CheckpointError, match="latest: no complete checkpoint under"):
        trainer.train()


def test_auto_resumes_the_newest_checkpoint_or_starts(tokenizer, checkpoint, tmp_path, capsys):
    """resume: auto (for torchrun --max-restarts): the newest complete checkpoint where there is one, a half-written
    one (no manifest) skipped; step 0 where there is none."""
    (checkpoint.parent / "step-000003").mkdir()  # interrupted before its manifest
    trainer = fresh_trainer(tokenizer, tmp_path)
    assert trainer.resume("auto") == checkpoint and trainer.step == 2
    empty = fresh_trainer(tokenizer, tmp_path / "empty")
    assert empty.resume("auto") is None and empty.step == 0
    assert "resume: auto: no checkpoint under" in capsys.readouterr().err


def test_a_restart_without_resume_says_how_to_continue(tokenizer, tiny_model, tmp_path, monkeypatch, capsys):
    """Restarted by torchrun (TORCHELASTIC_RESTART_COUNT > 0) with no resume set: the run starts at step 0, not from
    whatever checkpoints output_dir holds, and says how to continue instead."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    make_trainer(tokenizer, tiny_model, tmp_path, max_steps=1).train()
    assert "launch with --resume auto to continue from the newest checkpoint" in capsys.readouterr().err


def test_resume_continues_with_a_larger_max_steps(tokenizer, checkpoint, tmp_path):
    trainer = fresh_trainer(tokenizer, tmp_path, max_steps=4, resume="latest")
    history = trainer.train()
    assert [m["step"] for m in history] == [1, 2, 3, 4]


def test_ppo_checkpoint_holds_the_value_model(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, algorithm="ppo", max_steps=2, save_every=1)
    trainer.train()
    path = find_checkpoint(tmp_path / "run", "latest")
    assert (path / "value_model.safetensors").is_file()
    fresh = fresh_trainer(tokenizer, tmp_path, algorithm="ppo")
    fresh.resume(path)
    for a, b in zip(trainer.critic.value_model.parameters(), fresh.critic.value_model.parameters()):
        assert torch.equal(a, b)
    optimizers = [t.critic.learner.optimizer.state_dict()["state"].keys() for t in (fresh, trainer)]
    assert optimizers[0] == optimizers[1] and optimizers[0]


def test_pruning_renames_before_deleting(tmp_path, monkeypatch):
    """A crash in the middle of deleting an old checkpoint leaves no step-* directory with files missing: it is
    renamed to .tmp-* first, and the next save's pruning removes that."""
    from grpokit.training import checkpoint

    for step in (1, 2, 3):
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / "manifest.json").write_text("{}")
    real_rmtree = checkpoint.shutil.rmtree

    def crash(path, **kwargs):
        raise KeyboardInterrupt  # the process dies mid-delete

    monkeypatch.setattr(checkpoint.shutil, "rmtree", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint._prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-delete-step-1", "step-2", "step-3"]
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real_rmtree)
    checkpoint._prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-3"]
