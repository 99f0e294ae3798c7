"""The interpreter that runs the programs (the trainer's own by default): where its installation lies, which
bwrap binds read-only, and whether an unprivileged uid can read it, which the process isolation needs as root."""

from __future__ import annotations

import functools
import os
import stat
import subprocess
import sys

from grpokit.sandbox.limits import SandboxUnavailable

PREFIXES = "import sys; print(sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, sep='\\n')"


def inside(path: str, directory: str) -> bool:
    """Whether ``path`` is ``directory`` or lies under it (both absolute and normalised)."""
    return path == directory or path.startswith(directory.rstrip("/") + "/")


@functools.cache
def installation(executable: str) -> tuple[str, ...]:
    """The directories ``executable`` (a real path) needs: its prefixes (a venv's and its base's) and the
    directory above its ``bin``; none inside another."""
    if executable == os.path.realpath(sys.executable):
        prefixes = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    else:
        try:
            done = subprocess.run([executable, "-I", "-S", "-c", PREFIXES], capture_output=True, text=True,
                                  timeout=60)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise SandboxUnavailable(f"sandbox python: {executable} does not run: {error}") from error
        if done.returncode != 0:
            raise SandboxUnavailable(f"sandbox python: {executable} does not run: {done.stderr.strip()[-2000:]}")
        prefixes = done.stdout.splitlines()
    dirs = sorted({os.path.realpath(path) for path in [*prefixes, os.path.dirname(os.path.dirname(executable))]
                   if path})
    if "/" in dirs:
        raise SandboxUnavailable(f"sandbox python: {executable} is installed at / itself, so its installation "
                                 "is the whole file system; use a Python installed under a prefix (a venv, "
                                 "pyenv, conda or /usr)")
    return tuple(path for path in dirs if not any(inside(path, other) and path != other for other in dirs))


def closed_to_others(executable: str) -> str | None:
    """The first directory on the way to ``executable``'s installation that others cannot search (``/root``
    is 0700), or None: a uid of the run's own could not import the standard library through it."""
    for directory in installation(executable):
        parts = directory.strip("/").split("/")
        for n in range(1, len(parts) + 1):
            path = "/" + "/".join(parts[:n])
            if not os.stat(path).st_mode & stat.S_IXOTH:
                return path
    return None
