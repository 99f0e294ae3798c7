"""PPO, the baseline GRPO replaces (GRPO.md §4): a value model beside the policy, GAE advantages.

Per token ``t`` of completion ``i`` the reward is ``−β (logp − ref_logp)``, plus the completion's
rule-based reward at its last token (or, with ``supervision: process``, each step's reward at the
token that ends it). GAE over those rewards and the value model's estimates gives the advantages
(whitened over the batch) and the returns; the policy takes the same clipped surrogate as GRPO
(``grpo_loss`` with per-token advantages and no KL term: the KL is in the reward), and the value model
a clipped squared error on the returns. Everything else — rollout, rewards, micro-batching, logging,
saving, the CLI — is GRPO's: :class:`PPOTrainer` subclasses :class:`GRPOTrainer` and replaces only
the step's middle.

The value model is the cost GRPO removes: as many weights as the policy again, their gradients and
Adam states, and a forward and backward pass per batch. ``benchmarks/grpo_vs_ppo.py`` measures it.
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from grpokit.config import ConfigError
from grpokit.distributed import all_sum, all_sum_dict, data_parallel, full_state_dict, gradient_sync
from grpokit.objective import kl_penalty, masked_mean
from grpokit.rollout import Rollout, sequence_inputs
from grpokit.runlog import step_metrics
from grpokit.sampling import Batch
from grpokit.trainer import GRPOTrainer

# --------------------------------------------------------------------------------------------------
# The math: pure functions on tensors. Shapes: (N, T) completion tokens, right-padded, mask 1 on real
# tokens (prefix of each row).


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation over each completion's tokens: ``(advantages, returns)``.

    ``δ_t = r_t + γ V_{t+1} − V_t`` with ``V`` = 0 after a completion's last token (the episode ends),
    ``A_t = Σ_l (γλ)^l δ_{t+l}``, ``returns = A + V``. ``rewards``, ``values``, ``mask``: (N, T).
    Masked positions are 0 in both outputs, whatever ``rewards`` and ``values`` hold there.

    >>> adv, ret = gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.5]]), torch.ones(1, 2), 1.0, 1.0)
    >>> adv.tolist(), ret.tolist()
    ([[0.5, 0.5]], [[1.0, 1.0]])
    """
    if not (rewards.shape == values.shape == mask.shape) or rewards.dim() != 2:
        raise ValueError(
            f"rewards, values and mask must share one (N, T) shape, got {tuple(rewards.shape)}, "
            f"{tuple(values.shape)} and {tuple(mask.shape)}"
        )
    valid = mask.bool()
    rewards = torch.where(valid, rewards.float(), 0.0)
    values = torch.where(valid, values.float(), 0.0)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(valid[:, t], delta + gamma * lam * running, 0.0)
        advantages[:, t] = running
        next_value = values[:, t]  # 0 past the end, so the last token sees V = 0 after it
    return advantages, torch.where(valid, advantages + values, 0.0)


