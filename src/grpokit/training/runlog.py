"""What a run writes: each step's metrics (defined in docs/metrics.md) and the run directory —
``config.yaml``, ``metrics.jsonl`` (one line per step), ``completions.jsonl`` (sampled completions)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from grpokit.config import ConfigError
from grpokit.rewards.calling import RewardError
from grpokit.training.sampling import Batch


def step_metrics(step: int, batch: Batch, sampled: Batch, sampling: dict[str, float], first_update: dict,
                 last_update: dict, clock: tuple[float, float, float, float]) -> dict[str, float]:
    """Rewards over every completion sampled this step (the policy's score, whatever dynamic sampling
    kept); lengths and loss diagnostics over the training batch; ``clock``: the times at which the step
    started, finished sampling, finished its frozen passes, and finished updating."""
    group_size = len(sampled.completions) // len(sampled.rows)
    # lengths in the policy's own tokens (inserted tool results are not its output)
    rewards, lengths, rollout = sampled.rewards, batch.rollout.model_mask.sum(dim=1).float(), batch.rollout
    if batch.episode_of is not None:  # an agent episode's length: the tokens sampled over all its requests
        lengths = torch.zeros(len(batch.completions)).index_add_(0, batch.episode_of.cpu(), lengths.cpu())
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
    if sampled.tool_calls is not None:  # over every completion sampled, as the rewards
        calls = [len(c) for c in sampled.tool_calls]
        metrics.update(tool_call_rate=sum(n > 0 for n in calls) / len(calls), tool_calls_mean=sum(calls) / len(calls),
                       tool_result_tokens_mean=float(rollout.tool_mask.sum(dim=1).float().mean()))
    if sampled.log is not None:  # reward functions' log_metric
        metrics.update(sampled.log.metric_means(metrics))
    for key in ("sampler_kl", "is_weight_mean", "is_capped_frac"):  # rollout_precision's correction, if any
        if key in first_update:
            metrics[key] = first_update[key]
    # Diagnostics of the last optimizer step (the only one when μ = 1).
    for key in ("loss", "kl", "clipfrac", "clipfrac_low", "clipfrac_high", "ratio_mean", "grad_norm", "lr",
                "skipped_updates"):
        metrics[key] = last_update[key]
    start, sampled_at, frozen, updated = clock
    sampling = dict(sampling)
    if "code_tests_tests" in sampling:  # counts over every round and process, made a rate here
        passed, tests = sampling.pop("code_tests_passed"), sampling.pop("code_tests_tests")
        metrics["code_tests_pass_rate"] = passed / tests if tests else None
    metrics.update(sampling)
    if "frac_zero_std_groups" in sampling:  # the same share, said as what the step can learn from
        metrics["frac_signal_groups"] = 1 - sampling["frac_zero_std_groups"]
    metrics.update(
        time_frozen_logprobs=frozen - sampled_at, time_update=updated - frozen, time_step=updated - start,
        tokens_per_sec=float(rollout.completion_mask.sum()) / (updated - start),
    )
    return metrics


def silent_rewards(metrics: dict[str, Any], first_step: bool) -> list[str]:
    """The reward functions that returned None ("not applicable") for every completion of a step (their
    ``rewards/NAME`` metric is None), which gave the step no signal. On the first step a run takes, every function
    silent is an error naming them: no completion has a reward, so every advantage is 0 and the step teaches nothing,
    as every later one would where the functions always return None (a mistake this catches at step 1)."""
    names = [key.removeprefix("rewards/") for key in metrics if key.startswith("rewards/")]
    silent = [name for name in names if metrics[f"rewards/{name}"] is None]
    if first_step and silent and silent == names:
        raise RewardError(
            f"step {metrics['step']}: every reward function ({', '.join(silent)}) returned None for every completion, "
            "so no completion has a reward and the run cannot learn; None means 'not applicable': return a number "
            "(e.g. 0.0 for a wrong answer) for the completions a reward applies to"
        )
    return silent


def warn_of_silent_rewards(metrics: dict[str, Any], said: set[str], first_step: bool, say: bool = True) -> None:
    """Say (where ``say``: the main process), once per function (``said`` holds those said), when a reward function
    returned None for every completion of a step: it gave the step no signal. On the run's first step
    :func:`silent_rewards` stops the run where every function did so."""
    for name in silent_rewards(metrics, first_step=first_step):
        if name not in said and say:
            print(f"warning: reward function {name!r} returned None ('not applicable') for every completion of "
                  f"step {metrics['step']}, so it gave the step no signal (said once per function; its "
                  f"metric rewards/{name} is null on such steps)", file=sys.stderr)
        said.add(name)


def completion_records(step: int, batch: Batch, advantages: torch.Tensor, prompt_column: str, group_size: int,
                       limit: int) -> list[dict[str, Any]]:
    """The first ``limit`` completions of the batch with their rewards, for completions.jsonl (with an agent: its
    episodes, :func:`episode_records`)."""
    if batch.episodes is not None:
        return episode_records(step, batch, advantages, prompt_column, group_size, limit)
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
        if batch.log is not None and batch.log.extra:  # reward functions' log_extra columns
            record["extra"] = {column: values[i] for column, values in batch.log.extra.items()}
        if batch.tool_calls is not None:
            record["tool_calls"] = [{"name": c.name, "arguments": c.arguments, "result": c.result, "failed": c.failed}
                                    for c in batch.tool_calls[i]]
        records.append(record)
    return records


def episode_records(step: int, batch: Batch, advantages: torch.Tensor, prompt_column: str, group_size: int,
                    limit: int) -> list[dict[str, Any]]:
    """One record per agent episode: its reward and named rewards, its advantage, its transcript (``completion``; a
    chat episode's ``messages``), how it was trained (``samples``: merged or per_turn) and each request it made, with
    the token counts the server recorded."""
    records = []
    first_sample = {}  # episode → its first sample's row, which carries the episode's advantage
    for row, episode in enumerate(batch.episode_of.tolist()):
        first_sample.setdefault(episode, row)
    for i in range(min(limit, len(batch.completions))):
        episode, mode = batch.episodes[i]
        turns = episode.turns
        record = {
            "step": step, "episode": episode.id, "prompt": batch.rows[i // group_size].get(prompt_column),
            "completion": batch.completions[i], "reward": batch.rewards[i].item(),
            "advantage": advantages[first_sample[i], 0].item(),
            **{name: (None if math.isnan(s[i]) else s[i].item()) for name, s in batch.per_function.items()},
            "samples": mode, "seconds": round(episode.seconds, 3),
            "turns": [{"kind": t.kind, "prompt_tokens": len(t.prompt_ids), "completion_tokens": len(t.completion_ids),
                       "finish_reason": t.finish_reason} for t in turns],
        }
        if all(t.messages is not None for t in turns):
            record["messages"] = [*turns[-1].messages, turns[-1].reply]
        if batch.log is not None and batch.log.extra:
            record["extra"] = {column: values[i] for column, values in batch.log.extra.items()}
        records.append(record)
    return records


class RunLog:
    """The run directory's files, and the trackers of ``report_to`` (:func:`start_tracker`)."""

    def __init__(self, output_dir: str | Path, trackers: Sequence[str] = ()):
        self.dir = Path(output_dir)
        self.tracker_names = list(trackers)
        self.trackers: list[Any] = []

    def start(self, config: dict[str, Any], history: list[dict[str, float]], step: int,
              notes: Sequence[str] = ()) -> None:
        """Write config.yaml (``notes`` atop it as comments: what was decided at start-up, e.g. the precision
        'auto' chose; the file stays a config that ``grpokit train`` reads); start metrics.jsonl and
        completions.jsonl afresh, or, when resuming at ``step``, rewrite them up to it from ``history`` so that
        each step appears once; start each tracker's run (a resumed run is a new tracker run from ``step`` on).
        Called once the run may write ``output_dir`` (:func:`grpokit.training.run_dir.claim`): nothing of another
        run is truncated here."""
        self.dir.mkdir(parents=True, exist_ok=True)
        header = "".join(f"# {line}\n" for note in notes for line in note.splitlines())
        (self.dir / "config.yaml").write_text(header + yaml.safe_dump(config, sort_keys=False))
        (self.dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in history))
        kept = []
        if step and (self.dir / "completions.jsonl").is_file():
            lines = (self.dir / "completions.jsonl").read_text().splitlines(keepends=True)
            kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
        (self.dir / "completions.jsonl").write_text("".join(kept))
        self.finish()
        self.trackers = [start_tracker(name, self.dir, config) for name in self.tracker_names]

    def write(self, metrics: dict[str, float], completions: list[dict[str, Any]]) -> None:
        with (self.dir / "metrics.jsonl").open("a") as handle:
            handle.write(json.dumps(metrics) + "\n")
        # The trackers take numbers, under the step number (metrics that did not apply this step are None).
        scalars = {key: value for key, value in metrics.items() if key != "step" and value is not None}
        for tracker in self.trackers:
            tracker.log(scalars, int(metrics["step"]))
        if completions:
            with (self.dir / "completions.jsonl").open("a") as handle:
                handle.writelines(json.dumps(record) + "\n" for record in completions)

    def finish(self) -> None:
        """End the trackers' runs (flushing what they buffer)."""
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []


