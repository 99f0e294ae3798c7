"""The mutation audit of the tool and reward layers (docs/reliability.md, "Mutation audit").

    python scripts/mutation_audit.py              # the whole audit, from a fresh mutants/
    python scripts/mutation_audit.py --list       # generate the mutants and list the sample, run nothing
    python scripts/mutation_audit.py --again mutation_audit.json   # after new tests: rerun what survived there
    python scripts/mutation_audit.py --vllm       # the vLLM engine's mutants judged by its own tests, in vLLM's venv
    python scripts/mutation_audit.py --judges     # every mutant of the layers that judge model output, resumable
    python scripts/mutation_audit.py --judges --table               # its counts per file and its equivalent mutants
    python scripts/mutation_audit.py --judges --explain reasons.json   # survivors explained as equivalent

mutmut 3.8.1 (pyproject.toml's [tool.mutmut] names the files and the tests) makes the mutants and runs, for each,
the selected tests that reach the mutated function (``pytest -x``, in a process forked per mutant). This script
adds what mutmut has not: a uniform sample where there are more mutants than an audit's time allows (every one
when ``--sample`` is at least their number), and a report of the counts and of each mutant that survived, as the
diff of its function, for the docs to kill or explain.

Most of the vLLM engine's tests need vLLM, which lives in an environment of its own (``bash scripts/test_vllm.sh``
builds .venv-vllm). With ``--vllm``, each of its mutants that the tests above leave alive then runs that
environment's pytest on the vLLM tests in mutants/ with mutmut's switch set (``MUTANT_UNDER_TEST``, as mutmut's own
workers do; mutmut must be installed there too), one at a time, stopping at the first failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTMUT = "3.8.1"
VLLM_FILE = "src/grpokit/rollout/vllm_engine.py"
VLLM_TESTS = ["-m", "vllm", "tests/rollout/test_vllm_engine.py"]
# mutmut with [tool.mutmut]'s files and tests replaced (MUTATION_AUDIT_SCOPE: {"files": [...], "tests": [...]})
SCOPED_MUTMUT = ("import json, os, sys; import mutmut.configuration as c; scope = json.loads("
                 "os.environ['MUTATION_AUDIT_SCOPE']); cfg = c.config(); cfg.only_mutate = scope['files'] or "
                 "cfg.only_mutate; cfg.pytest_add_cli_args_test_selection = scope['tests'] or "
                 "cfg.pytest_add_cli_args_test_selection; cfg.timeout_multiplier = scope.get('timeout_multiplier') or "
                 "cfg.timeout_multiplier; sys.argv[0] = 'mutmut'; import mutmut.__main__ as m; m.cli()")


def generate(files: list[str] | None = None) -> None:
    """mutmut's own first phase (``mutmut run``'s generation, without the tests): src/ copied into mutants/ with
    every mutant of the audited files (``files``: these globs instead of [tool.mutmut]'s ``only_mutate``)."""
    import mutmut.__main__ as mm
    from mutmut.configuration import config

    if files:
        config().only_mutate = files
    os.makedirs("mutants", exist_ok=True)
    mm.copy_src_dir()
    mm.copy_also_copy_files()
    mm.create_mutants(2)


def mutants() -> dict[str, tuple[str, int | None]]:
    """Every mutant's name → (its source file, its exit code so far: None before it ran)."""
    found = {}
    for meta in sorted(Path("mutants/src").rglob("*.py.meta")):
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            found[name] = (str(meta.relative_to("mutants"))[: -len(".meta")], code)
    return found


def change(diff: str) -> tuple[str, str]:
    """A mutant's change, from its diff: the lines it removes and the lines it adds (stripped)."""
    lines = [line for line in diff.splitlines() if not line.startswith(("---", "+++"))]
    return tuple("\n".join(line[1:].strip() for line in lines if line.startswith(sign)) for sign in "-+")


def successors(survivors: dict[str, dict], every: dict[str, tuple[str, int | None]]) -> dict[str, str]:
    """Each survivor of an earlier report → the mutant of this tree that makes its change: itself while its function
    is as it was, else the one mutant of its file that changes the same lines the same way (mutmut numbers a changed
    function's mutants afresh, and a renamed function's mutants have new names). Left out: survivors whose lines
    are gone from the source."""
    from mutmut.__main__ import get_diff_for_mutant

    found: dict[str, str] = {}
    by_change: dict[str, dict[tuple[str, str], list[str]]] = {}
    for name, old in survivors.items():
        if name in every and get_diff_for_mutant(name, path=every[name][0]) == old["diff"]:
            found[name] = name
            continue
        if old["file"] not in by_change:
            by_change[old["file"]] = {}
            for other, (path, _) in every.items():
                if path == old["file"]:
                    by_change[path].setdefault(change(get_diff_for_mutant(other, path=path)), []).append(other)
        candidates = by_change[old["file"]].get(change(old["diff"]), [])
        if len(candidates) == 1:
            found[name] = candidates[0]
    return found


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (from /proc), deepest first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))

    def below(parent: int) -> list[int]:
        return [d for child in children.get(parent, []) for d in [*below(child), child]]

    return below(pid)


