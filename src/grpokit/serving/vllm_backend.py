"""The policy server on vLLM (:class:`~grpokit.rollout.vllm_engine.VLLMEngine`): each request goes to vLLM's engine as
it arrives (``LLMEngine.add_request``), and one worker thread steps that engine, so that vLLM's own scheduler does
continuous batching: a request joins the decode already running at its next step, and each leaves as soon as it ends.

It takes the :class:`~grpokit.serving.batcher.Batcher`'s place (:meth:`submit` a ``Job``, a future of its ``Sample``
list): the server picks it when its engine is a ``VLLMEngine`` (:func:`backend_for`). A prompt is one vLLM request of
``n`` sequences and its own ``max_tokens``; the sampled tokens and their log-probs are vLLM's (``logprobs=0``,
``processed_logprobs``: after the temperature), exactly as :meth:`VLLMEngine.generate` returns them.
"""

from __future__ import annotations

import itertools
import queue
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from grpokit.serving.batcher import Batcher, Job, Sample, Worker

SEED_RANGE = 2**31 - 1  # the seeds VLLMEngine.generate draws (vLLM's per-request generator takes a 32-bit seed)


def is_vllm_engine(engine: Any) -> bool:
    """Whether ``engine`` is a :class:`~grpokit.rollout.vllm_engine.VLLMEngine` (or a subclass), without importing
    that module: an instance of it means it is imported already."""
    module = sys.modules.get("grpokit.rollout.vllm_engine")
    return module is not None and isinstance(engine, module.VLLMEngine)


def backend_for(engine: Any, *, max_batch: int, batch_wait: float) -> Batcher | VLLMBackend:
    """What the policy server submits its requests to: :class:`VLLMBackend` on a vLLM engine, else the
    :class:`~grpokit.serving.batcher.Batcher` (``batch_wait``: its wait for requests sent together; vLLM needs none,
    a request joining the running decode at the next step)."""
    if is_vllm_engine(engine):
        return VLLMBackend(engine, max_batch=max_batch)
    return Batcher(engine, max_batch=max_batch, batch_wait=batch_wait)


@dataclass
class _Running:
    """A job in vLLM's engine: its prompts' request ids and, as each finishes, its samples."""

    job: Job
    ids: list[str]
    copies: int = 1  # each sample stands for this many of the job's n (greedy)
    done: dict[str, list[Sample]] = field(default_factory=dict)


