"""The reasoning-gym recipe's table from its run directories (examples/reasoning_gym/README.md):

    python examples/reasoning_gym/summarize.py runs/reasoning_gym --out benchmarks/results/reasoning_gym_recipe.json

Per seed: the held-out greedy score (200 rows) by the task's own scorer, on the tagged answer (strict) and on the last
number written (lenient: what a model that answers in prose knows), of the base model, the cold start bootstrapped
from it and fine-tuned, and GRPO after it; each bootstrap round's coverage and the share of its kept rows whose
reasoning computes the answer it tags (the rest are right by luck, or by heart); minutes; and what self-consistency
(``grpokit bootstrap --min_agreement``) would have kept of round 1's samples.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import yaml

from grpokit.algorithms.bootstrap import BootstrapSettings, select
from grpokit.algorithms.bootstrap_log import SamplesLog
from grpokit.resolve import load_rows
from grpokit.runtime.device import cpu_model
from grpokit.tasks.reasoning_gym import TaskScore

# chain_sum's reasoning reaches its answer when the sum or difference it writes last, before the answer, is the answer
_EXPRESSION = re.compile(r"(-?\d+)\s*([+-])\s*(-?\d+)")


def scores(path: Path) -> dict[str, float] | None:
    """A stage's held-out scores (``eval_NAME.json``, the completions beside it re-scored for the lenient reading)."""
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    completions = [json.loads(line) for line in path.with_name(
        path.name.replace("eval_", "completions_").replace(".json", ".jsonl")).open()]
    metadata = [{"source_dataset": "chain_sum"}] * len(completions)
    lenient = TaskScore("last_number")(prompts=[c["prompt"] for c in completions],
                                       completions=[c["completion"] for c in completions],
                                       answer=[c["answer"] for c in completions], metadata=metadata)
    return {"strict": summary["greedy_score"], "lenient": sum(lenient) / len(lenient),
            "format": summary["greedy_format"]}


def consistent(rows: list[dict]) -> float:
    """The share of kept rows whose reasoning computes the answer they tag: the last sum or difference written before
    the answer has its value (the rest, such as "The answer is</think><answer>3", are right by luck or by heart)."""
    def ok(text: str, answer: str) -> bool:
        found = _EXPRESSION.findall(text.split("<answer>")[0])
        if not found:
            return False
        a, op, b = found[-1]
        return (int(a) + int(b) if op == "+" else int(a) - int(b)) == int(answer)
    return sum(ok(r["completion"], r["answer"]) for r in rows) / max(1, len(rows))


def agreement(rows: list[dict], log_path: Path) -> list[dict]:
    """What ``--min_agreement`` 1, 2 and 3 would have kept of round 1's samples (the same samples: keeping needs no
    sampling): rows, coverage, and the share whose reasoning computes their answer."""
    log = SamplesLog(log_path, json.loads(log_path.open().readline())["bootstrap"])
    out = []
    for n in (1, 2, 3):
        kept, counts = select(rows, [log], BootstrapSettings(min_agreement=n, rewrite="tags"), ["reasoning_gym"])
        out.append({"min_agreement": n, "kept": counts["kept"], "coverage": counts["coverage"],
                    "consistent": consistent(kept)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="?", default="runs/reasoning_gym")
    parser.add_argument("--out", default="benchmarks/results/reasoning_gym_recipe.json")
    args = parser.parse_args()
    runs = Path(args.runs)
    base = scores(runs / "base" / "eval_base.json")
    config = yaml.safe_load(Path(__file__).with_name("grpo.yaml").read_text())
    bootstrapped = load_rows(config["dataset"], reasoning_gym_options=config["reasoning_gym"])[:256]  # run.sh's
    records = []
    for seed_dir in sorted((runs / "bootstrap").glob("seed*")):
        if not (seed_dir / "times.json").is_file():  # still running, or stopped part-way
            continue
        cold = json.loads((seed_dir / "cold" / "rows.summary.json").read_text())
        kept = [json.loads(line) for line in (seed_dir / "cold" / "rows.jsonl").open()]
        times = json.loads((seed_dir / "times.json").read_text())
        records.append({
            "seed": int(seed_dir.name.removeprefix("seed")), "base": base,
            "sft": scores(seed_dir / "eval_sft.json"), "grpo": scores(seed_dir / "eval_grpo.json"),
            "bootstrap": [{k: r[k] for k in ("iteration", "coverage", "kept", "correct_rate", "seconds")}
                          for r in cold["iterations"]],
            "cold_start_rows": cold["kept"], "cold_start_consistent": consistent(kept),
            "round_1_by_agreement": agreement(bootstrapped, seed_dir / "cold" / "rows.samples-1.jsonl"),
            "minutes": times["grpo_eval"] / 60,
        })
    Path(args.out).write_text(json.dumps({"machine": {"cpu": cpu_model()}, "runs": records}, indent=2))
    pct = lambda a, k: "—" if a is None else f"{100 * a[k]:.1f}"  # noqa: E731
    print("| seed | base strict / lenient | bootstrap coverage (round 1, 2) | cold start rows (reasoning consistent) "
          "| SFT strict / lenient | GRPO strict / lenient | minutes |")
    print("|---|---|---|---|---|---|---|")
    for r in records:
        coverage = ", ".join(f"{100 * b['coverage']:.0f} %" for b in r["bootstrap"])
        print(f"| {r['seed']} | {pct(base, 'strict')} / {pct(base, 'lenient')} | {coverage} "
              f"| {r['cold_start_rows']} ({100 * r['cold_start_consistent']:.0f} %) "
              f"| {pct(r['sft'], 'strict')} / {pct(r['sft'], 'lenient')} "
              f"| **{pct(r['grpo'], 'strict')}** / {pct(r['grpo'], 'lenient')} | {r['minutes']:.0f} |")
    print("\n| seed | round 1 kept with --min_agreement 1 / 2 / 3: rows, coverage, reasoning consistent |")
    print("|---|---|")
    for r in records:
        cells = [f"{a['kept']}, {100 * a['coverage']:.0f} %, {100 * a['consistent']:.0f} %"
                 for a in r["round_1_by_agreement"]]
        print(f"| {r['seed']} | {' / '.join(cells)} |")


if __name__ == "__main__":
    main()
