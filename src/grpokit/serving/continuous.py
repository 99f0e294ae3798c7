"""Continuous batching on the native sampler's fast path: :class:`ContinuousBatcher`.

One worker thread owns the model and runs one decode that requests join and leave. At each decode step the requests
that arrived since the last one join: their prompts are prefilled together (each prompt once for its ``n`` rows)
and their rows added to the KV cache batch, their prompts' keys and values in the columns just before the column
every row writes next (positions are each row's own, so where a row's keys sit does not matter to attention, only
the additive mask over the columns: a row never sees another's columns). A row leaves as soon as it samples a stop
token or reaches its request's ``max_tokens``, and a request is answered as soon as all its rows have left, whatever
the others still decode. Finished rows stay in the batch (their picks no longer asked for) until they are a quarter
of it or rows join; columns no running row reads are then cut from the cache too.

Each row samples as :func:`~grpokit.rollout.generate.generate`'s ``choose`` would: the engine's top_k, min_p and
repetition penalty, the request's temperature, top_p and greedy; log-probs at the temperature, before the filters.
Rows of one sampling setting are chosen together (one generator draw per row, in row order: a seeded request has its
own generator, so its tokens are those of a ``generate`` call of its rows alone).

What it runs: :func:`serves_continuously` says when (the native engine's own ``generate``, its fast path, the
policy's weights as they are, no autocast); other engines keep :class:`~grpokit.serving.batcher.Batcher`'s batching
between ``generate`` calls. The products (weights fused and packed) are built when the batch starts from empty, so a
weight update reaches requests from the next start.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from grpokit.models.fast.decode import CACHE_ROOM
from grpokit.models.fast.fused_linear import cast, decode_product
from grpokit.models.fast.llama_family import LlamaFamily, unsupported
from grpokit.rollout.engines import Engine, NativeEngine
from grpokit.rollout.generate import min_p_filter, penalize_repeats, sample_tokens, top_k_filter, top_p_filter
from grpokit.runtime.openmp import release_openmp_pool
from grpokit.serving.batcher import Job, Sample, Worker

PACKED_ROWS = 16  # the rows oneDNN's packed weights are laid out for (at least; at most max_batch)


def serves_continuously(engine: Engine) -> bool:
    """Whether :class:`ContinuousBatcher` can serve ``engine``: the native engine with its own ``generate`` (a
    subclass that overrides it, a spy or a scripted engine, is called through it), on the fast path, sampling the
    policy's own weights (no lower ``rollout_precision``, no autocast, not sharded) and a model the fast path runs."""
    if not isinstance(engine, NativeEngine) or type(engine).generate is not NativeEngine.generate:
        return False
    options = engine.options
    weights = engine.weights
    plain = options.fast_path and not engine.sharded and not (weights.lowered or weights.int8 or weights.autocast)
    return plain and options.mixed_precision == "no" and not options.cuda_graphs and \
        unsupported(engine.weights.current()) is None


@dataclass
class _Row:
    """One completion in the batch: its job, its prompt, its budget and what it has sampled so far."""

    job: Job
    prompt: list[int]
    key: tuple  # the sampling group: rows of one key are chosen together
    tokens: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    done: bool = False
    stopped: bool = False


