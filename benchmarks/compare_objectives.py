"""Outcome vs process supervision, and the three loss aggregations, on the built-in task.

    python benchmarks/compare_objectives.py --seeds 0 1 2 --budget 60

Every run starts from the same warm-started model (per seed, cached) with the demo's settings
(16 prompts × G = 8, 48 new tokens, T = 1, β = 0.04, lr 2e-4 decaying linearly over 60 steps) and
stops after 60 steps or ``--budget`` seconds of training, whichever comes first. Only training
counts towards the budget; the held-out evaluations (greedy accuracy on 200 held-out prompts
every ``--eval-every`` steps, and on 400 greedy + 4 samples each at the end) are timed apart.

Variants:
- ``outcome · sequence``: the paper (accuracy + format reward, 1/G Σ_i 1/|o_i| Σ_t);
- ``process · sequence``: process supervision with the built-in ``arithmetic_steps`` reward (each
  column step checked, the answer the last step) + format; accuracy logged with weight 0;
- ``outcome · token``: DAPO's token mean; ``outcome · constant``: Dr. GRPO's constant length.

Writes ``benchmarks/results/compare_objectives.json`` (every curve), the figure
``docs/images/compare_objectives.png`` and prints the Markdown table for ``docs/benchmarks.md``.
Needs matplotlib (``pip install -e .[plot]``). Run it alone: a 2-core machine's timings are
meaningless while anything else runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import SMOKE_GRPO, SMOKE_HELP, SMOKE_THREADS, mean_band, smoke_dir, smoke_warm_starts
from transformers.utils import logging as hf_logging

from grpokit.algorithms.grpo import GRPOTrainer
from grpokit.config import GRPOConfig
from grpokit.resolve import BUILTIN, load_model_and_tokenizer
from grpokit.tasks.arithmetic import held_out_rows
from grpokit.tasks.demo import DEMO_CONFIG
from grpokit.tasks.warm_start import warm_started_model_path
from grpokit.training.evaluation import evaluate, summarize

OUTCOME = dict(supervision="outcome", reward_funcs=["accuracy", "format"])
VARIANTS: dict[str, dict] = {
    "outcome · sequence (paper)": dict(OUTCOME, aggregation="sequence"),
    "process · sequence": dict(supervision="process", aggregation="sequence",
                               reward_funcs=["arithmetic_steps", "format", "accuracy"], reward_weights=[1.0, 1.0, 0.0]),
    "outcome · token (DAPO)": dict(OUTCOME, aggregation="token"),
    "outcome · constant (Dr. GRPO)": dict(OUTCOME, aggregation="constant"),
}


def greedy_accuracy(model, tokenizer, rows, seed: int, max_new_tokens: int) -> dict[str, float]:
    scores = evaluate(model, tokenizer, rows, samples_per_prompt=0, max_new_tokens=max_new_tokens, seed=seed,
                      progress=False)
    carry = [row["carry"] for row in rows]
    return {"greedy": summarize(scores)["greedy_correct"], "carry_greedy": summarize(scores, carry)["greedy_correct"]}


def run(name: str, seed: int, budget: float, eval_every: int, out_dir: Path, settings: dict,
        held_out: int = 400) -> dict:
    """One variant's run from ``seed``'s warm start with the demo's ``settings``, evaluated on ``held_out``
    prompts at the end (and on half of them along the way)."""
    model, tokenizer = load_model_and_tokenizer(str(warm_started_model_path(seed, progress=False)), progress=False)
    curve_rows, final_rows = held_out_rows(held_out)[:held_out // 2], held_out_rows(held_out)
    config = GRPOConfig.from_dict({**settings, **VARIANTS[name], "model": "warm-start", "dataset": BUILTIN,
                                   "seed": seed, "output_dir": str(out_dir), "progress_bar": False})
    trainer = GRPOTrainer(config, model=model, tokenizer=tokenizer)
    length = config.max_completion_length
    evals = [{"step": 0, "seconds": 0.0, **greedy_accuracy(trainer.model, tokenizer, curve_rows, seed, length)}]
    steps, seconds = [], 0.0
    while trainer.step < config.max_steps and seconds < budget:
        start = time.perf_counter()
        metrics = trainer.training_step()
        seconds += time.perf_counter() - start
        steps.append({"step": trainer.step, "seconds": seconds, "accuracy": metrics["accuracy"],
                      "reward": metrics["accuracy"] + metrics["format_rate"], "format_rate": metrics["format_rate"]})
        if trainer.step % eval_every == 0:
            evals.append({"step": trainer.step, "seconds": seconds,
                          **greedy_accuracy(trainer.model, tokenizer, curve_rows, seed, length)})
    if evals[-1]["step"] != trainer.step:
        evals.append({"step": trainer.step, "seconds": seconds,
                      **greedy_accuracy(trainer.model, tokenizer, curve_rows, seed, length)})
    scores = evaluate(trainer.model, tokenizer, final_rows, samples_per_prompt=4, max_new_tokens=length, seed=seed,
                      progress=False)
    carry = [row["carry"] for row in final_rows]
    final = {**summarize(scores), "carry_greedy": summarize(scores, carry)["greedy_correct"]}
    return {"variant": name, "seed": seed, "steps": steps, "evals": evals, "final": final, "train_seconds": seconds}


def seconds_to(evals: list[dict], level: float) -> float | None:
    """Training seconds until held-out greedy accuracy first reaches ``level`` (linear interpolation)."""
    for before, after in zip(evals, evals[1:]):
        if after["greedy"] >= level:
            if before["greedy"] >= level:
                return before["seconds"]
            fraction = (level - before["greedy"]) / (after["greedy"] - before["greedy"])
            return before["seconds"] + fraction * (after["seconds"] - before["seconds"])
    return None


def table(records: list[dict], names: list[str], level: float) -> str:
    header = ["variant", "held-out greedy acc", "carry class greedy", "sampled acc (T=1)", "format (sampled)",
              f"s to {100 * level:.0f} % greedy", "steps", "s/step"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def spread(values: list[float], scale: float = 100.0, digits: int = 1) -> str:
        v = np.array(values) * scale
        return f"{v.mean():.{digits}f} ({v.min():.{digits}f}–{v.max():.{digits}f})"

    for name in names:
        runs = [r for r in records if r["variant"] == name]
        reach = [seconds_to(r["evals"], level) for r in runs]
        reach_text = spread([x for x in reach if x is not None], 1.0, 0) if all(x is not None for x in reach) else (
            f"{sum(x is not None for x in reach)}/{len(reach)} runs reach it")
        lines.append("| " + " | ".join([
            name,
            spread([r["final"]["greedy_correct"] for r in runs]),
            spread([r["final"]["carry_greedy"] for r in runs]),
            spread([r["final"]["sampled_correct"] for r in runs]),
            spread([r["final"]["sampled_format"] for r in runs]),
            reach_text,
            spread([len(r["steps"]) for r in runs], 1.0, 0),
            spread([r["train_seconds"] / len(r["steps"]) for r in runs], 1.0, 2),
        ]) + " |")
    return "\n".join(lines)


def plot(records: list[dict], names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("evals", "greedy", "held-out greedy accuracy"), ("steps", "accuracy", "training accuracy (sampled)"),
              ("steps", "reward", "training reward: accuracy + format")]
    fig, axes = plt.subplots(len(panels), 2, figsize=(12, 11), constrained_layout=True)
    for row, (series, key, label) in enumerate(panels):
        for col, x_key in enumerate(("step", "seconds")):
            ax = axes[row][col]
            for color, name in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], names):
                runs = [r[series] for r in records if r["variant"] == name]
                mean_band(ax, runs, x_key, key, color=color, label=name)
            ax.set_xlabel("training step" if x_key == "step" else "training wall seconds")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
    axes[0][0].legend(loc="lower right")
    seeds = sorted({r["seed"] for r in records})
    fig.suptitle(f"Built-in task, seeds {seeds}: mean over seeds, band = min–max")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--budget", type=float, default=60.0, help="training seconds per run")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--level", type=float, default=0.9, help="accuracy level for the time-to-reach column")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", default="benchmarks/results/compare_objectives.json")
    parser.add_argument("--figure", default="docs/images/compare_objectives.png")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    hf_logging.disable_progress_bar()
    torch.set_num_threads(SMOKE_THREADS if args.smoke else 2)
    settings, held_out = DEMO_CONFIG, 400
    if args.smoke:
        args.seeds, args.eval_every, settings, held_out = [0], 1, {**DEMO_CONFIG, **SMOKE_GRPO, "max_steps": 2}, 4
        args.out, args.figure = (str(smoke_dir() / name) for name in ("compare_objectives.json", "objectives.png"))
        smoke_warm_starts(args.seeds)

    for seed in args.seeds:  # build (or find) the warm starts first, outside every timing
        warm_started_model_path(seed, progress=False)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for name in args.variants:
                record = run(name, seed, args.budget, args.eval_every, Path(tmp) / f"{seed}-{len(records)}",
                             settings, held_out)
                records.append(record)
                print(f"seed {seed} {name}: {len(record['steps'])} steps in {record['train_seconds']:.0f} s, "
                      f"held-out greedy {100 * record['final']['greedy_correct']:.1f} %", flush=True)
    meta = {"seeds": args.seeds, "budget": args.budget, "eval_every": args.eval_every, "demo_config": settings,
            "torch": torch.__version__, "machine": platform.platform(), "threads": torch.get_num_threads()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "runs": records}, indent=1))
    plot(records, args.variants, Path(args.figure))
    print(table(records, args.variants, args.level))


if __name__ == "__main__":
    main()
