"""What a sandboxed run is allowed (``Limits``), what it gives back (``Result``), and the error for a sandbox
that cannot start here (``SandboxUnavailable``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


class SandboxUnavailable(RuntimeError):
    """The isolation asked for cannot start here; the message says why, and how to choose ``isolation:
    process``, the weaker mode, explicitly."""


@dataclass(frozen=True)
class Limits:
    """Per program. Defaults suit scoring short programs; docs/sandbox.md says what each one bounds."""

    wall_seconds: float = 10.0  # the whole process tree is killed after this
    cpu_seconds: int = 5  # RLIMIT_CPU, per process: SIGXCPU, then SIGKILL a second later
    memory_mb: int = 512  # RLIMIT_AS, per process
    processes: int = 32  # RLIMIT_NPROC (threads count), for a uid of the run's own, so that it binds for root too
    file_size_mb: int = 16  # RLIMIT_FSIZE: the largest file the program can write
    open_files: int = 64  # RLIMIT_NOFILE
    output_bytes: int = 65_536  # stdout and stderr each: the rest is read and discarded, `truncated` set
    disk_mb: int = 64  # bwrap: the size of the tmpfs that is the working directory and HOME

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            # NaN compares false with everything: a NaN wall clock would never end a run
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
                raise ValueError(f"sandbox limits: {field.name} must be a positive number, got {value!r}")
        if self.processes < 2:
            raise ValueError(f"sandbox limits: processes must be at least 2, got {self.processes}")

    def rlimits(self) -> dict[str, int]:
        """The launcher's ``RLIMIT_*`` values (the name without ``RLIMIT_``; CPU's hard limit is one more)."""
        mib = 1 << 20
        return {"CPU": max(1, math.ceil(self.cpu_seconds)), "AS": int(self.memory_mb * mib),
                "NPROC": int(self.processes), "FSIZE": int(self.file_size_mb * mib), "NOFILE": int(self.open_files),
                "CORE": 0}

    def describe(self) -> str:
        return (f"wall {self.wall_seconds:g} s, cpu {self.cpu_seconds:g} s, memory {self.memory_mb:g} MB, "
                f"{self.processes} processes, files {self.file_size_mb:g} MB, {self.open_files} open files, "
                f"output {self.output_bytes} bytes, disk {self.disk_mb:g} MB")


@dataclass(frozen=True)
class Result:
    """One program's run. ``exit_code`` is the program's status, 128 + N when signal N killed it (as a shell
    reports it); None when the sandbox killed it (``timed_out``: the wall clock, or the CPU limit) or could not
    start it (``sandbox_error``)."""

    stdout: str  # decoded as UTF-8 with errors="replace", at most output_bytes
    stderr: str
    exit_code: int | None
    timed_out: bool
    sandbox_error: str | None  # the sandbox failed, not the program: count it apart from the program's errors
    seconds: float  # wall seconds, start to the last process's end
    truncated: bool  # stdout or stderr was cut to output_bytes

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and self.sandbox_error is None
