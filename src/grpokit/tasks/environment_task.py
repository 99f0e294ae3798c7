"""What an environment adapter (:mod:`grpokit.tasks.environments`) hands a run: :class:`EnvironmentTask`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EnvironmentTask"]


@dataclass
class EnvironmentTask:
    """What an environment brings to a run. ``rows``: training rows, each with a ``prompt`` (a text or a list of
    chat messages, system prompt and few-shot examples included) and the columns its reward functions read;
    ``eval_rows``: held-out rows where the environment has them (else None); ``reward_funcs`` and
    ``reward_weights``: grpokit reward functions (TRL's keyword convention, :mod:`grpokit.rewards.calling`), each
    with the ``__name__`` it is logged under; ``environment_factory``: one environment object per completion (None:
    single-turn, nothing per completion)."""

    name: str
    rows: list[dict[str, Any]]
    reward_funcs: list[Callable]
    reward_weights: list[float]
    environment_factory: Callable[[], Any] | None = None
    eval_rows: list[dict[str, Any]] | None = None
    prompt_column: str = "prompt"
    answer_column: str | None = "answer"
    info: dict[str, Any] = field(default_factory=dict)  # what the adapter reports (versions, the env's class)