class _Decode:
    """The running decode: the cache (layers, 2, A, kv heads, columns, D) of the A rows, the additive mask (A,
    columns), each row's next position and last hidden state, and ``column``: where every row writes next."""

    def __init__(self, engine: NativeEngine, max_batch: int):
        self.engine, self.max_batch = engine, max_batch
        self.model = engine.weights.current()
        self.fast = LlamaFamily(self.model)
        self.rows: list[_Row] = []
        self.cache = self.bias = self.last = self.positions = self.seen = None
        self.column = 0
        self.products = None
        self.turns = torch.zeros(0)
        self.stop_ids = set(engine.stop_ids)
        self.generators: dict[tuple, torch.Generator | None] = {}
        self.finished = 0  # rows of the batch that have left (they stay until compact drops them)
        self.job_rows: dict[int, list[_Row]] = {}  # each job's rows, in its order: prompt by prompt, n per prompt

    @property
    def running(self) -> int:
        return len(self.rows) - self.finished

    def samples(self, job: Job) -> list[Sample]:
        """A finished job's samples (and the job forgotten)."""
        return [Sample(row.prompt, row.tokens, row.logp, row.stopped) for row in self.job_rows.pop(id(job))]

    def _build(self, rows: int) -> None:
        fast = self.fast
        layers = [fast._decode_products(layer, rows, None) for layer in fast.backbone.layers]
        head = decode_product(fast.lm_head, rows=rows)
        self.products = layers, head, fast._norm_scale(fast.backbone.norm)

    def _turns(self, length: int, like: Tensor) -> Tensor:
        """Rotary phases for positions 0..length-1 at least (made again, twice as long, when outgrown)."""
        if len(self.turns) < length:
            self.turns = self.fast._rotary_turns(max(length, 2 * len(self.turns)), like)
        return self.turns

    # ---- rows joining ---------------------------------------------------------------------------------

    def join(self, jobs: list[Job], key_of) -> None:
        """Prefill ``jobs``' prompts (each once) and add their rows, n per prompt, after the running ones."""
        fast, device = self.fast, self.engine.device
        if self.products is None:
            # oneDNN packs the weights for a row count: packed for 1 row (a first request alone), a 576x1536 product
            # on 16 rows took ~1.6x as long as packed for 16 (one core, a shared machine); rows join later
            self._build(max(sum(job.rows for job in jobs), min(self.max_batch, PACKED_ROWS)))
        layers, head, head_scale = self.products
        prompts = [prompt for job in jobs for prompt in job.prompts]
        repeats = torch.tensor([job.n for job in jobs for _ in job.prompts], device=device)
        width = max(len(p) for p in prompts)
        pad = self.engine.pad_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long, device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.bool, device=device)
        x = fast.backbone.embed_tokens(ids)
        dtype = x.dtype
        positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
        turns = self._turns(width + CACHE_ROOM, x)
        # as Decoding._start: causal over the prompt, padding never attended to (a padding position sees itself)
        bias = torch.where(mask, 0.0, float("-inf")).to(dtype)
        causal = torch.full((width, width), float("-inf"), dtype=dtype, device=device).triu(1)
        prefill_mask = bias[:, None, :] + causal
        prefill_mask.diagonal(dim1=-2, dim2=-1).zero_()
        cache = torch.zeros(len(layers), 2, len(prompts), fast.kv_heads, width, fast.head_dim, dtype=dtype,
                            device=device)
        last = fast._prefill(x, layers, cache, turns[positions].unsqueeze(2), prefill_mask)[:, -1]
        cache, bias, last = (t.repeat_interleave(repeats, dim=-4 if t is cache else 0) for t in (cache, bias, last))
        next_positions = (positions[:, -1] + 1).repeat_interleave(repeats)
        keys = [key_of(job) for job in jobs]  # once per job: a seeded job's rows share its generator
        new_rows = [_Row(job, prompt, key) for job, key in zip(jobs, keys) for prompt in job.prompts
                    for _ in range(job.n)]
        for job in jobs:
            self.job_rows[id(job)] = [row for row in new_rows if row.job is job]
        seen = None
        if self.engine.options.repetition_penalty != 1.0:
            seen = torch.zeros(len(new_rows), self._vocabulary(), dtype=torch.bool, device=device)
            seen.scatter_(1, ids.masked_fill(~mask, 0).repeat_interleave(repeats, dim=0),
                          mask.repeat_interleave(repeats, dim=0))
        if self.cache is None:  # the batch starts: the prompts' columns and room for CACHE_ROOM new tokens
            self.cache = torch.cat([cache, cache.new_zeros(*cache.shape[:-2], CACHE_ROOM, cache.shape[-1])], dim=-2)
            self.bias = torch.cat([bias, bias.new_zeros(len(bias), CACHE_ROOM)], dim=1)
            self.last, self.positions, self.seen, self.column, self.rows = last, next_positions, seen, width, new_rows
            return
        self.compact(force=True)
        if width > self.column:  # room on the left for the new prompts: the running rows' columns move right
            shift = width - self.column
            self.cache = torch.cat([self.cache.new_zeros(*self.cache.shape[:-2], shift, self.cache.shape[-1]),
                                    self.cache], dim=-2)
            self.bias = torch.cat([self.bias.new_full((len(self.bias), shift), float("-inf")), self.bias], dim=1)
            self.column = width
        columns = self.cache.shape[-2]
        # The new rows' prompts end just before ``column``; every column from there on is written before it is read.
        placed = cache.new_zeros(*cache.shape[:-2], columns, cache.shape[-1])
        placed[..., self.column - width:self.column, :] = cache
        placed_bias = bias.new_full((len(bias), columns), float("-inf"))
        placed_bias[:, self.column - width:self.column] = bias
        placed_bias[:, self.column:] = 0.0
        self.cache = torch.cat([self.cache, placed], dim=2)
        self.bias = torch.cat([self.bias, placed_bias])
        self.last = torch.cat([self.last, last])
        self.positions = torch.cat([self.positions, next_positions])
        self.seen = None if seen is None else torch.cat([self.seen, seen])
        self.rows += new_rows

    def _vocabulary(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    # ---- rows leaving ---------------------------------------------------------------------------------

    def compact(self, tokens: Tensor | None = None, force: bool = False) -> Tensor | None:
        """Drop finished rows (once they are a quarter of the batch, or ``force``) and the columns before the first
        one any remaining row reads; ``tokens`` (A,), the rows' picks, are returned for the rows kept."""
        if not self.finished or not (force or 4 * self.finished >= len(self.rows)):
            return tokens
        keep = [i for i, row in enumerate(self.rows) if not row.done]
        index = torch.tensor(keep, dtype=torch.long, device=self.cache.device)
        self.rows = [self.rows[i] for i in keep]
        self.bias, self.last, self.positions = self.bias[index], self.last[index], self.positions[index]
        self.seen = None if self.seen is None else self.seen[index]
        read = (self.bias[:, :self.column] == 0).any(dim=0).nonzero()
        first = int(read[0]) if len(read) else self.column
        self.cache = self.cache[:, :, index, :, first:]  # a copy: contiguous again
        self.bias = self.bias[:, first:].contiguous()
        self.column -= first
        self.finished = 0
        return None if tokens is None else tokens[index]

    # ---- one step -----------------------------------------------------------------------------------

    def choose(self, logits: Tensor, rows: Tensor, sampling, generator) -> tuple[Tensor, Tensor]:
        """generate's ``choose`` for rows of one sampling setting: tokens and their log-probs at the temperature."""
        options = self.engine.options
        temperature = sampling.temperature
        policy = logits = logits / temperature if temperature != 1.0 else logits
        if self.seen is not None:
            logits = penalize_repeats(logits, self.seen[rows], options.repetition_penalty)
        if sampling.greedy:
            chosen = logits.argmax(dim=-1)
        else:
            filtered = min_p_filter(top_p_filter(top_k_filter(logits, options.top_k), sampling.top_p), options.min_p)
            chosen = sample_tokens(torch.softmax(filtered, dim=-1), generator)
        logp = torch.log_softmax(policy, dim=-1).gather(1, chosen.unsqueeze(1)).squeeze(1)
        if self.seen is not None:
            self.seen[rows, chosen] = True
        return chosen, logp

    def step(self) -> list[Job]:
        """Pick every running row's next token, let finished rows leave, then run the decode step that feeds the
        picks. Returns the jobs whose rows have all left (answered by the caller)."""
        layers, head, head_scale = self.products
        logits = cast(head(self.fast._normalize(self.last) * head_scale), torch.float32)
        groups: dict[tuple, list[int]] = {}
        for i, row in enumerate(self.rows):
            if not row.done:
                groups.setdefault(row.key, []).append(i)
        tokens = torch.zeros(len(self.rows), dtype=torch.long, device=logits.device)
        answered = []
        for key, members in groups.items():
            whole = len(members) == len(self.rows)
            index = torch.tensor(members, device=logits.device)
            chosen, logp = self.choose(logits if whole else logits[index], index, key[0], self.generators[key])
            tokens[index] = chosen
            for i, token, value in zip(members, chosen.tolist(), logp.tolist()):
                row = self.rows[i]
                row.tokens.append(token)
                row.logp.append(value)
                row.stopped = token in self.stop_ids
                if row.stopped or len(row.tokens) >= row.job.max_tokens:
                    row.done, self.finished = True, self.finished + 1
                    if all(r.done for r in self.job_rows[id(row.job)]):
                        answered.append(row.job)
        if self.finished < len(self.rows):  # else the batch is over: nothing to feed
            self._feed(self.compact(tokens))
        return answered

    def _feed(self, tokens: Tensor) -> None:
        """One decode step: each row's pick written at ``column``, its next hidden state in ``last``."""
        if self.column == self.cache.shape[-2]:  # full: twice the room (as Decoding._decode's cache)
            room = max(CACHE_ROOM, self.column)
            self.cache = torch.cat([self.cache, self.cache.new_zeros(*self.cache.shape[:-2], room,
                                                                     self.cache.shape[-1])], dim=-2)
            self.bias = torch.cat([self.bias, self.bias.new_zeros(len(self.bias), room)], dim=1)
        layers, _, _ = self.products
        x = self.fast.backbone.embed_tokens(tokens)
        turns = self._turns(int(self.positions.max()) + 1, x)
        self.last = self.fast._decode_step(x, layers, self.cache, turns[self.positions].unsqueeze(1), self.column,
                                           self.bias)
        self.positions = self.positions + 1
        self.column += 1


class ContinuousBatcher(Worker):
    """:class:`~grpokit.serving.batcher.Batcher`'s interface (:meth:`submit` from any thread, :meth:`close`) over one
    continuous decode. ``max_batch``: the most rows decoding at once (a request that would pass it waits for rows to
    leave; one larger than it runs alone). ``batch_wait``: seconds the worker waits, when a request finds it idle, for
    others sent with it (they then share one prefill). :attr:`batches` counts the prefills that joined rows to the
    decode (``rows`` the rows they added), :attr:`steps` the decode steps."""

    def __init__(self, engine: NativeEngine, *, max_batch: int = 64, batch_wait: float = 0.005):
        self.engine, self.max_batch, self.batch_wait = engine, max_batch, batch_wait
        self.batches = self.rows = self.steps = 0
        self._waiting: list[Job] = []  # taken from the queue, not yet joined (no room)
        self._seeds = 0
        self._closed = False
        self.start()

    def _take(self, block: bool) -> None:
        """Move the requests queued into :attr:`_waiting`; ``block``: wait for one first (then ``batch_wait``)."""
        if block:
            first = self._queue.get()
            if first is None:
                self._closed = True
                return
            self._waiting.append(first)
            if self.batch_wait > 0:
                time.sleep(self.batch_wait)  # requests sent together arrive a few milliseconds apart
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is None:
                self._closed = True
            else:
                self._waiting.append(job)

    def _key(self, job: Job) -> tuple:
        """Rows of one key are chosen together: a seeded request's key is its own (its own generator)."""
        if job.sampling.seed is None:
            return job.sampling, None
        self._seeds += 1
        return job.sampling, self._seeds

    def _admit(self, running: int) -> list[Job]:
        jobs = []
        while self._waiting and (running + self._waiting[0].rows <= self.max_batch or not running and not jobs):
            jobs.append(self._waiting.pop(0))
            running += jobs[-1].rows
        return jobs

    def _run(self) -> None:
        decode: _Decode | None = None
        model = self.engine.weights.current()
        while True:
            if decode is None:
                if self._closed and not self._waiting:
                    return
                if not self._waiting:
                    # idle: this thread's OpenMP helpers go (runtime/openmp.py: while they and another thread's are
                    # all counted, libgomp throttles every thread's spin-waits)
                    release_openmp_pool()
                    self._take(block=True)
                    continue
            else:
                self._take(block=False)
            jobs = self._admit(0 if decode is None else decode.running)
            try:
                with torch.inference_mode():
                    if decode is None:
                        was_training = model.training
                        model.eval()  # as NativeEngine.generate: modules called as modules run in eval mode
                        decode = _Decode(self.engine, self.max_batch)
                    if jobs:
                        decode.join(jobs, self._key_with_generator(decode))
                        self.batches, self.rows = self.batches + 1, self.rows + sum(job.rows for job in jobs)
                    answered = decode.step()
                    self.steps += 1
            except Exception as error:  # the requests fail, the server stays up
                failed = jobs + ([] if decode is None else [r.job for r in decode.rows if not r.done])
                for job in failed:
                    if not job.future.done():  # (a job of several rows is met once per row)
                        job.future.set_exception(error)
                decode = None
                model.train(was_training)
                continue
            for job in answered:
                job.future.set_result(decode.samples(job))  # at once: the other rows decode on
            if decode.running == 0:
                decode = None  # the cache freed; the next request starts a new decode with the weights as they are
                model.train(was_training)

    def _key_with_generator(self, decode: _Decode):
        def key_of(job: Job) -> tuple:
            key = self._key(job)
            if key not in decode.generators:
                seed = job.sampling.seed
                decode.generators[key] = None if seed is None else \
                    torch.Generator(self.engine.device).manual_seed(seed)
            return key
        return key_of
