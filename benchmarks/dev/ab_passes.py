"""The fast path's passes at one git revision against the working tree, timed alternately in one process.

    python benchmarks/dev/ab_passes.py --base HEAD~1 --config small --mode fp32 --reps 20

Whole-step runs of ``vs_trl.py`` move by ±15 % from one process to the next on a shared machine, more
than most single changes gain; alternating two versions call by call in one process puts that drift on
both. The script exports ``--base``'s ``src/grpokit`` into a temporary directory as the package
``grpokit_base`` (imports rewritten), builds ``vs_trl.py``'s model for ``--config``, and times each pass
of a GRPO step on the same model, alternating base and working tree (the first call of each is not
timed):

- ``rollout``: ``generate`` of 4 prompts × G = 8 completions, a new seed each repetition, both versions
  the same seed;
- ``reference``: the log-probs of a fixed rollout without gradient (the reference pass);
- ``update``: the same with gradient, and the backward of their masked sum.

Prints each pass's median and min for both and their ratio (working tree ÷ base: below 1 is faster),
and checks that the two versions sample the same tokens and agree on log-probs and gradients (float32:
to rounding). Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, vs_trl.py
from common import export_source  # noqa: E402
from vs_trl import CONFIGS, G, build, rows  # noqa: E402


def export_base(revision: str, into: Path) -> None:
    """``revision``'s src/grpokit as the package ``grpokit_base`` under ``into``."""
    package = into / "grpokit_base"
    (export_source(revision, into) / "grpokit").rename(package)
    for path in package.glob("*.py"):
        path.write_text(re.sub(r"\b(from|import) grpokit\b", r"\1 grpokit_base", path.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="git revision to compare the working tree with")
    parser.add_argument("--config", default="small", choices=list(CONFIGS))
    parser.add_argument("--mode", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--reps", type=int, default=20, help="timed calls of each pass per version")
    parser.add_argument("--passes", nargs="+", default=["rollout", "reference", "update"],
                        choices=["rollout", "reference", "update"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:  # the base package stays importable until the end
        export_base(args.base, Path(tmp))
        sys.path.insert(0, tmp)
        build(args.config, Path(tmp) / "model")
        compare(args, Path(tmp) / "model")


def compare(args: argparse.Namespace, model_dir: Path) -> None:
    import grpokit_base.rollout as old
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import grpokit.rollout.generate as new

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = tokenizer([r["prompt"] for r in rows()[:CONFIGS[args.config][1]]], return_tensors="pt", padding=True,
                        padding_side="left")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.mode == "bf16")

    def rollout(version, seed: int = 0):
        with autocast:
            return version.generate(model, prompts["input_ids"], prompts["attention_mask"], num_generations=G,
                                    max_new_tokens=CONFIGS[args.config][2], eos_token_id=tokenizer.eos_token_id,
                                    pad_token_id=tokenizer.pad_token_id, generator=torch.Generator().manual_seed(seed))

    fixed = rollout(new)
    inputs = (fixed.prompt_ids, fixed.prompt_mask, fixed.completion_ids, fixed.completion_mask)

    def reference(version, seed: int = 0):
        with torch.no_grad(), autocast:
            return version.sequence_logprobs(model, *inputs, fast=True)[0]

    def update(version, seed: int = 0):
        with autocast:
            logp, _ = version.sequence_logprobs(model, *inputs, with_entropy=True, fast=True)
        (logp * fixed.completion_mask).sum().backward()
        grads = [p.grad for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return logp.detach(), grads

    same_tokens = all(torch.equal(rollout(old, s).completion_ids, rollout(new, s).completion_ids) for s in (1, 2))
    (old_logp, old_grads), (new_logp, new_grads) = update(old), update(new)
    grad_gap = max(float((a - b).abs().max() / a.abs().max().clamp(min=1e-12)) for a, b in zip(old_grads, new_grads))
    print(f"{args.config} {args.mode}, base {args.base}: same sampled tokens {same_tokens}; log-probs differ by "
          f"≤ {float((old_logp - new_logp).abs().max()):.1e}, gradients by ≤ {grad_gap:.1e} (relative)")

    passes = {"rollout": rollout, "reference": reference, "update": update}
    for name in args.passes:
        step, times = passes[name], {"base": [], "tree": []}
        for rep in range(args.reps + 1):
            pair = [("base", old), ("tree", new)]
            for label, version in pair if rep % 2 == 0 else pair[::-1]:
                start = time.perf_counter()
                step(version, rep)
                if rep:  # the first call of each warms up
                    times[label].append(time.perf_counter() - start)
        base, tree = statistics.median(times["base"]), statistics.median(times["tree"])
        print(f"  {name:9s} base {base * 1e3:7.1f} ms, working tree {tree * 1e3:7.1f} ms (median of {args.reps}): "
              f"{tree / base:.3f}×; min {min(times['tree']) / min(times['base']):.3f}×")


if __name__ == "__main__":
    main()
