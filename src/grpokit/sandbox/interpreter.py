"""The interpreter that runs the programs (the trainer's own by default): the path to run it by, where its
installation lies, which bwrap binds read-only, and whether an unprivileged uid can read it, which the process
isolation needs as root."""

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


def executable_path(python: str | None = None) -> str:
    """The path to run ``python`` (default: this interpreter) by: absolute, its directories' symlinks resolved,
    but not the file's own. A venv's (or uv's) ``bin/python`` is a symlink to its base interpreter, and only run
    by that link does it find the ``pyvenv.cfg`` beside it, and with it the venv's site-packages."""
    given = os.path.abspath(python or sys.executable)
    return os.path.join(os.path.realpath(os.path.dirname(given)), os.path.basename(given))


def is_this(executable: str) -> bool:
    """Whether ``executable`` (an :func:`executable_path`) is the interpreter running this process, venv and all."""
    return executable == executable_path()


@functools.cache
def installation(executable: str) -> tuple[str, ...]:
    """The directories ``executable`` (an :func:`executable_path`) needs: its prefixes (a venv's and its base's) and the
    directories above its ``bin``, as run and as the link resolves; none inside another."""
    if is_this(executable):
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
    above_bin = [os.path.dirname(os.path.dirname(file)) for file in (executable, os.path.realpath(executable))]
    dirs = sorted({os.path.realpath(directory) for directory in [*prefixes, *above_bin] if directory})
    if "/" in dirs:
        raise SandboxUnavailable(f"sandbox python: {executable} is installed at / itself, so its installation "
                                 "is the whole file system; use a Python installed under a prefix (a venv, "
                                 "pyenv, conda or /usr)")
    return tuple(directory for directory in dirs
                 if not any(inside(directory, other) and directory != other for other in dirs))


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
