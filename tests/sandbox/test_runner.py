"""The runner's own decisions, without starting a program: the line it logs for each isolation, and how
``run_many`` spreads jobs over its workers (the caller's thread for one job or one worker; else at most ``workers``
threads, named for the sandbox, the results in the jobs' order)."""

import threading
import time

import pytest

from grpokit.sandbox import Limits, Sandbox

LIMITS = Limits(wall_seconds=2, processes=16)


def bare(**attributes) -> Sandbox:
    """A Sandbox with the given attributes and no start-up probe: what these decisions read, and nothing else."""
    sandbox = object.__new__(Sandbox)
    defaults = dict(isolation="process", limits=LIMITS, site_packages=False, workers=2, as_root=False,
                    executable="/opt/python3", bwrap=None)
    for key, value in {**defaults, **attributes}.items():
        setattr(sandbox, key, value)
    return sandbox


@pytest.mark.parametrize("isolation, as_root, how", [
    ("process", False, "process (weaker: no namespaces; runs as this user: trusted code only)"),
    ("process", True, "process (weaker: no namespaces; a uid of its own per run)"),
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
