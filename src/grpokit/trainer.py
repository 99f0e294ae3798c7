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
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm.auto import tqdm

from grpokit.config import GRPOConfig
from grpokit.data import DataError, check_columns, load_jsonl
from grpokit.models import BUILTIN, load_model_and_tokenizer, resolve_device, seed_everything
from grpokit.objective import group_advantages, grpo_loss, masked_mean, zero_variance_groups
from grpokit.rewards import required_columns, resolve_reward_functions, reward_name, score_completions
from grpokit.rollout import Rollout, generate, sequence_logprobs, stop_token_ids


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
        self.config = config
        seed_everything(config.seed)
        self.device = resolve_device(config.device)

        self.reward_funcs = resolve_reward_functions(reward_funcs or config.reward_funcs)
        names = [reward_name(fn) for fn in self.reward_funcs]
        if len(set(names)) != len(names):
            raise ValueError(f"reward_funcs: names must be unique, got {names}")
        self.reward_weights = config.reward_weights or [1.0] * len(self.reward_funcs)
        if len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(self.reward_weights)} values for {len(self.reward_funcs)} reward functions"
            )

        # Data and rewards are checked before the (possibly slow) model load.
        self.rows = self._load_rows(train_dataset)

        if model is None:
            model, tokenizer = load_model_and_tokenizer(config.model, config.seed, config.progress_bar)
        elif tokenizer is None:
            raise ValueError("a tokenizer is required when a model is passed")
        if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
            # The completion mask never looks at pad ids, so pad may safely equal EOS.
            tokenizer.pad_token = tokenizer.eos_token
        self.model, self.tokenizer = model.to(self.device), tokenizer
        self.stop_ids = stop_token_ids(self.model, tokenizer)

        self._check_prompt_lengths()

        # β = 0 turns the reference model off entirely: never created, never run (GRPO.md §3).
        self.ref_model = None
        if config.beta != 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)

        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2),
            weight_decay=config.weight_decay,
        )
        total_updates = config.max_steps * config.num_iterations
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor(total_updates))
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self._order: list[int] = []  # dataset indices left in this epoch
        self._epoch = 0
        self.step = 0
        self.history: list[dict[str, float]] = []

    # ---- set-up helpers --------------------------------------------------------------------------

    def _load_rows(self, train_dataset: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
        config = self.config
        if train_dataset is not None:
            rows, source = list(train_dataset), "train_dataset"
        elif config.dataset == BUILTIN:
            from grpokit.arithmetic import train_rows

            rows, source = train_rows(4096, config.seed), BUILTIN
        else:
            rows, source = load_jsonl(config.dataset), config.dataset
        needed = [config.prompt_column]
        for fn in self.reward_funcs:
            for column in required_columns(fn):
                column = config.answer_column if column == "answer" else column
                if column not in needed:
                    needed.append(column)
        check_columns(rows, needed, source=source)
        return rows

    def _check_prompt_lengths(self) -> None:
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if limit is None:
            return
        prompts = [row[self.config.prompt_column] for row in self.rows]
        lengths = [len(ids) for ids in self.tokenizer(prompts)["input_ids"]]
        for index, length in enumerate(lengths):
            if length + self.config.max_completion_length > limit:
                raise DataError(
                    f"row {index}: prompt of {length} tokens + max_completion_length "
                    f"{self.config.max_completion_length} exceeds the model's context of {limit} tokens"
                )

    def _lr_factor(self, total: int) -> Callable[[int], float]:
        warmup, schedule = self.config.warmup_steps, self.config.lr_schedule

        def factor(update: int) -> float:
            if update < warmup:
                return (update + 1) / warmup
            progress = (update - warmup) / max(1, total - warmup)
            if schedule == "linear":
                return max(0.0, 1.0 - progress)
            if schedule == "cosine":
                return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
            return 1.0

        return factor

    def _next_rows(self) -> list[dict[str, Any]]:
        """B rows, walking seeded permutations of the dataset without repeats within an epoch."""
        rows = []
        while len(rows) < self.config.prompts_per_step:
            if not self._order:
                order = list(range(len(self.rows)))
                random.Random(self.config.seed + self._epoch * 7919).shuffle(order)
                self._order, self._epoch = order, self._epoch + 1
            rows.append(self.rows[self._order.pop()])
        return rows

    def _tokenize_prompts(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        encoded = self.tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt")
        return encoded["input_ids"].to(self.device), encoded["attention_mask"].to(self.device)

    def _reward_columns(self, rows: list[dict[str, Any]]) -> dict[str, list]:
        """The rows' columns except the prompt, repeated G times; the answer column is ``answer``."""
        g, config = self.config.num_generations, self.config
        columns: dict[str, list] = {}
        for key in dict.fromkeys(key for row in rows for key in row):  # every column, in first-seen order
            if key == config.prompt_column:
                continue
            name = "answer" if key == config.answer_column else key
            columns[name] = [row.get(key) for row in rows for _ in range(g)]
        return columns

    # ---- the step --------------------------------------------------------------------------------

    def training_step(self) -> dict[str, float]:
        config, g = self.config, self.config.num_generations
        start = time.perf_counter()

        # 1. Sample G completions for each of B prompts from π_old (the current policy).
        rows = self._next_rows()
        prompts = [row[config.prompt_column] for row in rows]
        prompt_ids, prompt_mask = self._tokenize_prompts(prompts)
        self.model.eval()
        rollout = generate(
            self.model, prompt_ids, prompt_mask,
            num_generations=g, max_new_tokens=config.max_completion_length,
            temperature=config.temperature, top_p=config.top_p,
            eos_token_id=self.stop_ids, pad_token_id=self.tokenizer.pad_token_id,
            generator=self.generator,
        )
        generated = time.perf_counter()

        # 2. Score: weighted sum of the reward functions, each kept for logging.
        completions = rollout.decode(self.tokenizer)
        repeated_prompts = [p for p in prompts for _ in range(g)]
        rewards, per_function = score_completions(
            self.reward_funcs, self.reward_weights, repeated_prompts, completions, self._reward_columns(rows)
        )
        scored = time.perf_counter()

        # 3. Advantages relative to the group (§2). No value network.
        advantages = group_advantages(rewards, g, scale=config.scale_rewards).to(self.device)  # (N,)

        # 4. Log-probs that stay fixed during the update: π_ref, and π_old when μ > 1 (with μ = 1,
        #    π_old = π_θ and ratio = 1 in value, so no extra pass is needed: GRPO.md §1.4).
        ref_logp = self._frozen_logprobs(self.ref_model, rollout) if self.ref_model is not None else None
        old_logp = self._frozen_logprobs(self.model, rollout) if config.num_iterations > 1 else None
        frozen = time.perf_counter()

        # 5. μ optimizer steps over the batch, each accumulating gradients over micro-batches.
        self.model.train()
        for iteration in range(config.num_iterations):
            update = self._update(rollout, advantages, old_logp, ref_logp, with_entropy=iteration == 0)
            if iteration == 0:
                first_update = update
        updated = time.perf_counter()

        # 6. Metrics.
        self.step += 1
        metrics = self._metrics(rollout, rewards, per_function, first_update, update)
        metrics.update(
            time_generate=generated - start, time_score=scored - generated, time_frozen_logprobs=frozen - scored,
            time_update=updated - frozen, time_step=updated - start,
            tokens_per_sec=float(rollout.completion_mask.sum()) / (updated - start),
        )
        self._log(metrics, rows, completions, rewards, per_function, advantages)
        return metrics

    @torch.no_grad()
    def _frozen_logprobs(self, model: torch.nn.Module, rollout: Rollout) -> torch.Tensor:
        was_training = model.training
        model.eval()
        chunks = []
        for idx in self._micro_batches(rollout):
            logp, _ = sequence_logprobs(
                model, rollout.prompt_ids[idx], rollout.prompt_mask[idx],
                rollout.completion_ids[idx], rollout.completion_mask[idx],
                temperature=self.config.temperature,
            )
            chunks.append(logp)
        model.train(was_training)
        return torch.cat(chunks)

    def _micro_batches(self, rollout: Rollout) -> list[slice]:
        n, size = rollout.completion_ids.shape[0], self.config.micro_batch_size
        return [slice(i, min(i + size, n)) for i in range(0, n, size)]

    def _update(self, rollout, advantages, old_logp, ref_logp, *, with_entropy: bool) -> dict[str, float]:
        """One optimizer step on the whole batch."""
        stats = self.accumulate_gradients(rollout, advantages, old_logp, ref_logp, with_entropy=with_entropy)
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm > 0 else float("inf")
        stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        stats["lr"] = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return stats

    def accumulate_gradients(
        self, rollout: Rollout, advantages: torch.Tensor, old_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None, *, with_entropy: bool = False,
    ) -> dict[str, float]:
        """Backward the GRPO loss of the whole batch, micro-batch by micro-batch, into ``.grad``.

        Normalisers count over the whole batch, so each micro-batch's loss is its exact share of the
        batch loss and the gradient does not depend on ``micro_batch_size``. Returns the loss and the
        token-weighted means of the diagnostics.
        """
        config, mask = self.config, rollout.completion_mask
        total_tokens = float(mask.sum().clamp(min=1))
        normalizer = total_tokens if config.aggregation == "token" else mask.shape[0]
        totals: dict[str, float] = {"loss": 0.0}
        for idx in self._micro_batches(rollout):
            logp, entropy = sequence_logprobs(
                self.model, rollout.prompt_ids[idx], rollout.prompt_mask[idx],
                rollout.completion_ids[idx], mask[idx],
                temperature=config.temperature, with_entropy=with_entropy,
            )
            loss, stats = grpo_loss(
                logp,
                None if old_logp is None else old_logp[idx],
                None if ref_logp is None else ref_logp[idx],
                advantages[idx], mask[idx],
                epsilon=config.epsilon, epsilon_high=config.epsilon_high, beta=config.beta,
                aggregation=config.aggregation, ratio_level=config.ratio_level,
                max_completion_length=config.max_completion_length, kl_kind=config.kl_kind,
                normalizer=normalizer,
            )
            loss.backward()
            totals["loss"] += loss.item()
            if entropy is not None:
                stats["entropy"] = masked_mean(entropy, mask[idx]).item()
            share = float(mask[idx].sum()) / total_tokens
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value * share
        return totals

    # ---- metrics and logging ---------------------------------------------------------------------

    def _metrics(self, rollout, rewards, per_function, first_update, last_update) -> dict[str, float]:
        g = self.config.num_generations
        lengths = rollout.lengths.float()
        metrics: dict[str, float] = {
            "step": self.step,
            "reward": rewards.mean().item(),
            "reward_std": rewards.std().item(),
            "frac_zero_std_groups": zero_variance_groups(rewards, g).float().mean().item(),
        }
        for name, scores in per_function.items():
            applied = ~torch.isnan(scores)
            # None (JSON null) when the function applied to no completion of the batch
            metrics[f"rewards/{name}"] = scores[applied].mean().item() if applied.any() else None
            if name == "accuracy_reward":
                metrics["accuracy"] = metrics[f"rewards/{name}"]
            if name == "format_reward":
                metrics["format_rate"] = metrics[f"rewards/{name}"]
        metrics.update(
            completion_length_mean=lengths.mean().item(),
            completion_length_max=lengths.max().item(),
            completion_length_min=lengths.min().item(),
            truncated_frac=rollout.truncated.float().mean().item(),
            entropy=first_update["entropy"],
        )
        # Diagnostics of the last optimizer step (the only one when μ = 1).
        for key in ("loss", "kl", "clipfrac", "clipfrac_low", "clipfrac_high", "ratio_mean", "grad_norm", "lr"):
            metrics[key] = last_update[key]
        return metrics

    def _log(self, metrics, rows, completions, rewards, per_function, advantages) -> None:
        self.history.append(metrics)
        out = Path(self.config.output_dir)
        with (out / "metrics.jsonl").open("a") as handle:
            handle.write(json.dumps(metrics) + "\n")
        k = self.config.log_completions
        if k:
            g = self.config.num_generations
            with (out / "completions.jsonl").open("a") as handle:
                for i in range(min(k, len(completions))):
                    record = {
                        "step": self.step,
                        "prompt": rows[i // g][self.config.prompt_column],
                        "completion": completions[i],
                        "reward": rewards[i].item(),
                        "advantage": advantages[i].item(),
                        **{name: (None if math.isnan(s[i]) else s[i].item()) for name, s in per_function.items()},
                    }
                    handle.write(json.dumps(record) + "\n")

    def _start_run_dir(self) -> Path:
        out = Path(self.config.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        config = self.config.to_dict()
        config["reward_funcs"] = [reward_name(fn) for fn in self.reward_funcs]
        (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        for name in ("metrics.jsonl", "completions.jsonl"):
            (out / name).write_text("")
        return out

    def train(self) -> list[dict[str, float]]:
        """Run ``max_steps`` steps, then save the model and tokenizer to ``output_dir/model``."""
        config = self.config
        out = self._start_run_dir()
        bar = tqdm(range(config.max_steps), desc="GRPO", disable=not config.progress_bar, dynamic_ncols=True)
        for _ in bar:
            metrics = self.training_step()
            postfix = {"reward": f"{metrics['reward']:.3f}", "kl": f"{metrics['kl']:.4f}"}
            if metrics.get("accuracy") is not None:
                postfix["acc"] = f"{metrics['accuracy']:.2f}"
            bar.set_postfix(postfix)
        self.save(out / "model")
        return self.history

    def save(self, path: str | Path) -> None:
        """``save_pretrained`` (safetensors) for the model and the tokenizer."""
        self.model.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)
