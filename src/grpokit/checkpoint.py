"""Checkpoints that survive a crash and resume bit-exact.

A checkpoint is a directory ``output_dir/checkpoints/step-NNNNNN/`` holding:

- ``model/``: the policy and tokenizer, ``save_pretrained`` (safetensors): loadable by plain transformers;
- ``value_model.safetensors`` (PPO): the value model;
- ``trainer_state.pt``: optimizer and scheduler state dicts and each process's torch RNG states —
  tensors and plain containers only, read back with ``torch.load(weights_only=True)``;
- ``state.json``: step, data position, each process's Python and NumPy RNG states, the config and
  every metric so far;
- ``manifest.json``, written last: the size and SHA-256 of every other file.

It is written into a temporary directory beside its final place and renamed into place, so a crash
mid-write never leaves a directory that looks complete; a directory without a manifest, or whose
files do not match it, is refused. The last ``keep_checkpoints`` are kept. Nothing is unpickled
beyond what ``weights_only=True`` allows.

The reference model is not saved: it is the starting policy, rebuilt from ``config.model`` on resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import threading
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_model

from grpokit.distributed import barrier, gather, is_sharded

FORMAT = 1
# Keys that may change between a checkpoint and the run that resumes it: they do not change the math.
RESUMABLE_CHANGES = {
    "max_steps", "output_dir", "progress_bar", "log_completions", "save_every", "keep_checkpoints", "resume",
    "device", "micro_batch_size", "reward_timeout", "on_reward_error", "max_nonfinite_updates",
}


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupted, or from a different run; the message says which."""


class StopSignals:
    """While active, SIGINT/SIGTERM are recorded in ``received`` (the training loop then finishes its
    step, writes a checkpoint and stops); a second one stops at once. Signals reach the main thread
    only, so elsewhere this does nothing."""

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def save_checkpoint(trainer: Any) -> Path:
    """Write the trainer's state as ``checkpoints/step-NNNNNN`` (atomically) and prune old ones. With
    several processes every one calls this (each one's RNG states are saved) and the first writes."""
    world = trainer.world
    root = checkpoints_dir(trainer.config.output_dir)
    final = root / f"step-{trainer.step:06d}"
    if is_sharded(trainer.model):
        if world.main and not getattr(trainer, "_warned_fsdp", False):
            warnings.warn("parallelism: fsdp writes no checkpoints yet (the final model is saved); see "
                          "docs/distributed.md", stacklevel=2)
        trainer._warned_fsdp = True
        return final
    rng = gather({"torch": _torch_rng_states(trainer), "python": _jsonable(random.getstate()),
                  "numpy": _jsonable(np.random.get_state())}, world)
    if world.main:
        _write(trainer, root, final, rng)
    barrier(world)
    return final


def _write(trainer: Any, root: Path, final: Path, rng: list[dict[str, Any]]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".tmp-{final.name}-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()

    trainer.model.save_pretrained(staging / "model", safe_serialization=True)
    trainer.tokenizer.save_pretrained(staging / "model")
    for name, module in trainer.checkpointed_modules().items():
        save_model(module, str(staging / f"{name}.safetensors"))
    torch.save(
        {
            **{name: obj.state_dict() for name, obj in trainer.checkpointed_state().items()},
            "rng": [per_rank["torch"] for per_rank in rng],
        },
        staging / "trainer_state.pt",
    )
    state = {
        "format": FORMAT,
        "step": trainer.step,
        "data": {"order": trainer.sampler.order, "epoch": trainer.sampler.epoch},
        "world_size": len(rng),
        "python_rng": [per_rank["python"] for per_rank in rng],
        "numpy_rng": [per_rank["numpy"] for per_rank in rng],
        "nonfinite_streak": trainer.nonfinite_streak,
        "config": trainer.config.to_dict(),
        "history": trainer.history,
    }
    (staging / "state.json").write_text(json.dumps(state))
    _write_manifest(staging)

    if final.exists():  # a checkpoint of this step from an earlier, interrupted attempt
        shutil.rmtree(final)
    os.replace(staging, final)
    _prune(root, trainer.config.keep_checkpoints)


def _write_manifest(directory: Path) -> None:
    files = {str(p.relative_to(directory)): _digest(p) for p in sorted(directory.rglob("*"))
             if p.is_file() and p.name != "manifest.json"}
    (directory / "manifest.json").write_text(json.dumps({"format": FORMAT, "files": files}, indent=1))


def _digest(path: Path) -> dict[str, Any]:
    sha = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            sha.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": sha.hexdigest()}


def _prune(root: Path, keep: int) -> None:
    complete = sorted(p for p in root.glob("step-*") if (p / "manifest.json").is_file())
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-*"):  # left by a crash mid-write (ours was just renamed into place)
        shutil.rmtree(stale, ignore_errors=True)


def find_checkpoint(output_dir: str | Path, which: str) -> Path:
    """``which``: ``"latest"`` (the newest complete checkpoint under ``output_dir``) or a path."""
    if which != "latest":
        path = Path(which)
        if not path.is_dir():
            raise CheckpointError(f"resume: {path} is not a directory")
        return path
    root = checkpoints_dir(output_dir)
    complete = sorted(p for p in root.glob("step-*") if (p / "manifest.json").is_file())
    if not complete:
        raise CheckpointError(f"resume: latest: no complete checkpoint under {root}")
    return complete[-1]


def verify(path: Path) -> dict[str, Any]:
    """Check every file against the manifest; return the manifest."""
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path}: no manifest.json, so it is incomplete (interrupted while written?)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise CheckpointError(f"checkpoint {path}: manifest.json is unreadable ({error})") from None
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path}: {name} is missing")
        actual = _digest(file)
        if actual["bytes"] != expected["bytes"]:
            raise CheckpointError(
                f"checkpoint {path}: {name} has {actual['bytes']} bytes, the manifest says {expected['bytes']} "
                "(truncated or corrupted)"
            )
        if actual["sha256"] != expected["sha256"]:
            raise CheckpointError(f"checkpoint {path}: {name} does not match its SHA-256 in the manifest (corrupted)")
    return manifest


