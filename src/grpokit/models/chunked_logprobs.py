"""Log-probs and entropies of the sampled tokens through the LM head, a chunk of tokens at a time.

The plain way, ``token_logprobs(lm_head(hidden), tokens)``, holds the logits of every token of the
micro-batch, (K, V), and autograd keeps them and their softmax for the backward pass: at a real vocabulary
(49,152 for SmolLM2, 150k for Qwen) that is most of a training pass's memory. Here the head runs on
``chunk_size`` tokens at a time, each chunk's logits reduced to its log-probs and its rows' log-sum-exp
before the next; backward recomputes each chunk's logits and turns them into gradients, so only the
hidden states (K, H), the head's weight and K numbers are kept in between. The values are those of
:func:`grpokit.core.objective.token_logprobs` and :func:`~grpokit.core.objective.token_entropy` (docs/math.md,
"Log-probs in chunks", says why this is exact), and the gradients are the ones autograd computes for them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def chunk_rows(vocab_size: int, chunk_mb: float) -> int:
    """Tokens per chunk such that one chunk's float32 logits (rows × ``vocab_size`` × 4 bytes) take at
    most ``chunk_mb`` MiB; at least 1."""
    return max(1, int(chunk_mb * 2**20) // (4 * vocab_size))


def _logits(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The head's logits of ``hidden`` (C, H), computed in the weight's dtype and returned in float32
    (float64 for float64 weights): the precision log-probs need, whatever the weights' dtype."""
    with torch.autocast(hidden.device.type, enabled=False):  # the caller chose the dtype by the weight's
        logits = F.linear(hidden.to(weight.dtype), weight, bias)
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


class ChunkedTokenLogprobs(torch.autograd.Function):
    """log π(token) = z[token]/T − logsumexp(z/T) for z = weight · hidden (+ bias), chunk by chunk, and,
    with ``with_entropy``, each token's entropy −Σ π log π from the same chunk's logits (a metric: no
    gradient; without it, an empty tensor).

    Saves ``hidden``, ``weight``, ``bias``, ``tokens`` and the K log-sum-exps; backward recomputes each
    chunk's logits z and uses ∂ log π / ∂z = (onehot(token) − softmax(z/T)) / T.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor, temperature: float,
                chunk_size: int, with_entropy: bool = False) -> tuple[Tensor, Tensor]:
        logp = hidden.new_empty(len(tokens), dtype=torch.promote_types(weight.dtype, torch.float32))
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        for start in range(0, len(tokens), chunk_size):
            rows = slice(start, start + chunk_size)
            scaled = _logits(hidden[rows], weight, bias)  # (C, V)
            if temperature != 1.0:
                scaled /= temperature
            lse[rows] = torch.logsumexp(scaled, dim=-1)  # as token_logprobs: gather, then logsumexp
            logp[rows] = scaled.gather(-1, tokens[rows].unsqueeze(-1)).squeeze(-1) - lse[rows]
            if with_entropy:  # as token_entropy: −Σ p · log p, log p = z/T − logsumexp, here in place
                logprobs = scaled.sub_(lse[rows].unsqueeze(1))
                entropy[rows] = -torch.linalg.vecdot(logprobs.exp(), logprobs)
        ctx.save_for_backward(hidden, weight, bias, tokens, lse)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp: Tensor, _grad_entropy: Tensor):
        hidden, weight, bias, tokens, lse = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        wide = torch.promote_types(weight.dtype, torch.float32)  # the weight's and bias's gradients are summed in this
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=wide, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=wide, device=bias.device) if need_bias else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, len(tokens), chunk_size):
                rows = slice(start, start + chunk_size)
                h = hidden[rows].to(weight.dtype)
                g = grad_logp[rows].to(lse.dtype).unsqueeze(1)  # (C, 1)
                scaled = _logits(h, weight, bias)
                if temperature != 1.0:
                    scaled /= temperature
                # softmax(z/T) from the saved log-sum-exp (as logsumexp's own backward), then
                # ∂L/∂z = g · (onehot − softmax) / T, all in place in the one (C, V) buffer.
                grad_z = scaled.sub_(lse[rows].unsqueeze(1)).exp_().mul_(-g)
                grad_z.scatter_add_(1, tokens[rows].unsqueeze(1), g)
                if temperature != 1.0:
                    grad_z /= temperature
                grad_z = grad_z.to(weight.dtype)
                if need_hidden:
                    grad_hidden[rows] = grad_z @ weight
                if need_weight:
                    if grad_weight.dtype == weight.dtype:
                        grad_weight.addmm_(grad_z.t(), h)  # in place: no (V, H) temporary per chunk
                    else:  # half-precision weights: the chunks' products summed in float32
                        grad_weight += grad_z.t() @ h
                if need_bias:
                    grad_bias += grad_z.sum(dim=0)
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None)


def chunked_token_logprobs(hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor,
                           temperature: float = 1.0, chunk_size: int = 1024) -> Tensor:
    """log π(token) (K,) under ``softmax((hidden @ weight.T + bias) / temperature)``, ``chunk_size`` tokens
    at a time: ``hidden`` (K, H) the final hidden states that predict ``tokens`` (K,), ``weight`` (V, H) and
    ``bias`` (V,) or None the LM head's. Float32 (float64 for float64 weights); differentiable in
    ``hidden``, ``weight`` and ``bias`` (a tied head's weight is the embedding's: autograd adds the two
    gradients as usual). The head's product runs in the weight's dtype with autocast off: cast the weight
    first to compute it in another."""
    return chunked_logprobs_and_entropy(hidden, weight, bias, tokens, temperature, chunk_size)[0]


def chunked_logprobs_and_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor,
                                 temperature: float = 1.0, chunk_size: int = 1024,
                                 with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """:func:`chunked_token_logprobs` and, with ``with_entropy``, the entropy (K,) of each token's
    distribution, without gradient (a metric), from the same pass over the head (None otherwise)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.dim() != 2 or tokens.shape != hidden.shape[:1] or weight.shape[1:] != hidden.shape[1:]:
        raise ValueError(f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and tokens "
                         f"{tuple(tokens.shape)} are not (K, H), (V, H) and (K,)")
    logp, entropy = ChunkedTokenLogprobs.apply(hidden, weight, bias, tokens, temperature, chunk_size, with_entropy)
    return logp, entropy if with_entropy else None
