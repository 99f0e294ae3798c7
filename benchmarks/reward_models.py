"""Learned reward models on the built-in task: what the KL term holds back, and five reward sources under one
wall-clock budget.

    python benchmarks/reward_models.py --seeds 0 1 2

Per seed, from the demo's warm-started tiny model (cached per seed):

1. Reward-model data, small on purpose (so that the model can be fooled): ``--rm-prompts`` training prompts ×
   4 completions sampled from the warm-started model (``grpokit.training.labelling.sample_rows``), labelled by the rule
   ``accuracy`` (outcome rows, 0/1) and by ``arithmetic_steps`` (step rows: each column step and the answer).
2. An outcome and a process reward model trained on them (``RewardTrainer``, the warm-started model as the
   backbone, DeepSeekMath's choice), their held-out accuracy recorded.
3. (a) GRPO rewarded *only* by the learned outcome model, for β ∈ ``--betas``, ``--steps`` steps: every
   ``--eval-every`` steps, greedy completions of 200 held-out prompts, scored by the reward model (its mean
   logit: what GRPO climbs) and by the rule (true accuracy and format rate), side by side.
4. (b) Five reward sources, each run until ``--budget`` seconds of training (the iterative run's sampling and
   retraining counted) or ``--max-steps``: rule outcome (accuracy + format), rule process (``arithmetic_steps``
   + format), learned outcome, learned process, learned outcome with iterative RL (``--iterations``
   iterations; after each, ``--iteration-prompts`` × 8 new samples plus 10 % replay retrain it). Then greedy
   accuracy on 400 held-out prompts (evaluation timed apart).

The demo's GRPO settings otherwise (16 prompts × G = 8, 48 new tokens, T = 1, lr 2e-4 decaying linearly,
float32). Writes ``benchmarks/results/reward_models.json`` (every curve), the figures
``docs/images/reward_models_kl.png`` and ``docs/images/reward_models_sources.png``, and prints the Markdown
tables for ``docs/benchmarks.md``. Needs matplotlib (``pip install -e .[plot]``). Run it alone: a 2-core
machine's timings are meaningless while anything else runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from common import SMOKE_GRPO, SMOKE_HELP, SMOKE_THREADS, mean_band, smoke_dir, smoke_warm_starts
from transformers.utils import logging as hf_logging

from grpokit.algorithms.grpo import GRPOTrainer
from grpokit.algorithms.reward import RewardTrainer
from grpokit.config import GRPOConfig, RewardConfig
from grpokit.resolve import BUILTIN, load_model_and_tokenizer, load_rows
from grpokit.rewards.builtin import accuracy_reward, format_reward
from grpokit.rewards.learned import OutcomeRewardModel
from grpokit.rollout.generate import generate, stop_token_ids
from grpokit.runtime.device import cpu_model
from grpokit.tasks.arithmetic import arithmetic_steps_reward, held_out_rows
from grpokit.tasks.demo import DEMO_CONFIG
from grpokit.tasks.warm_start import warm_started_model_path
from grpokit.training.evaluation import evaluate, summarize
from grpokit.training.labelling import sample_rows

# The reward model's training settings (also what iterative RL retrains it with).
REWARD_TRAINING = dict(learning_rate=2e-3, epochs=5, batch_size=16, micro_batch_size=32, eval_fraction=0.2,
                       mixed_precision="no", progress_bar=False, save_every=0)
DEMO = DEMO_CONFIG  # the GRPO runs' settings
HELD_OUT = 400  # held-out prompts of the final evaluations (the curves: half of them)
SOURCES = ["rule outcome", "rule process", "learned outcome", "learned process", "learned outcome + iterative RL"]


def smoke_scale() -> None:
    """--smoke: GRPO, the evaluations and the reward models' training at a smoke run's size."""
    global DEMO, HELD_OUT, REWARD_TRAINING
    DEMO, HELD_OUT, REWARD_TRAINING = {**DEMO_CONFIG, **SMOKE_GRPO}, 4, dict(REWARD_TRAINING, epochs=1)


def sources(models: dict[str, str], iterations: int, iteration_prompts: int) -> dict[str, dict]:
    """Each reward source's GRPO settings; the true accuracy is logged beside the learned ones with weight 0."""
    return {
        "rule outcome": dict(reward_funcs=["accuracy", "format"], reward_weights=[1.0, 1.0]),
        "rule process": dict(supervision="process", reward_funcs=["arithmetic_steps", "format", "accuracy"],
                             reward_weights=[1.0, 1.0, 0.0]),
        "learned outcome": dict(reward_funcs=[f"model:{models['outcome']}", "accuracy"], reward_weights=[1.0, 0.0]),
        "learned process": dict(supervision="process", reward_funcs=[f"process_model:{models['process']}", "accuracy"],
                                reward_weights=[1.0, 0.0]),
        "learned outcome + iterative RL": dict(
            reward_funcs=[f"model:{models['outcome']}", "accuracy"], reward_weights=[1.0, 0.0],
            rl_iterations=iterations, reward_model_labels=["accuracy"], reward_model_prompts=iteration_prompts,
            reward_model_config=models["outcome_config"]),
    }


