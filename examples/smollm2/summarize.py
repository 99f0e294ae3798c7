"""The recipe's results over the seeds run so far, as Markdown (and JSON with ``--out``).

    python examples/smollm2/summarize.py runs/smollm2 [--out benchmarks/results/smollm2_recipe.json]

For each ``seedN`` directory written by run.sh: greedy accuracy and format rate on the 200 held-out problems
before the cold start, after it (the model GRPO starts from) and after GRPO, the minutes each stage took, and
the training accuracy curve, and the first three held-out problems' completions before and after GRPO.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from common import cpu_model  # noqa: E402

STAGES = ("base", "sft", "grpo")
WINDOW = 10  # training steps per point of the accuracy curve
LABELS = {"base": "SmolLM2-135M-Instruct", "sft": "after the cold start (before RL)", "grpo": "after GRPO"}


def load(run: Path, carries: list[bool]) -> dict:
    times = json.loads((run / "times.json").read_text())
    evals = {stage: json.loads((run / f"eval_{stage}.json").read_text()) for stage in STAGES}
    by_carry = {}  # greedy accuracy on the held-out problems with and without a carry
    for stage in STAGES:
        rows = [json.loads(line) for line in (run / f"completions_{stage}.jsonl").read_text().splitlines()]
        by_carry[stage] = {name: sum(r["correct"] for r, c in zip(rows, carries) if c == carry) / carries.count(carry)
                           for name, carry in (("carry", True), ("no_carry", False))}
    metrics = [json.loads(line) for line in (run / "grpo" / "metrics.jsonl").read_text().splitlines()]
    curve = [sum(m["accuracy"] for m in metrics[i:i + WINDOW]) / len(metrics[i:i + WINDOW])
             for i in range(0, len(metrics), WINDOW)]
    examples = {stage: [json.loads(line) for line in (run / f"completions_{stage}.jsonl").read_text().splitlines()]
                [:3] for stage in ("sft", "grpo")}
    return {"seed": int(run.name.removeprefix("seed")), "minutes_total": times["grpo_eval"] / 60,
            "seconds": times, "greedy_correct": {s: evals[s]["greedy_correct"] for s in STAGES},
            "greedy_format": {s: evals[s]["greedy_format"] for s in STAGES}, "greedy_correct_by_carry": by_carry,
            "training_accuracy_by_window": curve, "examples": examples}


def markdown(runs: list[dict]) -> str:
    lines = ["| seed | model | held-out accuracy (greedy) | without a carry | with a carry | format rate "
             "| minutes (cumulative) |", "|---|---|---|---|---|---|---|"]
    for run in runs:
        t, carry = run["seconds"], run["greedy_correct_by_carry"]
        minutes = {"base": t["base_eval"], "sft": t["sft_eval"], "grpo": t["grpo_eval"]}
        for stage in STAGES:
            lines.append(f"| {run['seed']} | {LABELS[stage]} | {run['greedy_correct'][stage]:.1%} "
                         f"| {carry[stage]['no_carry']:.1%} | {carry[stage]['carry']:.1%} "
                         f"| {run['greedy_format'][stage]:.1%} | {minutes[stage] / 60:.1f} |")
        gain = {key: 100 * (after - before) for key, before, after in (
            ("all", run["greedy_correct"]["sft"], run["greedy_correct"]["grpo"]),
            ("no_carry", carry["sft"]["no_carry"], carry["grpo"]["no_carry"]),
            ("carry", carry["sft"]["carry"], carry["grpo"]["carry"]))}
        lines.append(f"| {run['seed']} | **GRPO's gain** | **{gain['all']:+.1f} points** | {gain['no_carry']:+.1f} "
                     f"| {gain['carry']:+.1f} | | |")
    lines += ["", f"Training accuracy (sampled, T = 1), mean over each {WINDOW} steps:", "",
              "| seed | " + " | ".join(f"steps {i * WINDOW + 1}–{(i + 1) * WINDOW}"
                                       for i in range(len(runs[0]["training_accuracy_by_window"]))) + " |",
              "|---|" + "---|" * len(runs[0]["training_accuracy_by_window"])]
    for run in runs:
        lines.append(f"| {run['seed']} | " + " | ".join(f"{a:.0%}" for a in run["training_accuracy_by_window"]) + " |")
    first = runs[0]
    lines += ["", f"Seed {first['seed']}, the first three held-out problems, greedy:", ""]
    for before, after in zip(first["examples"]["sft"], first["examples"]["grpo"]):
        lines.append(f"- `{before['prompt']}` (answer {before['answer']})")
        for label, row in (("before RL", before), ("after GRPO", after)):
            mark = "✓" if row["correct"] else "✗"
            lines.append(f"  - {label} {mark}: `{row['completion']!r}`")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="?", default="runs/smollm2")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()
    carries = [json.loads(line)["carry"] for line in (Path(args.runs) / "data" / "held_out.jsonl").read_text()
               .splitlines()]
    runs = [load(run, carries) for run in sorted(Path(args.runs).glob("seed*")) if (run / "times.json").exists()]
    if not runs:
        sys.exit(f"no finished run under {args.runs} (bash examples/smollm2/run.sh SEED writes one)")
    print(markdown(runs))
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": {"cpu": cpu_model(), "platform": platform.platform()},
                                              "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