def run_vllm(names: list[str], python: Path, env: dict[str, str], own_session: bool = True) -> dict[str, str]:
    """Each mutant's status under the vLLM tests, run by ``python`` (vLLM's environment) in mutants/."""
    from mutmut.stats import status_by_exit_code

    def pytest(mutant: str, timeout: float | None) -> int | None:
        command = [os.path.abspath(python), "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *VLLM_TESTS]
        # A session of its own: a hung test's torchrun workers go with it, not on to slow the next mutant's run.
        # (In the group of this script where it must be stopped with it: /work/tools/quietable's pauses.)
        with subprocess.Popen(command, cwd="mutants", env={**env, "MUTANT_UNDER_TEST": mutant},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=own_session) as tests:
            try:
                return tests.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                if own_session:
                    os.killpg(tests.pid, signal.SIGKILL)
                else:
                    for pid in [*descendants(tests.pid), tests.pid]:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                tests.wait()
                return None

    start = time.monotonic()
    if pytest("", None) != 0:  # as mutmut's clean run: the tests must pass on the tree as it is
        sys.exit(f"the vLLM tests fail in mutants/ without a mutant: {python} -m pytest {' '.join(VLLM_TESTS)}")
    timeout = 15 * (time.monotonic() - start) + 60  # mutmut's own rule: 15 times the clean run
    status = {}
    for i, name in enumerate(names, 1):
        code = pytest(name, timeout)
        status[name] = "timeout" if code is None else status_by_exit_code[code]
        print(f"vLLM {i}/{len(names)} {name}: {status[name]}", flush=True)
    return status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sample", type=int, default=300, help="mutants run (a uniform sample; default 300)")
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed")
    parser.add_argument("--max-children", type=int, default=2, help="mutants run at once")
    parser.add_argument("--max-minutes", type=float, help="stop mutmut then: the mutants not reached are reported "
                        "'not checked' (mutmut runs those whose tests take least time first)")
    parser.add_argument("--list", action="store_true", help="generate and list the sample; run nothing")
    parser.add_argument("--keep", action="store_true", help="keep mutants/ (mutmut reruns only what changed)")
    parser.add_argument("--again", type=Path,
                        help="a report: rerun only its survivors (new tests kill, never revive), each followed to the "
                        "mutant making the same change where its function changed since")
    parser.add_argument("--report", type=Path, default=Path("mutation_audit.json"), help="where the results go")
    parser.add_argument("--vllm", nargs="?", type=Path, const=Path(".venv-vllm/bin/python"),
                        help="run the vLLM engine's mutants on its tests with this Python (default .venv-vllm's)")
    parser.add_argument("--judges", action="store_true", help="every mutant of the layers that judge model output, "
                        "resuming from docs/mutation_audit_judges.json (scripts/mutation_judges.py; --sample, --again, "
                        "--report do not apply)")
    parser.add_argument("--table", action="store_true", help="--judges: print the counts per file; run nothing")
    parser.add_argument("--survivors", action="store_true", help="--judges: run the state's survivors (not those "
                        "explained as equivalent) again, and nothing else")
    parser.add_argument("--limit", type=int, help="--judges: run at most this many of the mutants left")
    parser.add_argument("--recheck", type=int, help="--judges: run this many of the state's kills again, drawn at "
                        "random (--seed), and print those alive now; record nothing")
    parser.add_argument("--tests", nargs="+", help="--judges: run these tests (pytest paths) instead of JUDGE_TESTS: "
                        "a fast first pass, whose survivors a run with JUDGE_TESTS and --survivors judges again")
    parser.add_argument("--timeout-multiplier", type=float, help="--judges: mutmut's (15: a mutant may take 15 "
                        "times its tests' CPU time before it counts as a timeout, i.e. killed)")
    parser.add_argument("--explain", type=Path, help="--judges: a JSON file {mutant: reason}: mark those survivors "
                        "equivalent (never while a run is going: it rewrites the state)")
    parser.add_argument("--part", nargs="+", help="--judges: only the mutants whose names match these patterns "
                        "(e.g. 'grpokit.rewards.*')")
    args = parser.parse_args()
    os.chdir(ROOT)
    import mutmut

    if mutmut.__version__ != MUTMUT:
        sys.exit(f"the audit is pinned to mutmut {MUTMUT} (found {mutmut.__version__}): "
                 f"python -m pip install mutmut=={MUTMUT}")
    if args.judges:
        from mutation_judges import explain, judges

        return explain(args.explain) if args.explain else judges(args)
    if not args.keep:
        shutil.rmtree("mutants", ignore_errors=True)
    generate()
    every = mutants()
    names = sorted(every)
    sample = names if args.sample >= len(names) else sorted(random.Random(args.seed).sample(names, args.sample))
    print(f"{len(names)} mutants in {len({f for f, _ in every.values()})} files; {len(sample)} in the sample "
          f"(seed {args.seed})")
    before, follow = None, {}
    if args.again:
        before = json.loads(args.again.read_text())
        assert (before["sample"], before["seed"]) == (len(sample), args.seed), "--again takes the same sample"
        follow = successors(before["survivors"], every)
        renamed = {old: new for old, new in follow.items() if old != new}
        print(f"--again: {len(follow)} of the report's {len(before['survivors'])} survivors to rerun "
              f"({len(renamed)} under a new name), {len(before['survivors']) - len(follow)} gone from the source")
    run = sample if before is None else sorted(set(follow.values()))
    if args.list:
        print("\n".join(sample))
        return
    # Subprocesses of the tests (grpokit's CLI) import the mutated tree too, wherever they run.
    env = {**os.environ, "PYTHONPATH": str(ROOT / "mutants" / "src")}
    command = [sys.executable, "-m", "mutmut", "run", "--max-children", str(args.max_children), *run]
    if run:  # (with no names mutmut would run every mutant)
        with subprocess.Popen(command, env=env, start_new_session=True) as mutmut_run:
            try:
                mutmut_run.wait(timeout=None if args.max_minutes is None else args.max_minutes * 60)
            except subprocess.TimeoutExpired:  # its results so far are saved per mutant as it goes
                os.killpg(mutmut_run.pid, signal.SIGTERM)
                mutmut_run.wait()

    from mutmut.__main__ import get_diff_for_mutant
    from mutmut.stats import status_by_exit_code

    every = mutants()
    alive = [name for name in run if status_by_exit_code[every[name][1]] in ("survived", "no tests")]
    vllm_status = run_vllm([n for n in alive if every[n][0] == VLLM_FILE], args.vllm, env) if args.vllm else {}
    status = {name: vllm_status.get(name, status_by_exit_code[every[name][1]]) for name in run}
    counts = Counter(status.values())
    gone = {}
    if before is not None:  # the report's counts, its survivors' statuses replaced by their successors'
        gone = {name: old for name, old in before["survivors"].items() if name not in follow}
        counts = Counter(before["counts"])
        counts.subtract(old["status"] for old in before["survivors"].values())
        counts.update({"gone": len(gone), **Counter(status.values())})
        counts = +counts  # (without the statuses no mutant has now)
    survivors = [name for name in run if status[name] not in ("killed", "timeout", "segfault")]
    report = {"mutmut": MUTMUT, "mutants": len(names), "sample": len(sample), "seed": args.seed,
              "judged_in_vllm": sorted(set(vllm_status) | set(before.get("judged_in_vllm", []) if before else [])),
              "counts": dict(sorted(counts.items())),
              "survivors": {name: {"status": status[name], "file": every[name][0],
                                   "diff": get_diff_for_mutant(name, path=every[name][0])} for name in survivors},
              "renamed": {old: new for old, new in follow.items() if old != new},
              "gone": gone}
    args.report.write_text(json.dumps(report, indent=1) + "\n")
    for name in survivors:
        print(f"# {name}: {status[name]}\n{report['survivors'][name]['diff']}")
    by_file = Counter(every[name][0] for name in survivors)
    print("survivors per file:", dict(sorted(by_file.items())))
    print(f"counts over the sample of {len(sample)} (of {len(names)}): {dict(sorted(counts.items()))}; "
          f"report: {args.report}")


if __name__ == "__main__":
    main()
