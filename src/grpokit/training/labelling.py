"""``grpokit sample``: completions sampled from a model and labelled by rule rewards — the rows
``grpokit reward train`` reads (docs/reward_models.md).

Each prompt gets G completions (``rollout.generate``, the prompt rendered as ``grpokit train`` renders it);
each completion is scored by the named reward functions as a GRPO step scores it (``rewards.calling.score_steps``).
A row holds the completion's weighted total reward as ``label``, and, when a process reward (one that
returns step lists, such as ``arithmetic_steps``) is among them, its weighted steps as ``steps``; with
``pairs``, rows are preference pairs built within each group instead. ``grpokit sample`` is
:func:`grpokit.from_config.sample_to_file`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from grpokit.data import render_prompt, reward_column_names, reward_columns
from grpokit.models.loading import ensure_pad_token
from grpokit.rewards.calling import RewardFunction, check_reward_functions, reward_name, score_steps
from grpokit.rollout.engines import Engine, as_engine
from grpokit.rollout.tools import ToolBox, reward_keywords


@torch.no_grad()
def sample_rows(
    engine: Engine | torch.nn.Module, tokenizer: Any, rows: Sequence[dict[str, Any]],
    reward_funcs: Sequence[RewardFunction], reward_weights: Sequence[float], *, num_generations: int,
    prompt_column: str = "prompt", answer_column: str = "answer", max_new_tokens: int = 64, temperature: float = 1.0,
    top_p: float = 1.0, system_prompt: str | None = None, chat_template: bool | None = None, seed: int = 0,
    batch_size: int = 16, pairs: bool = False, progress: bool = True, toolbox: ToolBox = ToolBox.NONE,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The labelled rows ``{prompt, completion, label, rewards, [steps], [tool_calls]}`` (``pairs``: ``{prompt,
    chosen, rejected, chosen_label, rejected_label}``) of G = ``num_generations`` completions per row, and counts
    of what was left out, sampled by ``engine`` (:mod:`grpokit.rollout.engines`; a model: the native engine on it,
    float32). A completion no reward function applied to gets no row; steps ending at
    character 0 (of an empty completion) are left out, as no token holds them.

    With a ``toolbox`` that has tools (not the empty box) the model calls them as in training (the prompts list
    them where a chat template does): a completion is the whole trajectory as text, tool results included, as the
    run's reward functions and reward models read it, and a labelled or step row also counts its ``tool_calls``."""
    if num_generations < 1 or (pairs and num_generations < 2):
        raise ValueError(f"num_generations must be at least {2 if pairs else 1}, got {num_generations}")
    extras = reward_keywords(toolbox.environment_factory)
    check_reward_functions(reward_funcs, [*reward_column_names(rows, prompt_column, answer_column), *extras], "dataset")
    listed = toolbox.prompt_tools()
    ensure_pad_token(tokenizer)
    engine = as_engine(engine, tokenizer)
    generator = torch.Generator(device=engine.device).manual_seed(seed)
    seen: set[str] = set()  # the functions that returned step lists: process rewards
    spied = [_spy(fn, seen) for fn in reward_funcs]
    g, labelled = num_generations, []
    starts = range(0, len(rows), batch_size)
    for start in tqdm(starts, desc="sample", disable=not progress, dynamic_ncols=True):
        batch = list(rows[start:start + batch_size])
        rendered = [render_prompt(tokenizer, row[prompt_column], system_prompt=system_prompt,
                                  chat_template=chat_template, tools=listed) for row in batch]
        tools = toolbox.session(batch, g, max_new_tokens, prompt_column)
        rendered, repeats = tools.sample_prompts(rendered, g)  # with environments' observations: each its own
        encoded = tokenizer(rendered, padding=True, padding_side="left", return_tensors="pt")
        rollout = engine.generate(encoded["input_ids"], encoded["attention_mask"], num_generations=repeats,
                                  max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                  generator=generator, tools=tools)
        completions = rollout.decode(tokenizer)
        prompts = [row[prompt_column] for row in batch for _ in range(g)]  # as the dataset holds them (as TRL)
        columns = reward_columns(batch, prompt_column, answer_column, g)
        messages = tools.reward_inputs(rollout, prompts, columns)
        total, per_function, steps = score_steps(spied, reward_weights, prompts, completions, columns,
                                                 messages=messages)
        for i, completion in enumerate(completions):
            source = batch[i // g]
            scores = {name: None if math.isnan(v[i]) else float(v[i]) for name, v in per_function.items()}
            row = {"prompt": prompts[i], "completion": completion, "label": float(total[i]), "rewards": scores,
                   "steps": [[end, reward] for end, reward in steps[i] if end > 0]}
            if tools:  # the column is there exactly when the completions could call tools
                row["tool_calls"] = len(tools.calls[i])
            if answer_column in source:
                row["answer"] = source[answer_column]
            # None marks a completion no function applied to; the group's position is kept for the pairs.
            labelled.append(None if all(v is None for v in scores.values()) else row)

    counts = {"prompts": len(rows), "completions": len(labelled), "unscored": labelled.count(None),
              "no_steps": 0, "groups_without_pairs": 0, "empty_sides": 0}
    kept = [r for r in labelled if r is not None]
    if seen:  # a steps column (the outcome rewards as a step at the end); a row needs a step to train on
        counts["no_steps"] = sum(not r["steps"] for r in kept)
    for r in kept:
        if not seen:
            del r["steps"]
    if not pairs:
        return [r for r in kept if not seen or r["steps"]], counts
    out = []
    for first in range(0, len(labelled), g):
        made = _pairs([r for r in labelled[first:first + g] if r is not None], counts)
        counts["groups_without_pairs"] += not made
        out += made
    return out, counts


def _spy(fn: RewardFunction, seen: set[str]) -> RewardFunction:
    """``fn``, noting in ``seen`` (by name) whether it returns step lists; its signature and name kept, for
    the keywords it is passed and the name it is logged under."""

    @functools.wraps(fn)
    def spy(**kwargs: Any) -> list:
        values = fn(**kwargs)
        if any(isinstance(v, (list, tuple)) for v in values or []):
            seen.add(reward_name(fn))
        return values

    return spy


def _pairs(group: list[dict[str, Any]], counts: dict[str, int]) -> list[dict[str, Any]]:
    """Preference pairs within one group: best with worst, second best with second worst, ..., each
    completion in one pair at most; pairs of equal labels, or with an empty side, left out."""
    ranked = sorted(group, key=lambda r: -r["label"])
    made = []
    for high, low in zip(ranked[:len(ranked) // 2], reversed(ranked[len(ranked) // 2:])):
        if high["label"] <= low["label"]:
            continue
        if not high["completion"].strip() or not low["completion"].strip():
            counts["empty_sides"] += 1
            continue
        pair = {"prompt": high["prompt"], "chosen": high["completion"], "rejected": low["completion"],
                "chosen_label": high["label"], "rejected_label": low["label"]}
        made.append({**pair, **({"answer": high["answer"]} if "answer" in high else {})})
    return made
