"""One sampler, two engines (docs/sampling.md, "Engines"): whatever draws completions — training's steps,
``grpokit sample``, ``grpokit eval``, iterative RL — asks an :class:`Engine` for a
:class:`~grpokit.rollout.generate.Rollout` of prompt token ids, and tells it :meth:`~Engine.update_weights` when
the policy has changed.

How a run samples is decided once, from its config, by :meth:`SamplingOptions.from_config`; :func:`build_engine`
turns the options into the engine: :class:`NativeEngine` (grpokit's decode loop on the policy itself, or on what
``rollout_precision`` makes of it) or :class:`~grpokit.rollout.vllm_engine.VLLMEngine` (vLLM in this process).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from grpokit.models.rollout_weights import RolloutWeights
from grpokit.rollout.episodes import InertSession, ToolSession
from grpokit.rollout.generate import Rollout, generate, padding_id, stop_token_ids
from grpokit.rollout.sampling_options import SamplingOptions
from grpokit.runtime.device import autocast


@runtime_checkable
class Engine(Protocol):  # pragma: no mutate block
    # (Left out of the mutation audit: a protocol's members are its attributes, and the audit's copies of each
    # method would become members no engine has.)
    """What draws completions. ``lowered``: its log-probs are not the policy's own (a lower precision, another
    engine), so the loss corrects for the difference and logs ``sampler_kl`` (docs/math.md)."""

    options: SamplingOptions
    lowered: bool
    device: torch.device  # where a sampling generator for it lives

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, *, num_generations: int, max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False,
                 generator: torch.Generator | None = None,
                 tools: ToolSession | InertSession | None = None) -> Rollout:
        """G = ``num_generations`` completions of each left-padded prompt (B, P), each group contiguous."""
        ...

    def update_weights(self, step: int = 0) -> None:
        """Sample from the policy's weights as they are now (after ``step`` optimizer steps: named by the check)."""
        ...

    def sleep(self) -> None:
        """Sampling is over until the next :meth:`update_weights` or :meth:`generate`: free what can be freed."""
        ...


class NativeEngine:
    """grpokit's decode loop (:func:`~grpokit.rollout.generate.generate`) on the policy, or on the weights
    ``rollout_precision`` makes of it (:class:`~grpokit.models.rollout_weights.RolloutWeights`); ``sharded``: the
    policy is sharded across processes (FSDP), which must then run every decode pass."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, options: SamplingOptions | None = None, *,
                 sharded: bool = False):
        self.options, self.sharded = options or SamplingOptions(), sharded
        self.weights = RolloutWeights(model, self.options.rollout_precision)
        self.stop_ids = stop_token_ids(model, tokenizer)
        self.pad_id = padding_id(tokenizer, self.stop_ids)
        self.device = next(model.parameters()).device

    @property
    def lowered(self) -> bool:
        return self.weights.lowered

    def update_weights(self, step: int = 0) -> None:
        self.weights.refresh()

    def sleep(self) -> None:
        pass  # the policy is the sampler: nothing of its own to free

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, *, num_generations: int, max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False,
                 generator: torch.Generator | None = None,
                 tools: ToolSession | InertSession | None = None) -> Rollout:
        options, model = self.options, self.weights.current()
        autocast_bf16 = self.weights.autocast  # the products in bfloat16, the rest in the policy's precision
        was_training = model.training
        model.eval()
        try:
            with autocast("bf16" if autocast_bf16 else options.mixed_precision, self.device):
                return generate(
                    model, prompt_ids, prompt_mask, num_generations=num_generations, max_new_tokens=max_new_tokens,
                    eos_token_id=self.stop_ids, pad_token_id=self.pad_id, temperature=temperature, top_p=top_p,
                    top_k=options.top_k, min_p=options.min_p, repetition_penalty=options.repetition_penalty,
                    greedy=greedy, generator=generator, stop_early=not self.sharded, fast=options.fast_path,
                    tools=tools, int8=self.weights.int8, exact_prefill=autocast_bf16,
                    graph=options.cuda_graphs and self.device.type == "cuda" and not self.sharded,
                )
        finally:
            model.train(was_training)


def build_engine(options: SamplingOptions, model: torch.nn.Module, tokenizer: Any, *, sharded: bool = False,
                 rank: int = 0, world_size: int = 1, seed: int = 0) -> Engine:
    """The engine ``options`` name, sampling from ``model``'s weights (``rank``/``world_size``: this torchrun
    process's place, for an engine per process; ``seed``: the vLLM engine's own)."""
    if options.engine == "native":
        return NativeEngine(model, tokenizer, options, sharded=sharded)
    if options.engine == "vllm":
        from grpokit.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model, tokenizer, options, rank=rank, world_size=world_size, seed=seed)
    raise ValueError(f"generation_engine must be 'native' or 'vllm', got {options.engine!r}")


def as_engine(source: Engine | torch.nn.Module, tokenizer: Any) -> Engine:
    """``source`` if it is an engine, else the native engine on the model ``source`` (the defaults: float32, the
    fast path)."""
    return source if isinstance(source, Engine) and not isinstance(source, torch.nn.Module) else \
        NativeEngine(source, tokenizer)
