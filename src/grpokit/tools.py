"""Tools a model may call during a rollout. A tool is a plain function with type hints and a docstring (as in
TRL); its result, or the text of its error, goes back to the model.

The plain-text protocol: the model writes ``<tool>{"name": ..., "arguments": {...}}</tool>``; the rollout
pauses there, :func:`parse_tool_call` reads the call, :func:`run_tool` runs it, and ``<result>…</result>``
holding its text is appended. Every malformed call has a defined answer (an ``error: ...`` text, counted),
never an exception.

``calculator`` is the built-in tool: arithmetic on decimal numbers, parsed here (never ``eval``), with bounded
sizes, so that whatever a model writes gets a short text back and nothing else happens.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal, DivisionByZero, InvalidOperation, localcontext
from typing import Any

__all__ = ["ToolCall", "calculator", "call_with_timeout", "parse_tool_call", "run_tool"]

TOOL_OPEN, TOOL_CLOSE = "<tool>", "</tool>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
MAX_CALL = 4096  # characters between <tool> and </tool>
MAX_RESULT = 1024  # characters of a result given back to the model


class Overran(Exception):
    """A call took longer than its timeout (its thread is abandoned, not killed)."""


def call_with_timeout(fn: Callable[..., Any], kwargs: Mapping[str, Any], timeout: float | None,
                      name: str = "call") -> Any:
    """``fn(**kwargs)``; with a timeout, in a daemon thread abandoned (not killed) if it overruns, raising
    :class:`Overran`. The function's own exception is raised in the caller's thread."""
    if timeout is None:
        return fn(**kwargs)
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn(**kwargs)
        except Exception as error:  # handed to the caller's thread
            result["error"] = error

    thread = threading.Thread(target=target, daemon=True, name=name)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise Overran(f"{name} took longer than {timeout} s")
    if "error" in result:
        raise result["error"]
    return result["value"]


@dataclass
class ToolCall:
    """A call read from the model's text: the tool's name and arguments, or why it could not be read."""

    name: str | None = None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # set when the call is malformed; the model gets it back as the result


def parse_tool_call(text: str) -> ToolCall | None:
    """The call that ``text`` ends with — ``<tool>{"name": ..., "arguments": {...}}</tool>`` — or None when
    it does not end with ``</tool>``. A ``</tool>`` without its ``<tool>``, a nested ``<tool>``, a call
    longer than ``MAX_CALL`` characters, text that is not a JSON object, a missing or non-text name, or
    arguments that are not an object give a :class:`ToolCall` with ``error`` set."""
    if not text.endswith(TOOL_CLOSE):
        return None
    start = text.rfind(TOOL_OPEN, 0, len(text) - len(TOOL_CLOSE))
    if start < 0:
        return ToolCall(error=f"{TOOL_CLOSE} without a {TOOL_OPEN} before it")
    body = text[start + len(TOOL_OPEN):-len(TOOL_CLOSE)]
    if TOOL_CLOSE in body:
        return ToolCall(error=f"{TOOL_CLOSE} without a {TOOL_OPEN} before it")
    opener = text.rfind(TOOL_OPEN, 0, start)
    if opener >= 0 and TOOL_CLOSE not in text[opener:start]:
        return ToolCall(error=f"nested {TOOL_OPEN} tags: a call is one JSON object between one {TOOL_OPEN} and "
                              f"{TOOL_CLOSE}")
    if len(body) > MAX_CALL:
        return ToolCall(error=f"the call is longer than {MAX_CALL} characters")
    try:
        call = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as error:
        return ToolCall(error=f"the call is not valid JSON ({getattr(error, 'msg', 'too deeply nested')})")
    if not isinstance(call, dict):
        return ToolCall(error='the call must be a JSON object: {"name": ..., "arguments": {...}}')
    name, arguments = call.get("name"), call.get("arguments", {})
    if not isinstance(name, str) or not name:
        return ToolCall(error='the call has no "name" (the tool\'s name, as text)')
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

MAX_EXPRESSION = 200  # characters
MAX_DEPTH = 32  # nested parentheses and signs
MAX_DIGITS = 30  # per number written
MAX_MAGNITUDE = Decimal(10) ** 30  # of any intermediate result
PRECISION = 28  # significant digits of a quotient

_OPERATORS = {"+": "+", "-": "-", "\u2212": "-", "*": "*", "\u00d7": "*", "/": "/", "\u00f7": "/"}
_DIGITS = set("0123456789")  # ASCII only: other scripts' digits are refused, not reinterpreted


class CalculatorError(ValueError):
    """What the calculator answers instead of a number."""


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers (decimals allowed), + − × ÷ (or + - * /), parentheses.

    Args:
        expression: the expression, e.g. "(123 + 4.5) × 6".

    Returns:
        The result as text ("765", "0.5"), or "error: ..." saying why there is none.
    """
    try:
        if not isinstance(expression, str):
            raise CalculatorError(f"the expression must be text, got {type(expression).__name__}")
        if len(expression) > MAX_EXPRESSION:
            raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION} characters")
        with localcontext() as context:
            context.prec = PRECISION
            context.traps[DivisionByZero] = context.traps[InvalidOperation] = True
            parser = _Parser(_tokens(expression))
            value = parser.expression(0)
            if parser.peek() is not None:
                raise CalculatorError(f"unexpected {parser.peek()!r}")
            return _text(value)
    except CalculatorError as error:
        return f"error: {error}"
    except (DivisionByZero, InvalidOperation):
        return "error: division by zero"


