"""PPO, the baseline GRPO replaces (docs/math.md, "PPO"): a value model beside the policy, GAE advantages.

Per token ``t`` of completion ``i`` the reward is ``−β (logp − ref_logp)``, plus the completion's
rule-based reward at its last token (or, with ``supervision: process``, each step's reward at the
token that ends it). GAE over those rewards and the value model's estimates gives the advantages
(whitened over the batch) and the returns; the policy takes the same clipped surrogate as GRPO
(``grpo_loss`` with per-token advantages and no KL term: the KL is in the reward), and the value model
a clipped squared error on the returns. Everything else — rollout, rewards, the update's loops,
logging, saving, the CLI — is GRPO's: with ``algorithm: ppo`` the trainer holds a :class:`Critic` (the
value model, its optimizer and loss) and trains it as a second learner of the same update.

The value model is the cost GRPO removes: as many weights as the policy again, their gradients and
Adam states, and a forward and backward pass per batch. ``benchmarks/grpo_vs_ppo.py`` measures it.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from grpokit.core.objective import kl_penalty, masked_mean
from grpokit.core.optim import adamw_with_schedule
from grpokit.models.logprobs import sequence_inputs
from grpokit.rollout.generate import Rollout
from grpokit.training.distributed import World, all_sum_dict, data_parallel, full_state_dict
from grpokit.training.sampling import Batch
from grpokit.training.update import Learner, LossCounts, UpdateBatch

# --------------------------------------------------------------------------------------------------
# The math: pure functions on tensors. Shapes: (N, T) completion tokens, right-padded, mask 1 on real
# tokens (prefix of each row).


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation over each completion's tokens: ``(advantages, returns)``.

    ``δ_t = r_t + γ V_{t+1} − V_t`` with ``V`` = 0 after a completion's last token (the episode ends),
    ``A_t = Σ_l (γλ)^l δ_{t+l}``, ``returns = A + V``. ``rewards``, ``values``, ``mask``: (N, T).
    Masked positions are 0 in both outputs, whatever ``rewards`` and ``values`` hold there. A hole in the
    mask before a row's last token (an inserted tool result: context, not actions) is skipped, as in verl:
    ``V_{t+1}`` is the value at the next unmasked token, with no discount for the tokens between.

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
        # Masked columns carry both sums through unchanged: past a row's end they are still 0 there.
        running = torch.where(valid[:, t], delta + gamma * lam * running, running)
        advantages[:, t] = torch.where(valid[:, t], running, 0.0)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
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
    batch's). Returns the loss and ``value_clipfrac``: the share of tokens whose prediction moved more
    than ``clip_range`` from ``old_values``, so that the clip is active.

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
        # Compared directly, not as ``clipped != values``: old + (v − old) can land one ulp from v.
        clipfrac = masked_mean(((values - old_values).abs() > clip_range).float(), mask).item()
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

    def save(self, path: str | Path, state_dict: dict[str, Tensor] | None = None) -> None:
        """The backbone with ``save_pretrained`` (safetensors) and the head in ``value_head.safetensors``;
        ``state_dict``: this module's full state when its own parameters are shards."""
        path, state = Path(path), self.state_dict() if state_dict is None else state_dict
        part = lambda prefix: {k[len(prefix):]: v.detach().contiguous() for k, v in state.items()  # noqa: E731
                               if k.startswith(prefix)}
        self.backbone.save_pretrained(path, state_dict=part("backbone."), safe_serialization=True)
        save_file(part("head."), path / "value_head.safetensors")


# --------------------------------------------------------------------------------------------------
# The critic: PPO's state beside the policy, and its part of the step


def token_rewards(batch: Batch, old_logp: Tensor | None, ref_logp: Tensor | None, beta: float) -> Tensor:
    """(N, T): ``−β (old_logp − ref_logp)`` per token, plus each step's weighted reward at the token that
    ends it (outcome supervision: one step, the completion's reward at its last token)."""
    mask = batch.rollout.model_mask
    rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if ref_logp is not None:
        rewards -= beta * torch.where(mask.bool(), old_logp - ref_logp, 0.0)
    for i, steps in enumerate(batch.steps):
        for end, reward in steps:
            rewards[i, end] += reward
    return rewards


