"""The plain-text protocol of tool calls: the model writes ``<tool>{"name": ..., "arguments": {...}}</tool>``; the
rollout pauses there, :func:`parse_tool_call` reads the call, :func:`run_tool` runs it, and ``<result>…</result>``
holding its text is appended. Every malformed call has a defined answer (an ``error: ...`` text, counted), never an
exception. (:mod:`grpokit.rollout.tool_templates` reads a chat template's own format instead.)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from grpokit.user_code import Overran, call_with_timeout

TOOL_OPEN, TOOL_CLOSE = "<tool>", "</tool>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
MAX_CALL = 4096  # characters between <tool> and </tool>
MAX_RESULT = 1024  # characters of a result given back to the model, by default (``max_reply_chars``)


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


def run_tool(call: ToolCall, tools: Mapping[str, Callable[..., Any]], timeout: float | None = None,
             limit: int | None = MAX_RESULT) -> tuple[str, bool]:
    """``(text, failed)``: the tool's result as text (its first ``limit`` characters; None: all of it), or,
    ``failed``, the error the model gets back instead — a malformed call, an unknown tool, arguments its signature
    refuses, an exception it raised, or a run longer than ``timeout`` seconds."""
    cut = slice(limit)
    if call.error is not None:
        return f"error: {call.error}", True
    if call.name not in tools:
        return f"error: unknown tool {call.name!r:.60}; the tools are {', '.join(sorted(tools))}", True
    try:
        value = call_with_timeout(tools[call.name], call.arguments, timeout, f"tool {call.name}")
    except Overran:
        return f"error: {call.name} took longer than {timeout} s", True
    except TypeError as error:  # arguments the signature does not take (or the tool's own TypeError)
        return f"error: {call.name}: {error}"[cut], True
    except Exception as error:
        return f"error: {call.name} raised {type(error).__name__}: {error}"[cut], True
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    failed = text.startswith("error:")  # a tool may answer its own errors as text, as calculator does
    return text[cut], failed


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