def _tokens(expression: str) -> list[str]:
    tokens, i = [], 0
    while i < len(expression):
        c = expression[i]
        if c.isspace():
            i += 1
        elif c in _DIGITS or c == ".":
            j = i
            while j < len(expression) and (expression[j] in _DIGITS or expression[j] == "."):
                j += 1
            number = expression[i:j]
            if number.count(".") > 1 or number == ".":
                raise CalculatorError(f"{number!r} is not a number")
            if sum(ch in _DIGITS for ch in number) > MAX_DIGITS:
                raise CalculatorError(f"a number has more than {MAX_DIGITS} digits")
            tokens.append(number)
            i = j
        elif c in _OPERATORS or c in "()":
            if expression.startswith("**", i):
                raise CalculatorError("powers are not supported (only + − × ÷)")
            tokens.append(_OPERATORS.get(c, c))
            i += 1
        else:
            shown = c if c.isprintable() else f"U+{ord(c):04X}"
            raise CalculatorError(f"unsupported character {shown!r} (only digits, '.', + − × ÷ and parentheses)")
    if not tokens:
        raise CalculatorError("the expression is empty")
    return tokens


class _Parser:
    """Recursive descent: expression = term (('+'|'-') term)*; term = factor (('*'|'/') factor)*;
    factor = ('+'|'-') factor | number | '(' expression ')'."""

    def __init__(self, tokens: list[str]):
        self.tokens, self.at = tokens, 0

    def peek(self) -> str | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise CalculatorError("the expression ends too early")
        self.at += 1
        return token

    def expression(self, depth: int) -> Decimal:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            value = _checked(value + self.term(depth) if self.take() == "+" else value - self.term(depth))
        return value

    def term(self, depth: int) -> Decimal:
        value = self.factor(depth)
        while self.peek() in ("*", "/"):
            value = _checked(value * self.factor(depth) if self.take() == "*" else value / self.factor(depth))
        return value

    def factor(self, depth: int) -> Decimal:
        if depth > MAX_DEPTH:
            raise CalculatorError(f"nested more than {MAX_DEPTH} deep")
        token = self.take()
        if token in ("+", "-"):
            value = self.factor(depth + 1)
            return -value if token == "-" else value
        if token == "(":
            value = self.expression(depth + 1)
            if self.take() != ")":
                raise CalculatorError("a '(' is not closed")
            return value
        if token in (")", "*", "/"):
            raise CalculatorError(f"unexpected {token!r}")
        return Decimal(token)


def _checked(value: Decimal) -> Decimal:
    if abs(value) >= MAX_MAGNITUDE:
        raise CalculatorError("the result is too large")
    return value


def _text(value: Decimal) -> str:
    """Plain notation, without trailing zeros: 765, 0.5, -2.25 (never 7.65E+2)."""
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")
