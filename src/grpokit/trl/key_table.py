"""The table of every key of TRL 1.16's ``GRPOConfig`` and what grpokit does with it (docs/trl_keys.md):

    python -m grpokit.trl.key_table > docs/trl_keys.md

``MEANING`` says, for each mapped key, which grpokit key or trainer behaviour carries its meaning; ``NO_EFFECT`` and
``INSTEAD`` (:mod:`grpokit.trl.keys`) say why the others change nothing or what to use instead of them.
"""

from __future__ import annotations

import dataclasses

from grpokit.trl.config import GRPOConfig
from grpokit.trl.keys import INSTEAD, MAPPED, NO_EFFECT, key_kind

_BATCH = "a generation batch = `per_device_train_batch_size × processes × steps_per_generation` completions = one " \
         "grpokit step of `generation_batch_size ÷ num_generations` prompts (`prompts_per_step`)"
_HUB = "`trainer.push_to_hub()` (and at the end of `train()` with `push_to_hub=True`)"
_VLLM_IS = "with `use_vllm`: grpokit's importance-sampling correction (`rollout_is_mode`, `rollout_is_cap`); " \
           "an upper cap only"

MEANING: dict[str, str] = {
    "per_device_train_batch_size": f"`micro_batch_size`; {_BATCH}",
    "gradient_accumulation_steps": "`num_minibatches = steps_per_generation ÷ gradient_accumulation_steps` (a whole "
                                   "number)",
    "generation_batch_size": _BATCH, "steps_per_generation": _BATCH, "num_generations": "`num_generations` (G)",
    "max_steps": "`max_steps` × (optimizer steps per generation batch) = grpokit's `max_steps` generation batches",
    "num_train_epochs": "with `max_steps=-1`: passes over the dataset's whole generation batches, as TRL counts them",
    "num_iterations": "`num_iterations` (μ)",
    "loss_type": "`aggregation`: grpo → sequence, dapo → token, dr_grpo → constant; bnpo → token (one micro-batch "
                 "per optimizer step only); others refused",
    "beta": "`beta` (k3 KL)", "epsilon": "`epsilon`", "epsilon_high": "`epsilon_high`",
    "scale_rewards": "`scale_rewards` (group / batch / none; True → group, False → none)",
    "importance_sampling_level": "`ratio_level` (token / sequence)",
    "mask_truncated_completions": "`mask_truncated_completions`", "reward_weights": "`reward_weights`",
    "multi_objective_aggregation": "only `sum_then_normalize` (grpokit's)",
    "use_bias_correction_kl": "`kl_ratio_weighted` (with `beta > 0`)",
    "max_completion_length": "`max_completion_length`", "temperature": "`temperature`", "top_p": "`top_p`",
    "top_k": "`top_k`", "min_p": "`min_p` (None → 0.0)", "repetition_penalty": "`repetition_penalty`",
    "use_vllm": "`generation_engine: vllm`", "vllm_mode": "only `colocate` (vLLM in the training process)",
    "vllm_gpu_memory_utilization": "`vllm_gpu_memory_utilization`",
    "vllm_enable_sleep_mode": "`vllm_enable_sleep_mode`",
    "vllm_tensor_parallel_size": "`vllm_tensor_parallel_size`",
    "vllm_importance_sampling_correction": _VLLM_IS + " (only True)",
    "vllm_importance_sampling_mode": "`rollout_is_mode`",
    "vllm_importance_sampling_clip_max": "`rollout_is_cap`", "vllm_importance_sampling_cap": "`rollout_is_cap`",
    "vllm_importance_sampling_clip_min": _VLLM_IS + " (only None)",
    "learning_rate": "`learning_rate`", "lr_scheduler_type": "`lr_schedule` (linear, cosine, constant, "
                                                            "constant_with_warmup)",
    "lr_scheduler_kwargs": "only None", "warmup_steps": "`warmup_steps` (below 1: a share of the run)",
    "weight_decay": "`weight_decay`", "adam_beta1": "`adam_beta1`", "adam_beta2": "`adam_beta2`",
    "adam_epsilon": "only 1e-8 (grpokit's AdamW)", "max_grad_norm": "`max_grad_norm`",
    "optim": "`optimizer`: adamw_torch* → adamw, adamw_8bit / adamw_bnb_8bit → adamw_8bit", "seed": "`seed`",
    "bf16": "`mixed_precision: bf16` (default: on where a GPU is, else off and `use_cpu`)",
    "fp16": "only False (use bf16)", "use_cpu": "`device: cpu`",
    "gradient_checkpointing": "`gradient_checkpointing`", "activation_checkpointing": "`gradient_checkpointing`",
    "gradient_checkpointing_kwargs": "`use_reentrant` only (no effect)",
    "activation_checkpointing_kwargs": "`use_reentrant` only (no effect)",
    "model_init_kwargs": "`dtype`; attn_implementation, use_cache, low_cpu_mem_usage, revision 'main', "
                         "trust_remote_code False, device_map 'auto' accepted (no effect)",
    "output_dir": "`output_dir`", "logging_steps": "`log_history` / `on_log` every N optimizer steps (means)",
    "logging_strategy": "`steps` or `no`", "logging_first_step": "transformers' flow callback",
    "save_steps": "`save_every` = ⌈save_steps ÷ optimizer steps per generation batch⌉",
    "save_strategy": "`steps` or `no`", "save_total_limit": "`keep_checkpoints`",
    "report_to": "`report_to` (tensorboard, wandb, trackio)", "run_name": "`run_name`", "project": "`project`",
    "disable_tqdm": "`progress_bar`", "log_completions": "`log_completions` (completions.jsonl)",
    "num_completions_to_print": "`log_completions` (how many)",
    "push_to_hub": _HUB, "hub_model_id": _HUB, "hub_token": _HUB, "hub_private_repo": _HUB, "hub_revision": _HUB,
    "hub_strategy": _HUB, "hub_always_push": _HUB,
    "chat_template_kwargs": "passed to every `apply_chat_template` call (prompts, tool turns, reward models' chats)",
    "shuffle_dataset": "`prompt_sampling`: True → uniform (seeded passes), False → in_order",
    "remove_unused_columns": "only False: reward functions get every column",
    "eval_strategy": "`GRPOTrainer.evaluate()` every `eval_steps` (steps) or epoch", "eval_steps": "the same",
    "eval_on_start": "an evaluation before the first step",
    "num_generations_eval": "completions per eval prompt (default `num_generations`)",
    "per_device_eval_batch_size": "eval completions sampled at a time",
}


