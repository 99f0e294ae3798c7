"""What each ``grpokit`` command calls once its arguments are parsed (:mod:`grpokit.cli.main` parses them), and what
it prints: the three training commands through one path (:func:`run_training`), ``sample``, ``bootstrap`` and ``eval``
from the keys of a GRPOConfig they read (:func:`sampling_config`: a training CONFIG and/or ``--key value``), the demo
from GRPOConfig keys over its recipe, and the rest. The work is the library's; nothing here but reading and calling."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from grpokit.cli.options import load_run_config, parse_config_args
from grpokit.config import ConfigError, GRPOConfig, RewardConfig, SFTConfig
from grpokit.tasks.recipe_files import recipe_names, recipe_summary

# The GRPOConfig keys `sample`, `bootstrap` and `eval` read: what decides how a run samples, so that they sample as it
# trains (prompts_per_step: the prompts of one generation pass, as in a run's steps and held-out evaluation).
SAMPLING_KEYS = ("model", "dataset", "dataset_config", "dataset_train_split", "dataset_test_split", "dataset_columns",
                 "reasoning_gym", "answer_extraction", "prompt_column", "answer_column", "system_prompt",
                 "chat_template",
                 "prompts_per_step", "num_generations", "max_completion_length", "temperature", "top_p", "tools",
                 "environment_factory", "environment", "environment_args", "max_tool_calls", "tool_timeout",
                 "max_reply_chars", "max_turns", "call_workers", "sandbox", "sandbox_timeout", "seed",
                 "device", "dtype", "progress_bar",
                 # the engine and its precision (rollout.sampling_options.SamplingOptions.from_config)
                 "generation_engine", "rollout_precision", "mixed_precision", "fast_path", "cuda_graphs",
                 "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "vllm_tensor_parallel_size",
                 "vllm_sync_check")
SAMPLE_KEYS = (*SAMPLING_KEYS, "reward_funcs", "reward_weights", "code_tests_mode")
EVAL_KEYS = (*SAMPLING_KEYS, "eval_reward")
# The GRPOConfig keys `serve` reads: the model and how its engine (native or vLLM) samples it
SERVE_KEYS = ("model", "seed", "device", "dtype", "progress_bar", "generation_engine", "rollout_precision",
              "mixed_precision", "fast_path", "cuda_graphs", "top_k", "min_p", "repetition_penalty",
              "vllm_gpu_memory_utilization")


def _last_step(history: list[dict[str, Any]], keys: Sequence[str], digits: int) -> str:
    last = history[-1] if history else {}
    return ", ".join(f"{k} {last[k]:.{digits}f}" for k in keys if last.get(k) is not None)


def _train(config: GRPOConfig) -> int:
    from grpokit.algorithms.grpo import GRPOTrainer

    trainer = GRPOTrainer(config)
    history = trainer.train()
    if not trainer.world.main:  # under torchrun, one process reports
        return 0
    summary = _last_step(history, ("reward", "accuracy", "format_rate", "kl", "eval_accuracy"), 3)
    print(f"done: {trainer.step} steps; last step: {summary}; model saved to {Path(config.output_dir) / 'model'}")
    return 0


def _sft(config: SFTConfig) -> int:
    from grpokit.algorithms.sft import SFTTrainer

    history = SFTTrainer(config).train()
    print(f"done: {len(history)} steps; last step: {_last_step(history, ('loss', 'eval_loss'), 4)}; model saved to "
          f"{Path(config.output_dir) / 'model'} (grpokit train takes it as `model:`)")
    return 0


def _reward_train(config: RewardConfig) -> int:
    from grpokit.algorithms.reward import RewardTrainer

    trainer = RewardTrainer(config)
    history = trainer.train()
    summary = _last_step(history, ("loss", "eval_loss", "eval_accuracy"), 4)
    prefix = "process_model:" if trainer.form == "steps" else "model:"
    model = Path(config.output_dir) / "model"
    print(f"done: {len(history)} steps; last step: {summary}; reward model saved to {model} (grpokit train takes it "
          f"as `reward_funcs: [{prefix}{model}]`)")
    return 0


# command → its config class and what it runs; every one reads [CONFIG | recipe:NAME] [--resume [PATH]] [--key value]
TRAINING: dict[str, tuple[type, Callable[[Any], int]]] = {
    "train": (GRPOConfig, _train), "sft": (SFTConfig, _sft), "reward train": (RewardConfig, _reward_train),
}


def run_training(command: str, args: Sequence[str]) -> int:
    from grpokit.training.run_dir import check_early

    config_class, run = TRAINING[command]
    source, overrides = parse_config_args(args, config_class)
    config = load_run_config(source, overrides, config_class)
    check_early(config)  # a used output_dir is refused before the model loads
    return run(config)


def sampling_config(args: argparse.Namespace, extra: Sequence[str], keys: Sequence[str], *,
                    minimum: int) -> tuple[GRPOConfig, int]:
    """The GRPOConfig of ``[CONFIG] [MODEL] [--key value ...]`` and the completions per prompt: ``num_generations``
    from the flags, else the CONFIG's (else GRPOConfig's). It is checked here, against ``minimum``: a run's G of at
    least 2 is a group's, which sampling for rows or for a score does not need."""
    source, overrides = parse_config_args(extra, GRPOConfig, keys=keys, model_first=True, others=args.own_flags,
                                          command=args.command)
    generations = overrides.pop("num_generations", None)
    config = load_run_config(source, overrides, GRPOConfig)
    generations = config.num_generations if generations is None else generations
    if not isinstance(generations, int) or isinstance(generations, bool) or generations < minimum:
        raise ConfigError(f"num_generations must be an integer >= {minimum}, got {generations!r}")
    return config, generations