def reward_models(seed: int, warm: Path, prompts: int, root: Path) -> dict:
    """Sample the warm-started model, label, train the outcome and the process reward model; their paths and
    held-out accuracies."""
    model, tokenizer = load_model_and_tokenizer(str(warm), progress=False)
    rows = load_rows(BUILTIN, seed)[-prompts:]  # the end of the seed's order: GRPO's first steps draw elsewhere
    common = dict(num_generations=4, max_new_tokens=DEMO["max_completion_length"], seed=seed, progress=False)
    outcome_rows, _ = sample_rows(model, tokenizer, rows, [accuracy_reward], [1.0], **common)
    step_rows, _ = sample_rows(model, tokenizer, rows, [arithmetic_steps_reward], [1.0], **common)
    out: dict = {"rm_rows": len(outcome_rows), "rm_positive": float(np.mean([r["label"] for r in outcome_rows]))}
    for kind, data in (("outcome", outcome_rows), ("process", step_rows)):
        data_path = root / f"{kind}.jsonl"
        data_path.write_text("".join(json.dumps(r) + "\n" for r in data))
        settings = dict(REWARD_TRAINING, model=str(warm), dataset=str(data_path), output_dir=str(root / kind),
                        seed=seed)
        started = time.perf_counter()
        trainer = RewardTrainer(RewardConfig.from_dict(settings))
        history = trainer.train()
        out[kind] = str(root / kind / "model")
        out[f"{kind}_eval_accuracy"] = history[-1]["eval_accuracy"]
        out[f"{kind}_seconds"] = time.perf_counter() - started
        if kind == "outcome":  # what iterative RL retrains it with: the same settings, this data as the first
            config_path = root / "outcome.yaml"
            config_path.write_text(yaml.safe_dump({k: v for k, v in settings.items() if k not in ("model",
                                                                                                 "output_dir")}))
            out["outcome_config"] = str(config_path)
    return out


@torch.no_grad()
def held_out_scores(model, tokenizer, rows, reward: OutcomeRewardModel) -> dict[str, float]:
    """Greedy completions of ``rows``: the reward model's mean score, the true accuracy and format rate."""
    model.eval()
    completions = []
    for first in range(0, len(rows), 100):
        batch = rows[first:first + 100]
        encoded = tokenizer([r["prompt"] for r in batch], padding=True, padding_side="left", return_tensors="pt")
        rollout = generate(model, encoded["input_ids"], encoded["attention_mask"], num_generations=1,
                           max_new_tokens=DEMO["max_completion_length"], greedy=True,
                           eos_token_id=stop_token_ids(model, tokenizer), pad_token_id=tokenizer.pad_token_id)
        completions += rollout.decode(tokenizer)
    model.train()
    prompts, answers = [r["prompt"] for r in rows], [r["answer"] for r in rows]
    scores = reward(prompts=prompts, completions=completions)
    examples = [{"prompt": p, "answer": a, "completion": c, "rm_score": r}
                for p, a, c, r in list(zip(prompts, answers, completions, scores))[:3]]
    return {"rm_score": float(np.mean(scores)),
            "greedy": float(np.mean(accuracy_reward(prompts, completions, answer=answers))),
            "format": float(np.mean(format_reward(prompts, completions))), "examples": examples}


