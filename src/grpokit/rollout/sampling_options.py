"""What decides how completions are drawn (docs/sampling.md, "Engines"), read from a config in one place:
:class:`SamplingOptions`, which :func:`grpokit.rollout.engines.build_engine` turns into an engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SamplingOptions:
    """What decides how completions are drawn, the same for training, ``sample`` and ``eval`` under one config."""

    engine: str = "native"  # generation_engine
    rollout_precision: str = "fp32"
    mixed_precision: str = "no"  # resolved: 'no' or 'bf16' (runtime.device.resolve_precision)
    fast_path: bool = True
    cuda_graphs: bool = False
    vllm_gpu_memory_utilization: float = 0.3
    vllm_enable_sleep_mode: bool = False
    vllm_tensor_parallel_size: int = 1
    vllm_sync_check: float = 1e-3
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0.0: off
    repetition_penalty: float = 1.0  # 1.0: off

    @classmethod
    def from_config(cls, config: Any, mixed_precision: str) -> SamplingOptions:
        """The options of a GRPOConfig, with ``mixed_precision`` as resolved for the device."""
        return cls(engine=config.generation_engine, rollout_precision=config.rollout_precision,
                   mixed_precision=mixed_precision, fast_path=config.fast_path, cuda_graphs=config.cuda_graphs,
                   vllm_gpu_memory_utilization=config.vllm_gpu_memory_utilization,
                   vllm_enable_sleep_mode=config.vllm_enable_sleep_mode,
                   vllm_tensor_parallel_size=config.vllm_tensor_parallel_size, vllm_sync_check=config.vllm_sync_check,
                   top_k=config.top_k, min_p=config.min_p, repetition_penalty=config.repetition_penalty)
