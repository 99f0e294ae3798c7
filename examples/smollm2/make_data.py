"""The recipe's data: a cold start, GRPO prompts and a held-out set, as JSONL, from grpokit's addition task.

    python examples/smollm2/make_data.py runs/smollm2/data [CARRY_SHARE] [--carry inline|line|always|line_always]
    # → cold_start.jsonl, train.jsonl, held_out.jsonl

- ``cold_start.jsonl``: ROWS ``{"prompt", "completion"}`` rows for ``grpokit sft``, each a worked column
  addition (``<think>\\n7+5=12\\n4+8+1=13\\n</think>\\n<answer>132</answer>``); a minority (CARRY_SHARE) carry.
  The cold start teaches the format and the column method, with just enough carrying that the model's samples
  sometimes carry correctly: a problem whose G samples are all wrong gives GRPO no signal, so a cold start
  without any carry leaves every carry problem out of reach of RL. ``--carry``: how the solutions write
  the carry (``grpokit.tasks.arithmetic.worked_solution``): within the tens line (``4+8+1=13``), in a line of
  its own (``4+8=12``, ``12+1=13``), always, 0 or 1, copied from a two-digit units sum (``1+5=06``, ``4+3+0=7``), or
  both (``1+5=06``, ``4+3=7``, ``7+0=7``).
- ``train.jsonl``: ``{"prompt", "answer"}`` rows for ``grpokit train``: every training pair, carries included.
- ``held_out.jsonl``: ``{"prompt", "answer", "carry"}``, pairs that neither stage ever sees
  (grpokit.tasks.arithmetic's fixed held-out split), for ``grpokit eval``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

from grpokit.tasks.arithmetic import (
    CARRY_STYLES,
    HELD_OUT_PAIRS,
    TRAIN_PAIRS,
    has_carry,
    make_row,
    prompt_text,
    worked_solution,
)

ROWS = 300  # cold-start rows
CARRY_SHARE = 0.25  # of the cold-start rows (the held-out problems carry in 45 % of cases)
HELD_OUT = 200


def write_jsonl(path: Path, rows: list[dict]) -> None:
    # Written aside and renamed: recipe runs started side by side rewrite the same files while others read them.
    aside = path.with_name(f".{path.name}.{os.getpid()}")
    aside.write_text("".join(json.dumps(row) + "\n" for row in rows))
    aside.replace(path)
    print(f"{path}: {len(rows)} rows")


def main(out_dir: str, carry_share: float = CARRY_SHARE, carry: str = "inline") -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    carries = round(ROWS * carry_share)
    cold = (rng.sample([p for p in TRAIN_PAIRS if has_carry(*p)], carries)
            + rng.sample([p for p in TRAIN_PAIRS if not has_carry(*p)], ROWS - carries))
    rng.shuffle(cold)
    write_jsonl(out / "cold_start.jsonl", [
        {"prompt": prompt_text(a, b), "completion": worked_solution(a, b, carry=carry)} for a, b in cold])
    train = list(TRAIN_PAIRS)
    rng.shuffle(train)
    write_jsonl(out / "train.jsonl", [{k: v for k, v in make_row(a, b).items() if k != "carry"} for a, b in train])
    held_out = sorted(HELD_OUT_PAIRS)
    random.Random(1234).shuffle(held_out)
    write_jsonl(out / "held_out.jsonl", [make_row(a, b) for a, b in held_out[:HELD_OUT]])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="runs/smollm2/data")
    parser.add_argument("carry_share", nargs="?", type=float, default=CARRY_SHARE)
    parser.add_argument("--carry", choices=CARRY_STYLES, default="inline", help="how the solutions write the carry")
    args = parser.parse_args()
    main(args.out_dir, args.carry_share, args.carry)
