"""What becomes of each key of TRL 1.16's ``GRPOConfig`` (a ``transformers.TrainingArguments``) in grpokit.

Every key is one of three kinds (:func:`key_kind`):

- ``mapped``: translated to grpokit's key with the same meaning (``GRPOConfig.to_grpokit``), or read by
  :class:`grpokit.trl.GRPOTrainer` itself (logging, saving, the Hub); a value grpokit cannot honour is refused there.
- ``no effect``: accepted at any value because it changes nothing grpokit computes (``NO_EFFECT`` says why: a
  PyTorch ``DataLoader`` grpokit does not use, verbosity, a script's own flags, evaluation that is refused anyway).
- ``refused``: any key not above. Its default is accepted (grpokit then does what TRL does by default, or the key
  does nothing at its default); any other value raises :class:`~grpokit.config.ConfigError` naming the key and,
  from ``INSTEAD``, what to use instead.
"""

from __future__ import annotations

MAPPED: frozenset[str] = frozenset({
    # batch arithmetic, steps and epochs
    "per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size", "steps_per_generation",
    "num_generations", "max_steps", "num_train_epochs", "num_iterations",
    # the objective
    "loss_type", "beta", "epsilon", "epsilon_high", "scale_rewards", "importance_sampling_level",
    "mask_truncated_completions", "reward_weights", "multi_objective_aggregation", "use_bias_correction_kl",
    # sampling
    "max_completion_length", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "use_vllm", "vllm_mode", "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "vllm_tensor_parallel_size",
    "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_cap", "vllm_importance_sampling_clip_min",
    # optimisation
    "learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "weight_decay", "adam_beta1",
    "adam_beta2", "adam_epsilon", "max_grad_norm", "optim", "seed",
    # precision, device, memory
    "bf16", "fp16", "use_cpu", "gradient_checkpointing", "activation_checkpointing", "gradient_checkpointing_kwargs",
    "activation_checkpointing_kwargs", "model_init_kwargs",
    # run directory, logging, saving, trackers, the Hub (read by grpokit.trl.GRPOTrainer)
    "output_dir", "logging_steps", "logging_strategy", "logging_first_step", "save_steps", "save_strategy",
    "save_total_limit", "report_to", "run_name", "project", "disable_tqdm", "log_completions",
    "num_completions_to_print", "chat_template_kwargs", "push_to_hub", "hub_model_id", "hub_token", "hub_private_repo",
    "hub_revision",
    "hub_strategy", "hub_always_push", "shuffle_dataset", "remove_unused_columns",
    # evaluation (grpokit.trl.GRPOTrainer.evaluate: rewards of eval_dataset's prompts)
    "eval_strategy", "eval_steps", "eval_on_start", "num_generations_eval", "per_device_eval_batch_size",
})

_EVAL = "a setting of transformers' evaluation loop over labels; GRPO's evaluation samples and scores (no labels)"
_LOADER = "configures a PyTorch DataLoader; grpokit draws prompts itself (no DataLoader)"
NO_EFFECT: dict[str, str] = {
    **{key: _LOADER for key in (
        "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers",
        "dataloader_prefetch_factor",
        "dataloader_drop_last", "dataloader_multiprocessing_context", "dataloader_in_order", "length_column_name")},
    **{key: _EVAL for key in (
        "eval_accumulation_steps", "eval_do_concat_batches", "eval_use_gather_object", "batch_eval_metrics",
        "prediction_loss_only", "include_for_metrics", "label_names", "bf16_full_eval", "fp16_full_eval")},
    **{key: "a script's own flag: transformers' Trainer does not read it either" for key in (
        "do_train", "do_eval", "do_predict", "resume_from_checkpoint")},
    **{key: "verbosity of transformers' logging" for key in (
        "log_level", "log_level_replica", "log_on_each_node", "logging_nan_inf_filter", "skip_memory_metrics",
        "include_num_input_tokens_seen", "log_multimodal", "log_unique_prompts")},
    **{key: "settings of TRL's vLLM server mode; vllm_mode='server' is refused" for key in (
        "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port")},
    "local_rank": "set by the launcher; grpokit reads torchrun's environment",
    "ds3_gather_for_generation": "DeepSpeed ZeRO-3 only; deepspeed is refused",
    "pad_to_multiple_of": "padding is masked out: it changes shapes, not values",
    "cache_implementation": "transformers' generate() cache; grpokit samples with its own KV cache",
    "use_cache": "transformers' generate() cache; grpokit samples with its own KV cache",
    "torch_empty_cache_steps": "frees cached GPU memory only",
    "use_transformers_continuous_batching": "a transformers sampling engine; grpokit samples with its own (same math)",
    "transformers_continuous_batching_config": "a transformers sampling engine; grpokit samples with its own",
    "use_transformers_paged": "a transformers sampling engine; grpokit samples with its own (same math)",
}

# What to use instead of a refused key (any other refused key: "grpokit has no counterpart").
INSTEAD: dict[str, str] = {
    "deepspeed": "grpokit's GRPOConfig parallelism: 'fsdp' under torchrun (docs/distributed.md)",
    "fsdp": "grpokit's GRPOConfig parallelism: 'fsdp' under torchrun (docs/distributed.md)",
    "fsdp_config": "grpokit's GRPOConfig parallelism: 'fsdp' under torchrun (docs/distributed.md)",
    "sync_ref_model": "grpokit's GRPOConfig rl_iterations (iterative RL resets the reference to the policy)",
    "entropy_coef": "no entropy bonus in grpokit; the entropy is logged (metric entropy)",
    "use_adaptive_entropy": "no entropy bonus in grpokit",
    "top_entropy_quantile": "no entropy mask in grpokit",
    "off_policy_mask_threshold": "no off-policy sequence masking in grpokit",
    "delta": "no two-sided clipping in grpokit (epsilon, epsilon_high clip both sides of the ratio's product)",
    "data_seed": "seed (grpokit draws data with the run's seed)",
    "tf32": "grpokit's own precision setting (mixed_precision); TF32 is off",
    "use_liger_kernel": "grpokit's fast path (same math, its own kernels)",
    "liger_kernel_config": "grpokit's fast path (same math, its own kernels)",
    "save_only_model": "grpokit's checkpoints always hold the optimizer and random states (exact resume)",
    "trust_remote_code": "load the model yourself and pass it as model=",
    "auto_find_batch_size": "per_device_train_batch_size (grpokit's micro_batch_size)",
    "generation_kwargs": "temperature, top_p, top_k, min_p, repetition_penalty (grpokit samples with these only)",
    "max_tool_calling_iterations": "grpokit's GRPOConfig max_tool_calls / max_turns (docs/tools.md)",
    "log_completions_hub_repo": "log_completions (written to output_dir/completions.jsonl)",
}


def key_kind(name: str) -> str:
    """``'mapped'``, ``'no effect'`` or ``'refused'`` (refused at any value but its default)."""
    return "mapped" if name in MAPPED else "no effect" if name in NO_EFFECT else "refused"


def refusal(name: str, value: object, default: object) -> str:
    """Why ``name=value`` is refused: the key, its default, and what to use instead."""
    instead = INSTEAD.get(name, "grpokit has no counterpart")
    return (f"grpokit.trl.GRPOConfig: {name}={value!r} is not supported ({instead}); leave it at TRL's default "
            f"{default!r}, or use grpokit.GRPOConfig directly")
