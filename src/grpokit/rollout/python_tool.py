"""The built-in ``python`` tool (``tools: [python]``): the model writes a program, :mod:`grpokit.sandbox` runs it
(never this process), and what it printed — or the end of its error, or that it timed out — comes back as the
result. :func:`make_python_tool` builds one for a sandbox's isolation and limits; :data:`python` is the default
(bwrap, :func:`sandbox_limits`), whose sandbox starts at its first call, so importing grpokit starts none.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from typing import Any

from grpokit.sandbox import Limits, Result, Sandbox

__all__ = ["make_python_tool", "python", "result_text", "sandbox_limits", "start_sandboxes"]

MAX_TEXT = 1000  # characters of output or error given back (the result is cut to 1,024 in all)


def sandbox_limits(seconds: float = 5.0) -> Limits:
    """A sandbox's limits for one program of ``seconds`` wall time and as many CPU seconds (rounded up): the
    ``sandbox_timeout`` key of a run's config, for the tool and the ``code_tests`` reward alike."""
    return Limits(wall_seconds=seconds, cpu_seconds=max(1, math.ceil(seconds)))


def result_text(result: Result) -> str:
    """What the model reads of a run: its stdout (the first :data:`MAX_TEXT` characters, trailing whitespace
    dropped; "(no output)" when it printed nothing), or ``error: ...``: the sandbox's own failure, a timeout, or the
    last characters of the traceback (stderr) of a program that failed."""
    if result.sandbox_error is not None:
        return f"error: the sandbox failed: {result.sandbox_error}"[:MAX_TEXT]
    if result.timed_out:
        return "error: timed out"
    if result.exit_code != 0:
        # A traceback's last lines name the error; its start is the interpreter's frames.
        detail = result.stderr.strip()[-MAX_TEXT:] or f"exit code {result.exit_code}"
        return f"error: {detail}"
    out = result.stdout.rstrip()
    if not out:
        return "(no output)"
    cut = len(out) > MAX_TEXT or result.truncated
    return out[:MAX_TEXT] + (" …(cut)" if cut else "")


def make_python_tool(isolation: str = "bwrap", limits: Limits | None = None) -> Callable[[str], str]:
    """The ``python`` tool on a :class:`~grpokit.sandbox.Sandbox` of ``isolation`` and ``limits`` (default
    :func:`sandbox_limits`), created at the first call; ``tool.start_sandbox()`` creates it before (raising
    :class:`~grpokit.sandbox.SandboxUnavailable` where bwrap cannot start) and returns it."""
    limits = limits or sandbox_limits()
    created: list[Sandbox] = []
    lock = threading.Lock()

    def start_sandbox() -> Sandbox:
        with lock:
            if not created:
                created.append(Sandbox(isolation=isolation, limits=limits))
            return created[0]

    def python(code: str) -> str:
        """Run a Python program in a sandbox and return what it printed.

        Args:
            code: the program's source; print what you want to see (e.g. "print(sum(range(10)))").

        Returns:
            Its standard output, or "error: ..." with the end of its traceback, or "error: timed out".
        """
        if not isinstance(code, str):
            return f"error: code must be text, got {type(code).__name__}"
        return result_text(start_sandbox().run(code))

    python.start_sandbox = start_sandbox  # type: ignore[attr-defined]
    return python


python = make_python_tool()


def start_sandboxes(users: Iterable[Any]) -> list[str]:
    """Start the sandbox of each reward function or tool among ``users`` that runs model-written code (those with a
    ``start_sandbox()``: ``code_tests``, ``python``), so that a run refuses at start-up, with
    :class:`~grpokit.sandbox.SandboxUnavailable` saying why, rather than at its first program; return what each
    sandbox is (its ``describe()``), once per distinct text."""
    return list(dict.fromkeys(fn.start_sandbox().describe() for fn in users
                              if callable(getattr(fn, "start_sandbox", None))))
