"""What a rollout records of a completion's tool calls (:class:`ToolUse`), the tools an environment offers, and a
trajectory with tool calls as chat messages, as TRL passes it to reward functions."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


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


NOT_TOOLS = ("reset", "reply", "end", "reward", "get_reward")  # an environment's protocol, not its tools


def environment_tools(environment: Any) -> dict[str, Callable]:
    """The tools an environment offers: its public methods but ``reset`` and its reward (as TRL lists them,
    on the class, so properties are not evaluated)."""
    return {name: getattr(environment, name) for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
            if not name.startswith("_") and name not in NOT_TOOLS}


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
