"""Where a GRPO step's time goes on a GPU: ``benchmarks/step_throughput.py``'s step under ``torch.profiler``, the
GPU's busy time (its kernels' summed time) beside the wall time, for the sampling alone and for a whole step, and
the operators that keep the GPU busiest.

    python benchmarks/dev/profile_cuda.py --variant bf16_copy_graphs --prompts 16 64

Busy ÷ wall far below 1 says the GPU waits on the host (launches, syncs, Python); near 1 with a low MFU says the
kernels themselves are slow (small shapes, float32 work, memory-bound operators). One warm-up step first.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: step_throughput.py, common.py
import torch  # noqa: E402
from step_throughput import VARIANTS, build_trainer  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402

from grpokit.tasks.tiny_model import build_tokenizer  # noqa: E402


def profiled(call, label: str, rows: int) -> None:
    """Run ``call`` under the profiler; print its wall time, the GPU's busy time and the top operators."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    averages = prof.key_averages()
    on_gpu = [e for e in averages if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    busy, kernels = sum(e.self_device_time_total for e in on_gpu) / 1e6, sum(e.count for e in on_gpu)
    print(f"\n== {label}: wall {wall:.3f} s (under the profiler), GPU busy {busy:.3f} s ({100 * busy / wall:.0f} %), "
          f"{kernels} GPU activities", flush=True)
    print(averages.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=70), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", default="bf16_copy_graphs", choices=list(VARIANTS))
    parser.add_argument("--prompts", type=int, nargs="+", default=[16])
    parser.add_argument("--prompt_tokens", type=int, default=128)
    parser.add_argument("--new_tokens", type=int, default=256)
    parser.add_argument("--micro_batch_size", type=int, default=64)
    parser.add_argument("--rows", type=int, default=18, help="operators printed per table")
    args = parser.parse_args()
    device, tokenizer = torch.device("cuda"), build_tokenizer()
    for prompts in args.prompts:
        profile_step(argparse.Namespace(**{**vars(args), "prompts": prompts, "steps": 2}), device, tokenizer)


def profile_step(args: argparse.Namespace, device: torch.device, tokenizer) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(args.variant, args, device, tokenizer, tmp)
        trainer.training_step()  # warm-up
        label = f"{args.variant}, {args.prompts} × 8 completions, {args.prompt_tokens} + {args.new_tokens} tokens"
        profiled(lambda: trainer.sampler.sample(trainer.step),
                 f"{label}: sampling", args.rows)
        metrics = {}
        profiled(lambda: metrics.update(trainer.training_step()), f"{label}: a whole step", args.rows)
        print("the step's phases (s): " + ", ".join(f"{k} {metrics[k]:.3f}" for k in
                                                    ("time_generate", "time_frozen_logprobs", "time_update")))


if __name__ == "__main__":
    main()
