"""``grpokit demo``: warm-start the tiny model (cached), measure it, train it with GRPO, measure again.

The measurements are on held-out prompts never seen in warm-start or GRPO training: accuracy with
greedy decoding and with sampling at the training temperature, format rate, and the same on the
"carry" class that the warm-start corpus got systematically wrong. ``--task tools`` (:mod:`grpokit.tasks.tool_task`):
products the model cannot compute by hand and a calculator it may call; measured as well: how often it calls,
how many calls per completion, and how many of them fail.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from grpokit.algorithms.grpo import GRPOTrainer
from grpokit.cli.options import recipe_file
from grpokit.config import GRPOConfig
from grpokit.resolve import BUILTIN, BUILTIN_TOOLS, load_model_and_tokenizer
from grpokit.rollout.generate import generate, stop_token_ids
from grpokit.rollout.tool_templates import build_toolbox
from grpokit.rollout.tools import ToolBox, resolve_tools
from grpokit.runtime.progress import quiet_unless
from grpokit.tasks import tool_task
from grpokit.tasks.arithmetic import held_out_rows
from grpokit.tasks.warm_start import warm_started_model_path
from grpokit.training.evaluation import evaluate, summarize

# The keys of a recipe that run_demo sets itself.
_RUN_KEYS = ("model", "dataset", "output_dir", "seed")


def recipe(name: str) -> dict[str, Any]:
    """The settings of a packaged recipe, ``grpokit/tasks/recipes/<name>.yaml``, as a dict."""
    return yaml.safe_load(recipe_file(name).read_text(encoding="utf-8"))


# The demo's GRPO settings: those of the recipe recipes/arithmetic.yaml (``grpokit train`` runs the same),
# less what run_demo sets. Learning rates above ~3e-4 collapse this model within a few steps; a linear
# decay keeps the late steps from drifting.
DEMO_CONFIG: dict[str, Any] = {k: v for k, v in recipe("arithmetic").items() if k not in _RUN_KEYS}
TOOLS_CONFIG: dict[str, Any] = {k: v for k, v in recipe("tools").items() if k not in _RUN_KEYS}

# task → the rows of its before/after table: (subset, key, label, in % or as a number)
_ACCURACY = [("all", "greedy_correct", "accuracy, greedy", True),
             ("all", "sampled_correct", "accuracy, sampled (T=1)", True)]
_FORMAT = [("all", "greedy_format", "format rate, greedy", True),
           ("all", "sampled_format", "format rate, sampled (T=1)", True)]
TABLES = {
    "arithmetic": [
        *_ACCURACY, *_FORMAT,
        ("carry", "greedy_correct", "carry class: accuracy, greedy", True),
        ("carry", "sampled_correct", "carry class: accuracy, sampled", True),
        ("no_carry", "greedy_correct", "no-carry class: accuracy, greedy", True),
    ],
    "tools": [
        *_ACCURACY,
        ("all", "greedy_tool_rate", "tool-call rate, greedy", True),
        ("all", "sampled_tool_rate", "tool-call rate, sampled", True),
        ("all", "sampled_tool_calls", "calls per completion, sampled", False),
        ("all", "sampled_tool_errors", "tool errors per completion, sampled", False),
        *_FORMAT,
    ],
}


def _table(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]],
           task: str = "arithmetic") -> list[list[str]]:
    rows = []
    for subset, key, label, percent in TABLES[task]:
        b, a = before[subset][key], after[subset][key]
        if percent:
            rows.append([label, f"{100 * b:5.1f} %", f"{100 * a:5.1f} %", f"{100 * (a - b):+5.1f}"])
        else:
            rows.append([label, f"{b:.2f}", f"{a:.2f}", f"{a - b:+.2f}"])
    return rows


def format_table(rows: list[list[str]]) -> str:
    header = ["metric (held-out)", "before", "after", "change (points)"]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(4)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def greedy_completion(model: torch.nn.Module, tokenizer: Any, prompt: str, max_new_tokens: int | None = None,
                      toolbox: ToolBox = ToolBox.NONE) -> str:
    """The model's most likely completion of one prompt (calling ``toolbox``'s tools, if it has any)."""
    encoded = tokenizer([prompt], return_tensors="pt")
    max_new_tokens = max_new_tokens or DEMO_CONFIG["max_completion_length"]
    rollout = generate(model, encoded["input_ids"], encoded["attention_mask"], num_generations=1,
                       max_new_tokens=max_new_tokens, greedy=True,
                       eos_token_id=stop_token_ids(model, tokenizer), pad_token_id=tokenizer.pad_token_id,
                       tools=toolbox.session([{}], 1, max_new_tokens))
    return rollout.decode(tokenizer)[0]


def run_demo(
    seed: int = 0,
    output_dir: str | Path = "runs/demo",
    *,
    task: str = "arithmetic",
    eval_prompts: int = 400,
    samples_per_prompt: int = 4,
    progress: bool = True,
    **overrides: Any,
) -> dict[str, Any]:
    """Run the whole demo of ``task`` ('arithmetic' or 'tools'); return (and write to ``output_dir/demo.json``)
    the before/after numbers."""
    if task not in TABLES:
        raise ValueError(f"unknown demo task {task!r}; choose one of {sorted(TABLES)}")
    with quiet_unless(progress):
        return _run_demo(seed, output_dir, task, eval_prompts, samples_per_prompt, progress, overrides)


def _run_demo(seed: int, output_dir: str | Path, task: str, eval_prompts: int, samples_per_prompt: int,
              progress: bool, overrides: dict[str, Any]) -> dict[str, Any]:
    settings, dataset = (TOOLS_CONFIG, BUILTIN_TOOLS) if task == "tools" else (DEMO_CONFIG, BUILTIN)
    started = time.perf_counter()
    warm_path = warm_started_model_path(seed=seed, progress=progress, task=task)
    warm_seconds = time.perf_counter() - started
    model, tokenizer = load_model_and_tokenizer(str(warm_path), progress=progress)
    # The run's tools with the protocol a run chooses (the tiny tokenizer has no chat template: the plain one).
    toolbox = build_toolbox(tokenizer, resolve_tools(None, settings.get("tools", []))[0], None,
                            chat_template=settings.get("chat_template"),
                            max_calls=settings.get("max_tool_calls", GRPOConfig.max_tool_calls),
                            timeout=settings.get("tool_timeout", GRPOConfig.tool_timeout))
    if task == "tools":
        rows, classes = tool_task.held_out_rows(eval_prompts), {}
    else:
        rows = held_out_rows(eval_prompts)
        carry = [row["carry"] for row in rows]
        classes = {"carry": carry, "no_carry": [not c for c in carry]}
    eval_kwargs = dict(samples_per_prompt=samples_per_prompt, temperature=settings["temperature"],
                       max_new_tokens=settings["max_completion_length"], seed=seed, progress=progress,
                       toolbox=toolbox)

    def measure(m: torch.nn.Module) -> dict[str, dict[str, float]]:
        scores = evaluate(m, tokenizer, rows, **eval_kwargs)
        return {"all": summarize(scores), **{name: summarize(scores, keep) for name, keep in classes.items()}}

    before = measure(model)
    # a held-out problem (for arithmetic, of the class the corpus got wrong)
    example = next(row for row in rows if row.get("carry", True))
    show = dict(max_new_tokens=settings["max_completion_length"], toolbox=toolbox)
    example_before = greedy_completion(model, tokenizer, example["prompt"], **show)
    config = GRPOConfig.from_dict({**settings, "model": str(warm_path), "dataset": dataset, "seed": seed,
                                   "output_dir": str(output_dir), "progress_bar": progress, **overrides})
    trainer = GRPOTrainer(config, model=model, tokenizer=tokenizer)
    grpo_started = time.perf_counter()
    trainer.train()
    grpo_seconds = time.perf_counter() - grpo_started
    after = measure(trainer.model)
    result = {
        "seed": seed, "before": before, "after": after,
        "task": task,
        "example": {"prompt": example["prompt"], "answer": example["answer"], "before": example_before,
                    "after": greedy_completion(trainer.model, tokenizer, example["prompt"], **show)},
        "seconds": {"warm_start": warm_seconds, "grpo": grpo_seconds, "total": time.perf_counter() - started},
        "eval_prompts": eval_prompts, "samples_per_prompt": samples_per_prompt,
        "config": config.to_dict(), "table": _table(before, after, task),
    }
    Path(output_dir, "demo.json").write_text(json.dumps(result, indent=2))
    return result
