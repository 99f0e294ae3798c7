"""Tools a model may call during a rollout. A tool is a plain function with type hints and a docstring (as in
TRL); its result, or the text of its error, goes back to the model.

The plain-text protocol: the model writes ``<tool>{"name": ..., "arguments": {...}}</tool>``; the rollout
pauses there, :func:`parse_tool_call` reads the call, :func:`run_tool` runs it, and ``<result>…</result>``
holding its text is appended. Every malformed call has a defined answer (an ``error: ...`` text, counted),
never an exception.

``calculator`` (:mod:`grpokit.rollout.calculator`) is the built-in tool: arithmetic on decimal numbers, parsed by hand
(never ``eval``), with bounded sizes, so that whatever a model writes gets a short text back.
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from grpokit.rollout.calculator import calculator
from grpokit.user_code import Overran, call_with_timeout, load_callable

__all__ = ["PlainProtocol", "ToolBox", "ToolCall", "ToolUse", "calculator", "call_with_timeout", "parse_tool_call",
           "run_tool"]

TOOL_OPEN, TOOL_CLOSE = "<tool>", "</tool>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
MAX_CALL = 4096  # characters between <tool> and </tool>
MAX_RESULT = 1024  # characters of a result given back to the model


@dataclass
class ToolCall:
    """A call read from the model's text: the tool's name and arguments, or why it could not be read."""

    name: str | None = None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # set when the call is malformed; the model gets it back as the result


def parse_tool_call(text: str, open_tag: str = TOOL_OPEN, close_tag: str = TOOL_CLOSE) -> ToolCall | None:
    """The call that ``text`` ends with — ``<tool>{"name": ..., "arguments": {...}}</tool>``, or between a chat
    template's own tags — or None when it does not end with the close tag. A close tag without its open tag, a
    nested open tag, a call longer than ``MAX_CALL`` characters, text that is not a JSON object, a missing or
    non-text name, or arguments that are not an object give a :class:`ToolCall` with ``error`` set. The arguments
    may also be named ``parameters``, or be JSON text of an object, as some chat templates write them."""
    if not text.endswith(close_tag):
        return None
    start = text.rfind(open_tag, 0, len(text) - len(close_tag))
    if start < 0:
        return ToolCall(error=f"{close_tag} without a {open_tag} before it")
    body = text[start + len(open_tag):-len(close_tag)]
    if close_tag in body:
        return ToolCall(error=f"{close_tag} without a {open_tag} before it")
    opener = text.rfind(open_tag, 0, start)
    if opener >= 0 and close_tag not in text[opener:start]:
        return ToolCall(error=f"nested {open_tag} tags: a call is one JSON object between one {open_tag} and "
                              f"{close_tag}")
    if len(body) > MAX_CALL:
        return ToolCall(error=f"the call is longer than {MAX_CALL} characters")
    try:
        call = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as error:
        return ToolCall(error=f"the call is not valid JSON ({getattr(error, 'msg', 'too deeply nested')})")
    if not isinstance(call, dict):
        return ToolCall(error='the call must be a JSON object: {"name": ..., "arguments": {...}}')
    name, arguments = call.get("name"), call.get("arguments", call.get("parameters", {}))
    if not isinstance(name, str) or not name:
        return ToolCall(error='the call has no "name" (the tool\'s name, as text)')
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            return ToolCall(name=name, error='"arguments" is text that is not JSON of the tool\'s parameters')
    if not isinstance(arguments, dict):
        return ToolCall(name=name, error='"arguments" must be a JSON object of the tool\'s parameters')
    return ToolCall(name=name, arguments=arguments)


def run_tool(call: ToolCall, tools: Mapping[str, Callable[..., Any]], timeout: float | None = None) -> tuple[str, bool]:
    """``(text, failed)``: the tool's result as text (cut to ``MAX_RESULT`` characters), or, ``failed``, the
    error the model gets back instead — a malformed call, an unknown tool, arguments its signature refuses,
    an exception it raised, or a run longer than ``timeout`` seconds."""
    if call.error is not None:
        return f"error: {call.error}", True
    if call.name not in tools:
        return f"error: unknown tool {call.name!r:.60}; the tools are {', '.join(sorted(tools))}", True
    try:
        value = call_with_timeout(tools[call.name], call.arguments, timeout, f"tool {call.name}")
    except Overran:
        return f"error: {call.name} took longer than {timeout} s", True
    except TypeError as error:  # arguments the signature does not take (or the tool's own TypeError)
        return f"error: {call.name}: {error}"[:MAX_RESULT], True
    except Exception as error:
        return f"error: {call.name} raised {type(error).__name__}: {error}"[:MAX_RESULT], True
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    failed = text.startswith("error:")  # a tool may answer its own errors as text, as calculator does
    return text[:MAX_RESULT], failed

# ---- tools in the rollout ------------------------------------------------------------------------


class PlainProtocol:
    """The plain-text protocol: a call ends with ``</tool>`` (:func:`parse_tool_call` reads it) and its result
    comes back as ``<result>…</result>``. A chat template's own format is another protocol with these members."""

    close = TOOL_CLOSE

    def parse(self, text: str) -> ToolCall | None:
        return parse_tool_call(text)

    def result_pieces(self, text: str, call: ToolCall) -> list[tuple[str, bool]]:
        """What is inserted after a call, as ``(piece, is_markup)``: markup is tokenized with its special tokens
        (a chat template's turn markers), the rest never (a tool cannot end the completion by returning EOS)."""
        return [(f"{RESULT_OPEN}{text}{RESULT_CLOSE}", False)]


