"""TRL's GRPO evaluation: sample completions of each ``eval_dataset`` prompt with the policy as it is, score them with
the run's reward functions, and report the rewards and lengths under TRL's metric names with ``eval_`` before them
(``eval_reward``, ``eval_reward_std``, ``eval_rewards/NAME/mean``, ``eval_completions/mean_length``, ...).

It samples through the run's own engine and reward pipeline (``Sampler.generate_and_score``) with a generator of its
own, seeded from the step, so evaluating changes nothing the training run draws and a resumed run evaluates as an
uninterrupted one does. Every process evaluates every row (sharded models need every process to run the same passes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from grpokit.data import given_rows, render_prompt
from grpokit.rewards.calling import RewardLog
from grpokit.trl.convert import trl_metrics

EVAL_SEED = 1_000_003  # the eval generator's seed: seed × this + step (apart from every training stream)


def evaluate_rewards(trainer: Any, rows: Any, num_generations: int, prompts_per_round: int,
                     prefix: str = "eval") -> dict[str, float]:
    """TRL's evaluation metrics of grpokit's ``trainer`` (its policy after ``trainer.step`` steps) on ``rows`` (a
    ``datasets.Dataset`` or a list of dicts with the training set's prompt column), ``num_generations`` completions per
    prompt, sampled ``prompts_per_round`` prompts at a time."""
    config, sampler = trainer.config, trainer.sampler
    rows = given_rows(rows, "eval_dataset")
    if not rows:
        raise ValueError("eval_dataset is empty")
    render = dict(system_prompt=config.system_prompt, chat_template=config.chat_template,
                  tools=sampler.toolbox.prompt_tools())
    prompts = [render_prompt(trainer.tokenizer, row[config.prompt_column], **render) for row in rows]
    trainer.sync_engine()
    saved = sampler.config, sampler.rows, sampler.prompts, sampler.generator
    generator = torch.Generator(device=sampler.generator.device).manual_seed(config.seed * EVAL_SEED + trainer.step)
    sampler.config = dataclasses.replace(config, num_generations=num_generations)
    sampler.rows, sampler.prompts, sampler.generator = rows, prompts, generator
    try:
        stats: dict[str, float] = {}
        batches = [sampler.generate_and_score(list(range(start, min(start + prompts_per_round, len(rows)))), stats,
                                              trainer.step) for start in range(0, len(rows), prompts_per_round)]
    finally:
        sampler.config, sampler.rows, sampler.prompts, sampler.generator = saved
        trainer.engine.sleep()
    return {f"{prefix}_{key}": value for key, value in reward_metrics(batches, num_generations).items()}


def reward_metrics(batches: list[Any], num_generations: int) -> dict[str, float]:
    """The rewards and lengths of sampled batches (:class:`~grpokit.training.sampling.Batch`) as a training step
    reports them (docs/metrics.md), with TRL's names beside grpokit's."""
    rewards = torch.cat([b.rewards for b in batches]).float()
    lengths = torch.cat([b.rollout.model_mask.sum(dim=1) for b in batches]).float()
    truncated = torch.cat([b.rollout.truncated for b in batches]).float()
    metrics: dict[str, Any] = {
        "reward": rewards.mean().item(),
        "reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0,
        "frac_zero_std_groups": (rewards.view(-1, num_generations).std(dim=1) == 0).float().mean().item(),
        "completion_length_mean": lengths.mean().item(), "completion_length_min": lengths.min().item(),
        "completion_length_max": lengths.max().item(), "truncated_frac": truncated.mean().item(),
    }
    for name in batches[0].per_function:
        scores = torch.cat([b.per_function[name] for b in batches]).float()
        applied = ~torch.isnan(scores)
        metrics[f"rewards/{name}"] = scores[applied].mean().item() if applied.any() else None
        metrics[f"rewards/{name}/std"] = scores[applied].std().item() if applied.sum() > 1 else None
    metrics.update(RewardLog.merge([b.log for b in batches]).metric_means(metrics))  # reward functions' log_metric
    return {key: value for key, value in trl_metrics(metrics).items() if value is not None}
