"""Hostile programs: each gets a defined Result, harms nothing outside the sandbox (canary files, the test
process, the other programs of the batch), leaves no process behind, and ends within its time bound — under
bwrap and, where the weaker mode makes the same promise, under the process isolation. Each isolation runs the
whole table once, concurrently (one `run_many`), and the tests check the results one by one."""

import ast
import os
import random
import re
import secrets
import select
import signal
import socket
from textwrap import dedent

import pytest

from grpokit.sandbox import Limits, leftovers
from grpokit.sandbox.interpreter import executable_path, installation
from helpers import sandbox_or_skip

LIMITS = Limits(wall_seconds=2, cpu_seconds=2, memory_mb=256, processes=16, file_size_mb=1, output_bytes=4096,
                disk_mb=8)
BOUND = LIMITS.wall_seconds + 1.5  # every run ends within this, whatever the program does
SYSTEM_TOPS = {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "dev", "proc", "tmp"}

# name -> program; @NAME@ is filled in from the batch's context (paths of canaries, the secret, ...)
PROGRAMS = {k: dedent(v) for k, v in {
    "infinite_loop": """
        while True:
            pass
    """,
    "fork_bomb": """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """,
    "process_cap": """
        import os, time
        n = 0
        for _ in range(100):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(5)
                os._exit(0)
            n += 1
        print(n)
    """,
    "memory_bomb": """
        chunks = []
        while True:
            chunks.append(bytearray(16 << 20))
    """,
    "file_too_large": "open('big', 'wb').write(b'x' * (2 << 20))\n",
    "disk_full": """
        n = 0
        while True:
            open(f'f{n}', 'wb').write(b'x' * (512 << 10))
            n += 1
    """,
    "write_outside": """
        import os
        for path in @CANARIES@:
            for attempt in (lambda: open(path, 'w').write('pwned'),
                            lambda: os.remove(path),
                            lambda: open(os.path.join(os.path.dirname(path), 'new'), 'w')):
                try:
                    attempt()
                    print('did', path)
                except OSError as error:
                    print(type(error).__name__)
    """,
    "read_trainer_files": """
        import os
        for path in @CANARIES@:
            try:
                print(open(path).read())
            except OSError as error:
                print(type(error).__name__)
            try:
                print(os.listdir(os.path.dirname(path)))
            except OSError as error:
                print(type(error).__name__)
    """,
    "environment": """
        import os
        print(dict(os.environ))
        try:
            pids = os.listdir('/proc')
        except OSError as error:  # Landlock (the process isolation) shows no /proc
            pids = [str(os.getpid()), '1']
            print(type(error).__name__)
        for pid in pids:
            try:
                print(open(f'/proc/{pid}/environ', 'rb').read())
            except (OSError, ValueError):
                pass
    """,
    "home": """
        import os
        home = os.path.expanduser('~')
        print(home, os.listdir(home))
    """,
    "sockets": """
        import socket
        for kind, where in [(socket.SOCK_STREAM, ('127.0.0.1', @PORT@)), (socket.SOCK_STREAM, ('1.1.1.1', 80)),
                            (socket.SOCK_DGRAM, ('8.8.8.8', 53))]:
            try:  # the process isolation refuses the socket itself
                s = socket.socket(socket.AF_INET, kind)
                s.settimeout(1)
                s.connect(where)
                s.send(b'x')
                print('connected', where)
            except OSError as error:
                print('refused', error)
    """,
    "subprocesses": """
        import subprocess, sys
        print(subprocess.run([sys.executable, '-c', 'print(6 * 7)'],
                             capture_output=True, text=True).stdout)
        print(subprocess.run(['ls', '/'], capture_output=True, text=True).stdout.split())
    """,
    "kill_parent": """
        import os, signal
        for target in (os.getppid(), @TRAINER@, 1, -1):
            try:
                os.kill(target, signal.SIGKILL)
            except OSError as error:
                print(target, type(error).__name__)
        print('survived')
    """,
    "stop_or_trace_the_trainer": """
        import ctypes, os, signal
        for name, attempt in [("stop", lambda: os.kill(@TRAINER@, signal.SIGSTOP)),
                              ("group", lambda: os.killpg(os.getpgid(@TRAINER@), signal.SIGKILL)),
                              ("memory", lambda: open('/proc/@TRAINER@/mem', 'wb')),
                              ("environ", lambda: open('/proc/@TRAINER@/environ', 'rb'))]:
            try:
                attempt()
                print('did', name)
            except OSError as error:
                print(name, type(error).__name__)
        libc = ctypes.CDLL(None, use_errno=True)
        print('ptrace', libc.ptrace(16, @TRAINER@, 0, 0), ctypes.get_errno())  # PTRACE_ATTACH
        print('survived')
    """,
    "setsid_daemon": """
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(60)
            os._exit(0)
        print('left a daemon')
    """,
    "setsid_daemon_exec": """
        import os
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv('/bin/sleep', ['sleep', '@SLEEP@'])
            os._exit(0)
        print('left sleep')
    """,
    "daemon_then_hang": """
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(60)
            os._exit(0)
        while True:
            time.sleep(0.05)
    """,
    "ignore_sigterm": """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(0.05)
    """,
    "huge_output": """
        import sys
        while True:
            sys.stdout.write('x' * 65536)
    """,
    "huge_output_then_exit": """
        import sys
        print('y' * 100_000)
        print('z' * 100_000, file=sys.stderr)
    """,
    "binary_output": """
        import sys
        sys.stdout.buffer.write(bytes(range(256)) * 4)
    """,
    "deep_recursion": """
        def f(n):
            return f(n + 1)
        f(0)
    """,
    "recursion_limit_lifted": """
        import sys
        sys.setrecursionlimit(10**9)
        def f(n):
            return f(n + 1)
        f(0)
    """,
    "ctypes_segfault": """
        import ctypes
        ctypes.string_at(0)
    """,
    "os_exit": """
        import os
        print('bye', flush=True)
        os._exit(7)
    """,
    "close_stdout": """
        import os, time
        os.close(1)
        os.close(2)
        time.sleep(0.2)
    """,
    "threads": """
        import threading
        def spin():
            while True:
                pass
        for _ in range(4):
            threading.Thread(target=spin).start()
    """,
    "thread_cap": """
        import threading, time
        n = 0
        try:
            for _ in range(1000):
                threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
                n += 1
        except RuntimeError:
            pass
        print(n)
    """,
}.items()}
# What the process isolation does not promise (docs/sandbox.md): these run under bwrap only
BWRAP_ONLY = {"disk_full": "the process isolation does not bound the total disk a program writes"}