def load_checkpoint(trainer: Any, path: str | Path) -> None:
    """Restore the trainer from ``path``: weights, optimizer, scheduler, RNG states, data position, metrics."""
    path = Path(path)
    verify(path)
    state = json.loads((path / "state.json").read_text())
    if state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: format {state.get('format')!r}, this grpokit reads {FORMAT}")
    _check_config(path, state["config"], trainer.config.to_dict())
    rank, size = trainer.world.rank, trainer.world.size
    if is_sharded(trainer.model):
        raise CheckpointError("resume with parallelism: fsdp is not supported yet (docs/distributed.md); use ddp")
    if state["world_size"] != size:
        raise CheckpointError(f"checkpoint {path} was written by {state['world_size']} processes; resume it with "
                              f"the same number (now {size}): each one's random streams are in it")

    if trainer.config.lora_rank:
        _load_adapter(trainer.model, path / "model" / "adapter_model.safetensors", f"checkpoint {path}: model")
    else:
        load_weights(trainer.model, sorted((path / "model").glob("*.safetensors")), f"checkpoint {path}: model")
    for name, module in trainer.checkpointed_modules().items():
        load_weights(module, [path / f"{name}.safetensors"], f"checkpoint {path}: {name}")
    try:
        saved = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)
    except Exception as error:  # an unpicklable object is refused here, never executed
        raise CheckpointError(f"checkpoint {path}: trainer_state.pt cannot be read safely ({error})") from None
    for name, obj in trainer.checkpointed_state().items():
        try:
            obj.load_state_dict(saved[name])
        except (KeyError, ValueError, RuntimeError) as error:
            raise CheckpointError(f"checkpoint {path}: {name} state does not fit ({error})") from None
    _restore_torch_rng(trainer, saved["rng"][rank])
    random.setstate(_tuples(state["python_rng"][rank]))
    numpy_state = state["numpy_rng"][rank]
    np.random.set_state((numpy_state[0], np.array(numpy_state[1], dtype=np.uint32), *numpy_state[2:]))
    trainer.step = state["step"]
    trainer.sampler.order, trainer.sampler.epoch = list(state["data"]["order"]), state["data"]["epoch"]
    trainer.nonfinite_streak = state["nonfinite_streak"]
    trainer.history = state["history"]


def load_weights(module: torch.nn.Module, files: list[Path], source: str) -> None:
    """Load safetensors ``files`` into ``module``, naming the first name or shape that does not fit.
    Tied weights (saved once under one of their names) are accepted."""
    if not files:
        raise CheckpointError(f"{source}: no .safetensors file")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(str(file)))
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"{source}: {file.name} cannot be read ({error})") from None
    expected = module.state_dict()
    same_storage: dict[tuple, list[str]] = defaultdict(list)
    for name, tensor in expected.items():
        same_storage[(tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))].append(name)
    tied = {n for names in same_storage.values() if any(x in state for x in names) for n in names}
    missing = [n for n in expected if n not in state and n not in tied]
    unexpected = [n for n in state if n not in expected]
    if missing or unexpected:
        raise CheckpointError(f"{source}: the weights do not fit the model (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}); was it written for another model?")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise CheckpointError(f"{source}: {name} has shape {tuple(tensor.shape)} in the checkpoint but "
                                  f"{tuple(expected[name].shape)} in the model; was it written for another model?")
    module.load_state_dict(state, strict=False)


def _load_adapter(model: torch.nn.Module, file: Path, source: str) -> None:
    """A LoRA adapter saved by peft's save_pretrained, loaded into the model's adapter."""
    from peft import set_peft_model_state_dict

    try:
        result = set_peft_model_state_dict(model, load_file(str(file)))
    except (SafetensorError, OSError, RuntimeError) as error:  # unreadable, or shapes of another rank
        raise CheckpointError(f"{source}: the LoRA adapter does not fit ({error})") from None
    if result.unexpected_keys:
        raise CheckpointError(f"{source}: the LoRA adapter does not fit the model (unexpected "
                              f"{result.unexpected_keys[:3]})")


def _check_config(path: Path, saved: dict[str, Any], current: dict[str, Any]) -> None:
    different = [k for k in sorted(set(saved) | set(current))
                 if k not in RESUMABLE_CHANGES and saved.get(k) != current.get(k)]
    if different:
        details = ", ".join(f"{k}: {saved.get(k)!r} in the checkpoint, {current.get(k)!r} now" for k in different[:5])
        raise CheckpointError(f"checkpoint {path} was written by a run with a different config ({details})")


def _torch_rng_states(trainer: Any) -> dict[str, torch.Tensor]:
    states = {"torch": torch.get_rng_state(), "sampling": trainer.sampler.generator.get_state(),
              "minibatches": trainer._shuffle.get_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _restore_torch_rng(trainer: Any, states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    trainer.sampler.generator.set_state(states["sampling"])
    trainer._shuffle.set_state(states["minibatches"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _jsonable(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value
