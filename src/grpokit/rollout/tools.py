"""Tools a model may call during a rollout. A tool is a plain function with type hints and a docstring (as in
TRL); its result, or the text of its error, goes back to the model. A run's tools are one :class:`ToolBox` (empty
without tools); each rollout gets its :class:`ToolSession` (an :class:`InertSession` from the empty box).

The calls are read and run by a protocol: the plain-text one (:mod:`grpokit.rollout.tool_calls`, re-exported here)
or a chat template's own (:mod:`grpokit.rollout.tool_templates`).

The built-in tools: ``calculator`` (:mod:`grpokit.rollout.calculator`): arithmetic on decimal numbers, parsed by hand
(never ``eval``), with bounded sizes, so that whatever a model writes gets a short text back; ``python``
(:mod:`grpokit.rollout.python_tool`): a program run in :mod:`grpokit.sandbox`, its output given back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from grpokit.data import render_prompt
from grpokit.rollout.calculator import calculator
from grpokit.rollout.episodes import (
    INERT,
    TOOL_COUNTS,
    EnvironmentFailure,
    InertSession,
    ToolSession,
    environment_call,
    own_token_steps,
)
from grpokit.rollout.python_tool import make_python_tool, python, sandbox_limits
from grpokit.rollout.tool_calls import MAX_RESULT, PlainProtocol, ToolCall, parse_tool_call, run_tool
from grpokit.rollout.tool_use import ToolUse, environment_tools, tool_messages
from grpokit.runtime.threads import DaemonPool
from grpokit.user_code import call_with_timeout, load_callable

__all__ = ["INERT", "TOOL_COUNTS", "EnvironmentFailure", "InertSession", "PlainProtocol", "ToolBox", "ToolCall",
           "ToolSession", "ToolUse", "calculator", "call_with_timeout", "environment_tools", "own_token_steps",
           "parse_tool_call", "python", "run_tool", "tool_messages"]


def tool_functions(tools: Sequence[Callable] | Mapping[str, Callable]) -> dict[str, Callable]:
    """Name → function, names unique (a tool is called by its ``__name__``, as in TRL)."""
    if isinstance(tools, Mapping):
        return dict(tools)
    named: dict[str, Callable] = {}
    for fn in tools:
        if not callable(fn):
            raise ValueError(f"tools: {fn!r} is not callable")
        name = getattr(fn, "__name__", type(fn).__name__)
        if name in named:
            raise ValueError(f"tools: two tools are named {name!r}; a tool is called by its name")
        named[name] = fn
    return named


def environment_reward(environments: Sequence[Any]) -> list[float | None]:
    """An environment's own score of its completion: ``get_reward()`` (TRL's name) or ``reward()``."""
    scores = []
    for environment in environments:
        fn = getattr(environment, "get_reward", None) or getattr(environment, "reward", None)
        scores.append(None if fn is None else fn())
    return scores


def resolve_tools(config: Any | None, tools: Sequence[str | Callable] | None = None,
                  environment_factory: Callable[[], Any] | None = None) -> tuple[list[Callable], Callable | None]:
    """The run's tool functions and environment factory: those passed in Python, else the config's (``tools``:
    'calculator', 'python', 'FILE.py:NAME' or 'package.module:NAME'; ``environment_factory``: the same paths). The
    config's ``python`` runs in its ``sandbox`` with its ``sandbox_timeout``."""
    builtin = {"calculator": calculator, "python": python if config is None else
               make_python_tool(config.sandbox, sandbox_limits(config.sandbox_timeout))}
    functions = []
    for spec in (config.tools if tools is None else tools):
        if callable(spec):
            functions.append(spec)
        elif spec in builtin:
            functions.append(builtin[spec])
        elif ":" in spec:
            functions.append(load_callable(spec, "tools"))
        else:
            raise ValueError(f"tools: unknown tool {spec!r}; the built-in tools are {sorted(builtin)}; a tool of "
                             "your own is 'path/to/file.py:name' or 'package.module:name' (or a callable in Python)")
    tool_functions(functions)  # names unique
    if environment_factory is None and config is not None and config.environment_factory is not None:
        environment_factory = load_callable(config.environment_factory, "environment_factory")
    return functions, environment_factory


def reward_keywords(environment_factory: Callable[[], Any] | None) -> list[str]:
    """What a rollout with tools adds to the keywords reward functions may take (:meth:`ToolSession.reward_inputs`):
    ``environments`` where there is an ``environment_factory``."""
    return [] if environment_factory is None else ["environments"]


