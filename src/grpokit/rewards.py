"""Rule-based rewards (docs/math.md, "One step": rewards) and the code that calls and combines reward functions.

A reward function follows TRL's convention::

    fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]

``columns`` holds the dataset's other columns as lists aligned with ``completions`` (a prompt's
row is repeated for each of its G completions). ``None`` means "not applicable to this completion".
Rewards parse text; nothing here ever evaluates it.
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from grpokit.answers import answers_match, extract_answer, parse_number
from grpokit.arithmetic import arithmetic_steps_reward
from grpokit.config import check_reward_weights

RewardFunction = Callable[..., list]
Step = tuple[int, float]  # (character offset where a step ends, reward)

_TAG = r"</?(?:think|answer)>"
_FORMAT_RE = re.compile(
    rf"\s*<think>((?:(?!{_TAG}).)*)</think>\s*<answer>((?:(?!{_TAG}).)*)</answer>\s*", re.DOTALL
)


def format_reward(prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float]:
    """1.0 when a completion is exactly ``<think>…</think><answer>…</answer>`` (whitespace allowed
    around the blocks, no tags nested or repeated), else 0.0.

    >>> format_reward(["q"] * 3, ["<think>7+5=12</think><answer>12</answer>", "<answer>12</answer>",
    ...                           "<think>a</think><answer>1</answer><answer>2</answer>"])
    [1.0, 0.0, 0.0]
    """
    return [1.0 if _FORMAT_RE.fullmatch(c) else 0.0 for c in completions]


def accuracy_reward(
    prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any], **columns: Any
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
        predicted = extract_answer(completion)
        scores.append(1.0 if predicted is not None and answers_match(predicted, reference) else 0.0)
    return scores


def math_accuracy_reward(
    prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any], **columns: Any
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
        predicted = extract_answer(completion)
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


def builtin_rewards() -> dict[str, RewardFunction]:
    """Reward functions available by name in a config."""
    return {"accuracy": accuracy_reward, "math_accuracy": math_accuracy_reward, "format": format_reward,
            "arithmetic_steps": arithmetic_steps_reward}


class RewardError(ValueError):
    """A reward function failed or returned something unusable; the message names it."""


def reward_name(fn: RewardFunction) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def resolve_reward_functions(
    specs: Sequence[str | RewardFunction], weights: Sequence[float] | None = None
) -> tuple[list[RewardFunction], list[float]]:
    """The reward functions (names of built-in rewards — ``"accuracy"``, ``"format"``, ``"arithmetic_steps"``
    — or callables) and their weights (None: 1.0 each), checked: names unique, one weight per function."""
    functions, builtin = [], builtin_rewards()
    for spec in specs:
        if callable(spec):
            functions.append(spec)
        elif spec in builtin:
            functions.append(builtin[spec])
        else:
            raise ValueError(
                f"reward_funcs: unknown reward {spec!r}; built-in rewards are {sorted(builtin)}, "
                "or pass a callable"
            )
    names = [reward_name(fn) for fn in functions]
    if len(set(names)) != len(names):
        raise ValueError(f"reward_funcs: names must be unique, got {names}")
    check_reward_weights(weights, len(functions))
    return functions, [1.0] * len(functions) if weights is None else list(weights)


def required_columns(fn: RewardFunction) -> list[str]:
    """Keyword columns a reward function needs: its parameters after (prompts, completions) that
    have no default."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())[2:]
    except (TypeError, ValueError):  # no introspectable signature: assume it needs no column
        return []
    return [
        p.name for p in parameters
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def _short(text: str, limit: int = 120) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"… ({len(text)} characters)"


def _invoke(fn: RewardFunction, name: str, args: tuple, kwargs: dict, timeout: float | None, what: str) -> Any:
    """``fn(*args, **kwargs)``; with a timeout, in a daemon thread abandoned (not killed) if it overruns."""
    if timeout is None:
        return fn(*args, **kwargs)
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn(*args, **kwargs)
        except Exception as error:  # handed to the caller's thread
            result["error"] = error

    thread = threading.Thread(target=target, daemon=True, name=f"reward {name}")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise RewardError(f"reward function {name!r} took longer than reward_timeout={timeout} s {what}")
    if "error" in result:
        raise result["error"]
    return result["value"]


def _call(
    fn: RewardFunction, prompts: list[str], completions: list[str], columns: dict[str, list], *,
    timeout: float | None = None, on_error: str = "raise", errors: list[dict[str, Any]] | None = None,
) -> list:
    """Call one reward function on the batch. If it raises, call it on one completion at a time to find
    the culprit: ``on_error="raise"`` stops with an error naming the function, prompt and completion;
    ``"skip"`` scores the failing completions None and appends a record of each to ``errors``. A wrong
    length, or a call longer than ``timeout`` seconds, is always an error."""
    name, n = reward_name(fn), len(completions)
    try:
        values = _invoke(fn, name, (prompts, completions), columns, timeout, f"on a batch of {n} completions")
    except RewardError:
        raise
    except Exception as batch_error:
        values = []
        for i in range(n):
            single = {key: [column[i]] for key, column in columns.items()}
            try:
                value = _invoke(fn, name, ([prompts[i]], [completions[i]]), single, timeout, f"on completion {i}")
            except RewardError:
                raise
            except Exception as error:
                if on_error == "raise":
                    raise RewardError(
                        f"reward function {name!r} raised {type(error).__name__}: {error} on completion {i} "
                        f"(prompt {_short(prompts[i])}, completion {_short(completions[i])})"
                    ) from error
                if errors is not None:
                    errors.append({"function": name, "completion": i, "error": f"{type(error).__name__}: {error}"})
                values.append(None)
                continue
            if not isinstance(value, (list, tuple)) or len(value) != 1:
                raise RewardError(
                    f"reward function {name!r} returned {value!r} for 1 completion; expected a list of 1"
                ) from batch_error
            values.append(value[0])
        if on_error == "raise":  # every completion scores alone: the batch call itself is at fault
            raise RewardError(
                f"reward function {name!r} raised {type(batch_error).__name__}: {batch_error} on the batch of {n} "
                "completions, though each completion alone scores"
            ) from batch_error
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
        raise RewardError(f"reward function {name!r} returned {got} for {n} completions; expected a list of {n}")
    return list(values)


def _check_number(name: str, i: int, value: Any, prompts: list[str], completions: list[str], where: str = "") -> float:
    """A finite real number, else a RewardError naming the function, the completion (and the step)."""
    if not isinstance(value, numbers.Real):
        raise RewardError(
            f"reward function {name!r} returned {type(value).__name__} {value!r} for completion {i}{where}; "
            "expected a float or None"
        )
    if not math.isfinite(value):
        raise RewardError(
            f"reward function {name!r} returned {value} for completion {i}{where} "
            f"(prompt {prompts[i]!r}, completion {completions[i]!r})"
        )
    return float(value)


def _check_steps(name: str, i: int, value: Sequence, prompts: list[str], completions: list[str]) -> list[Step]:
    """A process reward's value for one completion: (character offset where a step ends, reward) pairs."""
    steps = []
    for j, pair in enumerate(value):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not isinstance(pair[0], numbers.Integral):
            raise RewardError(
                f"reward function {name!r}: step {j} of completion {i} is {pair!r}; expected a pair "
                "(character offset where the step ends, reward)"
            )
        offset = int(pair[0])
        if not 0 <= offset <= len(completions[i]):
            raise RewardError(
                f"reward function {name!r}: step {j} of completion {i} ends at character {offset}, outside "
                f"the completion's [0, {len(completions[i])}]"
            )
        steps.append((offset, _check_number(name, i, pair[1], prompts, completions, f", step {j}")))
    return steps


def score_completions(
    reward_funcs: Sequence[RewardFunction],
    weights: Sequence[float],
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list],
    **options: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Outcome supervision: call each reward function once on the batch; return the weighted total
    (N,) and, per function, its raw scores (N,) with NaN where it returned None.

    The total is the weighted sum over the functions that applied; a completion to which none applied
    gets 0. Any exception, wrong length, non-number or non-finite value raises :class:`RewardError`
    naming the function (and the completion, where one is at fault); so does a step list (a process
    reward), which needs :func:`score_steps`. ``options``: ``timeout``, ``on_error`` and ``errors`` of
    :func:`_call`.
    """
    total, per_function, _ = _score(reward_funcs, weights, prompts, completions, columns, steps_allowed=False,
                                    **options)
    return total, per_function


def score_steps(
    reward_funcs: Sequence[RewardFunction],
    weights: Sequence[float],
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list],
    **options: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[list[Step]]]:
    """Process supervision: every reward function's output as weighted steps per completion.

    A process reward returns, per completion, a list of ``(character offset where the step ends,
    reward)``; an outcome reward's single value becomes one step that ends with the completion
    (offset ``len(completion)``), so outcome and process rewards mix by their weights. Steps of
    several functions that end at the same offset are summed. ``None`` adds no step.

    Returns ``(total, per_function, steps)``: ``steps[i]`` sorted by offset; ``per_function[name][i]``
    is the function's outcome value or the mean of its step rewards (NaN where it gave none), and
    ``total`` their weighted sum, for logging.
    """
    return _score(reward_funcs, weights, prompts, completions, columns, steps_allowed=True, **options)


def _score(reward_funcs, weights, prompts, completions, columns, *, steps_allowed: bool, **options: Any):
    n = len(completions)
    per_function: dict[str, torch.Tensor] = {}
    total = torch.zeros(n)
    steps: list[dict[int, float]] = [{} for _ in range(n)]
    for fn, weight in zip(reward_funcs, weights):
        name = reward_name(fn)
        scores = torch.full((n,), float("nan"))
        for i, value in enumerate(_call(fn, prompts, completions, columns, **options)):
            if value is None:
                continue
            if isinstance(value, (list, tuple)):
                if not steps_allowed:
                    raise RewardError(
                        f"reward function {name!r} returned step rewards (a list) for completion {i}: it is a "
                        "process reward; set supervision: process to use it"
                    )
                pairs = _check_steps(name, i, value, prompts, completions)
                if pairs:
                    scores[i] = sum(r for _, r in pairs) / len(pairs)
            else:
                pairs = [(len(completions[i]), _check_number(name, i, value, prompts, completions))]
                scores[i] = pairs[0][1]
            for offset, reward in pairs:
                steps[i][offset] = steps[i].get(offset, 0.0) + weight * reward
        per_function[name] = scores
        total += weight * torch.nan_to_num(scores, nan=0.0)
    return total, per_function, [sorted(d.items()) for d in steps]
