"""One episode of an OpenEnv environment per completion (:class:`OpenEnvEpisode`, grpokit's environment protocol),
on either route :mod:`grpokit.tasks.openenv` builds (a server's WebSocket session, or the class in this process), and
the rewards read from the episodes (``openenv_reward``, ``openenv_steps``)."""

from __future__ import annotations

import inspect
import json
import math
import numbers
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from grpokit.core.answers import Text, text_of

# An observation's text, where observation_field names none: the first of these it has, else its one text field.
TEXT_FIELDS = ("prompt", "message", "echoed_message", "text", "feedback", "observation", "content")


class OpenEnvError(RuntimeError):
    """An OpenEnv environment failed in an episode, or gave a step result grpokit cannot use; the message names the
    environment, the episode's seed and the call."""


# ---- the two routes: a server's WebSocket sessions, or the class in this process ---------------------------------


@dataclass
class Backend:
    """What every episode of a task shares: where the environment is, how a turn becomes an action, how rewards are
    read. ``name`` names the environment in errors (its class, or the server's URL)."""

    name: str
    action_field: str
    settings: dict[str, Any]
    env_class: type | None = None        # in-process
    action_class: type | None = None     # in-process
    url: str | None = None               # a server
    info: dict[str, Any] = field(default_factory=dict)

    def session(self) -> Any:
        return _LocalSession(self) if self.url is None else _RemoteSession(self)


class _LocalSession:
    """One instance of the class, stepped with instances of its action class; results as a server sends them."""

    def __init__(self, backend: Backend):
        self.backend, self.env = backend, None

    def reset(self, seed: int | None) -> tuple[dict[str, Any], Any, Any]:
        self.env = self.backend.env_class(**self.backend.settings["env_kwargs"])
        parameters = inspect.signature(self.env.reset).parameters.values()
        takes_seed = any(p.name == "seed" or p.kind is p.VAR_KEYWORD for p in parameters)
        return self._result(self.env.reset(seed=seed) if takes_seed else self.env.reset())

    def step(self, text: str) -> tuple[dict[str, Any], Any, Any]:
        return self._result(self.env.step(self.backend.action_class(**{self.backend.action_field: text})))

    @staticmethod
    def _result(observation: Any) -> tuple[dict[str, Any], Any, Any]:
        if not hasattr(observation, "model_dump"):  # OpenEnv's Observation is a pydantic model
            raise TypeError(f"returned {type(observation).__name__} {observation!r}, not an OpenEnv Observation")
        # As OpenEnv's server serializes it, so that both routes render and score an observation alike.
        return observation.model_dump(exclude={"reward", "done"}), observation.reward, observation.done

    def close(self) -> None:
        if self.env is not None:
            self.env.close()


class _RemoteSession:
    """One WebSocket session on the server (OpenEnv's HTTP /step is stateless: a new env per call)."""

    def __init__(self, backend: Backend):
        self.backend, self.client = backend, None

    def reset(self, seed: int | None) -> tuple[dict[str, Any], Any, Any]:
        from openenv.core import GenericEnvClient
        s = self.backend.settings
        self.client = GenericEnvClient(base_url=self.backend.url, connect_timeout_s=s["connect_timeout"],
                                       message_timeout_s=s["timeout"]).sync()
        # The server passes seed on only where the env's reset takes it.
        return self._result(self.client.reset(**({} if seed is None else {"seed": seed})))

    def step(self, text: str) -> tuple[dict[str, Any], Any, Any]:
        return self._result(self.client.step({self.backend.action_field: text}))

    @staticmethod
    def _result(result: Any) -> tuple[dict[str, Any], Any, Any]:
        return dict(result.observation or {}), result.reward, result.done

    def close(self) -> None:
        if self.client is not None:
            self.client.close()  # ends the server's session, freeing its slot for the next episode


# ---- one episode per completion ----------------------------------------------------------------------------------


