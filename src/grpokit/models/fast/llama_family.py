"""Llama-family decoders (Llama, Qwen2, Mistral without a sliding window) run by our own forward.

The same weights and the same math as the Hugging Face forward, without what costs time at GRPO's
shapes (docs/benchmarks.md, "grpokit vs TRL: speed"):

- decoding prefills each prompt once for its G completions, writes keys and values into a cache that
  doubles its room when full (a few copies per rollout, not one per token by concatenation), fuses
  the q/k/v and gate/up projections into one product each with the norms' weights folded in, runs
  them on the CPU with weights packed once for oneDNN (much faster than MKL at a few rows), and drops
  finished completions from the batch;
- the reference and policy passes run every projection on real tokens only (prompts' left padding and
  what follows each completion's EOS are never computed) and a group's shared prompt once, with
  attention on per-row layouts where padding only trails, so plain causal attention is exact; the LM
  head runs only where a completion token is predicted.

Modules are called as modules where they are not plain ``nn.Linear`` (a LoRA adapter, a quantised
layer) or carry forward hooks, so wrapped and hooked models keep their behaviour. :func:`unsupported`
says why a model cannot take this path; callers then use the model's own forward (``fast_path: false``
forces that everywhere).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from grpokit.models.fast.fused_linear import cast, decode_product, fused, swiglu_down

SUPPORTED = ("llama", "qwen2", "mistral")
CACHE_ROOM = 32  # new tokens the decode cache has room for at first; it doubles that room when full
ATTENTION_GROUP_ROWS = 8  # training attention on the CPU: rows of similar length padded to a common length
MATMUL_ATTENTION_MAX_SCORES = 1 << 21  # float32 training attention on the CPU: matmuls up to this many scores
# Training passes in bfloat16 on the CPU run their token rows in multiples of ONEDNN_ROW_BUCKET and each attention
# group's length in multiples of ATTENTION_LENGTH_BUCKET: oneDNN builds a kernel per product shape (0.15-0.5 ms,
# and ~0.65 MB in its cache), and a batch's token count and lengths are new almost every step.
ONEDNN_ROW_BUCKET = 64
ATTENTION_LENGTH_BUCKET = 8


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` under a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def unsupported(model: nn.Module) -> str | None:
    """None when :class:`LlamaFamily` runs ``model`` exactly; otherwise the reason it cannot."""
    inner = unwrap_peft(model)
    config = getattr(inner, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        return f"model_type {model_type!r} is not one of {SUPPORTED}"
    backbone = getattr(inner, "model", None)
    if backbone is None or not hasattr(backbone, "layers") or not hasattr(backbone, "rotary_emb"):
        return "no model.layers / model.rotary_emb (an older transformers layout)"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (only silu)"
    if getattr(config, "use_sliding_window", False) or (model_type == "mistral" and config.sliding_window):
        return "a sliding attention window"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return "layer_types other than full_attention"
    if inner.training and getattr(config, "attention_dropout", 0.0):
        return "attention dropout in training mode"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    if any(type(p).__name__ == "DTensor" for p in inner.parameters()):  # no torch.distributed import needed
        return "sharded (FSDP) parameters"
    return None


def _rope_pairs(x: Tensor, turns: Tensor) -> Tensor:
    """Rotary embedding, in place, on ``x`` (..., D) whose features are laid out in pairs: features
    (2i, 2i+1) hold the Hugging Face layout's (i, i + D/2), the two halves ``rotate_half`` swaps. Each
    pair is then one complex number and the embedding one complex product with ``turns`` (..., D/2),
    cos + i·sin: one operator instead of a flip, a product and a fused multiply-add."""
    if x.dtype == torch.float32:
        torch.view_as_complex(x.unflatten(-1, (-1, 2))).mul_(turns)
        return x
    return x.copy_(_rotated_pairs(x, turns))


def _rotated_pairs(x: Tensor, turns: Tensor) -> Tensor:
    """:func:`_rope_pairs` out of place, for the passes that keep a gradient; in float32 (there is no
    complex bfloat16), then back to ``x``'s dtype."""
    rotated = torch.view_as_complex(x.float().unflatten(-1, (-1, 2))) * turns
    return torch.view_as_real(rotated).flatten(-2).to(x.dtype)


