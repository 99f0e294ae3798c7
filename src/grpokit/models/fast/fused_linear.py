"""Linear layers as the fast path runs them: several layers on the same input as one product, with an
RMSNorm's weight and an output permutation folded into the weights, and for decoding on the CPU the
larger weights packed once for oneDNN.

Layers that are not plain ``nn.Linear`` (a LoRA adapter, a quantised layer) or that carry forward hooks
are called as modules, so that wrappers and hooks see their calls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpokit.models.fast.int8 import Int8Product

ONEDNN_MIN_WEIGHTS = 150_000  # smaller decode products stay with MKL: oneDNN's fixed cost per call outweighs its speed


def cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x.to(dtype)`` without the call when it is already that dtype: a no-op cast still costs a
    dispatch, which adds up over decoding's thousands of small operators."""
    return x if x.dtype == dtype else x.to(dtype)


def plain_linear(module: nn.Module) -> tuple[Tensor, Tensor | None] | None:
    """(weight, bias) of a plain linear layer without hooks; None for anything else (called as a module,
    so that wrappers and hooks see their calls)."""
    plain = type(module) is nn.Linear and not (module._forward_hooks or module._forward_pre_hooks)
    return (module.weight, module.bias) if plain else None


def stacked_weights(modules: tuple[nn.Module, ...], dtype: torch.dtype | None) -> tuple[Tensor, Tensor | None] | None:
    """The layers' weights (and biases) stacked for one product, cast to ``dtype`` (once, here: decoding
    under autocast) when given; None when any layer is not a plain ``nn.Linear``."""
    parts = [plain_linear(m) for m in modules]
    if any(p is None for p in parts):
        return None
    weight = torch.cat([w for w, _ in parts]) if len(parts) > 1 else parts[0][0]
    bias = None
    if any(b is not None for _, b in parts):
        bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in parts])
    if dtype is not None:
        weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
    return weight, bias


def fused(*modules: nn.Module, dtype: torch.dtype | None = None,
          order: Tensor | None = None) -> Callable[[Tensor], Tensor]:
    """One matrix product for one or several linear layers on the same input (outputs concatenated);
    layers that are not plain ``nn.Linear`` are called as modules, one after another. ``order`` (out
    features) permutes the outputs: folded into the weights (differentiably) for plain layers."""
    stacked = stacked_weights(modules, dtype)
    if stacked is None:
        call = modules[0] if len(modules) == 1 else lambda x: torch.cat([m(x) for m in modules], dim=-1)
        return call if order is None else lambda x: call(x).index_select(-1, order)
    weight, bias = stacked
    if order is not None:
        weight, bias = weight.index_select(0, order), None if bias is None else bias.index_select(0, order)
    return lambda x: F.linear(x.to(weight.dtype), weight, bias)


