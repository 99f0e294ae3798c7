"""Which run a run directory (``output_dir``) holds, and whether a starting run may write there (:func:`claim`).

Every run writes ``run.json`` in its ``output_dir`` first, holding its id, and each of its checkpoints records the same
id in ``state.json``. Before anything else is written (the trainer's ``train``, or ``resume``):

- a run that starts afresh (no ``resume``) into a folder that holds any of ``RUN_FILES`` (what a grpokit run, its
  trackers, ``grpokit report`` and ``grpokit plot`` write there) is refused, naming the folder, what it holds and both
  ways out: ``--resume latest`` (continue that run) or ``--overwrite_output_dir`` (start over: those files are removed
  first, so no old ``step-*`` checkpoint, metric line or model survives to be taken for the new run's). A folder that
  is missing, empty or holds none of them (other files are left alone) is used as it is;
- ``resume: latest`` (and ``auto``) read the newest checkpoint under ``output_dir/checkpoints`` only if it was written
  by the folder's run (its id is ``run.json``'s); a checkpoint of another run found there is refused. ``auto`` where
  there is no checkpoint continues the folder's run from step 0 (torchrun ``--max-restarts``: a first attempt that
  died before its first checkpoint), its files replaced;
- ``resume: PATH`` inside ``output_dir/checkpoints`` is the same; a PATH elsewhere (another folder's checkpoint, named
  on purpose) starts a new run in ``output_dir`` from that checkpoint, so the folder must hold no other run, or
  ``overwrite_output_dir`` clears it; ``run.json`` records the checkpoint it started from.

``overwrite_output_dir`` with a resume of the same folder is refused (it would delete what the resume reads), and so is
one that would delete the run's own model or data. Under torchrun the first process claims the folder, before any
process writes, and every process raises its refusal (:meth:`grpokit.training.engine.Trainer.claim_output_dir`).

Folders and checkpoints written before grpokit recorded run ids have none: such a checkpoint is read as the run of
its own folder when that folder has no ``run.json`` either.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpokit.config import ConfigError
from grpokit.training.checkpoint import CheckpointError, checkpoint_run_id, find_checkpoint

RUN_FILE = "run.json"
# What a run writes in output_dir (engine, runlog, checkpoint, a LoRA model's adapter/, the trackers' folders,
# iterative RL's reward_model/, the demo's demo.json), and what `grpokit plot` and `grpokit report` add to it.
RUN_FILES = (RUN_FILE, "config.yaml", "metrics.jsonl", "completions.jsonl", "checkpoints", "model", "adapter",
             "tensorboard", "wandb", "reward_model", "demo.json", "plots", "report.html")


class OutputDirInUse(ValueError):
    """``output_dir`` (``folder``) holds another run's files (``held``); the message names them and the ways out."""

    def __init__(self, message: str, folder: Path | None = None, held: Sequence[str] = ()):
        super().__init__(message)
        self.folder, self.held = folder, list(held)

    def __reduce__(self) -> tuple[Any, ...]:  # broadcast to every process whole, not as the message alone
        return type(self), (str(self), self.folder, self.held)


def held_files(output_dir: str | Path) -> list[str]:
    """The ``RUN_FILES`` present in ``output_dir``."""
    folder = Path(output_dir)
    return [name for name in RUN_FILES if (folder / name).exists() or (folder / name).is_symlink()]


