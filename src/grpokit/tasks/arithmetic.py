"""The built-in task: two-digit addition, with worked solutions, a process reward that scores each
column step, and a fixed split of the problems into training and held-out pairs.

Prompts read ``What is 47 + 85?``; a worked solution adds column by column::

    <think>
    7+5=12
    4+8+1=13
    </think>
    <answer>132</answer>

``worked_solution(..., forget_carry=True)`` makes the mistake that the warm-start corpus makes on
purpose (:mod:`grpokit.tasks.warm_start`), so that GRPO has something real to fix; the tokenizer and the
tiny Llama are in :mod:`grpokit.tasks.tiny_model`.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Sequence
from typing import Any

from grpokit.core.answers import Text, answers_match, extract_answer, text_of

# Bump when prompts, solutions or the tokenizer (tiny_model.py) change, to invalidate the warm-start cache.
TASK_VERSION = 1


# ---- problems and worked solutions ---------------------------------------------------------------


def has_carry(a: int, b: int) -> bool:
    """Whether the units column of a + b carries (the class the corpus gets wrong)."""
    return a % 10 + b % 10 >= 10


def prompt_text(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


CARRY_STYLES = ("inline", "line", "always", "line_always")  # how worked_solution writes the carry


def worked_solution(a: int, b: int, *, forget_carry: bool = False, carry: str = "inline") -> str:
    """Column addition of two two-digit numbers; ``forget_carry`` makes the corpus's mistake. ``carry``:
    ``"inline"`` adds it within the tens line; ``"line"`` in a line of its own, so that every line adds
    two numbers; ``"always"`` writes every units sum with two digits and always adds its first, 0 or 1,
    so that every solution has the same shape and the carry is a copied digit; ``"line_always"`` both:
    the carry, 0 or 1, in a line of its own in every solution.

    >>> worked_solution(47, 85)
    '<think>\\n7+5=12\\n4+8+1=13\\n</think>\\n<answer>132</answer>'
    >>> worked_solution(47, 85, forget_carry=True)
    '<think>\\n7+5=12\\n4+8=12\\n</think>\\n<answer>122</answer>'
    >>> worked_solution(47, 85, carry="line")
    '<think>\\n7+5=12\\n4+8=12\\n12+1=13\\n</think>\\n<answer>132</answer>'
    >>> worked_solution(41, 35, carry="always")
    '<think>\\n1+5=06\\n4+3+0=7\\n</think>\\n<answer>76</answer>'
    >>> worked_solution(41, 35, carry="line_always")
    '<think>\\n1+5=06\\n4+3=7\\n7+0=7\\n</think>\\n<answer>76</answer>'
    """
    units = a % 10 + b % 10
    steps = expected_steps(a, b, carry=carry)
    if forget_carry:
        steps = [([a % 10, b % 10], units), ([a // 10, b // 10], a // 10 + b // 10)]
    results = [f"{units:02d}" if carry.endswith("always") else str(units)] + [str(result) for _, result in steps[1:]]
    lines = "".join("+".join(map(str, operands)) + f"={result}\n" for (operands, _), result in zip(steps, results))
    answer = steps[-1][1] * 10 + units % 10
    return f"<think>\n{lines}</think>\n<answer>{answer}</answer>"


_PROMPT_RE = re.compile(r"(\d+)\s*\+\s*(\d+)", re.ASCII)
# One line of column arithmetic: "7+5=12" or "4+8+1=13" (digits, plus signs, one equals sign).
_STEP_RE = re.compile(r"[ \t]*(\d+(?:[ \t]*\+[ \t]*\d+)*)[ \t]*=[ \t]*(\d+)[ \t]*", re.ASCII)
_THINK_RE = re.compile(r"<think>(.*?)</think>", re.DOTALL)


def expected_steps(a: int, b: int, *, carry: str = "inline") -> list[tuple[list[int], int]]:
    """The correct column steps of a + b as (operands, result): units, then tens with the carry as
    ``carry`` says (:data:`CARRY_STYLES`, :func:`worked_solution`).

    >>> expected_steps(47, 85)
    [([7, 5], 12), ([4, 8, 1], 13)]
    >>> expected_steps(47, 85, carry="line")
    [([7, 5], 12), ([4, 8], 12), ([12, 1], 13)]
    >>> expected_steps(41, 35, carry="always")
    [([1, 5], 6), ([4, 3, 0], 7)]
    >>> expected_steps(41, 35, carry="line_always")
    [([1, 5], 6), ([4, 3], 7), ([7, 0], 7)]
    """
    if carry not in CARRY_STYLES:
        raise ValueError(f"carry must be one of {CARRY_STYLES}, not {carry!r}")
    units = a % 10 + b % 10
    tens = [a // 10, b // 10]
    if units < 10 and carry == "line_always":
        return [([a % 10, b % 10], units), (tens, sum(tens)), ([sum(tens), 0], sum(tens))]
    if units < 10:
        return [([a % 10, b % 10], units), (tens + [0] if carry == "always" else tens, sum(tens))]
    if carry in ("line", "line_always"):
        return [([a % 10, b % 10], units), (tens, sum(tens)), ([sum(tens), 1], sum(tens) + 1)]
    return [([a % 10, b % 10], units), (tens + [1], sum(tens) + 1)]


def arithmetic_steps_reward(
    prompts: Sequence[Text], completions: Sequence[Text], **columns: Any
) -> list[list[tuple[int, float]] | None]:
    """Process reward for the built-in task: one step per arithmetic line of the ``<think>`` block,
    then the final answer as the last step (docs/math.md, "Process supervision").

    A line ``x+y(+c)=z`` scores 1.0 when it is the correct column step at its position (the right
    digits, the carry included, the right sum) and 0.0 otherwise, a forgotten carry included; lines
    are parsed, never evaluated. Any of :func:`worked_solution`'s carry styles is correct: the carry
    within the tens line, in a line of its own (``4+8=12``, ``12+1=13``), or a carry of 0 added
    (``4+3+0=7``, or ``4+3=7``, ``7+0=7``). Columns the block leaves out are one wrong step ending where
    the block closes (after ``</think>``): otherwise leaving out a column a model often gets wrong would
    score better than writing it wrong, and a model learns to skip the carry's column. The final step,
    ending with the completion, scores 1.0 when the single ``<answer>`` holds a + b. Each step is
    ``(character offset where it ends, reward)``. Prompts that name no ``a + b`` get None.

    >>> arithmetic_steps_reward(["What is 47 + 85?"], [worked_solution(47, 85, forget_carry=True)])
    [[(14, 1.0), (21, 0.0), (51, 0.0)]]
    >>> arithmetic_steps_reward(["What is 47 + 85?"], ["<think>\\n7+5=12\\n</think>\\n<answer>122</answer>"])
    [[(14, 1.0), (23, 0.0), (44, 0.0)]]
    """
    return [_column_steps(prompt, completion, split=False) for prompt, completion in zip(prompts, completions)]


def arithmetic_substeps_reward(
    prompts: Sequence[Text], completions: Sequence[Text], **columns: Any
) -> list[list[tuple[int, float]] | None]:
    """:func:`arithmetic_steps_reward` with each column line split in two steps: its operands, ending
    with the ``=`` (1.0 when they are the column's digits and its carry: ``4+8+1=``), then its result
    (1.0 when it is the column's sum). A model that forgets the carry and one that writes it but
    adds it wrong then score differently, so writing the carry is rewarded before the sum is right.

    >>> arithmetic_substeps_reward(["What is 47 + 85?"], ["<think>\\n7+5=12\\n4+8+1=12\\n</think><answer>122</answer>"])
    [[(12, 1.0), (14, 1.0), (21, 1.0), (23, 0.0), (52, 0.0)]]
    """
    return [_column_steps(prompt, completion, split=True) for prompt, completion in zip(prompts, completions)]


def _column_steps(prompt: Text, completion: Text, *, split: bool) -> list[tuple[int, float]] | None:
    prompt, completion = text_of(prompt), text_of(completion)
    match = _PROMPT_RE.search(prompt)
    if match is None:
        return None
    a, b = int(match.group(1)), int(match.group(2))
    steps: list[tuple[int, float]] = []
    think = _THINK_RE.search(completion)
    if think is not None:
        lines = []  # (offset where the line starts, the line, its operands, its result)
        offset = think.start(1)
        for line in think.group(1).split("\n"):
            parsed = _STEP_RE.fullmatch(line)
            if parsed is not None:
                lines.append((offset, line, [int(x) for x in parsed.group(1).split("+")], int(parsed.group(2))))
            offset += len(line) + 1
        # Each carry style is a correct method; the completion's lines say which it follows: the carry in a
        # line of its own (a third line after a two-operand tens line; 0 where there is none), a carry of 0
        # added (a three-operand tens line without a carry), else within the tens line. A carry left out is
        # wrong in all.
        style = "inline"
        if len(lines) > 2 and len(lines[1][2]) == 2:
            style = "line_always"
        elif len(lines) > 1 and not has_carry(a, b) and len(lines[1][2]) == 3:
            style = "always"
        expected = expected_steps(a, b, carry=style)
        for (offset, line, operands, result), want in zip(lines, expected + [None] * len(lines)):
            if split and want is not None:
                steps.append((offset + line.index("=") + 1, 1.0 if operands == want[0] else 0.0))
                steps.append((offset + len(line.rstrip()), 1.0 if result == want[1] else 0.0))
            else:
                steps.append((offset + len(line.rstrip()), 1.0 if (operands, result) == want else 0.0))
        if len(lines) < len(expected) and think.end() < len(completion):
            steps.append((think.end(), 0.0))
    predicted = extract_answer(completion)
    correct = predicted is not None and answers_match(predicted, a + b)
    steps.append((len(completion), 1.0 if correct else 0.0))
    return steps


# ---- reading completions: what a carry problem's tens column says --------------------------------------------


def prompt_operands(prompt: str) -> tuple[int, int]:
    """a and b of a prompt that asks for a + b (:func:`prompt_text`'s).

    >>> prompt_operands("What is 47 + 85?")
    (47, 85)
    """
    match = _PROMPT_RE.search(prompt)
    if match is None:
        raise ValueError(f"no a + b in the prompt {prompt!r}")
    return int(match.group(1)), int(match.group(2))


_TENS_LINE_RE = re.compile(r"^(\d+(?:\+\d+)*)=(\d+)$", re.MULTILINE)


def tens_column(a: int, b: int, completion: str) -> str:
    """What a carry problem's completion writes in the tens column: ``forgot`` the carry (``4+8=12``,
    ``4+8+0=12``), writes it but ``added_wrong`` (``4+8+1=12``, or ``4+8=12``, ``12+1=14`` with the carry in a
    line of its own), ``right``, or ``other``: the mistake the warm-start corpus makes, told apart from the
    one a model makes while learning to write the carry.

    >>> tens_column(47, 85, worked_solution(47, 85, forget_carry=True))
    'forgot'
    >>> tens_column(47, 85, worked_solution(47, 85, carry="line"))
    'right'
    >>> tens_column(47, 85, "<think>\\n7+5=12\\n4+8+1=14\\n</think>")
    'added_wrong'
    """
    lines = [([int(x) for x in terms.split("+")], int(result)) for terms, result in _TENS_LINE_RE.findall(completion)]
    tens = lines[1] if len(lines) > 1 else None
    if tens is not None and len(lines) > 2 and len(tens[0]) == 2 and lines[2][0][1:] == [1]:
        tens = (tens[0] + [1], lines[2][1])  # the carry in a line of its own: 4+8=12, 12+1=13
    right = expected_steps(a, b)[1]  # ([tens digits, 1], their sum)
    forgot = [(right[0][:2] + zero, right[1] - 1) for zero in ([], [0])]  # 4+8=12, or 4+8+0=12
    return ("right" if tens == right else "added_wrong" if tens is not None and tens[0] == right[0] else
            "forgot" if tens in forgot else "other")


def carry_mistakes(records: Sequence[dict], steps: int = 30) -> dict[str, dict[str, float]]:
    """The shares of :func:`tens_column`'s kinds among logged completions (``{step, prompt, completion}``, as
    a run's ``completions.jsonl`` holds them) of carry problems, in the ``first`` and the ``last`` ``steps``
    steps; empty where a window has none."""
    last = max(r["step"] for r in records)
    out = {}
    for name, low, high in (("first", 1, steps), ("last", last - steps + 1, last)):
        kinds = dict.fromkeys(("forgot", "added_wrong", "right", "other"), 0)
        for record in records:
            a, b = prompt_operands(record["prompt"])
            if low <= record["step"] <= high and has_carry(a, b):
                kinds[tens_column(a, b, record["completion"])] += 1
        total = sum(kinds.values())
        out[name] = {kind: count / total for kind, count in kinds.items()} if total else {}
    return out


def _is_held_out(a: int, b: int) -> bool:
    # A fixed ~10 % of all pairs, never seen in warm-start or GRPO training, whatever the seed.
    return int(hashlib.sha256(f"{a}+{b}".encode()).hexdigest(), 16) % 10 == 0


ALL_PAIRS = [(a, b) for a in range(10, 100) for b in range(10, 100)]
TRAIN_PAIRS = [p for p in ALL_PAIRS if not _is_held_out(*p)]
HELD_OUT_PAIRS = [p for p in ALL_PAIRS if _is_held_out(*p)]


def make_row(a: int, b: int) -> dict:
    return {"prompt": prompt_text(a, b), "answer": str(a + b), "carry": has_carry(a, b)}


def train_rows(num_rows: int, seed: int) -> list[dict]:
    """Rows of the GRPO training set: prompts from the training pairs, in a seeded order."""
    rng = random.Random(seed)
    return [make_row(*rng.choice(TRAIN_PAIRS)) for _ in range(num_rows)]


def held_out_rows(num_rows: int = 400) -> list[dict]:
    """A fixed evaluation set from the held-out pairs (the same for every seed)."""
    pairs = sorted(HELD_OUT_PAIRS)
    random.Random(1234).shuffle(pairs)
    return [make_row(*p) for p in pairs[:num_rows]]
