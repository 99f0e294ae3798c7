"""Log-probs through the LM head in chunks (``logprob_chunk_mb``) vs the full logits: peak memory of one pass.

    python benchmarks/logprob_memory.py            # ~10 min on 2 cores → benchmarks/results/logprob_memory.json

A Llama built from SmolLM2-135M's config (vocabulary 49,152, hidden 576, 30 layers, 9 query and 3 key/value
heads, FFN 1536, tied embeddings), random weights (memory does not depend on them), float32, and one
micro-batch: 2 prompts of 32 tokens × G = 8 completions of 128 tokens, every token scored (K = 2,048). Each
variant runs in a fresh process, which builds the model and the batch, then resets its peak RSS (Linux:
``/proc/self/clear_refs``) and runs one pass of ``grpokit.models.logprobs.sequence_logprobs``:

- **policy**: with gradient, ``logp.sum().backward()``; the parameters' gradients are allocated before the
  pass (as in training after the first step), so the rise is what the pass itself holds;
- **reference**: under ``no_grad`` (π_ref and π_old), the model in eval mode;

on the fast path (grpokit's forward for Llama-family models, the default) and the model's own forward
(``fast_path: false``), with ``logprob_chunk_mb: 0`` (the full (K, V) logits) and the default (64 MiB chunks:
341 tokens). Reported: the peak RSS during the pass minus the RSS before it. Memory only (no timing). Run it
alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from common import SMOKE_HELP, SMOKE_THREADS, SMOLLM2_135M, TINY_LLAMA, run_worker, smoke_dir

from grpokit.runtime.device import cpu_model

PROMPTS, G, PROMPT_TOKENS, COMPLETION_TOKENS = 2, 8, 32, 128


def status_mb(key: str) -> float:
    """A line of /proc/self/status (VmRSS: now; VmHWM: the peak since the last reset), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} in /proc/self/status (this benchmark needs Linux)")


def worker(job: dict) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpokit.models.logprobs import full_logits_reason, sequence_logprobs

    torch.set_num_threads(job["threads"])
    torch.manual_seed(0)
    shape = {**job["shape"], "num_hidden_layers": job["layers"]}
    model = LlamaForCausalLM(LlamaConfig(**shape)).float()
    gen = torch.Generator().manual_seed(0)
    n, vocab = PROMPTS * G, shape["vocab_size"]
    prompt_ids = torch.randint(3, vocab, (PROMPTS, PROMPT_TOKENS), generator=gen).repeat_interleave(G, dim=0)
    completion_ids = torch.randint(3, vocab, (n, COMPLETION_TOKENS), generator=gen)
    batch = (prompt_ids, torch.ones_like(prompt_ids), completion_ids, torch.ones_like(completion_ids))
    policy = job["pass"] == "policy"
    model.train(policy)
    if policy:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    chunked = full_logits_reason(model, job["chunk_mb"], job["fast"]) is None
    before = status_mb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    with torch.set_grad_enabled(policy):
        logp, _ = sequence_logprobs(model, *batch, fast=job["fast"], chunk_mb=job["chunk_mb"])
        if policy:
            logp.sum().backward()
    peak = status_mb("VmHWM")
    return {**job, "chunked": chunked, "tokens": int(batch[3].sum()), "rss_before_mb": before,
            "peak_rise_mb": peak - before, "logp_sum": float(logp.sum())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2-135M: 30)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk-mb", type=float, default=64.0, help="the chunked rows' logprob_chunk_mb")
    parser.add_argument("--out", default="benchmarks/results/logprob_memory.json")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    shape = SMOLLM2_135M
    if args.smoke:  # chunks small enough that the tiny model's logits still come in several
        shape, args.layers, args.chunk_mb, args.threads = TINY_LLAMA, 1, 0.05, SMOKE_THREADS
        args.out = str(smoke_dir() / "logprob_memory.json")
    import torch
    import transformers

    records = []
    for pass_ in ("policy", "reference"):
        for fast in (True, False):
            for chunk_mb in (0.0, args.chunk_mb):
                job = {"pass": pass_, "fast": fast, "chunk_mb": chunk_mb, "layers": args.layers,
                       "threads": args.threads, "shape": shape}
                records.append(run_worker(__file__, job, inline=worker if args.smoke else None))
                print(f"{pass_} fast={fast} chunk_mb={chunk_mb}: +{records[-1]['peak_rise_mb']:.0f} MB", flush=True)
    tokens = records[0]["tokens"]
    out = {"machine": {"platform": platform.platform(), "cpu": cpu_model(), "threads": args.threads,
                       "python": platform.python_version(), "torch": torch.__version__,
                       "transformers": transformers.__version__},
           "model": {**shape, "num_hidden_layers": args.layers}, "batch": {
               "prompts": PROMPTS, "num_generations": G, "prompt_tokens": PROMPT_TOKENS,
               "completion_tokens": COMPLETION_TOKENS, "scored_tokens": tokens},
           "full_logits_mb": tokens * shape["vocab_size"] * 4 / 2**20, "records": records}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\nfull logits of the micro-batch: {out['full_logits_mb']:.0f} MB (float32)\n")
    print(markdown(records))


def markdown(records: list[dict]) -> str:
    by = {(r["pass"], r["fast"], r["chunked"]): r["peak_rise_mb"] for r in records}
    lines = ["| pass | forward | full logits (MB) | chunked (MB) | chunked ÷ full |", "|---|---|---|---|---|"]
    for pass_ in ("policy", "reference"):
        for fast in (True, False):
            full, chunked = by[pass_, fast, False], by[pass_, fast, True]
            ratio = f"{chunked / full:.2f}" if full else "—"  # a tiny model's pass may not raise the peak at all
            lines.append(f"| {pass_} | {'fast path' if fast else 'model forward'} | {full:,.0f} | {chunked:,.0f} "
                         f"| {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
