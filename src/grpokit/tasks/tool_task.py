"""The built-in tools task: three-digit × two-digit products, which the tiny model cannot do by hand, and a
calculator it can call (:func:`grpokit.rollout.tools.calculator`).

Prompts read ``What is 347 * 58?``. A worked solution either calls the calculator::

    <think>
    <tool>{"name": "calculator", "arguments": {"expression": "347*58"}}</tool><result>20126</result>
    </think>
    <answer>20126</answer>

or works "by hand" in one line (``by hand: 347*58=15476``), and the warm-start corpus's hand products are
systematically wrong (every column's carry forgotten: :func:`carry_less_product`). Both ways start with one
token after ``<think>\n``, ``<tool>`` or ``b``, so the choice is one decision. The corpus calls the calculator
in a minority of its solutions (:data:`TOOL_SHARE`), so the warm-started model formats well, answers by hand
(greedy, and wrong) and calls the tool now and then when sampled: the signal GRPO has to find — that calling
the tool pays.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

from grpokit.rollout.tool_calls import RESULT_CLOSE, RESULT_OPEN, TOOL_CLOSE, TOOL_OPEN
from grpokit.rollout.tools import calculator

TASK_VERSION = 1  # bump when prompts, solutions or the tokenizer change: the warm-start cache is keyed by it
TOOL_SHARE = 0.25  # of the corpus's solutions that call the calculator


def prompt_text(a: int, b: int) -> str:
    return f"What is {a} * {b}?"


def carry_less_product(a: int, b: int) -> int:
    """Long multiplication with every carry forgotten: each column keeps only the last digit of its sum (the
    leftmost column writes all of it).

    >>> carry_less_product(347, 58), 347 * 58
    (15476, 20126)
    """
    xs, ys = [int(d) for d in reversed(str(a))], [int(d) for d in reversed(str(b))]
    columns = [0] * (len(xs) + len(ys) - 1)
    for i, x in enumerate(xs):
        for j, y in enumerate(ys):
            columns[i + j] += x * y
    return int(str(columns[-1]) + "".join(str(c % 10) for c in reversed(columns[:-1])))


def tool_call_text(a: int, b: int) -> str:
    call = {"name": "calculator", "arguments": {"expression": f"{a}*{b}"}}
    return f"{TOOL_OPEN}{json.dumps(call)}{TOOL_CLOSE}"


def worked_solution(a: int, b: int, *, use_tool: bool) -> list[tuple[str, bool]]:
    """The solution as ``(text, written_by_the_model)`` pieces: the calculator's result is context, not
    something the model writes (the warm start's loss skips it, as GRPO's does:
    :func:`grpokit.tasks.warm_start.supervised_batch`).

    >>> "".join(text for text, _ in worked_solution(347, 58, use_tool=False))
    '<think>\\nby hand: 347*58=15476\\n</think>\\n<answer>15476</answer>'
    >>> worked_solution(347, 58, use_tool=True)[1]
    ('<result>20126</result>', False)
    """
    if not use_tool:
        product = carry_less_product(a, b)
        return [(f"<think>\nby hand: {a}*{b}={product}\n</think>\n<answer>{product}</answer>", True)]
    result = calculator(f"{a}*{b}")
    return [(f"<think>\n{tool_call_text(a, b)}", True), (f"{RESULT_OPEN}{result}{RESULT_CLOSE}", False),
            (f"\n</think>\n<answer>{result}</answer>", True)]


def _is_held_out(a: int, b: int) -> bool:
    return int(hashlib.sha256(f"{a}*{b}".encode()).hexdigest(), 16) % 10 == 0


def all_pairs() -> list[tuple[int, int]]:
    return [(a, b) for a in range(100, 1000) for b in range(10, 100)]


def make_row(a: int, b: int) -> dict[str, Any]:
    return {"prompt": prompt_text(a, b), "answer": str(a * b)}


def train_rows(num_rows: int, seed: int) -> list[dict[str, Any]]:
    """GRPO's training rows: products of the training pairs, in a seeded order (deterministic for a seed)."""
    rng = random.Random(seed)
    pairs = all_pairs()
    rows = []
    while len(rows) < num_rows:
        a, b = rng.choice(pairs)
        if not _is_held_out(a, b):
            rows.append(make_row(a, b))
    return rows


def held_out_rows(num_rows: int = 400) -> list[dict[str, Any]]:
    """A fixed evaluation set of held-out pairs (the same for every seed; never in the corpus or training)."""
    rng = random.Random(4321)
    rows: list[dict[str, Any]] = []
    while len(rows) < num_rows:
        a, b = rng.randrange(100, 1000), rng.randrange(10, 100)
        if _is_held_out(a, b) and make_row(a, b) not in rows:
            rows.append(make_row(a, b))
    return rows


def corpus_example(rng: random.Random, tool_share: float = TOOL_SHARE) -> tuple[str, list[tuple[str, bool]]]:
    while True:
        a, b = rng.randrange(100, 1000), rng.randrange(10, 100)
        if not _is_held_out(a, b):
            return prompt_text(a, b), worked_solution(a, b, use_tool=rng.random() < tool_share)
