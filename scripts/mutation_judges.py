"""The ``--judges`` part of the mutation audit (scripts/mutation_audit.py; docs/reliability.md, "Every mutant of
the judges"): every mutant of the layers that judge model output, each judged once and kept in a state file, so a run
stopped anywhere resumes; the tests' sessions in cgroups of their own; the counts, and the survivors explained."""

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
from pathlib import Path

from mutation_audit import MUTMUT, ROOT, SCOPED_MUTMUT, VLLM_FILE, descendants, generate, mutants, run_vllm

# --judges: the layers that decide what a completion is worth (docs/reliability.md, "Every mutant of the judges"), all
# their mutants; of vllm_engine.py only the weight-sync check's functions.
JUDGE_FILES = ["src/grpokit/rollout/calculator.py", "src/grpokit/rollout/tool_calls.py",
               "src/grpokit/rollout/python_tool.py", "src/grpokit/rewards/*", "src/grpokit/core/answers.py",
               "src/grpokit/algorithms/reward.py", "src/grpokit/training/labelling.py", "src/grpokit/sandbox/*",
               "src/grpokit/rollout/vllm_engine.py"]
JUDGE_ONLY = ["grpokit.rollout.calculator.*", "grpokit.rollout.tool_calls.*", "grpokit.rollout.python_tool.*",
              "grpokit.rewards.*", "grpokit.core.answers.*", "grpokit.algorithms.reward.*",
              "grpokit.training.labelling.*", "grpokit.sandbox.*", "grpokit.rollout.vllm_engine.x_hf_weights__*",
              "grpokit.rollout.vllm_engine.x_gathered_weights__*",
              "grpokit.rollout.vllm_engine.x_policy_logprobs__*", *(f"grpokit.rollout.vllm_engine.x\u01c1VLLMEngine"
              f"\u01c1{name}__*" for name in ("update_weights", "_push", "difference", "check", "prompt_logprobs"))]
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
# on its training tests, whole (a few seconds each under mutmut: too slow for the other files' mutants); the sandbox
# runner's, on the tests that start programs (the rest of JUDGE_TESTS starts none, and mutmut's first pass over them
# would take minutes more).
APART = {
    "grpokit.sandbox.runner.*": ["tests/sandbox", "tests/rewards/test_code.py", "tests/rewards/test_code_boundaries.py",
                                 "tests/rollout/test_python_tool.py"],
    "grpokit.rewards.learned.*": ["tests/rewards/test_reward_models.py", "tests/algorithms/test_reward_truncation.py",
                                  "tests/rewards/test_reward_calls.py", "tests/rewards/test_answers_and_scores.py"],
    "grpokit.algorithms.reward.*": ["tests/algorithms/test_reward_train.py",
                                    "tests/algorithms/test_reward_trainer_inputs.py",
                                    "tests/training/test_labelling.py", "tests/algorithms/test_reward_truncation.py"]}
JUDGE_STATE = Path("docs/mutation_audit_judges.json")
# A test session under the audit (test_cgroup): its processes and threads (the suite needs a few hundred) and its
# wall clock (the slowest group's clean run takes about 3 minutes). Not its CPUs: each sandboxed run is a session of
# its own, which the kernel's autogroup gives a fair share of the CPUs beside the machine's other sessions, however
# many processes it holds; a CPU cgroup would put the runs in one group without autogroups, where the hostile tests'
# memory bomb, run beside their CPU burners, was starved past its wall clock.
TEST_PIDS, SESSION_SECONDS = 2000, 900


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
    changed since); with ``--survivors``, the state's survivors run again on today's tests instead; with ``--recheck
    N``, N of its kills drawn at random (``--seed``) run again and are printed, recorded nowhere."""
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
        if args.recheck:
            if entry is not None and entry["status"] in KILLED:
                todo.append(name)
        elif args.survivors:  # those alive and not explained, on today's tests
            if entry is not None and entry["status"] not in KILLED and "equivalent" not in entry:
                todo.append(name)
        elif entry is None or entry["diff"] != digest(get_diff_for_mutant(name, path=every[name][0])):
            todo.append(name)  # not judged yet, or its function changed since
    if args.part:
        todo = [n for n in todo if any(fnmatch.fnmatchcase(n, pattern) for pattern in args.part)]
    if args.recheck:
        todo = sorted(random.Random(args.seed).sample(todo, min(args.recheck, len(todo))))
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
        env = run_mutmut(group, tests, args, None if args.recheck else state, deadline)
    from mutmut.stats import status_by_exit_code

    every = mutants()
    if args.recheck:
        status = {n: status_by_exit_code[every[n][1]] for n in todo if every[n][1] is not None}
        print(f"{len(status)} kills judged again: {sum(s in KILLED for s in status.values())} killed; alive now:",
              *[n for n, s in status.items() if s not in KILLED] or ["none"])
        return
    alive = [n for n in todo if every[n][1] is not None and every[n][0] == VLLM_FILE
             and status_by_exit_code[every[n][1]] in ("survived", "no tests")]
    if args.vllm and alive:
        harvest(state, alive, run_vllm(alive, args.vllm, env, own_session=False))
    print(table(state, {n: every[n][0] for n in names}))
    for name, entry in state["mutants"].items():
        if entry["status"] not in KILLED and "equivalent" not in entry:
            print(f"# {name}: {entry['status']}\n{entry['source']}")


def test_cgroup() -> str | None:
    """A cgroup for the tests' sessions (tests/conftest.py moves each session's process into it and ends a session
    past SESSION_SECONDS): at most TEST_PIDS processes. As root, a mutant that keeps the sandbox from dropping to a
    uid of its own (``as_root`` false) runs the hostile tests' fork bombs as root, which RLIMIT_NPROC does not bound:
    they took every pid of the machine, mutmut's fork server included. None where none can be made (not root, no
    pids controller): the audit then runs without."""
    v1 = Path("/sys/fs/cgroup/pids")
    group = (v1 if v1.is_dir() else v1.parent) / "grpokit-mutation-audit"  # (cgroup v2: one hierarchy)
    try:
        group.mkdir(exist_ok=True)
        (group / "pids.max").write_text(str(TEST_PIDS))
    except OSError:
        print("warning: no cgroup could be made for the tests: a mutant that lifts the sandbox's process bound may "
              "take the machine's pids (run the audit as root on a machine with cgroups)", file=sys.stderr)
        return None
    return str(group)


def run_mutmut(todo: list[str], tests: list[str], args: argparse.Namespace, state: dict | None,
               deadline: float | None) -> dict[str, str]:
    """mutmut on the mutants ``todo`` with ``tests``, stopped at ``deadline``, the state (if any) harvested as it
    goes; the environment it ran with."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "mutants" / "src"),
           "MUTATION_AUDIT_SCOPE": json.dumps({"files": JUDGE_FILES, "tests": tests,
                                               "timeout_multiplier": args.timeout_multiplier})}
    cgroup = test_cgroup()
    if cgroup:
        env.update(MUTATION_AUDIT_CGROUP=cgroup, MUTATION_AUDIT_SESSION_SECONDS=str(SESSION_SECONDS))
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
            if state is not None:
                harvest(state, todo)  # a run stopped anywhere keeps what it judged
    if state is not None:
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
