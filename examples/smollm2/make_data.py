"""The recipe's data: a cold start, GRPO prompts and a held-out set, as JSONL, from grpokit's addition task.

    python examples/smollm2/make_data.py runs/smollm2/data    # cold_start.jsonl, train.jsonl, held_out.jsonl

- ``cold_start.jsonl``: ROWS ``{"prompt", "completion"}`` rows for ``grpokit sft``, each a worked column
  addition (``<think>\\n7+1=8\\n4+2=6\\n</think>\\n<answer>68</answer>``) of a problem **without a carry**. The
  cold start teaches the format and the column method on easy problems only; carrying is left for GRPO to
  learn from the accuracy reward alone.
- ``train.jsonl``: ``{"prompt", "answer"}`` rows for ``grpokit train``: every training pair, carries included.
- ``held_out.jsonl``: ``{"prompt", "answer", "carry"}``, pairs that neither stage ever sees
  (grpokit.arithmetic's fixed held-out split), for ``grpokit eval``.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from grpokit.arithmetic import HELD_OUT_PAIRS, TRAIN_PAIRS, has_carry, make_row, prompt_text, worked_solution

ROWS = 300  # cold-start rows
HELD_OUT = 200


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{path}: {len(rows)} rows")


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    easy = [pair for pair in TRAIN_PAIRS if not has_carry(*pair)]
    write_jsonl(out / "cold_start.jsonl", [{"prompt": prompt_text(a, b), "completion": worked_solution(a, b)}
                                           for a, b in rng.sample(easy, ROWS)])
    train = list(TRAIN_PAIRS)
    rng.shuffle(train)
    write_jsonl(out / "train.jsonl", [{k: v for k, v in make_row(a, b).items() if k != "carry"} for a, b in train])
    held_out = sorted(HELD_OUT_PAIRS)
    random.Random(1234).shuffle(held_out)
    write_jsonl(out / "held_out.jsonl", [make_row(a, b) for a, b in held_out[:HELD_OUT]])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/smollm2/data")
