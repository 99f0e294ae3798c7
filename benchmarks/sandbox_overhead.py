"""What the sandbox costs: milliseconds per program and programs per second for a batch.

    python benchmarks/sandbox_overhead.py            # about a minute on 2 cores

- Per program: ``print('x')`` run ``--repeats`` times in each way, the ways interleaved so that a drift of the
  machine's speed hits them alike: a bare ``subprocess.run([python, "-I", "-S", "-c", code])`` (the baseline: an
  interpreter start), ``Sandbox("bwrap")`` and ``Sandbox("process")``. Median and 10th–90th percentiles of the
  wall time of the call, and the median overhead over the baseline.
- A batch: ``--batch`` small programs (each prints a sum of its own) through ``run_many`` with the default workers
  (the CPU count), ``--rounds`` times per isolation, against the same programs run one after another; programs/s.

All ways use one interpreter: this one, or where the process isolation (as root) cannot use it, the one it can
(``--python``, default /usr/bin/python3). Writes ``benchmarks/results/sandbox_overhead.json`` and prints the
Markdown table for ``docs/sandbox.md`` ("Cost per program"). A shared machine makes these noisy: run it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import SMOKE_HELP, smoke_dir

from grpokit.runtime.device import cpu_model
from grpokit.sandbox import Sandbox
from grpokit.sandbox.bwrap import bwrap_version
from grpokit.sandbox.interpreter import closed_to_others

PROGRAM = "print('x')"


def percentiles(ms: list[float]) -> dict:
    ordered = sorted(ms)
    return {"median": statistics.median(ordered), "p10": ordered[len(ordered) // 10],
            "p90": ordered[(9 * len(ordered)) // 10], "n": len(ordered)}


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--python", default="/usr/bin/python3",
                        help="the interpreter, where the process isolation as root cannot read this one")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "sandbox_overhead.json"))
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        args.repeats, args.batch, args.rounds, args.out = 2, 2, 1, str(smoke_dir() / "sandbox_overhead.json")

    load_before = os.getloadavg()
    python = os.path.realpath(sys.executable)
    if os.geteuid() == 0 and closed_to_others(python):
        python = os.path.realpath(args.python)
    sandboxes = {"bwrap": Sandbox("bwrap", python=python), "process": Sandbox("process", python=python)}
    ways = {"bare": lambda: subprocess.run([python, "-I", "-S", "-c", PROGRAM], capture_output=True, check=True),
            **{name: (lambda sandbox=sandbox: sandbox.run(PROGRAM)) for name, sandbox in sandboxes.items()}}
    for way in ways.values():  # warm: the page cache, the probe already ran
        way()
    ms = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, way in ways.items():
            ms[name].append(timed(way))
    per_program = {name: percentiles(values) for name, values in ms.items()}
    for name in sandboxes:
        per_program[name]["overhead_ms"] = per_program[name]["median"] - per_program["bare"]["median"]

    programs = [(f"print(sum(range({n} * 1000)))", "") for n in range(args.batch)]
    batch = {}
    for name, sandbox in sandboxes.items():
        concurrent, sequential = [], []
        for _ in range(args.rounds):
            start = time.perf_counter()
            results = sandbox.run_many(programs)
            concurrent.append(args.batch / (time.perf_counter() - start))
            assert all(r.ok and r.stdout == f"{sum(range(n * 1000))}\n" for n, r in enumerate(results)), name
            start = time.perf_counter()
            for program in programs:
                sandbox.run(*program)
            sequential.append(args.batch / (time.perf_counter() - start))
        batch[name] = {"workers": sandbox.workers, "programs_per_s": statistics.median(concurrent),
                       "sequential_programs_per_s": statistics.median(sequential), "rounds": args.rounds}

    record = {"cpu": cpu_model(), "cpus": os.cpu_count(), "load_average_before": load_before,
              "python": python, "python_version": subprocess.run([python, "-V"], capture_output=True,
                                                                  text=True).stdout.strip(),
              "trainer_python": platform.python_version(), "as_root": os.geteuid() == 0,
              "bwrap": sandboxes["bwrap"].bwrap, "bwrap_version": bwrap_version(sandboxes["bwrap"].bwrap),
              "describe": {name: sandbox.describe() for name, sandbox in sandboxes.items()},
              "program": PROGRAM, "per_program_ms": per_program, "batch": batch, "batch_size": args.batch}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"| way | ms per program: median [p10, p90] | overhead ms | batch of {args.batch}: programs/s "
          "(workers) | one after another: programs/s |\n|---|---|---|---|---|")
    for name, row in per_program.items():
        overhead = f"{row['overhead_ms']:.1f}" if "overhead_ms" in row else "—"
        runs = (f"{batch[name]['programs_per_s']:.0f} ({batch[name]['workers']}) | "
                f"{batch[name]['sequential_programs_per_s']:.0f}" if name in batch else "— | —")
        print(f"| {name} | {row['median']:.1f} [{row['p10']:.1f}, {row['p90']:.1f}] | {overhead} | {runs} |")


if __name__ == "__main__":
    main()
