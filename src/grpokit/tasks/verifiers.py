"""verifiers environments as a run's task (``environment: verifiers:NAME``, ``environment_args`` going to its
``load_environment``): its dataset as rows, its rubric as reward functions, and one episode object per completion
holding verifiers' ``state`` (:mod:`grpokit.tasks.environments` describes the protocol). This speaks verifiers' v0 API
(``load_environment``, ``SingleTurnEnv``, ``MultiTurnEnv``, ``Rubric``, ``RubricGroup``, the parsers), which 0.3.x
serves (0.3.1 from ``verifiers.legacy``, at the same names). verifiers 0.4 replaced it (``verifiers.v1``): its
environments run as agents (:mod:`grpokit.agents.verifiers_v1`), and this adapter, finding 0.4, says so. Refused by
name: a v1 taskset under 0.3 (which holds a preview of v1) and ``ToolEnv`` (tool calls in OpenAI's format).

In place of verifiers' rollout loop (``MultiTurnEnv.rollout``), step by step the same calls:
``reset`` runs ``init_state`` and ``setup_state``; each assistant turn goes in through ``add_model_response`` (as a
``Response`` holding the turn's text), then ``is_completed``, then ``get_prompt_messages`` (which calls
``env_response``), whose new messages are the text the model sees next; ``end`` records a last turn and runs the
environment's cleanup handlers, which render ``state["completion"]``. The rubric's functions then score that state
as verifiers would (:mod:`grpokit.tasks.verifiers_rubric`): a function that raises scores 0, as in verifiers (warned
once); one that returns no number is an error naming it.

verifiers is asynchronous: its coroutines run on one event loop per task, in a thread of its own, so that the episodes
grpokit's rollout drives from worker threads run concurrently there, as verifiers' own rollouts would.
"""

from __future__ import annotations

import asyncio
import inspect
import signal
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

from grpokit.rewards.calling import REWARD_ARGUMENTS
from grpokit.tasks.environment_task import EnvironmentTask
from grpokit.tasks.verifiers_rubric import rubric_rewards

__all__ = ["VerifiersError", "verifiers_task"]

SUPPORTED = "0.3.x"
INSTALL = ("verifiers is not installed: pip install 'grpokit[verifiers]' (or bash scripts/test_verifiers.sh, which "
           "builds .venv-verifiers with it)")


class VerifiersError(ValueError):
    """verifiers, or one of its environments, cannot serve the run; the message names what and the fix."""


def _verifiers() -> Any:
    """The verifiers module, checked to speak the v0 API (0.3.x)."""
    try:
        import verifiers
    except ImportError:
        raise VerifiersError(INSTALL) from None
    version = getattr(verifiers, "__version__", "unknown")
    major_minor = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    if major_minor == (0, 4):  # its environments call the model themselves: they run as agents, elsewhere
        raise VerifiersError(f"verifiers {version} is installed: its environments (its v1 API: tasksets, harnesses) "
                             "run as agents against grpokit's policy server, through "
                             "grpokit.agents.verifiers_v1.verifiers_v1_task; this adapter (grpokit.tasks.verifiers) "
                             f"speaks verifiers {SUPPORTED}'s v0 API (load_environment, SingleTurnEnv, MultiTurnEnv, "
                             "Rubric): for it, pip install 'verifiers>=0.3,<0.4'")
    if major_minor != (0, 3):
        raise VerifiersError(f"verifiers {version} is installed; grpokit's adapter speaks verifiers' v0 API "
                             f"(load_environment, SingleTurnEnv, MultiTurnEnv, Rubric), which verifiers {SUPPORTED} "
                             "serves (0.4's v1 API runs through grpokit.agents.verifiers_v1): pip install "
                             "'verifiers>=0.3,<0.4'")
    return verifiers


class _Loop:
    """One event loop in a daemon thread: coroutines submitted from any other thread run there, concurrently."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, coroutine: Any) -> Any:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="grpokit-verifiers", daemon=True)
                self._thread.start()
        if threading.current_thread() is self._thread:  # waiting on our own loop would never return
            coroutine.close()
            raise RuntimeError("a verifiers coroutine asked, from the adapter's event loop, for another to finish")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()


def _text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    parts = content or []
    return "\n".join(p.get("text", "") if isinstance(p, dict) else getattr(p, "text", "") or "" for p in parts)


def _last_turn(completion: Any) -> str:
    """The text of a completion as grpokit passes it: the text, or its last assistant message's."""
    if isinstance(completion, str):
        return completion
    turns = [m for m in completion if isinstance(m, dict) and m.get("role") == "assistant"]
    return _text(turns[-1].get("content")) if turns else ""