def folder_run_id(output_dir: str | Path) -> str | None:
    """The id in ``output_dir/run.json``; None where there is none (no run, or one written before run ids)."""
    path = Path(output_dir) / RUN_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())["run_id"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise OutputDirInUse(f"{path} is unreadable ({error}): remove it, or start over with "
                             "--overwrite_output_dir") from None


def claim(output_dir: str | Path, resume: str | None, checkpoint: Path | None, checkpoint_id: str | None,
          overwrite: bool, act: bool = True, reads: Sequence[str | None] = ()) -> str | None:
    """The id under which a run writes ``output_dir``, or a refusal (the module docstring's rules): ``resume`` is the
    config's, ``checkpoint`` the one it resolved to (None: none) and ``checkpoint_id`` the run id in that checkpoint.
    With ``act`` (the first process, once, just before the run's first write), another run's files are removed
    (``overwrite``) and ``run.json`` is written for a new run; without, nothing is touched (a check). ``reads``: paths
    the run reads (its model, its data), which ``overwrite`` must not delete."""
    folder = Path(output_dir)
    inside = checkpoint is not None and _is_within(checkpoint, folder / "checkpoints")
    if overwrite and (resume in ("latest", "auto") or inside):
        raise ConfigError(f"overwrite_output_dir would delete the run in {folder} that resume: {resume} continues; "
                          "set one of them, not both")
    if inside:
        return _own_run(folder, checkpoint, checkpoint_id)  # type: ignore[arg-type]
    held = held_files(folder)
    if held and checkpoint is None and resume == "auto":
        return folder_run_id(folder)  # the folder's run, without a checkpoint yet: it starts again from step 0
    if held and not overwrite:
        raise OutputDirInUse(
            f"output_dir {folder} already holds a run ({', '.join(held)}); a new run there would overwrite it. "
            "Continue that run with --resume latest (resume: latest), or start over, deleting those files, with "
            "--overwrite_output_dir (overwrite_output_dir: true), or choose another --output_dir", folder, held)
    for read in reads:  # e.g. model: runs/x/model, output_dir: runs/x (a resume would rebuild its reference from it)
        if read and Path(read).exists() and any(_is_within(Path(read), folder / name) for name in held):
            raise ConfigError(f"overwrite_output_dir would delete {read}, which this run reads; copy it out of "
                              f"{folder} first, or choose another --output_dir")
    return _start(folder, held, checkpoint) if act else None


def _own_run(folder: Path, checkpoint: Path, checkpoint_id: str | None) -> str | None:
    """The id of the folder's run, which ``checkpoint`` (under ``folder/checkpoints``) must be of."""
    held_id = folder_run_id(folder)
    if checkpoint_id != held_id:
        holds = f"holds run {held_id} ({RUN_FILE})" if held_id else f"has no {RUN_FILE} naming that run"
        raise CheckpointError(
            f"checkpoint {checkpoint} was written by run {checkpoint_id or '(none recorded)'}, but {folder} {holds}: "
            f"it is another run's and is not read. Resume a checkpoint of {folder}'s own run, or start a new run "
            f"from this one in another folder (--resume {checkpoint} --output_dir NEW_DIR)")
    return checkpoint_id


def _start(folder: Path, held: list[str], checkpoint: Path | None) -> str:
    """A new run in ``folder``: the old run's files (``held``) removed, ``run.json`` written; its id."""
    # checkpoints first (the old run's most misleading part), run.json last: a removal cut short leaves a folder
    # that is still refused, never one that passes for a new run's
    for name in sorted(held, key=lambda name: (name != "checkpoints", name == RUN_FILE)):
        _remove(folder / name)
    run_id = uuid.uuid4().hex
    folder.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"run_id": run_id}
    if checkpoint is not None:
        record["resumed_from"] = str(checkpoint)
    (folder / RUN_FILE).write_text(json.dumps(record) + "\n")
    return run_id


def _is_within(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def check_early(config: Any) -> None:
    """Refuse now what :func:`claim` will refuse when ``config``'s run starts (its ``output_dir``, ``resume`` and
    ``overwrite_output_dir``), before any slow work (loading a model, the demo's warm start); nothing is written. Under
    torchrun only the first process checks (the others may start while it writes); the claim itself is made by every
    process together, in the trainer."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    try:
        checkpoint = find_checkpoint(config.output_dir, config.resume) if config.resume else None
        checkpoint_id = checkpoint_run_id(checkpoint) if checkpoint is not None else None
    except CheckpointError:
        return  # a missing or unreadable checkpoint: the run names it where it reads it
    claim(config.output_dir, config.resume, checkpoint, checkpoint_id, config.overwrite_output_dir, act=False,
          reads=reads_of(config))


def reads_of(config: Any) -> list[str | None]:
    """The paths a run with ``config`` reads that may lie in a run directory: its model and its data."""
    return [getattr(config, key, None) for key in ("model", "dataset", "eval_dataset")
            if isinstance(getattr(config, key, None), (str, type(None)))]
