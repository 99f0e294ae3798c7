"""Calling reward functions (docs/math.md, "One step": rewards): checking their signatures against the data, calling
them as TRL does, checking what they return, and combining them, outcome and per step. The built-in rule rewards are
:mod:`grpokit.rewards.builtin`'s; names in a config are resolved by :mod:`grpokit.resolve`.

Reward functions are called as TRL calls them, by keyword::

    fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., **columns) -> list[float | None]

``prompts``: each completion's prompt as the dataset holds it (text, or a list of chat messages);
``completions``: the decoded text, or for a conversational prompt ``[{"role": "assistant", "content":
text}]``; ``completion_ids``: the sampled token ids; ``trainer_state``: :class:`TrainerState`; every
other dataset column under its own name (the answer column also as ``answer``). All lists are aligned
with the completions (a prompt's row repeats for its G completions). A function receives the keywords
it names, or all of them with ``**kwargs``. ``None`` means "not applicable to this completion".
Rewards parse text; nothing here ever evaluates it.
"""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from grpokit.core.answers import Text, text_of
from grpokit.user_code import Overran, call_with_timeout

RewardFunction = Callable[..., list]
Step = tuple[int, float]  # (character offset where a step ends, reward)
# What every reward function may take besides the dataset's columns (log_extra, log_metric: TRL's, below).
REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


@dataclass
class RewardLog:
    """What reward functions log through TRL's ``log_metric(name, value)`` (scalars: a step's metric is their mean)
    and ``log_extra(column, values)`` (one value per completion: columns of completions.jsonl)."""

    metrics: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, list[Any]] = field(default_factory=dict)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(str(name), []).append(float(value))

    def log_extra(self, column: str, values: Sequence[Any]) -> None:
        self.extra.setdefault(str(column), []).extend(values)

    def metric_means(self, taken: Iterable[str]) -> dict[str, float]:
        """Each logged metric's mean, under its name, or ``logged/NAME`` where ``taken`` (the step's own metrics) has
        the name."""
        taken = set(taken)
        return {name if name not in taken else f"logged/{name}": sum(values) / len(values)
                for name, values in self.metrics.items()}

    @staticmethod
    def merge(logs: Sequence[RewardLog | None]) -> RewardLog:
        merged = RewardLog()
        for log in (log for log in logs if log is not None):
            for name, values in log.metrics.items():
                merged.metrics.setdefault(name, []).extend(values)
            for column, values in log.extra.items():
                merged.extra.setdefault(column, []).extend(values)
        return merged
FLOAT32_MAX = torch.finfo(torch.float32).max  # the largest reward a score tensor holds


@dataclass(frozen=True)
class TrainerState:
    """The part of TRL's ``trainer_state`` that reward functions read: optimizer steps done before this
    one, the run's total, and the data epoch (1 during the first pass over the dataset)."""

    global_step: int = 0
    max_steps: int = 0
    epoch: int = 0

class RewardError(ValueError):
    """A reward function failed or returned something unusable; the message names it."""


