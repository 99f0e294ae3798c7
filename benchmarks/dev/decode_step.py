"""One decode step of the fast path on fixed inputs, by the number of rows still decoding.

    python benchmarks/dev/decode_step.py --config small --rows 8 16 32

Builds ``vs_trl.py``'s model for ``--config`` and, for each row count, what a rollout's decode step
runs: the layers' products, norms, RoPE, the cache write and one-query attention, then the final norm
and the LM head (``LlamaFamily._decode_step``), at cache column ``--column``. Also times the layers'
products alone (each product on its own input, all layers) and the layers' one-query attention alone
(scores, softmax and the weighted sum over the filled columns), so the step can be read against its
parts. Row counts alternate in blocks of 50 calls, 20 blocks; prints min and median per call. No
sampling, so the tokens do not differ between variants. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, vs_trl.py
from vs_trl import CONFIGS, build  # noqa: E402


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from grpokit.models.fast.fused_linear import decode_product
    from grpokit.models.fast.llama_family import LlamaFamily

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="small", choices=list(CONFIGS))
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--column", type=int, default=40, help="cache column of the new token (prompt included)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = AutoModelForCausalLM.from_pretrained(build(args.config, Path(tmp)), dtype=torch.float32)
    family, config, end = LlamaFamily(model), model.config, args.column + 1
    kv, d = family.kv_heads, family.head_dim
    calls = {}
    with torch.inference_mode():
        for a in args.rows:
            layers = [family._decode_products(layer, a, None) for layer in family.backbone.layers]
            head = decode_product(family.lm_head, rows=a)
            head_scale = family._norm_scale(family.backbone.norm)
            cache = torch.randn(len(layers), 2, a, kv, end + 32, d)  # room beyond the column, as in decoding
            turns = family._rotary_turns(end, cache)[torch.full((a,), args.column)].unsqueeze(1)
            mask = torch.zeros(a, end)
            x, inner = torch.randn(a, config.hidden_size), torch.randn(a, family.intermediate)
            q = torch.randn(a * kv, family.heads // kv, d)
            filled = cache[..., :end, :].flatten(2, 3)
            scores_mask = torch.zeros(a * kv, 1, end)

            def step(x=x, layers=layers, head=head, head_scale=head_scale, cache=cache, turns=turns, mask=mask):
                head(family._normalize(family._decode_step(x, layers, cache, turns, args.column, mask)) * head_scale)

            def products(x=x, inner=inner, layers=layers, head=head):
                for qkv, o, gate_up, down in layers:
                    qkv(x), o(x, add=x), gate_up(x), down(inner, add=x)
                head(x)

            def attention(q=q, filled=filled, scores_mask=scores_mask):
                for keys, values in filled:
                    scores = torch.baddbmm(scores_mask, q, keys.transpose(1, 2), alpha=family.scaling)
                    torch.bmm(torch.softmax(scores, dim=-1), values)

            calls[a] = {"step": step, "products": products, "attention": attention}
        times = {(a, part): [] for a in args.rows for part in ("step", "products", "attention")}
        for block in range(20):
            for a in args.rows if block % 2 == 0 else args.rows[::-1]:
                for part, call in calls[a].items():
                    for _ in range(5):
                        call()
                    start = time.perf_counter()
                    for _ in range(50):
                        call()
                    times[a, part].append((time.perf_counter() - start) / 50 * 1e6)
    print(f"{args.config}, cache column {args.column}: µs per call, min / median of 20 blocks of 50")
    for a in args.rows:
        print(f"{a:3d} rows: " + "; ".join(
            f"{part} {min(times[a, part]):.0f} / {statistics.median(times[a, part]):.0f}"
            for part in ("step", "products", "attention")))


if __name__ == "__main__":
    main()
