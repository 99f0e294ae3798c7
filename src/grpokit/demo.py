"""``grpokit demo``: warm-start the tiny model (cached), measure it, train it with GRPO, measure again.

The measurements are on held-out prompts never seen in warm-start or GRPO training: accuracy with
greedy decoding and with sampling at the training temperature, format rate, and the same on the
"carry" class that the warm-start corpus got systematically wrong.
"""

from __future__ import annotations

import json
import time
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers.utils import logging as hf_logging

from grpokit.arithmetic import held_out_rows
from grpokit.config import GRPOConfig
from grpokit.evaluate import evaluate, summarize
from grpokit.models import BUILTIN, load_model_and_tokenizer
from grpokit.rollout import generate, stop_token_ids
from grpokit.trainer import GRPOTrainer
from grpokit.warm_start import warm_started_model_path

# The keys of a recipe that run_demo sets itself.
_RUN_KEYS = ("model", "dataset", "output_dir", "seed")


def recipe(name: str) -> dict[str, Any]:
    """The settings of a packaged recipe, ``grpokit/recipes/<name>.yaml``, as a dict."""
    text = (resources.files("grpokit") / "recipes" / f"{name}.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


# The demo's GRPO settings: those of the recipe recipes/arithmetic.yaml (``grpokit train`` runs the same),
# less what run_demo sets. Learning rates above ~3e-4 collapse this model within a few steps; a linear
# decay keeps the late steps from drifting.
DEMO_CONFIG: dict[str, Any] = {k: v for k, v in recipe("arithmetic").items() if k not in _RUN_KEYS}


def _table(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> list[list[str]]:
    rows = []
    labels = [
        ("all", "greedy_correct", "accuracy, greedy"),
        ("all", "sampled_correct", "accuracy, sampled (T=1)"),
        ("all", "greedy_format", "format rate, greedy"),
        ("all", "sampled_format", "format rate, sampled (T=1)"),
        ("carry", "greedy_correct", "carry class: accuracy, greedy"),
        ("carry", "sampled_correct", "carry class: accuracy, sampled"),
        ("no_carry", "greedy_correct", "no-carry class: accuracy, greedy"),
    ]
    for subset, key, label in labels:
        b, a = before[subset][key], after[subset][key]
        rows.append([label, f"{100 * b:5.1f} %", f"{100 * a:5.1f} %", f"{100 * (a - b):+5.1f}"])
    return rows


def format_table(rows: list[list[str]]) -> str:
    header = ["metric (held-out)", "before", "after", "change (points)"]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(4)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def greedy_completion(model: torch.nn.Module, tokenizer: Any, prompt: str) -> str:
    """The model's most likely completion of one prompt."""
    encoded = tokenizer([prompt], return_tensors="pt")
    rollout = generate(model, encoded["input_ids"], encoded["attention_mask"], num_generations=1,
                       max_new_tokens=DEMO_CONFIG["max_completion_length"], greedy=True,
                       eos_token_id=stop_token_ids(model, tokenizer), pad_token_id=tokenizer.pad_token_id)
    return rollout.decode(tokenizer)[0]


def run_demo(
    seed: int = 0,
    output_dir: str | Path = "runs/demo",
    *,
    eval_prompts: int = 400,
    samples_per_prompt: int = 4,
    progress: bool = True,
    **overrides: Any,
) -> dict[str, Any]:
    """Run the whole demo; return (and write to ``output_dir/demo.json``) the before/after numbers."""
    if not progress:
        hf_logging.disable_progress_bar()
    started = time.perf_counter()
    warm_path = warm_started_model_path(seed=seed, progress=progress)
    warm_seconds = time.perf_counter() - started
    model, tokenizer = load_model_and_tokenizer(str(warm_path), progress=progress)
    rows = held_out_rows(eval_prompts)
    carry = [row["carry"] for row in rows]
    eval_kwargs = dict(samples_per_prompt=samples_per_prompt, temperature=DEMO_CONFIG["temperature"],
                       max_new_tokens=DEMO_CONFIG["max_completion_length"], seed=seed, progress=progress)

    def measure(m: torch.nn.Module) -> dict[str, dict[str, float]]:
        scores = evaluate(m, tokenizer, rows, **eval_kwargs)
        return {"all": summarize(scores), "carry": summarize(scores, carry),
                "no_carry": summarize(scores, [not c for c in carry])}

    before = measure(model)
    example = next(row for row in rows if row["carry"])  # a held-out problem of the class the corpus got wrong
    example_before = greedy_completion(model, tokenizer, example["prompt"])
    config = GRPOConfig.from_dict({**DEMO_CONFIG, "model": str(warm_path), "dataset": BUILTIN, "seed": seed,
                                   "output_dir": str(output_dir), "progress_bar": progress, **overrides})
    trainer = GRPOTrainer(config, model=model, tokenizer=tokenizer)
    grpo_started = time.perf_counter()
    trainer.train()
    grpo_seconds = time.perf_counter() - grpo_started
    after = measure(trainer.model)
    result = {
        "seed": seed, "before": before, "after": after,
        "example": {"prompt": example["prompt"], "answer": example["answer"], "before": example_before,
                    "after": greedy_completion(trainer.model, tokenizer, example["prompt"])},
        "seconds": {"warm_start": warm_seconds, "grpo": grpo_seconds, "total": time.perf_counter() - started},
        "eval_prompts": eval_prompts, "samples_per_prompt": samples_per_prompt,
        "config": config.to_dict(), "table": _table(before, after),
    }
    Path(output_dir, "demo.json").write_text(json.dumps(result, indent=2))
    return result
