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

import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from grpokit.rollout.calculator import calculator
from grpokit.rollout.python_tool import make_python_tool, python, sandbox_limits
from grpokit.rollout.tool_calls import PlainProtocol, ToolCall, parse_tool_call, run_tool
from grpokit.user_code import call_with_timeout, load_callable

__all__ = ["INERT", "InertSession", "PlainProtocol", "ToolBox", "ToolCall", "ToolSession", "ToolUse", "calculator",
           "call_with_timeout", "parse_tool_call", "python", "run_tool"]

TOOL_COUNTS = ("tool_rate", "tool_calls", "tool_errors")  # per completion (:meth:`ToolSession.counts`)


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
    object with ``reset(**row)`` and tool methods). Built once; :meth:`session` serves one rollout. A box with
    neither is empty (falsy; :attr:`NONE` is one): a run without tools, whose sessions do nothing. Every consumer
    (the sampler, ``grpokit sample``, the evaluation) takes a box and asks it, never a None."""

    NONE: ClassVar[ToolBox]  # the empty box (set below the class)

    def __init__(self, tokenizer: Any = None, tools: Sequence[Callable] | Mapping[str, Callable] = (), *,
                 environment_factory: Callable[[], Any] | None = None, max_calls: int = 4,
                 timeout: float | None = 10.0, protocol: Any = None):
        self.tokenizer, self.tools = tokenizer, tool_functions(tools)
        self.environment_factory, self.max_calls, self.timeout = environment_factory, max_calls, timeout
        self.active = bool(self.tools) or environment_factory is not None
        self.protocol = protocol or PlainProtocol()
        self.listed_in_prompt = protocol is not None and self.active  # a chat template's protocol: prompts list them
        self.environment_methods: dict[str, Callable] = {}
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

    def schema_tools(self) -> list[Callable]:
        """Every tool a completion may call, for a chat template to describe (an environment's as methods of one
        instance: their signatures and docstrings are the class's)."""
        return [*self.tools.values(), *self.environment_methods.values()]

    def prompt_tools(self) -> list[Callable] | None:
        """The tools for the chat template to list in each prompt (``render_prompt(tools=...)``); None with the
        plain-text protocol, whose prompts say nothing of them."""
        return self.schema_tools() if self.listed_in_prompt else None

    def session(self, rows: Sequence[dict[str, Any]], group_size: int, max_new_tokens: int
                ) -> ToolSession | InertSession:
        """The state of one rollout of ``rows`` × ``group_size`` completions: each has its own environment (reset
        with its row) when there is a factory. The empty box's session is :data:`INERT`."""
        if not self.active:
            return INERT
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

    def reward_inputs(self, rollout: Any, prompts: Sequence[Any], columns: dict[str, list]
                      ) -> list[list[dict[str, Any]]] | None:
        """What reward functions get from this session's rollout (a :class:`~grpokit.rollout.generate.Rollout`)
        beyond its text: each completion's environment, added to ``columns`` as ``environments``, and, where a
        prompt is conversational, each trajectory as messages (the assistant's turns and the tool results;
        returned, else None), as TRL passes them."""
        if self.environments is not None:
            columns["environments"] = self.environments
        if not any(isinstance(prompt, list) for prompt in prompts):
            return None
        return [tool_messages(self.box.tokenizer, rollout.completion_ids[i, : int(n)].tolist(), self.calls[i])
                for i, n in enumerate(rollout.lengths.tolist())]

    def own_steps(self, steps: list[list[tuple[int, float]]], rollout: Any) -> list[list[tuple[int, float]]]:
        """Each completion's reward steps, those ending on an inserted token moved (:func:`own_token_steps`)."""
        return [own_token_steps(s, mask) for s, mask in zip(steps, rollout.model_mask.tolist())]

    def metrics(self) -> dict[str, float]:
        """The rollout's calls, failed calls and seconds spent in tools (docs/metrics.md)."""
        calls = [call for row in self.calls for call in row]
        return {"tool_calls": len(calls), "tool_errors": sum(c.failed for c in calls),
                "time_tools": sum(c.seconds for c in calls)}

    def counts(self) -> dict[str, Tensor]:
        """(N,) float per completion, under :data:`TOOL_COUNTS`'s names: whether it called a tool, its calls, its
        failed calls."""
        calls = torch.tensor([[len(c), sum(u.failed for u in c)] for c in self.calls], dtype=torch.float)
        return dict(zip(TOOL_COUNTS, ((calls[:, 0] > 0).float(), calls[:, 0], calls[:, 1])))


class InertSession:
    """The session of the empty box (a run without tools), :data:`INERT`: falsy, so ``generate`` never hands it
    a decode step (it costs nothing per step); it inserts nothing (``tool_mask`` None), gives reward functions
    nothing more, moves no step, and has no calls (``calls`` None: the rollout had no tools) nor metrics."""

    calls = environments = None

    def __bool__(self) -> bool:
        return False

    def tool_mask(self, width: int, device: torch.device | str) -> None:
        return None

    def reward_inputs(self, rollout: Any, prompts: Sequence[Any], columns: dict[str, list]) -> None:
        return None

    def own_steps(self, steps: list[list[tuple[int, float]]], rollout: Any) -> list[list[tuple[int, float]]]:
        return steps

    def metrics(self) -> dict[str, float]:
        return {}

    def counts(self) -> dict[str, Tensor]:
        return {}


INERT = InertSession()
ToolBox.NONE = ToolBox()


def own_token_steps(steps: list[tuple[int, float]], model_mask: list[int]) -> list[tuple[int, float]]:
    """Steps that end on an inserted tool token (a completion cut off inside a tool's result) moved to the
    policy's last token before it: rewards sit on the policy's actions (PPO's GAE reads them there)."""
    own = [i for i, m in enumerate(model_mask) if m]
    if not own:
        return steps
    moved: dict[int, float] = {}
    for end, reward in steps:
        if not model_mask[end]:
            end = max([i for i in own if i <= end], default=own[0])
        moved[end] = moved.get(end, 0.0) + reward
    return sorted(moved.items())
