"""What each ``grpokit`` command does once its arguments are parsed (:mod:`grpokit.cli.main` parses them):
the three training commands through one path (:func:`run_training`), ``sample`` and ``eval`` from the keys of a
GRPOConfig they read (:func:`sampling_config`: a training CONFIG and/or ``--key value``), and the rest."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from grpokit.cli.options import load_run_config, parse_config_args, recipe_names, recipe_summary
from grpokit.config import ConfigError, GRPOConfig, RewardConfig, SFTConfig
from grpokit.data import check_columns
from grpokit.resolve import load_rows

# The GRPOConfig keys `sample` and `eval` read: what decides how a run samples, so that both sample as it trains.
SAMPLING_KEYS = ("model", "dataset", "prompt_column", "answer_column", "system_prompt", "chat_template",
                 "num_generations", "max_completion_length", "temperature", "top_p", "tools", "environment_factory",
                 "max_tool_calls", "tool_timeout", "sandbox", "sandbox_timeout", "seed", "device", "dtype",
                 # the engine and its precision (rollout.sampling_options.SamplingOptions.from_config)
                 "generation_engine", "rollout_precision", "mixed_precision", "fast_path", "cuda_graphs",
                 "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "vllm_tensor_parallel_size",
                 "vllm_sync_check")
SAMPLE_KEYS = (*SAMPLING_KEYS, "reward_funcs", "reward_weights", "code_tests_mode")
EVAL_KEYS = SAMPLING_KEYS
EVAL_GENERATIONS = 4  # eval's samples per prompt without a CONFIG (a run's G is for training, 8 by default)


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
    config_class, run = TRAINING[command]
    source, overrides = parse_config_args(args, config_class)
    return run(load_run_config(source, overrides, config_class))


def sampling_config(args: argparse.Namespace, extra: Sequence[str], keys: Sequence[str], *,
                    minimum: int, default: int | None = None) -> tuple[GRPOConfig, int]:
    """The GRPOConfig of ``[CONFIG] [MODEL] [--key value ...]`` and the completions per prompt: ``num_generations``
    from the flags, else the CONFIG's, else ``default`` (else GRPOConfig's). It is checked here, against
    ``minimum``: a run's G of at least 2 is a group's, which sampling for rows or for a score does not need."""
    source, overrides = parse_config_args(extra, GRPOConfig, keys=keys, model_first=True, others=args.own_flags,
                                          command=args.command)
    generations = overrides.pop("num_generations", None)
    config = load_run_config(source, overrides, GRPOConfig)
    if generations is None:
        generations = config.num_generations if source is not None or default is None else default
    if not isinstance(generations, int) or isinstance(generations, bool) or generations < minimum:
        raise ConfigError(f"num_generations must be an integer >= {minimum}, got {generations!r}")
    return config, generations


def _engine_and_toolbox(config: GRPOConfig, quiet: bool) -> tuple[Any, Any, Any]:
    """The engine that samples as a run with ``config`` trains (its generation_engine and precision, on
    ``config.device``), the tokenizer and the ToolBox, the tools' protocol chosen by ``build_toolbox`` as that run
    chooses it."""
    from grpokit.resolve import load_model_and_tokenizer
    from grpokit.rollout.engines import SamplingOptions, build_engine
    from grpokit.rollout.tool_templates import build_toolbox
    from grpokit.rollout.tools import resolve_tools
    from grpokit.runtime.device import describe_precision, resolve_device, resolve_precision

    tool_functions, environment_factory = resolve_tools(config)
    _say_sandboxes(tool_functions, quiet)
    model, tokenizer = load_model_and_tokenizer(config.model, config.seed, progress=not quiet, dtype=config.dtype)
    toolbox = build_toolbox(tokenizer, tool_functions, environment_factory, chat_template=config.chat_template,
                            max_calls=config.max_tool_calls, timeout=config.tool_timeout)
    device = resolve_device(config.device)
    if not quiet:
        print(describe_precision(config.mixed_precision, device), file=sys.stderr)
    options = SamplingOptions.from_config(config, resolve_precision(config.mixed_precision, device))
    return build_engine(options, model.to(device), tokenizer, seed=config.seed), tokenizer, toolbox


def _say_sandboxes(users: Sequence[Any], quiet: bool) -> None:
    """Start the sandboxes of the tools or rewards that run model-written code (refusing now where one cannot
    start), and say what each is on stderr unless ``quiet``."""
    from grpokit.rollout.python_tool import start_sandboxes

    for note in start_sandboxes(users):
        if not quiet:
            print(note, file=sys.stderr)


def _first(rows: list[dict[str, Any]], num_prompts: int | None) -> list[dict[str, Any]]:
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"--num_prompts must be at least 1, got {num_prompts}")
    return rows[:num_prompts]


def cmd_sample(args: argparse.Namespace, extra: Sequence[str]) -> int:
    from grpokit.resolve import code_options, resolve_reward_functions
    from grpokit.rollout.tools import add_environment_reward
    from grpokit.runtime.device import resolve_device
    from grpokit.training.labelling import sample_rows

    config, generations = sampling_config(args, extra, SAMPLE_KEYS, minimum=1)
    if args.output is None:
        raise ConfigError("grpokit sample needs --output FILE: the JSONL file to write")
    rows = _first(load_rows(config.dataset, config.seed), args.num_prompts)
    check_columns(rows, [config.prompt_column], source=config.dataset)
    functions, weights = resolve_reward_functions(config.reward_funcs, config.reward_weights, code_options(config),
                                                  device=resolve_device(config.device))
    _say_sandboxes(functions, args.quiet)
    engine, tokenizer, toolbox = _engine_and_toolbox(config, args.quiet)
    add_environment_reward(functions, weights, toolbox.environment_factory)
    out, counts = sample_rows(
        engine, tokenizer, rows, functions, weights, num_generations=generations,
        prompt_column=config.prompt_column, answer_column=config.answer_column,
        max_new_tokens=config.max_completion_length, temperature=config.temperature, top_p=config.top_p,
        system_prompt=config.system_prompt, chat_template=config.chat_template, seed=config.seed,
        batch_size=args.batch_size, pairs=args.pairs, progress=not args.quiet, toolbox=toolbox,
    )
    if not out:
        raise ValueError(f"--dataset {config.dataset}: no row to write ({counts['completions']} completions: "
                         f"{counts['unscored']} unscored, {counts['no_steps']} without a step"
                         + (f", {counts['groups_without_pairs']} groups without a pair)" if args.pairs else ")"))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in out)
    form = "pairs" if args.pairs else "step rows" if "steps" in out[0] else "labelled rows"
    left_out = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in counts.items() if k not in ("prompts", "completions"))
    print(f"wrote {len(out)} {form} to {args.output} from {counts['completions']} completions of {counts['prompts']} "
          f"prompts (left out: {left_out}); train a reward model on them with `grpokit reward train --dataset "
          f"{args.output} --model ...`")
    return 0


def cmd_bootstrap(args: argparse.Namespace, extra: Sequence[str]) -> int:
    import dataclasses

    from grpokit.algorithms.bootstrap import BootstrapSettings, bootstrap
    from grpokit.algorithms.sft import SFTTrainer
    from grpokit.resolve import code_options, resolve_reward_functions
    from grpokit.runtime.device import resolve_device

    config, generations = sampling_config(args, extra, SAMPLE_KEYS, minimum=1, default=8)
    if args.output is None:
        raise ConfigError("grpokit bootstrap needs --output FILE: the cold-start JSONL file to write")
    if config.tools or config.environment_factory:
        raise ConfigError("grpokit bootstrap samples without tools: leave tools and environment_factory out")
    rows = _first(load_rows(config.dataset, config.seed), args.num_prompts)
    check_columns(rows, [config.prompt_column, config.answer_column], source=config.dataset)
    few_shot = []
    if args.few_shot is not None:
        few_shot = load_rows(args.few_shot)
        check_columns(few_shot, ["prompt", "completion"], source=f"--few_shot {args.few_shot}")
    settings = BootstrapSettings(
        samples=generations, keep_per_prompt=args.keep_per_prompt, judge=args.judge, min_score=args.min_score,
        instruction=None if args.no_instruction else args.instruction, few_shot=few_shot, rewrite=args.rewrite,
        batch_size=args.batch_size)
    if args.iterations < 1:
        raise ConfigError(f"--iterations must be at least 1, got {args.iterations}")
    # Check the SFT settings before any sampling, not after the first iteration's.
    sft_file = {}
    if args.sft_config:
        sft_file = yaml.safe_load(Path(args.sft_config).read_text()) or {}
        load_run_config(args.sft_config, {"model": config.model}, SFTConfig)  # its errors name the file and key
    functions, weights = resolve_reward_functions(config.reward_funcs, config.reward_weights, code_options(config),
                                                  device=resolve_device(config.device))
    _say_sandboxes(functions, args.quiet)
    output = Path(args.output)

    def make_engine(model: str) -> tuple[Any, Any]:
        engine, tokenizer, _ = _engine_and_toolbox(dataclasses.replace(config, model=model), args.quiet)
        return engine, tokenizer

    def train(kept: Path, iteration: int) -> str:
        """SFT from the starting model on every row kept so far (as STaR: never from the last round's model)."""
        out_dir = output.with_name(f"{output.stem}.sft-{iteration}")
        if (out_dir / "model" / "config.json").is_file():  # trained before a crash
            return str(out_dir / "model")
        resume = "latest" if any((out_dir / "checkpoints").glob("step-*")) else None
        sft = SFTConfig.from_dict({**sft_file, "model": config.model, "dataset": str(kept), "output_dir": str(out_dir),
                                   "system_prompt": config.system_prompt, "chat_template": config.chat_template,
                                   "seed": config.seed, "progress_bar": not args.quiet, "resume": resume})
        SFTTrainer(sft).train()
        return str(out_dir / "model")

    sampling = dict(prompt_column=config.prompt_column, answer_column=config.answer_column,
                    max_new_tokens=config.max_completion_length, temperature=config.temperature, top_p=config.top_p,
                    system_prompt=config.system_prompt, chat_template=config.chat_template, seed=config.seed)
    summary = bootstrap(rows, functions, weights, output, settings, make_engine=make_engine, model=config.model,
                        iterations=args.iterations, train=train, sampling=sampling, progress=not args.quiet)
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
    from grpokit.data import render_prompt
    from grpokit.resolve import eval_judge, load_eval_rows
    from grpokit.training.evaluation import evaluate, summarize

    config, generations = sampling_config(args, extra, EVAL_KEYS, minimum=0, default=EVAL_GENERATIONS)
    prompt_column, answer_column = config.prompt_column, config.answer_column
    rows = _first(load_eval_rows(config.dataset), args.num_prompts)
    code = eval_judge(config, rows)  # programming problems by their tests, other rows by their answer
    judged_by = "tests" if code is not None else answer_column
    check_columns(rows, [prompt_column, judged_by], source=config.dataset)
    if code is not None:
        _say_sandboxes([code], args.quiet)
    engine, tokenizer, toolbox = _engine_and_toolbox(config, args.quiet)
    listed = toolbox.prompt_tools()
    # the prompts as training renders them: the chat template (when there is one, unless chat_template is false)
    # with the system prompt and, where the template knows tools, the tools listed
    prompts = [render_prompt(tokenizer, row[prompt_column], system_prompt=config.system_prompt,
                             chat_template=config.chat_template, tools=listed) for row in rows]
    greedy: list[str] = []
    scores = evaluate(
        engine, tokenizer, rows, prompts=prompts, prompt_column=prompt_column, answer_column=answer_column,
        samples_per_prompt=generations, temperature=config.temperature, top_p=config.top_p,
        max_new_tokens=config.max_completion_length, batch_size=args.batch_size, seed=config.seed,
        progress=not args.quiet, pass_ks=args.pass_k if args.pass_k is not None else sorted({1, generations}),
        greedy_completions=greedy, toolbox=toolbox, code=code,
    )
    if args.completions:
        with open(args.completions, "w") as out:
            lenient = scores.get("greedy_lenient", [None] * len(rows))  # programs have no lenient reading
            for row, text, correct, loose, formatted in zip(rows, greedy, scores["greedy_correct"], lenient,
                                                            scores["greedy_format"]):
                out.write(json.dumps({"prompt": row[prompt_column], judged_by: row[judged_by], "completion": text,
                                      "correct": correct, "lenient": loose, "format": formatted}) + "\n")
    summary = {"model": config.model, "dataset": config.dataset, "num_prompts": len(rows),
               "num_generations": generations, **summarize(scores)}
    for key, value in summary.items():
        shown = ("_correct", "_lenient", "_format", "_tool_rate", "_tool_calls", "_tool_errors")
        if key.endswith(shown) or key.startswith("pass@"):
            print(f"{key:<16} {value:.3f}")
    if args.output:
        Path(args.output).write_text(json.dumps(summary, indent=2))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from grpokit.cli.demo import format_table, run_demo

    overrides = {key: getattr(args, key) for key in ("max_steps", "generation_engine")
                 if getattr(args, key) is not None}
    output_dir = args.output_dir or ("runs/demo-tools" if args.task == "tools" else "runs/demo")
    result = run_demo(args.seed, output_dir, task=args.task, eval_prompts=args.eval_prompts, progress=not args.quiet,
                      **overrides)
    seconds = result["seconds"]
    print(f"\nGRPO demo ({args.task}), seed {args.seed}: {result['eval_prompts']} held-out prompts, "
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


def cmd_convert(args: argparse.Namespace) -> int:
    from grpokit.models.gguf import convert_gguf

    out = convert_gguf(args.gguf_file, args.out_dir)
    print(f"converted {args.gguf_file} to {out} (float32, safetensors); train it with `model: {out}`")
    return 0
