"""A GRPO training step of SmolLM2-135M's architecture (random weights) on a device: generation and update tokens/s,
each beside the bound the device sets, measured in the same run.

    python benchmarks/step_throughput.py --device cuda                         # a GPU: the bf16 variants below
    python benchmarks/step_throughput.py --prompts 2 --new_tokens 32 --steps 2  # a quick look on the CPU (float32)
    python benchmarks/step_throughput.py --device cuda --variants bf16_copy_graphs --profile  # where the time goes

- The step: ``GRPOTrainer.training_step`` as a run calls it (B prompts × G = 8 completions, β = 0.04, one optimizer
  step, AdamW), on prompts of ``--prompt_tokens`` tokens (the built-in character tokenizer) with random rewards:
  the step's cost depends on neither the weights' nor the rewards' values. No token stops a completion, so every
  completion is ``--new_tokens`` long. One warm-up step, then ``--steps`` timed; the phases are the trainer's own
  ``time_*`` metrics, means over the timed steps.
- Generation: tokens sampled per second of ``time_generate`` (prefill included), beside the decode roofline of
  ``decode_roofline.py`` (every weight and the rows' cached keys and values read once per step, in 2-byte bfloat16
  on bf16 variants: the bound of sampling in bfloat16, whatever copy the variant reads).
- Update: sequence tokens (prompt + completion) through the policy's forward and backward per second of
  ``time_update``, and its model FLOPs utilisation (MFU: 3 × a forward pass's FLOPs per second over the device's
  measured matmul peak; the forward as ``common.forward_flops``, its LM head on the completions' positions
  only, where log-probs are taken; recomputation not counted); likewise the reference model's forward.
- The peak: the best of a few large products in the variant's dtype (a GPU: 8192³), measured in the same run;
  bandwidth, a sum over 1 GiB (``common.machine_bounds``).

Variants (``--variants``): ``fp32`` (CPU default), and on CUDA ``bf16`` (mixed_precision: bf16: float32 weights,
passes under bfloat16 autocast), ``bf16_graphs`` (+ cuda_graphs: true), ``bf16_copy_graphs`` (+ rollout_precision:
bf16, sampling from a bfloat16 copy of the weights). Writes ``benchmarks/results/step_throughput[_DEVICE].json`` and
prints the Markdown table for docs/benchmarks.md. Run it alone.

``--profile``: no measurement; each variant's step under ``torch.profiler`` instead, after one warm-up step: the
device's busy time (its kernels' summed time) beside the wall time, for the sampling alone and for a whole step, and
the operators that keep the device busiest. On a GPU, busy ÷ wall far below 1 says the GPU waits on the host
(launches, syncs, Python); near 1 with a low MFU says the kernels themselves are slow (small shapes, float32 work,
memory-bound operators).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import (
    SMOKE_HELP,
    SMOKE_THREADS,
    SMOLLM2_135M,
    TINY_LLAMA,
    best_seconds,
    forward_flops,
    machine_bounds,
    roofline,
    smoke_dir,
    sync,
)
from torch.autograd import DeviceType
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from grpokit.algorithms.grpo import GRPOTrainer
from grpokit.config import GRPOConfig
from grpokit.runtime.device import cpu_model
from grpokit.tasks.tiny_model import build_tokenizer

VARIANTS = {  # name → config overrides
    "fp32": {"mixed_precision": "no"},
    "bf16": {"mixed_precision": "bf16"},
    "bf16_graphs": {"mixed_precision": "bf16", "cuda_graphs": True},
    "bf16_copy_graphs": {"mixed_precision": "bf16", "cuda_graphs": True, "rollout_precision": "bf16"},
}
PHASES = ("time_generate", "time_frozen_logprobs", "time_update", "time_step")


def dtype_of(variant: str) -> str:
    """The dtype a variant's bounds are taken in: the one its products run in."""
    return "float32" if variant == "fp32" else "bfloat16"


def gpu_peak(device: torch.device, dtype: torch.dtype) -> float:
    """A GPU's matmul throughput in ``dtype`` (GFLOP/s), the best of five 8192³ products: decode_roofline's 2048³
    product leaves a large GPU partly idle."""
    a = torch.randn(8192, 8192, dtype=dtype, device=device)
    torch.mm(a, a)
    return 2 * 8192**3 / best_seconds(lambda: torch.mm(a, a), device, 5) / 1e9


