"""The GRPO objective as pure functions on tensors (docs/math.md: advantages, the objective, numerical care).

Notation, used in every shape comment: ``N`` completions (= B prompts × G generations, each group of
``G`` contiguous), ``T`` completion tokens (right-padded), ``V`` vocabulary size.

No function here sees a model, a config or a global: each takes tensors and plain options, and each
option is handled by one ``if/elif`` that raises ``ValueError`` listing the valid values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from grpokit.core.importance import importance_weights

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


def group_advantages(
    rewards: Tensor, group_size: int, *, scale: str = "group", eps: float = 1e-4, batch_std: float | None = None
) -> Tensor:
    """Outcome-supervision advantages ``A_i = (r_i − mean(group)) / (std + eps)``, one per completion.

    ``rewards``: (N,), each group of ``group_size`` completions contiguous. ``scale``: ``"group"``
    divides by the group's std (the paper), ``"batch"`` by the std of all N rewards, ``"none"`` only
    subtracts the group mean (Dr. GRPO). Std is the unbiased sample std. A group whose rewards are all
    equal carries no signal and gets exactly 0. ``batch_std`` replaces the std of ``rewards`` for
    ``"batch"`` (a data-parallel caller passes the std of the whole batch across processes).

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
        advantages = centered / ((rewards.float().std() if batch_std is None else batch_std) + eps)
    else:  # "none"
        advantages = centered
    # Exactly 0, not a rounding residue of the mean.
    zero_variance = zero_variance_groups(grouped, group_size).unsqueeze(1)  # (B, 1)
    advantages = torch.where(zero_variance, torch.zeros_like(advantages), advantages)
    return advantages.view(-1)


def _flatten_steps(step_rewards: Sequence[Sequence[float]], step_ends: Sequence[Sequence[int]],
                   width: int) -> tuple[list[int], list[int], list[float]]:
    """Every step of the batch, checked, as (completion, end token, reward) columns."""
    rows, cols, values = [], [], []
    for i, (rewards_i, ends_i) in enumerate(zip(step_rewards, step_ends)):
        if len(rewards_i) != len(ends_i):
            raise ValueError(f"completion {i}: {len(rewards_i)} step rewards but {len(ends_i)} step ends")
        for j, end in enumerate(ends_i):
            if not 0 <= end < width:
                raise ValueError(f"completion {i}: step {j} ends at token {end}, outside [0, {width})")
            if j and end <= ends_i[j - 1]:
                raise ValueError(f"completion {i}: step ends must increase, got {list(ends_i)}")
            if not math.isfinite(rewards_i[j]):
                raise ValueError(f"completion {i}: step {j} has reward {rewards_i[j]}")
        rows += [i] * len(ends_i)
        cols += list(ends_i)
        values += [float(r) for r in rewards_i]
    return rows, cols, values


def process_advantages(
    step_rewards: Sequence[Sequence[float]],
    step_ends: Sequence[Sequence[int]],
    mask: Tensor,
    group_size: int,
    *,
    scale: str = "group",
    eps: float = 1e-4,
    batch_std: float | None = None,
) -> Tensor:
    """Process-supervision advantages (docs/math.md, "Process supervision"), one per token: (N, T).

    ``step_rewards[i]``: the rewards of completion i's steps; ``step_ends[i]``: the 0-based token
    index at which each step ends (same length, strictly increasing, < T). Every step reward of a
    group is normalised together, ``r̃ = (r − mean(R)) / (std(R) + eps)`` with R the pooled step
    rewards of the group's G completions (unbiased std), and ``A[i, t] = Σ_{steps j of i ending at
    or after t} r̃_j``. Tokens after a completion's last step, and masked tokens, get 0; a group
    whose step rewards are all equal gets 0; a completion with no steps gets 0 everywhere.

    ``scale``: ``"group"`` as above, ``"batch"`` divides by the std of all the batch's step rewards,
    ``"none"`` only subtracts the group mean — the same choices as :func:`group_advantages`, and the
    same ``batch_std`` override.

    >>> mask = torch.ones(2, 3)
    >>> process_advantages([[1.0, 0.0], [1.0]], [[0, 2], [1]], mask, 2, scale="none").tolist()
    [[-0.3333..., -0.6666..., -0.6666...], [0.3333..., 0.3333..., 0.0]]
    """
    _check_choice("scale", scale, SCALES)
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if mask.dim() != 2:
        raise ValueError(f"mask must have shape (N, T), got {tuple(mask.shape)}")
    n, width = mask.shape
    if len(step_rewards) != n or len(step_ends) != n:
        raise ValueError(f"step_rewards and step_ends need one list per completion: N={n}, "
                         f"got {len(step_rewards)} and {len(step_ends)}")
    if n % group_size != 0:
        raise ValueError(f"group_size={group_size} does not divide the number of completions N={n}")
    rows, cols, values = _flatten_steps(step_rewards, step_ends, width)
    rewards = torch.tensor(values, dtype=torch.float32)  # (S,) every step of the batch, in order
    row = torch.tensor(rows, dtype=torch.long)
    group = row // group_size
    num_groups = n // group_size

    # Pooled mean and unbiased std per group over its steps (scatter sums; S is small).
    count = torch.zeros(num_groups).index_add_(0, group, torch.ones_like(rewards))
    mean = torch.zeros(num_groups).index_add_(0, group, rewards) / count.clamp(min=1)
    centered = rewards - mean[group]
    if scale == "group":
        var = torch.zeros(num_groups).index_add_(0, group, centered**2) / (count - 1).clamp(min=1)
        normalized = centered / (var.sqrt()[group] + eps)
    elif scale == "batch":
        std = (rewards.std() if rewards.numel() > 1 else 0.0) if batch_std is None else batch_std
        normalized = centered / (std + eps)
    else:  # "none"
        normalized = centered
    # Exactly 0 for a group whose step rewards are all equal, not a rounding residue of the mean.
    distinct: list[set[float]] = [set() for _ in range(num_groups)]
    for g, value in zip(group.tolist(), values):
        distinct[g].add(value)
    constant = torch.tensor([len(d) <= 1 for d in distinct], dtype=torch.bool)
    normalized = torch.where(constant[group], 0.0, normalized)

    # Place each step's r̃ at its end token, then sum from the right: A[i, t] = Σ_{end ≥ t} r̃.
    at_ends = torch.zeros(n, width).index_put_((row, torch.tensor(cols, dtype=torch.long)), normalized)
    advantages = at_ends.flip(1).cumsum(1).flip(1)
    return (advantages * mask.to(advantages.dtype).cpu()).to(mask.device)


