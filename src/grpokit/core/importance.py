"""Truncated importance sampling: the correction of the loss for completions sampled from a lower-precision copy
of the policy (``rollout_precision``; docs/math.md, "Sampling in a lower precision")."""

from __future__ import annotations

import torch
from torch import Tensor


def truncated_importance_weights(old_logp: Tensor, sample_logp: Tensor, mask: Tensor, cap: float) -> Tensor:
    """Per-token weights ``min(π_old / π_sample, cap)`` = min(exp(old_logp − sample_logp), cap) that correct for
    sampling from a copy of π_old in a lower precision (docs/math.md, "Sampling in a lower precision"); 1 on
    padding. Without gradient: the weight rescales the token's term, it is not trained through.

    >>> truncated_importance_weights(torch.tensor([[-1.0, -2.0, 0.0]]), torch.tensor([[-1.5, -1.0, 5.0]]),
    ...                              torch.tensor([[1, 1, 0]]), cap=1.5).tolist()
    [[1.5, 0.3678794503211975, 1.0]]
    """
    if old_logp.shape != sample_logp.shape:
        raise ValueError(f"old_logp and sample_logp must have the same shape, got {tuple(old_logp.shape)} and "
                         f"{tuple(sample_logp.shape)}")
    if cap < 1:
        raise ValueError(f"the importance weights' cap must be >= 1, got {cap}")
    log_ratio = torch.where(mask.bool(), old_logp.detach() - sample_logp, 0.0)
    return torch.exp(log_ratio).clamp(max=cap)
