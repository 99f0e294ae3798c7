"""The answers-only recipe's table from its run directories (examples/answers_only/README.md):

    python examples/answers_only/summarize.py runs/answers_only --out benchmarks/results/answers_only_recipe.json

Per seed: held-out greedy accuracy (200 problems), strict (the tagged answer) and lenient (else the last number), of
the base model, the cold start bootstrapped from it and fine-tuned, and GRPO after it; each bootstrap round's coverage;
minutes; and GRPO from the base model read at the same minutes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from grpokit.runtime.device import cpu_model


def accuracy(path: Path, runs: Path) -> dict[str, float] | None:
    """A stage's greedy held-out accuracy (``eval_NAME.json``), and strict on the carry class (from the completions
    beside it and the held-out rows' ``carry`` column)."""
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    completions = path.with_name(path.name.replace("eval_", "completions_").replace(".json", ".jsonl"))
    held_out = [json.loads(line) for line in (runs / "data" / "held_out.jsonl").open()]
    judged = [json.loads(line)["correct"] for line in completions.open()]
    carry = [c for c, row in zip(judged, held_out) if row["carry"]]
    return {"strict": summary["greedy_correct"], "lenient": summary["greedy_lenient"],
            "format": summary["greedy_format"], "carry_strict": sum(carry) / len(carry)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="?", default="runs/answers_only")
    parser.add_argument("--out", default="benchmarks/results/answers_only_recipe.json")
    args = parser.parse_args()
    runs = Path(args.runs)
    base = accuracy(runs / "base" / "eval_base.json", runs)
    records = []
    for seed_dir in sorted((runs / "bootstrap").glob("seed*")):
        if not (seed_dir / "times.json").is_file():  # still running, or stopped part-way
            continue
        seed = seed_dir.name.removeprefix("seed")
        cold = json.loads((seed_dir / "cold" / "rows.summary.json").read_text())
        times = json.loads((seed_dir / "times.json").read_text())
        baseline = runs / "grpo_from_base" / seed_dir.name
        records.append({
            "seed": int(seed), "base": base, "sft": accuracy(seed_dir / "eval_sft.json", runs),
            "grpo": accuracy(seed_dir / "eval_grpo.json", runs),
            "bootstrap": [{k: r[k] for k in ("iteration", "coverage", "kept", "correct_rate", "seconds")}
                          for r in cold["iterations"]],
            "cold_start_rows": cold["kept"], "minutes": times["grpo_eval"] / 60, "minutes_to_grpo": times["grpo"] / 60,
            "grpo_from_base": accuracy(baseline / "eval_grpo.json", runs),
            "grpo_from_base_budget": json.loads((baseline / "budget.json").read_text())
            if (baseline / "budget.json").is_file() else None,
        })
    Path(args.out).write_text(json.dumps({"machine": {"cpu": cpu_model()}, "runs": records}, indent=2))
    pct = lambda a, k: "—" if a is None else f"{100 * a[k]:.1f}"  # noqa: E731
    print("| seed | base strict / lenient | bootstrap coverage (round 1, 2) | cold start rows | SFT strict / lenient "
          "| GRPO strict / lenient (carry class) | minutes | GRPO from base, same minutes: strict / lenient |")
    print("|---|---|---|---|---|---|---|---|")
    for r in records:
        coverage = ", ".join(f"{100 * b['coverage']:.0f} %" for b in r["bootstrap"])
        print(f"| {r['seed']} | {pct(base, 'strict')} / {pct(base, 'lenient')} | {coverage} | {r['cold_start_rows']} "
              f"| {pct(r['sft'], 'strict')} / {pct(r['sft'], 'lenient')} "
              f"| **{pct(r['grpo'], 'strict')}** / {pct(r['grpo'], 'lenient')} ({pct(r['grpo'], 'carry_strict')}) "
              f"| {r['minutes']:.0f} "
              f"| {pct(r['grpo_from_base'], 'strict')} / {pct(r['grpo_from_base'], 'lenient')} |")


if __name__ == "__main__":
    main()
