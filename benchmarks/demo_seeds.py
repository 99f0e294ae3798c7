"""Run ``grpokit demo`` from scratch for several seeds and check the demo's bar.

    python benchmarks/demo_seeds.py --seeds 0 1 2 --out benchmarks/results/demo_seeds.json
    python benchmarks/demo_seeds.py --task tools --seeds 0 1 2 --out benchmarks/results/demo_tools_seeds.json
    .venv-vllm/bin/python benchmarks/demo_seeds.py --generation_engine vllm --seeds 0 1 \
        --out benchmarks/results/demo_vllm_seeds.json

Each seed runs the real command in a fresh process with an empty warm-start cache, so its wall time
is what a user's first ``grpokit demo`` costs. Prints a Markdown table for ``docs/benchmarks.md``.
Run it alone: timings on a 2-core machine are meaningless while anything else is running.

The bar (on held-out prompts): accuracy up >= 25 points both greedy and sampled at T=1; format rate
>= 95 % (greedy and sampled); on the carry class, greedy accuracy from < 50 % to > 90 %; <= 10 min.
The tools demo's: greedy accuracy and the tool-call rate (greedy and sampled) up >= 30 points; <= 15 min.

``--smoke``: the same command in this process, one GRPO step on 4 held-out prompts, from a warm start of 2 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import SMOKE_HELP, SMOKE_THREADS, smoke_dir, smoke_warm_starts

from grpokit.cli.main import main as grpokit_main
from grpokit.runtime.device import cpu_model


def check(result: dict, seconds: float) -> dict[str, bool]:
    before, after = result["before"], result["after"]
    if result.get("task") == "tools":
        gain = lambda key: after["all"][key] - before["all"][key]  # noqa: E731
        return {"greedy acc +30": gain("greedy_correct") >= 0.3,
                "greedy tool rate +30": gain("greedy_tool_rate") >= 0.3,
                "sampled tool rate +30": gain("sampled_tool_rate") >= 0.3, "<= 15 min": seconds <= 900}
    return {
        "greedy +25": after["all"]["greedy_correct"] - before["all"]["greedy_correct"] >= 0.25,
        "sampled +25": after["all"]["sampled_correct"] - before["all"]["sampled_correct"] >= 0.25,
        "format >= 95%": min(after["all"]["greedy_format"], after["all"]["sampled_format"]) >= 0.95,
        "carry greedy <50% -> >90%": before["carry"]["greedy_correct"] < 0.5 and after["carry"]["greedy_correct"] > 0.9,
        "<= 10 min": seconds <= 600,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=("arithmetic", "tools"), default="arithmetic")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--generation_engine", choices=("native", "vllm"), default="native",
                        help="the engine the GRPO steps sample with (vllm: run with .venv-vllm's python)")
    parser.add_argument("--out", default="benchmarks/results/demo_seeds.json")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        args.seeds, args.out = [0], str(smoke_dir() / "demo_seeds.json")
        smoke_warm_starts(args.seeds, args.task)
        torch.set_num_threads(SMOKE_THREADS)

    records = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            out_dir = Path(tmp) / "run"
            command = ["demo", "--task", args.task, "--seed", str(seed), "--output_dir", str(out_dir),
                       "--generation_engine", args.generation_engine, "--progress_bar", "false"]
            start = time.perf_counter()
            if args.smoke:
                if grpokit_main([*command, "--max_steps", "1", "--eval_prompts", "4"]) != 0:
                    raise SystemExit("grpokit demo failed")
            else:
                env = {**os.environ, "GRPOKIT_CACHE": str(Path(tmp) / "cache")}
                subprocess.run([sys.executable, "-m", "grpokit", *command], env=env, check=True)
            seconds = time.perf_counter() - start
            result = json.loads((out_dir / "demo.json").read_text())
            steps = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
        kl = [m["sampler_kl"] for m in steps if m.get("sampler_kl") is not None]  # a sampler other than the policy
        extra = {"sampler_kl": {"mean": sum(kl) / len(kl), "max": max(kl)}} if kl else {}
        records.append({"seed": seed, "wall_seconds": seconds, "checks": check(result, seconds), **extra, **result})

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    machine = {"python": platform.python_version(), "cpu": cpu_model(), "cpus": os.cpu_count()}
    Path(args.out).write_text(json.dumps({"machine": machine, "generation_engine": args.generation_engine,
                                          "runs": records}, indent=2))

    pct = lambda x: f"{100 * x:.1f}"  # noqa: E731
    if args.task == "tools":
        print("| seed | greedy acc before → after | sampled acc before → after | tool-call rate greedy before → after "
              "| tool-call rate sampled before → after | calls / completion (sampled) after | tool errors / completion "
              "(sampled) after | format after (greedy / sampled) | warm start s | GRPO s | total s | all checks |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in records:
            b, a = r["before"]["all"], r["after"]["all"]
            failed = [name for name, ok in r["checks"].items() if not ok]
            print(f"| {r['seed']} | {pct(b['greedy_correct'])} → {pct(a['greedy_correct'])} "
                  f"| {pct(b['sampled_correct'])} → {pct(a['sampled_correct'])} "
                  f"| {pct(b['greedy_tool_rate'])} → {pct(a['greedy_tool_rate'])} "
                  f"| {pct(b['sampled_tool_rate'])} → {pct(a['sampled_tool_rate'])} "
                  f"| {a['sampled_tool_calls']:.2f} | {a['sampled_tool_errors']:.3f} "
                  f"| {pct(a['greedy_format'])} / {pct(a['sampled_format'])} "
                  f"| {r['seconds']['warm_start']:.0f} | {r['seconds']['grpo']:.0f} | {r['wall_seconds']:.0f} "
                  f"| {'FAIL: ' + ', '.join(failed) if failed else 'pass'} |")
        return
    print("| seed | greedy acc before → after | sampled acc (T=1) before → after | format after (greedy / sampled) "
          "| carry class greedy before → after | warm start s | GRPO s | total s | all checks |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in records:
        b, a = r["before"], r["after"]
        failed = [name for name, ok in r["checks"].items() if not ok]
        print(f"| {r['seed']} | {pct(b['all']['greedy_correct'])} → {pct(a['all']['greedy_correct'])} "
              f"| {pct(b['all']['sampled_correct'])} → {pct(a['all']['sampled_correct'])} "
              f"| {pct(a['all']['greedy_format'])} / {pct(a['all']['sampled_format'])} "
              f"| {pct(b['carry']['greedy_correct'])} → {pct(a['carry']['greedy_correct'])} "
              f"| {r['seconds']['warm_start']:.0f} | {r['seconds']['grpo']:.0f} | {r['wall_seconds']:.0f} "
              f"| {'FAIL: ' + ', '.join(failed) if failed else 'pass'} |")


if __name__ == "__main__":
    main()
