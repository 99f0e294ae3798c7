"""What the values of TRL's mapped keys become in grpokit (``GRPOConfig.grpokit_settings``), and the values grpokit
cannot honour, each refused with a :class:`~grpokit.config.ConfigError` naming the key and what to use instead."""

from __future__ import annotations

import math
from typing import Any

from grpokit.config import TRACKERS, ConfigError

GRPOConfig = Any  # grpokit.trl.GRPOConfig (not imported: it imports this module)
LOSS_TYPES = {"grpo": "sequence", "dapo": "token", "dr_grpo": "constant", "bnpo": "token"}
SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}
OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw", "adamw_8bit": "adamw_8bit",
              "adamw_bnb_8bit": "adamw_8bit"}
KEEP_ALL = 1_000_000  # save_total_limit=None: keep every checkpoint
_DTYPES = {"auto": "auto", "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def choice(name: str, value: Any, choices: tuple[str, ...]) -> Any:
    if value not in choices:
        raise ConfigError(f"grpokit.trl.GRPOConfig: {name}={value!r} is not supported; choose one of "
                          f"{', '.join(map(repr, choices))}")
    return value


def batch_arithmetic(c: GRPOConfig) -> None:
    """TRL's: the generation batch from the per-device batch, processes and steps per generation."""
    world = c.world_size
    if c.generation_batch_size is None and c.steps_per_generation is None:
        c.steps_per_generation = c.gradient_accumulation_steps
        c.generation_batch_size = c.per_device_train_batch_size * world * c.steps_per_generation
    elif c.generation_batch_size is not None and c.steps_per_generation is None:
        if c.generation_batch_size % (c.per_device_train_batch_size * world):
            raise ConfigError(f"generation_batch_size ({c.generation_batch_size}) must be divisible by the global "
                              f"batch size ({c.per_device_train_batch_size * world}).")
        c.steps_per_generation = c.generation_batch_size // (c.per_device_train_batch_size * world)
    elif c.generation_batch_size is None:
        c.generation_batch_size = c.per_device_train_batch_size * world * c.steps_per_generation
    else:
        raise ConfigError("'generation_batch_size' and 'steps_per_generation' can not be both configured at the same "
                          "time")
    if c.num_generations is None or c.num_generations < 2:
        raise ConfigError(f"GRPO requires at least 2 generations per prompt; num_generations={c.num_generations}")
    if c.generation_batch_size % c.num_generations:
        raise ConfigError(f"generation_batch_size ({c.generation_batch_size}) must be divisible by num_generations "
                          f"({c.num_generations}).")
    if c.steps_per_generation % c.gradient_accumulation_steps:
        raise ConfigError(f"steps_per_generation={c.steps_per_generation} must be a multiple of "
                          f"gradient_accumulation_steps={c.gradient_accumulation_steps} in grpokit: an optimizer step "
                          "within one generation batch (grpokit's num_minibatches)")


def loss_type(c: GRPOConfig) -> str:
    if c.loss_type == "bnpo" and (c.gradient_accumulation_steps > 1 or c.world_size > 1):
        raise ConfigError("loss_type='bnpo' normalises by each micro-batch's tokens, which grpokit does not; it equals "
                          "'dapo' only with gradient_accumulation_steps=1 on one process: use loss_type='dapo'")
    if c.loss_type not in LOSS_TYPES:
        raise ConfigError(f"grpokit.trl.GRPOConfig: loss_type={c.loss_type!r} is not supported; grpokit has "
                          f"{', '.join(map(repr, LOSS_TYPES))} (docs/math.md)")
    return LOSS_TYPES[c.loss_type]


def schedule(c: GRPOConfig) -> str:
    name = getattr(c.lr_scheduler_type, "value", c.lr_scheduler_type)
    if name not in SCHEDULES or (name == "constant" and c.warmup_steps):
        raise ConfigError(f"grpokit.trl.GRPOConfig: lr_scheduler_type={name!r} is not supported (with these warmup "
                          "steps); use 'linear', 'cosine', 'constant' (no warmup) or 'constant_with_warmup'")
    if c.lr_scheduler_kwargs:
        raise ConfigError(f"grpokit.trl.GRPOConfig: lr_scheduler_kwargs={c.lr_scheduler_kwargs!r} is not supported; "
                          "leave it None")
    return SCHEDULES[name]


def warmup(c: GRPOConfig, num_rows: int | None) -> int:
    """transformers' rule: ``warmup_steps`` below 1 is a share of the run's optimizer steps (rounded up)."""
    if c.warmup_steps >= 1 or not c.warmup_steps:
        return int(c.warmup_steps)
    if c.max_steps <= 0 and num_rows is None:
        return 0  # decided when the dataset's size is known
    return math.ceil(c.warmup_steps * c.grpokit_steps(num_rows) * c.updates_per_generation)


def optimizer(c: GRPOConfig) -> str:
    name = getattr(c.optim, "value", c.optim)
    if name not in OPTIMIZERS or c.optim_args:
        raise ConfigError(f"grpokit.trl.GRPOConfig: optim={name!r} is not supported; use one of "
                          f"{', '.join(map(repr, OPTIMIZERS))}")
    if c.adam_epsilon != 1e-8:
        raise ConfigError(f"grpokit.trl.GRPOConfig: adam_epsilon={c.adam_epsilon!r} is not supported (grpokit's AdamW "
                          "uses 1e-8, TRL's default)")
    return OPTIMIZERS[name]


def precision(c: GRPOConfig) -> str:
    if c.fp16:
        raise ConfigError("grpokit.trl.GRPOConfig: fp16=True is not supported; use bf16=True (grpokit's "
                          "mixed_precision: bf16) or bf16=False")
    return "bf16" if c.bf16 else "no"


# model_init_kwargs keys beside dtype that change nothing grpokit computes, at any value or at the values listed
_LOADING_NO_EFFECT = {"attn_implementation": None, "use_cache": None, "low_cpu_mem_usage": None,
                      "revision": (None, "main"), "trust_remote_code": (None, False), "device_map": (None, "auto")}


def dtype(c: GRPOConfig) -> str:
    """``model_init_kwargs``' dtype; its other keys only where they change nothing (grpokit loads the model, places it
    and runs its own attention kernels)."""
    kwargs = dict(c.model_init_kwargs or {})
    name = str(kwargs.pop("dtype", kwargs.pop("torch_dtype", None)) or "auto").removeprefix("torch.")
    unsupported = {key: value for key, value in kwargs.items() if key not in _LOADING_NO_EFFECT or (
        _LOADING_NO_EFFECT[key] and value not in _LOADING_NO_EFFECT[key])}
    if unsupported or name not in _DTYPES:
        given = unsupported or {"dtype": name}
        raise ConfigError(f"grpokit.trl.GRPOConfig: model_init_kwargs {given!r} not supported: "
                          "grpokit reads dtype ('auto', 'float32', 'bfloat16', 'float16'), and attn_implementation, "
                          "use_cache, low_cpu_mem_usage, revision 'main', trust_remote_code False, device_map 'auto' "
                          "(no effect); for anything else load the model yourself and pass it")
    return _DTYPES[name]


def trackers(c: GRPOConfig) -> list[str]:
    for name in c.report_to:
        if name not in TRACKERS:
            raise ConfigError(f"grpokit.trl.GRPOConfig: report_to {name!r} is not supported; grpokit reports to "
                              f"{', '.join(TRACKERS)} (metrics.jsonl is always written)")
    return list(c.report_to)


def strategy(value: Any) -> str:
    return getattr(value, "value", value)


def save_strategy(c: GRPOConfig) -> str:
    return strategy(c.save_strategy)


def accelerator() -> bool:
    """Whether transformers would find a GPU (CUDA, XPU, MPS, ...) for TRL's default bf16."""
    import torch

    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available()) or \
        torch.backends.mps.is_available()


