"""PPO's math as pure functions on tensors (docs/math.md, "PPO"): GAE, whitening, the clipped value loss and
explained variance. Shapes: (N, T) completion tokens, right-padded, mask 1 on the tokens that count. The value
model and its training are :mod:`grpokit.algorithms.ppo`'s."""

from __future__ import annotations

import torch
from torch import Tensor

from grpokit.core.objective import masked_mean

__all__ = ["explained_variance", "explained_variance_from_moments", "gae", "value_loss", "whiten"]

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
