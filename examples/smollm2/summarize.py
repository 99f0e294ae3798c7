"""The recipe's results over the variants and seeds run so far, as Markdown (and JSON with ``--out``).

    python examples/smollm2/summarize.py runs/smollm2 [--out benchmarks/results/smollm2_recipe.json]
                                                      [--figure docs/images/smollm2_supervision.png]
                                                      [--keep benchmarks/results/smollm2_supervision.json]

For each ``VARIANT/seedN`` directory written by ``run.sh SEED VARIANT``: greedy accuracy and format rate on the
200 held-out problems before the cold start, after it (the model GRPO starts from) and after GRPO, split by carry;
the minutes each stage took; the sampled training accuracy on carry and carry-free problems over the steps (from
every completion GRPO logged); and the first three held-out problems' completions before and after GRPO.
``--figure``: the carry problems' sampled training accuracy against the step, one line per run (needs matplotlib).
``--keep``: also the runs an earlier ``--out`` recorded (on another machine, say) that are not under the directory;
each run names the CPU it ran on.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import yaml

from grpokit.core.answers import answers_match, extract_answer
from grpokit.runtime.device import cpu_model
from grpokit.tasks.arithmetic import carry_mistakes, has_carry, prompt_operands

STAGES = ("base", "sft", "grpo")
WINDOW = 10  # training steps per point of the accuracy curves
MISTAKE_STEPS = 30  # carry_mistakes: the first and the last this many GRPO steps
LABELS = {"base": "SmolLM2-135M-Instruct", "sft": "after the cold start", "grpo": "after GRPO"}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def by_carry(rows: list[tuple[bool, bool]]) -> dict[str, float | None]:
    """(carry, correct) pairs → accuracy with and without a carry."""
    out = {}
    for name, carry in (("carry", True), ("no_carry", False)):
        picked = [correct for c, correct in rows if c == carry]
        out[name] = sum(picked) / len(picked) if picked else None
    return out


def training_curves(records: list[dict]) -> dict[str, list[float | None]]:
    """Sampled (T = 1) accuracy of every logged completion, per window of WINDOW steps, by carry."""
    windows: dict[int, list[tuple[bool, bool]]] = {}
    for record in records:
        a, b = prompt_operands(record["prompt"])
        answer = extract_answer(record["completion"])
        correct = answer is not None and answers_match(answer, a + b)
        windows.setdefault((record["step"] - 1) // WINDOW, []).append((has_carry(a, b), correct))
    curves = [by_carry(windows[w]) for w in sorted(windows)]
    return {name: [c[name] for c in curves] for name in ("carry", "no_carry")}


def sampling(metrics: list[dict], completions_per_step: int) -> dict[str, float | None]:
    """Seconds GRPO spent sampling and milliseconds per sampled token (a run that samples shorter completions
    takes less time for that alone), and with a ``rollout_precision`` other than fp32 the sampler's mean KL to the
    policy and the mean importance weight and capped share (docs/math.md); None for a float32 sampler."""
    def mean(key: str) -> float | None:
        values = [m[key] for m in metrics if m.get(key) is not None]
        return sum(values) / len(values) if values else None
    seconds = sum(m["time_generate"] for m in metrics)
    tokens = completions_per_step * sum(m["completion_length_mean"] for m in metrics)
    return {"seconds": seconds, "ms_per_token": 1000 * seconds / tokens, "sampler_kl": mean("sampler_kl"),
            "is_weight": mean("is_weight_mean"), "is_capped": mean("is_capped_frac")}


def load(run: Path) -> dict:
    times = json.loads((run / "times.json").read_text())
    evals = {stage: json.loads((run / f"eval_{stage}.json").read_text()) for stage in STAGES}
    completions = {stage: read_jsonl(run / f"completions_{stage}.jsonl") for stage in STAGES}
    greedy_by_carry = {stage: by_carry([(has_carry(*prompt_operands(r["prompt"])), r["correct"]) for r in rows])
                       for stage, rows in completions.items()}
    sampled = read_jsonl(run / "grpo" / "completions.jsonl")
    config = yaml.safe_load((run / "grpo" / "config.yaml").read_text())
    steps = max(record["step"] for record in sampled)
    return {"variant": run.parent.name, "seed": int(run.name.removeprefix("seed")), "machine": cpu_model(),
            "minutes_total": times["grpo_eval"] / 60, "seconds": times,
            "grpo_seconds_per_step": (times["grpo"] - times["sft_eval"]) / steps,
            "sampling": sampling(read_jsonl(run / "grpo" / "metrics.jsonl"),
                                 config["prompts_per_step"] * config["num_generations"]),
            "greedy_correct": {s: evals[s]["greedy_correct"] for s in STAGES},
            "greedy_format": {s: evals[s]["greedy_format"] for s in STAGES},
            "greedy_correct_by_carry": greedy_by_carry, "training_accuracy_by_window": training_curves(sampled),
            "carry_mistakes": carry_mistakes(sampled, MISTAKE_STEPS),
            "examples": {stage: completions[stage][:3] for stage in ("sft", "grpo")}}


def cpu_name(cpu: dict) -> str:
    """'AMD EPYC 25/1': the model name with its family and model numbers (one name covers several generations)."""
    return f"{cpu['model']} {cpu['family']}/{cpu['model_number']}"


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def markdown(runs: list[dict]) -> str:
    lines = ["| variant | seed | model | held-out accuracy (greedy) | without a carry | with a carry | format rate "
             "| minutes (cumulative) |", "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        t, carry = run["seconds"], run["greedy_correct_by_carry"]
        minutes = {"base": None, "sft": t["sft_eval"], "grpo": t["grpo_eval"]}
        for stage in STAGES:
            lines.append(f"| {run['variant']} | {run['seed']} | {LABELS[stage]} | {pct(run['greedy_correct'][stage])} "
                         f"| {pct(carry[stage]['no_carry'])} | {pct(carry[stage]['carry'])} "
                         f"| {pct(run['greedy_format'][stage])} "
                         f"| {'' if minutes[stage] is None else f'{minutes[stage] / 60:.1f}'} |")
        gain = {key: 100 * (after - before) for key, before, after in (
            ("all", run["greedy_correct"]["sft"], run["greedy_correct"]["grpo"]),
            ("no_carry", carry["sft"]["no_carry"], carry["grpo"]["no_carry"]),
            ("carry", carry["sft"]["carry"], carry["grpo"]["carry"]))}
        lines.append(f"| {run['variant']} | {run['seed']} | **GRPO's gain** | **{gain['all']:+.1f} points** "
                     f"| {gain['no_carry']:+.1f} | {gain['carry']:+.1f} | "
                     f"| {run['grpo_seconds_per_step']:.1f} s/step ({cpu_name(run['machine'])}) |")
    lines += ["", "GRPO's sampling: seconds in all, per sampled token; the sampler against the policy "
              "(`rollout_precision`):", "",
              "| variant | seed | s sampling | ms per token | sampler_kl (mean) | IS weight (mean) | capped |",
              "|---|---|---|---|---|---|---|"]
    for run in runs:
        if "sampling" in run:  # older results files (--keep) do not record it
            sampled = run["sampling"]
            lines.append(f"| {run['variant']} | {run['seed']} | {sampled['seconds']:.0f} "
                         f"| {sampled['ms_per_token']:.2f} | " + " | ".join(
                "—" if sampled[k] is None else f"{sampled[k]:{f}}"
                for k, f in (("sampler_kl", ".1e"), ("is_weight", ".4f"), ("is_capped", ".2%"))) + " |")
    windows = max(len(r["training_accuracy_by_window"]["carry"]) for r in runs)
    lines += ["", f"Sampled training accuracy (T = 1) on carry problems (carry-free in brackets), each {WINDOW} steps:",
              "", "| variant | seed | " + " | ".join(f"steps {i * WINDOW + 1}–{(i + 1) * WINDOW}"
                                                  for i in range(windows)) + " |", "|---|---|" + "---|" * windows]
    for run in runs:
        curve = run["training_accuracy_by_window"]
        lines.append(f"| {run['variant']} | {run['seed']} | " + " | ".join(
            f"{pct(c)} ({pct(n)})" for c, n in zip(curve["carry"], curve["no_carry"])) + " |")
    lines += ["", f"The tens column of the sampled carry completions, first → last {MISTAKE_STEPS} steps:", "",
              "| variant | seed | forgets the carry | writes it, adds it wrong | right | other |",
              "|---|---|---|---|---|---|"]
    for run in runs:
        first, last = run["carry_mistakes"]["first"], run["carry_mistakes"]["last"]
        lines.append(f"| {run['variant']} | {run['seed']} | " + " | ".join(
            f"{pct(first.get(k))} → {pct(last.get(k))}" for k in ("forgot", "added_wrong", "right", "other")) + " |")
    first = runs[0]
    lines += ["", f"{first['variant']}, seed {first['seed']}, the first three held-out problems, greedy:", ""]
    for before, after in zip(first["examples"]["sft"], first["examples"]["grpo"]):
        lines.append(f"- `{before['prompt']}` (answer {before['answer']})")
        for label, row in (("before RL", before), ("after GRPO", after)):
            mark = "✓" if row["correct"] else "✗"
            lines.append(f"  - {label} {mark}: `{row['completion']!r}`")
    return "\n".join(lines)


def figure(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    variants = sorted({r["variant"] for r in runs})
    colours = {v: f"C{i}" for i, v in enumerate(variants)}
    for ax, name, title in ((axes[0], "carry", "carry problems"), (axes[1], "no_carry", "carry-free problems")):
        for run in runs:
            curve = run["training_accuracy_by_window"][name]
            steps = [WINDOW * (i + 1) for i in range(len(curve))]
            ax.plot(steps, [100 * c if c is not None else float("nan") for c in curve], color=colours[run["variant"]],
                    linestyle="-" if run["seed"] == 0 else "--", marker="o", markersize=3,
                    label=f"{run['variant']}, seed {run['seed']} ({cpu_name(run['machine'])})")
        ax.set_title(f"sampled training accuracy (T = 1), {title}")
        ax.set_xlabel(f"GRPO step (mean of each {WINDOW})")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("% correct")
    axes[1].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct, outcome vs process supervision (2 CPU cores)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="?", default="runs/smollm2")
    parser.add_argument("--out", help="also write the results as JSON here")
    parser.add_argument("--figure", help="also draw the carry problems' training curves to this PNG")
    parser.add_argument("--keep", help="also the runs this earlier --out holds that are not under RUNS")
    args = parser.parse_args()
    root = Path(args.runs)
    finished = sorted(p.parent for p in root.glob("*/seed*/times.json"))
    runs = [load(run) for run in finished]
    if args.keep:
        earlier = json.loads(Path(args.keep).read_text())
        here = {(r["variant"], r["seed"]) for r in runs}
        runs += [{"machine": earlier["machine"]["cpu"], **r} for r in earlier["runs"]
                 if (r["variant"], r["seed"]) not in here]
        runs.sort(key=lambda r: (r["variant"], r["seed"]))
    if not runs:
        sys.exit(f"no finished run under {root} (bash examples/smollm2/run.sh SEED VARIANT writes one)")
    print(markdown(runs))
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": {"cpu": cpu_model(), "platform": platform.platform()},
                                              "runs": runs}, indent=1))  # each run's own CPU: runs[i].machine
    if args.figure:
        figure(runs, args.figure)


if __name__ == "__main__":
    main()
