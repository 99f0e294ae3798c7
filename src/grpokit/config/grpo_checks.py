"""The checks across a GRPOConfig's keys: settings that cannot run together, each refused naming the keys."""

from __future__ import annotations

from typing import Any

from grpokit.config.fields import ConfigError, check_reward_weights

TRACKERS = ("tensorboard", "wandb", "trackio")  # report_to's values
ENGINES = ("native", "vllm")  # generation_engine's values


def reward_funcs_of(config: Any) -> list[Any]:
    """A config's ``reward_funcs``, or where it names none the dataset's own: the task's scorer for a reasoning-gym
    dataset (``reasoning_gym:TASK``), else ``accuracy`` and ``format``."""
    if config.reward_funcs is not None:
        return list(config.reward_funcs)
    if getattr(config, "agent", None) is not None:  # the agent's reward is the reward
        return []
    return ["reasoning_gym"] if str(config.dataset).startswith("reasoning_gym:") else ["accuracy", "format"]


def check_grpo_config(config: Any) -> None:
    """Raise :class:`ConfigError` for the first refused combination of ``config``'s keys (a GRPOConfig)."""
    unknown = [name for name in config.report_to if name not in TRACKERS]
    if unknown:
        raise ConfigError(f"report_to: {unknown[0]!r} is not a tracker; choose from {', '.join(TRACKERS)}")
    if config.reward_funcs is not None and not config.reward_funcs:
        raise ConfigError("reward_funcs is empty; give at least one reward function (or leave it out: the dataset's "
                          "own)")
    if config.agent is not None:  # its rewards are named by what it returns: checked at its first episode
        check_agent_config(config)
    elif config.reward_funcs is not None:  # else they are the functions passed in Python, or the environment's
        check_reward_weights(config.reward_weights, len(config.reward_funcs))  # rubric: checked where they are known
    refusals = (  # (refused, why): settings that cannot run together
        (config.num_minibatches > config.num_completions, f"num_minibatches={config.num_minibatches} exceeds the "
         f"{config.num_completions} completions of a step (prompts_per_step × num_generations)"),
        (config.algorithm == "ppo" and config.dynamic_sampling,
         "dynamic_sampling drops groups without signal, a GRPO notion; PPO has no groups"),
        (config.lora_rank and config.algorithm == "ppo", "lora_rank with algorithm: ppo is not supported yet: the "
         "value model copies the full policy; use GRPO, or lora_rank: 0"),
        (config.parallelism == "fsdp" and config.optimizer == "adamw_8bit", "optimizer: adamw_8bit with parallelism: "
         "fsdp is not supported (bitsandbytes does not step sharded parameters); use ddp, or optimizer: adamw"),
        (config.parallelism == "fsdp" and config.rollout_precision != "fp32", "rollout_precision with parallelism: "
         "fsdp is not supported (the bf16 copy and int8 products need the whole policy on every process; "
         "bf16_autocast is untested there); use ddp, or rollout_precision: fp32"),
        (config.parallelism == "fsdp" and config.lora_rank, "lora_rank with parallelism: fsdp is not supported yet "
         "(peft can neither save nor merge an adapter whose weights are shards, so no checkpoint or model could be "
         "written); use ddp, or lora_rank: 0"),
        (config.cuda_graphs and not config.fast_path, "cuda_graphs captures the fast path's decode step: fast_path: "
         "true"),
        (config.rollout_precision == "int8" and not config.fast_path,
         "rollout_precision: int8 samples with the fast path's int8 products: fast_path: true"),
        (config.generation_engine == "vllm" and config.rollout_precision not in ("fp32", "bf16"),
         f"rollout_precision: {config.rollout_precision} is the native engine's; generation_engine: vllm samples in "
         "float32 (fp32) or bfloat16 (bf16)"),
        (config.generation_engine == "vllm" and config.cuda_graphs, "cuda_graphs is the native engine's decode step; "
         "generation_engine: vllm captures its own CUDA graphs"),
        (config.generation_engine == "vllm" and config.top_p < 1, "top_p < 1 with generation_engine: vllm: vLLM "
         "reports its log-probs after the top-p cut, which the loss's correction does not expect yet; use top_p: 1"),
        (config.generation_engine == "vllm" and (config.top_k or config.min_p or config.repetition_penalty != 1),
         "top_k, min_p or repetition_penalty with generation_engine: vllm: vLLM reports its log-probs after them, "
         "which the loss's correction does not expect yet; leave them off (0, 0.0, 1.0)"),
        (config.generation_engine == "vllm" and config.vllm_tensor_parallel_size > 1, "vllm_tensor_parallel_size > 1 "
         "is not supported yet (the processes sharing an engine would have to sample one another's prompts); each "
         "process holds a whole engine: use 1"),
        (config.reference_placement in ("shard", "cpu_offload") and config.parallelism != "fsdp",
         f"reference_placement: {config.reference_placement} shards the reference like the policy, which only "
         "parallelism: fsdp shards; with ddp every process holds a whole reference: use auto or replicate"),
        (config.parallelism == "fsdp" and config.dynamic_sampling, "dynamic_sampling with parallelism: fsdp: "
         "processes would run different numbers of sharded passes; use ddp"),
        (config.eval_dataset is not None and config.eval_fraction > 0, "eval_dataset and eval_fraction both choose "
         "the held-out rows; set one of them"),
        ("python" in config.tools and config.tool_timeout is not None and config.tool_timeout <= config.sandbox_timeout,
         f"tool_timeout={config.tool_timeout} must exceed sandbox_timeout={config.sandbox_timeout} with the python "
         "tool, so that a slow program is killed by the sandbox (and the model reads 'timed out') before the "
         "call is abandoned"),
    )
    for refused, why in refusals:
        if refused:
            raise ConfigError(why)
    if config.rl_iterations > 1:
        _check_iterations(config)
    elif config.steps_per_iteration is not None:
        raise ConfigError("steps_per_iteration is set but rl_iterations is 1; set rl_iterations, or drop it")
    updates = config.max_steps * config.num_iterations * config.num_minibatches
    if config.warmup_steps >= updates:
        raise ConfigError(
            f"warmup_steps={config.warmup_steps} leaves no step after warmup: the run makes {updates} optimizer "
            "steps (max_steps × num_iterations × num_minibatches)"
        )


