"""What a run writes: each step's metrics (defined in docs/metrics.md) and the run directory —
``config.yaml``, ``metrics.jsonl`` (one line per step), ``completions.jsonl`` (sampled completions)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import torch
import yaml

from grpokit.config import ConfigError
from grpokit.sampling import Batch


def step_metrics(step: int, batch: Batch, sampled: Batch, sampling: dict[str, float], first_update: dict,
                 last_update: dict, clock: tuple[float, float, float, float]) -> dict[str, float]:
    """Rewards over every completion sampled this step (the policy's score, whatever dynamic sampling
    kept); lengths and loss diagnostics over the training batch; ``clock``: the times at which the step
    started, finished sampling, finished its frozen passes, and finished updating."""
    group_size = len(sampled.completions) // len(sampled.rows)
    rewards, lengths, rollout = sampled.rewards, batch.rollout.lengths.float(), batch.rollout
    metrics: dict[str, float] = {
        "step": step,
        "reward": rewards.mean().item(),
        "reward_std": rewards.std().item(),
    }
    for name, scores in sampled.per_function.items():
        applied = ~torch.isnan(scores)
        # None (JSON null) when the function applied to no completion of the batch
        metrics[f"rewards/{name}"] = scores[applied].mean().item() if applied.any() else None
        if name == "accuracy_reward":
            metrics["accuracy"] = metrics[f"rewards/{name}"]
        if name == "format_reward":
            metrics["format_rate"] = metrics[f"rewards/{name}"]
    scored = torch.stack([~torch.isnan(scores) for scores in sampled.per_function.values()]).any(dim=0)  # (N,)
    metrics.update(
        empty_frac=sum(not c.strip() for c in sampled.completions) / len(sampled.completions),
        unscored_groups=int((~scored.view(-1, group_size)).all(dim=1).sum()),
        completion_length_mean=lengths.mean().item(),
        completion_length_max=lengths.max().item(),
        completion_length_min=lengths.min().item(),
        truncated_frac=rollout.truncated.float().mean().item(),
        entropy=first_update["entropy"],
    )
    # Diagnostics of the last optimizer step (the only one when μ = 1).
    for key in ("loss", "kl", "clipfrac", "clipfrac_low", "clipfrac_high", "ratio_mean", "grad_norm", "lr",
                "skipped_updates"):
        metrics[key] = last_update[key]
    start, sampled_at, frozen, updated = clock
    metrics.update(sampling)
    metrics.update(
        time_frozen_logprobs=frozen - sampled_at, time_update=updated - frozen, time_step=updated - start,
        tokens_per_sec=float(rollout.completion_mask.sum()) / (updated - start),
    )
    return metrics


def completion_records(step: int, batch: Batch, advantages: torch.Tensor, prompt_column: str, group_size: int,
                       limit: int) -> list[dict[str, Any]]:
    """The first ``limit`` completions of the batch with their rewards, for completions.jsonl."""
    records = []
    for i in range(min(limit, len(batch.completions))):
        record = {
            "step": step,
            "prompt": batch.rows[i // group_size][prompt_column],
            "completion": batch.completions[i],
            "reward": batch.rewards[i].item(),
            # the first token's: for process supervision the sum of all its normalised steps
            "advantage": advantages[i, 0].item(),
            **{name: (None if math.isnan(s[i]) else s[i].item()) for name, s in batch.per_function.items()},
            # (token that ends the step, weighted reward); outcome supervision: one, at the last token
            "steps": [[end, reward] for end, reward in batch.steps[i]],
        }
        records.append(record)
    return records


class RunLog:
    """The run directory's files, and TensorBoard events when asked."""

    def __init__(self, output_dir: str | Path, tensorboard: bool = False):
        self.dir = Path(output_dir)
        self.writer = tensorboard_writer(self.dir / "tensorboard") if tensorboard else None

    def start(self, config: dict[str, Any], history: list[dict[str, float]], step: int) -> None:
        """Write config.yaml; start metrics.jsonl and completions.jsonl afresh, or, when resuming at
        ``step``, rewrite them up to it from ``history`` so that each step appears once."""
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        (self.dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in history))
        kept = []
        if step and (self.dir / "completions.jsonl").is_file():
            lines = (self.dir / "completions.jsonl").read_text().splitlines(keepends=True)
            kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
        (self.dir / "completions.jsonl").write_text("".join(kept))

    def write(self, metrics: dict[str, float], completions: list[dict[str, Any]]) -> None:
        with (self.dir / "metrics.jsonl").open("a") as handle:
            handle.write(json.dumps(metrics) + "\n")
        if self.writer is not None:
            for key, value in metrics.items():
                if key != "step" and value is not None:
                    self.writer.add_scalar(key, value, metrics["step"])
            self.writer.flush()
        if completions:
            with (self.dir / "completions.jsonl").open("a") as handle:
                handle.writelines(json.dumps(record) + "\n" for record in completions)


def check_tensorboard() -> None:
    """``tensorboard: true`` needs the tensorboard package; a ConfigError says how to install it."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("tensorboard: true needs the tensorboard package: pip install 'grpokit[tensorboard]'")


def tensorboard_writer(log_dir: Path) -> Any:
    check_tensorboard()
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(log_dir))