def _num_prompts(args: argparse.Namespace) -> int | None:
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ConfigError(f"--num_prompts must be at least 1, got {args.num_prompts}")
    return args.num_prompts


def _output(args: argparse.Namespace, what: str) -> str:
    if args.output is None:
        raise ConfigError(f"grpokit {args.command} needs --output {what}")
    return args.output


def cmd_sample(args: argparse.Namespace, extra: Sequence[str]) -> int:
    from grpokit.from_config import sample_to_file

    config, generations = sampling_config(args, extra, SAMPLE_KEYS, minimum=1)
    output = _output(args, "FILE: the JSONL file to write")
    out, counts = sample_to_file(config, output, num_generations=generations, num_prompts=_num_prompts(args),
                                 pairs=args.pairs)
    form = "pairs" if args.pairs else "step rows" if "steps" in out[0] else "labelled rows"
    left_out = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in counts.items() if k not in ("prompts", "completions"))
    print(f"wrote {len(out)} {form} to {output} from {counts['completions']} completions of {counts['prompts']} "
          f"prompts (left out: {left_out}); train a reward model on them with `grpokit reward train --dataset "
          f"{output} --model ...`")
    return 0


def cmd_serve(args: argparse.Namespace, extra: Sequence[str]) -> int:
    import signal

    from grpokit.from_config import serving_engine
    from grpokit.serving import PolicyServer

    config, _ = sampling_config(args, extra, SERVE_KEYS, minimum=0)
    model, tokenizer, engine = serving_engine(config)
    server = PolicyServer(model, tokenizer, engine=engine, model_name=args.model_name or str(config.model),
                          host=args.host, port=args.port, max_context=args.max_context)

    def stop(signum, frame):  # SIGTERM ends the server as Ctrl-C does (uvicorn re-raises it once it has stopped)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        server.serve_forever(lambda line: print(line, flush=True))
    except KeyboardInterrupt:
        pass
    print("stopped", flush=True)
    return 0