# --------------------------------------------------------------------------------------------------
# §5 Log-probs of the sampled tokens


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log π(token) under ``softmax(logits / temperature)``, in float32 (float64 for float64 logits):
    gather, then logsumexp.

    ``logits``: (..., V) in any dtype; ``tokens``: (...) integer. Returns (...). Rows are processed one at
    a time for half-precision logits so that only one row's float32 copy of the vocabulary exists at once.
    :mod:`grpokit.models.chunked_logprobs` computes the same from the hidden states, a chunk of tokens at a time.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits has shape {tuple(logits.shape)} but tokens has shape {tuple(tokens.shape)}")
    if logits.dtype in (torch.float32, torch.float64) or logits.dim() < 2:
        scaled = _wide(logits) / temperature if temperature != 1.0 else _wide(logits)
        picked = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(scaled, dim=-1)
    rows = [token_logprobs(row.float(), row_tokens, temperature) for row, row_tokens in zip(logits, tokens)]
    return torch.stack(rows)


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` per position, float32 (float64 for float64 logits):
    (..., V) → (...)."""
    logprobs = torch.log_softmax(_wide(logits) / temperature, dim=-1)
    return -(logprobs.exp() * logprobs).sum(dim=-1)


def _wide(logits: Tensor) -> Tensor:
    """``logits`` in float32, or as they are when wider (float64 tests compare gradients to 1e-6)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


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
    # expm1: exp(r) − 1 rounds to float32's spacing near 1 (~1e-7), which would swamp the r²/2 of a small log-ratio
    return torch.expm1(log_ratio) - log_ratio


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
    num_sequences: float | None = None,
    num_tokens: float | None = None,
) -> Tensor:
    """Reduce an (N, T) matrix of per-token terms to one number (docs/math.md, "Loss aggregation").

    - ``"sequence"``: mean over each completion's tokens, then ``sum over completions / num_sequences``
      (the paper: 1/G Σ_i 1/|o_i| Σ_t). An empty completion adds 0 and still counts.
    - ``"token"``: sum over all unmasked tokens ``/ num_tokens`` (DAPO).
    - ``"constant"``: sum over all unmasked tokens ``/ (num_sequences · max_completion_length)`` (Dr. GRPO).

    The denominator is chosen here, from the counts given: ``num_sequences`` and ``num_tokens`` default to
    this call's own (N and the unmasked tokens). A caller that splits a batch into micro-batches (or
    processes) passes the whole batch's counts, so the summed losses equal the loss of the whole batch.

    >>> per_token, mask = torch.tensor([[1.0, 3.0], [2.0, 0.0]]), torch.tensor([[1, 1], [1, 0]])
    >>> [aggregate_loss(per_token, mask, a, max_completion_length=4).item() for a in AGGREGATIONS]
    [2.0, 2.0, 0.75]
    """
    _check_choice("aggregation", aggregation, AGGREGATIONS)
    _check_same_shape("per_token", per_token, "mask", mask)
    mask = mask.to(per_token.dtype)
    sequences = per_token.shape[0] if num_sequences is None else num_sequences
    if aggregation == "sequence":
        per_sequence = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_sequence.sum() / sequences
    if aggregation == "token":
        return (per_token * mask).sum() / (mask.sum().clamp(min=1) if num_tokens is None else num_tokens)
    if max_completion_length is None or max_completion_length < 1:
        raise ValueError(
            f"aggregation='constant' requires max_completion_length >= 1, got {max_completion_length!r}"
        )
    return (per_token * mask).sum() / (sequences * max_completion_length)


def _check_loss_inputs(logp: Tensor, old_logp: Tensor | None, ref_logp: Tensor | None, advantages: Tensor,
                       mask: Tensor, beta: float) -> Tensor:
    """``grpo_loss``'s tensors checked against ``logp``'s (N, T); returns the advantages as (N, 1) or (N, T)."""
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
        return advantages.unsqueeze(1)  # (N, 1)
    _check_same_shape("advantages", advantages, "logp", logp)
    return advantages


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
    num_sequences: float | None = None,
    num_tokens: float | None = None,
    sample_logp: Tensor | None = None,
    is_cap: float = 3.0,
    is_mode: str = "sequence_mask",
    kl_weighted: bool = False,
) -> tuple[Tensor, dict[str, float]]:
    """The negative GRPO objective (docs/math.md, "The objective") and its diagnostics.

    Per token: ``min(ρA, clip(ρ, 1−epsilon, 1+epsilon_high)·A) − beta·D``, ρ = exp(logp − old_logp),
    D = ``kl_penalty(logp, ref_logp, kl_kind)``; the loss is minus its aggregate (see :func:`aggregate_loss`,
    which takes ``num_sequences`` and ``num_tokens``). Shapes: ``logp``, ``old_logp``, ``ref_logp``,
    ``mask``: (N, T); ``advantages``: (N,) or (N, T).

    ``kl_weighted``: D weighted by ρ (its gradient too), as TRL's ``use_bias_correction_kl`` (docs/math.md, "KL to
    the reference"). ``old_logp=None`` means π_old = π_θ (μ = 1): ρ is 1 in value but carries the gradient.
    ``ref_logp`` may be None only when ``beta == 0``. ``ratio_level="sequence"`` uses one ratio per
    completion, exp of the mean over its tokens of logp − old_logp (the R1 paper's form).

    ``sample_logp`` (N, T): the tokens were sampled from a lower-precision copy of π_old with these log-probs; each
    token's clipped term is then weighted by :func:`~grpokit.core.importance.importance_weights` (``is_mode``, the
    cap ``is_cap``), and the KL term is not (docs/math.md, "Sampling in a lower precision"). None: sampled from
    π_old itself.

    The returned dict holds floats: ``kl`` (mean per-token KL, 0 without a reference), ``clipfrac_low``
    (fraction of tokens where ρ < 1−ε with A < 0, so the clip binds), ``clipfrac_high`` (ρ > 1+ε_high
    with A > 0), ``clipfrac`` (their sum), ``ratio_mean``; with ``sample_logp`` also ``sampler_kl`` (KL(π_sample ‖
    π_old) per token, the k3 estimate on the sampled tokens), ``is_weight_mean`` and ``is_capped_frac`` (tokens whose
    weight the cap cut, or zeroed in a ``*_mask`` mode).
    """
    _check_choice("aggregation", aggregation, AGGREGATIONS)
    _check_choice("ratio_level", ratio_level, RATIO_LEVELS)
    _check_choice("kl_kind", kl_kind, KL_KINDS)
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    if epsilon < 0 or epsilon_high < 0:
        raise ValueError(f"epsilon and epsilon_high must be >= 0, got {epsilon} and {epsilon_high}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    advantages = _check_loss_inputs(logp, old_logp, ref_logp, advantages, mask, beta)

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
    if sample_logp is not None:
        weights = importance_weights(old_logp, sample_logp, mask, is_cap, is_mode)
        per_token = per_token * weights

    kl = kl_penalty(logp, torch.where(valid, ref_logp, logp), kl_kind) if ref_logp is not None else None
    if beta != 0:
        per_token = per_token - beta * (kl * ratio if kl_weighted else kl)

    loss = -aggregate_loss(per_token, mask, aggregation, max_completion_length=max_completion_length,
                           num_sequences=num_sequences, num_tokens=num_tokens)

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
        if sample_logp is not None:
            sampled = torch.where(valid, sample_logp, old_logp)
            stats["sampler_kl"] = masked_mean(kl_penalty(sampled, old_logp, "k3"), mask).item()
            stats["is_weight_mean"] = masked_mean(weights, mask).item()
            cut = weights.ge(is_cap) if is_mode.endswith("truncate") else weights.eq(0)
            stats["is_capped_frac"] = masked_mean(cut.to(mask.dtype), mask).item()
    return loss, stats