def add_environment_reward(reward_funcs: list[Callable], weights: list[float],
                           environment_factory: Callable[[], Any] | None) -> None:
    """Append the reward function of environments that score themselves (``get_reward()`` or ``reward()``), named
    after their class as in TRL, with weight 1, to ``reward_funcs`` and ``weights``: a run's rewards and
    ``grpokit sample``'s labels alike. Nothing for no factory, or environments that do not score themselves. A
    factory that is the class itself is read without making an environment (the ToolBox makes its own probe)."""
    if environment_factory is None:
        return
    kind = environment_factory if isinstance(environment_factory, type) else type(environment_factory())
    if not any(callable(getattr(kind, name, None)) for name in ("get_reward", "reward")):
        return

    def reward(environments: Sequence[Any], **kwargs: Any) -> list[float | None]:
        return environment_reward(environments)

    reward.__name__ = kind.__name__
    reward_funcs.append(reward)
    weights.append(1.0)


class ToolBox:
    """The run's tools: plain functions, and/or ``environment_factory`` (a callable returning, per completion, an
    object with ``reset(**row)``, tool methods and optionally ``reply(turn)``: :mod:`grpokit.tasks.environments`).
    Built once; :meth:`session` serves one rollout. A box with neither is empty (falsy; :attr:`NONE` is one): a run
    without tools, whose sessions do nothing. Every consumer (the sampler, ``grpokit sample``, the evaluation) takes
    a box and asks it, never a None. Calls run in the box's thread pool (``workers`` threads), concurrently."""

    NONE: ClassVar[ToolBox]  # the empty box (set below the class)

    def __init__(self, tokenizer: Any = None, tools: Sequence[Callable] | Mapping[str, Callable] = (), *,
                 environment_factory: Callable[[], Any] | None = None, max_calls: int = 4,
                 timeout: float | None = 10.0, protocol: Any = None, max_reply_chars: int | None = MAX_RESULT,
                 max_turns: int = 10, workers: int = 32, system_prompt: str | None = None,
                 chat_template: bool | None = None, overlap: bool = True):
        self.tokenizer, self.tools = tokenizer, tool_functions(tools)
        self.environment_factory, self.max_calls, self.timeout = environment_factory, max_calls, timeout
        self.max_reply_chars, self.max_turns, self.workers = max_reply_chars, max_turns, workers
        self.overlap = overlap  # False: each call waited for where it is made (benchmarks/slow_environment.py)
        self.system_prompt, self.chat_template = system_prompt, chat_template
        self.active = bool(self.tools) or environment_factory is not None
        self.protocol = protocol or PlainProtocol()
        self.listed_in_prompt = protocol is not None and self.active  # a chat template's protocol: prompts list them
        self.environment_methods: dict[str, Callable] = {}
        self._pool: DaemonPool | None = None
        self._turn_markup: tuple[str, str] | None = None
        if environment_factory is not None:
            probe = environment_factory()
            if not callable(getattr(probe, "reset", None)):
                raise ValueError(f"environment_factory: {type(probe).__name__} has no reset(**row) method")
            clash = sorted(set(environment_tools(probe)) & set(self.tools))
            if clash:
                raise ValueError(f"environment_factory: {type(probe).__name__}'s methods {clash} have the names of "
                                 "tools; a tool is called by its name")
            self.environment_methods = environment_tools(probe)
        if self.active:  # the empty box scans nothing: its sessions never see a token
            if tokenizer is None:
                raise ValueError("ToolBox: tools need the tokenizer (to read calls and insert results)")
            # Tokens that can end a call: their text holds the close tag's last character. Only after one of
            # these is a completion's text decoded and searched for the close tag.
            last = self.protocol.close[-1]
            pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
            self.closing = torch.tensor([last in (piece or "") for piece in pieces])

    def __bool__(self) -> bool:
        return self.active

    def pool(self) -> DaemonPool:
        """The threads calls run in (made at the first call: a box that never calls starts none): daemon threads,
        so that a call still running when another's error stops the run never holds up the process's exit."""
        if self._pool is None:
            self._pool = DaemonPool(self.workers, "grpokit-call")
        return self._pool

    def closing_tokens(self, ids: Tensor) -> Tensor:
        """(A,) bool: whether each token id can end a call (ids past the tokenizer's, in a model's padded
        vocabulary, never do)."""
        inside = ids < len(self.closing)
        return inside & self.closing[ids.clamp(max=len(self.closing) - 1)]

    def encode(self, pieces: Sequence[tuple[str, bool]]) -> list[int]:
        """``(piece, is_markup)`` → token ids: markup with its special tokens, the rest never (a tool or an
        environment cannot end the completion by writing EOS)."""
        ids: list[int] = []
        for piece, is_markup in pieces:
            ids += self.tokenizer(piece, add_special_tokens=False, split_special_tokens=not is_markup)["input_ids"]
        return ids

    def turn_pieces(self, reply: str) -> list[tuple[str, bool]]:
        """What follows a completion's stop token when its environment replies: the chat template's markup of a
        user message holding ``reply`` and of the next assistant turn (with a template), else the reply on its
        own lines."""
        if self._turn_markup is None:
            self._turn_markup = turn_markup(self.tokenizer, self.chat_template)
        before, after = self._turn_markup
        return [(before, True), (reply, False), (after, True)]

    def render(self, prompt: str | list[dict[str, Any]]) -> str:
        """A prompt as the model reads it (:func:`~grpokit.data.render_prompt`, with this box's tools listed where
        the template lists them)."""
        return render_prompt(self.tokenizer, prompt, system_prompt=self.system_prompt,
                             chat_template=self.chat_template, tools=self.prompt_tools())

    def schema_tools(self) -> list[Callable]:
        """Every tool a completion may call, for a chat template to describe (an environment's as methods of one
        instance: their signatures and docstrings are the class's)."""
        return [*self.tools.values(), *self.environment_methods.values()]

    def prompt_tools(self) -> list[Callable] | None:
        """The tools for the chat template to list in each prompt (``render_prompt(tools=...)``); None with the
        plain-text protocol, whose prompts say nothing of them."""
        return self.schema_tools() if self.listed_in_prompt else None

    def session(self, rows: Sequence[dict[str, Any]], group_size: int, max_new_tokens: int,
                prompt_column: str = "prompt") -> ToolSession | InertSession:
        """The state of one rollout of ``rows`` × ``group_size`` completions: each has its own environment when
        there is a factory, all made and reset with their rows at once, in the pool. Where a ``reset`` returns an
        observation (a text), it is appended to that completion's prompt (``rows[i][prompt_column]``), and the
        session's ``prompts`` are the N prompts to sample from. The empty box's session is :data:`INERT`."""
        if not self.active:
            return INERT
        n = len(rows) * group_size
        if self.environment_factory is None:
            return ToolSession(self, n, max_new_tokens, None)
        environments = list(self.pool().map(lambda i: environment_call(self, "environment_factory", i), range(n)))
        expanded = [row for row in rows for _ in range(group_size)]
        observations = list(self.pool().map(
            lambda i: environment_call(environments[i], "reset", i, **expanded[i]), range(n)))
        session = ToolSession(self, n, max_new_tokens, environments)
        if any(observation is not None for observation in observations):
            for i, observation in enumerate(observations):
                if observation is not None and not isinstance(observation, str):
                    raise EnvironmentFailure(f"environment {type(environments[i]).__name__}.reset returned "
                                             f"{type(observation).__name__}, not a text or None (completion {i})")
            session.observations = observations
            session.prompts = [self.render(with_observation(row.get(prompt_column, ""), observation))
                               for row, observation in zip(expanded, observations)]
        return session


