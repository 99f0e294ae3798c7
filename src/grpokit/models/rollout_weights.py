"""The weights completions are sampled with (``rollout_precision``): the policy itself, or a bfloat16 copy of it
that :meth:`RolloutWeights.refresh` brings up to date before each step's sampling. Decoding reads the weights once
per token, so on hardware that computes bfloat16 natively a copy of half the bytes samples faster; the loss keeps
the policy's precision and corrects for the difference (docs/math.md, "Sampling in a lower precision")."""

from __future__ import annotations

import copy

import torch
from torch import nn

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


class RolloutWeights:
    """What the sampler reads: :meth:`current`, the policy itself for ``fp32``, else its copy in ``precision``."""

    def __init__(self, policy: nn.Module, precision: str = "fp32"):
        if precision not in PRECISIONS:
            raise ValueError(f"rollout_precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        self.policy, self.precision = policy, precision
        dtype = PRECISIONS[precision]
        self.copy = None
        if dtype is not None:
            self.copy = copy.deepcopy(policy).eval().requires_grad_(False)
            for parameter in self.copy.parameters():  # buffers (the rotary frequencies) keep their precision
                parameter.data = parameter.data.to(dtype)

    @property
    def lowered(self) -> bool:
        """Whether the sampler reads a copy (whose log-probs the loss must correct for)."""
        return self.copy is not None

    @torch.no_grad()
    def current(self) -> nn.Module:
        """The model to sample from, holding the policy's weights as they are now (the copy refreshed first)."""
        if self.copy is None:
            return self.policy
        # parameters() lists a tied weight once, in the same order in the copy as in the policy
        for mine, theirs in zip(self.copy.parameters(), self.policy.parameters(), strict=True):
            mine.copy_(theirs)
        return self.copy
