"""The built-in ``code_tests`` reward: the program in each completion, run in :mod:`grpokit.sandbox` (never this
process) against its row's ``tests`` column; the fraction of the tests it passes, or 1/0 (``binary``).

The program (:func:`extract_program`): the last fenced code block inside the completion's last
``<answer>…</answer>``; else the last fenced block of the completion (````` ```python `````, ````` ```py ````` or a
bare ````` ``` `````; other languages are skipped; a block needs its closing fence); else the text inside
``<answer>…</answer>``. A completion given as chat messages is read in its assistant messages. No program: 0.0.

The tests (:func:`parse_tests`): a list of ``assert`` statements (any Python statements: one that raises fails), or
stdin/stdout cases as in APPS and CodeContests, ``{"inputs": [...], "outputs": [...]}`` or a list of ``{"input":
..., "output": ...}``; either also as JSON text (a CSV column). Outputs are compared after trailing whitespace is
dropped from each line and trailing empty lines from the end. No tests (None, empty): the reward does not apply.

Assert tests run in one program per completion (:func:`assert_harness`): the completion's program runs as the
module ``solution`` (its ``if __name__ == "__main__":`` block does not run, its stdin is empty and its stdout is
discarded), then each test in its own ``try``, the harness printing a line per test marked with a random nonce
that the sandbox receives on stdin, read before the program runs. Only marks after the harness's mark that the
program finished count, so a program that prints marks, or exits early (``sys.exit``, ``os._exit``, an exception
at the top level), passes nothing. The tests run in the program's process: a program written to read the harness's
memory (its frames, for the nonce) or to return objects equal to anything can still fool them; stdin/stdout cases,
checked here outside the sandbox, cannot be. Each stdin/stdout case is one run of the program (exit code 0 and the
output match). All of a call's runs go to :meth:`~grpokit.sandbox.Sandbox.run_many` at once.

A completion whose run the sandbox itself failed (``sandbox_error``: not the program's fault) scores None and is
counted; a timeout scores what passed before it. :class:`CodeTests` counts, for the run's metrics
(docs/metrics.md): runs, missing programs, tests and passes, timeouts, sandbox errors and seconds.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from grpokit.core.answers import Text
from grpokit.sandbox import Limits, Result, Sandbox

__all__ = ["AssertTests", "CodeTestCounts", "CodeTests", "StdioTests", "assert_harness", "code_counts", "code_tests",
           "extract_program", "make_code_tests", "parse_tests", "same_output"]

LANGUAGES = ("python", "py", "python3", "")  # fence info strings taken as Python
_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[^\n`]*$")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


# ---- the program ------------------------------------------------------------------------------


def assistant_text(completion: Text) -> str:
    """A completion's text: itself, or its assistant messages' contents (in order, one per line)."""
    if isinstance(completion, str):
        return completion
    return "\n".join(m["content"] for m in completion
                     if m.get("role") == "assistant" and isinstance(m.get("content"), str))


def _python_blocks(text: str) -> list[str]:
    """The closed fenced blocks of ``text`` whose info string names Python (or is empty), in order."""
    blocks, language, lines = [], None, []
    for line in text.split("\n"):
        fence = _FENCE.match(line)
        if language is None:
            if fence:
                language, lines = fence.group(1).lower(), []
        elif fence and not fence.group(1) and line.strip() == "```":
            if language in LANGUAGES:
                blocks.append("\n".join(lines))
            language = None
        else:
            lines.append(line)
    return blocks


def extract_program(completion: Text) -> str | None:
    """The program a completion holds (the module's docstring says where it is looked for); None if none.

    >>> extract_program("Try this:\\n```python\\nprint(1)\\n```\\nor\\n```py\\nprint(2)\\n```")
    'print(2)'
    >>> extract_program("<think>x</think><answer>def f(): return 3</answer>")
    'def f(): return 3'
    >>> extract_program("```bash\\nls\\n```") is None
    True
    """
    text = assistant_text(completion)
    answers = _ANSWER.findall(text)
    inside = _python_blocks(answers[-1]) if answers else []
    blocks = inside or _python_blocks(text)
    program = blocks[-1] if blocks else answers[-1] if answers else None
    return program if program is not None and program.strip() else None


# ---- the tests --------------------------------------------------------------------------------


@dataclass(frozen=True)
class AssertTests:
    """Statements run after the program, each on its own: it passes when it raises nothing."""

    statements: tuple[str, ...]


@dataclass(frozen=True)
class StdioTests:
    """(stdin, expected stdout) cases, each one run of the program."""

    cases: tuple[tuple[str, str], ...]


def parse_tests(value: Any, where: str = "tests") -> AssertTests | StdioTests | None:
    """A row's ``tests`` value (the module's docstring) → its tests; None for no tests (None or empty). Anything
    else, or an assert test that is not valid Python (compiled, never run, here), raises ValueError naming
    ``where``."""
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: text that is not JSON ({error.msg}): {value[:80]!r}") from None
    if value is None or (isinstance(value, (list, tuple, dict)) and not value):
        return None
    if isinstance(value, dict):
        keys = sorted(value)
        names = ("inputs", "outputs") if "inputs" in value else ("input", "output")
        if keys != sorted(names):
            raise ValueError(f"{where}: a dict of stdin/stdout cases has the keys 'inputs' and 'outputs' (lists of "
                             f"equal length); got {keys}")
        inputs, outputs = value[names[0]], value[names[1]]
        if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
            raise ValueError(f"{where}: 'inputs' and 'outputs' must be lists of equal length")
        return _stdio(list(zip(inputs, outputs)), where)
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{where}: expected a list of assert statements or stdin/stdout cases, got "
                         f"{type(value).__name__} {value!r:.80}")
    if all(isinstance(item, dict) for item in value):
        pairs = []
        for j, case in enumerate(value):
            if set(case) != {"input", "output"}:
                raise ValueError(f"{where}: case {j} has the keys {sorted(case)}; a stdin/stdout case is "
                                 "{'input': ..., 'output': ...}")
            pairs.append((case["input"], case["output"]))
        return _stdio(pairs, where)
    for j, statement in enumerate(value):
        if not isinstance(statement, str):
            raise ValueError(f"{where}: test {j} is {type(statement).__name__} {statement!r:.80}; expected an assert "
                             "statement (text)")
        try:
            compile(statement, f"test {j}", "exec")
        except (SyntaxError, ValueError) as error:
            raise ValueError(f"{where}: test {j} is not valid Python ({error}): {statement[:80]!r}") from None
    return AssertTests(tuple(value))


def _stdio(pairs: list[tuple[Any, Any]], where: str) -> StdioTests:
    for j, (given, expected) in enumerate(pairs):
        if not isinstance(given, str) or not isinstance(expected, str):
            raise ValueError(f"{where}: case {j}'s input and output must be text, got "
                             f"{type(given).__name__} and {type(expected).__name__}")
    return StdioTests(tuple(pairs))


def same_output(got: str, expected: str) -> bool:
    """Equal after dropping trailing whitespace from each line and empty lines from the end (``\\r\\n`` read as
    ``\\n``)."""
    def normal(text: str) -> list[str]:
        lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while lines and not lines[-1]:
            lines.pop()
        return lines
    return normal(got) == normal(expected)


# ---- the harness of assert tests ----------------------------------------------------------------

_HARNESS = '''\
import builtins, os, sys, traceback, types
def _harness(program, tests):
    # What the harness calls after the program ran is bound first: the program may rebind any name it can reach.
    _compile, _exec, _write, _error, _enumerate = compile, exec, os.write, BaseException, enumerate
    _builtins, _saved = builtins.__dict__, dict(builtins.__dict__)
    nonce = sys.stdin.readline().strip()
    null, marks = os.open(os.devnull, os.O_RDWR), os.dup(1)
    os.dup2(null, 0)  # the program's stdin is empty
    os.dup2(null, 1)  # and its stdout discarded: only the marks reach it
    mark = lambda text: _write(marks, ("\\n" + nonce + " " + text + "\\n").encode())
    module = types.ModuleType("solution")
    sys.modules["solution"] = module
    try:
        _exec(_compile(program, "solution.py", "exec"), module.__dict__)
    except _error:  # SystemExit too: a program that exits ran no test
        traceback.print_exc()
        return
    _builtins.clear()  # the tests see the builtins as they were, whatever the program replaced
    _builtins.update(_saved)
    module.__dict__["__builtins__"] = builtins
    mark("RAN")
    for i, test in _enumerate(tests):
        try:
            _exec(_compile(test, "test_%d" % i, "exec"), module.__dict__)
        except _error:
            mark("FAIL %d" % i)
        else:
            mark("PASS %d" % i)
    mark("END")
_harness(PROGRAM, TESTS)
'''


def assert_harness(program: str, tests: Sequence[str]) -> str:
    """The source the sandbox runs for assert tests: the harness, with ``program`` and ``tests`` as literals. Run it
    with a fresh nonce line as stdin and read its stdout with :func:`passed_asserts`."""
    return _HARNESS.replace("_harness(PROGRAM, TESTS)", f"_harness({program!r}, {tuple(tests)!r})")


def passed_asserts(stdout: str, nonce: str, count: int) -> int:
    """How many of ``count`` tests the harness marked passed, after its mark that the program ran (0 without it)."""
    lines = stdout.split("\n")
    try:
        start = lines.index(f"{nonce} RAN")
    except ValueError:
        return 0
    passed = {line.removeprefix(f"{nonce} PASS ") for line in lines[start + 1:] if line.startswith(f"{nonce} PASS ")}
    return sum(str(i) in passed for i in range(count))


# ---- the reward -------------------------------------------------------------------------------


@dataclass
class CodeTestCounts:
    """Running totals of a :class:`CodeTests` (over this process's calls); subtract two for what happened between."""

    runs: int = 0  # programs the sandbox ran
    missing: int = 0  # completions without a program
    tests: int = 0  # tests of the completions scored
    passed: int = 0
    timeouts: int = 0  # runs killed at the wall-clock limit
    sandbox_errors: int = 0  # runs the sandbox itself failed (their completions score None)
    seconds: float = 0.0  # wall seconds waiting for the sandbox

    def __add__(self, other: CodeTestCounts) -> CodeTestCounts:
        return CodeTestCounts(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __sub__(self, other: CodeTestCounts) -> CodeTestCounts:
        return CodeTestCounts(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def stats(self) -> dict[str, float]:
        """As a step's sampling counts (summed over rounds and processes): ``code_tests_passed`` and
        ``code_tests_tests`` become the metric ``code_tests_pass_rate`` (docs/metrics.md)."""
        return {"code_tests_runs": self.runs, "code_tests_missing": self.missing, "code_tests_passed": self.passed,
                "code_tests_tests": self.tests, "code_tests_timeouts": self.timeouts,
                "code_tests_sandbox_errors": self.sandbox_errors, "time_sandbox": self.seconds}


class CodeTests:
    """The ``code_tests`` reward (the module's docstring), called as TRL calls reward functions:
    ``reward(completions=[...], tests=[...])`` → one float (or None) per completion. Its sandbox is created at the
    first call, or by :meth:`start_sandbox`; :attr:`counts` holds its running totals."""

    def __init__(self, binary: bool = False, limits: Limits | None = None, isolation: str = "bwrap",
                 workers: int | None = None, name: str = "code_tests"):
        self.binary, self.isolation, self.workers, self.__name__ = binary, isolation, workers, name
        self.limits = limits or Limits()
        self.counts = CodeTestCounts()
        self._sandbox: Sandbox | None = None
        self._lock = threading.Lock()

    def start_sandbox(self) -> Sandbox:
        """The sandbox, created on first use (raises :class:`~grpokit.sandbox.SandboxUnavailable` where bwrap is
        asked for and cannot start)."""
        with self._lock:
            if self._sandbox is None:
                self._sandbox = Sandbox(isolation=self.isolation, limits=self.limits, workers=self.workers)
            return self._sandbox

    def __call__(self, completions: Sequence[Text], tests: Sequence[Any], **kwargs: Any) -> list[float | None]:
        if len(tests) != len(completions):
            raise ValueError(f"{self.__name__}: {len(completions)} completions but {len(tests)} tests")
        # A batch of one (as calling.py retries a failing batch) is named by the caller.
        where = ["column 'tests'"] if len(tests) == 1 else [f"column 'tests' (the row of completion {i})"
                                                              for i in range(len(tests))]
        parsed = [parse_tests(value, name) for value, name in zip(tests, where)]
        programs = [extract_program(c) if t is not None else None for c, t in zip(completions, parsed)]
        nonce = secrets.token_hex(16)
        jobs: list[tuple[str, str]] = []
        spans: list[slice] = []  # each completion's runs in `jobs`
        for program, cases in zip(programs, parsed):
            start = len(jobs)
            if program is not None and isinstance(cases, AssertTests):
                jobs.append((assert_harness(program, cases.statements), nonce + "\n"))
            elif program is not None and isinstance(cases, StdioTests):
                jobs += [(program, given) for given, _ in cases.cases]
            spans.append(slice(start, len(jobs)))
        started = time.perf_counter()
        results = self.start_sandbox().run_many(jobs) if jobs else []
        counts = CodeTestCounts(runs=len(jobs), seconds=time.perf_counter() - started,
                                timeouts=sum(r.timed_out for r in results),
                                sandbox_errors=sum(r.sandbox_error is not None for r in results))
        scores: list[float | None] = []
        for program, cases, span in zip(programs, parsed, spans):
            if cases is None:
                scores.append(None)
                continue
            n = len(cases.statements) if isinstance(cases, AssertTests) else len(cases.cases)
            runs = results[span]
            if program is None:
                counts.missing += 1
                passed = 0
            elif any(r.sandbox_error is not None for r in runs):
                scores.append(None)
                continue
            else:
                passed = self._passed(cases, runs, nonce)
            counts.tests, counts.passed = counts.tests + n, counts.passed + passed
            scores.append(float(passed == n) if self.binary else passed / n)
        with self._lock:
            self.counts = self.counts + counts
        return scores

    @staticmethod
    def _passed(cases: AssertTests | StdioTests, runs: list[Result], nonce: str) -> int:
        if isinstance(cases, AssertTests):
            return passed_asserts(runs[0].stdout, nonce, len(cases.statements))
        return sum(r.exit_code == 0 and not r.timed_out and same_output(r.stdout, expected)
                   for r, (_, expected) in zip(runs, cases.cases))


def code_counts(reward_funcs: Sequence[Any]) -> CodeTestCounts | None:
    """The running counts of the :class:`CodeTests` among ``reward_funcs``, summed; None when there is none."""
    counts = [fn.counts for fn in reward_funcs if isinstance(fn, CodeTests)]
    return sum(counts, CodeTestCounts()) if counts else None


def make_code_tests(binary: bool = False, limits: Limits | None = None, isolation: str = "bwrap",
                    workers: int | None = None, name: str = "code_tests") -> CodeTests:
    """A ``code_tests`` reward: ``binary`` scores 1.0 when every test passes, else 0.0 (default: the fraction
    passed); ``limits`` (default :class:`~grpokit.sandbox.Limits`), ``isolation`` ('bwrap' or 'process') and
    ``workers`` (programs run at once; default: the CPU count) are its sandbox's; ``name`` is its name in the metrics
    (``rewards/<name>``)."""
    return CodeTests(binary=binary, limits=limits, isolation=isolation, workers=workers, name=name)


code_tests = make_code_tests()