def moments(tensors: dict[str, Tensor], mask: Tensor, world: World) -> dict[str, float]:
    """Means of each tensor and of its square over the unmasked tokens of the whole batch (every
    process's): ``{"x": E[x], "x²": E[x²]}``."""
    valid = mask.bool()
    sums = {"n": float(valid.sum())}
    for name, tensor in tensors.items():
        picked = tensor[valid].double()
        sums[name], sums[name + "²"] = picked.sum().item(), (picked**2).sum().item()
    sums = all_sum_dict(sums, world)
    n = max(sums.pop("n"), 1.0)
    return {name: value / n for name, value in sums.items()}


class Critic:
    """PPO's value model with its optimizer, its schedule and its loss: a :class:`~grpokit.training.update.Learner`
    trained beside the policy, and the GAE advantages it gives the step."""

    def __init__(self, policy: nn.Module, config: Any, world: World, device: torch.device):
        self.config, self.world = config, world
        self.value_model = ValueModel(policy).to(device)  # copied before the policy is sharded
        train_module = data_parallel(self.value_model, world, config.parallelism)  # FSDP shards it in place
        optimizer, scheduler = adamw_with_schedule(  # over the parameters as sharded
            self.value_model, config, config.value_learning_rate or config.learning_rate
        )
        self.learner = Learner(prefix="value_", module=self.value_model, train_module=train_module,
                               optimizer=optimizer, scheduler=scheduler, loss=self.loss, loss_weight=config.vf_coef)

    def loss(self, model: nn.Module, batch: UpdateBatch, counts: LossCounts, first_pass: bool):
        """The clipped value loss of a micro-batch, over the minibatch's tokens."""
        values = model(*batch.rollout.sequences())
        loss, stats = value_loss(values, batch.old_values, batch.returns, batch.loss_mask,
                                 clip_range=self.config.cliprange_value, normalizer=counts.tokens)
        return loss, {"clipfrac": stats["value_clipfrac"]}

    @torch.no_grad()
    def frozen_values(self, rollout: Rollout) -> Tensor:
        """V(s_t) (N, T) at sampling time, micro-batch by micro-batch."""
        self.value_model.eval()
        values = [self.value_model(*micro.sequences()) for micro in rollout.split(self.config.micro_batch_size)]
        self.value_model.train()
        return torch.cat(values)

    def update_batch(self, batch: Batch, loss_mask: Tensor, old_logp: Tensor, ref_logp: Tensor | None) -> UpdateBatch:
        """The step's per-token rewards, GAE advantages (whitened over the batch) and returns."""
        config = self.config
        old_values = self.frozen_values(batch.rollout)
        rewards = token_rewards(batch, old_logp, ref_logp, config.beta)
        advantages, returns = gae(rewards, old_values, loss_mask, gamma=config.gamma, lam=config.lam)
        if config.whiten_advantages:
            m = moments({"a": advantages}, loss_mask, self.world)
            advantages = whiten(advantages, loss_mask, moments=(m["a"], m["a²"] - m["a"] ** 2))
        return UpdateBatch(batch.rollout, loss_mask, advantages, old_logp, ref_logp, returns, old_values)

    def metrics(self, fixed: UpdateBatch, last_pass: dict[str, float]) -> dict[str, float]:
        """The KL of the rollout policy (it is in the reward, not the loss) and the critic's diagnostics."""
        old_logp, ref_logp = fixed.old_logp, fixed.ref_logp
        kl = kl_penalty(old_logp, ref_logp) if ref_logp is not None else torch.zeros_like(old_logp)
        m = moments({"kl": kl, "V": fixed.old_values, "R": fixed.returns, "R-V": fixed.returns - fixed.old_values},
                    fixed.loss_mask, self.world)
        return {
            "kl": m["kl"], "value_loss": last_pass["value_loss"], "value_clipfrac": last_pass["value_clipfrac"],
            "value_grad_norm": last_pass["value_grad_norm"],
            "explained_variance": explained_variance_from_moments(m["R"], m["R²"], m["R-V"], m["R-V²"]),
            "value_mean": m["V"], "return_mean": m["R"],
        }

    def save(self, path: str | Path) -> None:
        """The value model in ``path`` (every process calls it: a sharded model is gathered first)."""
        state = full_state_dict(self.value_model, self.world)
        if self.world.main:
            self.value_model.save(path, state)
