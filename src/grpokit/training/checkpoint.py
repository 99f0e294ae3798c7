"""Checkpoints that survive a crash and resume bit-exact.

A checkpoint is a directory ``output_dir/checkpoints/step-NNNNNN/`` holding:

- ``model/``: the policy and tokenizer, ``save_pretrained`` (safetensors): loadable by plain transformers (LoRA:
  the adapter merged in, and ``adapter/`` the adapter alone, which a resume reads);
- ``value_model.safetensors`` (PPO): the value model;
- ``trainer_state.pt``: optimizer and scheduler state dicts and each process's torch RNG states —
  tensors and plain containers only, read back with ``torch.load(weights_only=True)``;
- ``state.json``: step, data position, each process's Python and NumPy RNG states, the id of the run that wrote
  it (:mod:`grpokit.training.run_dir`), the config and every metric so far;
- ``manifest.json``, written last: the size and SHA-256 of every other file.

With FSDP2 (``parallelism: fsdp``) every process writes its shards of the models and optimizers to ``shards/``
(:mod:`grpokit.training.sharded_checkpoint`); ``model/`` is still the whole policy, gathered to the first process,
and ``trainer_state.pt`` holds the schedules, the optimizers' ``param_groups`` and every process's torch RNG states.

What it holds is the trainer's :meth:`~grpokit.algorithms.grpo.GRPOTrainer.state_dict`, and on resume the
trainer's ``load_state_dict`` takes it back: this module reads nothing else of the trainer.

It is written into a temporary directory beside its final place (with FSDP2, one that every process writes into)
and renamed into place by the first process once everything is written, so a crash mid-write never leaves a
directory that looks complete; a directory without a manifest, or whose files do not match it, is refused. The
last ``keep_checkpoints`` are kept. Nothing is unpickled beyond what ``weights_only=True`` allows (and, for FSDP2's
shards, DCP's own metadata classes).

The reference model is not saved: it is the starting policy, rebuilt from ``config.model`` on resume;
except in iterative RL (``rl_iterations``), where ``reference.safetensors`` and ``reward_model.safetensors``
hold the reference and the learned reward model as the last iteration's end left them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_model

from grpokit.config import config_class_of
from grpokit.models.loading import save_pretrained
from grpokit.models.lora import is_lora
from grpokit.models.sharding import full_state_dict, is_sharded
from grpokit.training import sharded_checkpoint
from grpokit.training.distributed import SINGLE, World, barrier, broadcast_object, gather

FORMAT = 1
FULL, SHARDED = "full", "sharded"  # state.json's layout: every weight in model/ (and *.safetensors), or FSDP2 shards
JSON_RNG = ("python", "numpy")  # random streams kept in state.json; the torch ones are tensors


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


def save_checkpoint(state: dict[str, Any], output_dir: str | Path, keep: int, world: World = SINGLE) -> Path:
    """Write ``state`` (a trainer's :meth:`~grpokit.algorithms.grpo.GRPOTrainer.state_dict`) as
    ``output_dir/checkpoints/step-NNNNNN`` (atomically) and keep the last ``keep`` checkpoints. With
    several processes every one calls this (each one's random streams are saved) and the first writes; with FSDP2
    each also writes its shards."""
    root = checkpoints_dir(output_dir)
    final = root / f"step-{state['step']:06d}"
    rng = gather(state["rng"], world)
    if not _sharded(state):
        if world.main:
            _write(state, _staging(root, final, os.getpid()), final, rng, keep)
        barrier(world)
        return final
    # Every process writes into the first one's staging directory; it is published once all have written.
    staging = broadcast_object(_staging(root, final, os.getpid()) if world.main else None, world)
    groups = sharded_checkpoint.write_shards(state, staging)
    full = full_state_dict(state["modules"]["model"], world.main)  # the exported model/ (a collective)
    if world.main:
        _write(state, staging, final, rng, keep, sharded=(groups, full))
    barrier(world)
    return final


def _sharded(state: dict[str, Any]) -> bool:
    return any(is_sharded(module) for module in state["modules"].values())


def _staging(root: Path, final: Path, pid: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".tmp-{final.name}-{pid}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    return staging


def _write(state: dict[str, Any], staging: Path, final: Path, rng: list[dict[str, Any]], keep: int,
           sharded: tuple[dict[str, Any], dict[str, torch.Tensor]] | None = None) -> None:
    """Everything but the shards into ``staging``, then publish it as ``final``. ``sharded``: the optimizers'
    ``param_groups`` (beside the shards) and the policy's full weights for model/."""
    modules = dict(state["modules"])
    save_pretrained(modules.pop("model"), state["tokenizer"], staging / "model", sharded[1] if sharded else None)
    if not sharded:
        for name, module in modules.items():
            save_model(module, str(staging / f"{name}.safetensors"))
    tensors = [{k: v for k, v in per_rank.items() if k not in JSON_RNG} for per_rank in rng]
    extra = {"param_groups": sharded[0]} if sharded else {}
    torch.save({**state["optimizers"], **extra, "rng": tensors}, staging / "trainer_state.pt")
    saved = {
        "format": FORMAT,
        "step": state["step"],
        "data": state["data"],
        "world_size": len(rng),
        "layout": SHARDED if sharded else FULL,
        **{f"{kind}_rng": [_jsonable(per_rank[kind]) for per_rank in rng] for kind in JSON_RNG},
        "nonfinite_streak": state["nonfinite_streak"],
        "run_id": state.get("run_id"),  # the run that wrote it (training.run_dir): resume reads only its own run's
        "config": state["config"],
        "history": state["history"],
    }
    (staging / "state.json").write_text(json.dumps(saved))
    _write_manifest(staging)

    root = final.parent
    if final.exists():  # a checkpoint of this step from an earlier, interrupted attempt
        shutil.rmtree(final)
    os.replace(staging, final)
    _prune(root, keep)


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
        # Renamed out of the step-* names first (one atomic rename): a crash mid-delete leaves a .tmp-* directory
        # that the next save removes, never a step-* directory with some of its files gone.
        doomed = old.with_name(f".tmp-delete-{old.name}")
        old.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    for stale in root.glob(".tmp-*"):  # left by a crash mid-write or mid-delete (ours was just renamed into place)
        shutil.rmtree(stale, ignore_errors=True)


def find_checkpoint(output_dir: str | Path, which: str) -> Path | None:
    """``which``: ``"latest"`` (the newest complete checkpoint under ``output_dir``), ``"auto"`` (the same, or None
    where there is none: a run restarted by ``torchrun --max-restarts`` continues, a first launch starts) or a
    path. Directories still being written (``.tmp-*``, or without a manifest) are never chosen."""
    if which not in ("latest", "auto"):
        path = Path(which)
        if not path.is_dir():
            raise CheckpointError(f"resume: {path} is not a directory")
        return path
    root = checkpoints_dir(output_dir)
    complete = sorted(p for p in root.glob("step-*") if (p / "manifest.json").is_file())
    if not complete and which == "latest":
        raise CheckpointError(f"resume: latest: no complete checkpoint under {root}")
    return complete[-1] if complete else None


def checkpoint_run_id(path: Path) -> str | None:
    """The id of the run that wrote the checkpoint at ``path`` (None: written before grpokit recorded run ids)."""
    try:
        saved = json.loads((path / "state.json").read_text())
        return saved.get("run_id")
    except (OSError, json.JSONDecodeError, AttributeError) as error:
        raise CheckpointError(f"checkpoint {path}: state.json is missing or unreadable ({error}); is it a "
                              "checkpoint directory (output_dir/checkpoints/step-N)?") from None


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


def load_checkpoint(path: str | Path, state: dict[str, Any], world: World = SINGLE) -> dict[str, Any]:
    """Load the checkpoint at ``path`` for the run whose :meth:`~grpokit.algorithms.grpo.GRPOTrainer.state_dict`
    is ``state``: the weights of ``state["modules"]`` (and, with FSDP2, the optimizers' states) in place, after
    checking every file, the config and the world size; returns the rest of the state (this process's random
    streams) for the trainer's ``load_state_dict``. Every process calls it."""
    path = Path(path)
    sharded = _sharded(state)
    if sharded:  # the first process reads every file against the manifest, the others hear its verdict
        error = None
        if world.main:
            try:
                verify(path)
            except CheckpointError as failed:
                error = str(failed)
        error = broadcast_object(error, world)
        if error:
            raise CheckpointError(error)
    else:
        verify(path)
    saved = json.loads((path / "state.json").read_text())
    if saved.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: format {saved.get('format')!r}, this grpokit reads {FORMAT}")
    if saved["world_size"] != world.size:
        raise CheckpointError(f"checkpoint {path} was written by {saved['world_size']} processes; resume it with "
                              f"the same number (now {world.size}): each one's random streams are in it")
    _check_config(path, saved["config"], state["config"])
    layout = saved.get("layout", FULL)
    if layout != (SHARDED if sharded else FULL):
        raise CheckpointError(f"checkpoint {path} holds {layout} weights but this run's are "
                              f"{SHARDED if sharded else FULL} (parallelism: fsdp shards them)")
    try:
        tensors = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)
    except Exception as error:  # an unpicklable object is refused here, never executed
        raise CheckpointError(f"checkpoint {path}: trainer_state.pt cannot be read safely ({error})") from None
    missing = [name for name in state["optimizers"] if name not in tensors]
    if missing:
        raise CheckpointError(f"checkpoint {path}: no {missing[0]} state in trainer_state.pt")

    if sharded:
        try:
            sharded_checkpoint.read_shards(path, state, tensors["param_groups"])
        except Exception as error:  # DCP gathers every process's failure (a refused pickle too): each raises it
            raise CheckpointError(f"checkpoint {path}: shards/ cannot be read ({error})") from None
    else:
        _load_modules(path, state["modules"])
    numpy_state = saved["numpy_rng"][world.rank]
    rng = {**tensors["rng"][world.rank], "python": _tuples(saved["python_rng"][world.rank]),
           "numpy": (numpy_state[0], np.array(numpy_state[1], dtype=np.uint32), *numpy_state[2:])}
    return {"step": saved["step"], "optimizers": {name: tensors[name] for name in state["optimizers"]},
            "rng": rng, "data": saved["data"], "nonfinite_streak": saved["nonfinite_streak"],
            "history": saved["history"]}


def _load_modules(path: Path, modules: dict[str, torch.nn.Module]) -> None:
    for name, module in modules.items():
        source = f"checkpoint {path}: {name}"
        if name != "model":
            load_weights(module, [path / f"{name}.safetensors"], source)
        elif is_lora(module):  # checkpoints written before the merged layout hold the adapter in model/
            adapter = next((d for d in (path / "adapter", path / "model") if (d / "adapter_config.json").exists()),
                           path / "adapter")
            _load_adapter(module, adapter / "adapter_model.safetensors", source)
        else:
            load_weights(module, sorted((path / "model").glob("*.safetensors")), source)


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
    # What may differ is declared with the keys of the resuming run's config class (GRPO, SFT or reward).
    config_class = config_class_of(current)
    ignored = config_class.resumable_keys() | set(config_class.REMOVED)
    # A key the checkpoint's config lacks is newer than the grpokit that wrote it: its run had the key's default.
    saved = {**config_class.defaults(), **saved}
    different = [k for k in sorted(set(saved) | set(current)) if k not in ignored and saved.get(k) != current.get(k)]
    if different:
        details = ", ".join(f"{k}: {saved.get(k)!r} in the checkpoint, {current.get(k)!r} now" for k in different[:5])
        raise CheckpointError(f"checkpoint {path} was written by a run with a different config ({details})")


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