def cmd_bootstrap(args: argparse.Namespace, extra: Sequence[str]) -> int:
    from grpokit.algorithms.bootstrap import BootstrapSettings
    from grpokit.algorithms.bootstrap_config import bootstrap_from_config

    config, generations = sampling_config(args, extra, SAMPLE_KEYS, minimum=1)
    output = Path(_output(args, "FILE: the cold-start JSONL file to write"))
    settings = BootstrapSettings(
        samples=generations, keep_per_prompt=args.keep_per_prompt, judge=args.judge, min_score=args.min_score,
        instruction=None if args.no_instruction else args.instruction, rewrite=args.rewrite,
        batch_size=config.prompts_per_step, min_agreement=args.min_agreement)
    summary = bootstrap_from_config(config, output, settings, iterations=args.iterations,
                                    num_prompts=_num_prompts(args), few_shot=args.few_shot,
                                    sft_config=args.sft_config)
    for step in summary["iterations"]:
        print(f"iteration {step['iteration']} ({step['model']}): {step['correct']} of {step['samples']} samples "
              f"judged correct by {', '.join(summary['judge'])}; prompts covered {step['coverage']:.1%} "
              f"({step['seconds']:.0f} s)")
    print(f"wrote {summary['kept']} rows to {output} (coverage {summary['coverage']:.1%} of {summary['prompts']} "
          f"prompts, kept rate {summary['kept_rate']:.1%} of {summary['samples']} samples; {summary['duplicates']} "
          f"duplicates, {summary['over_cap']} over the cap left out); summary: "
          f"{output.with_name(output.stem + '.summary.json')}; train on it with `grpokit sft --dataset {output} "
          "--model ...`")
    return 0


def cmd_eval(args: argparse.Namespace, extra: Sequence[str]) -> int:
    from grpokit.from_config import evaluate_config

    config, generations = sampling_config(args, extra, EVAL_KEYS, minimum=0)
    summary = evaluate_config(config, num_generations=generations, pass_ks=args.pass_k, num_prompts=_num_prompts(args),
                              output=args.output, completions=args.completions)
    for key, value in summary.items():
        shown = ("_correct", "_score", "_lenient", "_format", "_tool_rate", "_tool_calls", "_tool_errors")
        if key.endswith(shown) or key.startswith("pass@"):
            print(f"{key:<16} {value:.3f}")
    return 0


def cmd_demo(args: argparse.Namespace, extra: Sequence[str]) -> int:
    from grpokit.algorithms.demo import run_demo
    from grpokit.tasks.demo import OUTPUT_DIRS, format_table
    from grpokit.training.run_dir import held_files

    source, overrides = parse_config_args(extra, GRPOConfig, others=args.own_flags, command="demo")
    if source is not None:
        raise ConfigError(f"unexpected argument {source!r}: grpokit demo takes no CONFIG; set its keys as --key value")
    seed = overrides.pop("seed", 0)
    output_dir = overrides.pop("output_dir", None)
    if output_dir is None:  # the demo's own folder, not one the user named: a rerun of the demo replaces the last
        output_dir = OUTPUT_DIRS[args.task]
        if held_files(output_dir) and not {"resume", "overwrite_output_dir"} & overrides.keys():
            print(f"{output_dir} holds the last demo run: replacing it (--output_dir DIR keeps it and runs there)")
            overrides["overwrite_output_dir"] = True
    result = run_demo(seed, output_dir, task=args.task, eval_prompts=args.eval_prompts,
                      progress=overrides.pop("progress_bar", True), **overrides)
    seconds = result["seconds"]
    print(f"\nGRPO demo ({args.task}), seed {seed}: {result['eval_prompts']} held-out prompts, "
          f"{result['samples_per_prompt']} samples each for the sampled rows")
    print(format_table(result["table"]))
    example = result["example"]
    print(f"\n{example['prompt']} (answer {example['answer']}), greedy:")
    for when in ("before", "after"):
        print(f"  {when + ':':<7} {example[when]!r}")
    print(f"warm start {seconds['warm_start']:.0f} s (cached after the first run), GRPO {seconds['grpo']:.0f} s, "
          f"total {seconds['total']:.0f} s; run directory: {output_dir}")
    return 0


def cmd_recipes(args: argparse.Namespace) -> int:
    for name in recipe_names():
        print(f"recipe:{name:<20} {recipe_summary(name)}")
    print("run one with `grpokit train recipe:NAME [--key value ...]`")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from grpokit.training.plots import plot_run

    print(plot_run(args.run_dir, args.output))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from grpokit.training.report import write_report

    print(write_report(args.run_dir, args.output))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from grpokit.models.gguf import convert_gguf

    out = convert_gguf(args.gguf_file, _output(args, "DIR: the model directory to create (must not exist, or be "
                                                      "empty)"))
    print(f"converted {args.gguf_file} to {out} (float32, safetensors); train it with `model: {out}`")
    return 0
