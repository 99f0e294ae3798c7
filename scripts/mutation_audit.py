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
import fnmatch
import hashlib
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
# --judges: the layers that decide what a completion is worth (docs/reliability.md, "Every mutant of the judges"), all
# their mutants; of vllm_engine.py only the weight-sync check's functions.
JUDGE_FILES = ["src/grpokit/rollout/calculator.py", "src/grpokit/rollout/tool_calls.py",
               "src/grpokit/rollout/python_tool.py", "src/grpokit/rewards/*", "src/grpokit/core/answers.py",
               "src/grpokit/algorithms/reward.py", "src/grpokit/training/labelling.py", "src/grpokit/sandbox/*",
               "src/grpokit/rollout/vllm_engine.py"]
JUDGE_ONLY = ["grpokit.rollout.calculator.*", "grpokit.rollout.tool_calls.*", "grpokit.rollout.python_tool.*",
              "grpokit.rewards.*", "grpokit.core.answers.*", "grpokit.algorithms.reward.*",
              "grpokit.training.labelling.*", "grpokit.sandbox.*", "grpokit.rollout.vllm_engine.x_hf_weights__*",
              "grpokit.rollout.vllm_engine.x_policy_logprobs__*", *(f"grpokit.rollout.vllm_engine.x\u01c1VLLMEngine"
              f"\u01c1{name}__*" for name in ("update_weights", "difference", "check", "prompt_logprobs"))]
# The layers' own tests and the sharp ones written for them (the reward trainer's and labelling's fast cases by name:
# their training runs would make every surviving mutant of those files take minutes).
_TRAIN, _SAMPLE = "tests/algorithms/test_reward_train.py::test_", "tests/training/test_labelling.py::test_"
JUDGE_TESTS = ["tests/rollout/test_tools.py", "tests/rollout/test_tool_boundaries.py",
               "tests/rollout/test_python_tool.py", "tests/rewards/test_answers_and_scores.py",
               "tests/rewards/test_rewards.py", "tests/rewards/test_math.py", "tests/rewards/test_reward_calls.py",
               "tests/rewards/test_code_boundaries.py", "tests/rewards/test_code.py",
               "tests/rollout/test_vllm_sync_check.py", "tests/rollout/test_vllm_wiring.py",
               "tests/rollout/test_engines.py::test_the_weights_pushed_to_vllm_are_the_merged_lora_model_and_leave_it_"
               "untouched",
               "tests/algorithms/test_reward_truncation.py", "tests/sandbox", "src/grpokit/core/answers.py",
               "src/grpokit/rewards",
               *(_TRAIN + name for name in ("texts_labels_and_steps_are_read_as_written", "each_bad_value_is_named",
                                            "the_form_is_found_from_the_first_row_steps_then_pairs_then_labelled",
                                            "a_process_model_needs_a_fast_tokenizer_and_a_template_that_keeps_the_text",
                                            "config_checks")),
               *(_SAMPLE + name for name in ("pairs_join_the_best_with_the_worst_and_skip_ties",
                                             "a_pair_with_an_empty_side_is_counted_not_made_and_the_answer_is_kept",
                                             "an_empty_side_skips_its_pair_only_and_every_one_is_counted"))]
# Files whose mutants run apart, on tests of their own: learned.py's, as mutmut's forked stats run fails with
# test_reward_models.py among JUDGE_TESTS (it passes alone, and beside them in one pytest run); the reward trainer's,
# on its training tests, whole (a few seconds each under mutmut: too slow for the other files' mutants).
APART = {
    "grpokit.rewards.learned.*": ["tests/rewards/test_reward_models.py", "tests/algorithms/test_reward_truncation.py",
                                  "tests/rewards/test_reward_calls.py", "tests/rewards/test_answers_and_scores.py"],
    "grpokit.algorithms.reward.*": ["tests/algorithms/test_reward_train.py",
                                    "tests/algorithms/test_reward_trainer_inputs.py",
                                    "tests/training/test_labelling.py", "tests/algorithms/test_reward_truncation.py"]}
JUDGE_STATE = Path("docs/mutation_audit_judges.json")
# A test session under the audit (test_cgroups): its processes and threads (the suite needs a few hundred), its CPUs
# (the rest of the machine stays usable), its wall clock (the slowest group's clean run takes about 3 minutes).
TEST_PIDS, TEST_CPUS, SESSION_SECONDS = 2000, 1.5, 900
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


def digest(diff: str) -> str:
    return hashlib.sha1(diff.encode()).hexdigest()[:12]


def harvest(state: dict, names: list[str], vllm: dict[str, str] | None = None) -> None:
    """Record in ``state`` the results mutmut has saved so far for ``names`` (a mutant's first result stays as
    ``first``: the count before later tests), and write it."""
    from mutmut.__main__ import get_diff_for_mutant
    from mutmut.stats import status_by_exit_code

    every = mutants()
    for name in names:
        path, code = every[name]
        if code is None and name not in (vllm or {}):
            continue
        status = (vllm or {}).get(name, status_by_exit_code[code])
        diff = get_diff_for_mutant(name, path=path)
        entry = state["mutants"].setdefault(name, {"file": path, "first": status})
        entry.update(status=status, diff=digest(diff))
        if name in (vllm or {}):
            entry["judged_in"] = "vllm"
        if status in KILLED:
            entry.pop("source", None)
            entry.pop("equivalent", None)
        else:
            entry["source"] = diff
    state["mutants"] = dict(sorted(state["mutants"].items()))
    save(state)


