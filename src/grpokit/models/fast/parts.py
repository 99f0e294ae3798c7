"""The fast path's common ground: :class:`LlamaParts`, a supported model's modules (the backbone, the LM
head, its shapes) with the pieces the passes use (Hugging Face's RMSNorm, the LM head in float32, the
rotary phases, the q/k features in rotary-pair layout), and the rotary embedding in that layout
(:func:`rope_pairs`, :func:`rotated_pairs`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpokit.models.fast.support import unsupported, unwrap_peft


def rope_pairs(x: Tensor, turns: Tensor) -> Tensor:
    """Rotary embedding, in place, on ``x`` (..., D) whose features are laid out in pairs: features
    (2i, 2i+1) hold the Hugging Face layout's (i, i + D/2), the two halves ``rotate_half`` swaps. Each
    pair is then one complex number and the embedding one complex product with ``turns`` (..., D/2),
    cos + i·sin: one operator instead of a flip, a product and a fused multiply-add."""
    if x.dtype == torch.float32:
        torch.view_as_complex(x.unflatten(-1, (-1, 2))).mul_(turns)
        return x
    return x.copy_(rotated_pairs(x, turns))


def rotated_pairs(x: Tensor, turns: Tensor) -> Tensor:
    """:func:`rope_pairs` out of place, for the passes that keep a gradient; in float32 (there is no
    complex bfloat16), then back to ``x``'s dtype."""
    rotated = torch.view_as_complex(x.float().unflatten(-1, (-1, 2))) * turns
    return torch.view_as_real(rotated).flatten(-2).to(x.dtype)


class LlamaParts:
    """A supported model's modules and the pieces the passes build on; the passes themselves are
    :class:`~grpokit.models.fast.hidden_states.HiddenStates` and :class:`~grpokit.models.fast.decode.Decoding`."""

    def __init__(self, model: nn.Module):
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"the fast path cannot run this model: {reason}")
        inner = unwrap_peft(model)
        self.backbone, self.lm_head = inner.model, inner.lm_head
        config = inner.config
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads or self.heads
        attention = self.backbone.layers[0].self_attn
        self.head_dim = attention.head_dim
        self.scaling = attention.scaling
        self.eps = self.backbone.norm.variance_epsilon
        self.q_size = self.heads * self.head_dim
        self.intermediate = config.intermediate_size
        # √(hidden · eps), for :meth:`~grpokit.models.fast.decode.Decoding._normalize`
        self.norm_floor = torch.tensor((config.hidden_size * self.eps) ** 0.5, device=self.backbone.norm.weight.device)

    def _norm(self, module: nn.Module, x: Tensor) -> Tensor:
        """Hugging Face's RMSNorm: normalise in float32, cast back, then scale."""
        if x.dtype == module.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), module.weight, self.eps)
        return module.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def head(self, x: Tensor) -> Tensor:
        """The LM head on final hidden states (from :meth:`HiddenStates.hidden_states`): logits in float32 (float64 for
        float64 weights), computed in the head's dtype, under autocast too (log-probs need the precision).
        :mod:`grpokit.models.chunked_logprobs` computes the same a chunk of tokens at a time."""
        with torch.autocast(x.device.type, enabled=False):
            logits = self.lm_head(x.to(self.lm_head.weight.dtype))
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def _rotary_turns(self, length: int, like: Tensor) -> Tensor:
        """cos + i·sin (length, head_dim / 2) for positions 0..length-1, from the model's rotary module,
        for :func:`rope_pairs`. These families repeat each frequency over both halves of the head, so
        the first halves of cos and sin say it all."""
        positions = torch.arange(length, device=like.device).unsqueeze(0)
        cos, sin = self.backbone.rotary_emb(like, positions)
        half = cos.shape[-1] // 2
        return torch.complex(cos[0, :, :half].float(), sin[0, :, :half].float())

    def _pair_order(self, device: torch.device) -> Tensor:
        """The q/k/v product's output features in :func:`rope_pairs`' layout: within each query and key
        head, features 0, D/2, 1, D/2 + 1, ...; values as they are. Attention is the same in that layout:
        queries and keys permute alike, so their dot products do not change."""
        d, rotated = self.head_dim, self.heads + self.kv_heads
        pairs = torch.arange(d, device=device).view(2, d // 2).t().reshape(d)
        return torch.cat([(torch.arange(rotated, device=device).unsqueeze(1) * d + pairs).reshape(-1),
                          torch.arange(rotated * d, (rotated + self.kv_heads) * d, device=device)])
