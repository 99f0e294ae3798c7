"""Int8 products for sampling (``rollout_precision: int8``): the weights quantized per output channel, each row of
activations quantized on the fly, the product summed in integers (``torch._int_mm``) and rescaled
(docs/math.md, "Sampling in a lower precision").

A language model's activations have a few channels far larger than the rest (SmolLM2: 2,000× the median going into
a late ``down_proj``); quantized per row, they would leave the other channels a few levels of 255. So each product
is calibrated on its first call, decoding's prefill (every prompt token, computed in the weights' precision):

- smoothing (SmoothQuant, α = ½): ``x Wᵀ = (x / s)(W · s)ᵀ`` with ``s_j = √(a_j / w_j)`` per input channel, ``a_j``
  the largest ``|x_j|`` seen (floored at ``FLOOR`` × the largest channel's) and ``w_j`` the largest ``|W_{·j}|``:
  activations and weights share the range;
- the ``OUTLIERS`` channels still largest after it are multiplied in float (LLM.int8()'s decomposition);
- the rest in int8.

Decoding builds its products from the policy's weights at every call (:mod:`grpokit.models.fast.decode`), so the
sampler never reads weights older than the policy's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

FLOOR = 0.05  # a channel quiet in the prompts is smoothed as if it reached this fraction of the loudest
OUTLIERS = 8  # channels per product multiplied in float


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 quantization of each row of ``x`` (..., K), float32, overwritten: ``(q int8 (..., K), scale
    float32 (...))`` with ``x ≈ scale[..., None] * q``. A row of zeros gets scale 1 (and zeros)."""
    scale = x.abs().amax(dim=-1) / 127  # (linalg.vector_norm's ord=inf is several times slower on the CPU)
    scale = torch.where(scale > 0, scale, 1.0)
    return x.div_(scale.unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8), scale


def smoothing(activation_max: Tensor, weight: Tensor) -> Tensor:
    """SmoothQuant's factors (α = ½) per input channel: ``s_j = √(a_j / w_j)`` with ``a_j`` floored at ``FLOOR`` ×
    max a and ``w_j = max_o |W_{o,j}|``; ``x / s`` and ``W · s`` then peak alike (√(a_j w_j) both)."""
    a = torch.maximum(activation_max, FLOOR * activation_max.max())
    w = weight.abs().amax(dim=0)
    return torch.where((a > 0) & (w > 0), (a / w.clamp(min=1e-30)).sqrt(), 1.0)


class Int8Product:
    """``f(x, add=None)`` ≈ ``F.linear(x, weight, bias) + add`` on rows ``x`` (..., in), in ``x``'s dtype: the first
    call exact, and calibrating (module docstring); the later ones in int8 but for ``OUTLIERS`` channels."""

    def __init__(self, weight: Tensor, bias: Tensor | None):
        if weight.device.type != "cpu":
            raise ValueError("int8 products run on the CPU (torch._int_mm); on a GPU sample in bf16")
        self.weight, self.bias = weight.detach().float(), None if bias is None else bias.detach().float()
        self.calibrated = False

    @torch.no_grad()
    def calibrate(self, rows: Tensor) -> None:
        """Smoothing, outliers and the int8 weights from the largest activations per channel in ``rows`` (R, in)."""
        activation_max = rows.abs().amax(dim=0)
        scale = smoothing(activation_max, self.weight)
        self.outliers = (activation_max / scale).topk(min(OUTLIERS, scale.numel())).indices
        self.outlier_weight = self.weight[:, self.outliers].t().contiguous()  # (k, out), unsmoothed: in float
        # x / s with the outliers' channels zeroed: one multiplication leaves them out of the int8 part
        self.inverse = scale.reciprocal().index_fill_(0, self.outliers, 0.0)
        weight_q, weight_scale = quantize_rows((self.weight * scale).index_fill_(1, self.outliers, 0.0))
        self.weight_scale = weight_scale / 127  # with x's scale / 127: one multiplication per call
        self.weight_t = weight_q.t()  # a view: _int_mm reads the (in, out) layout without a copy
        self.calibrated = True
        del self.weight  # from now on decoding reads the int8 copy and the outliers' columns

    def __call__(self, x: Tensor, add: Tensor | None = None) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if not self.calibrated:
            rows = rows.float()
            out = F.linear(rows, self.weight, self.bias)
            self.calibrate(rows)
        else:  # as few operators as will do: at a few rows each one's fixed cost is much of the product's
            out = rows[:, self.outliers].float() @ self.outlier_weight
            smoothed = rows * self.inverse
            x_scale = smoothed.abs().amax(dim=1, keepdim=True).clamp_(min=1e-30)
            x_q = smoothed.mul_(127 / x_scale).round_().to(torch.int8)
            out.addcmul_(torch._int_mm(x_q, self.weight_t).float(), x_scale * self.weight_scale)
            if self.bias is not None:
                out += self.bias
        out = out.view(*x.shape[:-1], -1).to(x.dtype)
        return out if add is None else out.add_(add)
