"""Steps 1–3 of the loop (docs/math.md, "One step"): B prompts from the data, G completions each, their
rewards, and the group-relative advantages — with dynamic sampling when asked.

``Sampler`` owns what decides *which* completions a step trains on: the data order, the sampling
generator, the reward functions. The trainer owns the models and the update.

Every completion's reward arrives as steps ``(token that ends the step, reward)``: with outcome
supervision one step, the whole reward at the completion's last token; with process supervision the
reward functions' steps. Both then take one path to the advantages (:func:`group_relative_advantages`).

Outside a run, ``grpokit sample``, ``bootstrap`` and ``eval`` draw their completions from
:func:`grpokit.from_config.sampling_engine`: the engine, tokenizer and tools that a run with the same config samples
with.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grpokit.config import GRPOConfig
from grpokit.core.objective import process_advantages, zero_variance_groups
from grpokit.core.offsets import step_token_ends
from grpokit.data import reward_columns
from grpokit.rewards.calling import RewardError, RewardLog, TrainerState, reward_name, score_completions, score_steps
from grpokit.rewards.code import code_counts
from grpokit.rewards.learned import OutcomeRewardModel, ProcessRewardModel
from grpokit.rollout.engines import Engine
from grpokit.rollout.generate import Rollout
from grpokit.rollout.tools import ToolBox, ToolUse
from grpokit.training.distributed import SINGLE, World, all_max, all_sum, gather


@dataclass
class Batch:
    """B groups of G sampled completions with their rewards; each group's G rows contiguous."""

    rows: list[dict[str, Any]]  # B dataset rows
    rollout: Rollout  # N = B × G completions
    completions: list[str]  # N decoded completions
    rewards: torch.Tensor  # (N,) weighted total reward (for process supervision: of the per-function means)
    per_function: dict[str, torch.Tensor]  # name → (N,) raw scores, NaN where the function returned None
    steps: list[list[tuple[int, float]]]  # per completion: (token that ends a step, its weighted reward)
    tool_calls: list[list[ToolUse]] | None = None  # per completion, its tool calls in order (None: without tools)
    log: RewardLog | None = None  # what the reward functions logged (TRL's log_metric, log_extra)
    # Agent episodes (grpokit.agents): the N "completions" are episodes, the rollout's M rows their training samples
    # (one per episode, or one per request), episode_of (M,) each sample's episode; episodes: (Episode, mode) each.
    episode_of: torch.Tensor | None = None
    episodes: list | None = None

    def groups(self, index: torch.Tensor, group_size: int) -> Batch:
        """The groups at ``index`` (a bool mask or indices over B)."""
        index = torch.arange(len(self.rows))[index]
        rows = (index.unsqueeze(1) * group_size + torch.arange(group_size)).view(-1)  # their completions
        samples, episode_of = rows, None
        if self.episode_of is not None:  # the kept episodes' samples, renumbered
            renumber = torch.full((len(self.completions),), -1, dtype=torch.long)
            renumber[rows] = torch.arange(len(rows))
            samples = (renumber[self.episode_of] >= 0).nonzero().squeeze(1)
            episode_of = renumber[self.episode_of[samples]]
        return Batch(
            rows=[self.rows[i] for i in index.tolist()],
            rollout=self.rollout.select(samples.to(self.rollout.completion_ids.device)),
            completions=[self.completions[i] for i in rows.tolist()],
            rewards=self.rewards[rows],
            per_function={name: scores[rows] for name, scores in self.per_function.items()},
            steps=[self.steps[i] for i in rows.tolist()],
            tool_calls=None if self.tool_calls is None else [self.tool_calls[i] for i in rows.tolist()],
            log=None if self.log is None else RewardLog(self.log.metrics, {
                column: [values[i] for i in rows.tolist() if i < len(values)] for column, values in
                self.log.extra.items()}),
            episode_of=episode_of,
            episodes=None if self.episodes is None else [self.episodes[i] for i in rows.tolist()],
        )

    @staticmethod
    def cat(batches: list[Batch], pad_token_id: int) -> Batch:
        return Batch(
            rows=[row for b in batches for row in b.rows],
            rollout=Rollout.cat([b.rollout for b in batches], pad_token_id),
            completions=[c for b in batches for c in b.completions],
            rewards=torch.cat([b.rewards for b in batches]),
            per_function={name: torch.cat([b.per_function[name] for b in batches]) for name in batches[0].per_function},
            steps=[s for b in batches for s in b.steps],
            tool_calls=None if batches[0].tool_calls is None else [c for b in batches for c in b.tool_calls],
            log=RewardLog.merge([b.log for b in batches]),
            episode_of=None if batches[0].episode_of is None else torch.cat(
                [b.episode_of + sum(len(a.completions) for a in batches[:k]) for k, b in enumerate(batches)]),
            episodes=None if batches[0].episodes is None else [e for b in batches for e in b.episodes],
        )