def markdown() -> str:
    """One row per key of TRL 1.16's GRPOConfig: its default, its kind, and what grpokit does with it."""
    lines = ["# Every key of TRL's GRPOConfig", "",
             "Generated by `python -m grpokit.trl.key_table > docs/trl_keys.md` from `grpokit.trl.keys` (tested to "
             "match). **mapped**: the grpokit key or behaviour with the same meaning; **no effect**: any value, and "
             "why; **refused**: accepted at TRL's default, any other value is a `ConfigError` naming the key and "
             "what to use instead ([trl.md](trl.md)).", "",
             "| key | TRL default | kind | in grpokit |", "| --- | --- | --- | --- |"]
    for f in sorted((f for f in dataclasses.fields(GRPOConfig) if f.init), key=lambda f: f.name):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        kind = key_kind(f.name)
        what = MEANING[f.name] if kind == "mapped" else NO_EFFECT[f.name] if kind == "no effect" else \
            INSTEAD.get(f.name, "no counterpart")
        shown = str(getattr(default, "value", default)).replace("|", "\\|")
        lines.append(f"| `{f.name}` | `{shown}` | {kind} | {what} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    missing = sorted(MAPPED - set(MEANING))
    if missing:
        raise SystemExit(f"MEANING lacks {missing}")
    print(markdown(), end="")
