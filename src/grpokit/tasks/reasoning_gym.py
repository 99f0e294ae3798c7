"""reasoning-gym's procedurally generated tasks (``dataset: reasoning_gym:TASK``): their rows, generated from a seed,
and their own scorers as a reward (``reasoning_gym``), partial credit included.

``reasoning_gym:chain_sum`` is one task; ``reasoning_gym:chain_sum,spell_backward`` a composite mix (reasoning-gym's
``composite`` dataset), weighted by ``weights``. The config's ``reasoning_gym`` key holds the options:
``size`` (rows generated, default 1000), ``seed`` (default: the run's), ``config`` (the task's own settings; for a
mix, a mapping from task to settings), ``weights`` (a mix's task → weight; default 1 each), ``eval_size`` (held-out
rows, default 200) and ``eval_seed`` (default: ``seed`` + ``size``: reasoning-gym draws row i from seed + i, so the
held-out rows' seeds follow the training rows'). A held-out question that the training rows also hold is dropped.

A row is ``{"prompt": question, "answer": answer, "task": its task, "metadata": the task's metadata}``: what the
scorer needs, so that rows written to a file and read back score alike.

Some tasks' scorers ``eval`` the answer or parse it with sympy (itself built on ``eval``): a model's answer is
untrusted text, so the scorer runs in the sandbox (:mod:`grpokit.sandbox`, with the interpreter's site-packages),
one program per batch, never in the trainer's process.
"""

from __future__ import annotations

import difflib
import json
import math
import warnings
from collections.abc import Sequence
from typing import Any

from grpokit.core.answers import ANSWER_EXTRACTIONS, Text, extract_by, text_of
from grpokit.data import DataError, refuse_unknown
from grpokit.sandbox import Limits, Sandbox

PREFIX = "reasoning_gym:"
OPTIONS = {"size": 1000, "seed": None, "config": None, "weights": None, "eval_size": 200, "eval_seed": None}
INSTALL = "reasoning-gym is not installed: pip install 'grpokit[reasoning_gym]'"
IMPORT_SECONDS = 20.0  # what a scorer's sandbox allows for importing reasoning-gym (about 1.3 s on 2 cores)

# The program that scores a batch in the sandbox: stdin {"configs": {task: settings}, "seconds": per answer, "jobs":
# [[task, answer, entry], ...]}; stdout one JSON list of [score, error] (error: why the answer scored 0).
SCORER = """
import json, math, signal, sys
from reasoning_gym.factory import DATASETS

request = json.load(sys.stdin)
scorers = {}
for task in sorted({task for task, _, _ in request["jobs"]}):  # built outside the answers' clocks; failing here fails
    dataset, settings = DATASETS[task]
    scorers[task] = dataset(config=settings(**request["configs"].get(task, {}))).score_answer

def expired(*_):
    raise TimeoutError("the scorer took longer than %s s" % request["seconds"])

signal.signal(signal.SIGALRM, expired)
results = []
for task, answer, entry in request["jobs"]:
    try:
        signal.setitimer(signal.ITIMER_REAL, request["seconds"])
        score = float(scorers[task](answer, entry))
        signal.setitimer(signal.ITIMER_REAL, 0)
        results.append([score, None] if math.isfinite(score) else [0.0, "not finite: %r" % score])
    except BaseException as error:
        signal.setitimer(signal.ITIMER_REAL, 0)
        results.append([0.0, "%s: %s" % (type(error).__name__, str(error)[:200])])
print(json.dumps(results))
"""


def _module() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise DataError(INSTALL) from None
    return reasoning_gym