@dataclass
class ToolUse:
    """One call a completion made: what it asked for, what it got back, and where the result sits."""

    name: str | None
    arguments: dict[str, Any]
    result: str  # the tool's text (an "error: ..." text when failed)
    failed: bool
    start: int  # the completion's token index where the inserted result begins
    tokens: int  # how many result tokens were inserted (fewer than the result's when the budget ran out)
    seconds: float


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


def environment_tools(environment: Any) -> dict[str, Callable]:
    """The tools an environment offers: its public methods but ``reset`` and its reward (as TRL lists them,
    on the class, so properties are not evaluated)."""
    return {name: getattr(environment, name) for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
            if not name.startswith("_") and name not in ("reset", "reward", "get_reward")}


def environment_reward(environments: Sequence[Any]) -> list[float | None]:
    """An environment's own score of its completion: ``get_reward()`` (TRL's name) or ``reward()``."""
    scores = []
    for environment in environments:
        fn = getattr(environment, "get_reward", None) or getattr(environment, "reward", None)
        scores.append(None if fn is None else fn())
    return scores


def tool_messages(tokenizer: Any, ids: Sequence[int], calls: Sequence[ToolUse]) -> list[dict[str, Any]]:
    """A completion with tool calls as chat messages, as TRL passes them to reward functions: the assistant's
    turns (each that called a tool with its ``tool_calls``), each followed by the tool's message."""
    messages: list[dict[str, Any]] = []
    start = 0
    for call in calls:
        text = tokenizer.decode(list(ids[start: call.start]), skip_special_tokens=True)
        messages.append({"role": "assistant", "content": text,
                         "tool_calls": [{"type": "function", "function": {"name": call.name,
                                                                          "arguments": call.arguments}}]})
        messages.append({"role": "tool", "name": call.name, "content": call.result})
        start = call.start + call.tokens
    messages.append({"role": "assistant", "content": tokenizer.decode(list(ids[start:]), skip_special_tokens=True)})
    return messages


