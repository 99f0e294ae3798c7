"""The weights completions are sampled with (``rollout_precision``): the policy itself; a bfloat16 copy of it that
:meth:`RolloutWeights.refresh` brings up to date before each step's sampling; the policy under bfloat16 autocast
(``bf16_autocast``: its decode steps' products in bfloat16, the prompts' prefill, residual stream, norms, cache and
LM head in float32); or the policy's weights quantized to int8 by the fast decoding path at each sampling call
(:mod:`grpokit.models.fast.int8`).
Decoding reads the weights once per token, so fewer bytes per weight sample faster where the hardware computes in
that precision; the loss keeps the policy's precision and corrects for the difference (docs/math.md, "Sampling in a
lower precision")."""

from __future__ import annotations

import copy

import torch
from torch import nn

from grpokit.models.fast.llama_family import unsupported

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "bf16_autocast": None, "int8": torch.int8}


class RolloutWeights:
    """What the native sampler reads: :meth:`current`, the policy itself for ``fp32``, ``bf16_autocast`` (with
    :attr:`autocast` the sampler runs it under autocast) and ``int8`` (with :attr:`int8` decoding quantizes it), its
    copy for ``bf16`` (made now, brought up to date by :meth:`refresh`)."""

    def __init__(self, policy: nn.Module, precision: str = "fp32"):
        if precision not in PRECISIONS:
            raise ValueError(f"rollout_precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        self.policy, self.precision = policy, precision
        dtype = PRECISIONS[precision]
        self.copy = None
        if precision == "int8":  # no copy: decoding quantizes the policy's weights at every call (never stale)
            why = unsupported(policy)
            device = next(policy.parameters()).device
            if why is not None or device.type != "cpu":
                raise ValueError("rollout_precision: int8 samples on the CPU with the fast path's int8 products, "
                                 f"which this model cannot take ({why or f'it is on {device}'}); use bf16 or fp32")
        elif dtype is not None:
            self.copy = copy.deepcopy(policy).eval().requires_grad_(False)
            for parameter in self.copy.parameters():  # buffers (the rotary frequencies) keep their precision
                parameter.data = parameter.data.to(dtype)

    @property
    def lowered(self) -> bool:
        """Whether the sampler reads lower-precision weights (whose log-probs the loss must correct for)."""
        return self.precision != "fp32"

    @property
    def int8(self) -> bool:
        """Whether decoding must quantize the weights it is given (``generate(int8=True)``)."""
        return self.precision == "int8"

    @property
    def autocast(self) -> bool:
        """Whether the sampler runs the policy under bfloat16 autocast, the prompts read in float32."""
        return self.precision == "bf16_autocast"

    @torch.no_grad()
    def refresh(self) -> None:
        """Bring the copy (if any) up to the policy's weights as they are now."""
        if self.copy is None:
            return
        # parameters() lists a tied weight once, in the same order in the copy as in the policy
        for mine, theirs in zip(self.copy.parameters(), self.policy.parameters(), strict=True):
            mine.copy_(theirs)

    def current(self) -> nn.Module:
        """The model to sample from: the policy, or its copy as of the last :meth:`refresh`."""
        return self.policy if self.copy is None else self.copy
