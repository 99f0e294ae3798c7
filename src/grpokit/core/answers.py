"""Reading the answer out of a completion: the text of its single ``<answer>…</answer>``, a number
written plainly, and whether a predicted answer matches a reference.

Shared by the rule-based rewards (:mod:`grpokit.rewards.calling`) and the built-in task's process reward
(:mod:`grpokit.tasks.arithmetic`). Everything here parses text; nothing ever evaluates it.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

Text = str | list[dict[str, Any]]  # plain text, or chat messages [{"role": ..., "content": ...}]

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# Plain decimal numbers, optionally signed, with optional thousands separators. ASCII digits only.
_NUMBER_RE = re.compile(r"[+-]?(?:[0-9]+|[0-9]{1,3}(?:,[0-9]{3})+)(?:\.[0-9]+)?|[+-]?\.[0-9]+", re.ASCII)
# The same numbers found within text: thousands separators tried first ("1,012" is one number, not "1" and "012").
_NUMBER_IN_TEXT_RE = re.compile(r"[+-]?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|[+-]?\.[0-9]+", re.ASCII)


def text_of(value: Text) -> str:
    """The text of a prompt or completion in either form reward functions receive: plain text as is,
    chat messages as the content of the last one (a completion's assistant message; a prompt's last turn).

    >>> text_of("12"), text_of([{"role": "assistant", "content": "<answer>12</answer>"}])
    ('12', '<answer>12</answer>')
    """
    if isinstance(value, str):
        return value
    return value[-1]["content"] if value else ""


def extract_answer(completion: str) -> str | None:
    """The text inside the completion's only ``<answer>…</answer>``; None if there is not exactly one.

    >>> extract_answer("<think>x</think><answer> 42 </answer>")
    ' 42 '
    >>> extract_answer("<answer>1</answer><answer>2</answer>") is None
    True
    """
    found = _ANSWER_RE.findall(completion)
    if len(found) != 1 or completion.count("<answer>") != 1:
        return None
    return found[0]


def last_number(text: str) -> re.Match[str] | None:
    """The last plainly written number in ``text`` (as :func:`parse_number` reads them), where a reply in prose
    usually states its result; None if there is none.

    >>> last_number("5 + 7 makes 12, so the answer is 1,012.").group()
    '1,012'
    >>> last_number("no digits") is None
    True
    """
    return next(reversed(list(_NUMBER_IN_TEXT_RE.finditer(text))), None)


def parse_number(text: str) -> Decimal | None:
    """A number written plainly (``" +1,234.0 "`` → 1234), or None. Never evaluates expressions.

    >>> parse_number(" +007 "), parse_number("1,234.50"), parse_number("3+4"), parse_number("")
    (Decimal('7'), Decimal('1234.50'), None, None)
    """
    text = text.strip()
    if not _NUMBER_RE.fullmatch(text):
        return None
    try:
        return Decimal(text.replace(",", ""))
    except InvalidOperation:  # pragma: no cover - the regex admits only valid literals
        return None


def answers_match(predicted: str, reference: Any) -> bool:
    """Numeric equality when both sides parse as numbers, else whitespace-insensitive text equality.

    >>> answers_match("0132", 132), answers_match("132.0", "132"), answers_match("", "0")
    (True, True, False)
    """
    predicted_number, reference_number = parse_number(predicted), parse_number(str(reference))
    if predicted_number is not None and reference_number is not None:
        return predicted_number == reference_number
    normalized = " ".join(predicted.split())
    return bool(normalized) and normalized == " ".join(str(reference).split())


# How `answer_extraction` reads a completion's final answer (for scorers that compare an answer, not a reply).
ANSWER_EXTRACTIONS = ("tag", "boxed", "last_line", "last_number", "whole")


def extract_by(completion: str, method: str) -> str | None:
    """The final answer in ``completion``, stripped, read by ``method``: ``"tag"`` the text of its only
    ``<answer>…</answer>`` (:func:`extract_answer`), ``"boxed"`` the last ``\\boxed{…}`` (braces balanced),
    ``"last_line"`` its last non-blank line, ``"last_number"`` the last number written plainly (:func:`last_number`),
    ``"whole"`` all of it; None where there is none (or it is empty).

    >>> text = "x = \\\\boxed{\\\\frac{1}{2}}\\n<answer> 1/2 </answer>\\n"
    >>> [extract_by(text, method) for method in ANSWER_EXTRACTIONS]
    ['1/2', '\\\\frac{1}{2}', '<answer> 1/2 </answer>', '2', 'x = \\\\boxed{\\\\frac{1}{2}}\\n<answer> 1/2 </answer>']
    >>> extract_by("\\\\boxed{1", "boxed") is None, extract_by("  ", "whole") is None
    (True, True)
    """
    if method == "tag":
        found = extract_answer(completion)
    elif method == "boxed":
        found = _last_boxed(completion)
    elif method == "last_line":
        found = next((line for line in reversed(completion.splitlines()) if line.strip()), None)
    elif method == "last_number":
        match = last_number(completion)
        found = match.group() if match else None
    elif method == "whole":
        found = completion
    else:
        raise ValueError(f"answer_extraction={method!r} is not one of {', '.join(map(repr, ANSWER_EXTRACTIONS))}")
    found = found.strip() if found is not None else None
    return found or None


def _last_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{…}`` whose braces close; None if there is none."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, i = 1, start + len("\\boxed{")
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if not depth:
            return text[start + len("\\boxed{"):i - 1]
        start = text.rfind("\\boxed{", 0, start)
    return None
