"""A generated problem set for code rewards: small Python functions to write from a description and two
examples, each checked by assert tests (the ``code_tests`` reward), with a fixed split into training and held-out
problems.

A problem is a family (say, "the numbers of a list greater than K") at one constant K (or character C). Its prompt
names the function, says what it returns ("Write a Python function `count_above(nums)` that returns how many numbers
in the list nums are greater than 4.") and shows two calls with their results, as a doctest does.

Its reference solution is one fenced block (``solution``), its tests six asserts: the prompt's two examples and
four unseen inputs, drawn until they tell the function from the family's at every other constant and expect at least
two different values. The held-out problems are a fixed quarter of the (family, constant) pairs, chosen by a hash, so
every family appears on both sides but a held-out problem's constant never appears in training for that family.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["FAMILIES", "Problem", "held_out_problems", "problems", "train_problems"]

TESTS_PER_PROBLEM = 6  # the prompt's 2 examples and 4 more
HELD_OUT_SHARE = 4  # one problem in 4 is held out


def _int(rng: random.Random, k: Any) -> int:
    return rng.randint(0, 50)


def _ints(rng: random.Random, k: Any) -> list[int]:
    return [rng.randint(0, 25) for _ in range(rng.randint(2, 6))]


def _items(rng: random.Random, k: Any) -> list[int]:
    return [rng.randint(0, 9) for _ in range(rng.randint(k + 1, k + 5))]


def _word(rng: random.Random, c: Any) -> str:
    # words from a few letters, and the character C twice over, so that C occurs often but not always
    letters = "abcdeflmnorst" + (c * 2 if isinstance(c, str) else "")
    return "".join(rng.choice(letters) for _ in range(rng.randint(3, 8)))


def _sentence(rng: random.Random, k: Any) -> str:
    words = ["a", "an", "on", "the", "cat", "blue", "jump", "river", "ocean", "orange", "garden", "quickly",
             "morning", "mountain", "beautiful"]  # every length from 1 to 9
    return " ".join(rng.choice(words) for _ in range(rng.randint(3, 6)))


@dataclass(frozen=True)
class Family:
    """One kind of function: ``name`` and ``arg`` as the prompt names them, ``does`` the rest of the prompt's
    sentence ("returns ..."), ``body`` the reference solution's return expression and ``value(k, arg)`` the same
    in Python (a test runs every reference solution against its tests, so the two cannot drift apart),
    ``inputs`` draws an argument and ``constants`` are the values of K (or the character C) the family takes;
    ``{k}`` in the texts stands for the constant."""

    name: str
    arg: str
    does: str
    body: str
    value: Callable[[Any, Any], Any]
    inputs: Callable[[random.Random, Any], Any]
    constants: tuple[Any, ...]


_K = tuple(range(2, 22))  # 20 constants
_SHORT = tuple(range(2, 10))  # list lengths and strides
_C = tuple("abcdeilmnorst")

FAMILIES: tuple[Family, ...] = (
    Family("add_{k}", "x", "returns x plus {k}", "x + {k}", lambda k, x: x + k, _int, _K),
    Family("minus_{k}", "x", "returns x minus {k}", "x - {k}", lambda k, x: x - k, _int, _K),
    Family("times_{k}", "x", "returns x multiplied by {k}", "x * {k}", lambda k, x: x * k, _int, _K),
    Family("is_multiple_of_{k}", "n", "returns True if n is divisible by {k}, else False", "n % {k} == 0",
           lambda k, n: n % k == 0, _int, _K),
    Family("cap_at", "x", "returns x, or {k} if x is larger than {k}", "min(x, {k})", lambda k, x: min(x, k),
           _int, _K),
    Family("count_above", "nums", "returns how many numbers in the list nums are greater than {k}",
           "sum(1 for v in nums if v > {k})", lambda k, nums: sum(1 for v in nums if v > k), _ints, _K),
    Family("count_below", "nums", "returns how many numbers in the list nums are less than {k}",
           "sum(1 for v in nums if v < {k})", lambda k, nums: sum(1 for v in nums if v < k), _ints, _K),
    Family("sum_above", "nums", "returns the sum of the numbers in the list nums that are greater than {k}",
           "sum(v for v in nums if v > {k})", lambda k, nums: sum(v for v in nums if v > k), _ints, _K),
    Family("add_to_each", "nums", "returns a new list with {k} added to every number of the list nums",
           "[v + {k} for v in nums]", lambda k, nums: [v + k for v in nums], _ints, _K),
    Family("keep_multiples", "nums", "returns the numbers of the list nums that are divisible by {k}, in order",
           "[v for v in nums if v % {k} == 0]", lambda k, nums: [v for v in nums if v % k == 0], _ints, _K),
    Family("first_items", "items", "returns the first {k} elements of the list items", "items[:{k}]",
           lambda k, items: items[:k], _items, _SHORT),
    Family("last_items", "items", "returns the last {k} elements of the list items", "items[-{k}:]",
           lambda k, items: items[-k:], _items, _SHORT),
    Family("every_nth", "items", "returns every {k}th element of the list items, starting with the first",
           "items[::{k}]", lambda k, items: items[::k], _items, _SHORT),
    Family("repeat_text", "s", "returns the string s repeated {k} times", "s * {k}", lambda k, s: s * k, _word,
           (2, 3, 4, 5)),
    Family("count_char", "s", "returns how many times the letter '{k}' appears in the string s", "s.count('{k}')",
           lambda c, s: s.count(c), _word, _C),
    Family("remove_char", "s", "returns the string s with every letter '{k}' removed", "s.replace('{k}', '')",
           lambda c, s: s.replace(c, ""), _word, _C),
    Family("starts_with", "s", "returns True if the string s starts with the letter '{k}', else False",
           "s.startswith('{k}')", lambda c, s: s.startswith(c), _word, _C),
    Family("ends_with", "s", "returns True if the string s ends with the letter '{k}', else False",
           "s.endswith('{k}')", lambda c, s: s.endswith(c), _word, _C),
    Family("long_words", "text", "returns how many words of the sentence text have more than {k} letters",
           "sum(1 for w in text.split() if len(w) > {k})", lambda k, text: sum(1 for w in text.split() if len(w) > k),
           _sentence, (2, 3, 4, 5, 6, 7)),
)


@dataclass(frozen=True)
class Problem:
    """A problem: its ``prompt``, its ``tests`` (assert statements) and a reference ``solution`` (a fenced
    block); ``family`` and ``constant`` say where it came from."""

    family: str
    constant: Any
    prompt: str
    tests: tuple[str, ...]
    solution: str

    def row(self) -> dict[str, Any]:
        """The problem as a dataset row for ``code_tests``: ``prompt`` and ``tests``."""
        return {"prompt": self.prompt, "tests": list(self.tests), "family": self.family}


def _problem(family: Family, constant: Any) -> Problem:
    fill = lambda text: text.replace("{k}", str(constant))  # noqa: E731
    name, arg = fill(family.name), family.arg
    rng = random.Random(f"{family.name}/{constant}")
    others = [c for c in family.constants if c != constant]
    inputs: list[Any] = []
    for _ in range(10_000):
        value = family.inputs(rng, constant)
        if value in inputs:
            continue
        inputs.append(value)
        if len(inputs) > TESTS_PER_PROBLEM:
            del inputs[2]  # the oldest after the prompt's two examples
        if len(inputs) == TESTS_PER_PROBLEM and _telling(family, constant, others, inputs):
            break
    else:
        raise RuntimeError(f"no telling tests found for {family.name} at {constant!r}")
    calls = [(f"{name}({value!r})", family.value(constant, value)) for value in inputs]
    asserts = tuple(f"assert {call} == {expected!r}" for call, expected in calls)
    examples = "\n".join(f">>> {call}\n{expected!r}" for call, expected in calls[:2])
    prompt = f"Write a Python function `{name}({arg})` that {fill(family.does)}.\n\n{examples}"
    solution = f"```python\ndef {name}({arg}):\n    return {fill(family.body)}\n```"
    return Problem(family.name, constant, prompt, asserts, solution)


def _telling(family: Family, constant: Any, others: list[Any], inputs: list[Any]) -> bool:
    """Whether the tests on ``inputs`` tell this problem's function from the family's at every other constant, and
    expect at least two different values (so that no constant answer passes them all)."""
    expected = [family.value(constant, value) for value in inputs]
    return (len({repr(e) for e in expected}) > 1
            and all(any(family.value(other, value) != e for value, e in zip(inputs, expected)) for other in others))


def _held_out(problem: Problem) -> bool:
    digest = hashlib.sha256(f"{problem.family}/{problem.constant}".encode()).digest()
    return digest[0] % HELD_OUT_SHARE == 0


def problems() -> list[Problem]:
    """Every problem, family by family."""
    return [_problem(family, constant) for family in FAMILIES for constant in family.constants]


def train_problems() -> list[Problem]:
    return [p for p in problems() if not _held_out(p)]


def held_out_problems() -> list[Problem]:
    return [p for p in problems() if _held_out(p)]
