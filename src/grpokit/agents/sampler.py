"""Steps 1–2 of the loop with an agent (docs/agents.md): the policy served over OpenAI's API for the round, the
agent's episodes run against it (``num_generations`` per row), and the tokens the server recorded made the
training samples, scored by what the agent returned (and by ``reward_funcs``, on each episode's transcript).

Everything else of a step — the data order, dynamic sampling, the advantages, the update — is the
:class:`~grpokit.training.sampling.Sampler`'s and the trainer's, on episodes where they would be on completions.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from grpokit.agents.calling import AgentError, agent_columns, agent_name
from grpokit.agents.runner import Episode, run_episodes
from grpokit.agents.samples import episode_rollout, transcript
from grpokit.config import ConfigError, GRPOConfig
from grpokit.data import row_place
from grpokit.rewards.calling import RewardLog, reward_name, score_completions
from grpokit.rollout.engines import Engine
from grpokit.rollout.served_samples import PER_TURN
from grpokit.serving import PolicyServer
from grpokit.serving.batcher import Sampling
from grpokit.training.distributed import SINGLE, World
from grpokit.training.sampling import Batch, Sampler


class AgentSampler(Sampler):
    """A :class:`~grpokit.training.sampling.Sampler` whose rounds are the agent's episodes. ``model``: the policy the
    engine samples from (the server reads its context length); ``source``: how messages name the rows."""

    def __init__(self, config: GRPOConfig, tokenizer: Any, rows: list[dict[str, Any]], agent: Callable,
                 reward_funcs: Sequence[Callable], model: torch.nn.Module, engine: Engine, device: torch.device,
                 world: World = SINGLE, source: str = "the dataset"):
        super().__init__(config, tokenizer, rows, [], reward_funcs, [], engine, device, world)
        self.agent, self.model, self.source = agent, model, source
        self.columns = agent_columns(agent, list(dict.fromkeys(k for row in rows for k in row)), source)
        self.names: list[str] | None = None  # the agent's reward names, fixed by the first episode
        self.weights: list[float] | None = None  # config.reward_weights over those names, then reward_funcs
        self.said: set[str] = set()
        self.episodes: list[Episode] = []  # the last round's, to inspect (the batch carries its own)

    def generate_and_score(self, indices: list[int], stats: dict[str, float] | None = None, step: int = 0) -> Batch:
        stats = {} if stats is None else stats
        config, g = self.config, self.config.num_generations
        start = time.perf_counter()
        rows = [self.rows[i] for i in indices]
        fixed = Sampling(temperature=config.temperature, top_p=config.top_p)
        with PolicyServer(self.model, self.tokenizer, engine=self.engine, fixed_sampling=fixed,
                          default_max_tokens=config.max_completion_length) as server:
            episodes = run_episodes(self.agent, rows, g, server, columns=self.columns,
                                    labels=[f"{row_place(self.rows[i], i)} of {self.source}" for i in indices],
                                    concurrency=config.agent_concurrency, timeout=config.agent_timeout)
        generated = time.perf_counter()
        asked = ", ".join(sorted(server.overridden)[:1])
        self.say_once("sampling", bool(asked), f"the agent's requests asked for other sampling settings ({asked}); "
                      f"training samples every request at the run's temperature={config.temperature}, "
                      f"top_p={config.top_p}, whose log-probs the loss recomputes")
        self.episodes = episodes
        rollout, episode_of, modes = episode_rollout(episodes, self.tokenizer.pad_token_id)
        self.say_once("per_turn", PER_TURN in modes, "a request of an agent episode did not extend the previous "
                      "request's prompt and sampled tokens, token for token (a chat template that re-renders earlier "
                      "turns, or history the agent rewrote), so such episodes are trained one sample per request "
                      "(metric agent_per_turn_episodes; completions.jsonl's 'samples')")

        # The agent's rewards, then reward_funcs on the transcripts, weighted by reward_weights in that order.
        agent_scores = self.agent_rewards(episodes)
        weights = self.reward_weights_for(list(agent_scores))
        per_function = dict(agent_scores)
        total = sum(w * s for w, s in zip(weights, agent_scores.values()))
        texts = [transcript(episode, self.tokenizer) for episode in episodes]
        completions = [text for _, text, _ in texts]
        log, errors = RewardLog(), []
        if self.reward_funcs:
            conversational = all(messages is not None for _, _, messages in texts)
            sampled = [rollout.completion_ids[episode_of == i][rollout.model_mask[episode_of == i].bool()].tolist()
                       for i in range(len(episodes))]
            funcs_total, scores = score_completions(
                self.reward_funcs, weights[len(agent_scores):], prompts=[p for p, _, _ in texts],
                completions=completions, columns=self.reward_columns(rows),
                messages=[m for _, _, m in texts] if conversational else None, completion_ids=sampled,
                trainer_state=self.reward_state(step),
                timeout=config.reward_timeout, on_error=config.on_reward_error, errors=errors, log=log)
            total = total + funcs_total
            per_function.update(scores)
        for key, value in (("time_generate", generated - start), ("time_score", time.perf_counter() - generated),
                           ("reward_errors", len(errors)), ("agent_episodes", len(episodes)),
                           ("agent_turns", sum(len(e.turns) for e in episodes)),
                           ("agent_per_turn_episodes", modes.count(PER_TURN))):
            stats[key] = stats.get(key, 0) + value
        steps = [[(0, reward)] for reward in total.tolist()]  # one outcome per episode
        return Batch(rows, rollout, completions, total, per_function, steps, None, log, episode_of=episode_of,
                     episodes=[(episode, mode) for episode, mode in zip(episodes, modes)])

    def agent_rewards(self, episodes: Sequence[Episode]) -> dict[str, torch.Tensor]:
        """name → (N,) the agent's rewards; every episode must name the same ones as the run's first did."""
        if self.names is None:
            self.names = list(episodes[0].rewards)
            clash = [name for name in self.names if name in {reward_name(fn) for fn in self.reward_funcs}]
            if clash:
                raise ConfigError(f"agent {agent_name(self.agent)!r} returns a reward named {clash[0]!r}, as a "
                                  "reward function in reward_funcs is named; rename one of them")
        for episode in episodes:
            if list(episode.rewards) != self.names:
                raise AgentError(f"agent {agent_name(self.agent)!r} returned rewards {list(episode.rewards)} in "
                                 f"episode {episode.id}, but {self.names} before; return the same names (in the same "
                                 "order) from every episode")
        return {name: torch.tensor([e.rewards[name] for e in episodes]) for name in self.names}

    def reward_weights_for(self, names: list[str]) -> list[float]:
        """reward_weights over the agent's reward names, then ``reward_funcs`` (1.0 each when not given)."""
        if self.weights is None:
            count = len(names) + len(self.reward_funcs)
            given = self.config.reward_weights
            own = getattr(self.agent, "reward_weights", None)  # an environment's agent brings its own
            if given is None and own is not None:
                given = [*own, *[1.0] * len(self.reward_funcs)]
            if given is not None and len(given) != count:
                listed = names + [reward_name(fn) for fn in self.reward_funcs]
                raise ConfigError(f"reward_weights has {len(given)} values, but the agent's rewards and reward_funcs "
                                  f"are {count}: {listed} (the agent's in the order it returns them, then "
                                  "reward_funcs)")
            self.weights = [1.0] * count if given is None else [float(w) for w in given]
        return self.weights

    def say_once(self, key: str, when: bool, message: str) -> None:
        if when and key not in self.said and self.world.main:
            print(f"note: {message}", file=sys.stderr)
        if when:
            self.said.add(key)
