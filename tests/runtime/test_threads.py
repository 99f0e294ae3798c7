"""DaemonPool: the tools' and environments' thread pool, which runs calls as ThreadPoolExecutor does (results in
order, exceptions to the caller) and never holds up the interpreter's exit."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from grpokit.runtime import threads
from grpokit.runtime.threads import DaemonPool


def test_calls_run_in_at_most_workers_daemon_threads_with_results_in_order():
    pool = DaemonPool(3, "test-pool")
    seen: set[threading.Thread] = set()

    def square(x: int) -> int:
        seen.add(threading.current_thread())
        time.sleep(0.01)
        return x * x

    assert list(pool.map(square, range(12))) == [x * x for x in range(12)]
    assert 1 <= len(seen) <= 3 and all(t.daemon and t.name.startswith("test-pool_") for t in seen)
    pool.shutdown()
    assert not any(t.is_alive() for t in seen)
    with pytest.raises(RuntimeError, match="submit after shutdown"):
        pool.submit(square, 2)


def test_an_exception_reaches_the_caller_and_the_thread_goes_on():
    pool = DaemonPool(1)

    def fail() -> None:
        raise KeyError("the call's own error")

    with pytest.raises(KeyError, match="the call's own error"):
        pool.submit(fail).result(timeout=10)
    assert pool.submit(lambda: 7).result(timeout=10) == 7  # the same one thread, still serving
    pool.shutdown()


def test_shutdown_can_cancel_the_calls_not_begun():
    pool, gate = DaemonPool(1), threading.Event()
    running = pool.submit(gate.wait, 10)
    queued = pool.submit(lambda: "never")
    time.sleep(0.05)  # the one thread has taken the first call
    gate.set()
    pool.shutdown(cancel_futures=True)
    assert running.result() is True and queued.cancelled()


def test_a_call_that_never_returns_does_not_hold_up_the_exit():
    """A real interpreter (the module alone: no torch to import) whose pool runs a call that sleeps for an hour
    exits at once, where ThreadPoolExecutor's would wait for the call."""
    program = ("import importlib.util, sys, time\n"
               f"spec = importlib.util.spec_from_file_location('threads', {str(Path(threads.__file__))!r})\n"
               "module = importlib.util.module_from_spec(spec)\n"
               "spec.loader.exec_module(module)\n"
               "module.DaemonPool(2).submit(time.sleep, 3600)\n"
               "time.sleep(0.2)\n"
               "sys.exit(3)\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
