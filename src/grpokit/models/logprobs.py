"""Log-probabilities of sampled tokens under a model: the training, π_old and π_ref passes (docs/math.md, step 4).

:func:`sequence_logprobs` scores prompts followed by their completions, as sampled: on the fast path
(:mod:`grpokit.models.fast`) where it can run the model, else through the model's own forward; the LM head in
chunks of tokens (:mod:`grpokit.models.chunked_logprobs`) where the model's forward is exactly
``lm_head(hidden)``, so the (tokens × vocabulary) logits are never held for backward; each decoder layer under
activation checkpointing when asked. :class:`PolicyLogprobs` is the same pass as a module, for DDP to wrap.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor

from grpokit.config import DEFAULT_CHUNK_MB
from grpokit.core.objective import token_entropy, token_logprobs
from grpokit.models.chunked_logprobs import chunk_rows, chunked_logprobs_and_entropy
from grpokit.models.fast.llama_family import LlamaFamily, unsupported, unwrap_peft
from grpokit.models.sharding import is_sharded

try:  # transformers >= 4.52: each decoder layer checkpoints itself
    from transformers.modeling_layers import GradientCheckpointingLayer
except ImportError:  # earlier: the base model checkpoints the layers it loops over
    GradientCheckpointingLayer = None

# Models whose causal-LM forward is exactly ``lm_head(base_model(...).last_hidden_state)``, nothing after the
# head (Gemma 2 soft-caps its logits, Cohere and Granite scale them): off the fast path, their head may run
# in chunks on the base model's hidden states.
PLAIN_HEAD_MODELS = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gpt2", "gpt_neox", "phi", "phi3", "olmo",
                     "olmo2", "smollm3", "starcoder2")


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that start at 0 at each row's first real token (left padding)."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


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
