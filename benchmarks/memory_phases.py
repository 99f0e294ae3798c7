"""Where a grpokit step's peak memory is: per phase of each step, the peak resident set (what ``vs_trl.py``
reports) beside the peak of glibc's in-use heap (``mallinfo2``: what live tensors and objects hold).

    python benchmarks/memory_phases.py --config smollm2 --mode bf16 gradient_checkpointing=true
    python benchmarks/memory_phases.py --config smollm2 --mode bf16 gradient_checkpointing=true optimizer=adamw_8bit

Builds ``vs_trl.py``'s model and grpokit settings (``common.build``, ``common.grpokit_settings``; ``KEY=VALUE``
arguments override the config), runs ``--steps`` steps, and samples both every few milliseconds from a thread. The
phases: ``sample`` (generation and rewards), ``reference`` (π_ref's pass), ``update`` (the policy's passes, backward
and the optimizer step; with it the rest of the step). The gap between the two columns is what the heap's free
memory, the model's memory-mapped weights and the runtime's own mappings add. Linux with glibc only.
"""

from __future__ import annotations

import argparse
import ctypes
import resource
import threading
import time
from pathlib import Path

import yaml
from common import CONFIGS, SMOKE_HELP, SMOKE_THREADS, build, grpokit_settings, rows


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="smollm2", choices=list(CONFIGS))
    parser.add_argument("--mode", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        args.config, args.mode, args.steps = "tiny", "fp32", 1

    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpokit.algorithms.grpo import GRPOTrainer
    from grpokit.config import GRPOConfig

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    page = resource.getpagesize()

    def resident_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page / 2**20

    def heap_in_use_mb() -> float:
        info = libc.mallinfo2()
        return (info.uordblks + info.hblkhd) / 2**20

    phase, peaks, done = ["setup"], {}, threading.Event()

    def watch() -> None:
        while not done.is_set():
            rss, heap = resident_mb(), heap_in_use_mb()
            old = peaks.get(phase[0], (0.0, 0.0))
            peaks[phase[0]] = (max(old[0], rss), max(old[1], heap))
            time.sleep(0.005)

    def as_phase(obj, name: str, label: str) -> None:
        real = getattr(obj, name)

        def wrapped(*a, **k):
            previous, phase[0] = phase[0], label
            try:
                return real(*a, **k)
            finally:
                phase[0] = previous
        setattr(obj, name, wrapped)

    torch.set_num_threads(SMOKE_THREADS if args.smoke else 2)
    with tempfile.TemporaryDirectory() as scratch:
        directory = str(build(args.config, Path(scratch) / "model"))
        tokenizer = AutoTokenizer.from_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        overrides = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.overrides)}
        config = GRPOConfig.from_dict(grpokit_settings(args.config, args.mode, directory, str(Path(scratch) / "run"),
                                                       args.steps, overrides))
        trainer = GRPOTrainer(config, model=model, tokenizer=tokenizer, train_dataset=rows())
        as_phase(trainer.sampler, "sample", "sample")
        as_phase(trainer, "reference_logprobs", "reference")
        threading.Thread(target=watch, daemon=True).start()
        print(f"{args.config} {args.mode} {overrides}: MB, peak resident / peak heap in use")
        for step in range(1, args.steps + 1):
            peaks.clear()
            phase[0] = "update"
            start = time.perf_counter()
            trainer.training_step()
            seconds = time.perf_counter() - start
            cells = "  ".join(f"{name} {rss:,.0f} / {heap:,.0f}" for name, (rss, heap) in sorted(peaks.items()))
            print(f"step {step} ({seconds:.1f} s): {cells}", flush=True)
        done.set()
    print(f"peak resident set of the process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MB")


if __name__ == "__main__":
    main()