def group_relative_advantages(batch: Batch, group_size: int, scale: str, world: World = SINGLE) -> torch.Tensor:
    """(N, T) advantages from the batch's steps (docs/math.md, "Advantages"): with one step per completion
    these are :func:`~grpokit.core.objective.group_advantages` on every token. With ``scale="batch"`` over
    several processes, the std is that of the whole batch's step rewards (a collective: every process
    calls it)."""
    batch_std = None
    if scale == "batch" and world.distributed:
        pooled = [reward for steps in batch.steps for _, reward in steps]
        everything = torch.tensor([r for part in gather(pooled, world) for r in part])
        batch_std = everything.std().item() if everything.numel() > 1 else 0.0
    episodes = batch.episode_of is not None  # one outcome per episode, carried by each of its samples' tokens
    mask = torch.ones(len(batch.steps), 1) if episodes else batch.rollout.completion_mask
    advantages = process_advantages(
        [[reward for _, reward in steps] for steps in batch.steps],
        [[end for end, _ in steps] for steps in batch.steps],
        mask, group_size, scale=scale, batch_std=batch_std,
    )
    if episodes:
        mask = batch.rollout.completion_mask
        return advantages.to(mask.device)[batch.episode_of.to(mask.device)] * mask
    return advantages


def whole_batches(batch: Batch, sampled: Batch, sampling: dict[str, float], world: World,
                  pad_token_id: int) -> tuple[Batch, Batch, dict[str, float]]:
    """A step's batches and sampling counts over all processes (as they are, in a world of one)."""
    if not world.distributed:
        return batch, sampled, sampling
    batch, sampled = (Batch.cat(gather(b, world), pad_token_id) for b in (batch, sampled))
    slowest = ("sampling_rounds", "time_generate", "time_score", "time_sandbox")
    sampling = {k: all_max(v, world) if k in slowest else all_sum(v, world) for k, v in sampling.items()}
    sampling["frac_zero_std_groups"] /= world.size  # every process holds the same number of groups
    return batch, sampled, sampling


def signal_weights(spread: dict[int, float], size: int, floor: float) -> torch.Tensor:
    """(size,) draw weights for ``prompt_sampling: signal``: ``floor + (1 - floor) · s / s_max`` from each
    prompt's reward spread ``s`` (``spread``: dataset index → spread so far), a prompt not yet seen
    counting as the most spread; all 1 while no spread is above 0.

    >>> signal_weights({0: 0.5, 1: 0.0}, 3, 0.1).tolist()
    [1.0, 0.10000000149011612, 1.0]
    """
    weights = torch.ones(size)
    top = max(spread.values(), default=0.0)
    if top > 0:
        weights[list(spread)] = floor + (1 - floor) * torch.tensor(list(spread.values())) / top
    return weights


