"""The sandbox at its boundaries: each limit from both sides (zero, either sign, NaN, infinity), the output cap
(which end of the output is kept, and exactly how many bytes), the end of a failing launcher's error, exit statuses
of either sign, and the file names a run accepts."""

import json
import math
import signal
import tempfile
from pathlib import Path

import pytest

from grpokit.sandbox import Limits, Result, Sandbox
from grpokit.sandbox.runner import _check_names
from helpers import sandbox_or_skip

FIELDS = ["wall_seconds", "cpu_seconds", "memory_mb", "processes", "file_size_mb", "open_files", "output_bytes",
          "disk_mb"]


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("value", [0, -1, -0.5, math.nan, math.inf, -math.inf, False, None])
def test_every_limit_refuses_what_bounds_nothing(field, value):
    with pytest.raises(ValueError, match=f"^sandbox limits: {field} must be a positive number, got "):
        Limits(**{field: value})


@pytest.mark.parametrize("field", [f for f in FIELDS if f != "processes"])
def test_every_limit_takes_the_smallest_positive_values(field):
    assert getattr(Limits(**{field: 0.001}), field) == 0.001 and getattr(Limits(**{field: 1}), field) == 1


def test_processes_from_both_sides_of_two():
    with pytest.raises(ValueError, match="^sandbox limits: processes must be at least 2, got 1.5$"):
        Limits(processes=1.5)
    assert Limits(processes=2).rlimits()["NPROC"] == 2


@pytest.mark.parametrize("cpu, soft", [(0.001, 1), (1, 1), (1.001, 2), (2, 2), (2.5, 3)])
def test_the_cpu_limit_is_rounded_up_to_whole_seconds(cpu, soft):
    assert Limits(cpu_seconds=cpu).rlimits()["CPU"] == soft


def test_the_byte_limits_by_hand():
    assert Limits(memory_mb=1, file_size_mb=0.5, open_files=3).rlimits() == {
        "CPU": 5, "AS": 1048576, "NPROC": 32, "FSIZE": 524288, "NOFILE": 3, "CORE": 0}


@pytest.fixture(scope="module")
def capped():
    return sandbox_or_skip("bwrap", Limits(wall_seconds=5, cpu_seconds=5, output_bytes=10))


@pytest.mark.parametrize("printed, kept, cut", [(9, 9, False), (10, 10, False), (11, 10, True), (100_000, 10, True)])
def test_the_output_cap_keeps_the_first_bytes_from_both_sides(capped, printed, kept, cut):
    program = f"import sys\nsys.stdout.write(''.join(str(i % 10) for i in range({printed})))\n" \
              f"sys.stderr.write(''.join(chr(97 + i % 26) for i in range({printed})))"
    result = capped.run(program)
    assert result.ok and result.truncated is cut
    assert result.stdout == "0123456789"[:kept] and result.stderr == "abcdefghij"[:kept]


def bare(bwrap=None) -> Sandbox:
    sandbox = Sandbox.__new__(Sandbox)
    sandbox.bwrap = bwrap
    return sandbox


def test_a_launcher_that_fails_before_the_program_is_told_by_the_end_of_its_error():
    stderr = ("".join(str(i % 10) for i in range(5000)) + "\nOSError: the reason\n").encode()
    result = bare("/bwrap")._result(1, b"", stderr, [], False, False, 0.5)
    reason = stderr.decode().strip()[-2000:]
    assert result.sandbox_error == f"the sandbox failed before the program started (exit 1): {reason}"
    assert result.sandbox_error.endswith("OSError: the reason") and result.exit_code is None
    assert not result.timed_out and not result.ok


@pytest.mark.parametrize("returncode, status, exit_code", [
    (0, ["started", "exit 0"], 0), (0, ["started", "exit 3"], 3), (-signal.SIGKILL, ["started"], 128 + 9),
    (0, ["started", "exit -11"], 128 + 11), (0, ["started", "exit 2", "exit 5"], 5), (4, ["started"], 4),
])
def test_exit_statuses_of_either_sign_as_a_shell_reports_them(returncode, status, exit_code):
    result = bare("/bwrap")._result(returncode, b"o", b"e", status, False, False, 0.5)
    assert (result.exit_code, result.timed_out, result.sandbox_error) == (exit_code, False, None)


