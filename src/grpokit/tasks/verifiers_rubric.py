"""A verifiers environment's rubric as grpokit reward functions (:mod:`grpokit.tasks.verifiers`): one per rubric
function, a RubricGroup's flattened, logged under the function's name and weighted by its weight (verifiers' metrics,
weight 0, are logged and reward nothing). Each is called as verifiers' ``Rubric`` calls it — the keywords of
``rubric.score_objects(state)`` its signature takes (``completion``, ``answer``, ``state``, ``parser``, ``prompt``,
``info``, ``task``, the row's other columns), a group function (plural keywords, or a list returned) with
``rubric.group_score_objects`` over the states of one ``example_id`` — so the score grpokit logs is verifiers' own.
"""

from __future__ import annotations

import asyncio
import inspect
import numbers
from collections.abc import Callable, Sequence
from typing import Any

from grpokit.rewards.calling import RewardError

RAISED = object()  # what a rubric function that raised gives: verifiers scores it 0


def _rubric_functions(vf: Any, rubric: Any) -> list[tuple[Any, Callable, float]]:
    """(rubric, function, weight) of every function that scores, a RubricGroup's flattened: each is called with
    its own rubric's objects (its parser), as RubricGroup.score_rollout does; a group's own funcs score nothing."""
    if isinstance(rubric, vf.RubricGroup):
        return [entry for inner in rubric.rubrics for entry in _rubric_functions(vf, inner)]
    return [(rubric, fn, float(w)) for fn, w in zip(rubric.funcs, rubric.weights)]


def _call_objects(fn: Callable, objects: dict[str, Any]) -> dict[str, Any]:
    """What verifiers passes: all ``objects`` to a function taking ``**kwargs``, else those it names."""
    parameters = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return objects
    return {key: value for key, value in objects.items() if key in parameters}


def _reward_function(adapter: Any, rubric: Any, fn: Callable, name: str) -> Callable:
    """A grpokit reward function scoring each completion's episode with the rubric function ``fn``."""
    group = rubric._is_group_func(fn)  # verifiers' own test (plural keywords, or a list returned)

    async def call(objects: dict[str, Any]) -> Any:
        try:
            value = fn(**_call_objects(fn, objects))
            return await value if inspect.isawaitable(value) else value
        except Exception as error:  # verifiers' Rubric scores a raising function 0 (and logs it)
            adapter.warn(name, f"rubric function {name!r} raised {type(error).__name__}: {error}; it scores 0, as "
                         "in verifiers")
            return RAISED

    async def score(states: list[Any]) -> list[Any]:
        if not group:
            return list(await asyncio.gather(*(call(rubric.score_objects(state)) for state in states)))
        by_example: dict[Any, list[int]] = {}
        for i, state in enumerate(states):
            by_example.setdefault(state.get("example_id"), []).append(i)
        values: list[Any] = [None] * len(states)
        for members in by_example.values():
            got = await call(rubric.group_score_objects([states[i] for i in members]))
            got = [RAISED] * len(members) if got is RAISED else got
            if not isinstance(got, (list, tuple)) or len(got) != len(members):
                raise RewardError(f"rubric function {name!r} (a group function) of verifiers environment "
                                  f"{adapter.name!r} returned {got!r} for a group of {len(members)}; expected a list "
                                  f"of {len(members)} numbers")
            for i, value in zip(members, got):
                values[i] = value
        return values

    def reward(completions: Sequence[Any], **columns: Any) -> list[float]:
        episodes = adapter.episodes(completions, columns)
        values = adapter.loop.run(score([episode.state for episode in episodes]))
        scores = []
        for i, value in enumerate(values):
            if value is RAISED:  # 0, as verifiers scores a function that raised
                scores.append(0.0)
            elif isinstance(value, numbers.Real) or (hasattr(value, "__float__") and not isinstance(value, str)):
                scores.append(float(value))
            else:
                raise RewardError(f"rubric function {name!r} of verifiers environment {adapter.name!r} returned "
                                  f"{type(value).__name__} {value!r:.80} for completion {i}; a rubric function "
                                  "returns a number (a group function, a list of them)")
        return scores

    reward.__name__ = reward.__qualname__ = name
    reward.__doc__ = f"verifiers rubric function {name!r} of environment {adapter.name!r}"
    return reward


def rubric_rewards(vf: Any, rubric: Any, adapter: Any) -> tuple[list[Callable], list[float]]:
    """The reward functions and weights of ``rubric``, scoring the episodes ``adapter.episodes`` gives, on its
    ``adapter.loop``. Names repeated (across a RubricGroup's rubrics) are numbered: grpokit logs each apart."""
    funcs, weights, seen = [], [], set()
    for inner, fn, weight in _rubric_functions(vf, rubric):
        base = logged = getattr(fn, "__name__", type(fn).__name__)
        k = 1
        while logged in seen:
            k += 1
            logged = f"{base}_{k}"
        seen.add(logged)
        funcs.append(_reward_function(adapter, inner, fn, logged))
        weights.append(weight)
    return funcs, weights
