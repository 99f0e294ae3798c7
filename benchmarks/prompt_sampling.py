"""``prompt_sampling: uniform`` against ``signal`` on the built-in task: the share of groups with signal and what the
policy learns, same seeds, same steps.

    python benchmarks/prompt_sampling.py --seeds 0 1 --out benchmarks/results/prompt_sampling.json   # ~20 min
    python benchmarks/prompt_sampling.py --seeds 0 1 --unsolvable 0.5 \
        --out benchmarks/results/prompt_sampling_unsolvable.json

The demo's run (warm start cached per seed, 60 GRPO steps of 16 prompts × 8) on a training set of ``--num_prompts``
prompts, so that each is drawn several times (7.5 on average with 128) and their spreads can steer the draw: the
warm-started model answers the sums without a carry right every time and those with one rarely, so under uniform
draws many groups have no signal. ``--unsolvable F``: a share F of the training rows get a wrong reference answer
(the sum plus one), prompts no policy can solve, as a dataset's mislabelled or too-hard rows are; the held-out
evaluation is unchanged. Reports per run the mean ``frac_signal_groups`` over the steps (and over the second
half), the held-out accuracy (400 prompts) before and after, greedy and sampled, on all and on the carry class (and in
the JSON the seconds of the GRPO steps, comparable only within one run on an otherwise idle machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
from pathlib import Path

import torch
from common import SMOKE_GRPO, SMOKE_HELP, SMOKE_THREADS, smoke_dir, smoke_warm_starts

from grpokit.algorithms.demo import run_demo
from grpokit.runtime.device import cpu_model
from grpokit.tasks.arithmetic import train_rows


def one_run(seed: int, mode: str, data: Path, out_dir: Path, **settings) -> dict:
    result = run_demo(seed, out_dir, progress=False, dataset=str(data), prompt_sampling=mode, save_every=0, **settings)
    steps = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    signal = [m["frac_signal_groups"] for m in steps if "frac_signal_groups" in m]
    half = signal[len(signal) // 2:]
    return {"seed": seed, "prompt_sampling": mode, "frac_signal_groups": sum(signal) / len(signal),
            "frac_signal_groups_second_half": sum(half) / len(half), "signal_per_step": signal,
            "before": result["before"], "after": result["after"], "grpo_seconds": result["seconds"]["grpo"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--num_prompts", type=int, default=128, help="training prompts (the demo's has 4096)")
    parser.add_argument("--unsolvable", type=float, default=0.0, help="share of training rows given a wrong answer")
    parser.add_argument("--out", default="benchmarks/results/prompt_sampling.json")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    settings = {}
    if args.smoke:
        args.seeds, args.num_prompts, args.out = [0], 8, str(smoke_dir() / "prompt_sampling.json")
        settings = dict(SMOKE_GRPO, max_steps=2, eval_prompts=4, samples_per_prompt=1)
        smoke_warm_starts(args.seeds)
        torch.set_num_threads(SMOKE_THREADS)

    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            data = Path(tmp) / f"train-{seed}.jsonl"
            rows = train_rows(args.num_prompts, seed)
            for row in random.Random(seed).sample(rows, round(args.unsolvable * len(rows))):
                row["answer"] = str(int(row["answer"]) + 1)
            data.write_text("".join(json.dumps(row) + "\n" for row in rows))
            for mode in ("uniform", "signal"):
                records.append(one_run(seed, mode, data, Path(tmp) / f"{mode}-{seed}", **settings))
                print(json.dumps({k: v for k, v in records[-1].items() if k != "signal_per_step"}), flush=True)

    machine = {"python": platform.python_version(), "cpu": cpu_model(), "cpus": os.cpu_count()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine, "num_prompts": args.num_prompts,
                                          "unsolvable": args.unsolvable, "runs": records}, indent=2))
    pct = lambda x: f"{100 * x:.1f}"  # noqa: E731
    print("| seed | prompt_sampling | groups with signal, mean (2nd half) | greedy acc before → after "
          "| sampled acc before → after | carry class greedy after |")
    print("|---|---|---|---|---|---|")
    for r in records:
        b, a = r["before"]["all"], r["after"]["all"]
        print(f"| {r['seed']} | {r['prompt_sampling']} | {pct(r['frac_signal_groups'])} % "
              f"({pct(r['frac_signal_groups_second_half'])} %) "
              f"| {pct(b['greedy_correct'])} → {pct(a['greedy_correct'])} "
              f"| {pct(b['sampled_correct'])} → {pct(a['sampled_correct'])} "
              f"| {pct(r['after']['carry']['greedy_correct'])} |")


if __name__ == "__main__":
    main()