def test_the_cpu_limits_signal_is_a_timeout_only_once_the_program_started():
    assert bare("/bwrap")._result(-signal.SIGXCPU, b"", b"", ["started"], False, False, 1).timed_out
    before = bare("/bwrap")._result(-signal.SIGXCPU, b"", b"", [], False, False, 1)
    assert not before.timed_out and before.sandbox_error.startswith("the sandbox failed before the program started")
    killed = bare("/bwrap")._result(-9, b"", b"", [], False, True, 1)
    assert killed.timed_out and killed.sandbox_error == "the sandbox did not start the program in time"


@pytest.mark.parametrize("bwrap", [None, "/bwrap"])
def test_a_results_output_is_decoded_with_replacement_and_its_flag_and_time_kept(bwrap):
    """Model code prints what it likes: bytes that are not UTF-8 become U+FFFD, never an error."""
    result = bare(bwrap)._result(0, b"o\xffk\n", b"\xfe", ["started", "exit 0"], True, False, 0.25)
    assert result == Result("o\ufffdk\n", "\ufffd", 0, False, None, 0.25, True)


@pytest.mark.parametrize("bwrap", [None, "/bwrap"])
def test_the_launchers_timeout_line_is_a_timeout_without_an_exit_status(bwrap):
    result = bare(bwrap)._result(0, b"", b"", ["started", "timeout"], False, False, 2.0)
    assert result == Result("", "", None, True, None, 2.0, False)


def test_a_supervisor_killed_without_its_report_is_a_sandbox_error():
    result = bare(None)._result(-9, b"", b"", ["started"], False, False, 1)
    assert result.sandbox_error == ("the sandbox's supervisor was killed (exit 137); the program may have left "
                                    "processes")
    assert bare(None)._result(0, b"", b"", ["started", "exit 0"], False, False, 1).ok


@pytest.mark.parametrize("name, allowed", [
    ("a.txt", True), ("sub/dir/a.txt", True), ("main.py.txt", True), ("sub/main.py", True), ("", False),
    ("main.py", False), ("../a", False), ("a/../b", False), ("/etc/passwd", False), ("./a", False), ("a//b", False),
    ("a/", False), ("..", False),
])
def test_the_file_names_a_run_takes(name, allowed):
    if allowed:
        _check_names({name: "x"})
    else:
        with pytest.raises(ValueError, match="^sandbox files: "):
            _check_names({name: "x"})


@pytest.mark.parametrize("workers", [0, -1])
def test_workers_below_one_are_refused(workers):
    with pytest.raises(ValueError, match=f"^sandbox workers: must be at least 1, got {workers}$"):
        Sandbox("process", workers=workers)


@pytest.mark.parametrize("path, directory, expected", [
    ("/a/b", "/a/b", True), ("/a/b/c", "/a/b", True), ("/a/bc", "/a/b", False), ("/a", "/a/b", False),
    ("/a/b/c", "/a/b/", True), ("/a/b", "/", True), ("/x", "/a", False), ("/a/b", "/a/X", False),
])
def test_a_path_inside_a_directory(path, directory, expected):
    from grpokit.sandbox.interpreter import inside

    assert inside(path, directory) is expected


@pytest.mark.parametrize("path, parents", [("/a/b/c", ["/a", "/a/b"]), ("/a", []), ("/a/b/", ["/a"]), ("/", []),
                                           ("/X/b/X", ["/X", "/X/b"])])
def test_the_parents_bwrap_makes(path, parents):
    from grpokit.sandbox.bwrap import _parents

    assert _parents(path) == parents


def test_a_probe_that_fails_is_told_by_the_end_of_its_error():
    from grpokit.sandbox.limits import Result

    sandbox = bare("/probe-test-bwrap")
    sandbox.executable, sandbox.as_root = "/probe-test-python", False
    stderr = "".join(str(i % 10) for i in range(5000)) + "\nImportError: the reason\n"
    sandbox._run = lambda *args: Result("", stderr, 1, False, None, 0.1, False)
    assert sandbox._cannot_run() == f"a test program gave exit 1: {stderr.strip()[-2000:]}"
    assert sandbox._cannot_run().endswith("ImportError: the reason")


