"""Rollouts: sample G completions per prompt with a KV cache (docs/math.md, step 1); scoring them is
:mod:`grpokit.models.logprobs`'s.

Works with any Hugging Face causal LM that accepts ``attention_mask``, ``position_ids``, a KV
cache (``cache`` or ``past_key_values``) and ``logits_to_keep``. Prompts are left-padded so that every row's next token
sits in the last column; completions are right-padded.

The completion mask is built from where each completion stopped (its first EOS, which it includes),
never from ``ids != pad_id``: with pad == EOS that comparison would hide the EOS token from the loss
and train a model that never stops.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
import torch.utils.checkpoint
from torch import Tensor

from grpokit.models.fast.llama_family import LlamaFamily, unsupported
from grpokit.models.logprobs import position_ids_from_mask
from grpokit.rollout.episodes import InertSession, ToolSession


@dataclass
class Rollout:
    """Prompts repeated G times and their sampled completions. N = B prompts × G."""

    prompt_ids: Tensor  # (N, P) left-padded
    prompt_mask: Tensor  # (N, P) 1 on real prompt tokens
    completion_ids: Tensor  # (N, T) right-padded with pad_token_id
    completion_mask: Tensor  # (N, T) 1 up to and including the first EOS
    logp: Tensor  # (N, T) float32 log-probs of the sampled tokens at the sampling temperature
    truncated: Tensor  # (N,) bool: reached max_new_tokens without EOS
    # (N, T) 1 on tokens a tool's result inserted (context, not the policy's actions); None: no tools
    tool_mask: Tensor | None = None

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def lengths(self) -> Tensor:
        """(N,) tokens of each completion, inserted tool results included (what the model reads)."""
        return self.completion_mask.sum(dim=1)

    @property
    def model_mask(self) -> Tensor:
        """(N, T) 1 on the policy's own tokens: the completion mask less inserted tool results. The loss, the
        KL, the entropy and the length metrics read this one."""
        return self.completion_mask if self.tool_mask is None else self.completion_mask * (1 - self.tool_mask)

    def decode(self, tokenizer) -> list[str]:
        """The N completions as text, each cut where it stopped; special tokens (EOS) dropped."""
        ids = [row[: int(n)].tolist() for row, n in zip(self.completion_ids, self.lengths)]
        return tokenizer.batch_decode(ids, skip_special_tokens=True)

    def sequences(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """What a model reads: ``(prompt_ids, prompt_mask, completion_ids, completion_mask)``."""
        return self.prompt_ids, self.prompt_mask, self.completion_ids, self.completion_mask

    def select(self, index: Tensor | slice) -> Rollout:
        """The completions at ``index`` (a bool mask, indices or a slice over N)."""
        return Rollout(*(None if (v := getattr(self, f.name)) is None else v[index] for f in fields(self)))

    def split(self, size: int) -> list[Rollout]:
        """Consecutive micro-batches of at most ``size`` completions (views, not copies)."""
        return [self.select(slice(start, start + size)) for start in range(0, len(self), size)]

    @staticmethod
    def cat(rollouts: Sequence[Rollout], pad_token_id: int) -> Rollout:
        """Stack rollouts of different widths: prompts left-padded, completions right-padded."""
        prompt_width = max(r.prompt_ids.shape[1] for r in rollouts)
        width = max(r.completion_ids.shape[1] for r in rollouts)

        def pad(tensors: list[Tensor], to: int, value: float, left: bool) -> Tensor:
            padded = [
                torch.nn.functional.pad(t, (to - t.shape[1], 0) if left else (0, to - t.shape[1]), value=value)
                for t in tensors
            ]
            return torch.cat(padded)

        return Rollout(
            prompt_ids=pad([r.prompt_ids for r in rollouts], prompt_width, pad_token_id, left=True),
            prompt_mask=pad([r.prompt_mask for r in rollouts], prompt_width, 0, left=True),
            completion_ids=pad([r.completion_ids for r in rollouts], width, pad_token_id, left=False),
            completion_mask=pad([r.completion_mask for r in rollouts], width, 0, left=False),
            logp=pad([r.logp for r in rollouts], width, 0.0, left=False),
            truncated=torch.cat([r.truncated for r in rollouts]),
            tool_mask=None if all(r.tool_mask is None for r in rollouts) else pad(
                [torch.zeros_like(r.completion_mask) if r.tool_mask is None else r.tool_mask for r in rollouts],
                width, 0, left=False),
        )


def top_p_filter(logits: Tensor, top_p: float) -> Tensor:
    """Set to -inf the logits (…, V) outside each row's smallest set whose probability reaches ``top_p``."""
    if top_p >= 1.0:
        return logits
    sorted_logits, sorted_idx = torch.sort(logits, descending=True, dim=-1)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p; the top token always stays.
    drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
    drop = drop_sorted.scatter(-1, sorted_idx, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def top_k_filter(logits: Tensor, top_k: int) -> Tensor:
    """Set to -inf the logits (…, V) below each row's ``top_k``-th largest (0: none; ties at the k-th stay)."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def min_p_filter(logits: Tensor, min_p: float) -> Tensor:
    """Set to -inf the logits (…, V) of tokens less likely than ``min_p`` times the row's most likely one."""
    if min_p <= 0:
        return logits
    # p_i < min_p · p_max  ⇔  logit_i < logit_max + log(min_p): no softmax needed
    cut = logits.max(dim=-1, keepdim=True).values + math.log(min_p)
    return logits.masked_fill(logits < cut, float("-inf"))


def penalize_repeats(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """transformers' repetition penalty: the logits (A, V) of tokens ``seen`` (A, V bool: in the prompt or the
    completion so far) divided by ``penalty`` where positive, multiplied by it where negative."""
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def sample_tokens(probs: Tensor, generator: torch.Generator | None = None, u: Tensor | None = None) -> Tensor:
    """One token per row of ``probs`` (A, V), drawn by inverse transform: a uniform draw per row, found
    in the row's cumulative distribution. The distribution of ``torch.multinomial(probs, 1)`` at a sixth
    of its cost at decoding's few rows (one uniform per row instead of one exponential per token). ``u`` (A, 1):
    the draws to use (else drawn from ``generator``)."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    if u is None:
        u = torch.rand(total.shape, generator=generator, dtype=cdf.dtype, device=cdf.device)
    else:  # given draws: converted here only (the plain path adds no operator per step)
        u = u.to(cdf.dtype)
    chosen = torch.searchsorted(cdf, u * total, right=True)  # a token of probability 0 spans no interval
    # u · total can round up to total: the last token of positive probability, never one of zero.
    return torch.minimum(chosen, torch.searchsorted(cdf, total)).squeeze(1)


def stop_token_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    """The tokenizer's EOS plus any EOS ids in the model's generation config (chat models often have
    several: end of turn and end of text)."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for token_id in [configured] if isinstance(configured, int) else configured or []:
        if token_id not in ids:
            ids.append(token_id)
    if not ids:
        raise ValueError("the tokenizer has no eos_token and the model no eos_token_id; set one so completions stop")
    return ids


def padding_id(tokenizer, stop_ids: list[int]) -> int:
    """The id completions are padded with after they stop: the tokenizer's pad, else the first stop id (padding is
    masked everywhere, so any id serves; the tokenizer is left as it is)."""
    return stop_ids[0] if tokenizer.pad_token_id is None else tokenizer.pad_token_id


def _cache_argument(model: torch.nn.Module) -> str:
    # transformers 5.2x renamed ``past_key_values`` to ``cache``; older versions use the old name. Wrappers
    # (peft) forward keyword arguments: ask the model they wrap.
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    *,
    num_generations: int,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int],
    pad_token_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    generator: torch.Generator | None = None,
    greedy: bool = False,
    stop_early: bool = True,
    fast: bool = True,
    tools: ToolSession | InertSession | None = None,
    int8: bool = False,
    graph: bool = False,
    exact_prefill: bool = False,
) -> Rollout:
    """Sample ``num_generations`` completions for each of the B left-padded prompts (B, P).

    Each group of G completions of one prompt is contiguous in the output. A completion stops at the
    first token in ``eos_token_id`` (one id or several, as chat models often have). With ``greedy=True`` the
    argmax is taken (and ``logp`` is still reported at ``temperature``). As transformers' ``generate``: the repetition
    penalty on the raw logits, then the temperature, ``top_k``, ``top_p``, ``min_p`` (each off at its default); ``logp``
    is the policy's at the temperature, before them all, as the loss recomputes it. ``stop_early=False`` runs all
    ``max_new_tokens`` decode steps even when every completion has stopped (sharded models need every
    process to run the same passes); the result is the same. With ``fast`` and a model
    :mod:`grpokit.models.fast.llama_family` supports, decoding uses a preallocated cache and drops finished
    completions from the batch (the same distribution; ``stop_early`` is then moot). With ``tools`` (a
    :class:`~grpokit.rollout.episodes.ToolSession`), a completion that closes a tool call (or ends a turn its
    environment replies to) waits in holes while the others keep decoding, then gets the result inserted as its next
    tokens, through the same cache; the Rollout's ``tool_mask`` marks them.
    An inert session (the empty box's: no tools) is as None: it never sees a decode step. ``int8``: sample with
    the model's projections and LM head in int8 (:mod:`grpokit.models.fast.int8`; the fast path, on the CPU).
    ``graph``: the fast path with fixed shapes, its decode step captured as a CUDA graph on CUDA (the same tokens).
    ``exact_prefill``: under autocast, the prompts read with autocast off (in the weights' precision), the decode
    steps under it (``rollout_precision: bf16_autocast``).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0 or not 0 <= min_p <= 1 or not repetition_penalty > 0:
        raise ValueError(f"top_k must be >= 0, min_p in [0, 1], repetition_penalty > 0; got {top_k}, {min_p}, "
                         f"{repetition_penalty}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    fast_only = "int8" if int8 else "graph" if graph else None  # what only the fast path decodes
    if fast_only and not fast:
        raise ValueError(f"{fast_only} decoding runs on the fast path: fast=True")
    device = next(model.parameters()).device
    unique_ids, unique_mask = prompt_ids.to(device), prompt_mask.to(device)  # (B, P)
    prompt_ids = unique_ids.repeat_interleave(num_generations, dim=0)  # (N, P)
    prompt_mask = unique_mask.repeat_interleave(num_generations, dim=0)
    n = prompt_ids.shape[0]
    stop_ids = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=device)

    calling = bool(tools)  # asked once: an inert session costs nothing per decode step
    seen = None  # with a repetition penalty: (N, V) which tokens each row's prompt and completion hold so far
    if repetition_penalty != 1.0:
        vocabulary = model.get_output_embeddings().weight.shape[0]
        seen = torch.zeros(n, vocabulary, dtype=torch.bool, device=device)
        seen.scatter_(1, prompt_ids.masked_fill(prompt_mask == 0, 0), prompt_mask.bool())
    # per decode step: rows, their columns (the step t, or each row's own with tools), tokens, log-probs, stopped
    picks: list[tuple[Tensor, int | Tensor, Tensor, Tensor, Tensor]] = []
    why = unsupported(model) if fast else None
    if fast_only and why is not None:
        raise ValueError(f"{fast_only} decoding needs a model the fast path runs: {why}")
    if calling:
        # A completion waiting for a call leaves holes in the decode steps: only where each step's shapes may
        # change and the processes need not run the same steps (episodes.py's ToolSession).
        tools.can_hold = tools.box.overlap and stop_early and not graph
        # Completion i's k-th token from draw [i, k]: the tokens do not depend on how long the calls took.
        uniforms = None if greedy else tools.uniforms(generator, device)
        filled = torch.zeros(n, dtype=torch.long, device=device)  # tokens each completion holds so far

    def choose(logits: Tensor, t: int, rows: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Pick the next tokens of the still-running ``rows`` from their logits (A, V); record them. Returns the
        picks, which rows leave the batch (stopped, or at the token budget) and which picks are holes (None: none)."""
        columns = filled[rows] if calling else None
        policy = logits = logits / temperature if temperature != 1.0 else logits  # x / 1 is x: skip the operator
        if seen is not None:  # (x / T) / p is transformers' (x / p) / T
            logits = penalize_repeats(logits, seen[rows], repetition_penalty)
        if greedy:
            chosen = logits.argmax(dim=-1)
        else:
            probs = torch.softmax(min_p_filter(top_p_filter(top_k_filter(logits, top_k), top_p), min_p), dim=-1)
            chosen = sample_tokens(probs, generator, None if not calling else uniforms[rows, columns].unsqueeze(1))
        stopped = chosen == stop_ids[0] if len(stop_ids) == 1 else torch.isin(chosen, stop_ids)  # == is cheaper
        # log-prob at the sampling temperature, before top-p: what the loss recomputes (§5). log_softmax
        # is one operator; token_logprobs' logsumexp (kept for training: a smaller autograd graph) is
        # several, which shows at decoding's few rows.
        logp = torch.log_softmax(policy, dim=-1).gather(1, chosen.unsqueeze(1)).squeeze(1)
        if not calling:  # every row's column is t; the loops end at the budget
            picks.append((rows, t, chosen, logp, stopped))
            if seen is not None:
                seen[rows, chosen] = True
            return chosen, stopped, None
        # queued tool-result tokens replace the picks of the rows that called; rows waiting for a call hold
        chosen, stopped, logp, hold = tools.intervene(columns, rows, chosen, stopped, logp)
        kept = ~hold
        if seen is not None:
            seen[rows[kept], chosen[kept]] = True
        picks.append((rows[kept], columns[kept], chosen[kept], logp[kept], stopped[kept]))
        filled[rows[kept]] += 1
        waiting = hold & ~stopped  # rows whose environment ended the episode hold and leave: not a hole
        return chosen, stopped | (filled[rows] >= max_new_tokens), waiting if waiting.any() else None

    if fast and why is None:
        LlamaFamily(model).decode(unique_ids, unique_mask, max_new_tokens, choose, repeats=num_generations, int8=int8,
                                  graph=graph, exact_prefill=exact_prefill)
    else:
        _decode(model, prompt_ids, prompt_mask, max_new_tokens, choose, stop_early, exact_prefill)

    # Every step's picks written at once (a few operators, not a few per decode step). A row is chosen
    # for until it stops, so it stops at most once.
    rows, columns, chosen, logp, stopped = zip(*picks)
    columns = torch.cat(columns) if calling else torch.tensor(columns, device=device).repeat_interleave(
        torch.tensor([len(r) for r in rows], device=device))
    rows, chosen, logp, stopped = (torch.cat(part) for part in (rows, chosen, logp, stopped))
    tokens = torch.full((n, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    logps = torch.zeros((n, max_new_tokens), dtype=torch.float32, device=device)
    tokens.index_put_((rows, columns), chosen)
    logps.index_put_((rows, columns), logp)
    finished = torch.zeros(n, dtype=torch.bool, device=device)
    lengths = torch.full((n,), max_new_tokens, dtype=torch.long, device=device)
    ended = rows[stopped]
    finished[ended] = True
    lengths[ended] = columns[stopped] + 1
    if calling:
        # Completions that an environment ended (after a reply) stopped without a stop token of their own.
        lengths = torch.minimum(lengths, filled)
        finished |= filled < max_new_tokens
        tools.finish(lengths.tolist())

    width = int(lengths.max().item())
    completion_mask = torch.arange(width, device=device).unsqueeze(0) < lengths.unsqueeze(1)
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask.long(),
        completion_ids=tokens[:, :width],
        completion_mask=completion_mask.long(),
        logp=logps[:, :width],
        truncated=~finished,
        tool_mask=tools.tool_mask(width, device) if calling else None,
    )


def _decode(model, prompt_ids, prompt_mask, max_new_tokens, choose, stop_early, exact_prefill) -> None:
    """The decode loop over the model's own forward and its KV cache (any Hugging Face causal LM). A row whose
    pick is a hole (it waits for a call) feeds a token that is masked out of every later step, its position not
    advanced; the loop then runs past ``max_new_tokens`` steps until every row has left."""
    n = prompt_ids.shape[0]
    attention_mask = prompt_mask.long()
    position_ids = position_ids_from_mask(attention_mask)
    rows = torch.arange(n, device=prompt_ids.device)
    next_tokens = torch.zeros(n, dtype=torch.long, device=prompt_ids.device)
    finished = torch.zeros(n, dtype=torch.bool, device=prompt_ids.device)
    cache_name = _cache_argument(model)
    input_ids, cache, holes = prompt_ids, None, False
    fed = torch.ones_like(next_tokens)  # 1 where the row's last pick was a token, 0 where it was a hole
    for t in itertools.count():
        exact = exact_prefill and t == 0  # the prompts with autocast off
        with torch.autocast(prompt_ids.device.type, enabled=False) if exact else contextlib.nullcontext():
            out = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                logits_to_keep=1,
                **{cache_name: cache},
            )
        cache = getattr(out, cache_name)
        running = ~finished
        advance, fed = fed, running.long()  # finished rows take no position (the loop may run past the budget)
        if running.any():  # finished rows keep feeding their last token: never read again
            next_tokens[running], finished[running], hold = choose(out.logits[running, -1, :].float(), t, rows[running])
            if hold is not None:
                fed[rows[running][hold]], holes = 0, True
        if (stop_early and finished.all()) or (t >= max_new_tokens - 1 and not holes):
            break
        input_ids = next_tokens.unsqueeze(1)
        attention_mask = torch.cat([attention_mask, fed.unsqueeze(1)], dim=1)
        # A hole takes the position after the row's last token, and the next token takes it again.
        position_ids = position_ids + advance.unsqueeze(1) if t else position_ids[:, -1:] + 1
