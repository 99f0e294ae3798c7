"""The training and reference passes of the fast path: :class:`HiddenStates` computes the final hidden
states that predict completion tokens, running every projection on real tokens only (no prompt padding, nothing
after an EOS) and a group's shared prompt once, with attention on rows of similar length grouped together, and
optionally checkpointing each decoder layer."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from grpokit.models.fast.fused_linear import fused, swiglu_down
from grpokit.models.fast.parts import LlamaParts, rotated_pairs

ATTENTION_GROUP_ROWS = 8  # training attention on the CPU: rows of similar length padded to a common length
MATMUL_ATTENTION_MAX_SCORES = 1 << 21  # float32 training attention on the CPU: matmuls up to this many scores
# Training passes in bfloat16 on the CPU run their token rows in multiples of ONEDNN_ROW_BUCKET and each attention
# group's length in multiples of ATTENTION_LENGTH_BUCKET: oneDNN builds a kernel per product shape (0.15-0.5 ms,
# and ~0.65 MB in its cache), and a batch's token count and lengths are new almost every step.
ONEDNN_ROW_BUCKET = 64
ATTENTION_LENGTH_BUCKET = 8


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class _Layout(NamedTuple):
    """Where :meth:`HiddenStates.hidden_states`' tokens go in attention, the same for every layer."""

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


class HiddenStates(LlamaParts):
    """The passes that keep a gradient (and the reference's): :meth:`hidden_states`, then :meth:`head`."""

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
        qk = rotated_pairs(fused(attention.q_proj, attention.k_proj, order=layout.order)(h).view(layout.m, rotated, d),
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
