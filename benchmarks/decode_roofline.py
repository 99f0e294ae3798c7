"""Decoding against its roofline: tokens/s of grpokit's sampling (``grpokit.rollout.generate``) for SmolLM2-135M's
architecture at several batch sizes (rows), beside the bound this machine sets, measured in the same run, and beside
``transformers``' ``generate`` on the same model.

    python benchmarks/decode_roofline.py                                  # ~5 minutes on 2 cores, float32
    python benchmarks/decode_roofline.py --device cuda --dtype bfloat16   # on a GPU
    python benchmarks/decode_roofline.py --profile 16                     # where a 16-row step's time goes
    python benchmarks/decode_roofline.py --int8                           # rollout_precision: int8's sampling

On CUDA grpokit is also timed with ``cuda_graphs: true`` (``generate(graph=True)``: the decode step replayed as a
CUDA graph), column ``grpokit_graph_tokens_s``.

- The model: SmolLM2-135M's config with random weights (decoding's cost does not depend on the values); no token
  stops a completion, so every row decodes ``--new_tokens`` tokens after a ``--prompt_tokens`` prompt. ``rows``
  completions are ``rows / G`` prompts × G (G = min(rows, 8), as GRPO samples them); the time includes each prompt's
  prefill. Best of ``--repeats`` runs after a warm-up.
- The bound: a decode step must read every weight once (the tied embedding is the LM head) and the rows' keys and
  values so far, and do 2 FLOPs per weight per row plus attention's 4·hidden FLOPs per cached position per layer.
  Its time is at least max(bytes / bandwidth, FLOPs / matmul throughput), with bandwidth measured as a sum over a
  1 GiB tensor and matmul throughput as the best product in ``--dtype`` (``common.machine_bounds``), both here and
  now. Summed over the steps, the bound in tokens/s; ``% of bound`` is the measured rate over it, and ``binds`` says
  which of the two it is. ``--int8``: the float32 model sampled with int8 products (``rollout_precision: int8``);
  its bound reads one byte per weight (the cache stays float32) at the best int8 product's rate (``torch._int_mm``).
- On the CPU the process keeps the memory it frees (``keep_freed_memory``, the trainer's default), so a decode
  step's outputs reuse memory the last step freed rather than fresh pages.

Writes ``benchmarks/results/decode_roofline[_DEVICE_DTYPE].json`` and prints the Markdown table for
docs/benchmarks.md. Run it alone: other jobs on the cores change every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from functools import partial
from pathlib import Path

import torch
from common import (
    SMOKE_HELP,
    SMOKE_THREADS,
    SMOLLM2_135M,
    TINY_LLAMA,
    best_seconds,
    machine_bounds,
    roofline,
    smoke_dir,
)
from transformers import LlamaConfig, LlamaForCausalLM

from grpokit.rollout.generate import generate
from grpokit.runtime.device import cpu_model
from grpokit.runtime.memory import keep_freed_memory


def speeds(model: torch.nn.Module, rows: int, args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """Tokens/s of grpokit's sampling and of transformers' generate for ``rows`` rows, ``rows / G`` prompts × G."""
    vocab = model.config.vocab_size
    g = min(rows, 8)
    prompts = torch.randint(3, vocab, (rows // g, args.prompt_tokens), device=device)
    expanded = prompts.repeat_interleave(g, dim=0)
    ours = partial(generate, model, prompts, torch.ones_like(prompts), num_generations=g, int8=args.int8,
                   eos_token_id=[vocab], pad_token_id=0)  # no sampled id equals vocab: every row decodes all its tokens
    theirs = partial(model.generate, input_ids=expanded, attention_mask=torch.ones_like(expanded), do_sample=True,
                     top_k=0, pad_token_id=0)
    calls = {"grpokit": lambda new: ours(max_new_tokens=new, generator=torch.Generator(device).manual_seed(0))}
    if device.type == "cuda":  # cuda_graphs: true, the decode step replayed as a CUDA graph
        calls["grpokit_graph"] = lambda new: ours(max_new_tokens=new, graph=True,
                                                  generator=torch.Generator(device).manual_seed(0))
    if not args.no_hf:
        calls["transformers"] = lambda new: theirs(max_new_tokens=new, min_new_tokens=new)
    result = {}
    for name, call in calls.items():
        call(8)  # warm-up
        result[f"{name}_tokens_s"] = rows * args.new_tokens / best_seconds(partial(call, args.new_tokens), device,
                                                                         args.repeats)
    return result


def profile(model: torch.nn.Module, rows: int, args: argparse.Namespace, device: torch.device) -> None:
    """Where a decode step's time goes at ``rows`` rows: the step, every weight's product alone (``F.linear`` on
    ``rows`` rows, the tied LM head included), and ``torch.profiler``'s operators over a 32-token call."""
    vocab = model.config.vocab_size
    g = min(rows, 8)
    prompts = torch.randint(3, vocab, (rows // g, args.prompt_tokens), device=device)
    call = partial(generate, model, prompts, torch.ones_like(prompts), num_generations=g, eos_token_id=[vocab],
                   pad_token_id=0, int8=args.int8)
    call(max_new_tokens=8)
    weights = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n] + [model.lm_head.weight]
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype, device=device) for w in weights}
    products = best_seconds(lambda: [torch.nn.functional.linear(inputs[w.shape[1]], w) for w in weights], device, 5)
    new = min(64, args.new_tokens)
    step = best_seconds(partial(call, max_new_tokens=new), device, args.repeats) / new
    print(f"{rows} rows: {1000 * step:.0f} ms per decode step; every weight's product alone (F.linear) "
          f"{1000 * products:.0f} ms")
    with torch.profiler.profile() as prof:
        call(max_new_tokens=min(32, args.new_tokens))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--prompt_tokens", type=int, default=64)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--no_hf", action="store_true", help="skip transformers' generate")
    parser.add_argument("--int8", action="store_true", help="sample with int8 products (float32 model; CPU)")
    parser.add_argument("--profile", type=int, metavar="ROWS", help="only profile a decode step at ROWS rows")
    parser.add_argument("--out")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; also profiles a step")
    args = parser.parse_args(argv)
    shape = SMOLLM2_135M
    if args.smoke:
        shape, args.rows, args.prompt_tokens, args.new_tokens, args.repeats = TINY_LLAMA, [2], 4, 4, 1
        torch.set_num_threads(SMOKE_THREADS)
        args.out = str(smoke_dir() / "decode_roofline.json")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    kept = device.type == "cpu" and keep_freed_memory()
    torch.manual_seed(0)
    load_before = os.getloadavg()
    model = LlamaForCausalLM(LlamaConfig(**shape)).to(device=device, dtype=dtype).eval()
    if args.profile or args.smoke:
        profile(model, args.profile or args.rows[0], args, device)
        if not args.smoke:
            return
    # The bounds are measured before and after the speeds, and the better of each kept: a virtual machine's
    # bandwidth and throughput drift, and the bound is what the machine showed it can do.
    first = machine_bounds(device, dtype, args.int8, smoke=args.smoke)
    records = [{"rows": rows, **speeds(model, rows, args, device)} for rows in args.rows]
    last = machine_bounds(device, dtype, args.int8, smoke=args.smoke)
    bounds = {key: max(first[key], last[key]) for key in first}
    for record in records:
        bound, binds = roofline(record["rows"], args.prompt_tokens, args.new_tokens, dtype.itemsize, bounds,
                                1 if args.int8 else None, shape)
        record.update(bound_tokens_s=bound, binds=binds)
        print(json.dumps(record), flush=True)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else None
    result = {"machine": {"cpu": cpu_model(), "platform": platform.platform(), "device": args.device, "gpu": gpu,
                          "threads": torch.get_num_threads(), "load": [load_before, os.getloadavg()],
                          "keep_freed_memory": kept},
              "torch": torch.__version__, "dtype": args.dtype, "int8": args.int8, "prompt_tokens": args.prompt_tokens,
              "new_tokens": args.new_tokens, "bounds": bounds, "bounds_measured": [first, last],
              "records": records}
    suffix = "" if (args.device, args.dtype) == ("cpu", "float32") else f"_{device.type}_{args.dtype}"
    suffix = "_cpu_int8" if args.int8 else suffix
    out = Path(args.out or Path(__file__).parent / "results" / f"decode_roofline{suffix}.json")
    out.write_text(json.dumps(result, indent=1))
    print(f"\nbandwidth {bounds['bandwidth_gb_s']:.1f} GB/s, matmul {bounds['matmul_gflop_s']:.0f} GFLOP/s "
          f"({'int8' if args.int8 else args.dtype}); {args.prompt_tokens}-token prompts, "
          f"{args.new_tokens} new tokens\n")
    print("| rows | bound, tokens/s (binds) | grpokit, tokens/s | % of bound | transformers' generate | grpokit ÷ it |")
    print("|---|---|---|---|---|---|")
    for r in records:
        hf = r.get("transformers_tokens_s")
        print(f"| {r['rows']} | {r['bound_tokens_s']:.0f} ({r['binds']}) | {r['grpokit_tokens_s']:.0f} "
              f"| {100 * r['grpokit_tokens_s'] / r['bound_tokens_s']:.0f} % | "
              + (f"{hf:.0f} | {r['grpokit_tokens_s'] / hf:.2f}× |" if hf else "— | — |"))
        if "grpokit_graph_tokens_s" in r:
            print(f"|  | CUDA graph: {r['grpokit_graph_tokens_s']:.0f} tokens/s, "
                  f"{100 * r['grpokit_graph_tokens_s'] / r['bound_tokens_s']:.0f} % of bound | | | | |")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