def render(observation: dict[str, Any], field_name: str | None = None, where: str = "openenv") -> str:
    """An observation's text for the model: its ``field_name``, else the first of :data:`TEXT_FIELDS` it has, else
    its one text field, else its fields as ``name: value`` lines."""
    if field_name is not None:
        if field_name not in observation:
            raise OpenEnvError(f"{where}: observation_field {field_name!r} is not a field of the observation "
                               f"(its fields: {sorted(observation)})")
        value = observation[field_name]
        return value if isinstance(value, str) else json.dumps(value, default=str)
    fields = {k: v for k, v in observation.items() if k != "metadata"}
    texts = [k for k, v in fields.items() if isinstance(v, str)]
    chosen = next((k for k in TEXT_FIELDS if k in texts), texts[0] if len(texts) == 1 else None)
    if chosen is not None:
        return fields[chosen]
    return "\n".join(f"{k}: {v if isinstance(v, str) else json.dumps(v, default=str)}" for k, v in fields.items())


class OpenEnvEpisode:
    """One completion's episode of an OpenEnv environment, in grpokit's environment protocol. Its public methods
    are the protocol's only: any other would be a tool the model could call. What it recorded is in attributes (not
    methods, so no tools): ``observations`` (each result's fields, the reset's first), ``rewards`` and ``dones``
    (each step's), ``turns`` (the text each step was made from), ``messages`` (the texts ``reply`` returned, each
    after its turn), ``done``, ``ended``; and ``episode_reward``."""

    def __init__(self, backend: Backend):
        self._backend, self._session, self.seed = backend, None, None
        self.observations: list[dict[str, Any]] = []
        self.rewards: list[float] = []
        self.dones: list[bool] = []
        self.turns: list[str] = []
        self.messages: list[str] = []
        self.done = self.ended = False

    def reset(self, seed: int | None = None, **row: Any) -> str | None:
        if self._session is not None:  # reset again: the episode before it is over
            self._finish()
        self.__init__(self._backend)
        self.seed, self._session = seed, self._backend.session()
        observation, _, done = self._call(f"reset(seed={seed})", lambda: self._session.reset(seed))
        self.observations.append(observation)
        self.done = self._check_done(done, "reset")
        return self._render(observation) or None

    def reply(self, turn: str) -> str | None:
        if self.done:
            return None
        observation = self._step(turn)
        limit = self._backend.settings["max_steps"]
        if self.done or (limit is not None and len(self.rewards) >= limit):
            self._finish()
            return None
        self.messages.append(self._render(observation))
        return self.messages[-1]

    def end(self, turn: str | None) -> None:
        if turn is not None and not self.done and not self.ended:
            self._step(turn)
        self._finish()

    @property
    def episode_reward(self) -> float | None:
        """The episode's return (``episode_reward``: the sum, or the last step's); None before any step."""
        if not self.rewards:
            return None
        return sum(self.rewards) if self._backend.settings["episode_reward"] == "sum" else self.rewards[-1]

    def _step(self, turn: str) -> dict[str, Any]:
        if self._session is None:
            when = "after the episode ended" if self.ended else "before reset"
            raise OpenEnvError(f"{self._where()}: a turn came {when}")
        pattern = self._backend.settings["action_pattern"]
        found = re.search(pattern, turn, flags=re.S) if pattern else None
        # the first group that matched (the whole match for a pattern without groups); no match: the whole turn
        text = next((g for g in found.groups() if g is not None), found.group(0)) if found else turn
        shown = text if len(text) <= 80 else text[:80] + "…"
        observation, reward, done = self._call(f"step({self._backend.action_field}={shown!r})",
                                               lambda: self._session.step(text))
        where = f"step {len(self.rewards) + 1}"
        self.observations.append(observation)
        self.rewards.append(self._check_reward(reward, where))
        self.dones.append(self._check_done(done, where))
        self.turns.append(turn)
        self.done = self.dones[-1]
        return observation

    def _finish(self) -> None:
        """The episode's end: its session closed (a server's slot freed), quietly: its rewards are recorded."""
        session, self._session, self.ended = self._session, None, True
        if session is not None:
            try:
                session.close()
            except Exception as error:
                warnings.warn(f"{self._where()}: close() raised {type(error).__name__}: {error}", stacklevel=2)

    def __del__(self) -> None:
        """An episode dropped unended (its rollout stopped by another episode's error) frees its session; not while
        the interpreter exits: OpenEnv's client closes on its event loop's thread, which finalisation has stopped
        (its close would wait forever), and the process's exit closes the socket, which ends the session as well."""
        if getattr(self, "_session", None) is None or sys.is_finalizing():
            return
        try:
            self._session.close()
        except Exception:
            pass

    def _render(self, observation: dict[str, Any]) -> str:
        return render(observation, self._backend.settings["observation_field"], self._where())

    def _where(self) -> str:
        return f"openenv {self._backend.name}, episode seed {self.seed}"

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the session. A failure closes the session first (a refused or broken session then holds
        nothing, so the run that stops here leaves nothing for its exit to close), then is raised naming the
        environment, the episode and the call."""
        try:
            return fn()
        except Exception as error:
            self._finish()
            if isinstance(error, OpenEnvError):
                raise
            hint = ""
            if "CAPACITY_REACHED" in str(error):
                hint = ("; the server holds fewer sessions than a rollout's episodes (one per completion): "
                        "create_app(..., max_concurrent_envs=N) with N >= prompts_per_step x num_generations, for "
                        "an Environment with SUPPORTS_CONCURRENT_SESSIONS = True")
            raise OpenEnvError(f"{self._where()}: {what} raised {type(error).__name__}: {error}{hint}") from error

    def _check_reward(self, reward: Any, where: str) -> float:
        if reward is None and self._backend.settings["missing_reward"] is not None:
            return float(self._backend.settings["missing_reward"])
        if reward is None:
            raise OpenEnvError(f"{self._where()}: {where} gave no reward (None); set environment_args "
                               "missing_reward (e.g. 0) for an environment that rewards some steps only")
        if not isinstance(reward, numbers.Real) or not math.isfinite(reward):
            raise OpenEnvError(f"{self._where()}: {where} gave the reward {reward!r} "
                               f"({type(reward).__name__}); expected a finite number")
        return float(reward)

    def _check_done(self, done: Any, where: str) -> bool:
        if not isinstance(done, bool):
            raise OpenEnvError(f"{self._where()}: {where} gave done={done!r} ({type(done).__name__}); "
                               "expected a bool")
        return done


# ---- rewards -----------------------------------------------------------------------------------------------------


def _finished(completions: Sequence[Text], environments: Sequence[Any]) -> list[Any]:
    """Each completion's episode, ended: one the rollout did not end (a single-turn rollout calls neither ``reply``
    nor ``end``) takes the whole completion as its final turn."""
    for completion, episode in zip(completions, environments):
        if not episode.ended:
            episode.end(None if episode.turns else text_of(completion))
    return list(environments)


def openenv_reward(completions: Sequence[Text], environments: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """Each completion's episode return (None for an episode without a step)."""
    return [episode.episode_reward for episode in _finished(completions, environments)]


