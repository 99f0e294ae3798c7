"""What the supervised trainers share (SFT and reward-model training): a fixed list of examples read in epochs of
shuffled batches, held-out examples evaluated every ``eval_every`` steps, and the step budget."""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from grpokit.config import ConfigError
from grpokit.core.optim import adamw_with_schedule
from grpokit.data import DataError
from grpokit.runtime.device import resolve_device
from grpokit.training.checkpoint import CheckpointError
from grpokit.training.distributed import require_one_process
from grpokit.training.engine import Trainer
from grpokit.training.update import Learner, LossCounts, NonfiniteGuard

__all__ = ["SupervisedTrainer", "split", "step_budget"]


class SupervisedTrainer(Trainer):
    """A :class:`~grpokit.training.engine.Trainer` over ``train_examples`` (and ``eval_examples``), set by the
    subclass with ``steps_per_epoch`` and ``max_steps`` (:func:`step_budget`)."""

    train_examples: list
    eval_examples: list
    steps_per_epoch: int

    def __init__(self) -> None:
        super().__init__()
        self._order: tuple[int, list[int]] = (-1, [])  # (epoch, its order of the training rows)

    def start(self, config: Any, command: str, train_dataset: Any, rows: str) -> None:
        """What SFT and reward training do first: refuse torchrun (one process trains), :meth:`set_up` (seeding
        every stream, the precision), and require rows (``train_dataset`` or the config's ``dataset``), which are
        checked before the (possibly slow) model load. ``rows``: what the dataset must hold, for the error."""
        require_one_process(command)
        self.set_up(config, resolve_device(config.device), ["tensorboard"] if config.tensorboard else [])
        if train_dataset is None and config.dataset is None:
            raise ConfigError(f"dataset is required: a file of {rows} (JSONL, CSV, Parquet, or a directory written by "
                              "datasets' save_to_disk), a dataset folder, or a Hugging Face Hub dataset id")

    def use_examples(self, examples: list, held_out: list, summary: dict[str, Any], none_left: str) -> None:
        """Train on ``examples`` and evaluate on ``held_out`` (None: a row that does not fit, left out), with the
        optimizer and schedule of the step budget; ``summary``: what :meth:`announce` says beyond the counts;
        ``none_left``: the error when no training row is left."""
        self.train_examples = [e for e in examples if e is not None]
        self.eval_examples = [e for e in held_out if e is not None]
        self.summary = {"rows": len(self.train_examples), "eval_rows": len(self.eval_examples),
                        "dropped_rows": sum(e is None for e in [*examples, *held_out]),
                        "truncated_rows": sum(e.truncated for e in [*self.train_examples, *self.eval_examples]),
                        **summary}
        if not self.train_examples:
            raise DataError(none_left)
        self.steps_per_epoch, self.max_steps, optimizer, scheduler = step_budget(
            self.model, self.config, len(self.train_examples))
        self.learner = Learner("", self.model, self.model, optimizer, scheduler, loss=self.loss)
        self.learners = [self.learner]
        self.guard = NonfiniteGuard(self.config.max_nonfinite_updates)

    def loss(self, model: torch.nn.Module, batch: Any, counts: LossCounts,
             first_pass: bool) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def batch_indices(self, step: int) -> list[int]:
        """The training rows of optimizer step ``step`` (0-based): each epoch, a fresh order seeded by
        (seed, epoch), cut into batches of ``batch_size`` (the last one may be smaller). A function of the
        step alone, so a resumed run reads the same rows."""
        epoch, position = divmod(step, self.steps_per_epoch)
        if self._order[0] != epoch:
            order = list(range(len(self.train_examples)))
            random.Random(f"sft-order-{self.config.seed}-{epoch}").shuffle(order)
            self._order = (epoch, order)
        size = self.config.batch_size
        return self._order[1][position * size: (position + 1) * size]

    def evaluates(self) -> bool:
        """Whether the step just taken is evaluated on the held-out rows: every ``eval_every`` steps and the last."""
        every = self.config.eval_every
        return bool(self.eval_examples) and (every and self.step % every == 0 or self.step == self.max_steps)

    def data_state(self) -> dict[str, Any]:
        """The data position is the step itself (:meth:`batch_indices`); the row counts, which a resumed run must
        match."""
        return {"rows": len(self.train_examples), "eval_rows": len(self.eval_examples)}

    def load_data_state(self, data: dict[str, Any]) -> None:
        here = self.data_state()
        if data != here:
            raise CheckpointError(f"the checkpoint was written for {data['rows']} training and {data['eval_rows']} "
                                  f"held-out rows, this run has {here['rows']} and {here['eval_rows']}: the dataset "
                                  "changed")


def step_budget(model: torch.nn.Module, config: Any, rows: int) -> tuple[int, int, torch.optim.Optimizer, Any]:
    """(steps per epoch, optimizer steps, AdamW, its schedule) for a supervised run over ``rows`` training
    rows: ``config.max_steps`` or ``config.epochs`` epochs of ``config.batch_size`` rows, warmup included."""
    steps_per_epoch = math.ceil(rows / config.batch_size)
    max_steps = config.max_steps or math.ceil(config.epochs * steps_per_epoch)
    if config.warmup_steps >= max_steps:
        raise ConfigError(f"warmup_steps={config.warmup_steps} leaves no step after warmup: the run makes "
                          f"{max_steps} optimizer steps")
    optimizer, scheduler = adamw_with_schedule(model, config, config.learning_rate, max_steps)
    return steps_per_epoch, max_steps, optimizer, scheduler


def split(examples: list, fraction: float, seed: int) -> tuple[list, list]:
    """(training, held-out): a seeded draw of ``round(fraction × rows)`` rows (at least one) held out."""
    count = max(1, round(fraction * len(examples)))
    if count >= len(examples):
        raise ConfigError(f"eval_fraction={fraction} holds out all {len(examples)} rows; lower it")
    order = list(range(len(examples)))
    random.Random(f"sft-eval-{seed}").shuffle(order)
    held = set(order[:count])
    return ([e for i, e in enumerate(examples) if i not in held], [e for i, e in enumerate(examples) if i in held])
