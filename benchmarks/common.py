"""Shared by the benchmark scripts: measurement workers in fresh processes, mean-and-spread curves, a git
revision's source, the CPU's model."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path
from typing import Any

import numpy as np

# SmolLM2-135M-Instruct's architecture (its config.json), for benchmarks that build it with random weights
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def mean_band(ax, runs: list[list[dict]], x_key: str, y_key: str, *, color: str, label: str, points: int = 80) -> None:
    """Plot the mean over ``runs`` of ``y_key`` against ``x_key`` and a min–max band, each run
    interpolated linearly on a common grid over the range that every run covers."""
    grid = np.linspace(max(run[0][x_key] for run in runs), min(run[-1][x_key] for run in runs), points)
    ys = np.array([np.interp(grid, [p[x_key] for p in run], [p[y_key] for p in run]) for run in runs])
    ax.plot(grid, ys.mean(axis=0), color=color, label=label)
    ax.fill_between(grid, ys.min(axis=0), ys.max(axis=0), color=color, alpha=0.15)


def run_worker(script: str, job: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``script --worker JOB`` in a fresh Python process (so that its peak RSS is its own; ``env``: its
    environment, default this one's) and return the JSON record it prints last; a failing worker stops the
    benchmark with its stderr."""
    done = subprocess.run([sys.executable, script, "--worker", json.dumps(job)], capture_output=True, text=True,
                          env=env)
    if done.returncode != 0:
        sys.exit(f"worker {job} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def export_source(revision: str, into: Path) -> Path:
    """``revision``'s ``src/grpokit`` written under ``into`` (as ``into/src/grpokit``); returns ``into/src``."""
    repo = Path(__file__).resolve().parents[1]
    archive = subprocess.run(["git", "-C", str(repo), "archive", revision, "src/grpokit"], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def cpu_model() -> dict:
    """The CPU's model name and the bfloat16-related flags it reports (Linux: /proc/cpuinfo)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"model": platform.processor(), "bf16_flags": None}
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {"model": fields.get("model name", ""), "family": fields.get("cpu family"),
            "model_number": fields.get("model"),
            "bf16_flags": sorted(flags & {"avx512_bf16", "amx_bf16", "avx_ne_convert"})}
