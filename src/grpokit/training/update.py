"""Step 5 of the loop: the update, one function for the policy and, with PPO, the value model.

:func:`update` runs μ passes over the batch (``num_iterations``), each split into minibatches (one
optimizer step per minibatch and per learner), each minibatch split into micro-batches whose gradients
accumulate. A learner's loss is given the whole minibatch's counts (over every process), so each
micro-batch's loss is its exact share of the minibatch's and the gradient depends neither on
``micro_batch_size`` nor on the number of processes (docs/math.md, "Loss aggregation").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from grpokit.models.sharding import full_value
from grpokit.rollout.generate import Rollout
from grpokit.training.distributed import SINGLE, World, all_sum, all_sum_dict, gradient_sync


class TrainingError(RuntimeError):
    """Training cannot go on (repeated non-finite updates); the message says why and what was kept."""


@dataclass
class LossCounts:
    """The denominators of a loss, counted over the whole minibatch on every process."""

    sequences: float  # completions with at least one token in the loss
    tokens: float  # tokens in the loss


@dataclass
class UpdateBatch:
    """What the update trains on: the rollout and the per-completion tensors fixed before it. N first."""

    rollout: Rollout
    loss_mask: Tensor  # (N, T) the tokens in the loss
    advantages: Tensor  # (N, T)
    old_logp: Tensor | None = None  # (N, T) π_old; None: π_old = π_θ (one optimizer step per batch)
    ref_logp: Tensor | None = None  # (N, T) π_ref; None: no KL term in the loss
    returns: Tensor | None = None  # (N, T) PPO: the value model's targets
    old_values: Tensor | None = None  # (N, T) PPO: the value model's estimates at sampling time

    def __len__(self) -> int:
        return self.loss_mask.shape[0]

    def select(self, index: Tensor | slice) -> UpdateBatch:
        """The completions at ``index`` (indices, a bool mask or a slice over N)."""
        if isinstance(index, Tensor):
            index = index.to(self.loss_mask.device)
        tensors = (getattr(self, f.name) for f in fields(self)[1:])
        return UpdateBatch(self.rollout.select(index), *(None if t is None else t[index] for t in tensors))

    def units(self) -> float:
        """What the loss averages over: its tokens."""
        return float(self.loss_mask.sum())

    def counts(self, world: World) -> LossCounts:
        mask = self.loss_mask
        return LossCounts(sequences=max(1.0, all_sum(float((mask.sum(dim=1) > 0).sum()), world)),
                          tokens=max(1.0, all_sum(float(mask.sum()), world)))


class Minibatchable(Protocol):
    """What :func:`update` trains on: an :class:`UpdateBatch`, or a trainer's own batch with the same methods (the
    reward-model trainer's rows)."""

    def __len__(self) -> int: ...

    def select(self, index: Tensor | slice) -> Minibatchable: ...  # the rows at index (indices or a slice)

    def units(self) -> float: ...  # what the loss averages over in these rows (tokens, rows, steps)

    def counts(self, world: World) -> LossCounts: ...  # the denominators, over every process


# A learner's loss on a micro-batch: (model to run, micro-batch, the minibatch's counts, first pass?) →
# (loss, diagnostics as means over the micro-batch's loss tokens).
LossFunction = Callable[[nn.Module, Any, LossCounts, bool], tuple[Tensor, dict[str, float]]]


@dataclass
class Learner:
    """A module the update trains: the policy, or PPO's value model."""

    prefix: str  # of its metrics: "" (loss, grad_norm, lr) for the policy, "value_" for the value model
    module: nn.Module  # the module itself: its gradient is clipped, its weights stepped
    train_module: nn.Module  # what its passes run through: DDP or FSDP around ``module``, or ``module``
    optimizer: torch.optim.Optimizer
    scheduler: Any  # the learning-rate schedule, stepped with the optimizer
    loss: LossFunction
    loss_weight: float = 1.0  # of the loss in the gradient (PPO's vf_coef); diagnostics report the loss before it


class NonfiniteGuard:
    """Counts optimizer steps skipped in a row for a non-finite loss or gradient norm; at ``limit``
    it stops training (the weights are those of the last good step)."""

    def __init__(self, limit: int):
        self.limit, self.streak = limit, 0

    def check(self, loss: float, grad_norm: float) -> bool:
        """True when the step may be applied."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.streak = 0
            return True
        self.streak += 1
        if self.streak >= self.limit:
            raise TrainingError(
                f"{self.streak} updates in a row had a non-finite loss or gradient norm (last: loss {loss}, "
                f"grad norm {grad_norm}); stopped with the weights of the last good update "
                f"(max_nonfinite_updates={self.limit})"
            )
        return False


def update(
    learners: Sequence[Learner], batch: Minibatchable, *, micro_batch_size: int, max_grad_norm: float,
    guard: NonfiniteGuard, num_iterations: int = 1, num_minibatches: int = 1,
    shuffle: torch.Generator | None = None, world: World = SINGLE,
) -> list[dict[str, float]]:
    """μ = ``num_iterations`` passes over ``batch``; each pass, a fresh shuffle (with several minibatches)
    and one optimizer step per minibatch and learner. Returns each pass's diagnostics, averaged over its
    minibatches (``skipped_updates`` summed). ``max_grad_norm`` 0 does not clip."""
    for learner in learners:
        learner.train_module.train()  # sampling and the frozen passes leave models in eval mode
    passes = []
    for iteration in range(num_iterations):
        order = torch.arange(len(batch)) if num_minibatches == 1 else torch.randperm(len(batch), generator=shuffle)
        steps = []
        for index in order.tensor_split(num_minibatches):
            minibatch = batch.select(index)
            counts = minibatch.counts(world)
            stats: dict[str, float] = {"skipped_updates": 0}
            for learner in learners:
                p = learner.prefix
                totals = {p + "loss": 0.0}
                starts = range(0, len(minibatch), micro_batch_size)
                for k, start in enumerate(starts):
                    micro = minibatch.select(slice(start, start + micro_batch_size))
                    # Gradients are reduced across processes once, on the last micro-batch.
                    with gradient_sync(learner.train_module, enabled=k == len(starts) - 1):
                        loss, diagnostics = learner.loss(learner.train_module, micro, counts, iteration == 0)
                        # DDP averages over processes; the shares must add up
                        (loss * learner.loss_weight * world.size).backward()
                    totals[p + "loss"] += loss.item()  # each micro-batch's loss is its share of the minibatch's
                    share = micro.units() / counts.tokens
                    for key, value in diagnostics.items():
                        totals[p + key] = totals.get(p + key, 0.0) + value * share
                totals = all_sum_dict(totals, world)
                totals[p + "lr"] = learner.scheduler.get_last_lr()[0]
                norm = torch.nn.utils.clip_grad_norm_(learner.module.parameters(), max_grad_norm or math.inf)
                totals[p + "grad_norm"] = float(full_value(norm))
                if guard.check(totals[p + "loss"], totals[p + "grad_norm"]):
                    learner.optimizer.step()
                    learner.scheduler.step()
                else:
                    stats["skipped_updates"] += 1
                learner.optimizer.zero_grad(set_to_none=True)
                stats.update(totals)
            steps.append(stats)
        passes.append({key: sum(s[key] for s in steps) / len(steps) for key in steps[0]})
        passes[-1]["skipped_updates"] = sum(s["skipped_updates"] for s in steps)
    return passes
