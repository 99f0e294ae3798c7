"""OpenEnv environments as a run's task (``environment: openenv:TARGET``): an OpenEnv ``Environment`` (the
``openenv`` package on PyPI, meta-pytorch/OpenEnv) played one episode per completion, its step rewards the reward.

TARGET is the URL of a running OpenEnv server (``openenv:http://localhost:8000``; each episode is one WebSocket
session, through OpenEnv's own ``GenericEnvClient``) or an ``Environment`` class run in this process
(``openenv:my_package.envs:GuessEnv`` or ``openenv:path/to/file.py:GuessEnv``).

Each row is one episode: ``{"prompt": the instruction, "seed": seed + i}``. Per completion, :class:`OpenEnvEpisode`
speaks grpokit's environment protocol (:mod:`.environments`): ``reset(**row)`` resets the environment with the row's
seed (where its ``reset`` takes one) and returns the observation's text, appended to the prompt; ``reply(turn)``
steps it with the action the turn makes and returns the next observation's text, or None once the episode is done;
``end(turn)`` steps the last turn no ``reply`` saw (the final action), so that its reward counts.

A turn becomes an action as TRL's OpenEnv examples make one: the action class built from the text in its one string
field (``action_field`` names another; ``action_pattern``, a regular expression, takes its first group from the turn,
e.g. wordle's ``\\[(\\w+)\\]``). An observation's text is its ``observation_field``, else the first text field of
:data:`~grpokit.tasks.openenv_episode.TEXT_FIELDS` it has, else its one text field, else its fields as ``name: value``
lines.

Rewards: ``openenv_reward``, the episode's return (``episode_reward``: ``sum`` of the step rewards, the default, or
the ``last`` step's); with ``process_rewards: true`` instead ``openenv_steps``, a process reward (``supervision:
process``) giving each step's reward where its turn ends in the completion. ``environment_args`` (all optional):
:data:`OPTIONS`.
"""

from __future__ import annotations

import json
import numbers
import re
import typing
import urllib.error
import urllib.request
from typing import Any

from grpokit.data import DataError, refuse_unknown
from grpokit.tasks.environment_task import EnvironmentTask
from grpokit.tasks.openenv_episode import Backend, OpenEnvEpisode, OpenEnvError, openenv_reward, openenv_steps
from grpokit.user_code import load_callable

__all__ = ["OPTIONS", "OpenEnvEpisode", "OpenEnvError", "openenv_reward", "openenv_steps", "openenv_task"]

INSTALL = ("OpenEnv is not installed: pip install 'grpokit[openenv]' (or bash scripts/test_openenv.sh, which builds "
           ".venv-openenv with it)")
OPTIONS: dict[str, Any] = {
    "episodes": 64,            # training rows, one episode each, reset with seed + i
    "eval_episodes": 0,        # held-out rows, reset with seed + episodes + i (0: none)
    "prompt": "",              # the instruction each row's prompt holds; the reset observation is appended to it
    "system_prompt": None,     # given: rows are chat messages (system, then the instruction as the user's)
    "action_field": None,      # the action's field the turn's text fills (default: its one string field)
    "action_class": None,      # an in-process env's Action class by path (default: read from the env's step)
    "action_pattern": None,    # a regex: the action's text is its first group's match in the turn (else the turn)
    "observation_field": None,  # the observation's field shown to the model (default: see the module's docstring)
    "max_steps": None,         # steps after which an episode ends though the env goes on
    "episode_reward": "sum",   # openenv_reward: the sum of the step rewards, or the last one's ("last")
    "process_rewards": False,  # true: openenv_steps (each step's reward at its turn's end) replaces openenv_reward
    "missing_reward": None,    # a step without a reward is an error, unless this number stands in for it
    "env_kwargs": {},          # an in-process class's constructor keywords
    "connect_timeout": 10.0,   # seconds to reach a server
    "timeout": 60.0,           # seconds a server may take over one reset or step
}


