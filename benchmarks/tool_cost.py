"""What a tool costs: generation and GRPO steps on the tools task with the calculator on and off, side by side.

    python benchmarks/tool_cost.py --out benchmarks/results/tool_cost.json

The model is the tools demo's (seed 0): warm-started, and with ``--model DIR`` any other (e.g. the trained
``runs/demo-tools/model`` that ``grpokit demo --task tools --seed 0`` leaves, which calls far more often).
Both settings decode the same prompts with the same sampling stream; "off" means the same model with the empty
ToolBox (no tools), so a completion that writes a call just goes on writing. Timings alternate on/off,
``--repeats`` times each, and report medians: per decode step, per token (inserted result tokens included, as the
model reads them), and per GRPO step. Run it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import SMOKE_GRPO, SMOKE_HELP, SMOKE_THREADS, smoke_dir, smoke_warm_starts

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.resolve import load_model_and_tokenizer
from grpokit.rollout.generate import generate, stop_token_ids
from grpokit.rollout.tools import ToolBox, resolve_tools
from grpokit.runtime.device import cpu_model
from grpokit.tasks.demo import TOOLS_CONFIG
from grpokit.tasks.tool_task import train_rows
from grpokit.tasks.warm_start import warm_started_model_path


def generation(model, tokenizer, rows, toolbox, group_size: int, max_new_tokens: int, seed: int) -> dict:
    prompts = [row["prompt"] for row in rows]
    encoded = tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt")
    session = toolbox.session(rows, group_size, max_new_tokens)
    start = time.perf_counter()
    rollout = generate(model, encoded["input_ids"], encoded["attention_mask"], num_generations=group_size,
                       max_new_tokens=max_new_tokens, eos_token_id=stop_token_ids(model, tokenizer),
                       pad_token_id=tokenizer.pad_token_id, generator=torch.Generator().manual_seed(seed),
                       tools=session)
    seconds = time.perf_counter() - start
    calls = session.metrics()  # none from the empty box's session
    tokens = int(rollout.completion_mask.sum())
    return {"seconds": seconds, "decode_steps": rollout.completion_ids.shape[1], "tokens": tokens,
            "inserted_tokens": 0 if rollout.tool_mask is None else int(rollout.tool_mask.sum()),
            "calls": calls.get("tool_calls", 0), "tool_seconds": calls.get("time_tools", 0.0),
            "ms_per_token": 1000 * seconds / tokens,
            "ms_per_decode_step": 1000 * seconds / rollout.completion_ids.shape[1]}


def training_steps(model_dir: str, recipe: dict, tools: bool, steps: int, seed: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        settings = {**recipe, "tools": recipe["tools"] if tools else [], "max_steps": steps,
                    "progress_bar": False, "log_completions": 0, "save_every": 0}
        config = GRPOConfig.from_dict({**settings, "model": model_dir, "dataset": "builtin:tools",
                                       "output_dir": tmp, "seed": seed})
        model, tokenizer = load_model_and_tokenizer(model_dir, progress=False)
        trainer = GRPOTrainer(config, model=model, tokenizer=tokenizer)
        return [trainer.training_step() for _ in range(steps)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the tools demo's warm-started model, seed 0")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per training repeat")
    parser.add_argument("--out", default="benchmarks/results/tool_cost.json")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    torch.set_num_threads(SMOKE_THREADS if args.smoke else os.cpu_count() or 1)
    recipe = TOOLS_CONFIG
    if args.smoke:
        args.repeats, args.steps, args.out = 1, 1, str(smoke_dir() / "tool_cost.json")
        recipe = {**TOOLS_CONFIG, **SMOKE_GRPO, "max_completion_length": 24}  # room for a call and its result
        if args.model is None:
            smoke_warm_starts([0], "tools")

    model_dir = args.model or str(warm_started_model_path(seed=0, progress=False, task="tools"))
    model, tokenizer = load_model_and_tokenizer(model_dir, progress=False)
    model.eval()
    tools, _ = resolve_tools(None, recipe["tools"])
    toolbox = ToolBox(tokenizer, tools, max_calls=recipe["max_tool_calls"])
    rows = train_rows(recipe["prompts_per_step"], seed=7)
    g, width = recipe["num_generations"], recipe["max_completion_length"]

    generation(model, tokenizer, rows, toolbox, g, width, 0)  # warm-up
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for repeat in range(args.repeats):
        for name in ("on", "off"):
            box = toolbox if name == "on" else ToolBox.NONE
            runs[name].append(generation(model, tokenizer, rows, box, g, width, repeat))
    steps: dict[str, list[dict]] = {"on": [], "off": []}
    for repeat in range(max(1, args.repeats // 2)):
        for name in ("on", "off"):
            steps[name] += training_steps(model_dir, recipe, name == "on", args.steps, repeat)

    med = lambda xs: statistics.median(xs)  # noqa: E731
    summary = {}
    for name in ("on", "off"):
        r, s = runs[name], steps[name]
        summary[name] = {
            "generation_ms_per_token": med([x["ms_per_token"] for x in r]),
            "generation_ms_per_decode_step": med([x["ms_per_decode_step"] for x in r]),
            "decode_steps": med([x["decode_steps"] for x in r]), "tokens": med([x["tokens"] for x in r]),
            "inserted_tokens": med([x["inserted_tokens"] for x in r]), "calls": med([x["calls"] for x in r]),
            "tool_seconds": med([x["tool_seconds"] for x in r]), "generation_seconds": med([x["seconds"] for x in r]),
            "step_seconds": med([m["time_step"] for m in s]),
            "step_generate_seconds": med([m["time_generate"] for m in s]),
            "step_update_seconds": med([m["time_update"] for m in s]),
            "step_tokens_per_sec": med([m["tokens_per_sec"] for m in s]),
            "step_tool_call_rate": med([m.get("tool_call_rate", 0.0) for m in s]),
        }
    on, off = summary["on"], summary["off"]
    ratios = {key: on[key] / off[key] for key in ("generation_ms_per_token", "generation_ms_per_decode_step",
                                                  "generation_seconds", "step_seconds", "step_tokens_per_sec")}
    machine = {"python": platform.python_version(), "cpu": cpu_model(), "cpus": os.cpu_count(),
               "torch": torch.__version__}
    result = {"machine": machine, "model": model_dir, "command": " ".join(["python", *sys.argv]),
              "summary": summary, "on_over_off": ratios, "generation_runs": runs,
              "settings": {"prompts": len(rows), "group_size": g, "max_completion_length": width,
                           "repeats": args.repeats, "steps": args.steps}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({"summary": summary, "on_over_off": ratios}, indent=2))


if __name__ == "__main__":
    main()