def with_observation(prompt: str | list[dict[str, Any]], observation: str | None) -> str | list[dict[str, Any]]:
    """A prompt with a reset's observation appended: to a conversation's last user message (a new user message
    if it has none after the system's), to a plain prompt on a line of its own, as TRL appends it.

    >>> with_observation([{"role": "user", "content": "Play."}], "Board: ...")
    [{'role': 'user', 'content': 'Play.\\n\\nBoard: ...'}]
    >>> with_observation("", "Board: ...")
    'Board: ...'
    """
    if observation is None:
        return prompt
    if isinstance(prompt, str):
        return f"{prompt}\n\n{observation}" if prompt else observation
    messages = [dict(message) for message in prompt]
    if messages and messages[-1].get("role") == "user":
        content = messages[-1].get("content") or ""
        messages[-1]["content"] = f"{content}\n\n{observation}" if content else observation
    else:
        messages.append({"role": "user", "content": observation})
    return messages


def turn_markup(tokenizer: Any, chat_template: bool | None) -> tuple[str, str]:
    """``(before, after)`` a user message's text when it follows an assistant turn that ended with the stop
    token, up to the next assistant turn's start: found by rendering a conversation with and without a last user
    message (what the template writes after the stop token included, e.g. ChatML's newline). Without a template
    (or ``chat_template`` false), the message on lines of its own."""
    if chat_template is False or getattr(tokenizer, "chat_template", None) is None:
        return "\n", "\n"
    marker = "\x00REPLY\x00"
    talk = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    base = tokenizer.apply_chat_template(talk, tokenize=False)
    full = tokenizer.apply_chat_template([*talk, {"role": "user", "content": marker}], tokenize=False,
                                         add_generation_prompt=True)
    stop = tokenizer.eos_token or ""
    end = base.rfind(stop) if stop else -1
    if not full.startswith(base) or marker not in full or end < 0:
        return "\n", "\n"  # a template that rewrites earlier turns: the plain-text markup
    before, after = full[len(base):].split(marker)
    return base[end + len(stop):] + before, after


ToolBox.NONE = ToolBox()
