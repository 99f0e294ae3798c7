"""Does a lower-precision sampler write the SmolLM2 recipe's carry line less often than the float32 policy?

    bash examples/smollm2/run.sh 0      # a cold-started model per seed (its sft/model), or any local model directory
    python benchmarks/sampler_carry.py --models runs/smollm2/process_carry_line_always/seed{0,1}/sft/model
    python benchmarks/sampler_carry.py --models runs/smollm2/process_carry_line_always/seed3/sft/model \
      --precisions fp32 bf16 bf16_autocast int8 --keep benchmarks/results/sampler_carry.json  # beside the others

The recipe's GRPO runs that lost the carry (docs/sampling.md) sampled with bf16 or int8 weights. This samples the
model GRPO starts from, as GRPO does (the recipe's prompts and system prompt, T = 1, ≤ 48 new tokens), on the
held-out carry problems with each ``rollout_precision`` — the same prompts and the same random seed for each — and
classifies the tens column of every completion as examples/smollm2/summarize.py does
(``grpokit.tasks.arithmetic.tens_column``): forgets the carry, writes it but adds it wrong, right, other. A sampler
biased against the carry shows as shares unlike float32's, beyond the binomial standard errors printed beside them.
Each lower-precision sampler's completions are then scored by the float32 model and the shares recomputed with each
completion weighted by its sequence ratio π_fp32/π_sample (as is, truncated at --cap, masked above it;
``rollout_is_mode``'s ``sequence_*``): where these land near float32's own shares, sequence-level weights undo the
sampler's bias (token-level weights, the default mode, have no such reading). Writes
``benchmarks/results/sampler_carry.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
from pathlib import Path

import torch
import yaml
from common import SMOKE_HELP, SMOKE_THREADS, smoke_dir, tiny_model_dir

from grpokit.core.importance import importance_weights
from grpokit.data import render_prompt
from grpokit.models.loading import load_pretrained
from grpokit.models.logprobs import sequence_logprobs
from grpokit.rollout.generate import generate
from grpokit.runtime.device import autocast, cpu_model
from grpokit.tasks.arithmetic import carry_mistakes, has_carry, held_out_rows, prompt_operands, tens_column

RECIPE = Path(__file__).resolve().parents[1] / "examples" / "smollm2"


def sample(model, policy, tokenizer, prompts: list[str], samples: int, seed: int, precision: str,
           batch: int, new_tokens: int = 48) -> tuple[list[str], list[float]]:
    """The completions ``model`` samples in ``precision`` (its int8 products, or under bfloat16 autocast for
    ``bf16_autocast``, as the trainer samples), and each one's log(π_policy / π_sample), summed over its tokens."""
    generator = torch.Generator().manual_seed(seed)
    completions, log_ratios = [], []
    for start in range(0, len(prompts), batch):
        encoded = tokenizer(prompts[start:start + batch], padding=True, padding_side="left", return_tensors="pt",
                            add_special_tokens=False)
        with autocast("bf16" if precision.startswith("bf16_autocast") else "no", torch.device("cpu")):
            rollout = generate(model, encoded["input_ids"], encoded["attention_mask"], num_generations=samples,
                               max_new_tokens=new_tokens, eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id, generator=generator, int8=precision == "int8",
                               exact_prefill=precision == "bf16_autocast")
        completions += rollout.decode(tokenizer)
        with torch.no_grad():
            logp, _ = sequence_logprobs(policy, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                        rollout.completion_mask, fast=False)
        log_ratios += ((logp - rollout.logp) * rollout.completion_mask).sum(dim=1).tolist()
    return completions, log_ratios