def random_reward(completions, **kwargs) -> list[float]:
    """Rewards with a spread, so that advantages are not all zero; their values do not change the step's cost."""
    return [random.random() for _ in completions]


def build_trainer(name: str, args: argparse.Namespace, device: torch.device, tokenizer, output_dir: str
                  ) -> GRPOTrainer:
    """The trainer of variant ``name`` on a fresh random SmolLM2-135M (``args.shape``), B = ``args.prompts`` prompts of
    ``args.prompt_tokens`` digits, every completion ``args.new_tokens`` long."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**args.shape))
    digits = random.Random(0)
    rows = [{"prompt": "".join(digits.choice("0123456789") for _ in range(args.prompt_tokens))}
            for _ in range(4 * args.prompts)]
    config = GRPOConfig.from_dict({
        "model": "benchmark", "output_dir": output_dir, "device": str(device), "seed": 0, "progress_bar": False,
        "log_completions": 0, "prompts_per_step": args.prompts, "num_generations": 8,
        "max_completion_length": args.new_tokens, "micro_batch_size": args.micro_batch_size, "beta": 0.04,
        "learning_rate": 1e-6, "max_steps": args.steps + 1, **VARIANTS[name]})
    trainer = GRPOTrainer(config, model=model, tokenizer=tokenizer, train_dataset=rows, reward_funcs=[random_reward])
    trainer.sampler.stop_ids = [-1]  # a random model stops at random: every completion runs to its length
    return trainer


def run_variant(name: str, args: argparse.Namespace, device: torch.device, tokenizer) -> dict:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(name, args, device, tokenizer, tmp)
        steps = [trainer.training_step() for _ in range(args.steps + 1)][1:]  # the first warms up
    model, rows = trainer.model, trainer.sampler.rows
    prompt = len(tokenizer(rows[0]["prompt"])["input_ids"])
    completions = args.prompts * 8
    times = {k: float(np.mean([s[k] for s in steps])) for k in PHASES}
    # the LM head runs on the completion's positions only (the log-probs of sampled tokens)
    c = model.config
    forward = (forward_flops(c, completions * (prompt + args.new_tokens), (prompt + args.new_tokens) / 2)
               - 2 * c.hidden_size * c.vocab_size * completions * prompt)
    return {"variant": name, "overrides": VARIANTS[name], "prompts": args.prompts, "completions": completions,
            "prompt_tokens": prompt, "new_tokens": args.new_tokens, **times,
            "generate_tokens_s": completions * args.new_tokens / times["time_generate"],
            "update_tokens_s": completions * (prompt + args.new_tokens) / times["time_update"],
            "update_flop_s": 3 * forward / times["time_update"],
            "reference_flop_s": forward / times["time_frozen_logprobs"],
            "peak_cuda_mb": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None,
            "steps": [{k: s[k] for k in PHASES} for s in steps]}


def profiled(call, label: str, device: torch.device, rows: int) -> None:
    """Run ``call`` under the profiler; print its wall time, the device's busy time and the top operators."""
    on_cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_cuda else [])
    sync(device)
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        call()
        sync(device)
        wall = time.perf_counter() - start
    averages = prof.key_averages()
    on_gpu = [e for e in averages if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    busy, kernels = sum(e.self_device_time_total for e in on_gpu) / 1e6, sum(e.count for e in on_gpu)
    print(f"\n== {label}: wall {wall:.3f} s (under the profiler), GPU busy {busy:.3f} s ({100 * busy / wall:.0f} %), "
          f"{kernels} GPU activities", flush=True)
    sort = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    print(averages.table(sort_by=sort, row_limit=rows, max_name_column_width=70), flush=True)


def profile_variant(name: str, args: argparse.Namespace, device: torch.device, tokenizer) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(name, args, device, tokenizer, tmp)
        trainer.training_step()  # warm-up
        label = f"{name}, {args.prompts} × 8 completions, {args.prompt_tokens} + {args.new_tokens} tokens"
        profiled(lambda: trainer.sampler.sample(trainer.step), f"{label}: sampling", device, args.top)
        metrics = {}
        profiled(lambda: metrics.update(trainer.training_step()), f"{label}: a whole step", device, args.top)
        print("the step's phases (s): " + ", ".join(f"{k} {metrics[k]:.3f}" for k in
                                                    ("time_generate", "time_frozen_logprobs", "time_update")))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS))
    parser.add_argument("--prompts", type=int, nargs="+", default=[16], help="B (prompts per step); G = 8")
    parser.add_argument("--prompt_tokens", type=int, default=128)
    parser.add_argument("--new_tokens", type=int, default=256)
    parser.add_argument("--micro_batch_size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="timed steps, after one warm-up step")
    parser.add_argument("--out")
    parser.add_argument("--profile", action="store_true", help="no measurement: each variant's step profiled")
    parser.add_argument("--top", type=int, default=18, help="--profile: operators printed per table")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; also profiles a step")
    args = parser.parse_args(argv)
    args.shape = SMOLLM2_135M
    if args.smoke:
        args.shape, args.prompts, args.prompt_tokens, args.new_tokens, args.micro_batch_size, args.steps, args.top = (
            TINY_LLAMA, [1], 4, 4, 8, 1, 5)
        args.out = str(smoke_dir() / "step_throughput.json")
        torch.set_num_threads(SMOKE_THREADS)
    device = torch.device(args.device)
    variants = args.variants or (["bf16", "bf16_graphs", "bf16_copy_graphs"] if device.type == "cuda" else ["fp32"])
    hf_logging.disable_progress_bar()
    tokenizer = build_tokenizer()
    if args.profile or args.smoke:
        for prompts in args.prompts:
            for name in variants:
                profile_variant(name, argparse.Namespace(**{**vars(args), "prompts": prompts}), device, tokenizer)
        if not args.smoke:
            return
    records = []
    for prompts in args.prompts:
        for name in variants:
            record = run_variant(name, argparse.Namespace(**{**vars(args), "prompts": prompts}), device, tokenizer)
            records.append(record)
            print(json.dumps({k: v for k, v in record.items() if k != "steps"}), flush=True)
    bounds = {}
    for dtype in sorted({dtype_of(r["variant"]) for r in records}):
        bounds[dtype] = machine_bounds(device, getattr(torch, dtype), smoke=args.smoke)
        if device.type == "cuda":
            bounds[dtype]["matmul_gflop_s"] = gpu_peak(device, getattr(torch, dtype))
    for r in records:
        dtype = dtype_of(r["variant"])
        bound, binds = roofline(r["completions"], r["prompt_tokens"], r["new_tokens"], getattr(torch, dtype).itemsize,
                                bounds[dtype], shape=args.shape)
        peak = bounds[dtype]["matmul_gflop_s"] * 1e9
        r.update(generate_bound_tokens_s=bound, generate_binds=binds, update_mfu=r["update_flop_s"] / peak,
                 reference_mfu=r["reference_flop_s"] / peak)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else None
    result = {"machine": {"cpu": cpu_model(), "platform": platform.platform(), "gpu": gpu,
                          "threads": torch.get_num_threads()},
              "torch": torch.__version__, "bounds": bounds, "records": records}
    suffix = "" if device.type == "cpu" else f"_{device.type}"
    out = Path(args.out or Path(__file__).parent / "results" / f"step_throughput{suffix}.json")
    out.write_text(json.dumps(result, indent=1))
    print(f"\n{gpu or cpu_model()}, torch {torch.__version__}; bounds: " + "; ".join(
        f"{d}: {b['bandwidth_gb_s']:.0f} GB/s, {b['matmul_gflop_s'] / 1000:.1f} TFLOP/s" for d, b in bounds.items()))
    print("\n| variant | B × G | step, s (generate / reference / update) | generation, tokens/s (% of bound) "
          "| update, tokens/s (MFU) | reference MFU | peak CUDA, GiB |")
    print("|---|---|---|---|---|---|---|")
    for r in records:
        peak = f"{r['peak_cuda_mb'] / 1024:.1f}" if r["peak_cuda_mb"] is not None else "—"
        print(f"| {r['variant']} | {r['prompts']} × 8 | {r['time_step']:.2f} ({r['time_generate']:.2f} / "
              f"{r['time_frozen_logprobs']:.2f} / {r['time_update']:.2f}) | {r['generate_tokens_s']:.0f} "
              f"({100 * r['generate_tokens_s'] / r['generate_bound_tokens_s']:.1f} %) | {r['update_tokens_s']:.0f} "
              f"({100 * r['update_mfu']:.1f} %) | {100 * r['reference_mfu']:.1f} % | {peak} |")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
