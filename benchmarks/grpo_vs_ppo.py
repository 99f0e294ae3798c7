"""GRPO vs PPO: memory, time per step by phase, and learning curves, measured side by side.

    python benchmarks/grpo_vs_ppo.py --seeds 0 1 2 --steps 60

For each model size, algorithm and seed, one fresh Python process (so that its peak RSS is its own)
trains with the demo's settings (16 prompts × G = 8 completions per step for both algorithms, 48 new
tokens, T = 1, β = 0.04, lr 2e-4) and reports:

- memory, counted: parameters (policy, reference, and PPO's value model), gradients (every trainable
  parameter), optimizer states (read from the optimizers), and activations (bytes autograd saves for
  backward in one micro-batch of 64 full-length sequences, the largest the step runs; PPO's policy and
  value passes run one after the other, so its peak is the larger of the two);
- memory, measured: the process's peak RSS, and its increase over the RSS before the model was built
  (on CUDA: ``torch.cuda.max_memory_allocated``);
- seconds per step by phase (the trainer's ``time_*`` metrics, first step excluded as warm-up);
- learning curves: training accuracy and reward against wall seconds, and held-out greedy accuracy at the
  end, for sizes that have a warm start (the built-in ``small``). Larger sizes start from random weights:
  their memory and time are real, their curves would be noise, so they run a few steps only, and never
  stop before ``max_completion_length`` (a random model's lengths would differ between the two runs).

Writes ``benchmarks/results/grpo_vs_ppo.json`` and ``docs/images/grpo_vs_ppo.png`` and prints the
Markdown tables for ``docs/benchmarks.md``. Needs matplotlib (``pip install -e .[plot]``). Run it alone.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
from common import (
    SIZES,
    SMOKE_GRPO,
    SMOKE_HELP,
    SMOKE_THREADS,
    counted_memory,
    mean_band,
    rss_mb,
    run_worker,
    smoke_dir,
    smoke_warm_starts,
)

PHASES = ("time_generate", "time_score", "time_frozen_logprobs", "time_update")


# ---- the worker: one size × algorithm × seed, in its own process ------------------------------------


def worker(job: dict) -> dict:
    import torch
    from transformers.utils import logging as hf_logging

    from grpokit.algorithms.grpo import GRPOTrainer
    from grpokit.config import GRPOConfig
    from grpokit.resolve import BUILTIN, load_model_and_tokenizer
    from grpokit.tasks.arithmetic import held_out_rows
    from grpokit.tasks.demo import DEMO_CONFIG
    from grpokit.tasks.tiny_model import TinyModelSpec, build_model, build_tokenizer
    from grpokit.tasks.warm_start import warm_started_model_path
    from grpokit.training.evaluation import evaluate, summarize

    hf_logging.disable_progress_bar()
    torch.set_num_threads(job["threads"])
    settings = {**DEMO_CONFIG, **job["overrides"]}
    fields, warm, _ = SIZES[job["size"]]
    spec = TinyModelSpec(**fields)
    if warm:  # built (and cached) before the RSS baseline, in the parent
        model, tokenizer = load_model_and_tokenizer(str(warm_started_model_path(job["seed"], spec, progress=False)),
                                                    progress=False)
    baseline = rss_mb()
    if not warm:
        tokenizer = build_tokenizer()
        model = build_model(tokenizer, spec, seed=job["seed"])
    cuda = job["device"].startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig.from_dict({**settings, "algorithm": job["algorithm"], "model": "benchmark",
                                       "dataset": BUILTIN, "seed": job["seed"], "output_dir": tmp,
                                       "progress_bar": False, "device": job["device"], "log_completions": 0,
                                       "mixed_precision": "no"})
        trainer = GRPOTrainer(config, model=model, tokenizer=tokenizer)
        if not warm:  # a random model stops at random: never stop, so both algorithms do the same work
            trainer.sampler.stop_ids = [-1]
        curve, seconds = [], 0.0
        for _ in range(job["steps"]):
            metrics = trainer.training_step()
            seconds += metrics["time_step"]
            curve.append({"step": trainer.step, "seconds": seconds, "accuracy": metrics["accuracy"],
                          "reward": metrics["reward"], **{k: metrics[k] for k in PHASES + ("time_step",)}})
        peak_cuda = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
        prompt_length = max(len(tokenizer(row["prompt"])["input_ids"]) for row in trainer.sampler.rows)
        counted = counted_memory(trainer, prompt_length)
        final = None
        if warm:
            scores = evaluate(trainer.model, tokenizer, held_out_rows(job["held_out"]), samples_per_prompt=0,
                              max_new_tokens=settings["max_completion_length"], progress=False)
            final = summarize(scores)["greedy_correct"]
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    parameters = {"policy": sum(p.numel() for p in trainer.model.parameters())}
    if trainer.critic is not None:
        parameters["value"] = sum(p.numel() for p in trainer.critic.value_model.parameters())
    return {**job, "spec": asdict(spec), "parameters": parameters, "curve": curve, "counted_mb": counted,
            "peak_rss_mb": peak_rss, "rss_before_model_mb": baseline, "peak_cuda_mb": peak_cuda,
            "held_out_greedy": final}


# ---- the parent: every job in turn, then the tables and the figure ----------------------------------


def phase_means(record: dict) -> dict[str, float]:
    steps = record["curve"][1:] or record["curve"]  # the first step warms up allocators and caches
    return {k: float(np.mean([s[k] for s in steps])) for k in PHASES + ("time_step",)}


def runs_of(records: list[dict], size: str, algorithm: str) -> list[dict]:
    return [r for r in records if r["size"] == size and r["algorithm"] == algorithm]


def mean_of(runs: list[dict], value) -> float:
    return float(np.mean([value(r) for r in runs]))


def rss_increase(record: dict) -> float:
    return record["peak_rss_mb"] - record["rss_before_model_mb"]


def step_seconds(record: dict) -> float:
    return phase_means(record)["time_step"]


def tables(records: list[dict]) -> str:
    sizes = list(dict.fromkeys(r["size"] for r in records))
    memory = ["| size | algorithm | parameters trained | counted: params / grads / Adam / activations = total (MB) "
              "| peak RSS (MB) | RSS over baseline (MB) | peak CUDA (MB) |", "|---|---|---|---|---|---|---|"]
    speed = ["| size | algorithm | s/step | generate | score | frozen log-probs (+ values) | update "
             "| held-out greedy acc at the end |", "|---|---|---|---|---|---|---|---|"]
    ratios = ["| size | GRPO / PPO counted memory | GRPO / PPO peak RSS over baseline | GRPO / PPO s/step |",
              "|---|---|---|---|"]
    for size in sizes:
        for algorithm in ("grpo", "ppo"):
            runs = runs_of(records, size, algorithm)
            c, cuda = runs[0]["counted_mb"], runs[0]["peak_cuda_mb"]
            memory.append(
                f"| {size} | {algorithm.upper()} | {sum(runs[0]['parameters'].values()) / 1e6:.2f} M "
                f"| {c['parameters']:.1f} / {c['gradients']:.1f} / {c['optimizer_states']:.1f} / "
                f"{c['activations']:.1f} = **{c['total']:.1f}** | {mean_of(runs, lambda r: r['peak_rss_mb']):.0f} "
                f"| {mean_of(runs, rss_increase):.0f} | {'—' if cuda is None else f'{cuda:.0f}'} |"
            )
            t = {k: mean_of(runs, lambda r, k=k: phase_means(r)[k]) for k in PHASES + ("time_step",)}
            acc = [100 * r["held_out_greedy"] for r in runs if r["held_out_greedy"] is not None]
            acc_text = f"{np.mean(acc):.1f} % ({min(acc):.1f}–{max(acc):.1f})" if acc else "—"
            speed.append(
                f"| {size} | {algorithm.upper()} | {t['time_step']:.2f} | {t['time_generate']:.2f} "
                f"| {t['time_score']:.2f} | {t['time_frozen_logprobs']:.2f} | {t['time_update']:.2f} | {acc_text} |"
            )
        cells = [mean_of(runs_of(records, size, "grpo"), value) / mean_of(runs_of(records, size, "ppo"), value)
                 for value in (lambda r: r["counted_mb"]["total"], rss_increase, step_seconds)]
        ratios.append(f"| {size} | " + " | ".join(f"{cell:.2f}" for cell in cells) + " |")
    return "\n\n".join("\n".join(table) for table in (memory, speed, ratios))


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"grpo": "tab:blue", "ppo": "tab:orange"}
    sizes = list(dict.fromkeys(r["size"] for r in records))
    fig, axes = plt.subplots(2, 2, figsize=(12, 9), constrained_layout=True)
    learned = [r for r in records if r["held_out_greedy"] is not None]
    for ax, key, label in ((axes[0][0], "accuracy", "training accuracy (sampled)"),
                           (axes[0][1], "reward", "training reward (accuracy + format)")):
        for algorithm, color in colors.items():
            runs = [r["curve"] for r in learned if r["algorithm"] == algorithm]
            if not runs:
                continue
            mean_band(ax, runs, "seconds", key, color=color, label=f"{algorithm.upper()} ({len(runs)} seeds)")
        ax.set_xlabel(f"training wall seconds ({', '.join(sorted({r['size'] for r in learned}))} model)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if learned:
            ax.legend()
        else:
            ax.text(0.5, 0.5, "no learning curves:\nrandom-init sizes only", ha="center", transform=ax.transAxes)

    # Bars relative to PPO's total at each size, so that sizes of very different scale share an axis.
    labels = [f"{size}\n{algorithm.upper()}" for size in sizes for algorithm in colors]
    bars = [(runs_of(records, size, algorithm), runs_of(records, size, "ppo"))
            for size in sizes for algorithm in colors]
    for ax, parts, value, ylabel in (
        (axes[1][0], ("parameters", "gradients", "optimizer_states", "activations"),
         lambda runs, part: mean_of(runs, lambda r: r["counted_mb"][part]), "counted memory / PPO's total"),
        (axes[1][1], PHASES, lambda runs, phase: mean_of(runs, lambda r: phase_means(r)[phase]),
         "seconds per step / PPO's"),
    ):
        bottoms = np.zeros(len(labels))
        for part in parts:
            heights = np.array([value(runs, part) / sum(value(ppo, p) for p in parts) for runs, ppo in bars])
            ax.bar(labels, heights, bottom=bottoms, label=part.removeprefix("time_"))
            bottoms += heights
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    fig.suptitle("GRPO vs PPO on the built-in task (same policy, data, B×G, lengths, seeds)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60, help="steps for sizes with a warm start")
    parser.add_argument("--sizes", nargs="+", default=["small", "medium"], choices=list(SIZES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/grpo_vs_ppo.json")
    parser.add_argument("--figure", default="docs/images/grpo_vs_ppo.png")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    overrides, held_out = {}, 400
    if args.smoke:
        args.seeds, args.steps, args.sizes, overrides, held_out = [0], 2, ["small", "tiny"], SMOKE_GRPO, 8
        args.threads = SMOKE_THREADS
        args.out, args.figure = str(smoke_dir() / "grpo_vs_ppo.json"), str(smoke_dir() / "grpo_vs_ppo.png")

    from grpokit.tasks.tiny_model import TinyModelSpec
    from grpokit.tasks.warm_start import warm_started_model_path

    records = []
    for size in args.sizes:
        fields, warm, steps = SIZES[size]
        seeds = args.seeds if warm else args.seeds[:1]  # random-init sizes: memory and time only
        for seed in seeds:
            if warm and args.smoke:
                smoke_warm_starts([seed], model_spec=TinyModelSpec(**fields))
            if warm:  # build the warm start outside every measurement
                warm_started_model_path(seed, TinyModelSpec(**fields), progress=False)
            for algorithm in ("grpo", "ppo"):
                job = {"size": size, "algorithm": algorithm, "seed": seed, "steps": steps or args.steps,
                       "device": args.device, "threads": args.threads, "overrides": overrides, "held_out": held_out}
                start = time.perf_counter()
                record = run_worker(__file__, job, inline=worker if args.smoke else None)
                records.append(record)
                print(f"{size} {algorithm} seed {seed}: {time.perf_counter() - start:.0f} s, counted "
                      f"{record['counted_mb']['total']:.1f} MB, peak RSS {record['peak_rss_mb']:.0f} MB", flush=True)
    import torch

    meta = {"seeds": args.seeds, "steps": args.steps, "device": args.device, "threads": args.threads,
            "torch": torch.__version__, "machine": platform.platform()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "runs": records}, indent=1))
    plot(records, Path(args.figure))
    print(tables(records))


if __name__ == "__main__":
    main()