def _openenv() -> Any:
    try:
        import openenv.core
    except ImportError:
        raise DataError(INSTALL) from None
    return openenv


def options(given: dict[str, Any]) -> dict[str, Any]:
    """``environment_args`` with the defaults filled in; an unknown one is refused with the closest name."""
    refuse_unknown(given, list(OPTIONS), "openenv", "environment_args key", "keys")
    merged = {**OPTIONS, **given}
    for key, least in (("episodes", 1), ("eval_episodes", 0)):
        if not isinstance(merged[key], int) or merged[key] < least:
            raise DataError(f"openenv: {key} must be an integer >= {least}, got {merged[key]!r}")
    if merged["episode_reward"] not in ("sum", "last"):
        raise DataError(f"openenv: episode_reward must be 'sum' or 'last', got {merged['episode_reward']!r}")
    if merged["max_steps"] is not None and (not isinstance(merged["max_steps"], int) or merged["max_steps"] < 1):
        raise DataError(f"openenv: max_steps must be a positive integer or null, got {merged['max_steps']!r}")
    if merged["missing_reward"] is not None and not isinstance(merged["missing_reward"], numbers.Real):
        raise DataError(f"openenv: missing_reward must be a number or null, got {merged['missing_reward']!r}")
    if merged["action_pattern"] is not None:
        try:
            re.compile(merged["action_pattern"])
        except re.error as error:
            raise DataError(f"openenv: action_pattern {merged['action_pattern']!r} is not a regex: {error}") from None
    return merged


# ---- building the task -------------------------------------------------------------------------------------------


def _get_json(url: str, seconds: float) -> Any:
    with urllib.request.urlopen(url, timeout=seconds) as response:
        return json.load(response)


def _server(url: str, settings: dict[str, Any]) -> Backend:
    """A running server: its health checked, its action's text field read from its /schema."""
    url = re.sub(r"^ws", "http", url.rstrip("/"))  # OpenEnv's client takes either; its HTTP routes want http
    try:
        _get_json(f"{url}/health", settings["connect_timeout"])
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        raise DataError(f"openenv: no OpenEnv server answers at {url} ({reason}). Start it first, e.g. `uvicorn "
                        "my_env.server.app:app --port 8000` where app = openenv.core.create_app(MyEnvironment, "
                        "MyAction, MyObservation, max_concurrent_envs=N), or name the Environment class to run it "
                        "in this process: openenv:my_package.module:MyEnvironment") from None
    field_name, properties = settings["action_field"], None
    try:
        schema = _get_json(f"{url}/schema", settings["connect_timeout"])["action"]
        properties = {k: v for k, v in schema.get("properties", {}).items() if k != "metadata"}
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError, AttributeError):
        if field_name is None:
            raise DataError(f"openenv: the server at {url} gives no action schema (/schema); name the action's "
                            "text field: environment_args: {action_field: NAME}") from None
    if properties is not None:
        texts = [k for k, v in properties.items() if v.get("type") == "string"]
        field_name = _pick_field(field_name, list(properties), texts, f"the action of the server at {url}")
    return Backend(name=url, action_field=field_name, settings=settings, url=url, info={"url": url})


def _pick_field(given: str | None, fields: list[str], texts: list[str], what: str) -> str:
    if given is not None:
        if given not in fields:
            raise DataError(f"openenv: action_field {given!r} is not a field of {what} (its fields: {fields})")
        return given
    if len(texts) != 1:
        raise DataError(f"openenv: {what} has {len(texts)} string fields {texts} (all fields: {fields}); name the "
                        "one the model's text fills: environment_args: {action_field: NAME}")
    return texts[0]


