"""The reference model's memory per process under FSDP2 (``reference_placement``), against the whole copy every
process held before: bytes counted, and peak RSS measured, with 1, 2 and 4 processes.

    python benchmarks/reference_memory.py                      # medium and wide, 1 / 2 / 4 processes

For each size (random weights: memory does not depend on them), each number of processes W and each placement, one
fresh launch (``torchrun --nproc_per_node W``, gloo on the CPU; W = 1: a plain process, where the reference is a whole
copy whatever the placement) builds a GRPO trainer with ``parallelism: fsdp`` and runs one step (4 prompts × 2
completions, 8 new tokens: the reference's pass included). Each process reports the bytes of the reference's
parameters it holds after the step (its shards: DTensor's local tensors; by device), the policy's likewise, and its
peak RSS over its RSS before the model was built; the record keeps every rank's, the table the largest. The counted
bytes are exact and the same on any machine; the RSS is this machine's (the policy is loaded whole on every process
before it is sharded, so the peak holds one whole policy whatever the placement). Run it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from common import SIZES, SMOKE_HELP, SMOKE_THREADS, rss_mb, run_worker, smoke_dir

# ~113 M parameters (453 MB in float32), beside common's medium (6.3 M): the reference shows above the RSS's noise
WIDE = dict(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072)
PLACEMENTS = ("replicate", "shard", "cpu_offload")


def spec_of(size: str) -> dict:
    return WIDE if size == "wide" else SIZES[size][0]


def worker(job: dict) -> dict:
    import torch

    from grpokit.algorithms.grpo import GRPOTrainer
    from grpokit.config import GRPOConfig
    from grpokit.models.sharding import local
    from grpokit.resolve import BUILTIN
    from grpokit.tasks.tiny_model import TinyModelSpec, build_model, build_tokenizer

    torch.set_num_threads(job["threads"])
    baseline = rss_mb()
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, TinyModelSpec(**spec_of(job["size"])), seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig.from_dict({
            "dataset": BUILTIN, "model": "benchmark", "output_dir": tmp, "prompts_per_step": 4, "num_generations": 2,
            "max_completion_length": 8, "micro_batch_size": 8, "max_steps": 1, "progress_bar": False,
            "log_completions": 0, "mixed_precision": "no", "save_every": 0, "parallelism": "fsdp",
            "reference_placement": job["placement"],
        })
        trainer = GRPOTrainer(config, model=model, tokenizer=tokenizer)
        trainer.training_step()

        def held(module: torch.nn.Module) -> dict[str, int]:
            by_device: dict[str, int] = {}
            for parameter in module.parameters():
                shard = local(parameter)
                kind = shard.device.type
                by_device[kind] = by_device.get(kind, 0) + shard.numel() * shard.element_size()
            return by_device

        record = {**job, "rank": trainer.world.rank, "reference_bytes": held(trainer.reference.model),
                  "policy_bytes": held(trainer.model),
                  # a DTensor's numel is the whole parameter's
                  "whole_copy_bytes": sum(p.numel() * p.element_size() for p in trainer.reference.model.parameters()),
                  "peak_rss_over_baseline_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - baseline}
    return record  # the process group is destroyed at exit (grpokit.training.distributed)


def launch(job: dict) -> list[dict]:
    """Every rank's record of ``job`` (``job["processes"]`` processes under torchrun; one: a plain process)."""
    if job["processes"] == 1:
        return [run_worker(__file__, job)]
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={job['processes']}",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=localhost:{port}", __file__, "--worker", json.dumps(job)]
    env = {**os.environ, "OMP_NUM_THREADS": str(job["threads"])}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        sys.exit(f"{job} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["medium", "wide"], choices=[*SIZES, "wide"])
    parser.add_argument("--processes", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--out", default="benchmarks/results/reference_memory.json")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    if args.smoke:  # one process, in this one: a smoke run checks the worker, not torchrun
        args.sizes, args.processes, args.out = ["tiny"], [1], str(smoke_dir() / "reference_memory.json")
    records = []
    for size in args.sizes:
        for processes in args.processes:
            for placement in PLACEMENTS[:1] if processes == 1 else PLACEMENTS:
                job = {"size": size, "processes": processes, "placement": placement,
                       "threads": SMOKE_THREADS if args.smoke else 1}
                ranks = [worker(job)] if args.smoke else launch(job)
                records.append({**job, "ranks": sorted(ranks, key=lambda r: r["rank"])})
                print(f"{size} W={processes} {placement}: {max(sum(r['reference_bytes'].values()) for r in ranks)} "
                      "reference bytes on the fullest process", flush=True)
    from grpokit.runtime.device import cpu_model

    result = {"machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "platform": platform.platform()},
              "records": records}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("| size | processes | reference | reference MB per process (CPU / device) | policy MB per process "
          "| peak RSS over baseline (MB, largest rank) |\n|---|---|---|---|---|---|")
    for r in records:
        fullest = max(r["ranks"], key=lambda rank: sum(rank["reference_bytes"].values()))
        ref, pol = fullest["reference_bytes"], fullest["policy_bytes"]
        mb = lambda b, kind: b.get(kind, 0) / 2**20  # noqa: E731
        print(f"| {r['size']} | {r['processes']} | {r['placement'] if r['processes'] > 1 else 'whole (one process)'} "
              f"| {mb(ref, 'cpu'):.1f} / {mb(ref, 'cuda'):.1f} | {sum(pol.values()) / 2**20:.1f} "
              f"| {max(rank['peak_rss_over_baseline_mb'] for rank in r['ranks']):.0f} |")


if __name__ == "__main__":
    main()