_warned: set[str] = set()


def turn_ends(completion: str, turns: Sequence[str], messages: Sequence[str] = ()) -> list[int]:
    """Where each turn ends in the completion's text: the turns in order, ``messages[i]`` (the environment's text
    after turn i) between them. Each turn is found after the message before it, as written or stripped of
    surrounding space; one not found (its tokens decoded otherwise) ends with the completion, warned once."""
    ends, start = [], 0
    for i, turn in enumerate(turns):
        at, text = completion.find(turn, start), turn
        if at < 0 and turn.strip():
            text = turn.strip()
            at = completion.find(text, start)
        if at < 0:
            if "turn" not in _warned:
                _warned.add("turn")
                warnings.warn(f"openenv_steps: a turn ({turn[:60]!r}) is not in its completion's text; its step's "
                              "reward is placed at the completion's end (warned once)", stacklevel=2)
            ends.append(len(completion))
            continue
        start = at + len(text)
        ends.append(start)
        # Past the environment's message, so that the next turn is not found inside it (a guess the hint repeats).
        message = messages[i].strip() if i < len(messages) and messages[i] else ""
        after = completion.find(message, start) if message else -1
        start = after + len(message) if after >= 0 else start
    return ends


def openenv_steps(completions: Sequence[Text], environments: Sequence[Any], **kwargs: Any
                  ) -> list[list[tuple[int, float]]]:
    """A process reward: each step's reward at the character where its turn ends in the completion."""
    return [list(zip(turn_ends(text_of(completion), episode.turns, episode.messages), episode.rewards))
            for completion, episode in zip(completions, _finished(completions, environments))]
