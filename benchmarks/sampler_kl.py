"""How far a lower-precision sampler is from the float32 policy on a real model: completions sampled with
``rollout_precision``'s bf16 copy (the whole model in bfloat16: weights, residual stream, cache), with bf16 autocast
on the float32 model (``bf16_autocast``: bfloat16 products after the prompts' float32 prefill, the residual
stream, norms, cache and LM head in float32, as the trainer samples; ``bf16_autocast_bf16_prefill``: the prompts
under autocast too) and with int8 products, scored by the float32 model's own forward; float32's own sampling for
the time.

    bash examples/smollm2/run.sh 3     # a cold-started SmolLM2 (or pass any local model directory)
    python benchmarks/sampler_kl.py --model runs/smollm2/process_carry_line_always/seed3/sft/model

For each seed and sampler (interleaved, each warmed up once first): 8 held-out prompts (the recipe's, rendered as it
trains) × 4 completions of up to 48 tokens at T = 1. Reported: the token mean of the k3 estimate of
KL(π_sample ‖ π_fp32) on the sampled tokens (what the trainer logs as ``sampler_kl``), the largest gap between the
two log-probs of a token, and milliseconds of sampling per sampled token (2 threads; run it alone).
Writes ``benchmarks/results/sampler_kl.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from pathlib import Path

import torch
import yaml
from common import SMOKE_HELP, SMOKE_THREADS, smoke_dir, tiny_model_dir

from grpokit.core.objective import kl_penalty
from grpokit.data import render_prompt
from grpokit.models.loading import load_pretrained
from grpokit.models.logprobs import sequence_logprobs
from grpokit.rollout.generate import generate
from grpokit.runtime.device import cpu_model
from grpokit.tasks.arithmetic import held_out_rows

RECIPE = Path(__file__).resolve().parents[1] / "examples" / "smollm2"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a local Hugging Face model directory (required but with --smoke)")
    parser.add_argument("--dataset", default="runs/smollm2/data/carry_share_0.5_carry_line_always/held_out.jsonl")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "sampler_kl.json"))
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; the built-in task's held-out prompts")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.seeds, args.threads = tiny_model_dir(), [0], SMOKE_THREADS
        args.out = str(smoke_dir() / "sampler_kl.json")
    elif args.model is None:
        parser.error("--model is required")
    model, tokenizer = load_pretrained(args.model)
    model.eval()
    system = yaml.safe_load((RECIPE / "grpo.yaml").read_text())["system_prompt"]
    # smoke: prompts of the recipe's form (examples/smollm2/make_data.py writes the built-in task's)
    rows = held_out_rows(8) if args.smoke else [json.loads(line) for line in
                                                Path(args.dataset).read_text().splitlines()[:8]]
    prompts = [render_prompt(tokenizer, row["prompt"], system_prompt=system) for row in rows]
    encoded = tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt", add_special_tokens=False)
    # name: (the model sampled, int8 products, under bf16 autocast, the prompts read in float32 under it)
    samplers = {"fp32": (model, False, False, False),
                "bf16": (copy.deepcopy(model).to(torch.bfloat16), False, False, False),
                "bf16_autocast": (model, False, True, True), "bf16_autocast_bf16_prefill": (model, False, True, False),
                "int8": (model, True, False, False)}

    def sample(sampler: torch.nn.Module, int8: bool, autocast: bool, exact_prefill: bool, seed: int):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return generate(sampler, encoded["input_ids"], encoded["attention_mask"], num_generations=4,
                            max_new_tokens=8 if args.smoke else 48, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id, generator=torch.Generator().manual_seed(seed),
                            int8=int8, exact_prefill=exact_prefill)

    torch.set_num_threads(args.threads)
    for sampler in samplers.values():  # warm-up: first calls pay for allocations and oneDNN's set-up
        sample(*sampler, seed=-1)
    records = []
    for seed in args.seeds:
        for name, sampler in samplers.items():
            start = time.perf_counter()
            rollout = sample(*sampler, seed=seed)
            seconds = time.perf_counter() - start
            with torch.no_grad():
                logp, _ = sequence_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                            rollout.completion_mask, fast=False)
            real = rollout.completion_mask.bool()
            kl = kl_penalty(rollout.logp, logp, "k3")[real]  # as grpo_loss logs sampler_kl
            record = {"sampler": name, "seed": seed, "tokens": kl.numel(), "sampler_kl": kl.mean().item(),
                      "max_abs_logp_gap": (logp - rollout.logp)[real].abs().max().item(),
                      "ms_per_token": seconds / kl.numel() * 1e3}
            records.append(record)
            print(json.dumps(record), flush=True)
    Path(args.out).write_text(json.dumps({"machine": {"cpu": cpu_model(), "platform": platform.platform()},
                                          "torch": torch.__version__, "model": args.model, "records": records},
                                         indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
