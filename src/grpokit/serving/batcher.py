"""Requests batched as they arrive: one worker thread owns the engine (the model is touched from it alone), takes
every request waiting (up to ``max_batch`` rows), groups them by their sampling settings and runs each group as one
left-padded :meth:`~grpokit.rollout.engines.Engine.generate` call. Requests arriving during a batch go in the next.

This is batching between calls, for engines that sample only through ``generate`` (vLLM, a subclass with its own
``generate``): a request does not join a decode that is running. The native engine's fast path batches continuously
instead (:mod:`grpokit.serving.continuous`), with this module's :class:`Job` and :class:`Sample`. Rows of
one batch with different ``max_tokens`` decode to the group's largest and are cut at their own (a token depends only
on those before it, so the cut row is what a call of its own size would sample, up to the random draws).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from grpokit.rollout.engines import Engine
from grpokit.runtime.openmp import release_openmp_pool


@dataclass(frozen=True)
class Sampling:
    """The settings rows must share to be in one ``generate`` call. ``greedy``: OpenAI's temperature 0 (the
    log-probs are then reported at temperature 1). ``seed``: a seeded request runs alone, so its tokens depend on
    the seed only, not on what else arrived with it."""

    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    seed: int | None = None


@dataclass
class Job:
    """One request's rows: each prompt (token ids) sampled ``n`` times, at most ``max_tokens`` tokens each."""

    prompts: list[list[int]]
    n: int
    max_tokens: int
    sampling: Sampling
    future: Future = field(default_factory=Future)  # list[Sample], prompt by prompt, n per prompt

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.n


@dataclass(frozen=True)
class Sample:
    """One sampled completion: its tokens, their log-probs, and whether it stopped on a stop token."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logp: list[float]
    stopped: bool


class Worker:
    """What every backend of the server is: one thread that owns the engine (the model is touched from it alone) and
    a queue of jobs. :meth:`submit` is safe from any thread; :meth:`close` stops once the jobs submitted are answered.
    A subclass sets its state, then calls :meth:`start`, and runs the queue in ``_run``."""

    thread_name = "grpokit-serving-batcher"

    def start(self) -> None:
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        raise NotImplementedError

    def submit(self, job: Job) -> Future:
        self._queue.put(job)
        return job.future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


class Batcher(Worker):
    """Batching between ``generate`` calls (the module's docstring). :attr:`batches` counts the calls made (``rows``
    the rows they held)."""

    def __init__(self, engine: Engine, *, max_batch: int = 64, batch_wait: float = 0.005):
        self.engine, self.max_batch, self.batch_wait = engine, max_batch, batch_wait
        self.batches = self.rows = 0
        self._seeds = itertools.count()  # makes each seeded request's group key its own
        self.start()

    def _collect(self) -> list[Job] | None:
        """Every job waiting (at least one: blocks for it), up to ``max_batch`` rows; None once closed."""
        if self._queue.empty():  # idle: this thread's OpenMP helpers go (grpokit.runtime.openmp says why)
            release_openmp_pool()
        first = self._queue.get()
        if first is None:
            return None
        jobs, rows = [first], first.rows
        if self.batch_wait > 0:
            time.sleep(self.batch_wait)  # requests sent together arrive a few milliseconds apart
        while rows < self.max_batch:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                self._queue.put(None)  # close after this batch
                break
            jobs.append(job)
            rows += job.rows
        return jobs

    def _run(self) -> None:
        while (jobs := self._collect()) is not None:
            groups: dict[tuple, list[Job]] = {}
            for job in jobs:
                key = (job.sampling, next(self._seeds) if job.sampling.seed is not None else None)
                groups.setdefault(key, []).append(job)
            for group in groups.values():
                try:
                    results = self._generate(group)
                except Exception as error:  # the requests fail, the server stays up
                    for job in group:
                        job.future.set_exception(error)
                    continue
                for job, samples in zip(group, results):
                    job.future.set_result(samples)

    def _generate(self, jobs: list[Job]) -> list[list[Sample]]:
        """One ``generate`` call for ``jobs`` (of one sampling): each job's samples."""
        sampling = jobs[0].sampling
        prompts = [prompt for job in jobs for prompt in job.prompts for _ in range(job.n)]
        limits = [job.max_tokens for job in jobs for _ in job.prompts for _ in range(job.n)]
        width = max(len(prompt) for prompt in prompts)
        pad = getattr(self.engine, "pad_id", 0)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long)  # (N, P) left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(self.engine.device).manual_seed(sampling.seed)
        rollout = self.engine.generate(ids, mask, num_generations=1, max_new_tokens=max(limits),
                                       temperature=sampling.temperature, top_p=sampling.top_p,
                                       greedy=sampling.greedy, generator=generator)
        self.batches += 1
        self.rows += len(prompts)
        lengths, truncated = rollout.lengths.tolist(), rollout.truncated.tolist()
        samples = []
        for row, (prompt, limit) in enumerate(zip(prompts, limits)):
            length = min(int(lengths[row]), limit)
            stopped = not truncated[row] and int(lengths[row]) <= limit
            samples.append(Sample(prompt, rollout.completion_ids[row, :length].tolist(),
                                  rollout.logp[row, :length].tolist(), stopped))
        out, start = [], 0
        for job in jobs:
            out.append(samples[start:start + job.rows])
            start += job.rows
        return out