class VLLMBackend(Worker):
    """One worker thread owns the vLLM engine: it adds each job's requests as they arrive and steps the engine while
    any runs (blocking for work when none does). :meth:`submit` is safe from any thread.

    ``max_batch``: the most rows (prompts × n) in vLLM's engine at once; a job that would pass it waits for rows to
    finish (one job alone may pass it). ``batches``: the engine's busy spells (from idle to idle: the requests of one
    spell share its decode steps), ``steps`` its steps, ``rows`` the rows run, ``most_rows`` the most at once."""

    thread_name = "grpokit-serving-vllm"

    def __init__(self, engine: Any, *, max_batch: int = 64):
        self.engine, self.max_batch = engine, max_batch
        self.batches = self.steps = self.rows = self.most_rows = 0
        self._running: dict[str, _Running] = {}  # by each of its requests' ids
        self._numbers = itertools.count()
        self.start()

    @property
    def _rows_running(self) -> int:
        return sum(r.job.rows for r in {id(r): r for r in self._running.values()}.values())

    def _run(self) -> None:
        waiting: deque[Job] = deque()
        closing = False
        while True:
            if not self._running and not waiting:
                if closing:
                    return
                item = self._queue.get()  # idle: block until a request arrives
                closing = item is None
                if item is not None:
                    waiting.append(item)
            while True:  # every request that arrived meanwhile joins at this step
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                closing = closing or item is None
                if item is not None:
                    waiting.append(item)
            while waiting and (not self._running or self._rows_running + waiting[0].rows <= self.max_batch):
                self._add(waiting.popleft())
            if self._running:
                self._step()

    def _add(self, job: Job) -> None:
        """``job``'s prompts into vLLM's engine, one request of ``n`` sequences each; a refused job fails alone."""
        vllm, llm, engine = self.engine._vllm, self.engine.llm, self.engine
        seeds: list[int | None] = [None] * len(job.prompts)
        if job.sampling.seed is not None:  # as VLLMEngine.generate draws them: the output is its output for the seed
            draws = torch.randint(0, SEED_RANGE, (len(job.prompts) * job.n,),
                                  generator=torch.Generator().manual_seed(job.sampling.seed)).tolist()
            seeds = draws[::job.n]
        # vLLM refuses n > 1 with greedy sampling: its n completions are one, sampled once and repeated (as the native
        # engine's greedy rows are the same)
        n, copies = (1, job.n) if job.sampling.greedy else (job.n, 1)
        number = next(self._numbers)
        running = _Running(job, [f"grpokit-{number}-{k}" for k in range(len(job.prompts))], copies)
        added = []
        try:
            engine.wake_up()
            for request_id, prompt, seed in zip(running.ids, job.prompts, seeds):
                params = vllm.SamplingParams(
                    n=n, max_tokens=job.max_tokens, seed=seed, stop_token_ids=engine.stop_ids,
                    temperature=0.0 if job.sampling.greedy else job.sampling.temperature, top_p=job.sampling.top_p,
                    logprobs=0, detokenize=False, output_kind=vllm.sampling_params.RequestOutputKind.FINAL_ONLY,
                    **engine.extra_sampling)
                llm.llm_engine.add_request(request_id, _engine_input(llm, vllm, prompt), params)
                added.append(request_id)
        except Exception as error:  # a request vLLM refuses fails, the others run on
            if added:
                llm.llm_engine.abort_request(added)
            job.future.set_exception(error)
            return
        if not self._running:
            self.batches += 1  # idle until now: a new busy spell
        for request_id in running.ids:
            self._running[request_id] = running
        self.rows += job.rows
        self.most_rows = max(self.most_rows, self._rows_running)

    def _step(self) -> None:
        """One step of vLLM's engine: each job whose requests have all finished is answered."""
        try:
            outputs = self.engine.llm.llm_engine.step()
        except Exception as error:  # the engine failed: every request in it fails, the server stays up
            jobs = {id(r): r for r in self._running.values()}.values()
            try:
                self.engine.llm.llm_engine.abort_request(list(self._running))
            except Exception:  # noqa: S110 - the engine is already broken; the requests' error says why
                pass
            self._running.clear()
            for running in jobs:
                running.job.future.set_exception(error)
            return
        self.steps += 1
        stop_ids = self.engine.stop_ids
        for out in outputs:
            running = self._running.get(out.request_id)
            if running is None or not out.finished:
                continue
            prompt = running.job.prompts[running.ids.index(out.request_id)]
            samples = []
            for completion in sorted(out.outputs, key=lambda c: c.index):
                ids = list(completion.token_ids)
                logp = [entry[token].logprob for entry, token in zip(completion.logprobs, ids)]
                samples.append(Sample(prompt, ids, logp, bool(ids) and ids[-1] in stop_ids))
            running.done[out.request_id] = [Sample(s.prompt_ids, list(s.completion_ids), list(s.logp), s.stopped)
                                             for s in samples for _ in range(running.copies)]
            del self._running[out.request_id]
            if len(running.done) == len(running.ids):
                running.job.future.set_result([s for request_id in running.ids for s in running.done[request_id]])


def _engine_input(llm: Any, vllm: Any, prompt: list[int]) -> Any:
    """A prompt of token ids as vLLM's engine takes it: rendered as ``LLM.generate`` renders it where this vLLM has
    that step (0.32: passing the raw prompt to ``add_request`` is deprecated), else the raw prompt."""
    tokens = vllm.inputs.TokensPrompt(prompt_token_ids=list(prompt))
    render = getattr(llm, "_preprocess_cmpl_one", None)
    return render(tokens) if render is not None else tokens
