"""``grpokit demo``: warm-start the tiny model (cached), measure it, train it with GRPO, measure again — the built-in
task of :mod:`grpokit.tasks.demo` run end to end.

    result = run_demo(seed=0, output_dir="runs/demo")           # the arithmetic demo; task="tools": the calculator's
    result = run_demo(0, "runs/demo-b0", beta=0.0, max_steps=30)  # any GRPOConfig key over the demo's settings
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from grpokit.algorithms.grpo import GRPOTrainer
from grpokit.config import GRPOConfig
from grpokit.resolve import BUILTIN, BUILTIN_TOOLS, load_model_and_tokenizer
from grpokit.rollout.tool_templates import build_toolbox, toolbox_options
from grpokit.rollout.tools import resolve_tools
from grpokit.runtime.progress import quiet_unless
from grpokit.tasks.demo import SETTINGS, TABLES, greedy_completion, held_out, table
from grpokit.tasks.warm_start import warm_started_model_path
from grpokit.training.evaluation import evaluate, summarize
from grpokit.training.run_dir import check_early

DATASETS = {"arithmetic": BUILTIN, "tools": BUILTIN_TOOLS}


def demo_config(task: str = "arithmetic", seed: int = 0, output_dir: str | Path = "runs/demo", progress: bool = True,
                model: str = BUILTIN, **overrides: Any) -> GRPOConfig:
    """The demo's GRPO run: the task's recipe with ``overrides`` (any GRPOConfig key but the model, which is the
    warm start's) over it; checked here, so that a bad key fails before the warm start."""
    if task not in TABLES:
        raise ValueError(f"unknown demo task {task!r}; choose one of {sorted(TABLES)}")
    if "model" in overrides:
        raise ValueError("the demo trains its own warm-started tiny model; `grpokit train --model ...` trains another")
    return GRPOConfig.from_dict({**SETTINGS[task], "model": model, "dataset": DATASETS[task], "seed": seed,
                                 "output_dir": str(output_dir), "progress_bar": progress, **overrides})


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
    check_early(demo_config(task, seed, output_dir, progress, **overrides))  # before the warm start
    with quiet_unless(progress):
        return _run_demo(seed, output_dir, task, eval_prompts, samples_per_prompt, progress, overrides)


def _run_demo(seed: int, output_dir: str | Path, task: str, eval_prompts: int, samples_per_prompt: int,
              progress: bool, overrides: dict[str, Any]) -> dict[str, Any]:
    settings = SETTINGS[task]
    started = time.perf_counter()
    warm_path = warm_started_model_path(seed=seed, progress=progress, task=task)
    warm_seconds = time.perf_counter() - started
    model, tokenizer = load_model_and_tokenizer(str(warm_path), progress=progress)
    # The run's tools with the protocol a run chooses (the tiny tokenizer has no chat template: the plain one).
    toolbox = build_toolbox(tokenizer, resolve_tools(None, settings.get("tools", []))[0], None,
                            chat_template=settings.get("chat_template"), **toolbox_options(settings))
    rows, classes = held_out(task, eval_prompts)
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
    config = demo_config(task, seed, output_dir, progress, model=str(warm_path), **overrides)
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
        "config": config.to_dict(), "table": table(before, after, task),
    }
    Path(output_dir, "demo.json").write_text(json.dumps(result, indent=2))
    return result
