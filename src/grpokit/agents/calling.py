"""A user's agent: loading it, checking its signature against the data, and reading what an episode returned.

An agent is ``async def agent(client: openai.AsyncOpenAI, model: str, **row) -> float | dict[str, float]`` (a plain
``def`` gets an ``openai.OpenAI`` client and runs in a thread). The row's columns come by keyword, as reward functions
get them: all of them with ``**row``, else the ones it names. It returns the episode's reward, or named rewards.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from grpokit.config import ConfigError
from grpokit.config.grpo_checks import check_agent_config
from grpokit.rollout.episodes import EnvironmentFailure
from grpokit.user_code import load_callable

RESERVED = ("client", "model")  # what every agent gets besides the row's columns


class AgentError(EnvironmentFailure):
    """An agent's episode failed (it raised, overran ``agent_timeout``, returned no reward, or made no request to the
    policy); the message names the agent, the row and the episode. A run stops on it as on an environment's failure:
    the step is taken back and the steps done are checkpointed."""


def agent_name(agent: Callable) -> str:
    """The agent's name in messages and metrics (a float reward is logged as ``rewards/<name>``)."""
    return getattr(agent, "__name__", None) or type(agent).__name__


def load_agent(spec: str | Callable) -> Callable:
    """The ``agent`` config key (``FILE.py:NAME`` or ``package.module:NAME``) or a callable, checked to take a client
    and a model."""
    agent = spec if callable(spec) else load_callable(spec, "agent")
    try:
        parameters = inspect.signature(agent).parameters
    except (TypeError, ValueError):
        return agent  # a builtin or C callable: its call says
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    missing = [name for name in RESERVED if name not in parameters and not takes_any]
    if missing:
        raise ConfigError(f"agent {agent_name(agent)!r} must take {', '.join(missing)} (it is called as "
                          f"agent(client=..., model=..., **row)); its parameters are {list(parameters)}")
    return agent


def agent_of(config: Any, agent: Callable | None, tools: Sequence | None = None,
             environment_factory: Callable | None = None, environment: bool = False) -> Callable | None:
    """The run's agent (``agent=`` in Python, else the config's ``agent`` key), loaded and checked against the rest
    of the run's settings; None without one. ``environment``: the agent is the config's ``environment``'s."""
    if agent is None and config.agent is None:
        return None
    if tools or environment_factory is not None:
        raise ConfigError("tools= and environment_factory= run inside grpokit's own episodes; an agent drives its own: "
                          "pass one or the other")
    check_agent_config(config, environment)
    missing = [name for name in ("fastapi", "uvicorn", "openai", "httpx") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"an agent is served the policy over OpenAI's API, which needs {', '.join(missing)}: "
                          "pip install 'grpokit[serve]'")
    return load_agent(agent if agent is not None else config.agent)


def agent_columns(agent: Callable, columns: Sequence[str], source: str) -> list[str]:
    """The dataset columns ``agent`` is given (all with ``**row``, else those it names), checked: a column named
    ``client`` or ``model`` would collide, and a parameter without a default must be a column."""
    clash = [c for c in columns if c in RESERVED]
    if clash:
        raise ConfigError(f"{source}: column {clash[0]!r} has the name of what every agent is given (client, model); "
                          "rename it (dataset_columns: {old: new})")
    try:
        parameters = inspect.signature(agent).parameters
    except (TypeError, ValueError):
        return list(columns)
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return list(columns)
    needed = [name for name, p in parameters.items() if name not in RESERVED and p.default is p.empty
              and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    absent = [name for name in needed if name not in columns]
    if absent:
        raise ConfigError(f"agent {agent_name(agent)!r} takes {absent[0]!r}, which is not a column of {source} "
                          f"(its columns: {list(columns)}); give it a default, or take **row")
    return [c for c in columns if c in parameters]


def episode_rewards(value: Any, agent: Callable, where: str) -> dict[str, float]:
    """What an episode returned, as named rewards: a number is named after the agent; a dict's values must be numbers
    (bools count as 0/1), all finite. ``where``: the row and episode, for the message."""
    name = agent_name(agent)
    if isinstance(value, Mapping):
        if not value:
            raise AgentError(f"agent {name!r} returned an empty dict ({where}); return a number or named numbers")
        rewards = dict(value)
    elif isinstance(value, numbers.Real):
        rewards = {name: value}
    else:
        raise AgentError(f"agent {name!r} returned {type(value).__name__} {_short(value)} ({where}); return the "
                         "episode's reward as a number, or a dict of named rewards")
    out = {}
    for key, reward in rewards.items():
        if not isinstance(key, str) or not isinstance(reward, numbers.Real):
            raise AgentError(f"agent {name!r} returned {{{key!r}: {_short(reward)}}} ({where}); named rewards map "
                             "names (str) to numbers")
        if not math.isfinite(float(reward)):
            raise AgentError(f"agent {name!r} returned reward {key!r} = {reward} ({where}); rewards must be finite")
        out[key] = float(reward)
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
