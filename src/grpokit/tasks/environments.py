"""Environments from other libraries as a run's task: ``environment: verifiers:NAME`` (an installed verifiers
environment, :mod:`.verifiers`) or ``environment: openenv:TARGET`` (an OpenEnv server's URL, or an in-process
``Environment`` class given by path, :mod:`.openenv`), with ``environment_args`` (a mapping) passed on.

Each adapter turns the library's environment into an :class:`EnvironmentTask`: the rows to train (and evaluate) on,
the reward functions, and an ``environment_factory`` making one environment object per completion. That object speaks
grpokit's environment protocol (TRL's ``environment_factory`` protocol, extended for multi-turn episodes):

- ``reset(**row) -> str | None``: the episode starts from its row; a returned text (an observation) is appended to
  the prompt (a conversational prompt's last user message), as in TRL.
- public methods (but ``reset``, ``reply``, ``end``, ``reward``, ``get_reward``) are tools the model may call, as in
  TRL (:mod:`grpokit.rollout.tools`).
- ``reply(turn: str) -> str | None`` (optional, multi-turn): called each time the model ends a turn with a stop
  token, with that turn's text; a text is the environment's next message (inserted as a user turn of the chat
  template, tokens masked from the loss) and the model writes its next turn; None ends the episode. Without it, an
  episode is one turn.
- ``end(turn: str | None) -> None`` (optional): called once per episode, after the rollout, with the text of the
  model's last turn if no ``reply`` saw it (the completion ran out of tokens, or of turns), else None.
- ``get_reward()`` / ``reward()`` (optional): the environment's own score of its episode (TRL's convention),
  logged under the environment's class name.

Calls to ``reset``, ``reply`` and tools run in a thread pool, concurrently for the whole batch, while the rows that
are not waiting keep decoding (docs/environments.md). Reward functions that take ``environments`` get each
completion's environment object, after its episode.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

# The adapters import EnvironmentTask from its own module: imported from here, they and this dispatch would import
# each other (tests/test_layers.py refuses the cycle).
from grpokit.tasks.environment_task import EnvironmentTask

__all__ = ["EnvironmentTask", "ENVIRONMENT_KINDS", "load_environment_task"]


def _verifiers(target: str, args: Mapping[str, Any], seed: int) -> EnvironmentTask:
    from grpokit.tasks.verifiers import verifiers_task
    return verifiers_task(target, dict(args), seed=seed)


def _openenv(target: str, args: Mapping[str, Any], seed: int) -> EnvironmentTask:
    from grpokit.tasks.openenv import openenv_task
    return openenv_task(target, dict(args), seed=seed)


ENVIRONMENT_KINDS: dict[str, Callable[[str, Mapping[str, Any], int], EnvironmentTask]] = {
    "verifiers": _verifiers, "openenv": _openenv}


def load_environment_task(spec: str, args: Mapping[str, Any] | None = None, *, seed: int = 0) -> EnvironmentTask:
    """``KIND:TARGET`` → its :class:`EnvironmentTask` (errors name the spec and the fix)."""
    kind, _, target = spec.partition(":")
    if kind not in ENVIRONMENT_KINDS or not target:
        raise ValueError(f"environment: {spec!r} is not KIND:TARGET with KIND one of {sorted(ENVIRONMENT_KINDS)} "
                         "(e.g. 'verifiers:wordle', 'openenv:http://localhost:8000', "
                         "'openenv:my_package.server:MyEnvironment')")
    return ENVIRONMENT_KINDS[kind](target, args or {}, seed)
