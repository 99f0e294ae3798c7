"""The built-in demo task (``grpokit demo``, run by :func:`grpokit.algorithms.demo.run_demo`): its GRPO settings (the
recipes ``arithmetic`` and ``tools``), its held-out rows, its before/after table and the greedy completion it shows.

The measurements are on held-out prompts never seen in warm-start or GRPO training: accuracy with
greedy decoding and with sampling at the training temperature, format rate, and the same on the
"carry" class that the warm-start corpus got systematically wrong. ``--task tools`` (:mod:`grpokit.tasks.tool_task`):
products the model cannot compute by hand and a calculator it may call; measured as well: how often it calls,
how many calls per completion, and how many of them fail.
"""

from __future__ import annotations

from typing import Any

import torch

from grpokit.rollout.generate import generate, stop_token_ids
from grpokit.rollout.tools import ToolBox
from grpokit.tasks import arithmetic, tool_task
from grpokit.tasks.recipe_files import recipe

# The keys of a recipe that the demo sets itself.
RUN_KEYS = ("model", "dataset", "output_dir", "seed")
# The demo's GRPO settings: those of the recipe recipes/arithmetic.yaml (``grpokit train`` runs the same),
# less what the demo sets. Learning rates above ~3e-4 collapse this model within a few steps; a linear
# decay keeps the late steps from drifting.
DEMO_CONFIG: dict[str, Any] = {k: v for k, v in recipe("arithmetic").items() if k not in RUN_KEYS}
TOOLS_CONFIG: dict[str, Any] = {k: v for k, v in recipe("tools").items() if k not in RUN_KEYS}
SETTINGS = {"arithmetic": DEMO_CONFIG, "tools": TOOLS_CONFIG}
OUTPUT_DIRS = {"arithmetic": "runs/demo", "tools": "runs/demo-tools"}

# task → the rows of its before/after table: (subset, key, label, in % or as a number)
_ACCURACY = [("all", "greedy_correct", "accuracy, greedy", True),
             ("all", "sampled_correct", "accuracy, sampled (T=1)", True)]
_FORMAT = [("all", "greedy_format", "format rate, greedy", True),
           ("all", "sampled_format", "format rate, sampled (T=1)", True)]
TABLES = {
    "arithmetic": [
        *_ACCURACY, *_FORMAT,
        ("carry", "greedy_correct", "carry class: accuracy, greedy", True),
        ("carry", "sampled_correct", "carry class: accuracy, sampled", True),
        ("no_carry", "greedy_correct", "no-carry class: accuracy, greedy", True),
    ],
    "tools": [
        *_ACCURACY,
        ("all", "greedy_tool_rate", "tool-call rate, greedy", True),
        ("all", "sampled_tool_rate", "tool-call rate, sampled", True),
        ("all", "sampled_tool_calls", "calls per completion, sampled", False),
        ("all", "sampled_tool_errors", "tool errors per completion, sampled", False),
        *_FORMAT,
    ],
}


def held_out(task: str, n: int) -> tuple[list[dict[str, Any]], dict[str, list[bool]]]:
    """The first ``n`` held-out rows of ``task`` and the classes the table reports apart (arithmetic: the rows whose
    units column carries, and the others)."""
    if task == "tools":
        return tool_task.held_out_rows(n), {}
    rows = arithmetic.held_out_rows(n)
    carry = [row["carry"] for row in rows]
    return rows, {"carry": carry, "no_carry": [not c for c in carry]}


def table(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]],
          task: str = "arithmetic") -> list[list[str]]:
    """The before/after table's rows: label, before, after, change."""
    rows = []
    for subset, key, label, percent in TABLES[task]:
        b, a = before[subset][key], after[subset][key]
        if percent:
            rows.append([label, f"{100 * b:5.1f} %", f"{100 * a:5.1f} %", f"{100 * (a - b):+5.1f}"])
        else:
            rows.append([label, f"{b:.2f}", f"{a:.2f}", f"{a - b:+.2f}"])
    return rows


def format_table(rows: list[list[str]]) -> str:
    header = ["metric (held-out)", "before", "after", "change (points)"]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(4)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def greedy_completion(model: torch.nn.Module, tokenizer: Any, prompt: str, max_new_tokens: int | None = None,
                      toolbox: ToolBox = ToolBox.NONE) -> str:
    """The model's most likely completion of one prompt (calling ``toolbox``'s tools, if it has any)."""
    encoded = tokenizer([prompt], return_tensors="pt")
    max_new_tokens = max_new_tokens or DEMO_CONFIG["max_completion_length"]
    rollout = generate(model, encoded["input_ids"], encoded["attention_mask"], num_generations=1,
                       max_new_tokens=max_new_tokens, greedy=True,
                       eos_token_id=stop_token_ids(model, tokenizer), pad_token_id=tokenizer.pad_token_id,
                       tools=toolbox.session([{}], 1, max_new_tokens))
    return rollout.decode(tokenizer)[0]