def _short(row: dict[str, Any]) -> str:
    text = repr({key: value for key, value in row.items() if key != "prompt"} or row)
    return text if len(text) <= 200 else text[:200] + "…"


def _grpokit_row(row: dict[str, Any]) -> dict[str, Any]:
    """A dataset row as grpokit takes it: chat messages without the null fields Arrow gives every message of a
    column (a user message's ``tool_calls: None``); verifiers builds the same messages from either."""
    prompt = row.get("prompt")
    if isinstance(prompt, list):
        row = {**row, "prompt": [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
                                 for m in prompt]}
    return row


class VerifiersEpisode:
    """One completion's verifiers episode: ``state`` is verifiers' state of its rollout. Single turn: ``reset``, the
    model's turn, ``end(turn)``. Its attributes are data, never methods: a public method would be a tool."""

    def __init__(self, adapter: _Adapter):
        self._adapter = adapter
        self.state: Any = None
        self.row: dict[str, Any] = {}
        self.done = False  # verifiers' rollout loop would have stopped: later turns are not recorded
        self.ended = False

    def _run(self, step: str, coroutine: Any) -> Any:
        try:
            return self._adapter.loop.run(coroutine)
        except VerifiersError:
            raise
        except Exception as error:
            raise VerifiersError(f"verifiers environment {self._adapter.name!r} raised {type(error).__name__}: "
                                 f"{error} in {step}, on the row {_short(self.row)}") from error

    def reset(self, **row: Any) -> None:
        self.row = row
        self.state, self.done, self.ended = None, False, False
        self._run("reset (init_state, setup_state)", self._start(row))

    async def _start(self, row: dict[str, Any]) -> None:
        env, vf = self._adapter.env, self._adapter.vf
        state = await env.init_state(dict(row), self._adapter.client, "grpokit", None)
        state["timing"].generation.start = state["timing"].setup.start = time.time()
        try:
            ready = await env.setup_state(state)
            state = state if ready is None else ready
        except vf.Error as error:  # verifiers' loop keeps such errors in the state, and stops on them
            state["error"] = error
        state["timing"].setup.end = time.time()
        self.state = state
        if await env.is_completed(state):
            self.done = True
            return
        self.prompt_messages = await self._prompt_messages()

    async def _prompt_messages(self) -> list[Any]:
        from verifiers.utils.message_utils import maybe_normalize_messages
        return maybe_normalize_messages(await self._adapter.env.get_prompt_messages(self.state),
                                        field_name="prompt_messages")

    async def _take(self, turn: str) -> None:
        """The model's turn, into the state as verifiers' client would give it: a Response holding the text."""
        vf = self._adapter.vf
        message = vf.ResponseMessage(content=turn, finish_reason="stop", is_truncated=False, tokens=None)
        response = vf.Response(id="grpokit", created=int(time.time()), model="grpokit", message=message)
        await self._adapter.env.add_model_response(self.state, self.prompt_messages, response)

    def end(self, turn: str | None = None) -> None:
        if self.ended or self.state is None:
            return
        self.ended = True
        self._run("end (cleanup)", self._end(turn))

    async def _end(self, turn: str | None) -> None:
        if turn is not None and not self.done:
            await self._take(turn)
            await self._adapter.env.is_completed(self.state)  # the stop condition, as the loop would record it
        await self._adapter.env.cleanup(self.state)  # renders state["completion"], then the env's own handlers


class VerifiersConversation(VerifiersEpisode):
    """A multi-turn episode: ``reply(turn)`` answers each turn with ``env_response``'s messages, as text."""

    def reply(self, turn: str) -> str | None:
        if self.done or self.state is None:
            return None
        return self._run("reply (env_response)", self._reply(turn))

    async def _reply(self, turn: str) -> str | None:
        env, vf = self._adapter.env, self._adapter.vf
        before = len(self.prompt_messages) + 1  # the conversation so far: the prompt and this turn
        await self._take(turn)
        if await env.is_completed(self.state):
            self.done = True
            return None
        try:
            prompt = await self._prompt_messages()
        except vf.Error as error:  # as verifiers' loop: kept in the state, which then stops
            if isinstance(error, vf.OverlongPromptError):
                self.state["prompt_too_long"] = self.state["is_truncated"] = True
            else:
                self.state["error"] = error
                why = error.__cause__ or error
                self._adapter.warn("env_response", f"env_response failed ({type(why).__name__}: {why}); it ends")
            await env.is_completed(self.state)
            self.done = True
            return None
        if self.state.get("final_env_response") is not None:  # the env's last word: in the completion, not a turn
            await env.is_completed(self.state)
            self.done = True
            return None
        if len(prompt) < before:
            raise VerifiersError(f"verifiers environment {self._adapter.name!r}: get_prompt_messages returned a "
                                 "conversation shorter than the one so far; grpokit's rollout only appends to it")
        self.prompt_messages = prompt
        return "\n\n".join(_text(getattr(m, "content", "")) for m in prompt[before:])


