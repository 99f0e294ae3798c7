"""The built-in rule rewards, by name in a config: ``accuracy`` (:func:`accuracy_reward`), ``math_accuracy``
(:func:`math_accuracy_reward`), ``lenient_accuracy`` (:func:`lenient_accuracy_reward`) and ``format``
(:func:`format_reward`) — docs/math.md, "One step": rewards. Each is a
plain function called as TRL calls reward functions (:mod:`grpokit.rewards.calling`); each parses text and never
evaluates it."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from grpokit.core.answers import Text, answers_match, extract_answer, last_number, parse_number, text_of

__all__ = ["accuracy_reward", "format_reward", "lenient_accuracy_reward", "math_accuracy_reward"]

_TAG = r"</?(?:think|answer)>"
_FORMAT_RE = re.compile(
    rf"\s*<think>((?:(?!{_TAG}).)*)</think>\s*<answer>((?:(?!{_TAG}).)*)</answer>\s*", re.DOTALL
)


def format_reward(prompts: Sequence[Text], completions: Sequence[Text], **columns: Any) -> list[float]:
    """1.0 when a completion is exactly ``<think>…</think><answer>…</answer>`` (whitespace allowed
    around the blocks, no tags nested or repeated), else 0.0.

    >>> format_reward(["q"] * 3, ["<think>7+5=12</think><answer>12</answer>", "<answer>12</answer>",
    ...                           "<think>a</think><answer>1</answer><answer>2</answer>"])
    [1.0, 0.0, 0.0]
    """
    return [1.0 if _FORMAT_RE.fullmatch(text_of(c)) else 0.0 for c in completions]


def accuracy_reward(
    prompts: Sequence[Text], completions: Sequence[Text], answer: Sequence[Any], **columns: Any
) -> list[float]:
    """1.0 when the text inside the single ``<answer>`` tag equals the row's ``answer``, else 0.0.

    Tolerates whitespace, a leading ``+``, leading zeros, ``.0`` and thousands separators; an empty
    or missing answer, or several ``<answer>`` tags, score 0.

    >>> accuracy_reward(["q"] * 4, ["<answer> 1,024 </answer>", "<answer></answer>", "1024",
    ...                             "<answer>1024</answer><answer>7</answer>"], answer=[1024] * 4)
    [1.0, 0.0, 0.0, 0.0]
    """
    scores = []
    for completion, reference in zip(completions, answer):
        predicted = extract_answer(text_of(completion))
        scores.append(1.0 if predicted is not None and answers_match(predicted, reference) else 0.0)
    return scores


def lenient_accuracy_reward(
    prompts: Sequence[Text], completions: Sequence[Text], answer: Sequence[Any], **columns: Any
) -> list[float]:
    """1.0 when the completion's answer equals the row's ``answer``: the text inside its single ``<answer>`` tag, or,
    without one, the last number it writes (a reply in prose: "... so the sum is 42."). What a model that has not
    learned the format knows; :func:`accuracy_reward` is the strict one.

    >>> lenient_accuracy_reward(["q"] * 3, ["<answer>42</answer>", "so it is 42.", "42 or maybe 41"], answer=[42] * 3)
    [1.0, 1.0, 0.0]
    """
    scores = []
    for completion, reference in zip(completions, answer):
        text = text_of(completion)
        predicted = extract_answer(text)
        if predicted is None:
            number = last_number(text)
            predicted = None if number is None else number.group()
        scores.append(1.0 if predicted is not None and answers_match(predicted, reference) else 0.0)
    return scores


def math_accuracy_reward(
    prompts: Sequence[Text], completions: Sequence[Text], answer: Sequence[Any], **columns: Any
) -> list[float]:
    """1.0 when the single ``<answer>`` is mathematically equal to the row's ``answer``.

    Plain numbers are compared exactly by the strict parser (as :func:`accuracy_reward`). Anything else
    (``\\frac{1}{2}`` for 0.5, ``\\boxed{72}``) is checked with HF's ``math-verify`` when it is installed
    (``pip install 'grpokit[math]'``), reading the model's answer as LaTeX only — its plain-expression
    reader runs sympy's ``parse_expr``, an ``eval``, which model output never reaches. Without
    math-verify those answers score 0.

    >>> math_accuracy_reward(["q"] * 3, ["<answer>72</answer>", "<answer>71</answer>", "72"], answer=["72"] * 3)
    [1.0, 0.0, 0.0]
    """
    scores = []
    for completion, reference in zip(completions, answer):
        predicted = extract_answer(text_of(completion))
        if predicted is None or not predicted.strip():
            scores.append(0.0)
        elif parse_number(predicted) is not None and parse_number(str(reference)) is not None:
            scores.append(1.0 if answers_match(predicted, reference) else 0.0)
        else:
            scores.append(1.0 if _math_verify(predicted, str(reference)) else 0.0)
    return scores


def _math_verify(predicted: str, reference: str) -> bool:
    try:
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError:
        return False
    gold = parse(reference if "$" in reference or "\\" in reference else f"${reference}$")
    guess = parse(f"${predicted.strip().strip('$')}$", extraction_config=[LatexExtractionConfig()])
    return bool(gold and guess and verify(gold, guess))
