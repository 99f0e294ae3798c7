"""Sampling in a lower precision (``rollout_precision: bf16`` or ``int8``, with importance sampling) against
sampling from the float32 policy: the built-in demo's learning, seed by seed, and the sampler's distance from the
policy.

    python benchmarks/rollout_precision.py --seeds 0 1     # the warm start once per seed (~5 min), then ~2 min a run
    python benchmarks/rollout_precision.py --seeds 0 --precisions bf16 int8 \
        --out benchmarks/results/rollout_precision_sequence_mask.json   # the default correction (sequence_mask, C = 3)
    python benchmarks/rollout_precision.py --seeds 0 --is_mode token_truncate --is_cap 2   # per token (C = 2)

Each seed's warm start (cached, shared by both settings) is followed by the demo's 60 GRPO steps (float32 training,
``mixed_precision: no``) with each ``rollout_precision``, in the same process, one after the other, and the demo's
held-out evaluation (400 problems; greedy, and 4 samples at T = 1). From each run's metrics: the mean
``sampler_kl``, ``is_weight_mean`` and ``is_capped_frac`` over its steps and the seconds spent sampling. Writes
``benchmarks/results/rollout_precision.json`` and prints the Markdown table for docs/benchmarks.md. Decoding speed
in each precision, alone: ``benchmarks/decode_roofline.py`` (``--dtype``).
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path

import torch
from common import SMOKE_GRPO, SMOKE_HELP, SMOKE_THREADS, smoke_dir, smoke_warm_starts

from grpokit.algorithms.demo import run_demo
from grpokit.config import GRPOConfig
from grpokit.core.importance import IS_MODES
from grpokit.runtime.device import cpu_model

PRECISIONS = ("fp32", "bf16", "int8")


def mean(metrics: list[dict], key: str) -> float | None:
    return sum(m[key] for m in metrics) / len(metrics) if key in metrics[0] else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument("--is_mode", default=GRPOConfig().rollout_is_mode, choices=IS_MODES, help="rollout_is_mode")
    parser.add_argument("--is_cap", type=float, default=GRPOConfig().rollout_is_cap, help="rollout_is_cap")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "rollout_precision.json"))
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    correction = {"rollout_is_mode": args.is_mode, "rollout_is_cap": args.is_cap}
    settings = {}
    if args.smoke:
        args.seeds, args.out = [0], str(smoke_dir() / "rollout_precision.json")
        settings = dict(SMOKE_GRPO, max_steps=1, eval_prompts=4, samples_per_prompt=1)
        smoke_warm_starts(args.seeds)
        torch.set_num_threads(SMOKE_THREADS)
    records = []
    for seed in args.seeds:
        for precision in args.precisions:
            with tempfile.TemporaryDirectory() as tmp:
                result = run_demo(seed, tmp, progress=False, rollout_precision=precision, mixed_precision="no",
                                  **correction, **settings)
                metrics = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
            after, before = result["after"], result["before"]
            record = {"seed": seed, "rollout_precision": precision, **correction,
                      "greedy_before": before["all"]["greedy_correct"], "greedy_after": after["all"]["greedy_correct"],
                      "sampled_after": after["all"]["sampled_correct"],
                      "carry_greedy_after": after["carry"]["greedy_correct"],
                      **{key: mean(metrics, key) for key in ("sampler_kl", "is_weight_mean", "is_capped_frac")},
                      "seconds_generate": sum(m["time_generate"] for m in metrics),
                      "seconds_grpo": result["seconds"]["grpo"]}
            records.append(record)
            print(json.dumps(record), flush=True)
    Path(args.out).write_text(json.dumps({"machine": {"cpu": cpu_model(), "platform": platform.platform(),
                                                      "threads": torch.get_num_threads()},
                                          "torch": torch.__version__, "records": records}, indent=1))
    print("\n| seed | rollout_precision | greedy acc after | sampled acc after | carry class greedy after "
          "| sampler_kl | IS weight mean | capped | s sampling / GRPO |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in records:
        lowered = r["sampler_kl"] is not None
        correction = (f"{r['sampler_kl']:.1e} | {r['is_weight_mean']:.4f} | {100 * r['is_capped_frac']:.2f} % | "
                      if lowered else "— | — | — | ")
        print(f"| {r['seed']} | {r['rollout_precision']} | {100 * r['greedy_after']:.1f} "
              f"| {100 * r['sampled_after']:.1f} | {100 * r['carry_greedy_after']:.1f} | {correction}"
              f"{r['seconds_generate']:.0f} / {r['seconds_grpo']:.0f} |")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
