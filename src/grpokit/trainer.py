"""``GRPOTrainer``: the GRPO loop of GRPO.md §1, one step top to bottom.

    trainer = GRPOTrainer(GRPOConfig(...), model=model, tokenizer=tokenizer,
                          train_dataset=rows, reward_funcs=[accuracy_reward, my_reward])
    trainer.train()

Each step: (1) sample G completions for each of B prompts; (2) score them; (3) group-relative
advantages; (4) reference (and, for μ > 1, π_old) log-probs; (5) μ optimizer steps over the batch in
micro-batches with gradient accumulation; (6) metrics. Loss normalisers count over the whole batch, so
the update does not depend on the micro-batch size.

Where it departs from the paper: none in the math. The reference model is the starting checkpoint,
frozen (the paper also refreshes it between RL iterations; we do not).
"""

from __future__ import annotations

import copy
import math
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from grpokit.checkpoint import StopSignals, find_checkpoint, load_checkpoint, save_checkpoint
from grpokit.config import ConfigError, GRPOConfig
from grpokit.data import check_columns, check_prompt_lengths, load_rows
from grpokit.distributed import (
    all_max,
    all_sum,
    all_sum_dict,
    data_parallel,
    device_for,
    full_state_dict,
    gather,
    gradient_sync,
    init_world,
)
from grpokit.models import (
    BUILTIN,
    autocast,
    keep_freed_memory,
    load_model_and_tokenizer,
    resolve_device,
    seed_everything,
    with_lora,
)
from grpokit.objective import grpo_loss, masked_mean
from grpokit.optim import adamw_with_schedule
from grpokit.rewards import (
    required_columns,
    resolve_reward_functions,
    reward_name,
)
from grpokit.rollout import Rollout, sequence_logprobs, stop_token_ids
from grpokit.runlog import RunLog, completion_records, step_metrics
from grpokit.sampling import Batch, Sampler, render_prompt


class TrainingError(RuntimeError):
    """Training cannot go on (repeated non-finite updates); the message says why and what was kept."""


class TrainingInterrupted(KeyboardInterrupt):
    """SIGINT/SIGTERM stopped training after a checkpoint; the message names it."""


