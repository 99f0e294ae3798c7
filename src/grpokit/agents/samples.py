"""A round's finished episodes as a training rollout, token in, token out (docs/agents.md): each episode's samples
(:func:`~grpokit.rollout.served_samples.episode_samples`: one merged sample, or one per request) stacked into one
:class:`~grpokit.rollout.generate.Rollout` whose rows are samples, ``episode_of`` naming each one's episode. What the
agent put between turns is in ``tool_mask`` (context: no loss, no KL); the sampled tokens keep the log-probs they
were sampled with. And each episode's transcript, as reward functions read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from grpokit.agents.runner import Episode
from grpokit.rollout.generate import Rollout
from grpokit.rollout.served_samples import PER_TURN, episode_samples


def episode_rollout(episodes: Sequence[Episode], pad_id: int) -> tuple[Rollout, torch.Tensor, list[str]]:
    """``(rollout, episode_of, modes)``: the samples of ``episodes`` (M ≥ N rows: prompts left-padded, completions
    right-padded), each sample's episode index (M,), and each episode's mode (``merged`` or ``per_turn``)."""
    samples, owners, cut, modes = [], [], [], []
    for index, episode in enumerate(episodes):
        made, mode = episode_samples(episode.turns)
        modes.append(mode)
        # a sample is cut where its last request stopped for length: per turn, its own; merged, the episode's last
        reasons = [turn.finish_reason for turn in episode.turns] if mode == PER_TURN else \
            [episode.turns[-1].finish_reason]
        samples += made
        owners += [index] * len(made)
        cut += [reason == "length" for reason in reasons]
    m = len(samples)
    width_p = max(len(s.prompt_ids) for s in samples)
    width_c = max(len(s.completion_ids) for s in samples)
    prompt_ids = torch.full((m, width_p), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros(m, width_p, dtype=torch.long)
    completion_ids = torch.full((m, width_c), pad_id, dtype=torch.long)
    completion_mask = torch.zeros(m, width_c, dtype=torch.long)
    context = torch.zeros(m, width_c, dtype=torch.long)
    logp = torch.zeros(m, width_c, dtype=torch.float32)
    for row, sample in enumerate(samples):
        p, c = len(sample.prompt_ids), len(sample.completion_ids)
        prompt_ids[row, width_p - p:] = torch.tensor(sample.prompt_ids)
        prompt_mask[row, width_p - p:] = 1
        completion_ids[row, :c] = torch.tensor(sample.completion_ids)
        completion_mask[row, :c] = 1
        context[row, :c] = 1 - torch.tensor(sample.loss_mask)
        logp[row, :c] = torch.tensor(sample.logprobs, dtype=torch.float32)
    rollout = Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, logp, torch.tensor(cut),
                      tool_mask=context)
    return rollout, torch.tensor(owners, dtype=torch.long), modes


def transcript(episode: Episode, tokenizer: Any) -> tuple[Any, str, list[dict[str, Any]] | None]:
    """``(prompt, completion, messages)`` of an episode as reward functions read it (TRL's conventions): an episode
    of chat requests has its first request's messages as the prompt and, as ``messages``, everything after them in
    its last request and the last reply (the assistant's turns, tool results, what the agent added); its completion
    text is the assistant's turns joined. Otherwise the prompt is the first request's text and the completion the
    sampled text of every request, in order (``messages`` None)."""
    first, last = episode.turns[0], episode.turns[-1]
    if all(turn.messages is not None for turn in episode.turns):
        messages = [*last.messages[len(first.messages):], last.reply]
        text = "\n".join(m.get("content") or "" for m in messages if m.get("role") == "assistant")
        return first.messages, text, messages
    prompt = tokenizer.decode(first.prompt_ids, skip_special_tokens=True)
    text = "".join(tokenizer.decode(turn.completion_ids, skip_special_tokens=True) for turn in episode.turns)
    return prompt, text, None
