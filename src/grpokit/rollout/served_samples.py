"""Token in, token out: an episode served over the API (several requests, each a prompt the agent built and the
tokens the policy sampled for it) becomes training samples made of exactly the tokens sampled, never re-tokenised
text (re-tokenising between turns silently changes what is trained: TRL #5213, prime-rl #1334, ART #726).

Where each request's prompt extends the one before it and that one's sampled tokens, token for token, the episode is
one sample: the first prompt, then every sampled turn and what came between the turns (tool output, the
environment's messages, the chat template's markup), that in-between context masked from the loss. Where one does
not (a template that re-renders an earlier turn, an agent that rewrote its history), each request is a sample of its
own: its prompt, its sampled tokens. :func:`episode_samples` says which it did, for the logs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MERGED, PER_TURN = "merged", "per_turn"


@dataclass(frozen=True)
class ServedTurn:
    """One request of an episode as the server recorded it: the prompt's token ids and the sampled ones, with
    their log-probs at the sampling temperature."""

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    logprobs: Sequence[float]


@dataclass(frozen=True)
class EpisodeSample:
    """A training sample: ``completion_ids`` follow ``prompt_ids``; ``loss_mask`` is 1 on the tokens the policy
    sampled, 0 on context put between turns; ``logprobs`` the sampling log-prob of each completion token (0.0 where
    masked)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]


def _checked(turns: Sequence[ServedTurn]) -> None:
    if not turns:
        raise ValueError("an episode with no request to the policy has no tokens to train")
    for i, turn in enumerate(turns):
        if len(turn.logprobs) != len(turn.completion_ids):
            raise ValueError(f"request {i} recorded {len(turn.completion_ids)} sampled tokens but "
                             f"{len(turn.logprobs)} log-probs")
        if not turn.prompt_ids:
            raise ValueError(f"request {i} has an empty prompt")


def extends(turns: Sequence[ServedTurn]) -> bool:
    """Whether each request's prompt begins with the previous request's prompt and sampled tokens."""
    for before, after in zip(turns, turns[1:]):
        history = [*before.prompt_ids, *before.completion_ids]
        if list(after.prompt_ids[: len(history)]) != history:
            return False
    return True


def episode_samples(turns: Sequence[ServedTurn]) -> tuple[list[EpisodeSample], str]:
    """The samples of one episode's ``turns`` (in the order they were served) and how they were made:
    ``"merged"`` (one sample) or ``"per_turn"`` (one per request).

    >>> turns = [ServedTurn([1, 2], [3, 4], [-0.5, -0.25]), ServedTurn([1, 2, 3, 4, 9], [5], [-1.0])]
    >>> samples, mode = episode_samples(turns)
    >>> mode, samples[0].completion_ids, samples[0].loss_mask
    ('merged', [3, 4, 9, 5], [1, 1, 0, 1])
    >>> episode_samples([turns[0], ServedTurn([1, 7], [5], [-1.0])])[1]
    'per_turn'
    """
    _checked(turns)
    if not extends(turns):
        return [EpisodeSample(list(t.prompt_ids), list(t.completion_ids), [1] * len(t.completion_ids),
                              list(t.logprobs)) for t in turns], PER_TURN
    completion, mask, logprobs = [], [], []
    seen = len(turns[0].prompt_ids)  # tokens of the conversation so far, prompt included
    for turn in turns:
        between = list(turn.prompt_ids[seen:])  # what the agent put after the previous sampled turn
        completion += between + list(turn.completion_ids)
        mask += [0] * len(between) + [1] * len(turn.completion_ids)
        logprobs += [0.0] * len(between) + list(turn.logprobs)
        seen = len(turn.prompt_ids) + len(turn.completion_ids)
    return [EpisodeSample(list(turns[0].prompt_ids), completion, mask, logprobs)], MERGED
