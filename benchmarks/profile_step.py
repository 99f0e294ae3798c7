"""Where a grpokit step spends its time, with the fast path off (the models' own forward) and on.

    python benchmarks/profile_step.py --config large

First times the decode step's matrix products for ``--config``'s shapes (every layer's own weights,
32 down to 8 rows) three ways: MKL on rows (``x @ Wᵀ``, the models' own), MKL on columns (``W @ x``) and
oneDNN on packed weights (the fast path's, on the CPU). Then builds vs_trl.py's model (``common.build``), runs
two untimed warm-up steps, profiles one step per setting with ``torch.profiler`` and prints the step's phases and
the operators with the most self CPU time. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

from common import CONFIGS, SMOKE_HELP, SMOKE_THREADS, build, grpokit_settings, rows


def decode_products(config_name: str, counts: tuple[int, ...] = (32, 24, 17, 16, 15, 12, 8), repeats: int = 7
                    ) -> None:
    """Best-of-``repeats`` time of one decode step's projections (all layers, distinct weights) at row counts a
    decode batch passes through, three ways: MKL on rows (``x @ Wᵀ``, the models' own), MKL on columns
    (``W @ x``: fast at 16, 24 and 32 columns, much slower just off them), and oneDNN on weights packed
    once (what ``llama_family`` decodes with on the CPU; no such cliffs)."""
    import time

    import torch

    shape, _, _ = CONFIGS[config_name]
    h, i, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    weights = [[torch.randn(3 * h, h), torch.randn(h, h), torch.randn(2 * i, h), torch.randn(h, i)]
               for _ in range(layers)]
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in layer] for layer in weights]

    def by_rows(x, inner):
        return [(x @ q.t(), x @ o.t(), x @ gu.t(), inner @ d.t()) for q, o, gu, d in weights]

    def by_columns(x, inner):
        return [(q @ x, o @ x, gu @ x, d @ inner) for q, o, gu, d in weights]

    def by_onednn(x, inner):
        linear = torch.ops.mkldnn._linear_pointwise
        return [(linear(x, q, None, "none", [], ""), linear(x, o, None, "none", [], ""),
                 linear(x, gu, None, "none", [], ""), linear(inner, d, None, "none", [], ""))
                for q, o, gu, d in packed]

    for count in counts:
        x, inner = torch.randn(count, h), torch.randn(count, i)
        flops = 2 * count * sum(w.numel() for layer in weights for w in layer)
        times = []
        for step, args in ((by_rows, (x, inner)), (by_columns, (x.t().contiguous(), inner.t().contiguous())),
                           (by_onednn, (x, inner))):
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                for _ in range(20):
                    step(*args)
                best = min(best, (time.perf_counter() - start) / 20)
            times.append(f"{best * 1e3:.2f} ms ({flops / best / 1e9:.0f} GFLOP/s)")
        print(f"decode products, {count} rows: MKL rows {times[0]}, MKL columns {times[1]}, oneDNN packed {times[2]}")


def main(argv: list[str] | None = None) -> None:
    import torch
    from torch.profiler import profile
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpokit.algorithms.grpo import GRPOTrainer
    from grpokit.config import GRPOConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="large", choices=list(CONFIGS))
    parser.add_argument("--mixed-precision", default="no", choices=["no", "bf16"])
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    torch.set_num_threads(SMOKE_THREADS if args.smoke else 2)
    if args.smoke:
        args.config = "tiny"
        decode_products(args.config, counts=(8,), repeats=1)
    else:
        decode_products(args.config)
    with tempfile.TemporaryDirectory() as tmp:
        directory = str(build(args.config, Path(tmp)))
        tokenizer = AutoTokenizer.from_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        mode = "bf16" if args.mixed_precision == "bf16" else "fp32"
        for fast in (False, True):
            config = GRPOConfig.from_dict(grpokit_settings(args.config, mode, directory, str(Path(tmp) / f"run-{fast}"),
                                                           max_steps=3, overrides={"fast_path": fast}))
            trainer = GRPOTrainer(config, model=copy.deepcopy(model), tokenizer=tokenizer, train_dataset=rows())
            for _ in range(2):
                trainer.training_step()
            with profile() as prof:
                metrics = trainer.training_step()
            phases = {k: round(metrics[k], 3) for k in
                      ("time_generate", "time_score", "time_frozen_logprobs", "time_update", "time_step")}
            print(f"\n== fast_path: {str(fast).lower()} ({args.config}, mixed_precision {args.mixed_precision}) "
                  f"{phases}, mean completion length {metrics['completion_length_mean']:.1f}")
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top,
                                              max_name_column_width=48)
            print(table)


if __name__ == "__main__":
    main()
