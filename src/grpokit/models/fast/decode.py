"""Sampling on the fast path: :class:`Decoding` prefills each prompt once for its G completions, keeps keys
and values in a cache that doubles its room when full (``CACHE_ROOM`` new tokens at first), runs each layer as
four fused products (:func:`~grpokit.models.fast.fused_linear.decode_product`) with the norms' weights folded
in, and drops finished completions from the batch. ``graph=True`` keeps every shape fixed instead (the cache
sized for all new tokens, finished rows kept), so that on CUDA one decode step is captured as a graph and replayed
for each token: one launch per token instead of a few hundred."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpokit.models.fast.fused_linear import cast, decode_product
from grpokit.models.fast.parts import LlamaParts, rope_pairs

CACHE_ROOM = 32  # new tokens the decode cache has room for at first; it doubles that room when full


class Decoding(LlamaParts):
    """Decoding with a preallocated cache: :meth:`decode`."""

    @torch.inference_mode()  # not only no_grad: without autograd's bookkeeping each small operator is cheaper
    def decode(
        self, prompt_ids: Tensor, prompt_mask: Tensor, max_new_tokens: int,
        choose: Callable[[Tensor, int, Tensor], tuple[Tensor, Tensor]], repeats: int = 1, int8: bool = False,
        graph: bool = False, exact_prefill: bool = False,
    ) -> None:
        """Run the prompts (B, P, left-padded) once each and then up to ``max_new_tokens`` decode steps
        for N = B × ``repeats`` rows (each prompt's rows contiguous).

        ``choose(logits (A, V) float32, t, rows (A,))`` picks the next token of each still-running row
        (indices into N) and returns ``(tokens (A,), stopped (A,) bool, hold (A,) bool or None)``: rows that
        stopped leave; a held row's pick is a hole (it waits for a tool or an environment: the token's key and
        value are masked from every later step and its position is not taken; ``graph`` takes no holes), and
        the loop goes on past ``max_new_tokens`` steps until every row has left. Finished rows leave the batch
        (and the cache) once they are a quarter of it. ``int8``: every projection and the LM head in int8
        (:mod:`~grpokit.models.fast.int8`), quantized from the weights as they are at this call. ``graph``:
        :meth:`_decode_static` (the same tokens; on CUDA, the decode step captured and replayed as a graph).
        ``exact_prefill``: under autocast, the prompts read in the weights' precision, only the decode steps'
        projections in autocast's dtype (int8's prefill is exact already); until the prefill, the products hold
        their weights in that precision, as without autocast.
        """
        device = prompt_ids.device.type
        # Under autocast, projections compute in its dtype with weights cast once; the rest (norms, the
        # cache and attention) stays in the weights' dtype, which on the CPU is also faster for the
        # one-query attention products.
        compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        compute = torch.int8 if int8 else compute
        with torch.autocast(device, enabled=False):
            (self._decode_static if graph else self._decode)(
                prompt_ids, prompt_mask, max_new_tokens, choose, compute, repeats, exact_prefill)

    def _start(self, prompt_ids: Tensor, prompt_mask: Tensor, max_new_tokens: int, compute: torch.dtype | None,
               repeats: int, exact_prefill: bool, room: int) -> tuple:
        """The products, the prefill and what decoding continues from: a cache with ``room`` columns after
        the prompt, each row's last hidden state, the additive mask over the columns, the next positions."""
        b, prompt_width = prompt_ids.shape
        n, total = b * repeats, prompt_width + max_new_tokens
        device = prompt_ids.device
        layers = [self._decode_products(layer, n, compute, exact_prefill) for layer in self.backbone.layers]
        head = decode_product(self.lm_head, rows=n, dtype=torch.int8 if compute == torch.int8 else None)  # own dtype
        x = self.backbone.embed_tokens(prompt_ids)  # (B, P, hidden)
        dtype = x.dtype
        # The final norm's weight scales the rows, not the head's weight: that fold would copy the whole
        # (vocabulary × hidden) matrix at every call, for one small product per decode step.
        head_scale = self._norm_scale(self.backbone.norm).to(dtype)
        cache = torch.zeros(len(layers), 2, b, self.kv_heads, prompt_width + room, self.head_dim,
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

        last = self._prefill(x, layers, cache, turns[positions].unsqueeze(2), prefill_mask)[:, -1]  # (B, hidden)
        # Each prompt's cache, last hidden state, positions and mask, once per row that continues it.
        cache = cache.repeat_interleave(repeats, dim=2)
        last, bias = last.repeat_interleave(repeats, dim=0), bias.repeat_interleave(repeats, dim=0)
        next_positions = positions[:, -1].repeat_interleave(repeats) + 1
        return layers, head, head_scale, turns, cache, last, bias, next_positions

    def _decode(self, prompt_ids, prompt_mask, max_new_tokens, choose, compute, repeats, exact_prefill) -> None:
        prompt_width, total = prompt_ids.shape[1], prompt_ids.shape[1] + max_new_tokens
        # The cache holds the prompt and room for CACHE_ROOM new tokens, and grows by doubling that room:
        # attention then reads keys and values packed close together, not spread over the full length
        # (on the CPU that read is ~2x faster once the cache outgrows the processor's caches).
        layers, head, head_scale, turns, cache, last, bias, next_positions = self._start(
            prompt_ids, prompt_mask, max_new_tokens, compute, repeats, exact_prefill,
            room=min(max_new_tokens, CACHE_ROOM))
        rows = torch.arange(len(last), device=last.device)
        alive = torch.ones(len(rows), dtype=torch.bool, device=last.device)
        finished = 0  # rows of the batch that have stopped (they stay until they are a quarter of it)
        holes = False  # whether a row has waited (its picks holes): then the loop runs until every row has left
        for t in itertools.count():
            logits = cast(head(self._normalize(last) * head_scale), torch.float32)
            picked = alive.nonzero().squeeze(1) if finished else None
            chosen, stopped, hold = (choose(logits, t, rows) if picked is None else
                                     choose(logits[picked], t, rows[picked]))
            holes = holes or hold is not None
            if t >= max_new_tokens - 1 and not holes:
                break
            stopping = int(stopped.sum())
            if stopping:
                alive[stopped if picked is None else picked[stopped]] = False
                finished += stopping
                if finished == len(rows):
                    break
            tokens = chosen if picked is None else torch.zeros_like(rows).index_put((picked,), chosen)
            waiting = None if hold is None else (hold if picked is None else
                                                 torch.zeros_like(alive).index_put((picked,), hold))
            if 4 * finished >= len(rows):  # drop finished rows from the batch and the cache
                keep = alive.nonzero().squeeze(1)
                rows, tokens, next_positions, bias, alive = (
                    v[keep] for v in (rows, tokens, next_positions, bias, alive))
                waiting = None if waiting is None else waiting[keep]
                cache = cache[:, :, keep]  # contiguous again: each layer's (rows, heads) merge into one batch dim
                finished = 0
            column = prompt_width + t
            if column == cache.shape[-2]:
                room = cache.shape[-2] - prompt_width
                size = prompt_width + 2 * room  # past prompt + max_new_tokens columns only after holes
                grown = cache.new_zeros(*cache.shape[:-2], size if holes else min(total, size), cache.shape[-1])
                grown[..., :column, :] = cache
                cache = grown
            if column == bias.shape[1]:  # past prompt + max_new_tokens columns: only after holes
                bias = torch.cat([bias, bias.new_zeros(len(bias), max(max_new_tokens, 1))], dim=1)
            x = self.backbone.embed_tokens(tokens)  # (A, hidden)
            if waiting is not None:  # a hole: its key and value never attended to, its position not taken
                bias[waiting, column] = float("-inf")
            last = self._decode_step(x, layers, cache, turns[next_positions].unsqueeze(1), column, bias)
            if holes:  # only rows that took a position move on (finished rows too stay put: the loop may run long)
                next_positions = next_positions + (alive if waiting is None else alive & ~waiting).long()
            else:
                next_positions = next_positions + 1

    def _decode_static(self, prompt_ids, prompt_mask, max_new_tokens, choose, compute, repeats,
                       exact_prefill) -> None:
        """:meth:`_decode` with every shape and address fixed for the whole call: the cache has room for all
        new tokens, finished rows stay in the batch (their picks are not asked for), the column and the
        positions are tensors the step advances itself, and attention reads every column under a mask that
        opens one column per step (a closed column weighs exactly 0). On CUDA the step after the first is
        captured as a graph and replayed for every further token; elsewhere it runs as it is (the tests
        compare its tokens with :meth:`_decode`'s on the CPU)."""
        prompt_width = prompt_ids.shape[1]
        layers, head, head_scale, turns, cache, last, bias, positions = self._start(
            prompt_ids, prompt_mask, max_new_tokens, compute, repeats, exact_prefill, room=max_new_tokens)
        bias[:, prompt_width:] = float("-inf")  # opened one column per step
        rows = torch.arange(len(last), device=last.device)
        alive = torch.ones(len(rows), dtype=torch.bool, device=last.device)
        tokens = torch.zeros_like(rows)
        column = torch.tensor([prompt_width], device=last.device)
        logits = cast(head(self._normalize(last) * head_scale), torch.float32)

        def step() -> None:  # the same kernels, on the same buffers, at every token
            bias.index_fill_(1, column, 0.0)
            x = self.backbone.embed_tokens(tokens)
            h = self._decode_step(x, layers, cache, turns[positions].unsqueeze(1), column, bias)
            logits.copy_(cast(head(self._normalize(h) * head_scale), torch.float32))
            positions.add_(1)
            column.add_(1)

        graph = None
        for t in range(max_new_tokens):
            picked = alive.nonzero().squeeze(1)
            chosen, stopped, _ = choose(logits[picked], t, rows[picked])  # no holes: the caller waits instead
            alive[picked[stopped]] = False
            if t == max_new_tokens - 1 or not alive.any():
                break
            tokens[picked] = chosen
            if graph is not None:
                graph.replay()
            elif last.device.type != "cuda":
                step()
            elif t == 0:  # the warm-up a capture needs (libraries' workspaces, lazy setup), on a side stream as
                side = torch.cuda.Stream()  # PyTorch's CUDA-graph notes do it
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    step()
                torch.cuda.current_stream().wait_stream(side)
            else:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):  # recorded, not run
                    step()
                graph.replay()

    def _decode_products(self, layer: nn.Module, rows: int, dtype: torch.dtype | None,
                         exact_prefill: bool = False) -> tuple:
        """A layer's four products for decoding (q/k/v and gate/up fused), each RMSNorm's weight folded
        into the product after it, and q and k in :func:`rope_pairs`' layout (:meth:`_pair_order`)."""
        attention, mlp = layer.self_attn, layer.mlp
        order = self._pair_order(layer.input_layernorm.weight.device)
        options = dict(rows=rows, dtype=dtype, exact_first=exact_prefill)
        return (decode_product(attention.q_proj, attention.k_proj, attention.v_proj, **options,
                               scale=self._norm_scale(layer.input_layernorm), order=order),
                decode_product(attention.o_proj, **options),
                decode_product(mlp.gate_proj, mlp.up_proj, **options,
                               scale=self._norm_scale(layer.post_attention_layernorm)),
                decode_product(mlp.down_proj, **options))

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

    def _decode_step(self, x: Tensor, layers: list, cache: Tensor, turns: Tensor, column: int | Tensor,
                     mask: Tensor) -> Tensor:
        """Every layer on one new token per row, ``x`` (A, hidden); writes its keys and values at ``column``
        of ``cache`` and attends to columns 0..column under the additive ``mask`` (A, ≥ column + 1). A
        ``column`` tensor (1,) (:meth:`_decode_static`): written at that index, every column attended to."""
        a = x.shape[0]
        heads, kv, groups, d = self.heads, self.kv_heads, self.heads // self.kv_heads, self.head_dim
        static = isinstance(column, Tensor)
        end, inner = cache.shape[-2] if static else column + 1, self.intermediate
        mask = mask[:, None, None, :end].expand(a, kv, 1, end).reshape(a * kv, 1, end)
        # Every layer's views, taken once per step (each view is a dispatch too): where this column's
        # keys and values go, (layers, A, 2, kv, D), and the filled columns, (layers, 2, A · kv, end, D).
        slots = None if static else cache[..., column, :].transpose(1, 2)
        filled = cache[..., :end, :].flatten(2, 3)
        for i, (qkv_proj, o_proj, gate_up, down) in enumerate(layers):
            # in the cache's dtype before the rotation: one cast (under autocast), then all in place
            qkv = cast(qkv_proj(self._normalize(x)), cache.dtype).view(a, heads + 2 * kv, d)
            rope_pairs(qkv[:, : heads + kv], turns)
            new = qkv[:, heads:].view(a, 2, kv, d)  # keys and values
            if static:
                cache[i].index_copy_(3, column, new.transpose(0, 1).unsqueeze(3))
            else:
                slots[i].copy_(new)
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
            qk = rope_pairs(qkv[:, :, : heads + kv], turns).transpose(1, 2)  # (B, heads + kv, P, D)
            q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, :, heads + kv:].transpose(1, 2)
            k_cache[:, :, :p], v_cache[:, :, :p] = k, v
            if kv != heads:
                k, v = (t.repeat_interleave(heads // kv, dim=1) for t in (k, v))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=self.scaling)
            x = o_proj(out.transpose(1, 2).reshape(b, p, self.q_size), add=x)
            gate, up = gate_up(self._normalize(x)).chunk(2, dim=-1)
            x = down(F.silu(gate) * up, add=x)
        return x
