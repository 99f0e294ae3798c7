"""Evaluation: accuracy (or a judge's score) and format rate of a model on prompts with answers, greedy and sampled
(:func:`evaluate`; ``grpokit eval`` is :func:`grpokit.from_config.evaluate_config`), and a run's held-out evaluation
on it (:class:`HeldOutEval`) with the reward-gaming alarm (:func:`reward_gaming_alarm`)."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from grpokit.data import check_columns, reward_column_names, reward_columns
from grpokit.rewards.builtin import accuracy_reward, format_reward, lenient_accuracy_reward
from grpokit.rewards.calling import (
    RewardError,
    RewardFunction,
    check_reward_functions,
    reward_name,
    score_completions,
)
from grpokit.rewards.code import CodeTests, extract_program
from grpokit.rollout.engines import Engine, as_engine
from grpokit.rollout.tools import TOOL_COUNTS, ToolBox
from grpokit.training.distributed import gather


@torch.no_grad()
def evaluate(
    engine: Engine | torch.nn.Module,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    *,
    prompts: Sequence[str] | None = None,
    prompt_column: str = "prompt",
    answer_column: str = "answer",
    samples_per_prompt: int = 4,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_new_tokens: int = 64,
    batch_size: int = 64,
    seed: int = 0,
    progress: bool = True,
    pass_ks: Sequence[int] | None = None,
    greedy_completions: list[str] | None = None,
    toolbox: ToolBox = ToolBox.NONE,
    judge: RewardFunction | None = None,
) -> dict[str, list[float]]:
    """Per-row scores of the completions ``engine`` samples (:mod:`grpokit.rollout.engines`; a model: the native
    engine on it, float32): ``greedy_correct``/``greedy_lenient``/``greedy_format`` (0 or 1; lenient: judged by
    :func:`~grpokit.rewards.builtin.lenient_accuracy_reward`, the last number when there is no ``<answer>``) and
    ``sampled_correct``/``sampled_lenient``/``sampled_format`` (the mean over ``samples_per_prompt`` samples at
    ``temperature``; left out when ``samples_per_prompt`` is 0), and ``pass@k`` for each k in ``pass_ks`` (the
    unbiased estimator over the samples, at ``temperature`` and ``top_p``). ``prompts``: the text to sample from for
    each row (the prompt as a run renders it), by default the row's ``prompt_column`` as it is; the scores and the
    tools' environments see the rows. ``greedy_completions``: a list that receives each row's greedy completion, in
    order. With ``toolbox`` the model may call its tools, and each mode also gets ``_tool_rate`` (completions that
    called at least once), ``_tool_calls`` (calls per completion) and ``_tool_errors`` (failed calls per
    completion). With a ``judge`` (a reward function giving one number per completion, called as in training with the
    rows' columns: a run's ``eval_reward``) a completion is correct when it scores 1 or more, and each mode also gets
    ``_score``, the mean score (partial credit; None, "not applicable", scores 0); there is no lenient reading. A
    ``code_tests`` judge makes the rows programming problems: formatted means the completion holds a program."""
    engine = as_engine(engine, tokenizer)
    generator = torch.Generator(device=engine.device).manual_seed(seed)
    modes = [("greedy", 1)] + ([("sampled", samples_per_prompt)] if samples_per_prompt else [])
    keys = ("correct", *(("lenient",) if judge is None else ("score",)), "format", *(TOOL_COUNTS if toolbox else ()))
    scores: dict[str, list[float]] = {f"{mode}_{key}": [] for mode, _ in modes for key in keys}
    pass_ks = [k for k in (pass_ks or []) if samples_per_prompt]
    for k in pass_ks:
        if not 1 <= k <= samples_per_prompt:
            raise ValueError(f"pass@{k} needs 1 <= k <= samples_per_prompt={samples_per_prompt}")
        scores[f"pass@{k}"] = []
    starts = range(0, len(rows), batch_size)
    for start in tqdm(starts, desc="eval", disable=not progress, dynamic_ncols=True, leave=False):
        batch = rows[start : start + batch_size]
        texts = [row[prompt_column] for row in batch] if prompts is None else prompts[start : start + batch_size]
        for mode, k in modes:
            tools = toolbox.session(batch, k, max_new_tokens, prompt_column)
            sampled, repeats = tools.sample_prompts(texts, k)  # with environments' observations: each its own
            encoded = tokenizer(sampled, padding=True, padding_side="left", return_tensors="pt")
            rollout = engine.generate(encoded["input_ids"], encoded["attention_mask"], num_generations=repeats,
                                      max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                      greedy=mode == "greedy", generator=generator, tools=tools)
            for key, per_completion in tools.counts().items():  # none without tools
                scores[f"{mode}_{key}"] += per_completion.view(-1, k).mean(dim=1).tolist()
            completions = rollout.decode(tokenizer)
            asked = [row[prompt_column] for row in batch for _ in range(k)]
            if judge is None:
                answers = [row[answer_column] for row in batch for _ in range(k)]
                correct = torch.tensor(accuracy_reward(asked, completions, answer=answers)).view(-1, k)
                lenient = torch.tensor(lenient_accuracy_reward(asked, completions, answer=answers)).view(-1, k)
                scores[f"{mode}_lenient"] += lenient.mean(dim=1).tolist()
            else:
                columns = reward_columns(batch, prompt_column, answer_column, k)
                tools.reward_inputs(rollout, asked, columns)  # each completion's environment, if any
                judged = judge_scores(judge, asked, completions, columns)
                correct = (judged >= 1.0).float().view(-1, k)
                scores[f"{mode}_score"] += judged.view(-1, k).mean(dim=1).tolist()
            if isinstance(judge, CodeTests):
                formatted = torch.tensor([float(extract_program(c) is not None) for c in completions]).view(-1, k)
            else:
                formatted = torch.tensor(format_reward(asked, completions)).view(-1, k)
            scores[f"{mode}_correct"] += correct.mean(dim=1).tolist()
            scores[f"{mode}_format"] += formatted.mean(dim=1).tolist()
            if mode == "greedy" and greedy_completions is not None:
                greedy_completions += completions
            if mode == "sampled":
                for k in pass_ks:
                    scores[f"pass@{k}"] += [pass_at_k(samples_per_prompt, int(c), k)
                                            for c in correct.sum(dim=1).tolist()]
    return scores


def check_eval_rows(rows: Sequence[dict[str, Any]], judge: RewardFunction | None, prompt_column: str,
                    answer_column: str, source: str) -> None:
    """Every row has what evaluation reads: the prompt, and what ``judge`` takes (without one: the answer column),
    checked before any sampling; errors name the row and column (or the judge's parameter)."""
    needed = [answer_column]
    if judge is not None:
        keywords = reward_column_names(rows, prompt_column, answer_column)
        needed = [keywords[k] for k in check_reward_functions([judge], keywords, f"{source} (eval_reward)")]
    check_columns(rows, list(dict.fromkeys([prompt_column, *needed])), source=source)


def judge_scores(judge: RewardFunction, prompts: list[Any], completions: list[str],
                 columns: dict[str, list]) -> torch.Tensor:
    """``judge``'s score of each completion, called as reward functions are in training (None: 0). One that
    raises, or returns anything but one number (or None) per completion, is refused, naming it as
    ``eval_reward``."""
    try:
        _, per_function = score_completions([judge], [1.0], prompts, completions, columns)
    except RewardError as error:
        # what it returned is at fault, or what it raised (a scorer whose sandbox failed: no return to blame)
        wrong_return = " returned " in str(error)
        raise RewardError(f"eval_reward: {error}" + ("; held-out evaluation needs one number (or None) per "
                                                    "completion" if wrong_return else "")) from error
    return torch.nan_to_num(per_function[reward_name(judge)], nan=0.0)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: ``1 − C(n−c, k) / C(n, k)``, the
    chance that at least one of k samples drawn without replacement is correct (Chen et al., 2021).

    >>> pass_at_k(4, 1, 1), pass_at_k(4, 1, 2), pass_at_k(4, 0, 4), pass_at_k(4, 3, 2)
    (0.25, 0.5, 0.0, 1.0)
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n samples, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(scores: dict[str, list[float]], keep: Sequence[bool] | None = None) -> dict[str, float]:
    """Means of the per-row scores, optionally over the rows where ``keep`` is true."""
    summary = {}
    for key, values in scores.items():
        chosen = list(values) if keep is None else [v for v, k in zip(values, keep) if k]
        summary[key] = sum(chosen) / len(chosen) if chosen else float("nan")
    return summary


# What a run logs of evaluate()'s summary, under the names of its training metrics with `eval_` before them.
EVAL_NAMES = {"greedy_correct": "eval_accuracy", "greedy_format": "eval_format_rate",
              "greedy_lenient": "eval_lenient_accuracy", "sampled_correct": "eval_sampled_accuracy",
              "sampled_format": "eval_sampled_format_rate", "sampled_lenient": "eval_sampled_lenient_accuracy",
              "greedy_score": "eval_score", "sampled_score": "eval_sampled_score"}


class HeldOutEval:
    """A run's held-out evaluation (``eval_dataset`` / ``eval_fraction``, every ``eval_every`` steps): :func:`evaluate`
    on the engine that samples the run, the prompts rendered as the run renders them, each process evaluating its
    share of the rows. ``judge``: what scores the completions (:func:`evaluate`; the run's ``eval_reward``), as
    ``grpokit eval`` judges them."""

    def __init__(self, config: Any, tokenizer: Any, rows: Sequence[dict[str, Any]], prompts: Sequence[str],
                 engine: Engine, world: Any, toolbox: ToolBox = ToolBox.NONE, judge: RewardFunction | None = None):
        self.config, self.tokenizer, self.engine, self.world, self.toolbox = config, tokenizer, engine, world, toolbox
        self.judge, self.size = judge, len(rows)
        # Every process gets as many rows (the last ones repeated where they do not divide), so that all run the
        # same passes (a sharded policy decodes on all of them at once); the repeats are not counted.
        share = -(-len(rows) // world.size)
        order = [(world.rank + world.size * i) % len(rows) for i in range(share)]
        self.counted = [world.rank + world.size * i < len(rows) for i in range(share)]
        self.rows, self.prompts = [rows[i] for i in order], [prompts[i] for i in order]

    def due(self, step: int) -> bool:
        """Whether to evaluate after ``step`` optimizer steps: before the first, every ``eval_every``, after the last
        one."""
        every = self.config.eval_every
        return step == 0 or step == self.config.max_steps or bool(every and step % every == 0)

    def __call__(self, step: int, history: Sequence[dict[str, Any]]) -> dict[str, float]:
        """The ``eval_*`` metrics of the policy after ``step`` steps, ``eval_alarm`` (1.0 when
        :func:`reward_gaming_alarm` goes off given the run's ``history`` so far) and ``time_eval``."""
        config, start = self.config, time.perf_counter()
        k = config.eval_samples
        scores = evaluate(self.engine, self.tokenizer, self.rows, prompts=self.prompts,
                          prompt_column=config.prompt_column, answer_column=config.answer_column,
                          samples_per_prompt=k, temperature=config.temperature, top_p=config.top_p,
                          max_new_tokens=config.max_completion_length,
                          batch_size=max(1, config.prompts_per_step // self.world.size), seed=config.seed,
                          progress=False, pass_ks=sorted({1, k}) if k else None, toolbox=self.toolbox, judge=self.judge)
        kept = {key: [v for v, counted in zip(values, self.counted) if counted] for key, values in scores.items()}
        everyone = gather(kept, self.world)
        whole = {key: [v for part in everyone for v in part[key]] for key in kept}
        metrics = {EVAL_NAMES.get(key, f"eval_{key}"): value for key, value in summarize(whole).items()}
        metrics["eval_prompts"] = float(self.size)
        span = config.eval_every or max(1, config.max_steps // 4)  # the steps whose mean reward stands for the policy
        alarm = reward_gaming_alarm([*history, {"step": step, **metrics}], span, config.eval_alarm_drop)
        metrics["eval_alarm"] = float(alarm is not None)
        metrics["time_eval"] = time.perf_counter() - start
        if alarm is not None and self.world.main:
            tqdm.write(f"grpokit: reward gaming? {alarm}", file=sys.stderr)
        return metrics


def reward_level(history: Sequence[dict[str, Any]], step: int, span: int) -> float | None:
    """The training reward of the policy evaluated after ``step`` steps: the mean ``reward`` of the ``span`` steps up to
    it (for step 0, step 1's: sampled from the starting policy); None before those steps are logged."""
    first, last = max(1, step - max(span, 1) + 1), max(step, 1)
    rewards = [m["reward"] for m in history if first <= m["step"] <= last and m.get("reward") is not None]
    return sum(rewards) / len(rewards) if rewards else None


def reward_gaming_alarm(history: Sequence[dict[str, Any]], span: int, min_drop: float) -> str | None:
    """Why the last held-out evaluation in ``history`` (a run's metrics, step by step) signals reward gaming, or None:
    its greedy accuracy ``eval_accuracy`` fell at least ``min_drop``, and more than twice the standard error of the
    difference, below the best earlier evaluation's, while the training reward (:func:`reward_level` over ``span``
    steps) rose above its level at that evaluation. Over-optimisation of a reward that pays for something other than
    being right: the reward rises, the accuracy falls.

    >>> h = [{"step": 0, "eval_accuracy": 0.6, "eval_prompts": 400}, {"step": 1, "reward": 0.5},
    ...      {"step": 2, "reward": 0.9, "eval_accuracy": 0.3, "eval_prompts": 400}]
    >>> reward_gaming_alarm(h, 1, 0.05)
    'since step 0 the training reward rose 0.5 -> 0.9 while held-out accuracy fell 60.0 % -> 30.0 % (400 prompts)'
    >>> reward_gaming_alarm(h[:2] + [{**h[2], "reward": 0.4}], 1, 0.05) is None  # the reward fell too: no gaming
    True
    """
    points = [m for m in history if m.get("eval_accuracy") is not None]
    if len(points) < 2:
        return None
    now = points[-1]
    best = max(points[:-1], key=lambda m: m["eval_accuracy"])
    a, b = best["eval_accuracy"], now["eval_accuracy"]
    n_a, n_b = best.get("eval_prompts", 1.0), now.get("eval_prompts", 1.0)
    error = math.sqrt(a * (1 - a) / n_a + b * (1 - b) / n_b)
    reward_then, reward_now = reward_level(history, best["step"], span), reward_level(history, now["step"], span)
    if reward_then is None or reward_now is None or a - b < max(min_drop, 2 * error) or reward_now <= reward_then:
        return None
    return (f"since step {best['step']} the training reward rose {reward_then:.3g} -> {reward_now:.3g} while held-out "
            f"accuracy fell {100 * a:.1f} % -> {100 * b:.1f} % ({int(n_b)} prompts)")
