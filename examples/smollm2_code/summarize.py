"""The code recipe's results over the seeds run so far, as Markdown (and JSON with ``--out``).

    python examples/smollm2_code/summarize.py runs/smollm2_code [--out benchmarks/results/smollm2_code_recipe.json]

For each ``seedN`` directory written by run.sh: greedy pass@1 (every test passes) on the held-out problems before
the cold start, after it (the model GRPO starts from) and after GRPO, split into the families the cold start showed
(make_data.SHAPE_FAMILIES) and the others; the rate of completions holding a program; the minutes each stage took;
the training pass rate over time; per family, the held-out problems solved; and example completions of problems
from the families the cold start did not show (one per family), before and after GRPO.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections import defaultdict
from pathlib import Path

from make_data import SHAPE_FAMILIES  # beside this script, which Python imports from when it runs it

from grpokit.runtime.device import cpu_model

STAGES = ("base", "sft", "grpo")
WINDOW = 10  # training steps per point of the pass-rate curve
EXAMPLES = 4
LABELS = {"base": "SmolLM2-135M-Instruct", "sft": "after the cold start (before RL)", "grpo": "after GRPO"}


def completions(run: Path, stage: str) -> list[dict]:
    return [json.loads(line) for line in (run / f"completions_{stage}.jsonl").read_text().splitlines()]


def load(run: Path, families: list[str]) -> dict:
    times = json.loads((run / "times.json").read_text())
    evals = {stage: json.loads((run / f"eval_{stage}.json").read_text()) for stage in STAGES}
    by_group, by_family = {}, {}
    for stage in STAGES:
        correct = [r["correct"] for r in completions(run, stage)]
        groups = {"shown": [c for c, f in zip(correct, families) if f in SHAPE_FAMILIES],
                  "not_shown": [c for c, f in zip(correct, families) if f not in SHAPE_FAMILIES]}
        by_group[stage] = {name: sum(values) / len(values) for name, values in groups.items()}
        solved = defaultdict(list)
        for c, f in zip(correct, families):
            solved[f].append(c)
        by_family[stage] = {f: [int(sum(v)), len(v)] for f, v in solved.items()}
    metrics = [json.loads(line) for line in (run / "grpo" / "metrics.jsonl").read_text().splitlines()]
    rates = [m["code_tests_pass_rate"] for m in metrics]
    curve = [sum(rates[i:i + WINDOW]) / len(rates[i:i + WINDOW]) for i in range(0, len(rates), WINDOW)]
    sft, grpo = completions(run, "sft"), completions(run, "grpo")
    examples, seen = [], set()  # the first problem per family that the cold-started model failed
    for a, b, f in zip(sft, grpo, families):
        if f not in SHAPE_FAMILIES and not a["correct"] and f not in seen:
            seen.add(f)
            examples.append({"family": f, "prompt": a["prompt"], "sft": a, "grpo": b})
    fixed = [e for e in examples if e["grpo"]["correct"]][:EXAMPLES - 1]
    still = [e for e in examples if not e["grpo"]["correct"]][:1]
    return {"seed": int(run.name.removeprefix("seed")), "minutes_total": times["grpo_eval"] / 60, "seconds": times,
            "greedy_pass": {s: evals[s]["greedy_correct"] for s in STAGES},
            "program_rate": {s: evals[s]["greedy_format"] for s in STAGES}, "greedy_pass_by_group": by_group,
            "solved_by_family": by_family, "training_pass_rate_by_window": curve, "examples": fixed + still}


def markdown(runs: list[dict]) -> str:
    lines = ["| seed | model | held-out pass@1 (greedy) | families in the cold start | other families "
             "| a program | minutes (cumulative) |", "|---|---|---|---|---|---|---|"]
    for run in runs:
        t, group = run["seconds"], run["greedy_pass_by_group"]
        minutes = {"base": t["base_eval"], "sft": t["sft_eval"], "grpo": t["grpo_eval"]}
        for stage in STAGES:
            lines.append(f"| {run['seed']} | {LABELS[stage]} | {run['greedy_pass'][stage]:.1%} "
                         f"| {group[stage]['shown']:.1%} | {group[stage]['not_shown']:.1%} "
                         f"| {run['program_rate'][stage]:.1%} | {minutes[stage] / 60:.1f} |")
        gain = {key: 100 * (after - before) for key, before, after in (
            ("all", run["greedy_pass"]["sft"], run["greedy_pass"]["grpo"]),
            ("shown", group["sft"]["shown"], group["grpo"]["shown"]),
            ("not_shown", group["sft"]["not_shown"], group["grpo"]["not_shown"]))}
        lines.append(f"| {run['seed']} | **GRPO's gain** | **{gain['all']:+.1f} points** | {gain['shown']:+.1f} "
                     f"| {gain['not_shown']:+.1f} | | |")
    windows = len(runs[0]["training_pass_rate_by_window"])
    lines += ["", f"Training pass rate (tests passed, sampled at T = 1), mean over each {WINDOW} steps:", "",
              "| seed | " + " | ".join(f"steps {i * WINDOW + 1}–{(i + 1) * WINDOW}" for i in range(windows)) + " |",
              "|---|" + "---|" * windows]
    for run in runs:
        lines.append(f"| {run['seed']} | " + " | ".join(f"{a:.0%}" for a in run["training_pass_rate_by_window"]) + " |")
    lines += ["", "Held-out problems solved per family, greedy (base → cold start → GRPO, " +
              ", ".join(f"seed {run['seed']}" for run in runs) + "):", "", "| family | problems | " +
              " | ".join(f"seed {run['seed']}" for run in runs) + " |", "|---|---|" + "---|" * len(runs)]
    for family, (_, total) in runs[0]["solved_by_family"]["base"].items():
        cells = [" → ".join(str(run["solved_by_family"][s][family][0]) for s in STAGES) for run in runs]
        shown = " (cold start)" if family in SHAPE_FAMILIES else ""
        lines.append(f"| `{family.replace('{k}', 'K')}`{shown} | {total} | " + " | ".join(cells) + " |")
    first = runs[0]
    lines += ["", f"Seed {first['seed']}, held-out problems of families the cold start did not show, greedy:", ""]
    for example in first["examples"]:
        lines.append(f"- {example['prompt'].splitlines()[0]}")
        for label in ("sft", "grpo"):
            row = example[label]
            mark = "✓" if row["correct"] else "✗"
            lines.append(f"  - {LABELS[label]} {mark}: `{row['completion']!r}`")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="?", default="runs/smollm2_code")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()
    families = [json.loads(line)["family"] for line in (Path(args.runs) / "data" / "held_out.jsonl").read_text()
                .splitlines()]
    runs = [load(run, families) for run in sorted(Path(args.runs).glob("seed*")) if (run / "times.json").exists()]
    if not runs:
        sys.exit(f"no finished run under {args.runs} (bash examples/smollm2_code/run.sh SEED writes one)")
    print(markdown(runs))
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": {"cpu": cpu_model(), "platform": platform.platform()},
                                              "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