class Sampler:
    """Samples and scores the groups of each step. ``rows``: the dataset; ``prompts``: each row's prompt
    as the model reads it (:func:`render_prompt`); ``engine``: what draws the completions
    (:mod:`grpokit.rollout.engines`, built from the run's config); ``device``: where the sampling generator lives;
    ``toolbox``: the tools completions may call (the empty box: none)."""

    def __init__(
        self, config: GRPOConfig, tokenizer: Any, rows: list[dict[str, Any]], prompts: list[str],
        reward_funcs: Sequence[Callable], reward_weights: Sequence[float], engine: Engine,
        device: torch.device, world: World = SINGLE, toolbox: ToolBox = ToolBox.NONE,
    ):
        self.config, self.tokenizer, self.rows, self.prompts, self.device = config, tokenizer, rows, prompts, device
        self.reward_funcs, self.reward_weights, self.engine = reward_funcs, reward_weights, engine
        self.world, self.toolbox = world, toolbox
        # Each process samples with its own stream (docs/distributed.md); one process: seeded by `seed`.
        self.generator = torch.Generator(device=device).manual_seed(config.seed + 1000 * world.rank)
        self.order: list[int] = []  # dataset indices left in this epoch (the same on every process)
        self.epoch = 0
        # What reward functions get as ``trainer_state`` (given the step); None: a :class:`TrainerState`. A front end
        # may give its own (grpokit.trl: the transformers TrainerState its callbacks see).
        self.trainer_state: Callable[[int], Any] | None = None
        self.groups_per_process = config.prompts_per_step // world.size
        # prompt_sampling 'signal': dataset index → its reward spread so far, and the draws made (both the
        # same on every process, which draw the same B prompts and each take their share).
        self.spread: dict[int, float] = {}
        self.draws = 0

    def next_indices(self) -> list[int]:
        """This process's share of the next B rows (all of them in a world of one): with ``prompt_sampling``
        'uniform', walking seeded permutations of the dataset without repeats within an epoch; 'in_order', the
        dataset's order; with 'signal', drawn without repeats by :func:`signal_weights`."""
        indices: list[int] = []
        if self.config.prompt_sampling == "signal":
            weights = signal_weights(self.spread, len(self.rows), self.config.prompt_sampling_floor)
        while self.config.prompt_sampling == "signal" and len(indices) < self.config.prompts_per_step:
            left = weights.clone()
            left[indices] = 0  # no prompt twice in a step
            if not left.any():  # unless the dataset is smaller than B
                left = weights
            generator = torch.Generator().manual_seed(self.config.seed * 7919 + self.draws)
            self.draws += 1
            take = min(self.config.prompts_per_step - len(indices), int((left > 0).sum()))
            indices += torch.multinomial(left, take, replacement=False, generator=generator).tolist()
        while len(indices) < self.config.prompts_per_step:
            if not self.order:
                order = list(range(len(self.rows)))
                if self.config.prompt_sampling == "uniform":
                    random.Random(self.config.seed + self.epoch * 7919).shuffle(order)
                else:  # in_order: popped from the end, the first row first
                    order.reverse()
                self.order, self.epoch = order, self.epoch + 1
            indices.append(self.order.pop())
        start = self.world.rank * self.groups_per_process
        return indices[start : start + self.groups_per_process]

    def tokenize_prompts(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        encoded = self.tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt")
        return encoded["input_ids"].to(self.device), encoded["attention_mask"].to(self.device)

    def reward_columns(self, rows: list[dict[str, Any]]) -> dict[str, list]:
        """Every column of the rows but the prompt, under its own name and repeated G times; the answer
        column also as ``answer`` (:func:`~grpokit.data.reward_column_names`)."""
        config = self.config
        return reward_columns(rows, config.prompt_column, config.answer_column, config.num_generations)

    def sample(self, step: int = 0) -> tuple[Batch, Batch, dict[str, float]]:
        """The step's training batch of B groups, every group sampled this step, and sampling metrics;
        ``step``: optimizer steps done so far (reward functions' ``trainer_state.global_step``).

        Without dynamic sampling both batches are one round of B prompts. With it, groups whose
        advantages are all 0 are dropped and rounds of B more prompts are sampled until B groups carry
        signal or ``max_sampling_rounds`` is reached; then the batch is filled with dropped groups.
        """
        config, b, g = self.config, self.groups_per_process, self.config.num_generations
        rounds, no_signal, drawn, stats = [], [], [], {}
        while True:
            drawn += self.next_indices()
            batch = self.generate_and_score(drawn[-b:], stats, step)
            rounds.append(batch)
            no_signal.append(self.no_signal_groups(batch))
            with_signal = int(sum((~mask).sum() for mask in no_signal))
            if not config.dynamic_sampling or len(rounds) == config.max_sampling_rounds:
                break
            # Every process samples as many rounds (one still short keeps all of them drawing), so that
            # they keep drawing the same prompts and their shares stay apart.
            if all_sum(float(with_signal < b), self.world) == 0:
                break
        sampled, no_signal = Batch.cat(rounds, self.tokenizer.pad_token_id), torch.cat(no_signal)
        if config.prompt_sampling == "signal":
            self.observe_spread(drawn, sampled.rewards.view(-1, g))
        stats.update(frac_zero_std_groups=no_signal.float().mean().item(), sampling_rounds=len(rounds))
        if not config.dynamic_sampling:
            return batch, batch, {**stats, "dropped_groups": 0, "refilled_groups": 0}
        # The first B groups with signal, then (if the rounds ran out) the first without.
        refill = max(0, b - with_signal)
        index = torch.cat([(~no_signal).nonzero().squeeze(1)[:b], no_signal.nonzero().squeeze(1)[:refill]])
        stats.update(dropped_groups=int(no_signal.sum()) - refill, refilled_groups=refill)
        return sampled.groups(index, g), sampled, stats

    def generate_and_score(self, indices: list[int], stats: dict[str, float] | None = None, step: int = 0) -> Batch:
        """Sample and score one round of the dataset rows at ``indices``; add its seconds, its reward
        errors, the completions each reward model cut to its context and the code rewards' counts to ``stats``.
        ``step``: as in :meth:`sample`."""
        stats = {} if stats is None else stats
        config, g = self.config, self.config.num_generations
        start = time.perf_counter()
        rows, prompts = [self.rows[i] for i in indices], [self.prompts[i] for i in indices]
        tools = self.toolbox.session(rows, g, config.max_completion_length, config.prompt_column)
        # Environments whose resets give observations: each completion's own prompt, one generation each.
        prompts, repeats = tools.sample_prompts(prompts, g)
        prompt_ids, prompt_mask = self.tokenize_prompts(prompts)
        rollout = self.engine.generate(prompt_ids, prompt_mask, num_generations=repeats,
                                       max_new_tokens=config.max_completion_length, temperature=config.temperature,
                                       top_p=config.top_p, generator=self.generator, tools=tools)
        generated = time.perf_counter()

        # Weighted sum of the reward functions, each kept for logging, and the weighted steps: with
        # outcome supervision one per completion, at its last token; with process supervision the
        # functions' steps, their character offsets mapped to the tokens that end them.
        completions = rollout.decode(self.tokenizer)
        # Reward functions see each prompt as the dataset holds it (TRL's convention), not as rendered; with
        # tools, the whole trajectory (as text, tool results included; as messages for a conversational prompt).
        columns = self.reward_columns(rows)
        held = [row[config.prompt_column] for row in rows for _ in range(g)]
        messages = tools.reward_inputs(rollout, held, columns)
        arguments = dict(
            prompts=held, completions=completions,
            columns=columns, messages=messages,
            completion_ids=[ids[:n] for ids, n in zip(rollout.completion_ids.tolist(), rollout.lengths.tolist())],
            trainer_state=self.reward_state(step),
        )
        errors: list[dict[str, Any]] = []
        log = RewardLog()
        options = dict(timeout=config.reward_timeout, on_error=config.on_reward_error, errors=errors, log=log)
        # Reward models count the texts they cut to their context (cumulative): this round's share is the growth.
        models = [fn for fn in self.reward_funcs if isinstance(fn, (OutcomeRewardModel, ProcessRewardModel))]
        cut_before = [fn.truncated for fn in models]
        code_before = code_counts(self.reward_funcs)  # code rewards count their runs (cumulative) too
        if config.supervision == "outcome":
            rewards, per_function = score_completions(self.reward_funcs, self.reward_weights, **arguments, **options)
            last = (rollout.lengths - 1).clamp(min=0).tolist()
            steps = [[(end, reward)] for end, reward in zip(last, rewards.tolist())]
        else:
            rewards, per_function, char_steps = score_steps(self.reward_funcs, self.reward_weights, **arguments,
                                                            **options)
            steps = [self.token_steps(rollout, i, completions[i], s) for i, s in enumerate(char_steps)]
        for column, values in log.extra.items():
            if len(values) != len(completions):
                raise RewardError(f"log_extra({column!r}, ...): {len(values)} values for {len(completions)} "
                                  "completions; give one value per completion")
        steps = tools.own_steps(steps, rollout)  # rewards on the policy's own tokens
        code = {} if code_before is None else (code_counts(self.reward_funcs) - code_before).stats()
        for key, value in (("time_generate", generated - start), ("time_score", time.perf_counter() - generated),
                           ("reward_errors", len(errors)), *tools.metrics().items(),
                           *((f"reward_truncated/{reward_name(fn)}", fn.truncated - before)
                             for fn, before in zip(models, cut_before)), *code.items()):
            stats[key] = stats.get(key, 0) + value
        return Batch(rows, rollout, completions, rewards, per_function, steps, tools.calls, log)

    def reward_state(self, step: int) -> Any:
        """What reward functions get as ``trainer_state`` at ``step``: the front end's, else a :class:`TrainerState`."""
        if self.trainer_state:
            return self.trainer_state(step)
        return TrainerState(global_step=step, max_steps=self.config.max_steps, epoch=self.epoch)

    def token_steps(self, rollout: Rollout, i: int, text: str, steps: list[tuple[int, float]]) -> list:
        """(character offset, reward) steps → (token index, reward), summing steps that share a token."""
        ids = rollout.completion_ids[i, : int(rollout.lengths[i])].tolist()
        ends = step_token_ends(self.tokenizer, ids, text, [offset for offset, _ in steps])
        merged: dict[int, float] = {}
        for end, (_, reward) in zip(ends, steps):
            merged[end] = merged.get(end, 0.0) + reward
        return sorted(merged.items())

    def observe_spread(self, indices: list[int], rewards: torch.Tensor) -> None:
        """Fold each group's reward std ((B, G) ``rewards`` of the prompts at ``indices``, from every
        process) into its prompt's spread: the first group's std, then halfway towards each new one, so
        that the spread follows the policy as it learns."""
        stds = rewards.float().std(dim=1).tolist() if rewards.shape[1] > 1 else [0.0] * len(indices)
        pairs = [pair for part in gather(list(zip(indices, stds)), self.world) for pair in part]
        for index, std in pairs:
            before = self.spread.get(index)
            self.spread[index] = std if before is None else (before + std) / 2

    def no_signal_groups(self, batch: Batch) -> torch.Tensor:
        """(B,) bool: groups whose advantages are all 0 (equal rewards), which teach nothing. Whether an
        advantage is 0 does not depend on the scale, so this stays local to the process."""
        if batch.episode_of is not None:  # one outcome per episode: no signal where a group's rewards are equal
            return zero_variance_groups(batch.rewards, self.config.num_generations).cpu()
        advantages = group_relative_advantages(batch, self.config.num_generations, "none")
        return (advantages.view(len(batch.rows), -1) == 0).all(dim=1).cpu()


# ---- outside a run: `grpokit sample`, `bootstrap` and `eval` sample as a run with the same config would --------------