def reward_name(fn: RewardFunction) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def accepted_keywords(fn: RewardFunction) -> set[str] | None:
    """The keywords ``fn`` can be called with; None when it takes any (``**kwargs``) or cannot be inspected."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def check_reward_functions(
    reward_funcs: Sequence[RewardFunction], columns: Iterable[str], source: str
) -> list[str]:
    """Check, before any model loads, that each function can be called with what it will be passed
    (:data:`REWARD_ARGUMENTS` and the dataset's ``columns``, as keywords); return the columns they
    require, for the caller to check row by row. Errors name the function and the parameter."""
    columns = list(columns)
    clash = [c for c in columns if c in REWARD_ARGUMENTS]
    if clash:
        raise ValueError(f"{source}: column {clash[0]!r} has the name of an argument every reward function is "
                         f"passed ({', '.join(REWARD_ARGUMENTS)}); rename the column")
    passed = [*REWARD_ARGUMENTS, *columns]
    required: list[str] = []
    for fn in reward_funcs:
        name = reward_name(fn)
        try:
            parameters = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # no introspectable signature: nothing to check
            continue
        for p in parameters:
            if p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            if p.kind is p.POSITIONAL_ONLY:
                raise ValueError(
                    f"reward function {name!r} takes {p.name!r} by position only; reward functions are called by "
                    f"keyword ({', '.join(REWARD_ARGUMENTS)}, and each column by name), as in TRL"
                )
            if p.name not in passed:
                close = difflib.get_close_matches(p.name, passed, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"reward function {name!r} needs {p.name!r}, which is neither a reward argument "
                    f"({', '.join(REWARD_ARGUMENTS)}) nor a column of {source} (its columns: {sorted(columns)}){hint}"
                )
            if p.name not in REWARD_ARGUMENTS:
                required.append(p.name)
    return list(dict.fromkeys(required))


def _short(text: str, limit: int = 120) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"… ({len(text)} characters)"


def _invoke(fn: RewardFunction, name: str, kwargs: dict, timeout: float | None, what: str) -> Any:
    """``fn(**kwargs)``; with a timeout, in a daemon thread abandoned (not killed) if it overruns."""
    try:
        return call_with_timeout(fn, kwargs, timeout, f"reward {name}")
    except Overran:
        raise RewardError(f"reward function {name!r} took longer than reward_timeout={timeout} s {what}") from None


def _call(
    fn: RewardFunction, arguments: dict[str, list], shared: dict[str, Any], *,
    timeout: float | None = None, on_error: str = "raise", errors: list[dict[str, Any]] | None = None,
) -> list:
    """Call one reward function on the batch: ``arguments`` (name → one value per completion, ``prompts``
    and ``completions`` among them) and ``shared`` (the same for all), each keyword passed when ``fn``
    takes it. If it raises, call it on one completion at a time to find the culprit:
    ``on_error="raise"`` stops with an error naming the function, prompt and completion; ``"skip"``
    scores the failing completions None and appends a record of each to ``errors``. A wrong length, or
    a call longer than ``timeout`` seconds, is always an error."""
    name, n = reward_name(fn), len(arguments["completions"])
    accepted = accepted_keywords(fn)
    passed = {k: v for k, v in arguments.items() if accepted is None or k in accepted}
    shared = {k: v for k, v in shared.items() if accepted is None or k in accepted}
    try:
        values = _invoke(fn, name, {**passed, **shared}, timeout, f"on a batch of {n} completions")
    except RewardError:
        raise
    except Exception as batch_error:
        values = []
        for i in range(n):
            single = {key: [column[i]] for key, column in passed.items()}
            try:
                value = _invoke(fn, name, {**single, **shared}, timeout, f"on completion {i}")
            except RewardError:
                raise
            except Exception as error:
                if on_error == "raise":
                    raise RewardError(
                        f"reward function {name!r} raised {type(error).__name__}: {error} on completion {i}"
                        f"{_which(arguments, i)}"
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


def _which(arguments: dict[str, list], i: int) -> str:
    """`` (prompt …, completion …)`` for an error message, from what the function was passed."""
    prompt, completion = (_short(str(text_of(arguments[key][i]))) for key in ("prompts", "completions"))
    return f" (prompt {prompt}, completion {completion})"


def _check_number(name: str, i: int, value: Any, prompts: list[str], completions: list[str], where: str = "") -> float:
    """A finite real number, else a RewardError naming the function, the completion (and the step)."""
    if not isinstance(value, numbers.Real):
        raise RewardError(
            f"reward function {name!r} returned {type(value).__name__} {value!r} for completion {i}{where}; "
            "expected a float or None"
        )
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:  # rewards are float32 tensors: 1e39 would be inf
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


def score_completions(reward_funcs: Sequence[RewardFunction], weights: Sequence[float], prompts: list[Text],
                      completions: list[str], columns: dict[str, list],
                      **options: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Outcome supervision: call each reward function once on the batch; return the weighted total
    (N,) and, per function, its raw scores (N,) with NaN where it returned None.

    ``prompts`` (as the dataset holds them), ``completions`` (decoded text), ``columns`` (name → one
    value per completion), ``completion_ids`` and ``trainer_state`` reach each function as keywords
    (this module's docstring); a completion of a conversational prompt as an assistant message, or, with
    tools, as ``messages[i]`` (the assistant's turns and the tool results between them).

    The total is the weighted sum over the functions that applied; a completion to which none applied
    gets 0. Any exception, wrong length, non-number or non-finite value raises :class:`RewardError`
    naming the function (and the completion, where one is at fault); so does a step list (a process
    reward), which needs :func:`score_steps`. ``options``: the keywords ``completion_ids``, ``trainer_state`` and
    ``messages`` above, ``log`` (a :class:`RewardLog`), and ``timeout``, ``on_error`` and ``errors`` of :func:`_call`.
    """
    total, per_function, _ = _score(reward_funcs, weights, prompts, completions, columns, steps_allowed=False,
                                    **options)
    return total, per_function


def score_steps(reward_funcs: Sequence[RewardFunction], weights: Sequence[float], prompts: list[Text],
                completions: list[str], columns: dict[str, list],
                **options: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[list[Step]]]:
    """Process supervision: every reward function's output as weighted steps per completion.

    A process reward returns, per completion, a list of ``(character offset where the step ends,
    reward)``; an outcome reward's single value becomes one step that ends with the completion
    (offset ``len(completion)``), so outcome and process rewards mix by their weights. Steps of
    several functions that end at the same offset are summed. ``None`` adds no step.

    Returns ``(total, per_function, steps)``: ``steps[i]`` sorted by offset; ``per_function[name][i]``
    is the function's outcome value or the mean of its step rewards (NaN where it gave none), and
    ``total`` their weighted sum, for logging. The arguments reach the functions as in
    :func:`score_completions`; offsets count characters of the completion's text.
    """
    return _score(reward_funcs, weights, prompts, completions, columns, steps_allowed=True, **options)


def _score(
    reward_funcs: Sequence[RewardFunction], weights: Sequence[float], prompts: list[Text], completions: list[str],
    columns: dict[str, list], *, steps_allowed: bool, completion_ids: list[list[int]] | None = None,
    trainer_state: TrainerState | None = None, messages: list[list[dict[str, Any]]] | None = None, **options: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[list[Step]]]:
    """Both supervisions' scoring (:func:`score_completions`, :func:`score_steps`); ``options``: ``log`` (a
    :class:`RewardLog`) and ``timeout``, ``on_error`` and ``errors`` of :func:`_call`."""
    n = len(completions)
    # As TRL passes them: a conversational prompt's completion as the assistant's message (with tools, its
    # messages: the assistant's turns and the tool results).
    as_passed = [(messages[i] if messages is not None else [{"role": "assistant", "content": c}])
                 if isinstance(p, list) else c for i, (p, c) in enumerate(zip(prompts, completions))]
    arguments = {**columns, "prompts": list(prompts), "completions": as_passed}
    if completion_ids is not None:
        arguments["completion_ids"] = completion_ids
    shared: dict[str, Any] = {} if trainer_state is None else {"trainer_state": trainer_state}
    log = options.pop("log", None) or RewardLog()  # TRL's logging hooks; without a log, what they get is dropped
    shared.update(log_metric=log.log_metric, log_extra=log.log_extra)
    per_function: dict[str, torch.Tensor] = {}
    total = torch.zeros(n)
    steps: list[dict[int, float]] = [{} for _ in range(n)]
    for fn, weight in zip(reward_funcs, weights):
        name = reward_name(fn)
        scores = torch.full((n,), float("nan"))
        for i, value in enumerate(_call(fn, arguments, shared, **options)):
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