def test_an_interpreter_that_does_not_run_is_told_by_the_end_of_its_error(tmp_path):
    from grpokit.sandbox import SandboxUnavailable
    from grpokit.sandbox.interpreter import installation

    script = tmp_path / "python"
    script.write_text("#!/bin/sh\nhead -c 5000 /dev/zero | tr '\\0' x >&2\necho ' the end' >&2\nexit 1\n")
    script.chmod(0o755)
    with pytest.raises(SandboxUnavailable) as caught:
        installation(str(script))
    told = str(caught.value)
    assert told == f"sandbox python: {script} does not run: {('x' * 5000 + ' the end')[-2000:]}"


@pytest.mark.parametrize("closed, found", [(None, None), ("a", "a"), ("a/b/X", "a/b/X"), ("a/b", "a/b")])
def test_the_first_directory_others_cannot_search_on_the_way_to_the_installation(monkeypatch, closed, found):
    """Each directory from / down to each installation directory, the last one included, by its own name."""
    from grpokit.sandbox import interpreter

    with tempfile.TemporaryDirectory() as made:  # (pytest's tmp_path lies in directories closed to others)
        root = Path(made)
        root.chmod(0o755)
        deep = root / "a" / "b" / "X"
        deep.mkdir(parents=True)
        (root / "other").mkdir()
        if any(not directory.stat().st_mode & 0o001 for directory in root.parents):
            pytest.skip(f"a directory above {root} is closed to others already")
        if closed:
            (root / closed).chmod(0o700)
        monkeypatch.setattr(interpreter, "installation", lambda executable: (str(root / "other"), str(deep))
                            if executable == "python" else ())
        try:
            assert interpreter.closed_to_others("python") == (found and str(root / found))
        finally:
            for directory in (root / "a", root / "a" / "b", deep):
                directory.chmod(0o755)


def test_a_bwrap_program_sees_the_sandboxs_own_host_name():
    """Its own UTS namespace: the machine's host name is not shown to the program."""
    sandbox = sandbox_or_skip("bwrap", Limits())
    result = sandbox.run("import socket; print(socket.gethostname())")
    assert result.exit_code == 0 and result.stdout == "sandbox\n", result


def test_bwrap_binds_each_installation_directory_outside_the_system_once_with_its_parents_once(monkeypatch):
    """Every directory of the interpreter's installation that the system directories do not hold is bound, read-only,
    at its own path, after each of its parents is made (searchable: 0755) once; the system's are bound already."""
    from grpokit.sandbox import bwrap

    monkeypatch.setattr(bwrap, "installation", lambda executable: ("/lib/python3", "/opt/py/base", "/opt/py/venv"))
    args = bwrap.command("bwrap", Limits(), as_root=True, files=[], launcher=["/opt/py/venv/bin/python"])
    triples = [tuple(args[i:i + 3]) for i in range(len(args) - 2)]
    assert [t for t in triples if t[0] == "--ro-bind" and t[1].startswith("/opt")] == [
        ("--ro-bind", "/opt/py/base", "/opt/py/base"), ("--ro-bind", "/opt/py/venv", "/opt/py/venv")]
    made = [args[i + 1] for i, a in enumerate(args) if a == "--dir" and args[i - 2:i] == ["--perms", "0755"]]
    assert made == ["/opt", "/opt/py"] and "/lib/python3" not in args


def test_a_bwrap_program_gets_a_clean_environment_and_tmpfs_of_the_disk_limit():
    """Its environment is the three variables set for it (the launcher's own, which it drops, aside); /tmp (its
    working directory) and /dev/shm are tmpfs of Limits.disk_mb each."""
    sandbox = sandbox_or_skip("bwrap", Limits(disk_mb=8))
    program = ("import json, os; s = {p: os.statvfs(p) for p in ('/tmp', '/dev/shm')}; print(json.dumps("
               "[{k: os.environ.get(k) for k in ('PATH', 'HOME', 'LANG')}, os.getcwd(), "
               "{p: v.f_blocks * v.f_frsize for p, v in s.items()}]))")
    result = sandbox.run(program)
    assert result.exit_code == 0, result
    environment, cwd, sizes = json.loads(result.stdout)
    assert environment == {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"} and cwd == "/tmp"
    assert sizes == {"/tmp": 8 << 20, "/dev/shm": 8 << 20}

