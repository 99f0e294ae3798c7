"""``GRPOConfig``: the keys of a GRPO (or PPO) run, ``grpokit train``'s config, and the checks across them."""

from __future__ import annotations

import typing
from dataclasses import dataclass

from grpokit.config.fields import TRL_OPTIM, _common, _field
from grpokit.config.grpo_checks import ENGINES, check_grpo_config
from grpokit.config.grpo_task import _TaskKeys
from grpokit.core.importance import IS_MODES
from grpokit.core.objective import AGGREGATIONS, KL_KINDS, RATIO_LEVELS, SCALES

# TRL's GRPOConfig keys with another name (or unit) here; grpokit.trl.GRPOConfig takes TRL's keys as they are
TRL_GRPO_NAMES = {
    "importance_sampling_level": "ratio_level (the same 'token' / 'sequence')",
    "per_device_train_batch_size": "micro_batch_size (completions per forward/backward "
    "pass; a step samples prompts_per_step × num_generations completions)",
    "gradient_accumulation_steps": "implicit (a step's whole batch makes one optimizer "
    "step, gradients accumulated over micro_batch_size passes)",
    "generation_batch_size": "prompts_per_step × num_generations completions",
    "steps_per_generation": "num_minibatches (optimizer steps per pass over a step's batch)",
    "loss_type": "aggregation ('sequence' = grpo, 'token' = dapo, 'constant' = dr_grpo)",
    "lr_scheduler_type": "lr_schedule", "save_steps": "save_every (in steps)", "save_total_limit": "keep_checkpoints",
    "num_train_epochs": "max_steps (in steps)", "bf16": "mixed_precision: bf16",
    "use_vllm": "generation_engine: vllm", "use_cpu": "device: cpu",
}
# The defaults for a pretrained model, written once: grpokit's GRPOConfig and grpokit.trl.GRPOConfig both take them
# from here (they are TRL 1.16's too). The demo and the recipes pin their tiny models' settings in their own configs.
# Left out on purpose, where the front doors differ: beta and the loss's aggregation (grpokit: the paper's 0.04 and
# per-sequence mean; TRL: 0 and DAPO's per-token mean), and adam_beta2 (grpokit 0.99, TRL 0.999).
REAL_MODEL: dict[str, typing.Any] = {
    "learning_rate": 1e-6, "max_completion_length": 512, "num_generations": 8, "temperature": 1.0, "top_p": 1.0,
    "top_k": 0, "repetition_penalty": 1.0, "epsilon": 0.2, "num_iterations": 1, "scale_rewards": "group",
    "mask_truncated_completions": False,
}
DEFAULT_CHUNK_MB = 64.0  # `logprob_chunk_mb`'s default: 341 tokens a chunk at SmolLM2's 49,152-token vocabulary


def _real(name: str, help: str, **bounds: typing.Any) -> typing.Any:
    """A key whose default is REAL_MODEL's."""
    return _field(REAL_MODEL[name], help, **bounds)