def _action_class(env_class: type, given: str | None) -> type:
    """The env's Action class: ``action_class`` by path, else its ``step``'s annotation, else its
    ``Environment[Action, Observation, State]`` base's first argument."""
    from openenv.core import Action
    if given is not None:
        try:
            named = load_callable(given, "environment_args.action_class")
        except ValueError as error:
            raise DataError(f"openenv: {error}") from None
        if not (isinstance(named, type) and issubclass(named, Action)):
            raise DataError(f"openenv: action_class {given!r} is {named!r}, not an OpenEnv Action class")
        return named
    try:
        hint = typing.get_type_hints(env_class.step).get("action")
    except Exception:  # an annotation that does not resolve: fall back to the generic base
        hint = None
    candidates = [hint] + [typing.get_args(base)[0] for klass in env_class.__mro__
                           for base in getattr(klass, "__orig_bases__", ()) if typing.get_args(base)]
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, Action) and candidate is not Action:
            return candidate
    raise DataError(f"openenv: cannot tell {env_class.__name__}'s Action class from its step() annotation or its "
                    "Environment[...] base; name it: environment_args: {action_class: 'module:ActionClass'}")


def _in_process(target: str, settings: dict[str, Any]) -> Backend:
    """An Environment class by path: loaded, its action class and text field found, one instance made to check."""
    from openenv.core import Environment
    try:
        env_class = load_callable(target, "environment (openenv)")
    except ValueError as error:
        raise DataError(f"openenv: {error}") from None
    if not (isinstance(env_class, type) and issubclass(env_class, Environment)):
        raise DataError(f"openenv: {target!r} is {env_class!r}, not an OpenEnv Environment class "
                        "(openenv.core.Environment's subclass)")
    action_class = _action_class(env_class, settings["action_class"])
    fields = [k for k in action_class.model_fields if k != "metadata"]
    texts = [k for k in fields if action_class.model_fields[k].annotation is str]
    field_name = _pick_field(settings["action_field"], fields, texts, f"{action_class.__name__}")
    if not isinstance(settings["env_kwargs"], dict):
        raise DataError(f"openenv: env_kwargs must be a mapping, got {settings['env_kwargs']!r}")
    try:
        env_class(**settings["env_kwargs"]).close()
    except Exception as error:
        raise DataError(f"openenv: {env_class.__name__}(**{settings['env_kwargs']}) raised "
                        f"{type(error).__name__}: {error}") from error
    return Backend(name=env_class.__name__, action_field=field_name, settings=settings, env_class=env_class,
                   action_class=action_class, info={"class": f"{env_class.__module__}.{env_class.__qualname__}",
                                                    "action_class": action_class.__name__})


def _rows(settings: dict[str, Any], first_seed: int, count: int) -> list[dict[str, Any]]:
    prompt: Any = settings["prompt"]
    if settings["system_prompt"] is not None:
        prompt = [{"role": "system", "content": settings["system_prompt"]}, {"role": "user", "content": prompt}]
    return [{"prompt": prompt, "seed": first_seed + i} for i in range(count)]


def openenv_task(target: str, args: dict[str, Any], *, seed: int) -> EnvironmentTask:
    """``environment: openenv:TARGET`` with ``environment_args`` ``args``: rows of seeds ``seed`` + i, the episode
    reward (or the per-step rewards), one :class:`OpenEnvEpisode` per completion."""
    openenv = _openenv()
    settings = options(dict(args))
    is_url = re.match(r"^(https?|wss?)://", target) is not None
    backend = _server(target, settings) if is_url else _in_process(target, settings)
    episodes = settings["episodes"]
    reward = openenv_steps if settings["process_rewards"] else openenv_reward

    def factory() -> OpenEnvEpisode:
        return OpenEnvEpisode(backend)

    return EnvironmentTask(
        name=f"openenv:{target}", rows=_rows(settings, seed, episodes), reward_funcs=[reward], reward_weights=[1.0],
        environment_factory=factory, eval_rows=_rows(settings, seed + episodes, settings["eval_episodes"]) or None,
        answer_column=None, info={"openenv": openenv.__version__, "action_field": backend.action_field,
                                  **backend.info})