# The package each tracker of `report_to` (config.TRACKERS) needs, installed by the extra of the same name.
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}


def check_trackers(names: Sequence[str]) -> None:
    """Every tracker in ``names`` is known and its package installed; a ConfigError names the pip install.
    Called at start-up, before the model loads."""
    for name in names:
        if name not in TRACKER_PACKAGES:
            raise ConfigError(f"report_to: {name!r} is not a tracker; choose from {', '.join(TRACKER_PACKAGES)}")
        if importlib.util.find_spec(TRACKER_PACKAGES[name]) is None:
            raise ConfigError(f"report_to: {name} needs the {TRACKER_PACKAGES[name]} package: "
                              f"pip install 'grpokit[{name}]'")


def start_tracker(name: str, output_dir: Path, config: dict[str, Any]) -> Any:
    """A started tracker run with ``log(metrics, step)`` and ``finish()``, the config logged. Its project is
    ``config["project"]``, its run name ``config["run_name"]`` or else the output directory's name."""
    check_trackers([name])
    project, run_name = config.get("project") or "grpokit", config.get("run_name") or output_dir.resolve().name
    if name == "tensorboard":
        return TensorBoardTracker(output_dir / "tensorboard", config)
    elif name == "wandb":
        return WandbTracker(output_dir, config, project, run_name)
    elif name == "trackio":
        return TrackioTracker(config, project, run_name)
    raise ValueError(f"unknown tracker {name!r}; choose from {', '.join(TRACKER_PACKAGES)}")


class TensorBoardTracker:
    """Event files in ``log_dir`` (TensorBoard's scalars; the config as a text entry)."""

    def __init__(self, log_dir: Path, config: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))
        self.writer.add_text("config", "    " + yaml.safe_dump(config, sort_keys=False).replace("\n", "\n    "))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class WandbTracker:
    """A Weights & Biases run, its files under ``output_dir/wandb`` (``WANDB_MODE=offline``: only there)."""

    def __init__(self, output_dir: Path, config: dict[str, Any], project: str, run_name: str):
        import wandb

        self.run = wandb.init(project=project, name=run_name, dir=str(output_dir), config=config)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        self.run.finish()


class TrackioTracker:
    """A trackio run: a local SQLite database under ``$TRACKIO_DIR`` (default ``~/.cache/huggingface/trackio``;
    ``trackio show`` opens its dashboard), or a Hugging Face Space where ``TRACKIO_SPACE_ID`` says so."""

    def __init__(self, config: dict[str, Any], project: str, run_name: str):
        import trackio

        self.run = trackio.init(project=project, name=run_name, config=config, embed=False)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        self.run.finish()
