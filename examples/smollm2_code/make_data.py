"""The code recipe's data, as JSONL, from grpokit's generated problem set (grpokit.tasks.python_functions):

    python examples/smollm2_code/make_data.py runs/smollm2_code/data   # cold_start.jsonl, train.jsonl, held_out.jsonl

- ``cold_start.jsonl``: COLD_START ``{"prompt", "completion"}`` rows for ``grpokit sft``: training problems of the
  SHAPE_FAMILIES with their reference solution (one fenced block). It teaches the reply's shape, one ```python
  block and then the end of the turn (SmolLM2 otherwise explains its code at length, which GRPO would pay for in
  generated tokens), on families the model already solves: the families it gets wrong are left to GRPO.
- ``train.jsonl``: ``{"prompt", "tests", "family"}`` rows for ``grpokit train`` with ``code_tests``: every training
  problem.
- ``held_out.jsonl``: the same for the held-out problems, which neither stage ever sees, for ``grpokit eval``.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from grpokit.tasks.python_functions import held_out_problems, train_problems

COLD_START = 40
SHAPE_FAMILIES = ("add_{k}", "minus_{k}", "times_{k}", "is_multiple_of_{k}", "add_to_each", "remove_char",
                  "starts_with")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{path}: {len(rows)} rows")


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    train = train_problems()
    rng.shuffle(train)
    shape = [p for p in train if p.family in SHAPE_FAMILIES][:COLD_START]
    write_jsonl(out / "cold_start.jsonl", [{"prompt": p.prompt, "completion": p.solution} for p in shape])
    write_jsonl(out / "train.jsonl", [p.row() for p in train])
    write_jsonl(out / "held_out.jsonl", [p.row() for p in held_out_problems()])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/smollm2_code/data")
