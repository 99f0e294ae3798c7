"""DDP and FSDP2 on every GPU this machine has (NCCL), with a checkpoint and a resume: each parallelism trains a
random-weight Llama (built from a config, nothing downloaded) for ``--steps`` steps straight, and again in two launches
(half the steps, then ``--resume latest`` in new processes); the resumed run must end bit-identical to the straight
one. Prints a pass/fail table with tokens/s and writes it to ``--out``.

    python3 scripts/distributed_check.py                         # every GPU nvidia-smi lists (1 GPU: one process)
    python3 scripts/distributed_check.py --cpu --processes 2     # the same with gloo on the CPU, on any machine
    python3 scripts/distributed_check.py --dry-run               # the plan and the commands only

On CUDA the workers ask torch for deterministic kernels (``torch.use_deterministic_algorithms``, warn only), so that two
runs can agree bit for bit; where a kernel has no deterministic form, the table gives the largest difference instead of
"bit-exact". tokens/s: completion tokens of the whole step (every process) per second of ``time_step``, the mean over
the straight run's steps after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from grpokit.runtime.processes import run_or_kill

ROOT = Path(__file__).resolve().parents[1]
PARALLELISMS = ("ddp", "fsdp")
PROMPTS, GROUP = 4, 4  # prompts per process and step, completions per prompt
SIZES = {"tiny": dict(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_positions=64),
         "small": dict(hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1408, max_positions=256)}


def worker(legs: list[list]) -> None:
    """Under torchrun: each leg [output_dir, steps, resume, parallelism, size, device] trains a fresh trainer, on
    PROMPTS prompts per process and step."""
    import torch

    if torch.cuda.is_available():  # before any CUDA work: cuBLAS reads it when it starts
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    from grpokit import GRPOConfig, GRPOTrainer
    from grpokit.tasks.tiny_model import TinyModelSpec, build_model, build_tokenizer

    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]

    def digits(prompts, completions, **kwargs):
        return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in completions]

    for out, steps, resume, parallelism, size, device in legs:
        tokenizer = build_tokenizer()
        world = int(os.environ.get("WORLD_SIZE", "1"))
        config = GRPOConfig(output_dir=out, prompts_per_step=PROMPTS * world, num_generations=GROUP,
                            max_completion_length=16,
                            max_steps=steps, learning_rate=1e-3, lr_schedule="constant", save_every=1,
                            progress_bar=False, resume=resume or None, parallelism=parallelism, device=device,
                            seed=0)
        model = build_model(tokenizer, TinyModelSpec(**SIZES[size]), seed=0)
        GRPOTrainer(config, model=model, tokenizer=tokenizer, train_dataset=rows, reward_funcs=[digits]).train()


def launch(processes: int, legs: list[list], env: dict[str, str], timeout: int) -> tuple[int, str]:
    """torchrun (a free port); past ``timeout`` it is killed with every process it started."""
    import socket

    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={processes}",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=localhost:{port}", str(Path(__file__).resolve()),
               "--worker", json.dumps(legs)]
    done, timed_out = run_or_kill(command, env, timeout, merge_stderr=True)
    if timed_out:
        return -1, f"{done.stdout}\n(killed after {timeout} s)"
    return done.returncode, done.stdout


def compare(straight: Path, resumed: Path) -> str:
    """'bit-exact', or the largest absolute difference between the final weights."""
    from safetensors.torch import load_file

    a, b = (load_file(str(run / "model" / "model.safetensors")) for run in (straight, resumed))
    if a.keys() != b.keys():
        return "different tensors"
    worst = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    return "bit-exact" if all(a[k].dtype == b[k].dtype and a[k].equal(b[k]) for k in a) else f"max |diff| {worst:.3g}"


def tokens_per_second(run: Path, processes: int) -> float | None:
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][1:]
    rates = [m["completion_length_mean"] * PROMPTS * processes * GROUP / m["time_step"] for m in steps]
    return sum(rates) / len(rates) if rates else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU, whatever GPUs there are")
    parser.add_argument("--processes", type=int, help="default: the GPU count (--cpu: 2)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--size", choices=SIZES, help="default: small on GPUs, tiny on the CPU")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check")) / "distributed")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the launches; run nothing")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return 0

    gpus = 0 if args.cpu else _gpu_count()
    device, size = ("cuda", args.size or "small") if gpus else ("cpu", args.size or "tiny")
    processes = args.processes or gpus or 2
    backend = "none (one process)" if processes == 1 else ("nccl" if gpus else "gloo")
    if processes < 1:
        parser.error("--processes must be at least 1")
    half = max(1, args.steps // 2)
    runs = {p: {leg: args.out / f"{p}-{leg}" for leg in ("straight", "resumed")} for p in PARALLELISMS}
    first = [[str(runs[p]["straight"]), args.steps, "", p, size, device] for p in PARALLELISMS] + \
            [[str(runs[p]["resumed"]), half, "", p, size, device] for p in PARALLELISMS]
    second = [[str(runs[p]["resumed"]), args.steps, "latest", p, size, device] for p in PARALLELISMS]
    print(f"{processes} process(es), backend {backend}, device {device}, model {size}, {args.steps} steps "
          f"(resumed after {half}); runs in {args.out}")
    if args.dry_run:
        for legs in (first, second):
            print(f"torchrun --nproc_per_node {processes} {Path(__file__).name} --worker '{json.dumps(legs)}'")
        return 0

    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("WORLD_SIZE", None)
    if not gpus:
        env.setdefault("OMP_NUM_THREADS", "1")
    rows, failed = [], False
    for name, legs in (("straight + first half", first), ("resume", second)):
        code, output = launch(processes, legs, env, args.timeout)
        (args.out / f"{name.split()[0]}.log").write_text(output)
        if code != 0:
            print(f"FAIL: the {name} launch exited with {code}; its output: {args.out / name.split()[0]}.log\n"
                  f"{output[-3000:]}")
            failed = True
            break
    for p in PARALLELISMS:
        done = all((run / "model" / "model.safetensors").is_file() for run in runs[p].values())
        result = compare(runs[p]["straight"], runs[p]["resumed"]) if done and not failed else "not run"
        rate = tokens_per_second(runs[p]["straight"], processes) if done else None
        ok = result == "bit-exact"
        failed |= not ok
        rows.append(f"| {p} | {backend} | {processes} | {'PASS' if ok else 'FAIL'} | {result} | "
                    f"{f'{rate:.0f}' if rate else '—'} |")
    table = "\n".join(["| parallelism | backend | processes | result | resumed vs straight | tokens/s |",
                       "|---|---|---|---|---|---|", *rows])
    print(table)
    (args.out / "table.md").write_text(table + "\n")
    print("FAIL" if failed else "PASS")
    return 1 if failed else 0


def _gpu_count() -> int:
    try:
        listed = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return len([line for line in listed.stdout.splitlines() if line.startswith("GPU ")]) if listed.returncode == 0 \
        else 0


if __name__ == "__main__":
    sys.exit(main())