def whiten(values: Tensor, mask: Tensor, eps: float = 1e-8, *, moments: tuple[float, float] | None = None) -> Tensor:
    """``(x − mean) / std`` over the unmasked entries (biased std, as PPO implementations use); masked → 0.
    ``moments``: ``(mean, variance)`` to use instead (a data-parallel caller passes the whole batch's)."""
    if moments is None:
        mean = masked_mean(values, mask)
        var = masked_mean((values - mean) ** 2, mask)
    else:
        mean, var = (torch.tensor(m, dtype=values.dtype, device=values.device) for m in moments)
    return torch.where(mask.bool(), (values - mean) * torch.rsqrt(var + eps), 0.0)


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip_range: float = 0.2,
    normalizer: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped value loss ``½ · max((V − R)², (clip(V, V_old ± c) − R)²)``, summed over unmasked
    tokens and divided by ``normalizer`` (default: their count; a micro-batch passes the whole
    batch's). Returns the loss and ``value_clipfrac``: the share of tokens where the clipped term is
    the larger.

    >>> loss, stats = value_loss(torch.tensor([[2.0]]), torch.tensor([[1.0]]), torch.tensor([[3.0]]),
    ...                          torch.ones(1, 1), clip_range=0.5)
    >>> loss.item(), stats["value_clipfrac"]   # clipped to 1.5: ½·max(1², 1.5²)
    (1.125, 1.0)
    """
    if clip_range < 0:
        raise ValueError(f"clip_range must be >= 0, got {clip_range}")
    clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
    unclipped_error, clipped_error = (values - returns) ** 2, (clipped - returns) ** 2
    per_token = 0.5 * torch.maximum(unclipped_error, clipped_error)
    valid = mask.bool()
    count = valid.sum().clamp(min=1) if normalizer is None else normalizer
    loss = torch.where(valid, per_token, 0.0).sum() / count
    with torch.no_grad():
        clipfrac = masked_mean((clipped_error > unclipped_error).float(), mask).item()
    return loss, {"value_clipfrac": clipfrac}


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """``1 − Var(R − V) / Var(R)`` over unmasked tokens: 1 is a perfect critic, ≤ 0 no better than a constant."""
    valid = mask.bool()
    r, d = returns[valid].double(), (returns - values)[valid].double()
    return explained_variance_from_moments(r.mean().item(), (r**2).mean().item(), d.mean().item(),
                                           (d**2).mean().item())


def explained_variance_from_moments(mean_r: float, mean_r2: float, mean_d: float, mean_d2: float) -> float:
    """The same from ``E[R], E[R²], E[R − V], E[(R − V)²]`` — which add up across processes; NaN when the
    returns do not vary."""
    var_returns = mean_r2 - mean_r**2
    return float("nan") if var_returns <= 0 else 1 - (mean_d2 - mean_d**2) / var_returns


# --------------------------------------------------------------------------------------------------
# The value model


class ValueModel(nn.Module):
    """The policy's transformer (without its LM head), copied, with a scalar head: ``V(s)`` per position.

    Initialised from the policy's weights, so it starts with the policy's features; the head starts
    small so the first values are near 0.
    """

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.backbone = copy.deepcopy(policy.base_model)  # e.g. LlamaModel inside LlamaForCausalLM
        hidden = policy.config.hidden_size
        self.head = nn.Linear(hidden, 1)
        nn.init.normal_(self.head.weight, std=1 / math.sqrt(hidden + 1))
        nn.init.zeros_(self.head.bias)
        self.backbone.requires_grad_(True)

    def forward(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor
    ) -> Tensor:
        """``V(s_t)`` (N, T) float32 for each completion token: the state before the token, i.e. the
        hidden state at the position that predicted it (as ``sequence_logprobs`` reads the logits)."""
        width = completion_ids.shape[1]
        hidden = self.backbone(
            **sequence_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask), use_cache=False
        ).last_hidden_state[:, -width - 1 : -1]  # (N, T, H)
        return self.head(hidden).squeeze(-1).float()

    def completion_values(self, *inputs: Tensor) -> Tensor:
        """``self(*inputs)``, under the name that says what it returns (through ``__call__``, so that
        wrappers' hooks, FSDP2's included, run)."""
        return self(*inputs)

    def save(self, path: str | Path, state_dict: dict[str, Tensor] | None = None) -> None:
        """The backbone with ``save_pretrained`` (safetensors) and the head in ``value_head.safetensors``;
        ``state_dict``: this module's full state when its own parameters are shards."""
        path, state = Path(path), self.state_dict() if state_dict is None else state_dict
        part = lambda prefix: {k[len(prefix):]: v.detach().contiguous() for k, v in state.items()  # noqa: E731
                               if k.startswith(prefix)}
        self.backbone.save_pretrained(path, state_dict=part("backbone."), safe_serialization=True)
        save_file(part("head."), path / "value_head.safetensors")


# --------------------------------------------------------------------------------------------------
# The trainer


class PPOTrainer(GRPOTrainer):
    """PPO with the same rollout, rewards, logging, saving and CLI as GRPO (``algorithm: ppo``)."""

    def __init__(self, config, **kwargs: Any):
        if config.algorithm != "ppo":
            raise ConfigError(f"PPOTrainer needs algorithm: ppo, got {config.algorithm!r}")
        super().__init__(config, **kwargs)
        self.loss_beta = 0.0  # the KL is in the per-token reward, not the loss
        self.train_value_model = data_parallel(self.value_model, self.world, config.parallelism)
        self.value_optimizer, self.value_scheduler = self._adamw(
            self.value_model, config.value_learning_rate or config.learning_rate
        )

    def _copy_models(self) -> None:
        self.value_model = ValueModel(self.model).to(self.device)

    def training_step(self) -> dict[str, float]:
        config = self.config
        start = time.perf_counter()

        # 1-2. Sample B prompts × G completions from π_old and score them (as GRPO).
        batch, sampled, sampling = self.sampler.sample(self.model)
        rollout = batch.rollout
        sampled_time = time.perf_counter()
        loss_mask = self._loss_mask(rollout)

        # 3. Fixed for the update: π_old and π_ref log-probs, and the value model's estimates.
        old_logp = self._frozen_logprobs(self.model, rollout)
        ref_logp = self._reference_logprobs(rollout)
        old_values = self._frozen_values(rollout)
        frozen = time.perf_counter()

        # 4. Per-token rewards, then GAE advantages and returns (GRPO.md §4).
        rewards = self.token_rewards(batch, old_logp, ref_logp)
        advantages, returns = gae(rewards, old_values, loss_mask, config.gamma, config.lam)
        if config.whiten_advantages:
            moments = self._moments({"a": advantages}, loss_mask)
            advantages = whiten(advantages, loss_mask, moments=(moments["a"], moments["a²"] - moments["a"] ** 2))

        # 5. PPO epochs (μ) over minibatches: the clipped surrogate for the policy, the clipped value loss.
        self.train_value_model.train()
        first_update, update = self._optimize(
            rollout, advantages=advantages, loss_mask=loss_mask, old_logp=old_logp, ref_logp=ref_logp,
            returns=returns, old_values=old_values,
        )
        updated = time.perf_counter()

        # 6. Metrics: GRPO's, with the KL of the rollout policy, and the critic's.
        self.step += 1
        metrics = step_metrics(self.step, *self._whole(batch, sampled, sampling), first_update, update,
                               (start, sampled_time, frozen, updated))
        kl = kl_penalty(old_logp, ref_logp) if ref_logp is not None else torch.zeros_like(old_logp)
        m = self._moments({"kl": kl, "V": old_values, "R": returns, "R-V": returns - old_values}, loss_mask)
        metrics.update(
            kl=m["kl"], value_loss=update["value_loss"], value_clipfrac=update["value_clipfrac"],
            value_grad_norm=update["value_grad_norm"],
            explained_variance=explained_variance_from_moments(m["R"], m["R²"], m["R-V"], m["R-V²"]),
            value_mean=m["V"], return_mean=m["R"],
        )
        self._log(metrics, batch, advantages)
        return metrics

    def _moments(self, tensors: dict[str, Tensor], mask: Tensor) -> dict[str, float]:
        """Means of each tensor and of its square over the unmasked tokens of the whole batch (every
        process's): ``{"x": E[x], "x²": E[x²]}``."""
        valid = mask.bool()
        sums = {"n": float(valid.sum())}
        for name, tensor in tensors.items():
            picked = tensor[valid].double()
            sums[name], sums[name + "²"] = picked.sum().item(), (picked**2).sum().item()
        sums = all_sum_dict(sums, self.world)
        n = max(sums.pop("n"), 1.0)
        return {name: value / n for name, value in sums.items()}

    def token_rewards(self, batch: Batch, old_logp: Tensor, ref_logp: Tensor | None) -> Tensor:
        """(N, T): ``−β (logp − ref_logp)`` per token, plus the rule-based reward at the last token
        (process supervision: each step's weighted reward at the token that ends it)."""
        mask = batch.rollout.completion_mask
        rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        if ref_logp is not None:
            rewards -= self.config.beta * torch.where(mask.bool(), old_logp - ref_logp, 0.0)
        if batch.steps is None:
            last = (batch.rollout.lengths - 1).clamp(min=0)
            rows = torch.arange(mask.shape[0], device=mask.device)
            rewards[rows, last] += batch.rewards.to(mask.device) * (batch.rollout.lengths > 0)
        else:
            for i, steps in enumerate(batch.steps):
                for end, reward in steps:
                    rewards[i, end] += reward
        return rewards

    @torch.no_grad()
    def _frozen_values(self, rollout: Rollout) -> Tensor:
        self.value_model.eval()
        return torch.cat([
            self.value_model.completion_values(rollout.prompt_ids[idx], rollout.prompt_mask[idx],
                                               rollout.completion_ids[idx], rollout.completion_mask[idx])
            for idx in self._micro_batches(rollout)
        ])

    def _update(self, rollout, advantages, loss_mask, old_logp, ref_logp, returns, old_values, *,
                with_entropy: bool) -> dict[str, float]:
        """One optimizer step of the policy and one of the value model, on a minibatch."""
        stats = super()._update(rollout, advantages, loss_mask, old_logp, ref_logp, with_entropy=with_entropy)
        world = self.world
        total_tokens = max(1.0, all_sum(float(loss_mask.sum()), world))  # every process's tokens
        totals = {"value_loss": 0.0, "value_clipfrac": 0.0}
        micro_batches = self._micro_batches(rollout)
        for k, idx in enumerate(micro_batches):
            with gradient_sync(self.train_value_model, enabled=k == len(micro_batches) - 1):
                values = self.train_value_model(
                    rollout.prompt_ids[idx], rollout.prompt_mask[idx], rollout.completion_ids[idx],
                    rollout.completion_mask[idx],
                )
                loss, value_stats = value_loss(values, old_values[idx], returns[idx], loss_mask[idx],
                                               clip_range=self.config.cliprange_value, normalizer=total_tokens)
                (self.config.vf_coef * world.size * loss).backward()  # DDP averages over processes
            totals["value_loss"] += loss.item()
            totals["value_clipfrac"] += value_stats["value_clipfrac"] * float(loss_mask[idx].sum()) / total_tokens
        totals = all_sum_dict(totals, world)
        totals["value_grad_norm"], skipped = self._step(
            self.value_model, self.value_optimizer, self.value_scheduler, totals["value_loss"]
        )
        return {**stats, **totals, "skipped_updates": stats["skipped_updates"] + skipped}

    def checkpointed_modules(self) -> dict[str, nn.Module]:
        return {"value_model": self.value_model}

    def checkpointed_state(self) -> dict[str, Any]:
        return {**super().checkpointed_state(), "value_optimizer": self.value_optimizer,
                "value_scheduler": self.value_scheduler}

    def save(self, path: str | Path) -> None:
        """The policy as GRPO saves it, and the value model beside it in ``value_model/``."""
        super().save(path)
        state = full_state_dict(self.value_model, self.world)  # every process: a collective when sharded
        if self.world.main:
            self.value_model.save(Path(path).parent / "value_model", state)
