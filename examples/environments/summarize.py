"""The example runs' metrics as the table in docs/environments.md: per run, the first and last two steps' mean
reward and each reward function's, the environment's replies per step, and the minutes the run took.

    python examples/environments/summarize.py [runs/environments]
"""

import json
import sys
from pathlib import Path


def mean(rows: list[dict], key: str) -> float:
    values = [row[key] for row in rows if row.get(key) is not None]
    return sum(values) / len(values) if values else float("nan")


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/environments")
    print("| run | steps | reward, steps 1–2 → last 2 | per function, steps 1–2 → last 2 | replies per step "
          "| minutes |")
    print("|---|---|---|---|---|---|")
    for run in sorted(path for path in root.iterdir() if (path / "metrics.jsonl").is_file()):
        steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        steps = [row for row in steps if "reward" in row]
        first, last = steps[:2], steps[-2:]
        functions = sorted(key for key in steps[0] if key.startswith("rewards/"))
        per = "; ".join(f"{key.removeprefix('rewards/')} {mean(first, key):.2f} → {mean(last, key):.2f}"
                        for key in functions)
        minutes = sum(row.get("time_step", 0.0) for row in steps) / 60
        print(f"| {run.name} | {len(steps)} | {mean(first, 'reward'):.3f} → {mean(last, 'reward'):.3f} | {per} | "
              f"{mean(steps, 'env_replies'):.1f} | {minutes:.1f} |")


if __name__ == "__main__":
    main()