def reweighted(sampled: list[dict], log_ratios: list[float], cap: float | None, mask: bool) -> dict[str, float]:
    """carry_mistakes' shares with each completion weighted by its sequence ratio π_policy/π_sample (truncated at
    ``cap``, or left out above it with ``mask``), normalised by the weights' sum: what the policy itself would
    sample, as far as the weights can tell from the sampler's completions."""
    # the trainer's own weights, each completion one row of one token: its summed log-ratio against 0
    log_ratio = torch.tensor(log_ratios).unsqueeze(1)
    mode = "sequence_mask" if mask else "sequence_truncate"
    weights = importance_weights(log_ratio, torch.zeros_like(log_ratio), torch.ones_like(log_ratio),
                                 math.inf if cap is None else cap, mode)[:, 0]
    kinds = dict.fromkeys(("forgot", "added_wrong", "right", "other"), 0.0)
    for record, weight in zip(sampled, weights.tolist()):
        kinds[tens_column(*prompt_operands(record["prompt"]), record["completion"])] += weight
    return {kind: share / sum(kinds.values()) for kind, share in kinds.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", help="local Hugging Face model directories (required but with --smoke)")
    parser.add_argument("--dataset", default="runs/smollm2/data/carry_share_0.5_carry_line_always/held_out.jsonl")
    parser.add_argument("--prompts", type=int, default=64, help="held-out carry problems")
    parser.add_argument("--samples", type=int, default=16, help="completions per problem")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=4, help="problems sampled at once")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16", "int8"],
                        choices=["fp32", "bf16", "bf16_autocast", "bf16_autocast_bf16_prefill", "int8"])
    parser.add_argument("--cap", type=float, default=3.0, help="C of the sequence modes (TRL's default: 3)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "sampler_carry.json"))
    parser.add_argument("--keep", nargs="*", default=[], metavar="FILE",
                        help="earlier results whose records for other (model, precision) pairs --out keeps")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; the built-in task's held-out prompts")
    args = parser.parse_args(argv)
    new_tokens = 48
    if args.smoke:
        args.models, args.prompts, args.samples, args.batch, new_tokens = [tiny_model_dir()], 2, 2, 2, 8
        args.precisions = ["fp32", "bf16", "bf16_autocast", "bf16_autocast_bf16_prefill", "int8"]
        args.out = str(smoke_dir() / "sampler_carry.json")
        torch.set_num_threads(SMOKE_THREADS)
    elif args.models is None:
        parser.error("--models is required")
    torch.manual_seed(args.seed)
    system = yaml.safe_load((RECIPE / "grpo.yaml").read_text())["system_prompt"]
    # smoke: prompts of the recipe's form (examples/smollm2/make_data.py writes the built-in task's)
    rows = held_out_rows() if args.smoke else [json.loads(line) for line in Path(args.dataset).read_text().splitlines()]
    rows = [row for row in rows if has_carry(*prompt_operands(row["prompt"]))][: args.prompts]
    records = []
    for path in args.models:
        model, tokenizer = load_pretrained(path)
        model.eval()
        prompts = [render_prompt(tokenizer, row["prompt"], system_prompt=system) for row in rows]
        for precision in args.precisions:
            sampler = copy.deepcopy(model).to(torch.bfloat16) if precision == "bf16" else model
            completions, log_ratios = sample(sampler, model, tokenizer, prompts, args.samples, args.seed, precision,
                                             args.batch, new_tokens)
            del sampler
            sampled = [{"step": 1, "prompt": row["prompt"], "completion": text}
                       for row, start in zip(rows, range(0, len(completions), args.samples))
                       for text in completions[start:start + args.samples]]
            kinds = carry_mistakes(sampled)["first"]
            n = len(sampled)
            record = {"model": path, "rollout_precision": precision, "completions": n, **kinds,
                      "forgot_standard_error": (kinds["forgot"] * (1 - kinds["forgot"]) / n) ** 0.5,
                      "right_standard_error": (kinds["right"] * (1 - kinds["right"]) / n) ** 0.5}
            if precision != "fp32":  # the shares with the completions weighted as each sequence-level mode does
                record["sequence_log_ratio_std"] = torch.tensor(log_ratios).std().item()
                record["reweighted"] = {"sequence": reweighted(sampled, log_ratios, None, False),
                                        "sequence_truncate": reweighted(sampled, log_ratios, args.cap, False),
                                        "sequence_mask": reweighted(sampled, log_ratios, args.cap, True)}
            records.append(record)
            print(json.dumps(record), flush=True)
    done = {(r["model"], r["rollout_precision"]) for r in records}
    kept = [r for path in args.keep for r in json.loads(Path(path).read_text())["records"]
            if (r["model"], r["rollout_precision"]) not in done]
    records = kept + records
    Path(args.out).write_text(json.dumps({"machine": {"cpu": cpu_model(), "platform": platform.platform()},
                                          "torch": torch.__version__, "args": vars(args), "records": records},
                                         indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
