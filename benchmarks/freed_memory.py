"""Freed memory kept for the next step (``keep_freed_memory``): page faults and seconds per step, off and on.

    python benchmarks/freed_memory.py            # under a minute on 2 cores

On the CPU under Linux with glibc, the trainer sets glibc's malloc thresholds
(``grpokit.runtime.memory.keep_freed_memory``) so that the memory a step frees is reused by the next step instead
of being returned to the system and taken back one zeroed 4 KB page at a time. This measures what that
changes. For each setting, ``--rounds`` fresh processes (the setting is process-wide and cannot be
undone), alternating off and on, each:

- builds ``vs_trl.py``'s model for ``--config`` (``common.build``) and a trainer with its grpokit settings
  (4 prompts × G = 8, float32) and ``keep_freed_memory`` off or on;
- allocates and frees 16 tensors of 4 MB (a step's worth of large tensors) and counts the page faults
  that takes, median of 5 repetitions after one untimed;
- runs ``--warmup`` untimed steps and then ``--steps`` steps, recording for each the process's minor
  page faults (``ru_minflt``), the whole ``training_step()`` call's seconds and the update phase's
  (``time_update``).

Page faults are counts, but they depend on the machine's state (its kernel, its other tenants): read them
as orders of magnitude. Seconds per step are noisy on a shared machine: more ``--rounds`` pool more processes.
Writes ``benchmarks/results/freed_memory.json`` and prints the Markdown table for ``docs/memory.md``. Run it alone
on the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
from pathlib import Path

from common import BETA, CONFIGS, LR, SMOKE_HELP, SMOKE_THREADS, G, build, rows, run_worker, smoke_dir

from grpokit.runtime.device import cpu_model


def page_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def worker(job: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpokit.algorithms.grpo import GRPOTrainer
    from grpokit.config import GRPOConfig

    torch.set_num_threads(job["threads"])
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    _, prompts, new_tokens = CONFIGS[job["config"]]  # as vs_trl.py runs the config
    config = GRPOConfig.from_dict({
        "model": job["model"], "output_dir": job["out"], "device": "cpu", "prompts_per_step": prompts,
        "num_generations": G, "max_completion_length": new_tokens, "temperature": 1.0, "top_p": 1.0,
        "beta": BETA, "learning_rate": LR, "aggregation": "token", "micro_batch_size": prompts * G, "seed": 0,
        "max_steps": job["warmup"] + job["steps"], "progress_bar": False, "log_completions": 0,
        "reward_funcs": ["accuracy", "format"], "adam_beta2": 0.999, "max_grad_norm": 1.0,
        "keep_freed_memory": job["keep_freed_memory"], "mixed_precision": "no",
    })
    trainer = GRPOTrainer(config, model=model, tokenizer=tokenizer, train_dataset=rows())

    def tensors_freed_and_allocated_again() -> int:
        before = page_faults()
        tensors = [torch.ones(1 << 20) for _ in range(16)]  # 16 × 4 MB
        del tensors
        return page_faults() - before

    tensors_freed_and_allocated_again()
    synthetic = statistics.median(tensors_freed_and_allocated_again() for _ in range(5))
    faults, seconds, update = [], [], []
    for _ in range(config.max_steps):
        before = page_faults()
        metrics = trainer.training_step()
        faults.append(page_faults() - before)
        seconds.append(metrics["time_step"])
        update.append(metrics["time_update"])
    w = job["warmup"]
    return {"page_faults": faults[w:], "step_seconds": seconds[w:], "update_seconds": update[w:],
            "page_faults_16x4mb": synthetic}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="small", choices=list(CONFIGS))
    parser.add_argument("--rounds", type=int, default=1, help="processes per setting, alternating off and on")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="measured steps per process")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/freed_memory.json")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.smoke:
        args.config, args.rounds, args.warmup, args.steps, args.threads = "tiny", 1, 0, 1, SMOKE_THREADS
        args.out = str(smoke_dir() / "freed_memory.json")

    import torch

    script = str(Path(__file__).resolve())
    runs: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        build(args.config, Path(tmp) / "model")
        for r in range(args.rounds):
            for keep in (False, True) if r % 2 == 0 else (True, False):
                job = {"model": str(Path(tmp) / "model"), "out": str(Path(tmp) / f"run-{keep}-{r}"),
                       "config": args.config, "keep_freed_memory": keep, "warmup": args.warmup, "steps": args.steps,
                       "threads": args.threads}
                run = run_worker(script, job, inline=worker if args.smoke else None)
                runs[keep].append(run)
                print(f"keep_freed_memory={str(keep).lower()}: page faults per step "
                      f"{statistics.median(run['page_faults']):,.0f}, "
                      f"step {statistics.median(run['step_seconds']):.3f} s, "
                      f"update {statistics.median(run['update_seconds']):.3f} s, "
                      f"16 × 4 MB freed and allocated again: {run['page_faults_16x4mb']:,.0f} page faults", flush=True)
    summary = []
    for keep in (False, True):
        pooled = {k: [v for run in runs[keep] for v in run[k]]
                  for k in ("page_faults", "step_seconds", "update_seconds")}
        summary.append({
            "keep_freed_memory": keep,
            "page_faults_per_step": {"median": statistics.median(pooled["page_faults"]),
                                     "min": min(pooled["page_faults"]), "max": max(pooled["page_faults"])},
            "step_seconds_median": statistics.median(pooled["step_seconds"]),
            "update_seconds_median": statistics.median(pooled["update_seconds"]),
            "page_faults_16x4mb": statistics.median(run["page_faults_16x4mb"] for run in runs[keep]),
        })
    out = {"machine": {"platform": platform.platform(), "libc": list(platform.libc_ver()), "cpu": cpu_model(),
                       "threads": args.threads, "torch": torch.__version__},
           "args": vars(args), "summary": summary, "runs": {str(k).lower(): v for k, v in runs.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print()
    print(markdown(summary, args))


def markdown(summary: list[dict], args: argparse.Namespace) -> str:
    lines = ["| `keep_freed_memory` | page faults per step, median [min, max] | s/step, median | update s, median "
             "| page faults, 16 × 4 MB freed and allocated again |", "|---|---|---|---|---|"]
    for s in summary:
        f = s["page_faults_per_step"]
        lines.append(f"| {str(s['keep_freed_memory']).lower()} | {f['median']:,.0f} [{f['min']:,.0f}, {f['max']:,.0f}] "
                     f"| {s['step_seconds_median']:.3f} | {s['update_seconds_median']:.3f} "
                     f"| {s['page_faults_16x4mb']:,.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