def save(state: dict) -> None:
    """Write the state whole or not at all (a run killed while writing leaves the last one)."""
    partial = JUDGE_STATE.with_suffix(".json.partial")
    partial.write_text(json.dumps(state, indent=1, ensure_ascii=False) + "\n")
    os.replace(partial, JUDGE_STATE)


def judges(args: argparse.Namespace) -> None:
    """``--judges``: every mutant of JUDGE_FILES (JUDGE_ONLY's functions), the results kept per mutant in
    JUDGE_STATE as they come, so that a run stopped anywhere resumes with the mutants not yet judged (or whose function
    changed since); with ``--survivors``, the state's survivors run again on today's tests instead."""
    from mutmut.__main__ import get_diff_for_mutant

    if not args.keep:
        shutil.rmtree("mutants", ignore_errors=True)
    generate(JUDGE_FILES)
    every = mutants()
    names = sorted(n for n in every if any(fnmatch.fnmatchcase(n, pattern) for pattern in JUDGE_ONLY))
    state = json.loads(JUDGE_STATE.read_text()) if JUDGE_STATE.exists() else {"mutmut": MUTMUT, "mutants": {}}
    state["mutants"] = {n: e for n, e in state["mutants"].items() if n in names}  # (gone from the source)
    todo = []
    for name in names:
        entry = state["mutants"].get(name)
        if args.survivors:  # those alive and not explained, on today's tests
            if entry is not None and entry["status"] not in KILLED and "equivalent" not in entry:
                todo.append(name)
        elif entry is None or entry["diff"] != digest(get_diff_for_mutant(name, path=every[name][0])):
            todo.append(name)  # not judged yet, or its function changed since
    if args.part:
        todo = [n for n in todo if any(fnmatch.fnmatchcase(n, pattern) for pattern in args.part)]
    todo = todo[:args.limit] if args.limit else todo
    print(f"{len(names)} mutants of the judges in {len({every[n][0] for n in names})} files; {len(todo)} to run")
    if args.list:
        print("\n".join(todo))
        return
    if args.table:
        print(table(state, {n: every[n][0] for n in names}), equivalents(state), sep="\n\n")
        return
    groups = [(todo, args.tests)] if args.tests else [
        *(([n for n in todo if fnmatch.fnmatchcase(n, pattern)], tests) for pattern, tests in APART.items()),
        ([n for n in todo if not any(fnmatch.fnmatchcase(n, pattern) for pattern in APART)], JUDGE_TESTS)]
    deadline = None if args.max_minutes is None else time.monotonic() + args.max_minutes * 60
    for i, (group, tests) in enumerate((g, t) for g, t in groups if g):
        if i:  # mutmut keeps the stats of the last test list in mutants/
            shutil.rmtree("mutants", ignore_errors=True)
            generate(JUDGE_FILES)
        env = run_mutmut(group, tests, args, state, deadline)
    from mutmut.stats import status_by_exit_code

    every = mutants()
    alive = [n for n in todo if every[n][1] is not None and every[n][0] == VLLM_FILE
             and status_by_exit_code[every[n][1]] in ("survived", "no tests")]
    if args.vllm and alive:
        harvest(state, alive, run_vllm(alive, args.vllm, env, own_session=False))
    print(table(state, {n: every[n][0] for n in names}))
    for name, entry in state["mutants"].items():
        if entry["status"] not in KILLED and "equivalent" not in entry:
            print(f"# {name}: {entry['status']}\n{entry['source']}")


def test_cgroups() -> list[str]:
    """Cgroups for the tests' sessions (tests/conftest.py moves each session's process into them and ends a session
    past SESSION_SECONDS): at most TEST_PIDS processes, and TEST_CPUS of the machine's CPUs. As root, a mutant that
    keeps the sandbox from dropping to a uid of its own (``as_root`` false) runs the hostile tests' fork bombs as root,
    which RLIMIT_NPROC does not bound: they took every pid of the machine and its CPUs, mutmut's fork server
    included. Empty where none can be made (not root, no such controller): the audit then runs without."""
    made = []
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    limits = {"pids": {"pids.max": str(TEST_PIDS)}, "cpu": {"cpu.cfs_quota_us": str(int(TEST_CPUS * 100_000)),
                                                            "cpu.cfs_period_us": "100000"}}
    if v2.exists():  # one hierarchy: both limits on one group
        limits = {"": {"pids.max": str(TEST_PIDS), "cpu.max": f"{int(TEST_CPUS * 100_000)} 100000"}}
    for controller, files in limits.items():
        group = Path("/sys/fs/cgroup", controller, "grpokit-mutation-audit")
        try:
            group.mkdir(exist_ok=True)
            for name, value in files.items():
                (group / name).write_text(value)
        except OSError:
            continue
        made.append(str(group))
    if not made:
        print("warning: no cgroup could be made for the tests: a mutant that lifts the sandbox's process bound may "
              "take the machine's pids and CPUs (run the audit as root on a machine with cgroups)", file=sys.stderr)
    return made