def _check_iterations(config: Any) -> None:
    k, s = config.rl_iterations, config.steps_per_iteration
    if s is None and config.max_steps % k:
        raise ConfigError(f"max_steps={config.max_steps} does not divide into rl_iterations={k} iterations; set "
                          "steps_per_iteration, or a max_steps that is a multiple of rl_iterations")
    if s is not None and s * k != config.max_steps:
        raise ConfigError(f"max_steps={config.max_steps} but rl_iterations × steps_per_iteration = {k} × {s} = "
                          f"{k * s}; set max_steps: {k * s}")
    if not config.reward_model_labels:
        raise ConfigError("rl_iterations > 1 needs reward_model_labels: the rule rewards that label the "
                          "policy's samples the reward model is retrained on")
    if config.reward_model_label_weights is not None and \
            len(config.reward_model_label_weights) != len(config.reward_model_labels):
        raise ConfigError(f"reward_model_label_weights has {len(config.reward_model_label_weights)} values but "
                          f"reward_model_labels has {len(config.reward_model_labels)}")
    if config.lora_rank:
        raise ConfigError("rl_iterations > 1 with lora_rank: the reference is the base model with the adapter "
                          "off, which cannot be reset to the current policy; use lora_rank: 0")
    if config.parallelism == "fsdp":
        raise ConfigError("rl_iterations > 1 with parallelism: fsdp is not supported (the first process samples "
                          "and retrains the reward model alone, which a sharded policy cannot: its passes need every "
                          "process); use ddp")


def check_agent_config(config: Any, environment: bool = False) -> None:
    """An agent owns its episodes' loop: what else would drive them, or needs what it does not give, is refused.
    ``environment``: the agent is the config's ``environment`` (verifiers 0.4's), not a second driver."""
    refusals = (
        (config.tools or config.environment_factory, "tools and environment_factory run inside grpokit's own episodes; "
         "an agent drives its own (its tools are its business): drop them, or the agent"),
        (config.environment and (config.agent or not environment), "environment and agent both say what drives the "
         "episodes; set one of them"),
        (config.algorithm == "ppo", "algorithm: ppo with an agent is not supported: the value model would need a value "
         "for every served token; use grpo"),
        (config.supervision == "process", "supervision: process with an agent: an agent returns one reward per "
         "episode; use outcome"),
        (config.rl_iterations > 1, "rl_iterations > 1 with an agent is not supported (the reward model is retrained "
         "on single completions); use 1"),
        (config.eval_dataset is not None or config.eval_fraction or config.eval_every, "held-out evaluation "
         "(eval_dataset, eval_fraction, eval_every) with an agent is not supported yet: it would run the agent's "
         "episodes on held-out rows; evaluate a saved model by serving it (grpokit serve) to the agent"),
        (config.parallelism == "fsdp", "an agent with parallelism: fsdp is not supported (the policy server decodes "
         "on one process; sharded decoding needs every process in step); use ddp"),
    )
    for refused, why in refusals:
        if refused:
            raise ConfigError(why)