class _Adapter:
    """The loaded environment and what its episodes and reward functions share."""

    def __init__(self, vf: Any, env: Any, name: str):
        self.vf, self.env, self.name = vf, env, name
        self.loop = _Loop()
        self.client = _policy_client(vf, name)
        self._warned: set[str] = set()
        self.kind = VerifiersEpisode if isinstance(env, vf.SingleTurnEnv) else VerifiersConversation

    def warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"verifiers environment {self.name!r}: {message} (warned once)", stacklevel=3)

    def episode(self) -> VerifiersEpisode:
        return self.kind(self)

    def episodes(self, completions: Sequence[Any], columns: dict[str, Any]) -> list[VerifiersEpisode]:
        """Each completion's episode: the one its rollout drove (``environments``), ended; without them (a caller
        that made none), each completion replayed as one last turn of a fresh episode of its row."""
        given = columns.get("environments")
        if given is None:
            given = []
            for i, completion in enumerate(completions):
                row = {k: v[i] for k, v in columns.items() if k not in REWARD_ARGUMENTS and k != "environments"}
                episode = self.episode()
                episode.reset(**{**row, "prompt": columns["prompts"][i]})
                if isinstance(completion, list) and len(completion) != 1:
                    raise VerifiersError(f"verifiers environment {self.name!r}: completion {i} has several "
                                         "messages; scoring a multi-turn completion needs its episode "
                                         "(the environments keyword)")
                given.append(episode)
        for episode, completion in zip(given, completions):
            if not isinstance(episode, VerifiersEpisode):
                raise VerifiersError(f"verifiers environment {self.name!r}'s reward functions got an environment "
                                     f"{type(episode).__name__}, not one of its own episodes")
            # A rollout that did not end the episode: a single turn's text is the completion; cleanup renders it.
            unseen = not episode.ended and episode.state is not None and not episode.state["trajectory"]
            episode.end(_last_turn(completion) if unseen else None)
        return list(given)


def _policy_client(vf: Any, name: str) -> Any:
    """The client verifiers' state holds: in grpokit the policy writes every assistant turn, so an environment that
    asks a model itself (``get_model_response``: a simulated user, a judge through the state's client) is told so."""

    async def same(self: Any, value: Any = None, *args: Any, **kwargs: Any) -> Any:
        return value

    async def prompt(self: Any, messages: Any) -> tuple[Any, dict]:
        return messages, {}

    async def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"verifiers environment {name!r} asked the rollout's model for a response itself; in "
                           "grpokit the policy writes the assistant's turns, and the environment answers them")

    members = {"setup_client": lambda self, config: None, "to_native_tool": same, "to_native_prompt": prompt,
               "get_native_response": refuse, "raise_from_native_response": same, "from_native_response": same,
               "close": same}
    return type("GrpokitPolicy", (vf.Client,), members)(None)


