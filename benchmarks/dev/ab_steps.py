"""Whole grpokit training steps at one git revision against the working tree, in alternating processes.

    python benchmarks/dev/ab_steps.py --base HEAD~1 --config small --mode bf16 --rounds 4
    python benchmarks/dev/ab_steps.py --base HEAD --base-set keep_freed_memory=false --config small --mode fp32

``ab_passes.py`` times single passes on one fixed rollout in one process; what depends on the rollout
changing from step to step (oneDNN building kernels for new shapes) or on the process (its allocator)
needs whole steps on new rollouts in fresh processes. This runs ``benchmarks/vs_trl.py``'s grpokit
worker (its model, data and settings: 2 untimed warm-up steps, then ``--steps`` timed ones) ``--rounds``
times for each side, in ABBA order so that drift in the machine's speed falls on both: ``--base``'s
``src/grpokit`` (exported into a temporary directory, first on ``PYTHONPATH``) and the working tree.
``--base-set KEY=VALUE`` and ``--tree-set KEY=VALUE`` override one side's config (to compare a setting at
one revision, or one change of several).
Prints each process's medians and both sides' pooled medians of the step and its phases, and their
ratio (working tree ÷ base: below 1 is faster). Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, vs_trl.py
from common import export_source, run_worker  # noqa: E402
from vs_trl import CONFIGS, build  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PHASES = ("step", "generate", "score_and_reference", "update")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="git revision to compare the working tree with")
    for side in ("base", "tree"):
        parser.add_argument(f"--{side}-set", nargs="*", default=[], metavar="KEY=VALUE",
                            help=f"config overrides for the {side} side only (YAML values)")
    parser.add_argument("--config", default="small", choices=list(CONFIGS))
    parser.add_argument("--mode", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=4, help="processes per side")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per process")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    overrides = {side: {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in getattr(args, f"{side}_set"))}
                 for side in ("base", "tree")}
    script = str(REPO / "benchmarks" / "vs_trl.py")
    with tempfile.TemporaryDirectory() as tmp:
        base_source = export_source(args.base, Path(tmp))
        build(args.config, Path(tmp) / "model")
        runs: dict[str, list[dict]] = {"base": [], "tree": []}
        for r in range(args.rounds):
            for side in ("base", "tree") if r % 2 == 0 else ("tree", "base"):
                env = dict(os.environ)
                if side == "base":
                    env["PYTHONPATH"] = os.pathsep.join([str(base_source), env.get("PYTHONPATH", "")])
                job = {"kind": "grpokit", "config": args.config, "mode": args.mode, "model": str(Path(tmp) / "model"),
                       "out": str(Path(tmp) / f"{side}-{r}"), "warmup": 2, "steps": args.steps,
                       "threads": args.threads, "overrides": overrides[side]}
                run = run_worker(script, job, env)
                runs[side].append(run)
                print(f"{side}: " + ", ".join(f"{k} {statistics.median(run[k]):.4f}" for k in PHASES), flush=True)
    print(f"{args.config} {args.mode}, base {args.base} {overrides['base'] or ''} vs working tree "
          f"{overrides['tree'] or ''}: pooled medians, s ({args.rounds} processes × {args.steps} steps each side)")
    for key in PHASES:
        base, tree = (statistics.median([v for run in runs[side] for v in run[key]]) for side in ("base", "tree"))
        print(f"  {key:20s} base {base:.4f}  working tree {tree:.4f}  {tree / base:.3f}×")


if __name__ == "__main__":
    main()
