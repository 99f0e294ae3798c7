"""Rows for examples/agent: addition problems (question, answer), a seeded draw, one JSON object per line."""

import json
import random
import sys
from pathlib import Path

out, count = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/agent/data.jsonl"), 64
out.parent.mkdir(parents=True, exist_ok=True)
rng = random.Random(0)
rows = []
for _ in range(count):
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    rows.append({"question": f"What is {a} + {b}?", "answer": str(a + b)})
out.write_text("".join(json.dumps(row) + "\n" for row in rows))
print(f"{len(rows)} rows in {out}")