def vllm(c: GRPOConfig) -> dict[str, Any]:
    if not c.use_vllm:
        return {}
    if c.top_k or c.min_p or c.repetition_penalty != 1.0 or c.top_p < 1.0:
        raise ConfigError("grpokit.trl.GRPOConfig: top_k, min_p, repetition_penalty or top_p < 1 with use_vllm: vLLM "
                          "reports its log-probs after them, which grpokit's correction does not expect yet; leave "
                          "them off with use_vllm (or sample with grpokit's engine: use_vllm=False)")
    if c.vllm_mode != "colocate":
        raise ConfigError(f"grpokit.trl.GRPOConfig: vllm_mode={c.vllm_mode!r} is not supported; grpokit runs vLLM in "
                          "the training process: vllm_mode='colocate'")
    if not c.vllm_importance_sampling_correction or c.vllm_importance_sampling_clip_max is None or \
            c.vllm_importance_sampling_clip_min is not None:
        raise ConfigError("grpokit.trl.GRPOConfig: with use_vllm, grpokit always corrects by importance sampling with "
                          "an upper cap only: vllm_importance_sampling_correction=True, "
                          "vllm_importance_sampling_clip_max "
                          "set, vllm_importance_sampling_clip_min=None")
    return {"generation_engine": "vllm", "vllm_gpu_memory_utilization": c.vllm_gpu_memory_utilization,
            "vllm_enable_sleep_mode": c.vllm_enable_sleep_mode,
            "vllm_tensor_parallel_size": c.vllm_tensor_parallel_size,
            "rollout_is_mode": c.vllm_importance_sampling_mode, "rollout_is_cap": c.vllm_importance_sampling_clip_max,
            "rollout_precision": "bf16" if c.bf16 else "fp32"}


def refuse_values(c: GRPOConfig) -> None:
    """Mapped keys whose value grpokit cannot honour (each refusal names the key and what to use)."""
    refusals = (
        (c.max_completion_length is None, "max_completion_length=None: grpokit needs a length limit"),
        (c.multi_objective_aggregation != "sum_then_normalize", f"multi_objective_aggregation="
         f"{c.multi_objective_aggregation!r}: grpokit sums the weighted rewards, then normalises "
         "('sum_then_normalize')"),
        (c.save_steps < 1 or c.logging_steps < 1, "save_steps or logging_steps below 1 (a share of the run): give "
         "a number of steps"),
        (save_strategy(c) not in ("steps", "no"), f"save_strategy={save_strategy(c)!r}: use 'steps' or 'no'"),
        (getattr(c.logging_strategy, "value", c.logging_strategy) == "epoch", "logging_strategy='epoch': use 'steps'"),
        (strategy(c.eval_strategy) not in ("no", "steps", "epoch"), f"eval_strategy={strategy(c.eval_strategy)!r}"
         ": use 'no', 'steps' or 'epoch'"),
        (c.eval_steps is not None and c.eval_steps < 1, "eval_steps below 1 (a share of the run): give a number of "
         "steps"),
        (bool(c.remove_unused_columns), "remove_unused_columns=True: grpokit gives reward functions every column; use "
         "False (TRL's GRPO default)"),
        (bool(c.gradient_checkpointing_kwargs) and set(c.gradient_checkpointing_kwargs) - {"use_reentrant"},
         f"gradient_checkpointing_kwargs={c.gradient_checkpointing_kwargs!r}: only use_reentrant is accepted (and has "
         "no effect: grpokit checkpoints its own layers)"),
    )
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"grpokit.trl.GRPOConfig: {why}")
