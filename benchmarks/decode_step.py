"""One decode step of the fast path on fixed inputs, by the number of rows still decoding.

    python benchmarks/decode_step.py --config small --rows 8 16 32

Builds ``vs_trl.py``'s model for ``--config`` (``common.build``) and, for each row count, what a rollout's decode step
runs: the layers' products, norms, RoPE, the cache write and one-query attention, then the final norm
and the LM head (``LlamaFamily._decode_step``), at cache column ``--column``. Also times the layers'
products alone (each product on its own input, all layers), the LM head's product alone, the layers' products
all on the first layer's weights (which then stay in the processor's caches: the arithmetic without the reading),
the layers' weights merely read (summed: the reading without the arithmetic), the layers' one-query attention alone
(scores, softmax and the weighted sum over the filled columns) and the filled keys and values merely read (summed),
so the step can be read against its parts, the products against their arithmetic and memory traffic (how much the
two overlap), and attention against its memory traffic. Row counts alternate in blocks of 50 calls, 20 blocks;
prints min and median per call. No sampling, so the tokens do not differ between variants. Run it alone on the
machine.

``--compile``: also the step under ``torch.compile(dynamic=True)``, with each product an opaque custom op
(Inductor lowers oneDNN's packed linear only for weights it froze itself); prints the seconds to compile, to
compile again for the next cache column and for fewer rows (as decoding moves on and drops finished rows), and
the compiled step's largest difference from the eager one in the logits, and both steps' best of 5 calls.

``--compile_attention``: also the layers' one-query attention written as elementwise products and sums (no batched
matrix products), under ``torch.compile(dynamic=True)``: Inductor fuses it into loops of its own; prints its largest
difference from the eager attention.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import timeit
from pathlib import Path

from common import CONFIGS, SMOKE_HELP, SMOKE_THREADS, build


def main(argv: list[str] | None = None) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from grpokit.models.fast.fused_linear import decode_product
    from grpokit.models.fast.llama_family import LlamaFamily

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="small", choices=list(CONFIGS))
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--column", type=int, default=40, help="cache column of the new token (prompt included)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="also the step under torch.compile (see above)")
    parser.add_argument("--compile_attention", action="store_true", help="also attention compiled (see above)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    blocks, calls_per_block = 20, 50
    if args.smoke:
        args.config, args.rows, args.column, blocks, calls_per_block = "tiny", [2, 4], 8, 2, 1
        args.threads = SMOKE_THREADS
    if args.compile:
        opaque_products()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = AutoModelForCausalLM.from_pretrained(build(args.config, Path(tmp)), dtype=torch.float32)
    family, config, end = LlamaFamily(model), model.config, args.column + 1
    kv, d = family.kv_heads, family.head_dim
    calls = {}

    def products_and_sums(mask, q, keys, values):  # the attention below, as elementwise products and sums
        scores = (q.unsqueeze(2) * keys.unsqueeze(1)).sum(-1) * family.scaling + mask
        return (torch.softmax(scores, dim=-1).unsqueeze(-1) * values.unsqueeze(1)).sum(2)
    fused_attention = torch.compile(products_and_sums, dynamic=True)
    with torch.inference_mode():
        for a in args.rows:
            layers = [family._decode_products(layer, a, None) for layer in family.backbone.layers]
            head = decode_product(family.lm_head, rows=a)
            head_scale = family._norm_scale(family.backbone.norm)
            cache = torch.randn(len(layers), 2, a, kv, end + 32, d)  # room beyond the column, as in decoding
            turns = family._rotary_turns(end, cache)[torch.full((a,), args.column)].unsqueeze(1)
            mask = torch.zeros(a, end + 32)  # as wide as the cache: the compiled step also runs a column on
            x, inner = torch.randn(a, config.hidden_size), torch.randn(a, family.intermediate)
            q = torch.randn(a * kv, family.heads // kv, d)
            filled = cache[..., :end, :].flatten(2, 3)
            scores_mask = torch.zeros(a * kv, 1, end)

            def step(x=x, layers=layers, head=head, head_scale=head_scale, cache=cache, turns=turns, mask=mask):
                head(family._normalize(family._decode_step(x, layers, cache, turns, args.column, mask)) * head_scale)

            def products(x=x, inner=inner, layers=layers):
                for qkv, o, gate_up, down in layers:
                    qkv(x), o(x, add=x), gate_up(x), down(inner, add=x)

            def products_cached(x=x, inner=inner, layers=layers):
                qkv, o, gate_up, down = layers[0]
                for _ in layers:
                    qkv(x), o(x, add=x), gate_up(x), down(inner, add=x)

            weights = [p for layer in family.backbone.layers for p in layer.parameters() if p.dim() == 2]

            def weights_read(weights=weights):
                for w in weights:
                    w.sum()

            def attention(q=q, filled=filled, scores_mask=scores_mask):
                for keys, values in filled:
                    scores = torch.baddbmm(scores_mask, q, keys.transpose(1, 2), alpha=family.scaling)
                    torch.bmm(torch.softmax(scores, dim=-1), values)

            def attention_compiled(q=q, filled=filled, scores_mask=scores_mask):
                for keys, values in filled:
                    fused_attention(scores_mask, q, keys, values)

            def cache_read(filled=filled):  # what attention reads, summed: its floor in memory traffic
                for keys, values in filled:
                    keys.sum(), values.sum()

            calls[a] = {"step": step, "products": products, "head": lambda x=x, head=head: head(x),
                        "products cached": products_cached, "weights read": weights_read,
                        "attention": attention, "cache read": cache_read}
            if args.compile_attention:
                calls[a]["attention compiled"] = attention_compiled
                keys, values = filled[0]
                eager = torch.bmm(torch.softmax(torch.baddbmm(scores_mask, q, keys.transpose(1, 2),
                                                              alpha=family.scaling), dim=-1), values)
                print(f"{a} rows: compiled attention's largest difference from eager "
                      f"{(fused_attention(scores_mask, q, keys, values) - eager).abs().max().item():.2g}", flush=True)
            if args.compile:
                compiled_step(family, layers, head, head_scale, x, cache, turns, mask, args.column)
        parts = tuple(calls[args.rows[0]])
        times = {(a, part): [] for a in args.rows for part in parts}
        for block in range(blocks):
            for a in args.rows if block % 2 == 0 else args.rows[::-1]:
                for part, call in calls[a].items():
                    for _ in range(5):
                        call()
                    start = time.perf_counter()
                    for _ in range(calls_per_block):
                        call()
                    times[a, part].append((time.perf_counter() - start) / calls_per_block * 1e6)
    print(f"{args.config}, cache column {args.column}: µs per call, min / median of {blocks} blocks of "
          f"{calls_per_block}")
    for a in args.rows:
        print(f"{a:3d} rows: " + "; ".join(
            f"{part} {min(times[a, part]):.0f} / {statistics.median(times[a, part]):.0f}"
            for part in parts))


def opaque_products() -> None:
    """Every oneDNN product the fast path builds from here on calls one custom op, which Inductor leaves alone."""
    import torch

    import grpokit.models.fast.fused_linear as fused_linear

    @torch.library.custom_op("grpokit_dev::packed_linear", mutates_args=(),
                             schema="(Tensor x, Tensor packed, Tensor? bias, Tensor? add) -> Tensor")
    def packed_linear(x, packed, bias, add):
        if add is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(x, add, packed, bias, "add")
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    packed_linear.register_fake(lambda x, packed, bias, add: x.new_empty(x.shape[0], packed.shape[0]))
    fused_linear._onednn_product = lambda packed, bias, dtype: (
        lambda x, add=None: packed_linear(fused_linear.cast(x, dtype), packed, bias, add))


def compiled_step(family, layers, head, head_scale, x, cache, turns, mask, column: int) -> None:
    """The step under torch.compile: the seconds to compile it for ``column``, the next column and fewer rows,
    then the best of 5 calls beside the eager step's."""
    import torch

    def step(x, cache, turns, mask, column):
        return head(family._normalize(family._decode_step(x, layers, cache, turns, column, mask)) * head_scale)

    compiled = torch.compile(step, dynamic=True)
    f = len(x) * 3 // 4
    for what, args in (("compile", (x, cache.clone(), turns, mask, column)),
                       ("the next column", (x, cache.clone(), turns, mask, column + 1)),
                       (f"{f} rows", (x[:f], cache[:, :, :f].clone(), turns[:f], mask[:f], column))):
        start = time.perf_counter()
        out = compiled(*args)
        seconds = time.perf_counter() - start
        print(f"{len(x)} rows: {what} {seconds:.1f} s; largest logit difference from eager "
              f"{(out - step(*args)).abs().max().item():.2g}", flush=True)
    for name, call in (("compiled", compiled), ("eager", step)):
        best = min(timeit.timeit(lambda call=call: call(x, cache, turns, mask, column), number=1) for _ in range(5))
        print(f"{len(x)} rows: {name} step {best * 1e3:.0f} ms (best of 5)", flush=True)


if __name__ == "__main__":
    main()