class GRPOTrainer:
    """Trains a causal LM with GRPO. Anything not passed is built from the config."""

    def __init__(
        self,
        config: GRPOConfig,
        *,
        model: torch.nn.Module | None = None,
        tokenizer: Any = None,
        train_dataset: Sequence[dict[str, Any]] | None = None,
        reward_funcs: Sequence[str | Callable] | None = None,
    ):
        if config.algorithm != "grpo" and type(self) is GRPOTrainer:
            raise ConfigError(f"algorithm: {config.algorithm} needs its own trainer: use build_trainer(config)")
        self.config = config
        seed_everything(config.seed)
        # Bad launcher settings fail here, before any work (docs/distributed.md).
        self.world = init_world(config.device, config.prompts_per_step)
        self.device = device_for(self.world, resolve_device(config.device))
        if config.keep_freed_memory and self.device.type == "cpu":
            keep_freed_memory()

        self.reward_funcs = resolve_reward_functions(reward_funcs or config.reward_funcs)
        names = [reward_name(fn) for fn in self.reward_funcs]
        if len(set(names)) != len(names):
            raise ValueError(f"reward_funcs: names must be unique, got {names}")
        self.reward_weights = config.reward_weights or [1.0] * len(self.reward_funcs)
        if len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(self.reward_weights)} values for {len(self.reward_funcs)} reward functions"
            )

        if config.tensorboard:  # a missing package fails now, not after the model load
            import importlib.util

            if importlib.util.find_spec("tensorboard") is None:
                raise ConfigError("tensorboard: true needs the tensorboard package: pip install 'grpokit[tensorboard]'")

        # Data and rewards are checked before the (possibly slow) model load.
        self.rows = self._load_rows(train_dataset)

        if model is None:
            model, tokenizer = load_model_and_tokenizer(config.model, config.seed, config.progress_bar, config.dtype)
        elif tokenizer is None:
            raise ValueError("a tokenizer is required when a model is passed")
        if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
            # The completion mask never looks at pad ids, so pad may safely equal EOS.
            tokenizer.pad_token = tokenizer.eos_token
        self.model, self.tokenizer = with_lora(model, config).to(self.device), tokenizer
        self.stop_ids = stop_token_ids(self.model, tokenizer)

        prompts = [render_prompt(tokenizer, row[config.prompt_column], system_prompt=config.system_prompt,
                                 chat_template=config.chat_template) for row in self.rows]
        check_prompt_lengths(prompts, tokenizer, config.max_completion_length,
                             getattr(self.model.config, "max_position_embeddings", None))

        # β = 0 turns the reference model off entirely: never created, never run (GRPO.md §3). With LoRA
        # the reference is the policy with its adapter disabled, so no copy is held.
        self.loss_beta = config.beta  # the KL term's weight in the loss (PPO puts it in the reward instead)
        self.ref_model = None
        if config.beta != 0 and not config.lora_rank:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)

        self._copy_models()
        # The training passes go through this: DDP or FSDP2 with several processes, the model otherwise.
        self.train_model = data_parallel(self.model, self.world, config.parallelism)
        self.optimizer, self.scheduler = self._adamw(self.model, config.learning_rate)
        self.sampler = Sampler(config, tokenizer, self.rows, self.reward_funcs, self.reward_weights, self.stop_ids,
                               self.device, self.world)
        self._shuffle = torch.Generator().manual_seed(config.seed + 1)  # minibatch order
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.run_log: RunLog | None = None  # the run directory, started by train() or the first logged step
        self.nonfinite_streak = 0  # consecutive updates skipped for a non-finite loss or gradient

    # ---- set-up helpers --------------------------------------------------------------------------

    def _load_rows(self, train_dataset: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
        config = self.config
        if train_dataset is not None:
            rows, source = list(train_dataset), "train_dataset"
        elif config.dataset == BUILTIN:
            from grpokit.arithmetic import train_rows

            rows, source = train_rows(4096, config.seed), BUILTIN
        else:
            rows, source = load_rows(config.dataset), config.dataset
        needed = [config.prompt_column]
        for fn in self.reward_funcs:
            for column in required_columns(fn):
                column = config.answer_column if column == "answer" else column
                if column not in needed:
                    needed.append(column)
        check_columns(rows, needed, source=source)
        return rows

    def _copy_models(self) -> None:
        """Models copied from the policy before it is sharded (PPO's value model)."""

    def _adamw(self, model: torch.nn.Module, lr: float) -> tuple[torch.optim.Optimizer, Any]:
        """AdamW over the model's trainable parameters, and its warmup + decay schedule over the run."""
        return adamw_with_schedule(model, self.config, lr)

    # ---- the step --------------------------------------------------------------------------------

    def training_step(self) -> dict[str, float]:
        config = self.config
        start = time.perf_counter()

        # 1-2. Sample G completions for each of B prompts from π_old and score them; with dynamic
        #      sampling, groups without signal are replaced by groups from further rounds.
        batch, sampled, sampling = self.sampler.sample(self.model)
        rollout = batch.rollout
        sampled_time = time.perf_counter()

        # 3. Advantages relative to the group (§2): (N,) for outcome, (N, T) for process supervision.
        advantages = self.sampler.advantages(batch)
        loss_mask = self._loss_mask(rollout)

        # 4. Log-probs that stay fixed during the update: π_ref, and π_old when there are several
        #    optimizer steps (with one, π_old = π_θ and ratio = 1 in value, so no extra pass is
        #    needed: GRPO.md §1.4).
        ref_logp = self._reference_logprobs(rollout)
        several_updates = config.num_iterations > 1 or config.num_minibatches > 1
        old_logp = self._frozen_logprobs(self.model, rollout) if several_updates else None
        frozen = time.perf_counter()

        # 5. μ passes over the batch, one optimizer step per minibatch, gradients accumulated over
        #    micro-batches.
        first_update, update = self._optimize(
            rollout, advantages=advantages, loss_mask=loss_mask, old_logp=old_logp, ref_logp=ref_logp
        )
        updated = time.perf_counter()

        # 6. Metrics, over every process's completions.
        self.step += 1
        metrics = step_metrics(self.step, *self._whole(batch, sampled, sampling), first_update, update,
                               (start, sampled_time, frozen, updated))
        self._log(metrics, batch, advantages)
        return metrics

    def _whole(self, batch: Batch, sampled: Batch, sampling: dict[str, float]) -> tuple[Batch, Batch, dict]:
        """The step's batches and sampling counts over all processes (as they are, in a world of one)."""
        world = self.world
        if not world.distributed:
            return batch, sampled, sampling
        pad = self.tokenizer.pad_token_id
        batch, sampled = (Batch.cat(gather(b, world), pad) for b in (batch, sampled))
        slowest = ("sampling_rounds", "time_generate", "time_score")
        sampling = {k: all_max(v, world) if k in slowest else all_sum(v, world) for k, v in sampling.items()}
        sampling["frac_zero_std_groups"] /= world.size  # every process holds the same number of groups
        return batch, sampled, sampling

    def _loss_mask(self, rollout: Rollout) -> torch.Tensor:
        """The tokens in the loss: the completions', less truncated completions when they are masked."""
        if self.config.mask_truncated_completions:
            return rollout.completion_mask * ~rollout.truncated.unsqueeze(1)
        return rollout.completion_mask

    def _reference_logprobs(self, rollout: Rollout) -> torch.Tensor | None:
        """π_ref's log-probs: the frozen copy's, the policy's with its LoRA adapter disabled, or None (β = 0)."""
        if self.config.beta == 0:
            return None
        if self.ref_model is not None:
            return self._frozen_logprobs(self.ref_model, rollout)
        with self.model.disable_adapter():
            return self._frozen_logprobs(self.model, rollout)

    @torch.no_grad()
    def _frozen_logprobs(self, model: torch.nn.Module, rollout: Rollout) -> torch.Tensor:
        was_training = model.training
        model.eval()
        chunks = []
        for idx in self._micro_batches(rollout):
            with self._autocast():
                logp, _ = sequence_logprobs(
                    model, rollout.prompt_ids[idx], rollout.prompt_mask[idx],
                    rollout.completion_ids[idx], rollout.completion_mask[idx],
                    temperature=self.config.temperature, fast=self.config.fast_path,
                )
            chunks.append(logp)
        model.train(was_training)
        return torch.cat(chunks)

    def _autocast(self):
        return autocast(self.config.mixed_precision, self.device)

    def _micro_batches(self, rollout: Rollout) -> list[slice]:
        n, size = rollout.completion_ids.shape[0], self.config.micro_batch_size
        return [slice(i, min(i + size, n)) for i in range(0, n, size)]

    def _optimize(self, rollout: Rollout, **tensors: torch.Tensor | None) -> tuple[dict, dict]:
        """μ passes over the batch, each one optimizer step per minibatch (``_update``); ``tensors``
        are per-completion and follow the minibatch. Returns the mean diagnostics of the first pass
        and of the last."""
        self.train_model.train()
        passes = []
        for iteration in range(self.config.num_iterations):
            stats = []
            for index in self._minibatches(rollout):
                picked = {k: None if t is None else t[index.to(t.device)] for k, t in tensors.items()}
                stats.append(self._update(rollout.select(index), **picked, with_entropy=iteration == 0))
            passes.append({key: sum(s[key] for s in stats) / len(stats) for key in stats[0]})
            passes[-1]["skipped_updates"] = sum(s["skipped_updates"] for s in stats)
        last = passes[-1]
        last["skipped_updates"] = sum(p["skipped_updates"] for p in passes)  # every skip of the step
        return passes[0], last

    def _minibatches(self, rollout: Rollout) -> list[torch.Tensor]:
        """Completion indices of each minibatch: a fresh shuffle per pass when there are several."""
        n, k = rollout.completion_ids.shape[0], self.config.num_minibatches
        if k == 1:
            return [torch.arange(n)]
        return list(torch.randperm(n, generator=self._shuffle).tensor_split(k))

    def _update(self, rollout, advantages, loss_mask, old_logp, ref_logp, *, with_entropy: bool) -> dict[str, float]:
        """One optimizer step on the (mini)batch."""
        stats = self.accumulate_gradients(
            rollout, advantages, old_logp, ref_logp, loss_mask=loss_mask, with_entropy=with_entropy
        )
        stats["lr"] = self.scheduler.get_last_lr()[0]
        stats["grad_norm"], stats["skipped_updates"] = self._step(
            self.model, self.optimizer, self.scheduler, stats["loss"]
        )
        return stats

    def _step(self, model, optimizer, scheduler, loss: float) -> tuple[float, int]:
        """Clip and apply the accumulated gradient; returns (grad norm, 1 if skipped else 0). A non-finite
        loss or gradient norm skips the step (weights, optimizer and schedule untouched) and, after
        ``max_nonfinite_updates`` in a row, stops training."""
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2: a DTensor
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite:
            optimizer.step()
            scheduler.step()
            self.nonfinite_streak = 0
        optimizer.zero_grad(set_to_none=True)
        if not finite:
            self.nonfinite_streak += 1
            if self.nonfinite_streak >= self.config.max_nonfinite_updates:
                raise TrainingError(
                    f"step {self.step + 1}: {self.nonfinite_streak} updates in a row had a non-finite loss or "
                    f"gradient norm (last: loss {loss}, grad norm {grad_norm}); stopped with the weights of the "
                    f"last good update (max_nonfinite_updates={self.config.max_nonfinite_updates})"
                )
        return grad_norm, int(not finite)

    def accumulate_gradients(
        self, rollout: Rollout, advantages: torch.Tensor, old_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None, *, loss_mask: torch.Tensor | None = None, with_entropy: bool = False,
    ) -> dict[str, float]:
        """Backward the GRPO loss of the whole batch, micro-batch by micro-batch, into ``.grad``.

        ``loss_mask`` (default: the completion mask) selects the tokens in the loss. Normalisers count
        over the whole batch, so each micro-batch's loss is its exact share of the batch loss and the
        gradient does not depend on ``micro_batch_size``. Returns the loss and the token-weighted means
        of the diagnostics.
        """
        config, world = self.config, self.world
        mask = rollout.completion_mask if loss_mask is None else loss_mask
        # Counts over the whole batch, every process's share included; completions left with no token
        # in the loss (masked truncations) are out of the batch.
        total_tokens = max(1.0, all_sum(float(mask.sum()), world))
        sequences = max(1.0, all_sum(float((mask.sum(dim=1) > 0).sum()), world))
        normalizer = total_tokens if config.aggregation == "token" else sequences
        totals: dict[str, float] = {"loss": 0.0}
        micro_batches = self._micro_batches(rollout)
        for k, idx in enumerate(micro_batches):
            with gradient_sync(self.train_model, enabled=k == len(micro_batches) - 1):
                with self._autocast():
                    logp, entropy = sequence_logprobs(
                        self.train_model, rollout.prompt_ids[idx], rollout.prompt_mask[idx],
                        rollout.completion_ids[idx], rollout.completion_mask[idx],
                        temperature=config.temperature, with_entropy=with_entropy, fast=config.fast_path,
                    )
                loss, stats = grpo_loss(
                    logp,
                    None if old_logp is None else old_logp[idx],
                    None if ref_logp is None else ref_logp[idx],
                    advantages[idx], mask[idx],
                    epsilon=config.epsilon, epsilon_high=config.epsilon_high, beta=self.loss_beta,
                    aggregation=config.aggregation, ratio_level=config.ratio_level,
                    max_completion_length=config.max_completion_length, kl_kind=config.kl_kind,
                    normalizer=normalizer,
                )
                (loss * world.size).backward()  # DDP averages over processes; the shares must add up
            totals["loss"] += loss.item()
            if entropy is not None:
                stats["entropy"] = masked_mean(entropy, mask[idx]).item()
            share = float(mask[idx].sum()) / total_tokens
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value * share
        return all_sum_dict(totals, world)  # shares of the whole batch: their sums are its totals and means

    # ---- metrics and logging ---------------------------------------------------------------------

    def _log(self, metrics: dict[str, float], batch: Batch, advantages: torch.Tensor) -> None:
        self.history.append(metrics)
        if not self.world.main:  # one process writes the run directory
            return
        if self.run_log is None:
            self._start_run_log()
        self.run_log.write(metrics, completion_records(
            self.step, batch, advantages, self.config.prompt_column, self.config.num_generations,
            self.config.log_completions,
        ))

    def _start_run_log(self) -> RunLog:
        config = self.config.to_dict()
        config["reward_funcs"] = [reward_name(fn) for fn in self.reward_funcs]
        self.run_log = RunLog(self.config.output_dir, tensorboard=self.config.tensorboard)
        self.run_log.start(config, self.history, self.step)
        return self.run_log

    def resume(self, which: str = "latest") -> Path:
        """Continue from a checkpoint (``"latest"`` under ``output_dir``, or a path), exactly."""
        path = find_checkpoint(self.config.output_dir, which)
        load_checkpoint(self, path)
        return path

    def checkpointed_modules(self) -> dict[str, torch.nn.Module]:
        """Trained modules a checkpoint holds besides the policy (PPO adds its value model)."""
        return {}

    def checkpointed_state(self) -> dict[str, Any]:
        """Objects with ``state_dict``/``load_state_dict`` a checkpoint holds."""
        return {"optimizer": self.optimizer, "scheduler": self.scheduler}

    def train(self) -> list[dict[str, float]]:
        """Run to ``max_steps`` (from the checkpoint when ``config.resume`` is set), writing a checkpoint
        every ``save_every`` steps, at the end, and on SIGINT/SIGTERM; then save the model and tokenizer
        to ``output_dir/model``."""
        config, world = self.config, self.world
        if config.resume:
            self.resume(config.resume)
        if world.main:
            self._start_run_log()
        bar = tqdm(range(self.step, config.max_steps), desc=config.algorithm.upper(),
                   disable=not (config.progress_bar and world.main), dynamic_ncols=True)
        saved_at = None
        with StopSignals() as signals:
            for _ in bar:
                metrics = self.training_step()
                postfix = {"reward": f"{metrics['reward']:.3f}", "kl": f"{metrics['kl']:.4f}"}
                if metrics.get("accuracy") is not None:
                    postfix["acc"] = f"{metrics['accuracy']:.2f}"
                bar.set_postfix(postfix)
                # Every process stops after the same step, whichever got the signal.
                stop = all_max(float(signals.received or 0), world)
                if config.save_every and self.step % config.save_every == 0 or stop:
                    saved_at = save_checkpoint(self)
                if stop:
                    raise TrainingInterrupted(
                        f"stopped by {signal.Signals(int(stop)).name} after step {self.step}; checkpoint "
                        f"{saved_at}; continue with --resume latest"
                    )
        if saved_at is None or not saved_at.name.endswith(f"{self.step:06d}"):
            save_checkpoint(self)
        self.save(Path(config.output_dir) / "model")
        return self.history

    def save(self, path: str | Path) -> None:
        """``save_pretrained`` (safetensors) for the model and the tokenizer, by the first process (every
        process calls it: a sharded model is gathered first)."""
        state = full_state_dict(self.model, self.world)
        if self.world.main:
            # a LoRA model saves its adapter alone (adapter_model.safetensors + adapter_config.json)
            self.model.save_pretrained(path, state_dict=None if self.config.lora_rank else state,
                                       safe_serialization=True)
            self.tokenizer.save_pretrained(path)
            if self.config.lora_rank and self.config.merge_lora:
                merged = Path(path).parent / "model_merged"
                copy.deepcopy(self.model).merge_and_unload().save_pretrained(merged, safe_serialization=True)
                self.tokenizer.save_pretrained(merged)


def build_trainer(config: GRPOConfig, **kwargs: Any) -> GRPOTrainer:
    """The trainer for ``config.algorithm``: the one place where GRPO and PPO part ways."""
    if config.algorithm == "ppo":
        from grpokit.ppo import PPOTrainer  # imports this module

        return PPOTrainer(config, **kwargs)
    return GRPOTrainer(config, **kwargs)
