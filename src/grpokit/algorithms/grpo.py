"""``GRPOTrainer``: the loop of docs/math.md ("One step"), one step top to bottom, for GRPO and for PPO.

    trainer = GRPOTrainer(GRPOConfig(...), model=model, tokenizer=tokenizer,
                          train_dataset=rows, reward_funcs=[accuracy_reward, my_reward])
    trainer.train()

Each step: (1) sample G completions for each of B prompts; (2) score them; (3) advantages; (4) the
log-probs that stay fixed during the update (π_ref, and π_old when the policy moves before the batch's
last optimizer step); (5) the update (:func:`grpokit.training.update.update`); (6) metrics. ``algorithm: ppo``
adds one learner, the :class:`~grpokit.algorithms.ppo.Critic`, whose value model gives GAE advantages in step 3
and trains beside the policy in step 5; everything else is shared.

Where it departs from the paper: none in the math. The reference model is the starting checkpoint,
frozen; with ``rl_iterations`` (iterative RL, :mod:`grpokit.algorithms.iterative`) it is reset to the policy at each
iteration's end, as in DeepSeekMath, after the learned reward model is retrained (step 7).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from grpokit.agents.calling import agent_of
from grpokit.agents.sampler import AgentSampler
from grpokit.agents.verifiers_v1 import environment_agent
from grpokit.algorithms.iterative import IterativeRL
from grpokit.algorithms.ppo import Critic
from grpokit.config import ConfigError, GRPOConfig, reward_funcs_of
from grpokit.core.objective import grpo_loss, masked_mean
from grpokit.core.optim import adamw_with_schedule
from grpokit.data import DataError, check_columns, check_prompt_lengths, given_rows, render_prompt, reward_column_names
from grpokit.models.loading import ensure_pad_token, save_pretrained
from grpokit.models.logprobs import PolicyLogprobs, sequence_logprobs
from grpokit.models.lora import with_lora
from grpokit.models.reference import build_reference, resolve_placement
from grpokit.models.sharding import full_state_dict, is_sharded
from grpokit.resolve import (
    agent_environment,
    code_options,
    dataset_options,
    environment_task,
    eval_judge,
    load_eval_rows,
    load_model_and_tokenizer,
    load_rows,
    resolve_reward_functions,
    task_options,
    with_environment,
)
from grpokit.rewards.calling import check_reward_functions, reward_name
from grpokit.rollout.engines import SamplingOptions, build_engine
from grpokit.rollout.generate import Rollout
from grpokit.rollout.python_tool import start_sandboxes
from grpokit.rollout.tool_templates import build_toolbox, toolbox_options
from grpokit.rollout.tools import add_environment_reward, resolve_tools, reward_keywords
from grpokit.runtime.device import autocast, resolve_device
from grpokit.runtime.memory import keep_freed_memory
from grpokit.training.distributed import data_parallel, device_for, init_world
from grpokit.training.engine import Trainer, TrainingInterrupted
from grpokit.training.evaluation import HeldOutEval, check_eval_rows
from grpokit.training.runlog import completion_records, step_metrics, warn_of_silent_rewards
from grpokit.training.sampling import Sampler, group_relative_advantages, whole_batches
from grpokit.training.supervised import split
from grpokit.training.update import Learner, LossCounts, NonfiniteGuard, TrainingError, UpdateBatch, update

__all__ = ["GRPOTrainer", "TrainingError", "TrainingInterrupted"]


class GRPOTrainer(Trainer):
    """Trains a causal LM with ``config.algorithm`` (GRPO, or the PPO baseline) on the run loop of
    :class:`~grpokit.training.engine.Trainer`. Anything not passed is built from the config."""

    postfix = ("reward", "kl", "accuracy", "eval_accuracy")

    def __init__(
        self,
        config: GRPOConfig,
        *,
        model: torch.nn.Module | None = None,
        tokenizer: Any = None,
        train_dataset: Iterable[dict[str, Any]] | None = None,
        eval_dataset: Iterable[dict[str, Any]] | None = None,
        reward_funcs: Sequence[str | Callable] | None = None,
        tools: Sequence[str | Callable] | None = None,
        environment_factory: Callable[[], Any] | None = None,
        agent: Callable[..., Any] | None = None,
    ):
        super().__init__()
        self.label = config.algorithm.upper()
        self.silent: set[str] = set()  # reward functions said to have returned None for a whole step
        self.rewards_checked = False  # whether a step of this process has been checked for silent rewards
        # Bad launcher settings fail here, before any work (docs/distributed.md).
        self.world = init_world(config.device, config.prompts_per_step)
        self.set_up(config, device_for(self.world, resolve_device(config.device)), config.trackers)
        if config.keep_freed_memory and self.device.type == "cpu":
            keep_freed_memory()

        # An environment (verifiers, OpenEnv) brings rows, a rubric and episodes, where nothing else is given.
        self.environment = environment_task(config)
        # An agent drives its own episodes against the served policy (grpokit.agents): no prompts are rendered here.
        # verifiers 0.4's environments call the model themselves: they are agents.
        if (task := agent_environment(config)) is not None:
            agent, train_dataset = environment_agent(task), task.rows if train_dataset is None else train_dataset
        self.agent = agent_of(config, agent, tools, environment_factory, environment=task is not None)
        train_dataset, eval_dataset, reward_funcs, weights, environment_factory = with_environment(
            config, self.environment, train_dataset, eval_dataset, reward_funcs, environment_factory)
        # Rewards, data and optional packages are checked before the (possibly slow) model load.
        # Reward models named in the config run on this process's device, in the run's precision.
        self.reward_funcs, self.reward_weights = resolve_reward_functions(
            reward_funcs or ([] if self.agent and config.reward_funcs is None else reward_funcs_of(config)),
            None if self.agent else weights, code_options(config),
            task_options(config),
            device=self.device, mixed_precision=self.mixed_precision,
        )
        # Tools (and an environment's own reward) are resolved here too; the ToolBox needs the tokenizer.
        tool_functions, environment_factory = resolve_tools(config, tools, environment_factory)
        add_environment_reward(self.reward_funcs, self.reward_weights, environment_factory)
        # Rows passed in (a list of dicts or a datasets.Dataset) are taken as they are, instead of the config's.
        rows = given_rows(train_dataset, "train_dataset") if train_dataset is not None else load_rows(
            config.dataset, config.seed, dataset_options(config), reasoning_gym_options=config.reasoning_gym)
        source = "train_dataset" if train_dataset is not None else config.dataset
        rows, eval_rows, judge = self.held_out_rows(rows, eval_dataset)
        keywords = reward_column_names(rows, config.prompt_column, config.answer_column)
        extras = reward_keywords(environment_factory)
        self.iterations = IterativeRL(config, self.reward_funcs, self.world) if config.rl_iterations > 1 else None
        # Iterative RL's labelling rewards are called on the same rows, first after an iteration's steps: checked now.
        checked = self.reward_funcs + (self.iterations.labels if self.iterations else [])
        needed = [k for k in check_reward_functions(checked, [*keywords, *extras], source) if k not in extras]
        self.start_sandboxes([*checked, *tool_functions])
        prompt_column = [] if self.agent else [config.prompt_column]  # an agent takes the columns it names
        check_columns(rows, list(dict.fromkeys([*prompt_column, *(keywords[k] for k in needed)])), source=source,
                      prompt=not self.agent)

        if model is None:
            model, tokenizer = load_model_and_tokenizer(config.model, config.seed, config.progress_bar, config.dtype)
        elif tokenizer is None:
            raise ValueError("a tokenizer is required when a model is passed")
        ensure_pad_token(tokenizer, repr(config.model))
        self.model, self.tokenizer = with_lora(model, config).to(self.device), tokenizer
        toolbox = build_toolbox(tokenizer, tool_functions, environment_factory, chat_template=config.chat_template,
                                system_prompt=config.system_prompt, **toolbox_options(config))
        listed = toolbox.prompt_tools()
        render = dict(system_prompt=config.system_prompt, chat_template=config.chat_template, tools=listed)
        prompts, eval_prompts = ([render_prompt(tokenizer, row[config.prompt_column], **render) for row in part]
                                 for part in (([], []) if self.agent else (rows, eval_rows)))
        if prompts:  # an agent's prompts are its own: the server refuses one too long, as OpenAI's API does
            check_prompt_lengths(prompts + eval_prompts, tokenizer, config.max_completion_length,
                                 getattr(self.model.config, "max_position_embeddings", None))

        # Copies of the starting policy are taken before it is sharded: π_ref (a whole copy, or a frame without
        # weights that is sharded like the policy and filled from its shards: reference_placement), and PPO's value
        # model.
        fsdp = self.world.distributed and config.parallelism == "fsdp"
        self.reference = build_reference(self.model, config.beta, self.mixed_precision,
                                         resolve_placement(config.reference_placement, fsdp))
        self.critic = Critic(self.model, config, self.world, self.device) if config.algorithm == "ppo" else None
        # The policy's training passes are a module (PolicyLogprobs: the fast path, the LM head in chunks) that
        # DDP wraps with several processes, its gradient sync hooked in as in any forward. FSDP2 shards the model
        # in place and must gather its parameters in the model's own forward: there the pass takes it, its LM head
        # set aside and run in chunks after it (sequence_logprobs; sampling and the frozen passes keep the fast path).
        policy_pass = PolicyLogprobs(self.model, temperature=config.temperature, fast=config.fast_path and not fsdp,
                                     chunk_mb=config.logprob_chunk_mb, checkpoint_layers=config.gradient_checkpointing)
        if fsdp:
            data_parallel(self.model, self.world, "fsdp")  # shards it in place
            if self.reference is not None:
                self.reference.shard_like(self.model)
        train_model = policy_pass if fsdp else data_parallel(policy_pass, self.world)
        optimizer, scheduler = adamw_with_schedule(self.model, config, config.learning_rate)  # over the shards
        self.policy = Learner("", self.model, train_model, optimizer, scheduler, loss=self.policy_loss)
        self.learners = [self.policy] + ([self.critic.learner] if self.critic else [])
        # What samples the completions (generation_engine, rollout_precision, ...): the same for `sample` and `eval`.
        self.engine = build_engine(SamplingOptions.from_config(config, self.mixed_precision), self.model, tokenizer,
                                   sharded=is_sharded(self.model), rank=self.world.rank, world_size=self.world.size,
                                   seed=config.seed)
        self.synced: int | None = None  # the step whose weights the engine holds
        self.sampler = AgentSampler(config, tokenizer, rows, self.agent, self.reward_funcs, self.model, self.engine,
                                    self.device, self.world, str(source)) if self.agent else \
            Sampler(config, tokenizer, rows, prompts, self.reward_funcs, self.reward_weights, self.engine, self.device,
                    self.world, toolbox=toolbox)
        # Held-out evaluation (eval_dataset / eval_fraction) through the same engine, judged as `grpokit eval` judges.
        self.start_sandboxes([judge] if judge else [])
        self.held_out = HeldOutEval(config, tokenizer, eval_rows, eval_prompts, self.engine, self.world, toolbox,
                                    judge) if eval_rows else None
        self.guard = NonfiniteGuard(config.max_nonfinite_updates)
        self.shuffle = torch.Generator().manual_seed(config.seed + 1)  # minibatch order

    def held_out_rows(self, rows: list[dict[str, Any]], given: Iterable[dict[str, Any]] | None = None,
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Callable | None]:
        """(training rows, held-out rows, what judges them): ``given`` (``eval_dataset=`` rows) or ``eval_dataset``'s
        rows, or an ``eval_fraction`` of the dataset's (then not trained on), checked for the columns evaluation and its
        judge (:func:`~grpokit.resolve.eval_judge`; None: ``accuracy``) read; no held-out rows without any (then
        ``eval_every`` is refused: it is checked here, where rows passed in are known)."""
        config = self.config
        if given is not None and config.eval_fraction:
            raise ConfigError("eval_fraction and eval_dataset= both choose the held-out rows; set one of them")
        if config.eval_fraction:
            rows, held = split(rows, config.eval_fraction, config.seed)
            source = f"{config.dataset} (eval_fraction)"
        elif given is not None:
            held, source = given_rows(given, "eval_dataset"), "eval_dataset"
        elif config.eval_dataset is not None:
            held = load_eval_rows(config.eval_dataset, dataset_options(config, held_out=True), seed=config.seed,
                                  reasoning_gym_options=config.reasoning_gym)
            source = config.eval_dataset
        elif config.eval_every:
            raise ConfigError("eval_every needs held-out rows: set eval_dataset or eval_fraction (or pass "
                              "eval_dataset= rows)")
        else:
            return rows, [], None
        if not held:
            raise DataError(f"{source}: no held-out rows")
        judge = eval_judge(config, held, self.environment)
        check_eval_rows(held, judge, config.prompt_column, config.answer_column, source)
        return rows, held, judge

    def start_sandboxes(self, users: Sequence[Callable]) -> None:
        """Start the sandboxes of the rewards and tools that run model-written code (``code_tests``, ``python``):
        one that cannot start stops the run now, saying why; each says what it is, on the console and atop
        config.yaml."""
        for note in start_sandboxes(users):
            self.notes.append(note)
            if self.world.main:
                print(note, file=sys.stderr)

    @property
    def max_steps(self) -> int:
        return self.config.max_steps

    # ---- the step --------------------------------------------------------------------------------

    def training_step(self) -> dict[str, float]:
        config = self.config
        start = time.perf_counter()

        # 1-2. Sample G completions for each of B prompts from π_old, through the engine (generation_engine,
        #      rollout_precision), and score them; with dynamic sampling, groups without signal are replaced by
        #      further rounds' groups.
        if self.held_out is not None and self.step == 0:
            self.log({"step": 0, **self.evaluate_held_out()})  # the starting policy
        self.sync_engine()  # the last step's optimizer steps (or a resumed checkpoint's)
        batch, sampled, sampling = self.sampler.sample(self.step)
        self.engine.sleep()  # vllm_enable_sleep_mode: its memory back to training until the next step
        rollout = batch.rollout
        sampled_at = time.perf_counter()
        loss_mask = rollout.model_mask  # the policy's own tokens: inserted tool results are context
        if config.mask_truncated_completions:
            loss_mask = loss_mask * ~rollout.truncated.unsqueeze(1)

        # 4. Log-probs that stay fixed during the update: π_ref, and π_old when the policy moves before
        #    the last optimizer step on the batch or PPO's reward needs it (with one step, π_old = π_θ and
        #    ratio = 1 in value, so no extra pass is needed: docs/math.md, "One step").
        ref_logp = self.reference_logprobs(rollout)
        moves = config.num_iterations > 1 or config.num_minibatches > 1
        old_logp = self.frozen_logprobs(self.model, rollout) if moves or self.critic else None

        # 3. Advantages, (N, T): relative to the group (GRPO), or GAE on the value model's estimates (PPO).
        if self.critic is None:
            advantages = group_relative_advantages(batch, config.num_generations, config.scale_rewards, self.world)
            fixed = UpdateBatch(rollout, loss_mask, advantages.to(self.device), old_logp, ref_logp)
        else:
            fixed = self.critic.update_batch(batch, loss_mask, old_logp, ref_logp)
        frozen = time.perf_counter()

        # 5. μ passes over the batch, one optimizer step per minibatch and learner, gradients accumulated
        #    over micro-batches.
        passes = update(self.learners, fixed, micro_batch_size=config.micro_batch_size,
                        max_grad_norm=config.max_grad_norm, guard=self.guard, num_iterations=config.num_iterations,
                        num_minibatches=config.num_minibatches, shuffle=self.shuffle, world=self.world)
        last = {**passes[-1], "skipped_updates": sum(p["skipped_updates"] for p in passes)}
        updated = time.perf_counter()

        # 6. Metrics, over every process's completions.
        self.step += 1
        whole = whole_batches(batch, sampled, sampling, self.world, self.tokenizer.pad_token_id)
        metrics = step_metrics(self.step, *whole, passes[0], last, (start, sampled_at, frozen, updated))
        warn_of_silent_rewards(metrics, self.silent, first_step=not self.rewards_checked, say=self.world.main)
        self.rewards_checked = True
        if self.critic is not None:
            metrics.update(self.critic.metrics(fixed, last))
        if self.iterations is not None:
            metrics["rl_iteration"] = self.iterations.iteration(self.step)
        if self.held_out is not None and self.held_out.due(self.step):
            metrics.update(self.evaluate_held_out())
        self.log(metrics, completion_records(self.step, batch, fixed.advantages, config.prompt_column,
                                             config.num_generations, config.log_completions) if self.world.main else ())

        # 7. Iterative RL, at an iteration's end: retrain the reward model on the new policy's samples and
        #    reset the reference to the policy.
        if self.iterations is not None and self.iterations.ends_iteration(self.step):
            self.iterations.advance(self)
        return metrics

    def sync_engine(self) -> None:
        """Have the engine sample from the policy as it is after this step's updates (once per step)."""
        if self.synced != self.step:
            self.engine.update_weights(self.step)
            self.synced = self.step

    def evaluate_held_out(self) -> dict[str, float]:
        """The held-out metrics of the policy as it is now (``eval_*``, the alarm)."""
        self.sync_engine()
        metrics = self.held_out(self.step, self.history)
        self.engine.sleep()
        return metrics

    def policy_loss(self, model: torch.nn.Module, batch: UpdateBatch, counts: LossCounts,
                    first_pass: bool) -> tuple[torch.Tensor, dict[str, float]]:
        """The clipped surrogate on a micro-batch (``grpo_loss``), with the policy's entropy on the first
        pass. PPO's KL is in its per-token reward (``ppo.token_rewards``), so its loss has no KL term."""
        config = self.config
        with autocast(self.mixed_precision, self.device, cache=False):  # a weight's copy lives while a pass needs it
            logp, entropy = model(*batch.rollout.sequences(), with_entropy=first_pass)  # PolicyLogprobs (in DDP)
        loss, stats = grpo_loss(
            logp, batch.old_logp, batch.ref_logp, batch.advantages, batch.loss_mask,
            epsilon=config.epsilon, epsilon_high=config.epsilon_high,
            beta=0.0 if self.critic else config.beta, aggregation=config.aggregation,
            ratio_level=config.ratio_level, max_completion_length=config.max_completion_length,
            kl_kind=config.kl_kind, num_sequences=counts.sequences, num_tokens=counts.tokens,
            # served tokens' log-probs too: the check that the sampler and the trainer agree covers them
            sample_logp=batch.rollout.logp if self.engine.lowered or self.agent else None, is_cap=config.rollout_is_cap,
            is_mode=config.rollout_is_mode, kl_weighted=config.kl_ratio_weighted,
        )
        if entropy is not None:
            stats["entropy"] = masked_mean(entropy, batch.loss_mask).item()
        return loss, stats

    @torch.no_grad()
    def frozen_logprobs(self, model: torch.nn.Module, rollout: Rollout) -> torch.Tensor:
        """Log-probs (N, T) of the sampled tokens under ``model``, without gradient, micro-batch by
        micro-batch: π_old, or π_ref."""
        was_training = model.training
        model.eval()
        chunks = []
        for micro in rollout.split(self.config.micro_batch_size):
            with autocast(self.mixed_precision, self.device, cache=False):
                chunks.append(sequence_logprobs(model, *micro.sequences(), temperature=self.config.temperature,
                                                fast=self.config.fast_path, chunk_mb=self.config.logprob_chunk_mb)[0])
        model.train(was_training)
        return torch.cat(chunks)

    def reference_logprobs(self, rollout: Rollout) -> torch.Tensor | None:
        """π_ref's log-probs (N, T), or None when β = 0."""
        if self.reference is None:
            return None
        with self.reference.active():
            return self.frozen_logprobs(self.reference.model, rollout)

    # ---- checkpoints and saving ------------------------------------------------------------------

    def run_config(self) -> dict[str, Any]:
        config = self.config.to_dict()
        config["reward_funcs"] = [reward_name(fn) for fn in self.reward_funcs]
        return config

    def modules(self) -> dict[str, torch.nn.Module]:
        """The policy (``"model"``), PPO's value model, and with iterative RL the reward model and the reference
        (both change between iterations)."""
        modules = {"model": self.model, **({"value_model": self.critic.value_model} if self.critic else {})}
        if self.iterations is not None:
            modules["reward_model"] = self.iterations.reward_model.model
            if self.reference is not None:
                modules["reference"] = self.reference.model
        return modules

    def generators(self) -> dict[str, torch.Generator]:
        return {"sampling": self.sampler.generator, "minibatches": self.shuffle}

    def data_state(self) -> dict[str, Any]:
        sampler = self.sampler
        return {"order": list(sampler.order), "epoch": sampler.epoch, "draws": sampler.draws,
                "spread": [[index, value] for index, value in sampler.spread.items()]}  # JSON keys are strings

    def load_data_state(self, data: dict[str, Any]) -> None:
        self.sampler.order, self.sampler.epoch = list(data["order"]), data["epoch"]
        self.sampler.draws = data.get("draws", 0)  # checkpoints from before prompt_sampling have neither
        self.sampler.spread = {int(index): value for index, value in data.get("spread", [])}

    def save(self, path: str | Path, adapter: str | Path | None = None) -> None:
        """The policy and tokenizer (:func:`~grpokit.models.loading.save_pretrained`: safetensors, full weights; LoRA:
        merged, the adapter in ``adapter`` beside it, or at ``adapter``), and PPO's value model in ``value_model``
        beside it. Every process calls it: a sharded model is gathered first."""
        path = Path(path)
        state = full_state_dict(self.model, self.world.main)
        if self.world.main:
            save_pretrained(self.model, self.tokenizer, path, state, adapter)
        if self.critic is not None:
            self.critic.save(path.parent / "value_model")
