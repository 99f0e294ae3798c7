"""The built-in tool: arithmetic on decimal numbers, parsed here by recursive descent over ``Decimal`` (never
``eval``), with bounded sizes, so that whatever a model writes gets a short text back and nothing else happens.
Import it as ``grpokit.rollout.tools.calculator``."""

from __future__ import annotations

from decimal import Decimal, DivisionByZero, InvalidOperation, localcontext

MAX_EXPRESSION = 200  # characters
MAX_DEPTH = 32  # nested parentheses and signs
MAX_DIGITS = 30  # per number written
MAX_MAGNITUDE = Decimal(10) ** 30  # of any intermediate result
PRECISION = 28  # significant digits of a quotient

_OPERATORS = {"+": "+", "-": "-", "\u2212": "-", "*": "*", "\u00d7": "*", "/": "/", "\u00f7": "/"}
_DIGITS = set("0123456789")  # ASCII only: other scripts' digits are refused, not reinterpreted


class CalculatorError(ValueError):
    """What the calculator answers instead of a number."""


# Left out of the mutation audit (docs/reliability.md): its copies there are renamed, and Python's own TypeError
# for a call with wrong arguments, which the tests pin, names the function.
def calculator(expression: str) -> str:  # pragma: no mutate block
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
                raise CalculatorError("powers are not supported (only + - * /)")
            tokens.append(_OPERATORS.get(c, c))
            i += 1
        else:
            shown = c if c.isprintable() else f"U+{ord(c):04X}"
            raise CalculatorError(f"unsupported character {shown!r} (only digits, '.', + - * / and parentheses)")
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
            # copy_negate, not unary minus: exact, as a number is read; minus would round -(10**30 - 1) to -10**30
            return value.copy_negate() if token == "-" else value
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