@pytest.fixture(scope="module", params=["bwrap", "process"])
def batch(request, tmp_path_factory):
    """Every program of the table run at once in one isolation, with canaries in a private directory, in the
    test process's cwd and in its HOME, a secret in its environment and a socket listening on localhost."""
    sandbox = sandbox_or_skip(request.param, LIMITS, workers=4)
    base = tmp_path_factory.mktemp("hostile")  # 0700, as pytest makes it
    context = {"secret": secrets.token_hex(16), "canary_text": secrets.token_hex(16), "trainer": os.getpid(),
               "sleep": f"{random.randint(10_000, 99_999)}.{random.randint(1, 9)}"}
    canaries = []
    for place in ("private", "trainer-cwd", "home"):
        (base / place).mkdir()
        canaries.append(base / place / "canary")
        canaries[-1].write_text(context["canary_text"])
    listener = socket.create_server(("127.0.0.1", 0))
    names = [name for name in PROGRAMS if request.param == "bwrap" or name not in BWRAP_ONLY]
    fill = {"@CANARIES@": repr([str(path) for path in canaries]), "@PORT@": str(listener.getsockname()[1]),
            "@TRAINER@": str(context["trainer"]), "@SLEEP@": context["sleep"]}
    programs = [(re.sub("@[A-Z]+@", lambda match: fill[match[0]], PROGRAMS[name]), "") for name in names]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(base / "trainer-cwd")
        patch.setenv("HOME", str(base / "home"))
        patch.setenv("GRPOKIT_TEST_SECRET", context["secret"])
        results = dict(zip(names, sandbox.run_many(programs)))
    context["connections"] = len(select.select([listener], [], [], 0)[0])  # a connection waiting to be accepted
    listener.close()
    context.update(isolation=request.param, results=results, canaries=canaries, home=str(base / "home"))
    return context


def _timed_out(result, context=None):
    assert result.timed_out and result.exit_code is None and result.sandbox_error is None, result


def _exit(code, text=None):
    def check(result, context):
        assert result.exit_code == code and not result.timed_out and result.sandbox_error is None, result
        if text is not None:
            assert text in result.stdout + result.stderr, result

    return check


def _count_below_cap(result, context):
    assert result.ok, result
    # The bound holds for a root trainer too. A normal user's process isolation bounds the user's count, which the
    # batch's fork bomb, running beside it as the same user, may already hold: then it starts none
    shared = context["isolation"] == "process" and os.geteuid() != 0
    assert (0 if shared else 1) <= int(result.stdout) < LIMITS.processes, result


def _canaries_intact(result, context):
    assert result.ok and "did" not in result.stdout, result
    _nothing_changed(context)


