"""The policy server: a causal LM and its tokenizer served over OpenAI's API on localhost, sampled by grpokit's
native engine with requests batched continuously (:mod:`grpokit.serving.continuous`; where it cannot, between
``generate`` calls: :mod:`grpokit.serving.batcher`), or by vLLM, each request added to its engine as it arrives
(:mod:`grpokit.serving.vllm_backend`); every request recorded per episode
(:mod:`grpokit.serving.records`). docs/serving.md says what it serves and records.

In Python::

    with PolicyServer(model, tokenizer) as server:
        client = openai.OpenAI(base_url=server.episode_url("ep-1"), api_key="none")
        ...
        turns = server.pop_episode("ep-1")  # the tokens in, the tokens out, their log-probs

``grpokit serve MODEL`` runs one in the foreground (:meth:`PolicyServer.serve_forever`).
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import time
import uuid
from typing import Any

import torch

from grpokit.rollout.engines import Engine, NativeEngine
from grpokit.runtime.openmp import release_openmp_pool
from grpokit.serving.batcher import Batcher, Job, Sample, Sampling
from grpokit.serving.chat import RequestError, ToolCallReader, render_chat
from grpokit.serving.continuous import ContinuousBatcher, serves_continuously
from grpokit.serving.records import EpisodeLog, Turn
from grpokit.serving.vllm_backend import VLLMBackend, backend_for

DEFAULT_MAX_TOKENS = 256  # a request's completion budget when it names none (capped by the context left)


def model_context(model: torch.nn.Module) -> int | None:
    """The positions the model reads (its config's ``max_position_embeddings``), None where it says none."""
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


class PolicyServer:
    """Serves ``model`` (with ``tokenizer``) on ``host``:``port`` (0: a free port) in a background thread, as a
    context manager or with :meth:`start` / :meth:`stop`; or in the foreground with :meth:`serve_forever`.

    ``engine``: what samples (default: :class:`~grpokit.rollout.engines.NativeEngine` on ``model``; a
    :class:`~grpokit.rollout.vllm_engine.VLLMEngine` is served by :mod:`grpokit.serving.vllm_backend`); the server
    touches it from one thread only. ``model_name``: the id ``/v1/models`` lists and requests must name.
    ``max_context``: the most tokens a request's prompt and completion may hold together (default and ceiling: the
    model's context). ``max_batch``: the most rows (prompts × n) decoding at once (vLLM: the most in its engine at
    once); ``batch_wait``: seconds the worker waits after a request finds it idle for others sent with it (not on
    vLLM). ``continuous``: batch continuously (requests join a running decode at its next step, and leave it as they
    finish: :mod:`grpokit.serving.continuous`); default: where
    :func:`~grpokit.serving.continuous.serves_continuously` says the engine can, else between ``generate`` calls
    (:class:`~grpokit.serving.batcher.Batcher`; vLLM batches continuously itself). ``fixed_sampling``: every request is
    sampled so, whatever it asks (training: the tokens must come from the policy at the run's temperature, whose
    log-probs the loss recomputes); what was asked otherwise is noted in :attr:`overridden`."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, engine: Engine | None = None,
                 model_name: str = "grpokit-policy", host: str = "127.0.0.1", port: int = 0,
                 max_context: int | None = None, max_batch: int = 64, batch_wait: float = 0.005,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS, continuous: bool | None = None,
                 fixed_sampling: Sampling | None = None):
        self.tokenizer, self.model_name, self.host, self.port = tokenizer, model_name, host, port
        self.engine = engine or NativeEngine(model, tokenizer)
        limits = [n for n in (model_context(model), max_context) if n]
        self.max_context = min(limits) if limits else None
        self.max_batch, self.batch_wait, self.default_max_tokens = max_batch, batch_wait, default_max_tokens
        able = serves_continuously(self.engine)
        if continuous and not able:
            raise ValueError("continuous batching needs the native engine's own generate on its fast path, sampling "
                             "the policy's weights in their precision (see grpokit.serving.continuous)")
        self.continuous = able if continuous is None else continuous
        self.fixed_sampling, self.overridden = fixed_sampling, set()
        self.created = int(time.time())
        self.log = EpisodeLog()
        self.tool_calls = ToolCallReader(tokenizer)
        self._requests = itertools.count()
        self._batcher: Batcher | ContinuousBatcher | VLLMBackend | None = None
        self._uvicorn = self._thread = None

    # ---- what is recorded -------------------------------------------------------------------------

    def episode_turns(self, episode_id: str | None) -> list[Turn]:
        """The turns recorded for ``episode_id`` (None: requests under plain ``/v1``), in order of arrival."""
        return self.log.turns(episode_id)

    def pop_episode(self, episode_id: str | None) -> list[Turn]:
        """:meth:`episode_turns`, forgotten by the server."""
        return self.log.pop(episode_id)

    @property
    def batches(self) -> int:
        """``generate`` calls made so far (requests sent together share one); batching continuously, the prefills
        that joined requests to the running decode (requests that arrive together share one); on vLLM, its engine's
        busy spells (the requests of one spell share its decode steps)."""
        return self._batcher.batches if self._batcher else 0

    # ---- addresses --------------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        """The OpenAI base URL of requests attributed to no episode."""
        return f"http://{self.host}:{self.port}/v1"

    def episode_url(self, episode_id: str) -> str:
        """The OpenAI base URL whose requests are attributed to ``episode_id``."""
        return f"http://{self.host}:{self.port}/episodes/{episode_id}/v1"

    # ---- starting and stopping --------------------------------------------------------------------

    def _prepare(self):
        import uvicorn

        from grpokit.serving.api import build_app

        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        # Listening now, not when uvicorn's loop starts: a client that connects as soon as serve_forever says the URL
        # waits in the backlog instead of being refused (uvicorn listens again on it, with its own backlog).
        sock.listen()
        # This thread's idle OpenMP helpers go: counted with the worker's, they would make libgomp throttle the
        # worker's spin-waits (grpokit.runtime.openmp says why; a decode off the main thread was ~1.6x slower).
        release_openmp_pool()
        if self.continuous:
            self._batcher = ContinuousBatcher(self.engine, max_batch=self.max_batch, batch_wait=self.batch_wait)
        else:
            self._batcher = backend_for(self.engine, max_batch=self.max_batch, batch_wait=self.batch_wait)
        config = uvicorn.Config(build_app(self), log_level="warning", lifespan="off", access_log=False)
        self._uvicorn = uvicorn.Server(config)
        return sock

    def start(self) -> PolicyServer:
        """Serve in a background thread; returns once the server accepts requests."""
        sock = self._prepare()
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [sock]},
                                        name="grpokit-serving-http", daemon=True)
        self._thread.start()
        while not self._uvicorn.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the policy server failed to start on {self.host}:{self.port}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop serving and the batcher's thread (requests in flight are answered first)."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join()
        if self._batcher is not None:
            self._batcher.close()
        self._thread = self._uvicorn = None

    def serve_forever(self, announce=print) -> None:
        """Serve in this thread until SIGINT or SIGTERM (uvicorn's handlers), saying the URL first."""
        sock = self._prepare()
        announce(f"serving {self.model_name} at {self.base_url} (OpenAI API; per episode: "
                 f"http://{self.host}:{self.port}/episodes/ID/v1); Ctrl-C stops")
        try:
            self._uvicorn.run(sockets=[sock])
        finally:
            self._batcher.close()

    def __enter__(self) -> PolicyServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- requests ---------------------------------------------------------------------------------

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise RequestError(f"The model {name!r} does not exist: this server serves {self.model_name!r}",
                               param="model", code="model_not_found", status=404)

    def _budget(self, prompt: list[int], asked: int | None, param: str) -> int:
        """The completion's token budget: ``asked`` (or the default, capped by the context left), refused with
        OpenAI's ``context_length_exceeded`` where the prompt and it exceed the context."""
        room = None if self.max_context is None else self.max_context - len(prompt)
        budget = asked if asked is not None else self.default_max_tokens if room is None else \
            min(self.default_max_tokens, room)
        if room is not None and (budget > room or budget < 1):
            raise RequestError(
                f"This model's maximum context length is {self.max_context} tokens. However, you requested "
                f"{len(prompt) + max(budget, 1)} tokens ({len(prompt)} in the prompt, {max(budget, 1)} for the "
                f"completion). Please reduce the prompt or {param}.", param=param, code="context_length_exceeded")
        return budget

    async def _sample(self, prompts: list[list[int]], body: Any, budget: int) -> list[Sample]:
        sampling = Sampling(temperature=body.temperature or 1.0, top_p=body.top_p, greedy=body.temperature == 0,
                            seed=body.seed)
        if self.fixed_sampling is not None:
            fixed = self.fixed_sampling
            asked = {name: getattr(body, name) for name in ("temperature", "top_p", "seed")
                     if name in body.model_fields_set}  # what the request set, not the API's defaults
            differs = any(getattr(sampling, name) != getattr(fixed, name) for name in asked)
            if differs or sampling.greedy != fixed.greedy:
                self.overridden.add(", ".join(f"{name}={value}" for name, value in asked.items()))
            sampling = fixed
        job = Job(prompts, body.n, budget, sampling)
        if self._batcher is None:
            raise RuntimeError("the policy server is not started")
        return await asyncio.wrap_future(self._batcher.submit(job))

    def _finish(self, sample: Sample, stops: list[str]) -> tuple[list[int], list[float], str, str]:
        """``(tokens, logp, text, finish_reason)`` of a sample, cut after the first token that completes a ``stop``
        string (the text then ends before it, as OpenAI's)."""
        ids, logp = sample.completion_ids, sample.logp
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if stops and any(s in text for s in stops):
            for k in range(1, len(ids) + 1):
                head = self.tokenizer.decode(ids[:k], skip_special_tokens=True)
                found = [head.find(s) for s in stops if s in head]
                if found:
                    return ids[:k], logp[:k], head[:min(found)], "stop"
        return ids, logp, text, "stop" if sample.stopped else "length"

    def _record(self, episode: str | None, kind: str, request: int, turns: list[tuple],
                messages: list[dict] | None = None, replies: list[dict] | None = None) -> None:
        self.log.add(episode, [Turn(kind, list(prompt), ids, logp, reason, request, choice, messages,
                                    replies[choice] if replies else None)
                               for choice, (prompt, ids, logp, reason) in enumerate(turns)])

    def _tokens(self, prompt: Any) -> list[list[int]]:
        """A completion request's prompts as token ids (text tokenized as ``grpokit sample`` does)."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        out = [self.tokenizer(p)["input_ids"] if isinstance(p, str) else list(p) for p in prompt]
        if not out or any(not ids for ids in out):
            raise RequestError("prompt must hold at least one token", param="prompt")
        vocabulary = len(self.tokenizer)
        if any(not 0 <= t < vocabulary for ids in out for t in ids):
            raise RequestError(f"prompt token ids must be in [0, {vocabulary})", param="prompt")
        return out

    async def complete(self, body: Any, episode: str | None) -> dict[str, Any]:
        """A ``/v1/completions`` response (OpenAI's shape) for ``body``, recorded under ``episode``."""
        self._check_model(body.model)
        prompts = self._tokens(body.prompt)
        budget = min(self._budget(p, body.max_tokens, "max_tokens") for p in prompts)  # each prompt's room
        request = next(self._requests)
        samples = await self._sample(prompts, body, budget)
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        choices, turns = [], []
        for index, sample in enumerate(samples):
            ids, logp, text, reason = self._finish(sample, stops)
            turns.append((sample.prompt_ids, ids, logp, reason))
            choices.append({"index": index, "text": text, "finish_reason": reason,
                            "logprobs": self._completion_logprobs(ids, logp) if body.logprobs is not None else None})
        self._record(episode, "completion", request, turns)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": _usage(prompts, turns)}

    async def chat(self, body: Any, episode: str | None) -> dict[str, Any]:
        """A ``/v1/chat/completions`` response for ``body``, recorded under ``episode``."""
        self._check_model(body.model)
        tools = body.tools if body.tool_choice != "none" else None
        if tools:
            self.tool_calls.check()
        prompt = self._tokens(render_chat(self.tokenizer, body.messages, tools))[0]
        asked, param = (body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens \
            else (body.max_tokens, "max_tokens")
        budget = self._budget(prompt, asked, param)
        request = next(self._requests)
        samples = await self._sample([prompt], body, budget)
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        choices, turns = [], []
        for index, sample in enumerate(samples):
            ids, logp, text, reason = self._finish(sample, stops)
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tools:
                message["content"], calls = self.tool_calls.message(text)
                if calls:
                    message["tool_calls"], reason = calls, "tool_calls"
            turns.append((sample.prompt_ids, ids, logp, reason))
            choices.append({"index": index, "message": message, "finish_reason": reason,
                            "logprobs": self._chat_logprobs(ids, logp) if body.logprobs else None})
        self._record(episode, "chat", request, turns, [dict(m) for m in body.messages],
                     [choice["message"] for choice in choices])
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": _usage([prompt], turns)}

    def _pieces(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([t], skip_special_tokens=False) for t in ids]

    def _completion_logprobs(self, ids: list[int], logp: list[float]) -> dict[str, Any]:
        pieces = self._pieces(ids)
        offsets = list(itertools.accumulate((len(p) for p in pieces[:-1]), initial=0)) if pieces else []
        return {"tokens": pieces, "token_logprobs": logp, "top_logprobs": None, "text_offset": offsets}

    def _chat_logprobs(self, ids: list[int], logp: list[float]) -> dict[str, Any]:
        return {"content": [{"token": piece, "logprob": value, "bytes": list(piece.encode()), "top_logprobs": []}
                            for piece, value in zip(self._pieces(ids), logp)], "refusal": None}


def _usage(prompts: list[list[int]], turns: list[tuple]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(ids) for _, ids, _, _ in turns)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