@dataclass
class GRPOConfig(_TaskKeys):
    """A GRPO run, or a PPO one (``algorithm: ppo``): ``grpokit train``'s config (docs/usage.md). Its first keys, what
    the run learns from, are :class:`~grpokit.config.grpo_task._TaskKeys`'."""

    TRL_NAMES: typing.ClassVar[dict[str, str]] = {
        "optim": TRL_OPTIM, "dataset_name": "dataset (a Hub id, or 'hf:ID')",
        "vllm_importance_sampling_mode": "rollout_is_mode (the same four modes)",
        "vllm_importance_sampling_cap": "rollout_is_cap", "vllm_importance_sampling_clip_max": "rollout_is_cap",
        **TRL_GRPO_NAMES}
    TRL_HINT: typing.ClassVar[str] = " (grpokit.trl.GRPOConfig takes TRL's keys as they are: docs/trl.md)"
    REMOVED: typing.ClassVar[dict[str, str]] = {
        "merge_lora": "a LoRA run always writes the merged weights to output_dir/model and the adapter alone to "
                      "output_dir/adapter (docs/lora.md)"}

    # ---- iterative RL (docs/reward_models.md, "Iterative RL") -------------------------------------
    rl_iterations: int = _field(
        1, "Iterative RL (DeepSeekMath §4.1.4): the run's steps in this many iterations; after each but the last, "
        "the learned reward model in reward_funcs is retrained on samples of the new policy (labelled by "
        "reward_model_labels) plus a replay share of its older data, and the reference model is reset to the "
        "current policy. 1: a plain run.", min=1
    )
    steps_per_iteration: int | None = _field(
        None, "Iterative RL: steps per iteration; max_steps must then be rl_iterations × steps_per_iteration. "
        "None: max_steps / rl_iterations (which must divide evenly).", min=1
    )
    reward_model_labels: list[str] = _field(
        [], "Iterative RL: the rule reward functions (same syntax as reward_funcs) that label the policy's samples "
        "the reward model is retrained on: their weighted sum as the label; a process reward's steps for a "
        "process model."
    )
    reward_model_label_weights: list[float] | None = _field(
        None, "Iterative RL: the weight of each of reward_model_labels; None means 1.0 each.")
    reward_model_prompts: int = _field(
        64, "Iterative RL: training prompts sampled (num_generations completions each) to retrain the reward model "
        "after each iteration.", min=1
    )
    reward_model_replay: float = _field(
        0.1, "Iterative RL: the share of the reward model's older rows (its reward_model_config dataset and earlier "
        "iterations' samples) replayed beside each iteration's new samples.", min=0, max=1
    )
    reward_model_config: str | None = _field(
        None, "Iterative RL: the `grpokit reward train` YAML whose settings (learning rate, epochs, batch size, "
        "form, held-out data, ...) retrain the reward model and whose dataset is its first old data; None: "
        "RewardConfig's defaults and no old data."
    )

    # ---- sampling (docs/math.md, step 1) ---------------------------------------------------------
    prompts_per_step: int = _field(16, "B: prompts sampled per training step.", min=1)
    num_generations: int = _real("num_generations", "G: completions sampled per prompt (the group).", min=2)
    max_completion_length: int = _real(
        "max_completion_length", "Maximum tokens per completion (with tools, the inserted tool results count too).",
        min=1)
    temperature: float = _real("temperature", "Sampling temperature; the loss's log-probs use the same one.", gt=0)
    top_p: float = _real("top_p", "Nucleus sampling threshold (1.0 = off).", gt=0, max=1)
    top_k: int = _real("top_k", "Sample from the k most likely tokens only (0 = off).", min=0)
    min_p: float = _field(
        0.0, "Drop the tokens less likely than min_p times the most likely one (0.0 = off).", min=0, max=1)
    repetition_penalty: float = _real(
        "repetition_penalty", "Divide the positive logits (multiply the negative ones) of tokens already in the "
        "prompt or the completion by this, before the temperature, as transformers does (1.0 = off).", gt=0)
    rollout_precision: str = _field(
        "fp32", "Completions sampled with 'fp32', the policy; 'bf16', its copy refreshed before each sampling; "
        "'bf16_autocast', the policy under bfloat16 autocast (prompts read in float32); 'int8' (CPU, fast path), its "
        "weights quantized per sampling; loss corrected by importance sampling (docs/math.md, lower precision).",
        choices=("fp32", "bf16", "bf16_autocast", "int8"))
    rollout_is_cap: float = _field(
        3.0, "C, the cap of the importance weights (π_old/π_sample) with rollout_precision other than fp32.", min=1)
    rollout_is_mode: str = _field(
        "sequence_mask", "The importance weights: each completion's ratio or each token's (sequence_*, token_*), "
        "masked above C or truncated at it (*_mask, *_truncate); TRL's modes (docs/math.md).", choices=IS_MODES)

    # ---- the generation engine (docs/sampling.md, "Engines") --------------------------------------
    generation_engine: str = _field(
        "native", "What samples the completions: 'native', grpokit's decode loop on the policy itself; 'vllm', a "
        "vLLM engine in this process (one per torchrun process; pip install 'grpokit[vllm]'), the policy's weights "
        "pushed to it before each step's sampling and checked there (vllm_sync_check).", choices=ENGINES)
    vllm_gpu_memory_utilization: float = _field(
        0.3, "vLLM's gpu_memory_utilization: the share of the GPU's memory the engine takes (weights and KV cache) "
        "beside training; on the CPU, the share of the memory free at its start that its KV cache takes.", gt=0, max=1,
        resumable=True)
    vllm_enable_sleep_mode: bool = _field(
        False, "vLLM's enable_sleep_mode (CUDA only): the engine frees its KV cache while the policy trains and takes "
        "it back to sample (LLM.sleep / wake_up), for memory at a little time per step.", resumable=True)
    vllm_tensor_parallel_size: int = _field(
        1, "vLLM's tensor_parallel_size: the GPUs one engine is split over; only 1 yet (each torchrun process holds "
        "a whole engine).", min=1)
    vllm_sync_check: float = _field(
        1e-3, "After each weight push, the engine's log-probs of a fixed probe sequence must match the policy's "
        "(float32) within this plus twice the engine's own rounding, measured as it starts (max absolute difference), "
        "else the run stops naming the step; 0 skips the check.", min=0, resumable=True)

    # ---- tools (docs/tools.md) ---------------------------------------------------------------------
    tools: list[str] = _field(
        [], "Tools the model may call while it writes: 'calculator' and 'python' (built in; python runs the "
        "model's program in the sandbox), 'FILE.py:NAME' or "
        "'package.module:NAME' (a function with type hints and a docstring); the Python API also takes callables. "
        "The model writes <tool>{\"name\": ..., \"arguments\": {...}}</tool>; the result comes back as "
        "<result>…</result>, which the loss, the KL and the length metrics leave out.")
    environment_factory: str | None = _field(
        None, "'FILE.py:NAME' or 'package.module:NAME' of a callable returning, per completion, an environment: "
        "reset(**row) is called with the completion's dataset row, its public methods are tools, and its "
        "get_reward() (or reward()), if any, is a reward function named after its class.")
    environment: str | None = _field(
        None, "Another library's environment as the run's task (docs/environments.md): 'verifiers:NAME' (an installed "
        "verifiers environment: its dataset, rubric and turns; pip install 'grpokit[verifiers]') or 'openenv:URL' / "
        "'openenv:MODULE:CLASS' (an OpenEnv server or Environment class; pip install 'grpokit[openenv]').")
    environment_args: dict | None = _field(
        None, "Keyword arguments of the environment: verifiers' load_environment(**args), or the OpenEnv adapter's "
        "options (docs/environments.md).")
    max_tool_calls: int = _field(4, "Tool calls per completion; a further call gets an error text back.", min=0)
    tool_timeout: float | None = _field(
        10.0, "Seconds a tool call, or an environment's reply, may take; a slower tool gets an error text back (and "
        "counts in tool_errors), a slower environment stops the run naming it.", gt=0)
    max_reply_chars: int | None = _field(
        1024, "Characters of a tool's result or an environment's reply given to the model (the start; null: all "
        "of it). The completion's token budget still applies.", min=1)
    max_turns: int = _field(
        10, "Turns of the model per episode with an environment that replies (reply(turn)); at the last one, its "
        "stop token ends the episode.", min=1)
    call_workers: int = _field(
        32, "Threads that run tool calls, environments' resets and replies, concurrently for the whole batch, while "
        "the completions that are not waiting keep decoding.", min=1)

    # ---- model-written code: the code_tests reward and the python tool (docs/data_and_rewards.md) ----
    sandbox: str = _field(
        "bwrap", "How the code_tests reward and the python tool run model-written programs: 'bwrap' (a separate "
        "process tree in bubblewrap's namespaces: no network, none of the trainer's files or environment; the run "
        "stops at start-up if bwrap cannot start here) or 'process' (the weaker mode, chosen explicitly: a separate "
        "process with resource limits, a cleared environment and a fresh temporary directory, walled in by Landlock "
        "and seccomp but no namespaces; as a normal user it needs Linux 6.12 or later: docs/sandbox.md).",
        choices=("bwrap", "process"),
    )
    sandbox_timeout: float = _field(
        5.0, "Wall seconds (and CPU seconds, rounded up) one sandboxed program may take: a code_tests program with "
        "all its asserts, one stdin/stdout case, or one python tool call; the program is then killed (a timeout).",
        gt=0,
    )
    code_tests_mode: str = _field(
        "fraction", "The code_tests reward's value: 'fraction' of the row's tests passed, or 'binary': 1.0 when "
        "all pass, else 0.0.", choices=("fraction", "binary"),
    )

    # ---- objective (docs/math.md: advantages, the objective) ------------------------------------
    algorithm: str = _field(
        "grpo", "'grpo', or 'ppo': the baseline with a value model and GAE (docs/math.md, PPO; keys under PPO).",
        choices=("grpo", "ppo"),
    )
    supervision: str = _field(
        "outcome",
        "'outcome': one reward per completion, one advantage for all its tokens. 'process': reward "
        "functions may return step rewards [(character offset where a step ends, reward), ...]; "
        "outcome rewards become a step that ends with the completion; each token's advantage is the sum "
        "of the group-normalised rewards of the steps ending at or after it (DeepSeekMath §4.1.3).",
        choices=("outcome", "process"),
    )
    scale_rewards: str = _real(
        "scale_rewards", "Advantage scaling: 'group' std (paper), 'batch' std, or 'none' (Dr. GRPO).",
        choices=SCALES)
    epsilon: float = _real("epsilon", "Clip range ε: ratio clipped to [1-ε, 1+ε_high].", min=0)
    epsilon_high: float | None = _field(None, "Upper clip ε_high ('clip-higher'); None means ε.", min=0)
    beta: float = _field(0.04, "KL coefficient β; 0 never creates the reference model.", min=0)
    kl_kind: str = _field("k3", "KL estimator: 'k3' (paper), 'k1' or 'k2'.", choices=KL_KINDS)
    kl_ratio_weighted: bool = _field(
        False, "Weight each token's KL estimate by its ratio ρ = π_θ/π_old, gradient included (TRL's "
        "use_bias_correction_kl; docs/math.md). False: the paper's term.")
    aggregation: str = _field(
        "sequence",
        "Loss aggregation: 'sequence' (paper: per-completion mean, then mean), 'token' (DAPO), "
        "'constant' (Dr. GRPO: sum / (N · max_completion_length)).",
        choices=AGGREGATIONS,
    )
    ratio_level: str = _field(
        "token", "Importance ratio per 'token' (default) or per 'sequence' (length-normalised).",
        choices=RATIO_LEVELS,
    )
    num_iterations: int = _real(
        "num_iterations", "μ: optimizer steps over each generated batch; for μ > 1 the π_old log-probs are "
        "computed once per batch, before the first step.", min=1)
    num_minibatches: int = _field(
        1, "Optimizer steps per pass over the batch: each pass shuffles the batch's completions and splits "
        "them into this many minibatches (PPO's minibatches; 1 = one step on the whole batch).", min=1
    )
    mask_truncated_completions: bool = _real(
        "mask_truncated_completions", "Leave completions that hit max_completion_length without EOS out of the "
        "loss (DAPO's overlong filtering); they still count in their group's advantages.")
    dynamic_sampling: bool = _field(
        False, "Drop groups whose advantages are all 0 (equal rewards: no signal) and sample more prompts "
        "until the batch holds prompts_per_step groups (DAPO).",
    )
    prompt_sampling: str = _field(
        "uniform", "How each step's prompts are drawn: 'uniform', seeded passes over the dataset without repeats "
        "within a pass; 'signal', by each prompt's reward spread so far (the std of its groups' rewards, moved "
        "halfway to each new group's: for a 0/1 reward highest at solve rate 1/2), so prompts with mixed outcomes "
        "come back more often and those always or never solved less (never below prompt_sampling_floor's share); "
        "prompts not yet seen count as the most spread; 'in_order', the dataset's own order, pass after pass (TRL's "
        "shuffle_dataset=False). Works beside dynamic_sampling.", choices=("uniform", "signal", "in_order"))
    prompt_sampling_floor: float = _field(
        0.1, "prompt_sampling 'signal': the weight (as a share of the largest) below which no prompt falls.", gt=0,
        max=1)
    max_sampling_rounds: int = _field(
        4, "With dynamic_sampling, the most generation rounds in one step; a batch still short after "
        "them is filled with dropped groups (counted in the metrics).", min=1
    )

    # ---- PPO (algorithm: ppo; docs/math.md, "PPO") -------------------------------------------------
    gamma: float = _field(1.0, "PPO: discount γ of the per-token rewards in GAE.", min=0, max=1)
    lam: float = _field(0.95, "PPO: GAE's λ (0 = one-step TD, 1 = Monte Carlo returns).", min=0, max=1)
    vf_coef: float = _field(0.1, "PPO: weight of the value loss.", gt=0)
    cliprange_value: float = _field(
        0.2, "PPO: the value prediction may move at most this far from the rollout's before the value loss "
        "clips it.", min=0
    )
    whiten_advantages: bool = _field(True, "PPO: normalise the advantages to mean 0, std 1 over the batch's tokens.")
    value_learning_rate: float | None = _field(
        None, "PPO: peak AdamW learning rate of the value model; None means learning_rate.", gt=0
    )

    # ---- optimisation ----------------------------------------------------------------------------
    max_steps: int = _field(50, "Training steps (each: generate, score, μ optimizer updates).", min=1,
                            resumable=True)
    learning_rate: float = _common("learning_rate", REAL_MODEL["learning_rate"])
    lr_schedule: str = _common("lr_schedule")
    warmup_steps: int = _common("warmup_steps")
    weight_decay: float = _common("weight_decay")
    adam_beta1: float = _common("adam_beta1")
    adam_beta2: float = _common("adam_beta2", 0.99)
    optimizer: str = _common("optimizer")
    max_grad_norm: float = _common("max_grad_norm")
    micro_batch_size: int = _field(
        64, "Completions per forward/backward pass; gradients accumulate over the batch.", min=1, resumable=True
    )
    fast_path: bool = _field(
        True, "Run Llama-family models (Llama, Qwen2, Mistral without a sliding window) through grpokit's own "
        "forward: a preallocated KV cache when sampling, no padding computed in the reference and policy passes "
        "(same math; docs/benchmarks.md). Other models, and the training passes of parallelism: fsdp, use the "
        "model's own forward; false forces that everywhere.",
    )
    cuda_graphs: bool = _field(
        False, "On CUDA, sample with the fast path's decode step captured as a CUDA graph and replayed for each token "
        "(fixed shapes: the cache sized for all new tokens, finished rows kept); ignored on the CPU and under FSDP.")
    logprob_chunk_mb: float = _field(
        DEFAULT_CHUNK_MB, "Memory (MiB) for one chunk of the LM head's float32 logits when computing log-probs and "
        "entropies: the head runs on as many tokens at a time as fit (at least one) and recomputes them in backward, "
        "so no (tokens × vocabulary) logits are held for the micro-batch (same values and gradients; "
        "docs/math.md). 0: the full logits at once. LoRA or hooked heads, and multi-process training passes, "
        "always use the full logits.", min=0, resumable=True,
    )
    gradient_checkpointing: bool = _field(
        False, "Recompute each decoder layer's activations in backward instead of holding them for the whole "
        "micro-batch (activation checkpointing): the same values and gradients, less memory, more update time "
        "(SmolLM2-135M, float32 on a CPU: -1.0 GB peak, +22 % update time; docs/benchmarks.md).", resumable=True,
    )
    mixed_precision: str = _field(
        "auto", "'bf16': run the policy and reference passes (sampling included) under bfloat16 autocast; weights, "
        "gradients, optimizer states, logits and the loss stay float32; log-probs then differ from float32 by "
        "~1e-2. 'no': float32 throughout. 'auto': 'bf16' where the hardware computes bfloat16 natively (CUDA "
        "compute capability >= 8; CPUs with avx512_bf16 or amx_bf16, or Arm's bf16, in Linux's /proc/cpuinfo), "
        "'no' elsewhere, where bfloat16 is emulated and slower than float32; decided at start-up, printed, and "
        "decided again on resume.",
        choices=("auto", "no", "bf16"),
        # 'auto' decides again on the resuming machine anyway (an older checkpoint says 'no', the old default)
        resumable=True,
    )
    keep_freed_memory: bool = _field(
        True, "Training on the CPU under Linux (glibc): keep the memory each step frees for the next step's tensors "
        "instead of returning it to the system and taking it back page by page (as PyTorch keeps GPU memory). "
        "No page faults retaking a step's tensors (docs/memory.md); the process's resident memory stays near "
        "its peak. Affects the whole process.",
    )

    # ---- LoRA (pip install 'grpokit[lora]'; docs/lora.md) ----------------------------------------
    lora_rank: int = _field(0, "LoRA rank r (peft); 0 trains every weight. With LoRA the reference policy is the "
                            "base model with the adapter disabled: no second copy of the weights. output_dir/model "
                            "holds the adapter merged into the weights; output_dir/adapter the adapter alone.", min=0)
    lora_alpha: float = _common("lora_alpha")
    lora_dropout: float = _common("lora_dropout")
    lora_target_modules: list[str] | None = _common("lora_target_modules")

    # ---- scale-out (torchrun; docs/distributed.md) ----------------------------------------------
    parallelism: str = _field(
        "ddp", "With several processes: 'ddp' (each holds the whole model; gradients all-reduced) or 'fsdp' "
        "(FSDP2 fully_shard per decoder layer: parameters, gradients and optimizer states sharded).",
        choices=("ddp", "fsdp"),
    )
    reference_placement: str = _field(
        "auto", "Where the reference model lives with parallelism: fsdp (docs/distributed.md): 'shard', sharded like "
        "the policy (each process holds 1/W of it; a layer is gathered for its pass); 'cpu_offload', sharded with its "
        "shards in CPU memory (copied to the device layer by layer); 'replicate', a whole copy on every process (no "
        "gathers); 'auto': 'shard' under fsdp. Under ddp or in one process the reference is a whole copy. The same "
        "log-probs whatever the placement: a resumed run may change it.",
        choices=("auto", "replicate", "shard", "cpu_offload"), resumable=True,
    )

    # ---- reliability -----------------------------------------------------------------------------
    save_every: int = _field(
        25, "Write a checkpoint (model, optimizer, RNG states, data position, metrics) every this many steps, "
        "and always at the end and on SIGINT/SIGTERM; 0: only then.", min=0, resumable=True
    )
    keep_checkpoints: int = _common("keep_checkpoints")
    resume: str | None = _common("resume")
    overwrite_output_dir: bool = _common("overwrite_output_dir")
    on_reward_error: str = _field(
        "raise", "A reward function that raises: 'raise' stops, naming the function, prompt and completion; "
        "'skip' scores that completion None and counts it (metric reward_errors).", choices=("raise", "skip"),
        resumable=True,
    )
    reward_timeout: float | None = _field(
        None, "Seconds a reward function may take on a step's completions before training stops with an error.",
        gt=0, resumable=True,
    )
    max_nonfinite_updates: int = _common("max_nonfinite_updates")

    # ---- logging (where the metrics go, not what they are: a resume may change them) -------------
    report_to: list[str] = _field(
        [], "Trackers that also receive every step's metrics under its step number, and the config: 'tensorboard' "
        "(events in output_dir/tensorboard), 'wandb' (Weights & Biases; files in output_dir/wandb; WANDB_MODE=offline "
        "keeps them there), 'trackio' (local by default: `trackio show`). Each needs its package: pip install "
        "'grpokit[NAME]'. metrics.jsonl is always written.", resumable=True,
    )
    project: str = _field("grpokit", "The trackers' project name (wandb, trackio).", resumable=True)
    run_name: str | None = _field(None, "The run's name in the trackers; None: output_dir's last part.",
                                  resumable=True)
    tensorboard: bool = _field(False, "The same as 'tensorboard' in report_to (kept for older configs).",
                               resumable=True)
    log_completions: int = _field(
        4, "Completions per step written to completions.jsonl (0 disables).", min=0, resumable=True
    )
    progress_bar: bool = _common("progress_bar")

    def __post_init__(self) -> None:
        if isinstance(self.report_to, str):  # `report_to: wandb`, as TRL takes it
            self.report_to = [self.report_to]
        self._check_fields()
        check_grpo_config(self)

    @property
    def iteration_steps(self) -> int:
        """Steps per RL iteration (``max_steps`` for a plain run)."""
        return self.steps_per_iteration or self.max_steps // self.rl_iterations

    @property
    def trackers(self) -> list[str]:
        """The trackers to report to: ``report_to``, with 'tensorboard' when ``tensorboard`` is true."""
        return list(dict.fromkeys(self.report_to + (["tensorboard"] if self.tensorboard else [])))

    @property
    def num_completions(self) -> int:
        """N = B × G completions per step."""
        return self.prompts_per_step * self.num_generations
