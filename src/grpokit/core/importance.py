"""Importance sampling for completions sampled from a lower-precision copy of the policy (``rollout_precision``;
docs/math.md, "Sampling in a lower precision"): per token or per sequence, the ratio truncated at a cap or masked
above it — the four modes TRL names ``token_truncate``, ``token_mask``, ``sequence_truncate``, ``sequence_mask``."""

from __future__ import annotations

import torch
from torch import Tensor

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_weights(old_logp: Tensor, sample_logp: Tensor, mask: Tensor, cap: float,
                       mode: str = "sequence_mask") -> Tensor:
    """Weights (N, T) for tokens sampled from π_sample instead of π_old (docs/math.md, "Sampling in a lower
    precision"), from the ratio r = π_old / π_sample of each token (``token_*``) or of each whole completion, the
    product over its tokens (``sequence_*``, every token of the completion given its completion's weight):
    ``*_truncate``: min(r, cap); ``*_mask``: r where r ≤ cap, else 0 (the token or completion left out). 1 on
    padding. Without gradient: the weight rescales a term, it is not trained through.

    >>> old, sample = torch.tensor([[-1.0, -2.0, 0.0]]), torch.tensor([[-1.5, -1.0, 5.0]])
    >>> mask = torch.tensor([[1, 1, 0]])
    >>> importance_weights(old, sample, mask, cap=1.5, mode="token_truncate").tolist()  # e^0.5 = 1.65 → 1.5, e^-1
    [[1.5, 0.3678794503211975, 1.0]]
    >>> importance_weights(old, sample, mask, cap=1.5).tolist()  # sequence_mask: e^(0.5 − 1) = 0.61
    [[0.6065306663513184, 0.6065306663513184, 1.0]]
    """
    if mode not in IS_MODES:
        raise ValueError(f"the importance sampling mode must be one of {', '.join(IS_MODES)}, got {mode!r}")
    if old_logp.shape != sample_logp.shape:
        raise ValueError(f"old_logp and sample_logp must have the same shape, got {tuple(old_logp.shape)} and "
                         f"{tuple(sample_logp.shape)}")
    if cap < 1:
        raise ValueError(f"the importance weights' cap must be >= 1, got {cap}")
    valid = mask.bool()
    log_ratio = torch.where(valid, old_logp.detach() - sample_logp, 0.0)
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(log_ratio)
    ratio = torch.exp(log_ratio)
    weights = ratio.clamp(max=cap) if mode.endswith("truncate") else torch.where(ratio > cap, 0.0, ratio)
    return torch.where(valid, weights, 1.0)
