"""What the server records of each request, per episode: the tokens in, the tokens out and their sampling
log-probabilities — what training consumes, never re-tokenised from text."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Turn:
    """One sampled choice of one request. ``completion_ids`` are exactly the tokens the policy sampled (its stop token
    included where it stopped), ``logp`` their log-probabilities at the sampling temperature (as the loss recomputes
    them), ``finish_reason`` OpenAI's (``stop``, ``length``, ``tool_calls``), ``kind`` ``chat`` or ``completion``."""

    kind: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logp: list[float]
    finish_reason: str
    request: int = 0  # the request's number, in order of arrival at the server
    choice: int = 0  # its index among the request's n choices
    # a chat request's messages as sent and the assistant message answered (an episode's transcript is built from
    # them); None for /v1/completions
    messages: list[dict] | None = None
    reply: dict | None = None

    @property
    def logprobs(self) -> list[float]:
        """``logp`` under the name :class:`grpokit.rollout.served_samples.ServedTurn` reads: a Turn is one, so an
        episode's turns go to :func:`~grpokit.rollout.served_samples.episode_samples` as they are."""
        return self.logp


@dataclass
class EpisodeLog:
    """Turns per episode (``None``: requests to the plain ``/v1`` base URL), each episode's in order of arrival.
    Written from the server's event loop, read from any thread."""

    _turns: dict[str | None, list[Turn]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, episode: str | None, turns: list[Turn]) -> None:
        with self._lock:
            held = self._turns.setdefault(episode, [])
            held.extend(turns)
            # a request answered before an earlier one of the same episode still goes after it
            held.sort(key=lambda turn: (turn.request, turn.choice))

    def turns(self, episode: str | None) -> list[Turn]:
        with self._lock:
            return list(self._turns.get(episode, []))

    def pop(self, episode: str | None) -> list[Turn]:
        with self._lock:
            return self._turns.pop(episode, [])

    def episodes(self) -> list[str | None]:
        with self._lock:
            return list(self._turns)
