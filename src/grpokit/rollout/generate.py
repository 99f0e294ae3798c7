"""Rollouts: sample G completions per prompt with a KV cache (docs/math.md, step 1), and score sequences.

Works with any Hugging Face causal LM that accepts ``attention_mask``, ``position_ids``, a KV
cache (``cache`` or ``past_key_values``) and ``logits_to_keep``. Prompts are left-padded so that every row's next token
sits in the last column; completions are right-padded.

The completion mask is built from where each completion stopped (its first EOS, which it includes),
never from ``ids != pad_id``: with pad == EOS that comparison would hide the EOS token from the loss
and train a model that never stops.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor

from grpokit.config import DEFAULT_CHUNK_MB
from grpokit.core.objective import token_entropy, token_logprobs
from grpokit.models.chunked_logprobs import chunk_rows, chunked_logprobs_and_entropy
from grpokit.models.fast.llama_family import LlamaFamily, unsupported, unwrap_peft
from grpokit.rollout.tools import ToolSession
from grpokit.training.distributed import is_sharded

try:  # transformers >= 4.52: each decoder layer checkpoints itself
    from transformers.modeling_layers import GradientCheckpointingLayer
except ImportError:  # earlier: the base model checkpoints the layers it loops over
    GradientCheckpointingLayer = None

# Models whose causal-LM forward is exactly ``lm_head(base_model(...).last_hidden_state)``, nothing after the
# head (Gemma 2 soft-caps its logits, Cohere and Granite scale them): off the fast path, their head may run
# in chunks on the base model's hidden states.
PLAIN_HEAD_MODELS = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gpt2", "gpt_neox", "phi", "phi3", "olmo",
                     "olmo2", "smollm3", "starcoder2")


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


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that start at 0 at each row's first real token (left padding)."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def top_p_filter(logits: Tensor, top_p: float) -> Tensor:
    """Set to -inf the logits outside the smallest set whose probability reaches ``top_p``."""
    if top_p >= 1.0:
        return logits
    sorted_logits, sorted_idx = torch.sort(logits, descending=True, dim=-1)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p; the top token always stays.
    drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
    drop = drop_sorted.scatter(-1, sorted_idx, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_tokens(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One token per row of ``probs`` (A, V), drawn by inverse transform: a uniform draw per row, found
    in the row's cumulative distribution. The distribution of ``torch.multinomial(probs, 1)`` at a sixth
    of its cost at decoding's few rows (one uniform per row instead of one exponential per token)."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    u = torch.rand(total.shape, generator=generator, dtype=cdf.dtype, device=cdf.device)
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
    greedy: bool = False,
    generator: torch.Generator | None = None,
    stop_early: bool = True,
    fast: bool = True,
    tools: ToolSession | None = None,
) -> Rollout:
    """Sample ``num_generations`` completions for each of the B left-padded prompts (B, P).

    Each group of G completions of one prompt is contiguous in the output. A completion stops at the
    first token in ``eos_token_id`` (one id or several, as chat models often have). With ``greedy=True`` the
    argmax is taken (and ``logp`` is still reported at ``temperature``). ``stop_early=False`` runs all
    ``max_new_tokens`` decode steps even when every completion has stopped (sharded models need every
    process to run the same passes); the result is the same. With ``fast`` and a model
    :mod:`grpokit.models.fast.llama_family` supports, decoding uses a preallocated cache and drops finished
    completions from the batch (the same distribution; ``stop_early`` is then moot). With ``tools`` (a
    :class:`~grpokit.rollout.tools.ToolSession`), a completion that closes a tool call gets the result inserted as its
    next tokens, through the same cache, while the others keep decoding; the Rollout's ``tool_mask`` marks them.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = next(model.parameters()).device
    unique_ids, unique_mask = prompt_ids.to(device), prompt_mask.to(device)  # (B, P)
    prompt_ids = unique_ids.repeat_interleave(num_generations, dim=0)  # (N, P)
    prompt_mask = unique_mask.repeat_interleave(num_generations, dim=0)
    n = prompt_ids.shape[0]
    stop_ids = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=device)

    picks: list[tuple[int, Tensor, Tensor, Tensor, Tensor]] = []  # per decode step: t, rows, tokens, log-probs, stopped

    def choose(logits: Tensor, t: int, rows: Tensor) -> tuple[Tensor, Tensor]:
        """Pick the next tokens of the still-running ``rows`` from their logits (A, V); record them."""
        logits = logits / temperature if temperature != 1.0 else logits  # x / 1 is x: skip the operator
        if greedy:
            chosen = logits.argmax(dim=-1)
        else:
            probs = torch.softmax(top_p_filter(logits, top_p), dim=-1)
            chosen = sample_tokens(probs, generator)
        stopped = chosen == stop_ids[0] if len(stop_ids) == 1 else torch.isin(chosen, stop_ids)  # == is cheaper
        # log-prob at the sampling temperature, before top-p: what the loss recomputes (§5). log_softmax
        # is one operator; token_logprobs' logsumexp (kept for training: a smaller autograd graph) is
        # several, which shows at decoding's few rows.
        logp = torch.log_softmax(logits, dim=-1).gather(1, chosen.unsqueeze(1)).squeeze(1)
        if tools is not None:  # queued tool-result tokens replace the picks of the rows that called
            chosen, stopped, logp = tools.intervene(t, rows, chosen, stopped, logp)
        picks.append((t, rows, chosen, logp, stopped))
        return chosen, stopped

    if fast and unsupported(model) is None:
        LlamaFamily(model).decode(unique_ids, unique_mask, max_new_tokens, choose, repeats=num_generations)
    else:
        _decode(model, prompt_ids, prompt_mask, max_new_tokens, choose, stop_early)

    # Every step's picks written at once (a few operators, not a few per decode step). A row is chosen
    # for until it stops, so it stops at most once.
    steps, rows, chosen, logp, stopped = zip(*picks)
    columns = torch.tensor(steps, device=device).repeat_interleave(torch.tensor([len(r) for r in rows], device=device))
    rows, stopped = torch.cat(rows), torch.cat(stopped)
    tokens = torch.full((n, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    logps = torch.zeros((n, max_new_tokens), dtype=torch.float32, device=device)
    tokens.index_put_((rows, columns), torch.cat(chosen))
    logps.index_put_((rows, columns), torch.cat(logp))
    finished = torch.zeros(n, dtype=torch.bool, device=device)
    lengths = torch.full((n,), max_new_tokens, dtype=torch.long, device=device)
    ended = rows[stopped]
    finished[ended] = True
    lengths[ended] = columns[stopped] + 1

    width = int(lengths.max().item())
    completion_mask = torch.arange(width, device=device).unsqueeze(0) < lengths.unsqueeze(1)
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask.long(),
        completion_ids=tokens[:, :width],
        completion_mask=completion_mask.long(),
        logp=logps[:, :width],
        truncated=~finished,
        tool_mask=None if tools is None else tools.tool_mask(width, device),
    )


def _decode(model, prompt_ids, prompt_mask, max_new_tokens, choose, stop_early) -> None:
    """The decode loop over the model's own forward and its KV cache (any Hugging Face causal LM)."""
    n = prompt_ids.shape[0]
    attention_mask = prompt_mask.long()
    position_ids = position_ids_from_mask(attention_mask)
    rows = torch.arange(n, device=prompt_ids.device)
    next_tokens = torch.zeros(n, dtype=torch.long, device=prompt_ids.device)
    finished = torch.zeros(n, dtype=torch.bool, device=prompt_ids.device)
    cache_name = _cache_argument(model)
    input_ids, cache = prompt_ids, None
    for t in range(max_new_tokens):
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
        if running.any():  # finished rows keep feeding their last token: never read again
            next_tokens[running], finished[running] = choose(out.logits[running, -1, :].float(), t, rows[running])
        if stop_early and finished.all():
            break
        input_ids = next_tokens.unsqueeze(1)
        attention_mask = torch.cat([attention_mask, torch.ones_like(input_ids)], dim=1)
        position_ids = position_ids[:, -1:] + 1


def sequence_inputs(
    prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor
) -> dict[str, Tensor]:
    """Model inputs for prompts followed by their completions, as during generation."""
    return {
        "input_ids": torch.cat([prompt_ids, completion_ids], dim=1),
        "attention_mask": torch.cat([prompt_mask, completion_mask], dim=1),
        # Positions continue through the completion even after EOS, as during generation.
        "position_ids": position_ids_from_mask(torch.cat([prompt_mask, torch.ones_like(completion_mask)], dim=1)),
    }


def sequence_logprobs(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    fast: bool = True,
    chunk_mb: float = DEFAULT_CHUNK_MB,
    checkpoint_layers: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (N, T) of ``completion_ids`` given the prompts, in one forward pass, float32; 0 where
    ``completion_mask`` is 0.

    Returns ``(logp, entropy)``; ``entropy`` (N, T) is the policy's per-token entropy when
    ``with_entropy`` and None otherwise. With ``fast`` and a model :mod:`grpokit.models.fast.llama_family`
    supports, only the real tokens are computed (the same values within float rounding). The LM head
    runs on the K completion tokens ``chunk_mb`` MiB of logits at a time (:mod:`grpokit.models.chunked_logprobs`:
    the same values and gradients, without the (K, V) logits held for backward), unless
    :func:`full_logits_reason` says why it cannot; then the model's full logits are computed as they are.
    ``checkpoint_layers``: each decoder layer is recomputed in backward (activation checkpointing), on the fast
    path and, under :func:`checkpointed_layers`, through the model's own forward.
    """
    mask = completion_mask.bool()
    fast = fast and unsupported(model) is None and bool((prompt_mask.sum(dim=1) > 0).all())
    reason = full_logits_reason(model, chunk_mb, fast)
    if fast:
        family = LlamaFamily(model)
        hidden = _real_token_hidden(family, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                    checkpoint_layers)  # (K, H)
    elif reason is None:
        width = completion_ids.shape[1]
        inputs = sequence_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask)
        with checkpointed_layers(model, checkpoint_layers):
            if is_sharded(model):  # FSDP gathers the parameters in the model's own forward: run it, head aside
                with head_returns_hidden_states(model):
                    states = model(**inputs, use_cache=False, logits_to_keep=width + 1).logits
            else:
                states = unwrap_peft(model).base_model(**inputs, use_cache=False).last_hidden_state
        hidden = states[:, -(width + 1):-1][mask]  # (K, H): the states that predicted each token
    else:
        with checkpointed_layers(model, checkpoint_layers):
            return _full_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature,
                                  with_entropy)
    tokens = completion_ids[mask]  # (K,)
    if reason is None:
        head = unwrap_peft(model).get_output_embeddings()
        weight, bias = head.weight, head.bias
        device = weight.device.type
        if not fast and torch.is_autocast_enabled(device):  # the head in autocast's dtype, as the model's forward
            dtype = torch.get_autocast_dtype(device)
            weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
        chunk = chunk_rows(weight.shape[0], chunk_mb)
        logp, entropy = chunked_logprobs_and_entropy(hidden, weight, bias, tokens, temperature, chunk, with_entropy)
    else:
        logits = family.head(hidden)  # (K, V)
        logp = token_logprobs(logits, tokens, temperature)
        entropy = token_entropy(logits.detach(), temperature) if with_entropy else None
    rows, steps = mask.nonzero().unbind(1)
    logp = torch.zeros(mask.shape, dtype=logp.dtype, device=mask.device).index_put((rows, steps), logp)
    if entropy is not None:
        entropy = torch.zeros(mask.shape, dtype=entropy.dtype, device=mask.device).index_put((rows, steps), entropy)
    return logp, entropy


@contextlib.contextmanager
def checkpointed_layers(model: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within the block, the model's own forward checkpoints each transformers decoder layer: it keeps the
    layer's input and recomputes the layer in backward. Unlike ``model.gradient_checkpointing_enable()`` this
    needs no training mode (grpokit's passes run in eval mode, without dropout): only the flags of the modules
    that decide it are set (the layers, ``GradientCheckpointingLayer``; before transformers 4.52 the base
    model), and restored after the block, before backward recomputes the layers."""
    if not enabled or not torch.is_grad_enabled():
        yield
        return
    if GradientCheckpointingLayer is not None:
        layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    else:
        layers = [m for m in model.modules() if isinstance(getattr(m, "gradient_checkpointing", None), bool)]
    if not layers:
        raise ValueError(f"gradient_checkpointing: {type(unwrap_peft(model)).__name__} has no transformers "
                         "decoder layer that can be checkpointed (GradientCheckpointingLayer)")
    saved = [(m.gradient_checkpointing, m.training, m.__dict__.get("_gradient_checkpointing_func")) for m in layers]
    for m in layers:
        m.gradient_checkpointing, m.training = True, True
        m._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    try:
        yield
    finally:
        for m, (flag, training, func) in zip(layers, saved):
            m.gradient_checkpointing, m.training = flag, training
            if func is None:
                del m._gradient_checkpointing_func
            else:
                m._gradient_checkpointing_func = func


class PolicyLogprobs(torch.nn.Module):
    """The policy's training pass, :func:`sequence_logprobs`, as a module's forward: DDP wraps this (its forward
    starts the gradient sync) so that under torchrun the pass is the same as in one process — the fast path and
    the LM head in chunks — rather than the model's own forward with its full logits. The policy is
    ``self.model`` (its parameters are the same tensors)."""

    def __init__(self, model: torch.nn.Module, **options: Any):
        super().__init__()
        self.model, self.options = model, options  # temperature, fast, chunk_mb, checkpoint_layers

    def forward(self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor,
                with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        return sequence_logprobs(self.model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                 with_entropy=with_entropy, **self.options)


def full_logits_reason(model: torch.nn.Module, chunk_mb: float, fast: bool) -> str | None:
    """None when :func:`sequence_logprobs` runs ``model``'s LM head in chunks on the fast path (``fast``)
    or on the final hidden states of its base model; otherwise why it computes the full logits instead."""
    if not chunk_mb:
        return "logprob_chunk_mb is 0"
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return "a DDP module, whose own forward must run (its gradient sync): wrap PolicyLogprobs instead"
    inner = unwrap_peft(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear:  # exactly: a LoRA or quantised head computes something else
        return f"the LM head is a {type(head).__name__}, not a plain torch.nn.Linear"
    if head._forward_hooks or head._forward_pre_hooks:
        return "forward hooks on the LM head"
    if fast:
        return None
    model_type = getattr(getattr(inner, "config", None), "model_type", None)
    if model_type not in PLAIN_HEAD_MODELS:
        return f"model_type {model_type!r} is not one of {PLAIN_HEAD_MODELS}"
    if not is_sharded(model) and any(m._forward_hooks or m._forward_pre_hooks for m in (model, inner)):
        return "forward hooks on the model"  # (an FSDP model's are FSDP's, and its own forward runs them)
    return None


@contextlib.contextmanager
def head_returns_hidden_states(model: torch.nn.Module) -> Iterator[None]:
    """Within the block the model's own forward returns, as its ``logits``, the final hidden states the LM head
    would read: an FSDP-sharded model gathers its parameters in that forward, and as the root it keeps them
    gathered until backward, so the head can then run in chunks on its (gathered) weight."""
    inner = unwrap_peft(model)
    head = inner.get_output_embeddings()
    inner.set_output_embeddings(torch.nn.Identity())
    try:
        yield
    finally:
        inner.set_output_embeddings(head)


def _full_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature,
                   with_entropy) -> tuple[Tensor, Tensor | None]:
    """:func:`sequence_logprobs` through the model's own forward and its full logits (N, T, V)."""
    width = completion_ids.shape[1]
    logits = model(
        **sequence_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask),
        use_cache=False,
        logits_to_keep=width + 1,
    ).logits[:, -(width + 1):-1, :]  # (N, T, V): the logits that predicted each completion token
    # (sliced again: models that ignore ``logits_to_keep``, e.g. GPT-2 in transformers 4.50, return all)
    mask = completion_mask.bool()
    logp = token_logprobs(logits, completion_ids, temperature) * mask
    entropy = token_entropy(logits.detach(), temperature) * mask if with_entropy else None
    return logp, entropy


def _real_token_hidden(family: LlamaFamily, prompt_ids, prompt_mask, completion_ids, completion_mask,
                       checkpoint_layers: bool = False) -> Tensor:
    """The final hidden states (K, H) that predicted the K completion tokens, from the fast path: each row's
    real tokens laid out from column 0 (its prompt, then its completion up to where it stopped), and rows
    with the same prompt (a group's G completions) sharing the first such row's computation of it."""
    tokens = torch.cat([prompt_mask, completion_mask], dim=1).bool()
    columns = tokens.long().cumsum(dim=1) - 1
    lengths = tokens.sum(dim=1)
    input_ids = torch.zeros(tokens.shape[0], int(lengths.max()), dtype=torch.long, device=tokens.device)
    input_ids[tokens.nonzero()[:, 0], columns[tokens]] = torch.cat([prompt_ids, completion_ids], dim=1)[tokens]
    prompt_lengths = prompt_mask.sum(dim=1)
    rows, steps = completion_mask.bool().nonzero().unbind(1)
    predict = torch.stack([rows, prompt_lengths[rows] + steps - 1], dim=1)  # the position before each token
    key = torch.cat([prompt_ids * prompt_mask, prompt_mask], dim=1)
    _, same = torch.unique(key, dim=0, return_inverse=True)
    n = key.shape[0]
    first = torch.full((int(same.max()) + 1,), n, device=key.device).scatter_reduce(
        0, same, torch.arange(n, device=key.device), "amin")
    return family.hidden_states(input_ids, lengths, predict, first[same], prompt_lengths, checkpoint_layers)