def _load(vf: Any, name: str, args: dict[str, Any], seed: int) -> Any:
    """``verifiers.load_environment(name, **args)``, its failures named; the run's ``seed`` where the environment's
    ``load_environment`` takes one and ``args`` gives none. verifiers' Environment installs SIGINT/SIGTERM handlers
    as it is made; the process's are put back, so that grpokit's checkpoint-on-signal keeps working."""
    from verifiers.utils.env_utils import env_module_name, import_env_module

    module = env_module_name(name)
    install = (f"install it: vf-install {name} (from ./environments/{module}, or OWNER/{name} from the Environments "
               f"Hub), or pip install the package that holds the module {module!r}")
    try:
        env_module = import_env_module(name)
    except Exception as error:
        if isinstance(error, ModuleNotFoundError) and error.name == module:
            raise VerifiersError(f"verifiers environment {name!r} is not installed (no module {module!r}): "
                                 f"{install}") from None
        raise VerifiersError(f"verifiers environment {name!r}: its module {module!r} failed to import: "
                             f"{type(error).__name__}: {error}") from error
    loader = getattr(env_module, "load_environment", None)
    if loader is None:
        tasksets = _v1_tasksets(env_module)
        if tasksets:
            raise VerifiersError(
                f"verifiers environment {name!r} is a verifiers v1 taskset ({', '.join(tasksets)}: a verifiers.v1."
                f"Taskset), which grpokit's adapter does not run: it speaks verifiers' v0 API (a module's "
                f"load_environment() returning a SingleTurnEnv or MultiTurnEnv), which verifiers {SUPPORTED} serves; "
                "v1 tasksets are the API that replaced it in verifiers 0.4 (0.3 holds a preview, verifiers.v1). Use "
                "a v0 environment, one whose module defines load_environment(), or install verifiers 0.4, whose "
                "tasksets run as agents (grpokit.agents.verifiers_v1)")
        raise VerifiersError(f"verifiers environment {name!r}: its module {module!r} has no load_environment(); "
                             "a verifiers environment's module defines it")
    if "seed" not in args and "seed" in inspect.signature(loader).parameters:
        args = {**args, "seed": seed}
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        env = vf.load_environment(name, **args)
    except Exception as error:
        cause = error.__cause__ or error
        raise VerifiersError(f"verifiers environment {name!r} failed to load with environment_args {args}: "
                             f"{type(cause).__name__}: {cause}") from error
    finally:
        if threading.current_thread() is threading.main_thread():
            for number, handler in handlers.items():
                signal.signal(number, handler if handler is not None else signal.SIG_DFL)
    return env


def _v1_tasksets(env_module: Any) -> list[str]:
    """The names of the verifiers v1 tasksets (subclasses of ``verifiers.v1.Taskset``) an environment's module
    exports: what a v1 environment package exports instead of ``load_environment``."""
    def is_taskset(value: Any) -> bool:
        return isinstance(value, type) and any(base.__name__ == "Taskset" and base.__module__.startswith("verifiers.v1")
                                               for base in value.__mro__[1:])

    return sorted(name for name, value in vars(env_module).items() if is_taskset(value))


def _check_kind(vf: Any, env: Any, name: str) -> None:
    kind = type(env).__name__
    if isinstance(env, vf.ToolEnv):
        raise VerifiersError(f"verifiers environment {name!r} is a {kind} (a ToolEnv: tools called in OpenAI's "
                             "tool_calls format), which grpokit's verifiers adapter does not run yet; SingleTurnEnv "
                             "and MultiTurnEnv environments are supported")
    if not isinstance(env, vf.MultiTurnEnv):
        raise VerifiersError(f"verifiers environment {name!r} is a {kind}, not a SingleTurnEnv or MultiTurnEnv (an "
                             "EnvGroup, or a rollout of its own), which grpokit's verifiers adapter cannot drive")


def verifiers_task(name: str, args: dict[str, Any], *, seed: int) -> EnvironmentTask:
    """The installed verifiers environment ``name`` (``load_environment(name, **args)``) as an EnvironmentTask."""
    vf = _verifiers()
    env = _load(vf, name, dict(args), seed)
    _check_kind(vf, env, name)
    adapter = _Adapter(vf, env, name)
    if env.build_dataset() is None:
        raise VerifiersError(f"verifiers environment {name!r} has no training dataset (only an eval_dataset); "
                             "grpokit trains on its dataset")
    rows = [_grpokit_row(row) for row in env.get_dataset().to_list()]
    eval_built = env.build_eval_dataset()
    eval_rows = None if eval_built is None else [_grpokit_row(row) for row in eval_built.to_list()]
    funcs, weights = rubric_rewards(vf, env.rubric, adapter)
    if not funcs:
        raise VerifiersError(f"verifiers environment {name!r}'s rubric has no reward functions")
    info = {"verifiers": vf.__version__, "environment_class": type(env).__name__,
            "parser": type(env.parser).__name__, "max_turns": getattr(env, "max_turns", None)}
    return EnvironmentTask(name=f"verifiers:{name}", rows=rows, eval_rows=eval_rows, reward_funcs=funcs,
                           reward_weights=weights, environment_factory=adapter.episode,
                           answer_column="answer" if rows and "answer" in rows[0] else None, info=info)
