"""User code: loading a user's function or class by path (``"path/to/file.py:name"`` or ``"package.module:name"``,
as the config names reward functions, tools and environment factories) and calling it with a timeout."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


def load_callable(spec: str, what: str) -> Callable:
    """``"path/to/file.py:name"`` or ``"package.module:name"`` → that callable, for the config key ``what``
    (``reward_funcs``, ``tools``, ``environment_factory``); errors name the key, the file or module and the
    attribute. A file is imported once, so that everything named from one file shares its module."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"{what}: {spec!r} must be 'path/to/file.py:name' or 'package.module:name'")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ValueError(f"{what}: {spec!r}: file {where!r} does not exist (relative to {Path.cwd()})")
        module_name = f"grpokit_user_{path.resolve().as_posix().strip('/').replace('/', '_').replace('.', '_')}"
        module = sys.modules.get(module_name)
        if module is None:
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module
            try:
                module_spec.loader.exec_module(module)
            except Exception as error:
                del sys.modules[module_name]
                raise ValueError(f"{what}: {spec!r}: importing {where!r} raised "
                                 f"{type(error).__name__}: {error}") from error
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as error:
            raise ValueError(f"{what}: {spec!r}: cannot import module {where!r} ({error}); a file path must "
                             "end in .py") from error
    fn = getattr(module, name, None)
    if fn is None:
        public = [n for n in vars(module) if not n.startswith("_") and callable(vars(module)[n])]
        close = difflib.get_close_matches(name, public, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; it defines {sorted(public)}"
        raise ValueError(f"{what}: {spec!r}: {where!r} has no attribute {name!r}{hint}")
    if not callable(fn):
        raise ValueError(f"{what}: {spec!r}: {where}:{name} is a {type(fn).__name__}, not a function")
    return fn


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
