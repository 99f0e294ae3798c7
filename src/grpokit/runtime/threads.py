"""A thread pool that never holds up the interpreter's exit: :class:`DaemonPool`.

``concurrent.futures.ThreadPoolExecutor`` joins its threads when the interpreter exits, so one call that never
returns (an environment's ``reset`` waiting on a server that stopped answering, while another's error stops the run)
keeps a failed run alive forever. The tools' and environments' calls (:class:`~grpokit.rollout.tools.ToolBox`) run
here instead: daemon threads, which the exit abandons. A run that ends well has waited for every call it made.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


class DaemonPool(Executor):
    """Up to ``workers`` daemon threads, started as calls come (``submit``, and ``map`` through it)."""

    def __init__(self, workers: int, name: str = "pool"):
        if workers < 1:
            raise ValueError(f"DaemonPool: workers must be at least 1, got {workers}")
        self.workers, self.name = workers, name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting for a call
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: submit after shutdown")
            self._calls.put((future, fn, args, kwargs))
            if self._idle:
                self._idle -= 1  # the call is that thread's
            elif len(self._threads) < self.workers:
                thread = threading.Thread(target=self._work, name=f"{self.name}_{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
        return future

    def _work(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:  # shutdown
                return
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as error:  # handed to whoever waits on the future
                    future.set_exception(error)
                else:
                    future.set_result(result)
            del item, future, fn, args, kwargs  # hold nothing of the call while idle
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        while cancel_futures:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in threads:
            self._calls.put(None)
        if wait:
            for thread in threads:
                thread.join()
