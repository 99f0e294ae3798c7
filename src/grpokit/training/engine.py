"""The training engine: the run loop every trainer uses — GRPO/PPO, SFT and reward-model training.

A trainer (:class:`Trainer`'s subclass) writes what is its own: the step (:meth:`Trainer.training_step`), what
its checkpoint holds beyond the common part (:meth:`Trainer.modules`, :meth:`Trainer.data_state`,
:meth:`Trainer.generators`) and how it saves its model. Everything around the step is written here once:

    claim output_dir (training.run_dir: another run's folder is refused) and resume (config.resume: a path, latest,
    auto) → run directory → for each step: step, progress bar, checkpoint every
    save_every steps or on SIGINT/SIGTERM (then TrainingInterrupted) → final checkpoint → save(output_dir/model)
    → trackers

and a checkpoint's common part: the step, each learner's optimizer and schedule, every random stream, the
non-finite streak and the metrics so far (:mod:`grpokit.training.checkpoint` writes and verifies it).
"""

from __future__ import annotations

import copy
import os
import signal
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from grpokit.models.sharding import is_sharded
from grpokit.rollout.episodes import EnvironmentFailure
from grpokit.runtime.device import describe_precision, resolve_precision
from grpokit.runtime.progress import follows_progress_bar
from grpokit.runtime.seeding import rng_states, seed_everything, set_rng_states
from grpokit.training.checkpoint import (
    StopSignals,
    checkpoint_run_id,
    find_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from grpokit.training.distributed import SINGLE, World, all_max, broadcast_object
from grpokit.training.run_dir import claim, reads_of
from grpokit.training.runlog import RunLog, check_trackers
from grpokit.training.update import Learner, NonfiniteGuard

__all__ = ["Trainer", "TrainingInterrupted"]


class TrainingInterrupted(KeyboardInterrupt):
    """SIGINT/SIGTERM stopped training after a checkpoint; the message names it."""


class Trainer:
    """The run loop and the checkpoint's common part, for a subclass that sets, in its ``__init__``: ``model``,
    ``tokenizer``, ``learners`` (what the update trains), ``guard`` (a :class:`NonfiniteGuard`)
    and ``max_steps``, after :meth:`set_up` (with several processes, ``world`` before it)."""

    label = "train"  # the progress bar's
    postfix: Sequence[str] = ("loss",)  # the metrics the bar shows
    world: World = SINGLE

    # output_dir, resume, overwrite_output_dir, save_every, keep_checkpoints, progress_bar, seed, mixed_precision
    config: Any
    device: torch.device
    mixed_precision: str  # 'no' or 'bf16', decided by set_up
    model: torch.nn.Module
    tokenizer: Any
    learners: list[Learner]
    guard: NonfiniteGuard
    max_steps: int
    trackers: list[str] = []
    notes: list[str] = []

    def __init__(self) -> None:
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.run_log: RunLog | None = None  # the run directory, started by train() or the first logged step
        self.run_id: str | None = None  # this run's, in output_dir/run.json and each checkpoint (training.run_dir)
        self.claimed = False  # whether output_dir was claimed for this run (claim_output_dir)

    def set_up(self, config: Any, device: torch.device, trackers: list[str]) -> None:
        """What every trainer does first: seed every random stream, decide the precision for ``device`` (here and
        nowhere else: every pass reads ``mixed_precision``; the config, and so a checkpoint, keeps 'auto', so a
        resume on other hardware decides again), say it (also atop config.yaml), and check that the trackers'
        packages are installed — all before the (possibly slow) model load."""
        seed_everything(config.seed)
        self.config, self.device = config, device
        self.mixed_precision = resolve_precision(config.mixed_precision, device)
        self.notes = [describe_precision(config.mixed_precision, device)]
        if self.world.main:
            print(self.notes[0], file=sys.stderr)  # beside the progress bar; stdout stays the caller's
        self.trackers = list(trackers)
        check_trackers(self.trackers)

    # ---- what each trainer writes ------------------------------------------------------------------

    def training_step(self) -> dict[str, float]:
        raise NotImplementedError

    def save(self, path: str | Path) -> None:
        """The trained model at ``path`` (``save_pretrained``)."""
        raise NotImplementedError

    def announce(self) -> None:
        """What the run is about to do, printed once before the first step (default: nothing)."""

    def run_config(self) -> dict[str, Any]:
        """The config as config.yaml records it."""
        return self.config.to_dict()

    def modules(self) -> dict[str, torch.nn.Module]:
        """The modules a checkpoint holds, loaded in place on resume (the trained model is ``"model"``)."""
        return {"model": self.model}

    def generators(self) -> dict[str, torch.Generator]:
        """The trainer's own random streams, saved and restored beside torch's, Python's and NumPy's."""
        return {}

    def data_state(self) -> dict[str, Any]:
        """The position in the data (a checkpoint's ``data``)."""
        return {}

    def load_data_state(self, data: dict[str, Any]) -> None:
        """Restore :meth:`data_state`'s value (raise ``CheckpointError`` if this run's data cannot resume it)."""

    # ---- the loop --------------------------------------------------------------------------------

    @follows_progress_bar
    def train(self) -> list[dict[str, float]]:
        """Run to ``max_steps`` (from the checkpoint when ``config.resume`` is set), writing a checkpoint every
        ``save_every`` steps, at the end, and on SIGINT/SIGTERM; then save the model to ``output_dir/model``."""
        config, world = self.config, self.world
        self.begin(config.resume)
        bar = tqdm(range(self.step, self.max_steps), desc=self.label,
                   disable=not (config.progress_bar and world.main), dynamic_ncols=True)
        saved_at = None
        with StopSignals() as signals:
            for _ in bar:
                before = self.sampling_state()
                try:
                    metrics = self.training_step()
                except EnvironmentFailure as error:
                    raise type(error)(f"{error}; {self.save_before_failure(before, saved_at)}") from error
                bar.set_postfix({key: f"{metrics[key]:.4g}" for key in self.postfix if metrics.get(key) is not None})
                # Every process stops after the same step, whichever got the signal.
                stop = all_max(float(signals.received or 0), world)
                if config.save_every and self.step % config.save_every == 0 or stop:
                    saved_at = self.save_checkpoint()
                if stop:
                    raise TrainingInterrupted(
                        f"stopped by {signal.Signals(int(stop)).name} after step {self.step}; checkpoint "
                        f"{saved_at}; continue with --resume latest"
                    )
        if saved_at is None or not saved_at.name.endswith(f"{self.step:06d}"):
            self.save_checkpoint()
        self.save(Path(config.output_dir) / "model")
        if self.run_log is not None:
            self.run_log.finish()  # the trackers' runs (stopped runs are ended by their own exit handlers)
        return self.history

    def begin(self, which: str | None) -> Path | None:
        """What a run does before its first step: claim ``output_dir`` and resume from ``which`` (a checkpoint's path,
        'latest' or 'auto'; None: start afresh), then, on the first process, start the run directory's files and
        announce the run. Returns the checkpoint resumed (None: none)."""
        path = None
        if which:
            path = self.resume(which)
        elif not self.claimed:
            if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) and self.world.main:
                # Not resumed implicitly: output_dir may hold an earlier run's checkpoints (then it is refused below).
                print("torchrun restarted this run's processes but resume is not set, so it is not continued from "
                      "output_dir's checkpoints; launch with --resume auto to continue from the newest checkpoint",
                      file=sys.stderr)
            self.claim_output_dir(None)
        if self.world.main:
            self.start_run_log()
            self.announce()
        return path

    def sampling_state(self) -> tuple[Any, ...]:
        """What a step's sampling moves before any update: the random streams and the data's order (cheap: no
        weights), so that a step whose sampling failed can be taken back."""
        return (rng_states(), {name: g.get_state() for name, g in self.generators().items()},
                copy.deepcopy(self.data_state()))

    def save_before_failure(self, before: tuple[Any, ...], saved_at: Path | None) -> str:
        """After a step failed while sampling (an environment raised): its sampling taken back, so that the step is
        redone on resume with the same prompts and draws, and a checkpoint of the steps done written unless one is;
        says where."""
        rng, generators, data = before
        set_rng_states(rng)
        for name, generator in self.generators().items():
            generator.set_state(generators[name])
        self.load_data_state(data)
        if not self.step:
            return "no step was done"
        if saved_at is None or not saved_at.name.endswith(f"{self.step:06d}"):
            saved_at = self.save_checkpoint()
        return f"checkpoint {saved_at} (step {self.step}); continue with --resume latest"

    # ---- the run directory -----------------------------------------------------------------------

    def claim_output_dir(self, resume: str | None, checkpoint: Path | None = None, act: bool = True) -> None:
        """Whether this run may write ``output_dir`` (:func:`~grpokit.training.run_dir.claim`: another run's files are
        refused, or removed with ``overwrite_output_dir``; a checkpoint of another run is refused), decided by the
        first process before any process writes there; every process raises its refusal or takes the run's id.
        ``act=False``: the check alone (nothing removed or written)."""
        run_id = error = None
        if self.world.main:
            try:
                checkpoint_id = checkpoint_run_id(checkpoint) if checkpoint is not None else None
                run_id = claim(self.config.output_dir, resume, checkpoint, checkpoint_id,
                               self.config.overwrite_output_dir, act, reads_of(self.config))
            except Exception as failed:  # (an OSError too) every process must hear it, or the others would wait
                error = failed
        run_id, error = broadcast_object((run_id, error), self.world)
        if error is not None:
            raise error
        if act:
            self.run_id, self.claimed = run_id, True

    def start_run_log(self) -> None:
        if not self.claimed:  # a step logged outside train() (only the first process writes): a fresh run's claim
            self.run_id, self.claimed = claim(self.config.output_dir, None, None, None,
                                              self.config.overwrite_output_dir, reads=reads_of(self.config)), True
        if self.run_log is not None:
            self.run_log.finish()
        self.run_log = RunLog(self.config.output_dir, trackers=self.trackers)
        self.run_log.start(self.run_config(), self.history, self.step, notes=self.notes)

    def log(self, metrics: dict[str, float], completions: Iterable[dict[str, Any]] = ()) -> None:
        """Record a step's metrics (and, on the main process, write them and its completions)."""
        self.history.append(metrics)
        if not self.world.main:  # one process writes the run directory
            return
        if self.run_log is None:
            self.start_run_log()
        self.run_log.write(metrics, list(completions))

    # ---- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a checkpoint holds (:mod:`grpokit.training.checkpoint` reads nothing else of the trainer):
        ``modules`` (:meth:`modules`), ``tokenizer``, ``optimizers`` (each learner's optimizer and schedule
        state), ``rng`` (this process's random streams), ``data`` (:meth:`data_state`), ``step``,
        ``nonfinite_streak``, ``history`` (every step's metrics), ``run_id`` and ``config``."""
        rng = {**rng_states(), **{name: g.get_state() for name, g in self.generators().items()}}
        optimizers, sharded = {}, {}
        for learner in self.learners:
            if is_sharded(learner.module):  # its state is shards, written and loaded in place with its module's
                sharded[learner.prefix + "optimizer"] = (learner.module, learner.optimizer)
            else:
                optimizers[learner.prefix + "optimizer"] = learner.optimizer.state_dict()
            optimizers[learner.prefix + "scheduler"] = learner.scheduler.state_dict()
        return {"step": self.step, "run_id": self.run_id, "config": self.config.to_dict(), "modules": self.modules(),
                "tokenizer": self.tokenizer, "optimizers": optimizers, "sharded": sharded, "rng": rng,
                "data": self.data_state(), "nonfinite_streak": self.guard.streak, "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (``modules``, ``tokenizer`` and ``config`` excepted: the
        modules' weights are loaded in place, the others are the run's own)."""
        self.load_data_state(state["data"])
        for learner in self.learners:
            if learner.prefix + "optimizer" in state["optimizers"]:  # (a sharded one was loaded in place)
                learner.optimizer.load_state_dict(state["optimizers"][learner.prefix + "optimizer"])
            learner.scheduler.load_state_dict(state["optimizers"][learner.prefix + "scheduler"])
        set_rng_states(state["rng"])
        for name, generator in self.generators().items():
            generator.set_state(state["rng"][name])
        self.step, self.guard.streak, self.history = state["step"], state["nonfinite_streak"], list(state["history"])

    def resume(self, which: str = "latest") -> Path | None:
        """Continue from a checkpoint (``"latest"`` under ``output_dir``, ``"auto"``: the latest if there is one, or
        a path), exactly; returns it (None: ``"auto"`` found none, and the run starts from its first step). Only a
        checkpoint of the run in ``output_dir`` is read, unless named by a path outside it
        (:meth:`claim_output_dir`)."""
        path = find_checkpoint(self.config.output_dir, which)
        self.claim_output_dir(which, path, act=False)  # refused before it is read
        if path is not None:
            self.load_state_dict(load_checkpoint(path, self.state_dict(), self.world))
        self.claim_output_dir(which, path)  # once it has loaded: a checkpoint that fails to load leaves nothing behind
        if self.world.main:
            print(f"resume: {which}: " + (f"from {path} (step {self.step})" if path else
                                           f"no checkpoint under {self.config.output_dir}; starting at step 0"),
                  file=sys.stderr)
        return path

    def save_checkpoint(self) -> Path:
        """Write a checkpoint of this step under ``output_dir/checkpoints`` (every process calls it)."""
        return save_checkpoint(self.state_dict(), self.config.output_dir, self.config.keep_checkpoints, self.world)
