"""What a grpokit trainer does at each step of a benchmark run (``vs_trl.py``'s grpokit workers, its own front door
and the TRL one): the completions and prompts it samples, its step metrics, and the result record made of them."""

from __future__ import annotations

import resource


def recorded(trainer) -> dict:
    """What each step of grpokit's ``trainer`` samples (completion and prompt lengths, prompts) and reports."""
    seen = {"lengths": [], "prompt_lengths": [], "prompts": [], "records": []}
    real_sample, real_next, real_step = trainer.sampler.sample, trainer.sampler.next_indices, trainer.training_step

    def recorded_sample(*a, **k):
        batch, sampled, sampling = real_sample(*a, **k)
        seen["lengths"].append(batch.rollout.completion_mask.sum(dim=1).tolist())
        seen["prompt_lengths"].append(batch.rollout.prompt_mask.sum(dim=1).tolist())
        return batch, sampled, sampling

    def recorded_indices():
        indices = real_next()
        seen["prompts"].extend(trainer.sampler.rows[i]["prompt"] for i in indices)
        return indices

    def recorded_step():
        seen["records"].append(real_step())
        return seen["records"][-1]

    trainer.sampler.sample, trainer.sampler.next_indices, trainer.training_step = (
        recorded_sample, recorded_indices, recorded_step)
    return seen


def grpokit_result(job: dict, walls: list[float], seen: dict) -> dict:
    w = job["warmup"]
    records, walls, lengths, prompt_lengths = (seen["records"][w:], walls[w:], seen["lengths"][w:],
                                               seen["prompt_lengths"][w:])
    return {
        "step": walls, "generate": [m["time_generate"] for m in records],
        "score_and_reference": [m["time_score"] + m["time_frozen_logprobs"] for m in records],
        "update": [wall - m["time_generate"] - m["time_score"] - m["time_frozen_logprobs"]
                   for wall, m in zip(walls, records)],
        "completion_lengths": lengths, "prompt_lengths": prompt_lengths, "prompts": seen["prompts"],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
