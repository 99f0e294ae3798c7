"""Evaluation: accuracy and format rate of a model on prompts with answers, greedy and sampled."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from grpokit.rewards.builtin import accuracy_reward, format_reward
from grpokit.rewards.code import CodeTests, extract_program
from grpokit.rollout.engines import Engine, as_engine
from grpokit.rollout.tools import TOOL_COUNTS, ToolBox


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
    code: CodeTests | None = None,
) -> dict[str, list[float]]:
    """Per-row scores of the completions ``engine`` samples (:mod:`grpokit.rollout.engines`; a model: the native
    engine on it, float32): ``greedy_correct``/``greedy_format`` (0 or 1) and ``sampled_correct``/
    ``sampled_format`` (the mean over ``samples_per_prompt`` samples at ``temperature``; left out when
    ``samples_per_prompt`` is 0), and ``pass@k`` for each k in ``pass_ks`` (the unbiased estimator over
    the samples, at ``temperature`` and ``top_p``). ``prompts``: the text to sample from for each row (the prompt
    as a run renders it), by default the row's ``prompt_column`` as it is; the scores and the tools' environments
    see the rows. ``greedy_completions``: a list that receives each row's greedy completion, in order.
    With ``toolbox`` the model may call its tools, and each mode also gets ``_tool_rate`` (completions that
    called at least once), ``_tool_calls`` (calls per completion) and ``_tool_errors`` (failed calls per
    completion). With ``code`` (a ``code_tests`` reward, binary) the rows are programming problems: a completion is
    correct when its program passes every test of the row's ``tests`` (run in ``code``'s sandbox; a sandbox error
    counts as a failure) and formatted when it holds a program at all."""
    engine = as_engine(engine, tokenizer)
    generator = torch.Generator(device=engine.device).manual_seed(seed)
    modes = [("greedy", 1)] + ([("sampled", samples_per_prompt)] if samples_per_prompt else [])
    keys = ("correct", "format", *(TOOL_COUNTS if toolbox else ()))
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
        encoded = tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
        for mode, k in modes:
            tools = toolbox.session(batch, k, max_new_tokens)
            rollout = engine.generate(encoded["input_ids"], encoded["attention_mask"], num_generations=k,
                                      max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                      greedy=mode == "greedy", generator=generator, tools=tools)
            for key, per_completion in tools.counts().items():  # none without tools
                scores[f"{mode}_{key}"] += per_completion.view(-1, k).mean(dim=1).tolist()
            completions = rollout.decode(tokenizer)
            asked = [row[prompt_column] for row in batch for _ in range(k)]
            if code is None:
                answers = [row[answer_column] for row in batch for _ in range(k)]
                correct = torch.tensor(accuracy_reward(asked, completions, answer=answers)).view(-1, k)
                formatted = torch.tensor(format_reward(asked, completions)).view(-1, k)
            else:
                passed = code(completions, tests=[row["tests"] for row in batch for _ in range(k)])
                correct = torch.tensor([float(p == 1.0) for p in passed]).view(-1, k)
                formatted = torch.tensor([float(extract_program(c) is not None) for c in completions]).view(-1, k)
            scores[f"{mode}_correct"] += correct.mean(dim=1).tolist()
            scores[f"{mode}_format"] += formatted.mean(dim=1).tolist()
            if mode == "greedy" and greedy_completions is not None:
                greedy_completions += completions
            if mode == "sampled":
                for k in pass_ks:
                    scores[f"pass@{k}"] += [pass_at_k(samples_per_prompt, int(c), k)
                                            for c in correct.sum(dim=1).tolist()]
    return scores


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