class _Layout(NamedTuple):
    """Where :meth:`LlamaFamily.hidden_states`' tokens go in attention, the same for every layer."""

    m: int  # rows of the states: the owned tokens (and, in bfloat16 on the CPU, bucket padding)
    turns: Tensor  # each row's rotary phases (M, 1, D/2)
    order: Tensor  # the q/k product's output features in rotary-pair layout
    gather_qk: Tensor
    gather_v: Tensor
    qk_sizes: list[int]
    v_sizes: list[int]
    groups: list[tuple[int, int]]  # attention groups: (rows, padded length)
    pick: Tensor  # where each token's heads are in attention's concatenated output
    compute: torch.dtype
    causal_masks: dict[int, Tensor]


class LlamaFamily:
    """A supported model's modules, run by the two passes GRPO needs: :meth:`decode`, and
    :meth:`hidden_states` followed by the LM head."""

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
        # √(hidden · eps), for :meth:`_normalize`
        self.norm_floor = torch.tensor((config.hidden_size * self.eps) ** 0.5, device=self.backbone.norm.weight.device)

    # ---- pieces shared by both passes -------------------------------------------------------------

    def _norm(self, module: nn.Module, x: Tensor) -> Tensor:
        """Hugging Face's RMSNorm: normalise in float32, cast back, then scale."""
        if x.dtype == module.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), module.weight, self.eps)
        return module.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def head(self, x: Tensor) -> Tensor:
        """The LM head on final hidden states (from :meth:`hidden_states`): logits in float32 (float64 for
        float64 weights), computed in the head's dtype, under autocast too (log-probs need the precision).
        :mod:`grpokit.models.chunked_logprobs` computes the same a chunk of tokens at a time."""
        with torch.autocast(x.device.type, enabled=False):
            logits = self.lm_head(x.to(self.lm_head.weight.dtype))
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def _rotary_turns(self, length: int, like: Tensor) -> Tensor:
        """cos + i·sin (length, head_dim / 2) for positions 0..length-1, from the model's rotary module,
        for :func:`_rope_pairs`. These families repeat each frequency over both halves of the head, so
        the first halves of cos and sin say it all."""
        positions = torch.arange(length, device=like.device).unsqueeze(0)
        cos, sin = self.backbone.rotary_emb(like, positions)
        half = cos.shape[-1] // 2
        return torch.complex(cos[0, :, :half].float(), sin[0, :, :half].float())

    def _pair_order(self, device: torch.device) -> Tensor:
        """The q/k/v product's output features in :func:`_rope_pairs`' layout: within each query and key
        head, features 0, D/2, 1, D/2 + 1, ...; values as they are. Attention is the same in that layout:
        queries and keys permute alike, so their dot products do not change."""
        d, rotated = self.head_dim, self.heads + self.kv_heads
        pairs = torch.arange(d, device=device).view(2, d // 2).t().reshape(d)
        return torch.cat([(torch.arange(rotated, device=device).unsqueeze(1) * d + pairs).reshape(-1),
                          torch.arange(rotated * d, (rotated + self.kv_heads) * d, device=device)])

    # ---- training and reference passes: real tokens only -------------------------------------------

    def hidden_states(self, input_ids: Tensor, lengths: Tensor, predict: Tensor, prefix_source: Tensor | None = None,
                      prefix_lengths: Tensor | None = None, checkpoint_layers: bool = False) -> Tensor:
        """The final hidden states (K, hidden), after the last norm, that the LM head reads (:meth:`head`)
        at the positions ``predict`` (K, 2) = (row, column) of the right-padded ``input_ids``
        (N, L) whose row i holds ``lengths[i]`` real tokens from column 0 (positions 0, 1, ...).

        Projections and MLPs run on real tokens only, and once per shared prefix: row i's first
        ``prefix_lengths[i]`` tokens are those of row ``prefix_source[i]`` (a GRPO group's G completions
        share their prompt), so only that row computes them and the others attend to its keys and values —
        the same values, with the gradient of every row that reads them. Attention runs on rows of similar
        length grouped together, each group padded to its longest row; padding only trails, so causal
        attention never lets a real token see it. Differentiable, and reproducible: gathers are
        ``index_select``, whose gradient sums a row read several times (a shared prompt, padding) in a
        fixed order; indexing's gradient adds them with atomics across CPU threads, in a different
        order from run to run. ``checkpoint_layers``: keep only each decoder layer's input for backward and
        recompute the layer there (activation checkpointing: the same values and gradients).
        """
        n, width = input_ids.shape
        device = input_ids.device
        columns = torch.arange(width, device=device)
        real = columns < lengths.unsqueeze(1)  # (N, L)
        own = real  # the positions whose token this row computes
        if prefix_source is not None:
            others = prefix_source != torch.arange(n, device=device)
            borrowed = (columns < prefix_lengths.unsqueeze(1)) & others.unsqueeze(1)
            own = real & ~borrowed
        ids = input_ids[own]  # row-major order of ``own``
        m = owned_count = len(ids)
        compute = self.backbone.embed_tokens.weight.dtype
        if torch.is_autocast_enabled(device.type):
            compute = torch.get_autocast_dtype(device.type)
        # On the CPU in bfloat16 (oneDNN), M rows: the owned tokens and then token 0 (at position 0) up to a
        # multiple of ONEDNN_ROW_BUCKET, so that product shapes recur from step to step. The extra rows
        # are never read, so their gradient is exactly zero.
        onednn = device.type == "cpu" and compute != torch.float32
        if onednn:
            m = _round_up(owned_count, ONEDNN_ROW_BUCKET)
            ids = torch.cat([ids, ids.new_zeros(m - owned_count)])
        x = self.backbone.embed_tokens(ids)  # (M, hidden)
        # Each position's row of x. Padding reads row 0: padding only trails, so no real token attends to
        # it, and its outputs are never read (so its gradient is exactly zero).
        token = torch.zeros((n, width), dtype=torch.long, device=device)
        token[own] = torch.arange(owned_count, device=device)
        if prefix_source is not None:
            token = torch.where(borrowed, token[prefix_source], token)
        position = F.pad(own.nonzero()[:, 1], (0, m - owned_count))
        turns = self._rotary_turns(width, x)[position].unsqueeze(1)  # (M, 1, D/2)
        # Rows sorted by length in groups of ATTENTION_GROUP_ROWS on the CPU (one group elsewhere, where
        # padding is cheaper than more kernel launches), each padded to its longest row. A group's positions
        # are gathered head-major, (heads · rows, L, D), the layout batched matmuls read without a copy: all
        # groups at once, one gather per layer for q/k and one for v (and one sum in each's gradient), from
        # the projections viewed as one row per (token, head). Attention's outputs of all groups are
        # concatenated likewise; ``pick`` lists where each of the M tokens' heads are in that, token-major,
        # as ``o_proj`` reads them.
        per_group = ATTENTION_GROUP_ROWS if device.type == "cpu" else n
        bucket = ATTENTION_LENGTH_BUCKET if onednn else 1  # attention's shapes too (its padding trails, as above)
        if onednn:
            extra = _round_up(width, bucket) - width
            token, own = F.pad(token, (0, extra)), F.pad(own, (0, extra), value=False)
        rotated, kv, d = self.heads + self.kv_heads, self.kv_heads, self.head_dim
        groups, gather_qk, gather_v, offset = [], [], [], 0
        pick_start = torch.zeros(m, dtype=torch.long, device=device)  # padding reads row 0 for every head
        pick_stride = torch.zeros_like(pick_start)
        for rows in lengths.argsort().split(per_group):
            length = _round_up(int(lengths[rows].max()), bucket)
            index, owned = token[rows, :length], own[rows, :length]
            flat = index.flatten()
            gather_qk.append((flat * rotated + torch.arange(rotated, device=device).unsqueeze(1)).flatten())
            gather_v.append((flat * kv + torch.arange(kv, device=device).unsqueeze(1)).flatten())
            tokens = index[owned]
            pick_start[tokens], pick_stride[tokens] = offset + owned.flatten().nonzero().squeeze(1), flat.numel()
            groups.append((len(rows), length))
            offset += self.heads * flat.numel()
        gather_qk, gather_v = torch.cat(gather_qk), torch.cat(gather_v)
        pick = (pick_start.unsqueeze(1) + pick_stride.unsqueeze(1) * torch.arange(self.heads, device=device)).flatten()
        qk_sizes, v_sizes = [rotated * r * c for r, c in groups], [kv * r * c for r, c in groups]
        order = self._pair_order(device)[: rotated * d]
        causal_masks: dict[int, Tensor] = {}  # by length, made once for every layer
        layout = _Layout(m, turns, order, gather_qk, gather_v, qk_sizes, v_sizes, groups, pick, compute, causal_masks)
        checkpoint_layers = checkpoint_layers and torch.is_grad_enabled()
        for layer in self.backbone.layers:
            if checkpoint_layers:
                x = torch.utils.checkpoint.checkpoint(self._layer, layer, x, layout, use_reentrant=False)
            else:
                x = self._layer(layer, x, layout)
        return self._norm(self.backbone.norm, x.index_select(0, token[predict[:, 0], predict[:, 1]]))

    def _layer(self, layer: nn.Module, x: Tensor, layout: _Layout) -> Tensor:
        """One decoder layer of :meth:`hidden_states` on the owned tokens' states ``x`` (M, hidden)."""
        attention, rotated, kv, d = layer.self_attn, self.heads + self.kv_heads, self.kv_heads, self.head_dim
        h = self._norm(layer.input_layernorm, x)
        # q/k and v as two products, gathered apart: one product's slices, or their concatenation, would
        # cost passes over the whole in the gradient. Attention in autocast's dtype (what autocast gives SDPA).
        qk = _rotated_pairs(fused(attention.q_proj, attention.k_proj, order=layout.order)(h).view(layout.m, rotated, d),
                            layout.turns)
        values = attention.v_proj(h).view(layout.m * kv, d).to(layout.compute)
        outs = []
        for qk_part, v_part, (count, length) in zip(
            qk.to(layout.compute).flatten(0, 1).index_select(0, layout.gather_qk).split(layout.qk_sizes),
            values.index_select(0, layout.gather_v).split(layout.v_sizes), layout.groups,
        ):
            q, k = qk_part.view(rotated * count, length, d).split([self.heads * count, kv * count])
            v = v_part.view(kv * count, length, d)
            outs.append(self._attention(q, k, v, count, layout.causal_masks).flatten(0, 1))
        out = torch.cat(outs).index_select(0, layout.pick).view(layout.m, self.q_size)  # o_proj takes it in its dtype
        x = x + attention.o_proj(out)
        h = self._norm(layer.post_attention_layernorm, x)
        # two products, not one on stacked weights: the gradient of one output's halves would be concatenated
        return x + swiglu_down(layer.mlp.gate_proj(h), layer.mlp.up_proj(h), layer.mlp.down_proj)

    def _attention(self, q: Tensor, k: Tensor, v: Tensor, rows: int, causal_masks: dict[int, Tensor]) -> Tensor:
        """Causal attention of ``rows`` rows laid out head-major: q (heads · rows, L, D), k and v
        (kv heads · rows, L, D). On the CPU, scores, float32 softmax and the product run as matmuls: SDPA's
        fused kernel is slower for bfloat16 (its backward) and, in float32, for attention groups of a few
        short rows (~30 % for 4 rows of 76 tokens, forward and backward). Its kernel runs elsewhere and
        where the float32 scores would be large (it never holds them whole). ``causal_masks``: the additive
        masks made so far, by length."""
        if self.kv_heads != self.heads:
            k, v = (t.unflatten(0, (self.kv_heads, rows)).repeat_interleave(self.heads // self.kv_heads, dim=0)
                    .flatten(0, 1) for t in (k, v))
        batch, length, _ = q.shape
        large = q.dtype == torch.float32 and batch * length * length > MATMUL_ATTENTION_MAX_SCORES
        if q.device.type != "cpu" or large:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)
        if length not in causal_masks:
            causal_masks[length] = torch.full((length, length), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
        scores = torch.baddbmm(causal_masks[length], q, k.transpose(1, 2), alpha=self.scaling)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        return torch.bmm(probs, v)

    # ---- decoding: a preallocated cache ------------------------------------------------------------

    @torch.inference_mode()  # not only no_grad: without autograd's bookkeeping each small operator is cheaper
    def decode(
        self, prompt_ids: Tensor, prompt_mask: Tensor, max_new_tokens: int,
        choose: Callable[[Tensor, int, Tensor], tuple[Tensor, Tensor]], repeats: int = 1,
    ) -> None:
        """Run the prompts (B, P, left-padded) once each and then up to ``max_new_tokens`` decode steps
        for N = B × ``repeats`` rows (each prompt's rows contiguous).

        ``choose(logits (A, V) float32, t, rows (A,))`` picks the next token of each still-running row
        (indices into N) and returns ``(tokens (A,), stopped (A,) bool)``. Finished rows leave the batch
        (and the cache) once they are a quarter of it.
        """
        device = prompt_ids.device.type
        # Under autocast, projections compute in its dtype with weights cast once; the rest (norms, the
        # cache and attention) stays in the weights' dtype, which on the CPU is also faster for the
        # one-query attention products.
        compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        with torch.autocast(device, enabled=False):
            self._decode(prompt_ids, prompt_mask, max_new_tokens, choose, compute, repeats)

    def _decode(self, prompt_ids, prompt_mask, max_new_tokens, choose, compute, repeats) -> None:
        b, prompt_width = prompt_ids.shape
        n = b * repeats
        device = prompt_ids.device
        total = prompt_width + max_new_tokens
        layers = [self._decode_products(layer, n, compute) for layer in self.backbone.layers]
        head = decode_product(self.lm_head, rows=n, scale=self._norm_scale(self.backbone.norm))  # own dtype, as head
        x = self.backbone.embed_tokens(prompt_ids)  # (B, P, hidden)
        dtype = x.dtype
        # The cache holds the prompt and room for CACHE_ROOM new tokens, and grows by doubling that room:
        # attention then reads keys and values packed close together, not spread over the full length
        # (on the CPU that read is ~2x faster once the cache outgrows the processor's caches).
        cache = torch.zeros(len(layers), 2, b, self.kv_heads, min(total, prompt_width + CACHE_ROOM), self.head_dim,
                            dtype=dtype, device=device)
        turns = self._rotary_turns(total, x)
        positions = (prompt_mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, P)
        # Additive mask over cache columns: left padding is never attended to.
        bias = torch.zeros(b, total, dtype=dtype, device=device)
        bias[:, :prompt_width] = torch.where(prompt_mask.bool(), 0.0, float("-inf"))
        # Causal over the prompt; a padding position sees itself only (finite, and never seen by others).
        causal = torch.full((prompt_width, prompt_width), float("-inf"), dtype=dtype, device=device).triu(1)
        prefill_mask = bias[:, None, :prompt_width] + causal  # (B, P, P)
        prefill_mask.diagonal(dim1=-2, dim2=-1).zero_()
        rows = torch.arange(n, device=device)

        last = self._prefill(x, layers, cache, turns[positions].unsqueeze(2), prefill_mask)[:, -1]  # (B, hidden)
        # Each prompt's cache, last hidden state, positions and mask, once per row that continues it.
        cache = cache.repeat_interleave(repeats, dim=2)
        last, bias = last.repeat_interleave(repeats, dim=0), bias.repeat_interleave(repeats, dim=0)
        next_positions = positions[:, -1].repeat_interleave(repeats) + 1
        alive = torch.ones(n, dtype=torch.bool, device=device)
        finished = 0  # rows of the batch that have stopped (they stay until they are a quarter of it)
        for t in range(max_new_tokens):
            logits = cast(head(self._normalize(last)), torch.float32)
            picked = alive.nonzero().squeeze(1) if finished else None
            chosen, stopped = choose(logits, t, rows) if picked is None else choose(logits[picked], t, rows[picked])
            if t == max_new_tokens - 1:
                break
            stopping = int(stopped.sum())
            if stopping:
                alive[stopped if picked is None else picked[stopped]] = False
                finished += stopping
                if finished == len(rows):
                    break
            tokens = chosen if picked is None else torch.zeros_like(rows).index_put((picked,), chosen)
            if 4 * finished >= len(rows):  # drop finished rows from the batch and the cache
                keep = alive.nonzero().squeeze(1)
                rows, tokens, next_positions, bias, alive = (
                    v[keep] for v in (rows, tokens, next_positions, bias, alive))
                cache = cache[:, :, keep]  # contiguous again: each layer's (rows, heads) merge into one batch dim
                finished = 0
            column = prompt_width + t
            if column == cache.shape[-2]:
                room = cache.shape[-2] - prompt_width
                grown = cache.new_zeros(*cache.shape[:-2], min(total, prompt_width + 2 * room), cache.shape[-1])
                grown[..., :column, :] = cache
                cache = grown
            x = self.backbone.embed_tokens(tokens)  # (A, hidden)
            last = self._decode_step(x, layers, cache, turns[next_positions].unsqueeze(1), column,
                                     bias[:, : column + 1])
            next_positions = next_positions + 1

    def _decode_products(self, layer: nn.Module, rows: int, dtype: torch.dtype | None) -> tuple:
        """A layer's four products for decoding (q/k/v and gate/up fused), each RMSNorm's weight folded
        into the product after it, and q and k in :func:`_rope_pairs`' layout (:meth:`_pair_order`)."""
        attention, mlp = layer.self_attn, layer.mlp
        order = self._pair_order(layer.input_layernorm.weight.device)
        return (decode_product(attention.q_proj, attention.k_proj, attention.v_proj, rows=rows, dtype=dtype,
                               scale=self._norm_scale(layer.input_layernorm), order=order),
                decode_product(attention.o_proj, rows=rows, dtype=dtype),
                decode_product(mlp.gate_proj, mlp.up_proj, rows=rows, dtype=dtype,
                               scale=self._norm_scale(layer.post_attention_layernorm)),
                decode_product(mlp.down_proj, rows=rows, dtype=dtype))

    def _norm_scale(self, norm: nn.Module) -> Tensor:
        """What :meth:`_normalize` leaves to the product after it: the norm's weight times √hidden."""
        return norm.weight * norm.weight.shape[-1] ** 0.5

    def _normalize(self, x: Tensor) -> Tensor:
        """RMSNorm without its weight and a factor √hidden (both folded into the next product, see
        :meth:`_norm_scale`), in float32 as the Hugging Face norm: x · rsqrt(‖x‖² / hidden + eps) =
        √hidden · x / hypot(‖x‖, √(hidden · eps)). Three operators instead of ``F.rms_norm``'s five
        (decoding, no gradient)."""
        x32 = cast(x, torch.float32)
        return cast(x32 / torch.hypot(torch.linalg.vector_norm(x32, dim=-1, keepdim=True), self.norm_floor), x.dtype)

    def _decode_step(self, x: Tensor, layers: list, cache: Tensor, turns: Tensor, column: int,
                     mask: Tensor) -> Tensor:
        """Every layer on one new token per row, ``x`` (A, hidden); writes its keys and values at ``column``
        of ``cache`` and attends to columns 0..column under the additive ``mask`` (A, column + 1)."""
        a = x.shape[0]
        heads, kv, groups, d = self.heads, self.kv_heads, self.heads // self.kv_heads, self.head_dim
        end, inner = column + 1, self.intermediate
        mask = mask[:, None, None].expand(a, kv, 1, end).reshape(a * kv, 1, end)
        # Every layer's views, taken once per step (each view is a dispatch too): where this column's
        # keys and values go, (layers, A, 2, kv, D), and the filled columns, (layers, 2, A · kv, end, D).
        slots = cache[..., column, :].transpose(1, 2)
        filled = cache[..., :end, :].flatten(2, 3)
        for i, (qkv_proj, o_proj, gate_up, down) in enumerate(layers):
            # in the cache's dtype before the rotation: one cast (under autocast), then all in place
            qkv = cast(qkv_proj(self._normalize(x)), cache.dtype).view(a, heads + 2 * kv, d)
            _rope_pairs(qkv[:, : heads + kv], turns)
            slots[i].copy_(qkv[:, heads:].view(a, 2, kv, d))  # keys and values
            q = qkv[:, :heads].reshape(a * kv, groups, d)
            keys, values = filled[i]
            scores = torch.baddbmm(mask, q, keys.transpose(1, 2), alpha=self.scaling)
            probs = cast(torch.softmax(scores, dim=-1, dtype=torch.float32), values.dtype)
            out = torch.bmm(probs, values).view(a, heads * d)
            x = o_proj(out, add=x)
            gate_and_up = gate_up(self._normalize(x))
            x = down(F.silu(gate_and_up[:, :inner]) * gate_and_up[:, inner:], add=x)
        return x

    def _prefill(self, x: Tensor, layers: list, cache: Tensor, turns: Tensor, mask: Tensor) -> Tensor:
        """Every layer on the prompts ``x`` (B, P, hidden): writes their keys and values into columns
        0..P-1 of ``cache`` (layers, 2, B, kv heads, columns, D); ``mask`` (B, P, P) is additive."""
        b, p, _ = x.shape
        heads, kv, d = self.heads, self.kv_heads, self.head_dim
        for (qkv_proj, o_proj, gate_up, down), (k_cache, v_cache) in zip(layers, cache):
            qkv = cast(qkv_proj(self._normalize(x)), cache.dtype).view(b, p, heads + 2 * kv, d)  # as _decode_step
            qk = _rope_pairs(qkv[:, :, : heads + kv], turns).transpose(1, 2)  # (B, heads + kv, P, D)
            q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, :, heads + kv:].transpose(1, 2)
            k_cache[:, :, :p], v_cache[:, :, :p] = k, v
            if kv != heads:
                k, v = (t.repeat_interleave(heads // kv, dim=1) for t in (k, v))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=self.scaling)
            x = o_proj(out.transpose(1, 2).reshape(b, p, self.q_size), add=x)
            gate, up = gate_up(self._normalize(x)).chunk(2, dim=-1)
            x = down(F.silu(gate) * up, add=x)
        return x