def run_mutmut(todo: list[str], tests: list[str], args: argparse.Namespace, state: dict,
               deadline: float | None) -> dict[str, str]:
    """mutmut on the mutants ``todo`` with ``tests``, stopped at ``deadline``, the state harvested as it goes; the
    environment it ran with."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "mutants" / "src"),
           "MUTATION_AUDIT_SCOPE": json.dumps({"files": JUDGE_FILES, "tests": tests,
                                               "timeout_multiplier": args.timeout_multiplier})}
    cgroups = test_cgroups()
    if cgroups:
        env.update(MUTATION_AUDIT_CGROUPS=os.pathsep.join(cgroups), MUTATION_AUDIT_SESSION_SECONDS=str(SESSION_SECONDS))
    command = [sys.executable, "-c", SCOPED_MUTMUT, "run", "--max-children", str(args.max_children), *todo]
    # in this script's process group, so that /work/tools/quietable pauses it with the script
    with subprocess.Popen(command, env=env) as mutmut_run:
        while mutmut_run.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                # (SIGINT would not do: a shell's background job, as under quietable, ignores it.) mutmut saved
                # each result as it came; its fork server and worker go by their ids.
                below = descendants(mutmut_run.pid)
                mutmut_run.terminate()
                mutmut_run.wait()
                for pid in below:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                mutmut_run.wait(timeout=60)
            harvest(state, todo)  # a run stopped anywhere keeps what it judged
    harvest(state, todo)
    return env


KILLED = ("killed", "timeout", "segfault")


def table(state: dict, files: dict[str, str]) -> str:
    """The counts per file (markdown): its mutants, and of them, at their first run and now, those killed (a timeout
    counts: the tests hung) and those alive; now, those explained as equivalent (``equivalent`` in the state: the
    reason) apart; and those not judged yet."""
    rows = ["| file | mutants | first run: killed / alive | now: killed / alive / equivalent | not judged yet |",
            "|---|---|---|---|---|"]
    for path in sorted(set(files.values())):
        names = [n for n, f in files.items() if f == path]
        judged = [state["mutants"][n] for n in names if n in state["mutants"]]
        first = sum(e["first"] in KILLED for e in judged)
        now = sum(e["status"] in KILLED for e in judged)
        equivalent = sum(e["status"] not in KILLED and "equivalent" in e for e in judged)
        rows.append(f"| `{path.removeprefix('src/grpokit/')}` | {len(names)} | {first} / {len(judged) - first} | "
                    f"{now} / {len(judged) - now - equivalent} / {equivalent} | {len(names) - len(judged)} |")
    return "\n".join(rows)

def equivalents(state: dict) -> str:
    """The mutants explained as equivalent, one line each, as docs/reliability.md lists them: the file, the function,
    the mutant's number, the reason."""
    lines = []
    for name, entry in state["mutants"].items():
        if entry["status"] not in KILLED and "equivalent" in entry:
            function, number = name.rsplit("__mutmut_", 1)
            function = ".".join(part for part in function.rsplit(".", 1)[1].split("\u01c1")[1:]) \
                or function.rsplit(".x_", 1)[1]
            lines.append(f"- `{entry['file'].removeprefix('src/grpokit/')}` `{function}` ({number}): "
                         f"{entry['equivalent']}")
    return "\n".join(lines)


def explain(path: Path) -> None:
    """``--explain FILE``: mark the survivors that FILE (JSON, ``{mutant: reason}``) explains as equivalent."""
    state, reasons = json.loads(JUDGE_STATE.read_text()), json.loads(path.read_text())
    for name, reason in reasons.items():
        entry = state["mutants"].get(name)
        if entry is None or entry["status"] in KILLED:
            sys.exit(f"--explain: {name} is {'not judged' if entry is None else entry['status']}: nothing to explain")
        entry["equivalent"] = reason
    save(state)
    print(f"{len(reasons)} mutants explained as equivalent in {JUDGE_STATE}")


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
    parser.add_argument("--judges", action="store_true", help=f"every mutant of the layers that judge model output, "
                        f"resuming from {JUDGE_STATE} (--sample, --seed, --again, --report do not apply)")
    parser.add_argument("--table", action="store_true", help="--judges: print the counts per file; run nothing")
    parser.add_argument("--survivors", action="store_true", help="--judges: run the state's survivors (not those "
                        "explained as equivalent) again, and nothing else")
    parser.add_argument("--limit", type=int, help="--judges: run at most this many of the mutants left")
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
    if args.judges and args.explain:
        return explain(args.explain)
    if args.judges:
        return judges(args)
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