def _nothing_changed(context):
    for path in context["canaries"]:
        assert path.read_text() == context["canary_text"]
        assert sorted(os.listdir(path.parent)) == ["canary"]


def _nothing_read(result, context):
    assert result.ok and ("FileNotFoundError" in result.stdout or "PermissionError" in result.stdout), result
    assert context["canary_text"] not in result.stdout + result.stderr and "canary" not in result.stdout, result


def _no_secret(result, context):
    assert result.ok, result
    assert context["secret"] not in result.stdout + result.stderr, "the trainer's environment leaked"
    assert "GRPOKIT_TEST_SECRET" not in result.stdout


def _empty_home(result, context):
    assert result.ok, result
    home, listing = result.stdout.split(" ", 1)
    assert home not in (context["home"], os.environ.get("HOME")) and "canary" not in listing, result


def _no_network(result, context):
    assert result.ok, result
    assert [line.split()[0] for line in result.stdout.splitlines()] == ["refused"] * 3, result
    assert context["connections"] == 0, "a sandboxed program reached the test's socket"


def _bounded_subprocesses(result, context):
    assert result.ok and "42" in result.stdout, result
    if context["isolation"] == "bwrap":  # only the sandbox's own root: the system, the interpreter, its own places
        installed = {directory.split("/")[1] for directory in installation(executable_path())}
        shown = set(ast.literal_eval(result.stdout.splitlines()[-1]))
        assert shown <= {*SYSTEM_TOPS, *installed}, (shown, installed)


def _survived(result, context):
    assert result.ok and "survived" in result.stdout, result
    os.kill(context["trainer"], 0)  # this process is alive, and the other programs' results are checked too


def _untouched_trainer(result, context):
    _survived(result, context)
    assert "did" not in result.stdout and "ptrace -1 " in result.stdout, result


def _sleep_gone(result, context):
    assert result.ok, result
    for entry in os.listdir("/proc"):
        try:
            args = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        assert context["sleep"].encode() not in args, f"the daemon's sleep (pid {entry}) outlived its sandbox"


def _huge_output(result, context):
    _timed_out(result)
    assert result.truncated and result.stdout == "x" * LIMITS.output_bytes, len(result.stdout)


def _capped_both(result, context):
    assert result.ok and result.truncated, result
    assert result.stdout == "y" * LIMITS.output_bytes and result.stderr == "z" * LIMITS.output_bytes


def _binary(result, context):
    assert result.ok and "\ufffd" in result.stdout and not result.truncated, result


def _defined_failure(result, context):
    assert not result.ok and result.sandbox_error is None and result.exit_code != 0, result


def _closed_stdout(result, context):
    assert result.exit_code is not None and not result.timed_out and result.sandbox_error is None, result
    assert result.stdout == "" and result.stderr == "", result


CHECKS = {
    "infinite_loop": _timed_out,
    "fork_bomb": _timed_out,
    "process_cap": _count_below_cap,
    "memory_bomb": _exit(1, "MemoryError"),
    "file_too_large": _exit(1, "File too large"),
    "disk_full": _exit(1, "No space left on device"),
    "write_outside": _canaries_intact,
    "read_trainer_files": _nothing_read,
    "environment": _no_secret,
    "home": _empty_home,
    "sockets": _no_network,
    "subprocesses": _bounded_subprocesses,
    "kill_parent": _survived,
    "stop_or_trace_the_trainer": _untouched_trainer,
    "setsid_daemon": _exit(0, "left a daemon"),
    "setsid_daemon_exec": _sleep_gone,
    "daemon_then_hang": _timed_out,
    "ignore_sigterm": _timed_out,
    "huge_output": _huge_output,
    "huge_output_then_exit": _capped_both,
    "binary_output": _binary,
    "deep_recursion": _exit(1, "RecursionError"),
    "recursion_limit_lifted": _defined_failure,
    "ctypes_segfault": _exit(128 + signal.SIGSEGV),
    "os_exit": _exit(7, "bye"),
    "close_stdout": _closed_stdout,
    "threads": _timed_out,
    "thread_cap": _count_below_cap,
}


def test_every_program_has_a_check():
    assert CHECKS.keys() == PROGRAMS.keys()


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_hostile_program(batch, name):
    if name not in batch["results"]:
        pytest.skip(f"{name}: {BWRAP_ONLY[name]}")
    result = batch["results"][name]
    CHECKS[name](result, batch)
    assert result.seconds < BOUND, f"{name} took {result.seconds:.1f} s"
    assert leftovers() == [], f"processes of the sandbox outlived {name}"
    _nothing_changed(batch)