class _SwiGLUDown(torch.autograd.Function):
    """``F.linear(silu(gate) * up, weight, bias)`` that saves only ``gate`` and ``up`` for backward: autograd
    would also keep silu(gate) and the product, two more (rows, intermediate) tensors per layer, the largest
    of a decoder layer's activations. Backward recomputes both (elementwise, cheap next to the products)."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(gate, up, weight)
        ctx.has_bias = bias is not None
        # under autocast, F.linear computes in autocast's dtype as the module would
        return F.linear(F.silu(gate) * up, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        gate, up, weight = ctx.saved_tensors
        need_gate, need_up, need_weight, need_bias = ctx.needs_input_grad
        sigmoid = torch.sigmoid(gate)
        silu = gate * sigmoid
        grad_product = grad_out @ weight.to(grad_out.dtype)
        grad_weight = grad_bias = None
        if need_weight:
            grad_weight = (grad_out.flatten(0, -2).t() @ (silu * up).flatten(0, -2).to(grad_out.dtype)).to(weight.dtype)
        if need_bias and ctx.has_bias:
            grad_bias = grad_out.flatten(0, -2).sum(0).to(weight.dtype)
        grad_up = (grad_product * silu).to(up.dtype) if need_up else None
        # d silu(x)/dx = σ(x) (1 + x (1 − σ(x))), as autograd's silu backward
        grad_gate = (grad_product * up * (sigmoid * (1 + gate * (1 - sigmoid)))).to(gate.dtype) if need_gate else None
        return grad_gate, grad_up, grad_weight, grad_bias


def swiglu_down(gate: Tensor, up: Tensor, down: nn.Module) -> Tensor:
    """``down(silu(gate) * up)``, a SwiGLU MLP's output: with a gradient and a plain ``nn.Linear`` ``down``,
    through :class:`_SwiGLUDown`, which keeps half the activations autograd would; otherwise ``down`` is
    called as a module."""
    linear = plain_linear(down)
    if linear is None or not torch.is_grad_enabled():
        return down(F.silu(gate) * up)
    return _SwiGLUDown.apply(gate, up, *linear)


def decode_product(*modules: nn.Module, rows: int, dtype: torch.dtype | None = None,
                   scale: Tensor | None = None, order: Tensor | None = None,
                   exact_first: bool = False) -> Callable[..., Tensor]:
    """:func:`fused` for decoding (prompts once, then few rows with the same weights every token), as
    ``f(x, add=None)``.

    ``scale`` (in features) multiplies the input first: an RMSNorm's weight, folded into the weights once
    when the layers are plain ``nn.Linear``; ``order`` (out features) permutes the outputs, also folded
    into the weights; ``add`` is added to the product (a residual connection). On the CPU the larger
    weights are packed once for oneDNN (``rows``: the batch it is tuned for), faster at a few rows than
    either MKL layout and without MKL's slow row counts (``benchmarks/profile_step.py``;
    docs/benchmarks.md). Elsewhere, or without oneDNN, it is MKL/``F.linear``. Under autocast
    (``dtype``), products too small for oneDNN stay in the weights' dtype on the CPU: there the casts
    cost more than the lower precision saves. ``dtype=torch.int8``: every plain layer's product in int8
    (:class:`~grpokit.models.fast.int8.Int8Product`), quantized from the weights as they are now.
    ``exact_first`` (with a ``dtype``): the first call, decoding's prefill, in the weights' own precision, the
    later ones in ``dtype`` (as int8's products do)."""
    int8 = dtype == torch.int8
    weights = [getattr(m, "weight", None) for m in modules]
    if int8:
        dtype = None  # stacked and folded in the weights' own precision, then quantized
    elif dtype is not None and all(isinstance(w, Tensor) and w.device.type == "cpu" for w in weights):
        dtype = dtype if sum(w.numel() for w in weights) >= ONEDNN_MIN_WEIGHTS else None
    later = dtype if exact_first else None  # stacked and folded in the weights' precision, cast after the first call
    stacked = stacked_weights(modules, None if later is not None else dtype)
    if stacked is None:
        product = fused(*modules, dtype=dtype, order=order)

        def by_modules(x: Tensor, add: Tensor | None = None) -> Tensor:
            out = product(x if scale is None else x * scale)
            return out if add is None else add + out
        return by_modules
    weight, bias = stacked
    if scale is not None:
        weight = weight * scale.to(weight.dtype)
    if order is not None:
        weight, bias = weight[order], None if bias is None else bias[order]
    if int8:
        return Int8Product(weight, bias)
    if later is not None:
        return _exact_first(weight, bias, later, rows)
    return _weights_product(weight, bias, rows)


def _exact_first(weight: Tensor, bias: Tensor | None, dtype: torch.dtype, rows: int) -> Callable[..., Tensor]:
    """A product whose first call computes in ``weight``'s precision and the later ones in ``dtype``."""
    later = None

    def product(x: Tensor, add: Tensor | None = None) -> Tensor:
        nonlocal later, weight, bias
        if later is not None:
            return later(x, add)
        out = F.linear(cast(x, weight.dtype), weight, bias)
        later = _weights_product(weight.to(dtype), None if bias is None else bias.to(dtype), rows)
        weight = bias = None  # from now on decoding reads only the lower-precision copy
        return out if add is None else add + out
    return product


def _weights_product(weight: Tensor, bias: Tensor | None, rows: int) -> Callable[..., Tensor]:
    """``f(x, add=None)`` with ``weight`` packed for oneDNN where it can be, else MKL/``F.linear``."""
    packed = onednn_pack(weight, rows)
    if packed is not None:  # the packed copy is all decoding reads: the unpacked one is not kept as well
        return _onednn_product(packed, bias, weight.dtype)

    def linear(x: Tensor, add: Tensor | None = None) -> Tensor:
        x = cast(x, weight.dtype)
        if add is not None and add.dtype == weight.dtype and bias is None and x.dim() == 2:
            return torch.addmm(add, x, weight.t())
        out = F.linear(x, weight, bias)
        return out if add is None else add + out
    return linear


def _onednn_product(packed: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Callable[..., Tensor]:
    def onednn(x: Tensor, add: Tensor | None = None) -> Tensor:
        x = cast(x, dtype)
        if add is not None and add.dtype == dtype:
            return torch.ops.mkldnn._linear_pointwise.binary(x, add, packed, bias, "add")
        out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return out if add is None else add + out
    return onednn


def onednn_pack(weight: Tensor, rows: int) -> Tensor | None:
    """``weight`` reordered for oneDNN's linear (the op torch.compile uses on the CPU), or None where
    that is not available: not the CPU, not float32/bfloat16, or a build without it."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if weight.numel() < ONEDNN_MIN_WEIGHTS or not onednn_works():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    except RuntimeError:  # e.g. bfloat16 on a CPU oneDNN has no kernel for
        return None


@functools.cache
def onednn_works() -> bool:
    """Whether this torch's oneDNN linear ops (private ones) exist and compute what they are called for
    here; checked once, so that a torch that changed them falls back to MKL instead of failing."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight, x = torch.arange(6.0).view(2, 3), torch.ones(1, 3)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        doubled = torch.ops.mkldnn._linear_pointwise.binary(x, out, packed, None, "add")
        return bool(torch.equal(out, x @ weight.t()) and torch.equal(doubled, 2 * out))
    except (AttributeError, RuntimeError, TypeError):
        return False