def resolve_tools(config: Any | None, tools: Sequence[str | Callable] | None = None,
                  environment_factory: Callable[[], Any] | None = None) -> tuple[list[Callable], Callable | None]:
    """The run's tool functions and environment factory: those passed in Python, else the config's (``tools``:
    'calculator', 'FILE.py:NAME' or 'package.module:NAME'; ``environment_factory``: the same paths)."""
    builtin = {"calculator": calculator}
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
    object with ``reset(**row)`` and tool methods). Built once; :meth:`session` serves one rollout."""

    def __init__(self, tokenizer: Any, tools: Sequence[Callable] | Mapping[str, Callable] = (), *,
                 environment_factory: Callable[[], Any] | None = None, max_calls: int = 4,
                 timeout: float | None = 10.0, protocol: Any = None):
        self.tokenizer, self.tools = tokenizer, tool_functions(tools)
        self.environment_factory, self.max_calls, self.timeout = environment_factory, max_calls, timeout
        self.protocol = protocol or PlainProtocol()
        self.listed_in_prompt = protocol is not None  # a chat template's protocol: its prompts list the tools
        if environment_factory is not None:
            probe = environment_factory()
            if not callable(getattr(probe, "reset", None)):
                raise ValueError(f"environment_factory: {type(probe).__name__} has no reset(**row) method")
            clash = sorted(set(environment_tools(probe)) & set(self.tools))
            if clash:
                raise ValueError(f"environment_factory: {type(probe).__name__}'s methods {clash} have the names of "
                                 "tools; a tool is called by its name")
            self.environment_methods = environment_tools(probe)
        else:
            self.environment_methods = {}
        if not self.tools and environment_factory is None:
            raise ValueError("tools: give at least one tool or an environment_factory")
        # Tokens that can end a call: their text holds the close tag's last character. Only after one of these
        # is a completion's text decoded and searched for the close tag.
        last = self.protocol.close[-1]
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        self.closing = torch.tensor([last in (piece or "") for piece in pieces])

    def schema_tools(self) -> list[Callable]:
        """Every tool a completion may call, for a chat template to describe (an environment's as methods of one
        instance: their signatures and docstrings are the class's)."""
        return [*self.tools.values(), *self.environment_methods.values()]

    def prompt_tools(self) -> list[Callable] | None:
        """The tools for the chat template to list in each prompt (``render_prompt(tools=...)``); None with the
        plain-text protocol, whose prompts say nothing of them."""
        return self.schema_tools() if self.listed_in_prompt else None

    def session(self, rows: Sequence[dict[str, Any]], group_size: int, max_new_tokens: int) -> ToolSession:
        """The state of one rollout of ``rows`` × ``group_size`` completions: each has its own environment (reset
        with its row) when there is a factory."""
        environments = None
        if self.environment_factory is not None:
            environments = []
            for row in rows:
                for _ in range(group_size):
                    environment = self.environment_factory()
                    environment.reset(**row)
                    environments.append(environment)
        return ToolSession(self, len(rows) * group_size, max_new_tokens, environments)


class ToolSession:
    """Runs the calls of one rollout between decode steps. :meth:`intervene` sees each step's picks: a completion
    whose new token closes a call gets the tool's result queued, and the queued tokens replace its next picks one
    per step — they go through the KV cache like any token, so nothing is re-encoded, and the other completions
    keep decoding meanwhile. The positions of inserted tokens make :meth:`tool_mask`."""

    def __init__(self, box: ToolBox, n: int, max_new_tokens: int, environments: list[Any] | None):
        self.box, self.max_new_tokens, self.environments = box, max_new_tokens, environments
        self.tokens = torch.zeros(n, max_new_tokens, dtype=torch.long)  # what each completion holds so far
        self.segment_start = [0] * n  # where the text after the last call begins
        self.pending: dict[int, list[int]] = {}  # row → result tokens still to insert
        self.inserted: list[tuple[int, int]] = []  # (row, column) of every inserted token
        self.calls: list[list[ToolUse]] = [[] for _ in range(n)]

    def tools_of(self, row: int) -> Mapping[str, Callable]:
        if self.environments is None:
            return self.box.tools
        return {**self.box.tools, **environment_tools(self.environments[row])}

    def intervene(self, t: int, rows: Tensor, chosen: Tensor, stopped: Tensor, logp: Tensor
                  ) -> tuple[Tensor, Tensor, Tensor]:
        """Step ``t``'s picks of the running ``rows`` → the picks with queued result tokens in place of sampled
        ones (never stopping; log-prob 0: they are not the policy's)."""
        rows_list = rows.tolist()
        forced = torch.zeros_like(stopped)
        if self.pending:
            at = [k for k, row in enumerate(rows_list) if row in self.pending]
            if at:
                ids = []
                for k in at:
                    queue = self.pending[rows_list[k]]
                    ids.append(queue.pop(0))
                    if not queue:
                        del self.pending[rows_list[k]]
                    self.inserted.append((rows_list[k], t))
                index = torch.tensor(at, device=chosen.device)
                chosen, stopped, logp = chosen.clone(), stopped.clone(), logp.clone()
                chosen[index] = torch.tensor(ids, device=chosen.device)
                stopped[index], logp[index], forced[index] = False, 0.0, True
        cpu = chosen.cpu()
        self.tokens[rows.cpu(), t] = cpu
        closing = self.box.closing
        if int(cpu.max()) >= len(closing):  # a model's vocabulary padded past the tokenizer's: ids it never decodes
            closing = torch.cat([closing, closing.new_zeros(int(cpu.max()) + 1 - len(closing))])
        hits = closing[cpu] & ~(stopped | forced).cpu()
        for k in hits.nonzero().squeeze(1).tolist():
            self._maybe_call(rows_list[k], t)
        return chosen, stopped, logp

    def _maybe_call(self, row: int, t: int) -> None:
        box = self.box
        close = box.protocol.close
        text = box.tokenizer.decode(self.tokens[row, self.segment_start[row]: t + 1].tolist(), skip_special_tokens=True)
        end = text.find(close)
        if end < 0:
            return
        started = time.perf_counter()
        if len(self.calls[row]) >= box.max_calls:
            call = ToolCall(error=f"at most {box.max_calls} tool calls per completion")
        else:
            call = box.protocol.parse(text[: end + len(close)])
        result, failed = run_tool(call, self.tools_of(row), box.timeout)
        ids = []
        for piece, is_markup in box.protocol.result_pieces(result, call):
            ids += box.tokenizer(piece, add_special_tokens=False, split_special_tokens=not is_markup)["input_ids"]
        ids = ids[: self.max_new_tokens - t - 1]  # what fits before the completion's budget ends
        if ids:
            self.pending[row] = ids
        # The next call is searched for after the result: a result's own text (an error quoting "</tool>", a tool
        # returning a call) is never read as a call.
        self.segment_start[row] = t + 1 + len(ids)
        self.calls[row].append(ToolUse(call.name, call.arguments, result, failed, t + 1, len(ids),
                                       time.perf_counter() - started))

    def tool_mask(self, width: int, device: torch.device | str) -> Tensor:
        """(N, width) long: 1 on every inserted token."""
        mask = torch.zeros(len(self.calls), self.max_new_tokens, dtype=torch.long)
        if self.inserted:
            rows, columns = zip(*self.inserted)
            mask[list(rows), list(columns)] = 1
        return mask[:, :width].to(device)
