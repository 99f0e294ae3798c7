"""LoRA vs full fine-tuning: the memory GRPO holds, counted and measured, in one invocation.

    python benchmarks/lora_memory.py --sizes medium large

For each size (random weights: memory does not depend on them) and mode, one fresh process builds the
trainer, runs 2 GRPO steps (2 prompts × 4 completions, 8 new tokens, micro-batches of 4) and reports
the counted memory — parameters (policy + reference: full fine-tuning holds a frozen copy, LoRA none,
its reference being the base with the adapter disabled), gradients and Adam states of what trains,
activations of one full-length micro-batch — and the process's peak RSS over its RSS before the
model was built. LoRA: rank 8 on every attention and MLP projection. Run it alone.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
from pathlib import Path

from common import SIZES, SMOKE_HELP, SMOKE_THREADS, counted_memory, rss_mb, run_worker, smoke_dir

LORA = dict(lora_rank=8, lora_alpha=16.0,
            lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def worker(job: dict) -> dict:
    import torch

    from grpokit.algorithms.grpo import GRPOTrainer
    from grpokit.config import GRPOConfig
    from grpokit.resolve import BUILTIN
    from grpokit.tasks.tiny_model import TinyModelSpec, build_model, build_tokenizer

    torch.set_num_threads(job["threads"])
    baseline = rss_mb()
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, TinyModelSpec(**SIZES[job["size"]][0]), seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig.from_dict({
            "dataset": BUILTIN, "model": "benchmark", "output_dir": tmp, "prompts_per_step": 2, "num_generations": 4,
            "max_completion_length": 8, "micro_batch_size": 4, "max_steps": 2, "progress_bar": False,
            "log_completions": 0, "mixed_precision": "no", **(LORA if job["mode"] == "lora" else {}),
        })
        trainer = GRPOTrainer(config, model=model, tokenizer=tokenizer)
        for _ in range(2):
            trainer.training_step()
        counted = counted_memory(trainer, prompt_length=16)
    trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return {**job, "trained_parameters": trained, "counted_mb": counted,
            "peak_rss_over_baseline_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - baseline}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["medium", "large"], choices=list(SIZES))
    parser.add_argument("--out", default="benchmarks/results/lora_memory.json")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.smoke:
        args.sizes, args.out = ["tiny"], str(smoke_dir() / "lora_memory.json")
    records = []
    for size in args.sizes:
        for mode in ("full", "lora"):
            job = {"size": size, "mode": mode, "threads": SMOKE_THREADS if args.smoke else 2}
            records.append(run_worker(__file__, job, inline=worker if args.smoke else None))
            print(f"{size} {mode}: {records[-1]['counted_mb']['total']:.1f} MB counted", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(records, indent=1))
    print("| size | mode | parameters trained | counted: params / grads / Adam / activations = total (MB) "
          "| peak RSS over baseline (MB) |\n|---|---|---|---|---|")
    for r in records:
        c = r["counted_mb"]
        print(f"| {r['size']} | {r['mode']} | {r['trained_parameters'] / 1e6:.2f} M | {c['parameters']:.1f} / "
              f"{c['gradients']:.1f} / {c['optimizer_states']:.1f} / {c['activations']:.1f} = **{c['total']:.1f}** "
              f"| {r['peak_rss_over_baseline_mb']:.0f} |")


if __name__ == "__main__":
    main()
