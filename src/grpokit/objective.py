"""The GRPO objective as pure functions on tensors (``shared/GRPO.md`` §2, §3, §5).

Notation, used in every shape comment: ``N`` completions (= B prompts × G generations, each group of
``G`` contiguous), ``T`` completion tokens (right-padded), ``V`` vocabulary size.

No function here sees a model, a config or a global: each takes tensors and plain options, and each
option is handled by one ``if/elif`` that raises ``ValueError`` listing the valid values.
"""

from __future__ import annotations

import torch
from torch import Tensor

SCALES = ("group", "batch", "none")
KL_KINDS = ("k1", "k2", "k3")
AGGREGATIONS = ("sequence", "token", "constant")
RATIO_LEVELS = ("token", "sequence")


def _check_choice(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {', '.join(map(repr, valid))}")


def _check_same_shape(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{name_a} has shape {tuple(a.shape)} but {name_b} has shape {tuple(b.shape)}")


# --------------------------------------------------------------------------------------------------
# §2 Advantages


def zero_variance_groups(rewards: Tensor, group_size: int) -> Tensor:
    """(B,) bool: the groups whose ``group_size`` rewards are all equal, which carry no signal."""
    grouped = rewards.view(-1, group_size)
    return (grouped == grouped[:, :1]).all(dim=1)


def group_advantages(rewards: Tensor, group_size: int, *, scale: str = "group", eps: float = 1e-4) -> Tensor:
    """Outcome-supervision advantages ``A_i = (r_i − mean(group)) / (std + eps)``, one per completion.

    ``rewards``: (N,), each group of ``group_size`` completions contiguous. ``scale``: ``"group"``
    divides by the group's std (the paper), ``"batch"`` by the std of all N rewards, ``"none"`` only
    subtracts the group mean (Dr. GRPO). Std is the unbiased sample std. A group whose rewards are all
    equal carries no signal and gets exactly 0.

    >>> group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), 2).tolist()
    [0.7070..., -0.7070..., 0.0, 0.0]
    """
    _check_choice("scale", scale, SCALES)
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape (N,), got {tuple(rewards.shape)}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"group_size={group_size} does not divide the number of rewards N={rewards.numel()}"
        )
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf")
    if group_size == 1:  # a group of one has no spread, hence no signal
        return torch.zeros_like(rewards, dtype=torch.float32)
    grouped = rewards.float().view(-1, group_size)  # (B, G)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        advantages = centered / (grouped.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        advantages = centered / (rewards.float().std() + eps)
    else:  # "none"
        advantages = centered
    # Exactly 0, not a rounding residue of the mean.
    zero_variance = zero_variance_groups(grouped, group_size).unsqueeze(1)  # (B, 1)
    advantages = torch.where(zero_variance, torch.zeros_like(advantages), advantages)
    return advantages.view(-1)


# --------------------------------------------------------------------------------------------------
# §5 Log-probs of the sampled tokens


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log π(token) under ``softmax(logits / temperature)``, in float32: gather, then logsumexp.

    ``logits``: (..., V) in any dtype; ``tokens``: (...) integer. Returns (...) float32. Rows are
    processed one at a time for half-precision logits so that only one row's float32 copy of the
    vocabulary exists at once.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits has shape {tuple(logits.shape)} but tokens has shape {tuple(tokens.shape)}")
    if logits.dtype == torch.float32 or logits.dim() < 2:
        scaled = logits.float() / temperature
        picked = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(scaled, dim=-1)
    rows = [token_logprobs(row.float(), row_tokens, temperature) for row, row_tokens in zip(logits, tokens)]
    return torch.stack(rows)


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` per position, float32: (..., V) → (...)."""
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logprobs.exp() * logprobs).sum(dim=-1)


# --------------------------------------------------------------------------------------------------
# §3 The objective


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from the sampled tokens' log-probs.

    ``"k1"``: logp − ref_logp; ``"k2"``: ½(logp − ref_logp)²; ``"k3"`` (the paper's, unbiased and
    non-negative): exp(ref_logp − logp) − (ref_logp − logp) − 1.
    """
    _check_choice("kind", kind, KL_KINDS)
    _check_same_shape("logp", logp, "ref_logp", ref_logp)
    log_ratio = ref_logp - logp
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    return torch.exp(log_ratio) - log_ratio - 1


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` where ``mask`` is 1; an all-masked row gives 0, not NaN."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def aggregate_loss(
    per_token: Tensor,
    mask: Tensor,
    aggregation: str = "sequence",
    *,
    max_completion_length: int | None = None,
    normalizer: float | None = None,
) -> Tensor:
    """Reduce an (N, T) matrix of per-token terms to one number (GRPO.md §3, "Loss aggregation").

    - ``"sequence"``: mean over each completion's tokens, then ``sum over completions / normalizer``
      (the paper: 1/G Σ_i 1/|o_i| Σ_t). An empty completion adds 0 and still counts.
    - ``"token"``: sum over all unmasked tokens ``/ normalizer`` (DAPO).
    - ``"constant"``: sum over all unmasked tokens ``/ (normalizer · max_completion_length)`` (Dr. GRPO).

    ``normalizer`` defaults to this call's own count — completions for ``"sequence"`` and
    ``"constant"``, unmasked tokens for ``"token"``. A caller that splits a batch into micro-batches
    (or ranks) passes the whole batch's count, so the summed losses equal the loss of the whole batch.
    """
    _check_choice("aggregation", aggregation, AGGREGATIONS)
    _check_same_shape("per_token", per_token, "mask", mask)
    mask = mask.to(per_token.dtype)
    if aggregation == "sequence":
        per_sequence = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_sequence.sum() / (per_token.shape[0] if normalizer is None else normalizer)
    if aggregation == "token":
        total = (per_token * mask).sum()
        return total / (mask.sum().clamp(min=1) if normalizer is None else normalizer)
    if max_completion_length is None or max_completion_length < 1:
        raise ValueError(
            f"aggregation='constant' requires max_completion_length >= 1, got {max_completion_length!r}"
        )
    count = per_token.shape[0] if normalizer is None else normalizer
    return (per_token * mask).sum() / (count * max_completion_length)


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.04,
    aggregation: str = "sequence",
    ratio_level: str = "token",
    max_completion_length: int | None = None,
    kl_kind: str = "k3",
    normalizer: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The negative GRPO objective (GRPO.md §3) and its diagnostics.

    Per token: ``min(ρA, clip(ρ, 1−epsilon, 1+epsilon_high)·A) − beta·D``, ρ = exp(logp − old_logp),
    D = ``kl_penalty(logp, ref_logp, kl_kind)``; the loss is minus its aggregate (see
    :func:`aggregate_loss`). Shapes: ``logp``, ``old_logp``, ``ref_logp``, ``mask``: (N, T);
    ``advantages``: (N,) or (N, T).

    ``old_logp=None`` means π_old = π_θ (μ = 1): ρ is 1 in value but carries the gradient.
    ``ref_logp`` may be None only when ``beta == 0``. ``ratio_level="sequence"`` uses one ratio per
    completion, exp of the mean over its tokens of logp − old_logp (the R1 paper's form).

    The returned dict holds floats: ``kl`` (mean per-token KL, 0 without a reference), ``clipfrac_low``
    (fraction of tokens where ρ < 1−ε with A < 0, so the clip binds), ``clipfrac_high`` (ρ > 1+ε_high
    with A > 0), ``clipfrac`` (their sum), ``ratio_mean``.
    """
    _check_choice("aggregation", aggregation, AGGREGATIONS)
    _check_choice("ratio_level", ratio_level, RATIO_LEVELS)
    _check_choice("kl_kind", kl_kind, KL_KINDS)
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    if epsilon < 0 or epsilon_high < 0:
        raise ValueError(f"epsilon and epsilon_high must be >= 0, got {epsilon} and {epsilon_high}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if logp.dim() != 2:
        raise ValueError(f"logp must have shape (N, T), got {tuple(logp.shape)}")
    _check_same_shape("logp", logp, "mask", mask)
    if old_logp is not None:
        _check_same_shape("logp", logp, "old_logp", old_logp)
    if ref_logp is None:
        if beta != 0:
            raise ValueError(f"ref_logp is None but beta={beta}; pass ref_logp or set beta=0")
    else:
        _check_same_shape("logp", logp, "ref_logp", ref_logp)
    if advantages.dim() == 1:
        if advantages.shape[0] != logp.shape[0]:
            raise ValueError(
                f"advantages has shape {tuple(advantages.shape)} but logp has shape {tuple(logp.shape)}"
            )
        advantages = advantages.unsqueeze(1)  # (N, 1)
    else:
        _check_same_shape("advantages", advantages, "logp", logp)

    valid = mask.bool()
    mask = mask.to(logp.dtype)
    old_logp = logp.detach() if old_logp is None else old_logp
    # Padded positions get a log-ratio of 0 before any exp: whatever values they hold, they can then
    # produce neither inf·0 = NaN in the loss nor NaN gradients.
    log_ratio = torch.where(valid, logp - old_logp, 0.0)  # (N, T)
    if ratio_level == "sequence":
        log_ratio = masked_mean(log_ratio, mask, dim=1).unsqueeze(1)  # (N, 1)
    ratio = torch.exp(log_ratio).expand_as(logp)  # (N, T)
    clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    per_token = torch.min(ratio * advantages, clipped_ratio * advantages)  # (N, T)

    kl = kl_penalty(logp, torch.where(valid, ref_logp, logp), kl_kind) if ref_logp is not None else None
    if beta != 0:
        per_token = per_token - beta * kl

    loss = -aggregate_loss(
        per_token, mask, aggregation, max_completion_length=max_completion_length, normalizer=normalizer
    )

    with torch.no_grad():
        low = ((ratio < 1 - epsilon) & (advantages < 0)).to(logp.dtype)
        high = ((ratio > 1 + epsilon_high) & (advantages > 0)).to(logp.dtype)
        stats = {
            "kl": masked_mean(kl, mask).item() if kl is not None else 0.0,
            "clipfrac_low": masked_mean(low, mask).item(),
            "clipfrac_high": masked_mean(high, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
        }
        stats["clipfrac"] = stats["clipfrac_low"] + stats["clipfrac_high"]
    return loss, stats
