"""The ``grpokit`` command: ``demo``, ``train CONFIG.yaml [--key value ...]``, ``sft CONFIG.yaml [--key value ...]``,
``reward train CONFIG.yaml [--key value ...]``, ``sample MODEL``, ``eval MODEL``, ``plot RUN_DIR``,
``report RUN_DIR``, ``convert GGUF_FILE OUT_DIR``.

Bad input (config, data, reward functions) ends with a one-line ``error:`` naming the culprit and
exit status 2, not a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grpokit.config import GRPOConfig, RewardConfig, SFTConfig, load_config, parse_overrides
from grpokit.data import check_columns
from grpokit.resolve import load_rows
from grpokit.training.update import TrainingError


def _train_epilog(config_class: type = GRPOConfig) -> str:
    lines = ["config keys (YAML file or --key value):"]
    lines += [f"  {name:<22} {text}" for name, text in config_class.help().items()]
    return "\n".join(lines)


def _add_resume(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--resume", nargs="?", const="latest", default=None, metavar="PATH|latest",
        help="continue from a checkpoint: the newest under output_dir/checkpoints (default) or PATH",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpokit", description="GRPO training for causal language models.")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo", help="warm-start the tiny built-in model, train it with GRPO, show before/after"
    )
    demo.add_argument("--task", choices=("arithmetic", "tools"), default="arithmetic",
                      help="arithmetic: two-digit sums; tools: products, with a calculator the model may call")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--output-dir", default=None, help="default: runs/demo, or runs/demo-tools")
    demo.add_argument("--steps", type=int, default=None, help="GRPO steps (default: the demo's)")
    demo.add_argument("--eval-prompts", type=int, default=400, help="held-out prompts to evaluate")
    demo.add_argument("--quiet", action="store_true", help="no progress bars")

    # CONFIG is taken from the arguments by hand (main): argparse would take a value with a space in it,
    # such as --reward_funcs "[accuracy, format]", for the positional.
    train = commands.add_parser(
        "train", help="train with a YAML config", epilog=_train_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="grpokit train [CONFIG.yaml] [--resume [PATH|latest]] [--key value ...]",
        description="CONFIG.yaml: a YAML config file (omit it to use the defaults and overrides).",
    )
    _add_resume(train)

    sft = commands.add_parser(
        "sft", help="supervised fine-tuning on prompt/completion rows (the cold start before GRPO)",
        epilog=_train_epilog(SFTConfig), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sft.add_argument("config", nargs="?", help="YAML config file (omit to give every key as --key value)")
    _add_resume(sft)

    reward = commands.add_parser("reward", help="reward models: `grpokit reward train CONFIG` (docs/reward_models.md)")
    reward_commands = reward.add_subparsers(dest="reward_command", required=True)
    reward_train = reward_commands.add_parser(
        "train", help="train an outcome or process reward model from labelled, pair or step rows",
        epilog=_train_epilog(RewardConfig), formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="grpokit reward train [CONFIG.yaml] [--resume [PATH|latest]] [--key value ...]",
        description="CONFIG.yaml: a YAML config file (omit it to give every key as --key value).",
    )
    _add_resume(reward_train)

    sample = commands.add_parser(
        "sample", help="sample completions from a model, label them with rule rewards: rows for `reward train`",
        description="Samples --num-generations completions per prompt of --data from MODEL and labels each with "
        "the --reward-funcs (weighted sum: `label`; a process reward's steps: `steps`), written as JSONL rows "
        "that `grpokit reward train` reads; --pairs writes preference pairs built within each group instead.",
    )
    sample.add_argument("model", help="model directory, gguf:FILE, or builtin:arithmetic")
    sample.add_argument("--data", required=True,
                        help="JSONL, CSV or Parquet file, a save_to_disk directory, gsm8k:FILE, or builtin:arithmetic")
    sample.add_argument("--num-generations", type=int, required=True, metavar="G", help="completions per prompt")
    sample.add_argument("--out", required=True, help="the JSONL file to write")
    sample.add_argument("--reward-funcs", nargs="+", default=["accuracy", "format"], metavar="REWARD",
                        help="reward functions as in a config's reward_funcs (default: accuracy format); a process "
                        "reward such as arithmetic_steps adds a steps column")
    sample.add_argument("--reward-weights", type=float, nargs="+", default=None, metavar="W")
    sample.add_argument("--pairs", action="store_true",
                        help="write preference pairs {prompt, chosen, rejected}: within each group, the best "
                        "completion with the worst, the second best with the second worst, ... (equal labels left out)")
    sample.add_argument("--prompt-column", default="prompt")
    sample.add_argument("--answer-column", default="answer")
    sample.add_argument("--num-prompts", type=int, default=None, help="only the first N rows of --data")
    sample.add_argument("--system-prompt", default=None,
                        help="system message before each prompt (as the training config's system_prompt)")
    sample.add_argument("--no-chat-template", action="store_true",
                        help="render prompts as plain text even where the tokenizer has a chat template (as a "
                        "training config's chat_template: false)")
    sample.add_argument("--max-new-tokens", type=int, default=64)
    sample.add_argument("--temperature", type=float, default=1.0)
    sample.add_argument("--top-p", type=float, default=1.0)
    sample.add_argument("--batch-size", type=int, default=16, help="prompts per generation pass")
    sample.add_argument("--tools", nargs="+", default=[], metavar="TOOL",
                        help="tools the model may call, as a config's tools (calculator, FILE.py:NAME, "
                        "package.module:NAME): sample as a run with these tools trains")
    sample.add_argument("--environment-factory", default=None, metavar="FILE.py:NAME",
                        help="as a config's environment_factory: an environment per completion, its methods tools")
    sample.add_argument("--max-tool-calls", type=int, default=GRPOConfig.max_tool_calls, metavar="N")
    sample.add_argument("--tool-timeout", type=float, default=GRPOConfig.tool_timeout, metavar="SECONDS")
    sample.add_argument("--device", default="auto")
    sample.add_argument("--seed", type=int, default=0)
    sample.add_argument("--quiet", action="store_true")

    plot = commands.add_parser("plot", help="learning curves of a run directory as PNG (needs matplotlib)")
    plot.add_argument("run_dir", help="a run's output_dir (holds metrics.jsonl)")
    plot.add_argument("--output", help="folder for the PNG (default: RUN_DIR/plots)")

    report = commands.add_parser("report", help="one self-contained HTML page: config, curves, completions")
    report.add_argument("run_dir", help="a run's output_dir")
    report.add_argument("--output", help="the HTML file (default: RUN_DIR/report.html)")

    evaluate = commands.add_parser("eval", help="accuracy and format rate of a model on a dataset")
    evaluate.add_argument("model", help="model directory, builtin:arithmetic or builtin:tools")
    evaluate.add_argument(
        "--data", default="builtin:arithmetic",
        help="JSONL or CSV file, gsm8k:FILE (GSM8K-style JSONL), builtin:arithmetic or builtin:tools (held-out sets)"
    )
    evaluate.add_argument("--tools", nargs="+", default=None, metavar="TOOL",
                          help="tools the model may call, as in the config's tools (calculator, FILE.py:NAME, ...)")
    evaluate.add_argument("--max-tool-calls", type=int, default=4)
    evaluate.add_argument("--prompt-column", default="prompt")
    evaluate.add_argument("--answer-column", default="answer")
    evaluate.add_argument("--samples", type=int, default=4, help="samples per prompt for sampled accuracy")
    evaluate.add_argument("--pass-k", type=int, nargs="+", default=None, metavar="K",
                          help="report pass@K for each K (unbiased estimator over the samples; "
                          "default: 1 and --samples)")
    evaluate.add_argument("--system-prompt", default=None,
                          help="system message before each prompt (as the training config's system_prompt)")
    evaluate.add_argument("--temperature", type=float, default=1.0)
    evaluate.add_argument("--max-new-tokens", type=int, default=64)
    evaluate.add_argument("--seed", type=int, default=0)
    evaluate.add_argument("--output", help="write the summary as JSON here")
    evaluate.add_argument("--completions", help="write each row's greedy completion and its scores here (JSONL)")
    evaluate.add_argument("--quiet", action="store_true")

    convert = commands.add_parser(
        "convert", help="a llama.cpp GGUF file → a Hugging Face model directory (float32, safetensors) to train",
        description="Dequantize a GGUF file's weights to float32 and save them with its tokenizer and chat "
        "template (save_pretrained), loadable by plain transformers and by `model:` in a config. Needs "
        "pip install 'grpokit[gguf]'. A config may also say `model: gguf:FILE` to convert once and cache.",
    )
    convert.add_argument("gguf_file", help="the .gguf file")
    convert.add_argument("out_dir", help="the directory to create (must not exist, or be empty)")
    return parser


def cmd_demo(args: argparse.Namespace) -> int:
    from grpokit.cli.demo import format_table, run_demo

    overrides = {} if args.steps is None else {"max_steps": args.steps}
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


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    from grpokit.trainers.grpo import GRPOTrainer

    overrides = parse_overrides(extra)
    if args.resume is not None:
        overrides["resume"] = args.resume
    config = load_config(args.config, overrides)
    trainer = GRPOTrainer(config)
    history = trainer.train()
    if not trainer.world.main:  # under torchrun, one process reports
        return 0
    last = history[-1]
    summary = ", ".join(f"{k} {last[k]:.3f}" for k in ("reward", "accuracy", "format_rate", "kl")
                        if last.get(k) is not None)
    print(f"done: {len(history)} steps; last step: {summary}; model saved to {Path(config.output_dir) / 'model'}")
    return 0


def cmd_sft(args: argparse.Namespace, extra: list[str]) -> int:
    from grpokit.trainers.sft import SFTTrainer

    overrides = parse_overrides(extra)
    if args.resume is not None:
        overrides["resume"] = args.resume
    config = load_config(args.config, overrides, config_class=SFTConfig)
    history = SFTTrainer(config).train()
    last = history[-1] if history else {}
    summary = ", ".join(f"{k} {last[k]:.4f}" for k in ("loss", "eval_loss") if k in last)
    model = Path(config.output_dir) / "model"
    print(f"done: {len(history)} steps; last step: {summary}; model saved to {model} (grpokit train takes it as "
          "`model:`)")
    return 0


def cmd_reward_train(args: argparse.Namespace, extra: list[str]) -> int:
    from grpokit.trainers.reward import RewardTrainer

    overrides = parse_overrides(extra)
    if args.resume is not None:
        overrides["resume"] = args.resume
    config = load_config(args.config, overrides, config_class=RewardConfig)
    trainer = RewardTrainer(config)
    history = trainer.train()
    last = history[-1] if history else {}
    summary = ", ".join(f"{k} {last[k]:.4f}" for k in ("loss", "eval_loss", "eval_accuracy") if last.get(k) is not None)
    prefix = "process_model:" if trainer.form == "steps" else "model:"
    model = Path(config.output_dir) / "model"
    print(f"done: {len(history)} steps; last step: {summary}; reward model saved to {model} (grpokit train takes it "
          f"as `reward_funcs: [{prefix}{model}]`)")
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from grpokit.models.loading import resolve_device
    from grpokit.resolve import load_model_and_tokenizer, resolve_reward_functions
    from grpokit.rollout.tool_templates import build_toolbox
    from grpokit.rollout.tools import add_environment_reward, resolve_tools
    from grpokit.trainers.sample import sample_rows
    from grpokit.user_code import load_callable

    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    rows = load_rows(args.data, args.seed)[:args.num_prompts]
    check_columns(rows, [args.prompt_column], source=args.data)
    device = resolve_device(args.device)
    functions, weights = resolve_reward_functions(args.reward_funcs, args.reward_weights, device=device)
    tool_functions, environment_factory = resolve_tools(None, args.tools, None if args.environment_factory is None
                                                        else load_callable(args.environment_factory,
                                                                           "--environment-factory"))
    add_environment_reward(functions, weights, environment_factory)  # labels, as it rewards a run
    model, tokenizer = load_model_and_tokenizer(args.model, args.seed, progress=not args.quiet)
    chat_template = False if args.no_chat_template else None
    toolbox = build_toolbox(tokenizer, tool_functions, environment_factory, chat_template=chat_template,
                            max_calls=args.max_tool_calls, timeout=args.tool_timeout)
    out, counts = sample_rows(
        model.to(device), tokenizer, rows, functions, weights, num_generations=args.num_generations,
        prompt_column=args.prompt_column, answer_column=args.answer_column, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, system_prompt=args.system_prompt,
        chat_template=chat_template, seed=args.seed, batch_size=args.batch_size, pairs=args.pairs,
        progress=not args.quiet, toolbox=toolbox,
    )
    if not out:
        raise ValueError(f"--data {args.data}: no row to write ({counts['completions']} completions: "
                         f"{counts['unscored']} unscored, {counts['no_steps']} without a step"
                         + (f", {counts['groups_without_pairs']} groups without a pair)" if args.pairs else ")"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in out)
    form = "pairs" if args.pairs else "step rows" if "steps" in out[0] else "labelled rows"
    left_out = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in counts.items() if k not in ("prompts", "completions"))
    print(f"wrote {len(out)} {form} to {args.out} from {counts['completions']} completions of {counts['prompts']} "
          f"prompts (left out: {left_out}); train a reward model on them with `grpokit reward train --dataset "
          f"{args.out} --model ...`")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from grpokit.cli.evaluate import evaluate, summarize
    from grpokit.resolve import load_model_and_tokenizer
    from grpokit.training.sampling import render_prompt

    if args.data == "builtin:arithmetic":
        from grpokit.tasks.arithmetic import held_out_rows

        rows = held_out_rows()
    elif args.data == "builtin:tools":
        from grpokit.tasks.tool_task import held_out_rows

        rows = held_out_rows()
    else:
        rows = load_rows(args.data)
    check_columns(rows, [args.prompt_column, args.answer_column], source=args.data)
    tool_functions = None
    if args.tools:
        from grpokit.rollout.tools import ToolBox, resolve_tools

        tool_functions, _ = resolve_tools(None, args.tools)
    model, tokenizer = load_model_and_tokenizer(args.model, progress=not args.quiet)
    toolbox = None if tool_functions is None else ToolBox(tokenizer, tool_functions, max_calls=args.max_tool_calls)
    raw_prompts = [row[args.prompt_column] for row in rows]
    # the prompts as training renders them: through the chat template when the tokenizer has one
    rows = [{**row, args.prompt_column: render_prompt(tokenizer, row[args.prompt_column],
                                                      system_prompt=args.system_prompt)} for row in rows]
    greedy: list[str] = []
    scores = evaluate(
        model, tokenizer, rows, prompt_column=args.prompt_column, answer_column=args.answer_column,
        samples_per_prompt=args.samples, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
        seed=args.seed, progress=not args.quiet,
        pass_ks=args.pass_k if args.pass_k is not None else sorted({1, args.samples}), greedy_completions=greedy,
        toolbox=toolbox,
    )
    if args.completions:
        with open(args.completions, "w") as out:
            for prompt, row, text, correct, formatted in zip(raw_prompts, rows, greedy, scores["greedy_correct"],
                                                             scores["greedy_format"]):
                out.write(json.dumps({"prompt": prompt, "answer": row[args.answer_column],
                                      "completion": text, "correct": correct, "format": formatted}) + "\n")
    summary = {"model": args.model, "data": args.data, "num_prompts": len(rows), "samples": args.samples,
               **summarize(scores)}
    for key, value in summary.items():
        shown = ("_correct", "_format", "_tool_rate", "_tool_calls", "_tool_errors")
        if key.endswith(shown) or key.startswith("pass@"):
            print(f"{key:<16} {value:.3f}")
    if args.output:
        Path(args.output).write_text(json.dumps(summary, indent=2))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from grpokit.models.gguf import convert_gguf

    out = convert_gguf(args.gguf_file, args.out_dir)
    print(f"converted {args.gguf_file} to {out} (float32, safetensors); train it with `model: {out}`")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in ("train", "sft", "reward"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command in ("train", "reward"):  # CONFIG taken by hand: see build_parser
        args.config = extra.pop(0) if extra and not extra[0].startswith("-") else None
    try:
        if args.command == "demo":
            return cmd_demo(args)
        if args.command == "train":
            return cmd_train(args, extra)
        if args.command == "sft":
            return cmd_sft(args, extra)
        if args.command == "reward":
            return cmd_reward_train(args, extra)
        if args.command == "sample":
            return cmd_sample(args)
        if args.command == "report":
            from grpokit.cli.report import write_report

            print(write_report(args.run_dir, args.output))
            return 0
        if args.command == "plot":
            from grpokit.cli.plots import plot_run

            print(plot_run(args.run_dir, args.output))
            return 0
        if args.command == "convert":
            return cmd_convert(args)
        return cmd_eval(args)
    except ValueError as error:  # ConfigError, DataError, RewardError and other bad input
        print(f"error: {error}", file=sys.stderr)
        return 2
    except TrainingError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as interrupt:  # TrainingInterrupted says where its checkpoint is
        print(f"interrupted: {interrupt}" if str(interrupt) else "interrupted", file=sys.stderr)
        return 130