def task_names(spec: str) -> list[str]:
    """The tasks ``reasoning_gym:A,B`` names, checked against reasoning-gym's registry (a near miss suggested)."""
    names = [name.strip() for name in spec.removeprefix(PREFIX).split(",")]
    _module()
    from reasoning_gym.factory import DATASETS

    known = sorted(DATASETS)
    for name in names:
        if name not in DATASETS or name == "composite":
            close = difflib.get_close_matches(name, known, n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise DataError(f"dataset {spec!r}: reasoning-gym has no task {name!r}{hint} (its {len(known)} tasks: "
                            "python -c 'import reasoning_gym.factory as f; print(sorted(f.DATASETS))')")
    if len(set(names)) != len(names):
        raise DataError(f"dataset {spec!r}: a task is named twice")
    return names


def options(given: dict[str, Any] | None, seed: int) -> dict[str, Any]:
    """The ``reasoning_gym`` key's options, defaults filled in (``seed`` is the run's); an unknown one is refused."""
    given = dict(given or {})
    refuse_unknown(given, list(OPTIONS), "reasoning_gym", "option", "options")
    merged = {**OPTIONS, **given}
    merged["seed"] = seed if merged["seed"] is None else merged["seed"]
    for key in ("size", "eval_size"):
        if not isinstance(merged[key], int) or merged[key] < 1:
            raise DataError(f"reasoning_gym: {key} must be a positive integer, got {merged[key]!r}")
    # reasoning-gym draws row i from seed + i: past the training rows' seeds, the held-out rows are others
    merged["eval_seed"] = merged["seed"] + merged["size"] if merged["eval_seed"] is None else merged["eval_seed"]
    return merged


def task_configs(spec: str, config: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Each task's own settings: ``config`` itself for one task, ``config[task]`` for a mix."""
    names = task_names(spec)
    config = dict(config or {})
    if len(names) == 1:
        return {names[0]: config}
    stray = sorted(set(config) - set(names))
    if stray:
        raise DataError(f"reasoning_gym: config of a mix maps each task to its settings; {stray[0]!r} is not one of "
                        f"the mix's tasks {names}")
    return {name: dict(config.get(name) or {}) for name in names}


def generate(spec: str, size: int, seed: int, config: dict[str, Any] | None = None,
             weights: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """``size`` rows of the task(s) ``spec`` names, generated from ``seed`` with the tasks' settings ``config``."""
    reasoning_gym = _module()
    configs = task_configs(spec, config)
    weights = dict(weights or {})
    stray = sorted(set(weights) - set(configs))
    if stray:
        raise DataError(f"reasoning_gym: weights names {stray[0]!r}, not one of the mix's tasks {sorted(configs)}")
    try:
        if len(configs) == 1:
            ((name, settings),) = configs.items()
            dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **settings)
        else:
            from reasoning_gym.composite import DatasetSpec

            specs = [DatasetSpec(name, float(weights.get(name, 1.0)), settings) for name, settings in configs.items()]
            dataset = reasoning_gym.create_dataset("composite", size=size, seed=seed, datasets=specs)
        entries = list(dataset)
    except (TypeError, ValueError, AssertionError, KeyError) as error:
        raise DataError(f"dataset {spec!r}: reasoning-gym refused the settings {configs}: "
                        f"{type(error).__name__}: {error}") from None
    # Through JSON once: the row a file gives back is the row scored here (tuples become lists, and so on).
    return [{"prompt": e["question"], "answer": e["answer"], "task": e["metadata"]["source_dataset"],
             "metadata": json.loads(json.dumps(e["metadata"], default=str))} for e in entries]


def train_rows(spec: str, given: dict[str, Any] | None, seed: int) -> list[dict[str, Any]]:
    """The training rows of ``dataset: reasoning_gym:...`` with the ``reasoning_gym`` key's options ``given``."""
    o = options(given, seed)
    return generate(spec, o["size"], o["seed"], o["config"], o["weights"])


def held_out_rows(spec: str, given: dict[str, Any] | None, seed: int) -> list[dict[str, Any]]:
    """Held-out rows: ``eval_size`` rows from ``eval_seed``, without the questions the training rows hold."""
    o = options(given, seed)
    seen = {row["prompt"] for row in generate(spec, o["size"], o["seed"], o["config"], o["weights"])}
    # Small tasks repeat questions: draw more than asked for, to keep eval_size rows after dropping the seen ones.
    drawn = generate(spec, 2 * o["eval_size"] + 16, o["eval_seed"], o["config"], o["weights"])
    fresh = list({row["prompt"]: row for row in drawn if row["prompt"] not in seen}.values())[:o["eval_size"]]
    why = (f"reasoning-gym draws row i from seed + i, so an eval_seed in [{o['seed'] - len(drawn) + 1}, "
           f"{o['seed'] + o['size'] - 1}] repeats training rows (the default is seed + size), or the task's settings "
           "allow few distinct questions")
    if not fresh:
        raise DataError(f"dataset {spec!r}: every held-out question is among the training rows: {why}")
    if len(fresh) < o["eval_size"]:
        warnings.warn(f"dataset {spec!r}: {len(fresh)} held-out rows, not eval_size {o['eval_size']}: {why}",
                      stacklevel=2)
    return fresh


class TaskScore:
    """The ``reasoning_gym`` reward: each completion's answer (read by ``extraction``, one of
    :data:`~grpokit.core.answers.ANSWER_EXTRACTIONS`) scored by its row's task's own ``score_answer``, in
    ``[0, 1]`` with partial credit where the task gives it; a completion without an answer scores as reasoning-gym
    scores ``None`` (0). ``configs``: task → settings the scorer is built with (default: the task's defaults).
    The scorer runs in a sandbox (``isolation`` 'bwrap' or 'process'), each answer for at most ``seconds``; an
    answer whose scoring raises or overruns scores 0 and is counted in :attr:`errors`."""

    def __init__(self, extraction: str = "tag", configs: dict[str, dict[str, Any]] | None = None,
                 isolation: str = "bwrap", seconds: float = 5.0, name: str = "reasoning_gym"):
        if extraction not in ANSWER_EXTRACTIONS:
            raise ValueError(f"answer_extraction={extraction!r} is not one of "
                             f"{', '.join(map(repr, ANSWER_EXTRACTIONS))}")
        self.extraction, self.configs = extraction, dict(configs or {})
        self.isolation, self.seconds = isolation, seconds
        self.__name__ = name
        self.errors = 0

    def start_sandbox(self, answers: int = 1) -> Sandbox:
        """A sandbox for a batch of ``answers``: the interpreter's site-packages (reasoning-gym) importable, room
        for its imports, a wall clock of the imports and each answer's limit. Raises
        :class:`~grpokit.sandbox.SandboxUnavailable` where it cannot start (checked once per process)."""
        _module()
        seconds = IMPORT_SECONDS + self.seconds * answers
        limits = Limits(wall_seconds=seconds, cpu_seconds=math.ceil(seconds), memory_mb=2048, processes=64)
        return Sandbox(isolation=self.isolation, limits=limits, workers=1, site_packages=True)

    def __call__(self, prompts: Sequence[Text], completions: Sequence[Text], answer: Sequence[Any],
                 metadata: Sequence[dict[str, Any]], **kwargs: Any) -> list[float]:
        jobs = []
        for i, (prompt, reference, meta, completion) in enumerate(zip(prompts, answer, metadata, completions)):
            task = meta.get("source_dataset") if isinstance(meta, dict) else None
            if not isinstance(task, str):
                raise ValueError(f"{self.__name__}: the metadata of completion {i}'s row names no task "
                                 "('source_dataset'); rows of reasoning_gym:TASK carry it")
            entry = {"question": text_of(prompt), "answer": reference, "metadata": meta}
            jobs.append([task, extract_by(text_of(completion), self.extraction), entry])
        return self._score(jobs)

    def _score(self, jobs: list[list[Any]]) -> list[float]:
        sandbox = self.start_sandbox(len(jobs))
        result = sandbox.run(SCORER, json.dumps({"configs": self.configs, "seconds": self.seconds, "jobs": jobs}))
        if result.timed_out and len(jobs) > 1:  # an answer stuck where no alarm reaches (C code): find it alone
            return [score for job in jobs for score in self._score([job])]
        if result.timed_out:
            if not self.errors:
                warnings.warn(f"{self.__name__}: scoring an answer overran its sandbox; it scores 0 (counted in "
                              ".errors, warned once)", stacklevel=2)
            self.errors += 1
            return [0.0]
        if result.sandbox_error is not None or result.exit_code != 0:
            why = result.sandbox_error or f"exit {result.exit_code}: {result.stderr.strip()[-1500:]}"
            if "No module named" in result.stderr:
                why += (f". The sandbox runs {sandbox.executable} with that environment's site-packages: install "
                        "reasoning-gym there (pip install 'grpokit[reasoning_gym]')")
            raise RuntimeError(f"{self.__name__}: the scorer's sandbox ({sandbox.isolation} isolation) failed before "
                               f"scoring any answer, so no answer is at fault: {why}")
        scored = json.loads(result.stdout)
        failed = [error for _, error in scored if error is not None]
        if failed and not self.errors:
            warnings.warn(f"{self.__name__}: the task's scorer failed on {len(failed)} of {len(scored)} answers, "
                          f"which score 0 (first: {failed[0]}); counted in .errors, warned once", stacklevel=2)
        self.errors += len(failed)
        return [score for score, _ in scored]