def grpo(warm: Path, seed: int, settings: dict, out_dir: Path) -> GRPOTrainer:
    model, tokenizer = load_model_and_tokenizer(str(warm), progress=False)
    config = GRPOConfig.from_dict({**DEMO, **settings, "model": str(warm), "dataset": BUILTIN, "seed": seed,
                                   "output_dir": str(out_dir), "progress_bar": False, "save_every": 0})
    return GRPOTrainer(config, model=model, tokenizer=tokenizer)


def step_record(trainer: GRPOTrainer, metrics: dict, seconds: float) -> dict:
    reward = metrics["reward"]
    return {"step": trainer.step, "seconds": seconds, "reward": reward, "accuracy": metrics["accuracy"],
            "kl": metrics["kl"]}


def kl_run(warm: Path, seed: int, beta: float, models: dict, steps: int, eval_every: int, out_dir: Path) -> dict:
    """(a): rewarded only by the learned outcome model (accuracy logged with weight 0)."""
    trainer = grpo(warm, seed, dict(beta=beta, max_steps=steps, reward_funcs=[f"model:{models['outcome']}",
                                                                              "accuracy"],
                                    reward_weights=[1.0, 0.0]), out_dir)
    rows = held_out_rows(HELD_OUT)[:HELD_OUT // 2]
    reward = trainer.reward_funcs[0]
    evals = [{"step": 0, **held_out_scores(trainer.model, trainer.tokenizer, rows, reward)}]
    records = []
    while trainer.step < steps:
        started = time.perf_counter()
        metrics = trainer.training_step()
        records.append(step_record(trainer, metrics, time.perf_counter() - started))
        if trainer.step % eval_every == 0:
            evals.append({"step": trainer.step, **held_out_scores(trainer.model, trainer.tokenizer, rows, reward)})
    return {"beta": beta, "seed": seed, "steps": records, "evals": evals}


def source_run(warm: Path, seed: int, name: str, settings: dict, budget: float, max_steps: int,
               out_dir: Path) -> dict:
    """(b): until ``budget`` training seconds or ``max_steps``; then held-out greedy accuracy."""
    trainer = grpo(warm, seed, dict(settings, max_steps=max_steps), out_dir)
    seconds, records = 0.0, []
    while trainer.step < max_steps and seconds < budget:
        started = time.perf_counter()
        metrics = trainer.training_step()  # with iterative RL, an iteration's end runs inside the step
        seconds += time.perf_counter() - started
        records.append({**step_record(trainer, metrics, seconds), "seconds": seconds})
    scores = evaluate(trainer.model, trainer.tokenizer, held_out_rows(HELD_OUT), samples_per_prompt=0,
                      max_new_tokens=DEMO["max_completion_length"], seed=seed, progress=False)
    carry = [row["carry"] for row in held_out_rows(HELD_OUT)]
    iterations = out_dir / "reward_model" / "iterations.jsonl"
    return {"source": name, "seed": seed, "steps": records, "train_seconds": seconds,
            "final": {"greedy": summarize(scores)["greedy_correct"],
                      "carry_greedy": summarize(scores, carry)["greedy_correct"]},
            "iterations": [json.loads(x) for x in iterations.read_text().splitlines()] if iterations.exists() else []}


def spread(values, scale: float = 100.0, digits: int = 1) -> str:
    v = np.array(values, dtype=float) * scale
    return f"{v.mean():.{digits}f} ({v.min():.{digits}f}–{v.max():.{digits}f})"


def kl_table(records: list[dict], betas: list[float]) -> str:
    lines = ["| β | RM score, held-out greedy: start → end (peak) | true greedy acc: start → peak → end | format "
             "end | training reward end | KL end |", "|---|---|---|---|---|---|"]
    for beta in betas:
        runs = [r for r in records if r["beta"] == beta]
        first = [r["evals"][0] for r in runs]
        last = [r["evals"][-1] for r in runs]
        lines.append("| " + " | ".join([
            f"{beta:g}",
            f"{spread([e['rm_score'] for e in first], 1, 2)} → {spread([e['rm_score'] for e in last], 1, 2)} "
            f"({spread([max(e['rm_score'] for e in r['evals']) for r in runs], 1, 2)})",
            f"{spread([e['greedy'] for e in first])} → {spread([max(e['greedy'] for e in r['evals']) for r in runs])}"
            f" → {spread([e['greedy'] for e in last])}",
            spread([e["format"] for e in last]),
            spread([np.mean([s["reward"] for s in r["steps"][-5:]]) for r in runs], 1, 2),
            spread([np.mean([s["kl"] for s in r["steps"][-5:]]) for r in runs], 1, 3),
        ]) + " |")
    return "\n".join(lines)


def source_table(records: list[dict]) -> str:
    lines = ["| reward source | held-out greedy acc | carry class greedy | steps in the budget | s/step | "
             "true acc of the last 5 steps' samples |", "|---|---|---|---|---|---|"]
    for name in SOURCES:
        runs = [r for r in records if r["source"] == name]
        if not runs:
            continue
        lines.append("| " + " | ".join([
            name, spread([r["final"]["greedy"] for r in runs]), spread([r["final"]["carry_greedy"] for r in runs]),
            spread([len(r["steps"]) for r in runs], 1, 0),
            spread([r["train_seconds"] / len(r["steps"]) for r in runs], 1, 2),
            spread([np.mean([s["accuracy"] for s in r["steps"][-5:]]) for r in runs]),
        ]) + " |")
    return "\n".join(lines)


def plot_kl(records: list[dict], betas: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("evals", "rm_score", "reward model's mean score, held-out greedy"),
              ("evals", "greedy", "true accuracy, held-out greedy"),
              ("steps", "reward", "training reward (reward model, sampled)"),
              ("steps", "accuracy", "true accuracy of the training samples")]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (series, key, label) in zip(axes.flat, panels):
        for color, beta in zip(colors, betas):
            mean_band(ax, [r[series] for r in records if r["beta"] == beta], "step", key, color=color,
                      label=f"β = {beta:g}")
        ax.set_xlabel("training step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    seeds = sorted({r["seed"] for r in records})
    fig.suptitle(f"GRPO rewarded only by a learned outcome model; seeds {seeds}: mean, band = min–max")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def plot_sources(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, name in zip(colors, SOURCES):
        runs = [r for r in records if r["source"] == name]
        if runs:
            mean_band(axes[0], [r["steps"] for r in runs], "seconds", "accuracy", color=color, label=name)
            finals = [100 * r["final"]["greedy"] for r in runs]
            axes[1].bar(name.replace(" + ", "\n+ "), np.mean(finals), color=color, yerr=[[np.mean(finals) -
                        min(finals)], [max(finals) - np.mean(finals)]], capsize=4)
    axes[0].set_xlabel("training wall seconds")
    axes[0].set_ylabel("true accuracy of the training samples")
    axes[0].grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[1].set_ylabel("held-out greedy accuracy after the budget, %")
    axes[1].tick_params(axis="x", labelsize=7)
    seeds = sorted({r["seed"] for r in records})
    fig.suptitle(f"Five reward sources, one wall-clock budget; seeds {seeds}: mean, band/bars = min–max")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rm-prompts", type=int, default=64, help="prompts (× 4 samples) the reward models learn from")
    parser.add_argument("--betas", type=float, nargs="+", default=[0.0, 0.04, 0.2])
    parser.add_argument("--steps", type=int, default=80, help="(a): GRPO steps per β")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--budget", type=float, default=60.0, help="(b): training seconds per run")
    parser.add_argument("--max-steps", type=int, default=90, help="(b): steps at most (the LR decays over them)")
    parser.add_argument("--iterations", type=int, default=3, help="(b): iterative RL's iterations over --max-steps")
    parser.add_argument("--iteration-prompts", type=int, default=32)
    parser.add_argument("--parts", nargs="+", default=["kl", "sources"], choices=["kl", "sources"])
    parser.add_argument("--sources", nargs="+", default=SOURCES, choices=SOURCES, help="(b): the sources to run")
    parser.add_argument("--out", default="benchmarks/results/reward_models.json")
    parser.add_argument("--figures", default="docs/images/reward_models")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    hf_logging.disable_progress_bar()
    torch.set_num_threads(SMOKE_THREADS if args.smoke else 2)
    if args.smoke:
        args.seeds, args.rm_prompts, args.betas, args.steps, args.eval_every = [0], 4, [0.04], 1, 1
        args.max_steps, args.iterations, args.iteration_prompts = 2, 1, 2
        args.out, args.figures = str(smoke_dir() / "reward_models.json"), str(smoke_dir() / "reward_models")
        smoke_scale()
        smoke_warm_starts(args.seeds)

    warm = {seed: warm_started_model_path(seed, progress=False) for seed in args.seeds}  # outside every timing
    result: dict = {"meta": {**vars(args), "reward_training": REWARD_TRAINING, "demo_config": DEMO,
                             "torch": torch.__version__, "machine": platform.platform(), "cpu": cpu_model(),
                             "threads": torch.get_num_threads()}, "reward_models": {}, "kl": [], "sources": []}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            root = Path(tmp) / f"seed-{seed}"
            root.mkdir()
            models = reward_models(seed, warm[seed], args.rm_prompts, root)
            result["reward_models"][seed] = {k: v for k, v in models.items() if not isinstance(v, str)}
            print(f"seed {seed}: reward models from {models['rm_rows']} rows ({100 * models['rm_positive']:.0f} % "
                  f"correct): held-out accuracy outcome {models['outcome_eval_accuracy']:.2f}, process "
                  f"{models['process_eval_accuracy']:.2f}", flush=True)
            if "kl" in args.parts:
                for beta in args.betas:
                    record = kl_run(warm[seed], seed, beta, models, args.steps, args.eval_every,
                                    root / f"kl-{beta}")
                    result["kl"].append(record)
                    e = record["evals"]
                    print(f"  β={beta:g}: RM score {e[0]['rm_score']:.2f} → {e[-1]['rm_score']:.2f}, true greedy "
                          f"{100 * e[0]['greedy']:.1f} → {100 * e[-1]['greedy']:.1f} %", flush=True)
            if "sources" in args.parts:
                for name, settings in sources(models, args.iterations, args.iteration_prompts).items():
                    if name not in args.sources:
                        continue
                    record = source_run(warm[seed], seed, name, settings, args.budget, args.max_steps,
                                        root / name.replace(" ", "_"))
                    result["sources"].append(record)
                    print(f"  {name}: {len(record['steps'])} steps in {record['train_seconds']:.0f} s, held-out "
                          f"greedy {100 * record['final']['greedy']:.1f} %", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if result["kl"]:
        plot_kl(result["kl"], args.betas, Path(f"{args.figures}_kl.png"))
        print(kl_table(result["kl"], args.betas))
    if result["sources"]:
        plot_sources(result["sources"], Path(f"{args.figures}_sources.png"))
        print(source_table(result["sources"]))


if __name__ == "__main__":
    main()
