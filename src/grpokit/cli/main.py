"""The ``grpokit`` command's parser and dispatch: ``demo``, ``train``, ``sft``, ``reward train``, ``sample``,
``bootstrap``, ``eval``, ``serve``, ``recipes``, ``plot``, ``report``, ``convert``, ``--version`` (what each calls:
:mod:`grpokit.cli.commands`).

One convention for all (docs/usage.md, "The command line"):
- a config key is a flag of its name, ``--key value``: ``train``, ``sft`` and ``reward train`` take every key of their
  config (after ``[CONFIG.yaml | recipe:NAME]``), ``demo`` every GRPOConfig key over its recipe's, and ``sample``,
  ``bootstrap`` and ``eval`` the keys of a GRPO config that decide how a run samples (after an optional training
  CONFIG, to sample as that run trains), besides a few options of their own;
- a key has one default wherever it is read: its config's (the demo's: its recipe's);
- the one progress switch is the config key ``--progress_bar false``;
- ``--output`` is the file (or folder) a command writes; ``--output_dir`` a run directory, as configs call it;
- a flag is spelled with ``_`` or ``-``, and an old spelling fails naming the new one.

Bad input (config, data, reward functions), or a sandbox that cannot start here, ends with a one-line ``error:``
naming the culprit (and the key that fixes it) and exit status 2, not a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from grpokit.algorithms.bootstrap import DEFAULT_INSTRUCTION
from grpokit.cli import commands
from grpokit.cli.options import config_keys_epilog, normalize_flags, refuse_options
from grpokit.config import GRPOConfig, RewardConfig, SFTConfig
from grpokit.resolve import BUILTIN
from grpokit.rollout.episodes import EnvironmentFailure
from grpokit.runtime.versions import installed_version
from grpokit.sandbox import SandboxUnavailable
from grpokit.tasks.demo import DEMO_CONFIG, OUTPUT_DIRS
from grpokit.training.update import TrainingError

RAW = argparse.RawDescriptionHelpFormatter
# After a sandbox that cannot start: the config key that chooses the isolation, and where each one's needs are
SANDBOX_FIX = ("The config key `sandbox` chooses how model-written programs run: --sandbox bwrap (the default: pip "
               "install 'grpokit[sandbox]', and user namespaces or root) or --sandbox process (no namespaces: Landlock "
               "and seccomp; as a normal user, Linux 6.12 or later); "
               "docs/sandbox.md, \"The isolations\", says what each needs.")
CONFIG_USAGE = "[CONFIG.yaml | recipe:NAME] [--resume [PATH|latest|auto]] [--key value ...]"
CONFIG_HELP = ("CONFIG.yaml: a YAML config file, or recipe:NAME, a recipe packaged with grpokit (`grpokit recipes` "
               "lists them); omit it to use the defaults. Every config key below is also a flag, --key value, "
               "which overrides the file: --max_steps 10 or --max-steps 10; a list as --key \"[a, b]\" or "
               "--key a b. --resume: continue from the newest checkpoint under output_dir/checkpoints; "
               "--resume auto: from it if there is one, else from the start (under torchrun --max-restarts); "
               "--resume PATH: from that one.")
SAMPLING_HELP = ("MODEL: a model directory, gguf:FILE or builtin:arithmetic (or --model). CONFIG.yaml or recipe:NAME: "
                 "a training config, whose keys below are read, so that this samples as that run trains; --key value "
                 "overrides them (--max_completion_length 64 or --max-completion-length 64); --progress_bar false: "
                 "quiet; --prompts_per_step B: prompts per generation pass.")


def _own_flags(parser: argparse.ArgumentParser, config_class: type | None = None,
               keys: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """Note a command's own flag names, which its errors suggest beside the config keys, and the config keys it reads
    as flags (``keys``: only those of ``config_class``; None: all)."""
    flags = [s[2:] for action in parser._actions for s in action.option_strings if s.startswith("--") and s != "--help"]
    parser.set_defaults(own_flags=flags, config_class=config_class, config_keys=keys)
    return parser


def _training_parser(commands_: argparse._SubParsersAction, name: str, config_class: type, help: str,
                     usage: str) -> argparse.ArgumentParser:
    """A training command's parser: its arguments are read by ``commands.run_training`` (argparse would take a
    value with a space in it, such as --reward_funcs "[accuracy, format]", for a positional); this gives --help."""
    return _own_flags(commands_.add_parser(name, help=help, usage=f"{usage} {CONFIG_USAGE}", description=CONFIG_HELP,
                                           epilog=config_keys_epilog(config_class), formatter_class=RAW,
                                           allow_abbrev=False), config_class)


# The sampling commands' one-line help and description
SAMPLING_COMMANDS = {
    "sample": (
        "sample completions from a model, label them with rule rewards: rows for `reward train`",
        "Samples num_generations completions per prompt of the dataset from the model and labels each with the "
        "reward_funcs (weighted sum: `label`; a process reward's steps: `steps`), written as JSONL rows that "
        "`grpokit reward train` reads; --pairs writes preference pairs built within each group instead."),
    "bootstrap": (
        "a cold start from the model itself: sample, keep what the rewards judge correct",
        "Samples num_generations completions per prompt of the dataset (default 8), each prompt after an instruction "
        "and optional few-shot demonstrations, scores them with the run's reward_funcs, and keeps those the judge "
        "calls correct (at most --keep_per_prompt per prompt, duplicates removed), optionally rewritten into the "
        "<think>/<answer> reply format: SFT rows {prompt, completion} with their provenance, and a summary (coverage, "
        "kept rate). Resumable: run the same command again after a crash. --iterations N: sample, fine-tune (grpokit "
        "sft), sample again from the fine-tuned model, as in STaR / expert iteration (docs/bootstrap.md)."),
    "eval": (
        "accuracy and format rate of a model on a dataset (greedy, sampled, pass@k)",
        "Accuracy (or eval_reward's solve rate and mean score) and format rate of the model on the dataset's prompts "
        "(builtin:arithmetic, builtin:tools and reasoning_gym:TASK: their held-out sets): greedy, and over "
        "num_generations samples per prompt (0: greedy only), with pass@k; with tools, how often the model calls "
        "them."),
    "serve": (
        "serve a model over OpenAI's API on localhost until Ctrl-C (docs/serving.md)",
        "Serve the model on http://HOST:PORT/v1 (/v1/models, /v1/completions, /v1/chat/completions, with tools in the "
        "chat template's format), sampled by grpokit's native engine with concurrent requests batched, or by vLLM "
        "(--generation_engine vllm: each request joins vLLM's running batch); "
        "http://HOST:PORT/episodes/ID/v1 attributes requests to episode ID. Needs pip install 'grpokit[serve]'."),
}


def _sampling_parser(commands_: argparse._SubParsersAction, name: str, keys: Sequence[str]) -> argparse.ArgumentParser:
    help, description = SAMPLING_COMMANDS[name]
    parser = commands_.add_parser(
        name, help=help, description=f"{description}\n\n{SAMPLING_HELP}", formatter_class=RAW, allow_abbrev=False,
        usage=f"grpokit {name} [CONFIG.yaml | recipe:NAME] [MODEL] [--key value ...] [options]",
        epilog=config_keys_epilog(GRPOConfig, keys),
    )
    parser.add_argument("--num_prompts", type=int, default=None, metavar="N", help="only the first N rows")
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpokit", description="GRPO training for causal language models.",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"grpokit {installed_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo", help="warm-start the tiny built-in model, train it with GRPO, show before/after", allow_abbrev=False,
        usage="grpokit demo [--task arithmetic|tools] [--eval_prompts N] [--key value ...]", formatter_class=RAW,
        description="Warm-start the tiny built-in model (cached), measure it on held-out prompts, train it with GRPO "
        "(the recipe recipe:arithmetic, or recipe:tools with --task tools), measure again, print the table. Every "
        "GRPOConfig key below is also a flag over the recipe's value: --beta 0, --max_steps 10, --progress_bar false.",
        epilog=config_keys_epilog(GRPOConfig, defaults={**vars(GRPOConfig.from_dict(DEMO_CONFIG)), "seed": 0,
                                                        "model": "(the warm start)", "dataset": BUILTIN,
                                                        "output_dir": OUTPUT_DIRS["arithmetic"]},
                                  title="config keys (--key value), with the arithmetic demo's values (recipe:"
                                  "arithmetic; --task tools: recipe:tools, output_dir runs/demo-tools):"))
    demo.add_argument("--task", choices=("arithmetic", "tools"), default="arithmetic",
                      help="arithmetic: two-digit sums; tools: products, with a calculator the model may call")
    demo.add_argument("--eval_prompts", type=int, default=400, metavar="N", help="held-out prompts to evaluate")
    _own_flags(demo, GRPOConfig)

    _training_parser(sub, "train", GRPOConfig, "train with GRPO (or PPO) from a YAML config, a recipe or flags",
                     "grpokit train")
    _training_parser(sub, "sft", SFTConfig, "supervised fine-tuning on prompt/completion rows (the cold start "
                     "before GRPO)", "grpokit sft")
    reward = sub.add_parser("reward", help="reward models: `grpokit reward train CONFIG` (docs/reward_models.md)")
    reward_commands = reward.add_subparsers(dest="reward_command", required=True)
    _training_parser(reward_commands, "train", RewardConfig, "train an outcome or process reward model from "
                     "labelled, pair or step rows", "grpokit reward train")

    sample = _sampling_parser(sub, "sample", commands.SAMPLE_KEYS)
    sample.add_argument("--output", metavar="FILE", help="the JSONL file to write (required)")
    sample.add_argument("--pairs", action="store_true",
                        help="write preference pairs {prompt, chosen, rejected}: within each group, the best "
                        "completion with the worst, the second best with the second worst, ... (equal labels left out)")
    _own_flags(sample, GRPOConfig, commands.SAMPLE_KEYS)

    boot = _sampling_parser(sub, "bootstrap", commands.SAMPLE_KEYS)
    boot.add_argument("--output", metavar="FILE", help="the cold-start JSONL file to write (required); its samples "
                      "log and summary go beside it")
    boot.add_argument("--keep_per_prompt", type=int, default=2, metavar="N", help="the most rows kept per prompt")
    boot.add_argument("--judge", nargs="+", default=None, metavar="NAME",
                      help="reward functions (as logged: accuracy_reward, ...) that must each score at least "
                      "--min_score for a sample to count as correct (default: the first of reward_funcs)")
    boot.add_argument("--min_score", type=float, default=1.0, help="the judge's passing score")
    boot.add_argument("--min_agreement", type=int, default=1, metavar="N",
                      help="self-consistency: keep a correct sample only when at least N of its prompt's samples (of "
                      "its round) give the same answer (its <answer>, else its last number); a lucky guess seldom "
                      "comes twice (default 1: no such filter)")
    boot.add_argument("--instruction", default=DEFAULT_INSTRUCTION, metavar="TEXT",
                      help=f"put before each question (default: {DEFAULT_INSTRUCTION!r})")
    boot.add_argument("--no_instruction", action="store_true", help="no instruction")
    boot.add_argument("--few_shot", metavar="FILE", help="demonstrations, rows {prompt, completion} (JSONL, CSV, ...)"
                      ", shown before each prompt as earlier turns of the conversation (or blocks of text)")
    boot.add_argument("--rewrite", choices=("none", "tags"), default="none",
                      help="tags: judge and keep each sample rewritten as <think>reasoning</think><answer>answer"
                      "</answer>, its answer being its <answer> or else its last number")
    boot.add_argument("--iterations", type=int, default=1, metavar="N",
                      help="rounds of sample → fine-tune → sample again (default 1: no fine-tuning)")
    boot.add_argument("--sft_config", metavar="FILE", help="grpokit sft settings for the rounds' fine-tuning (YAML; "
                      "model, dataset and output_dir are set by bootstrap)")
    _own_flags(boot, GRPOConfig, commands.SAMPLE_KEYS)

    evaluate = _sampling_parser(sub, "eval", commands.EVAL_KEYS)
    evaluate.add_argument("--output", metavar="FILE", help="write the summary as JSON here")
    evaluate.add_argument("--completions", metavar="FILE",
                          help="write each row's greedy completion and its scores here (JSONL)")
    evaluate.add_argument("--pass_k", type=int, nargs="+", default=None, metavar="K",
                          help="report pass@K for each K (unbiased estimator over the samples; default: 1 and "
                          "num_generations)")
    _own_flags(evaluate, GRPOConfig, commands.EVAL_KEYS)

    help, description = SAMPLING_COMMANDS["serve"]
    serve = sub.add_parser(
        "serve", help=help, formatter_class=RAW, allow_abbrev=False,
        epilog=config_keys_epilog(GRPOConfig, commands.SERVE_KEYS),
        usage="grpokit serve [CONFIG.yaml | recipe:NAME] [MODEL] [--host H] [--port P] [--key value ...]",
        description=f"{description}\n\nMODEL: a model directory, gguf:FILE or builtin:arithmetic (or --model). "
        "CONFIG.yaml or recipe:NAME: a training config, whose keys below are read, so that this samples as that run "
        "does; --key value overrides them.")
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1: this "
                       "machine only)")
    serve.add_argument("--port", type=int, default=8000, help="the port (default 8000; 0: a free one)")
    serve.add_argument("--model_name", default=None, metavar="NAME",
                       help="the model id /v1/models lists and requests name (default: MODEL as given)")
    serve.add_argument("--max_context", type=int, default=None, metavar="N",
                       help="the most tokens of a request's prompt and completion together (default: the model's "
                       "context); a request over it gets OpenAI's context_length_exceeded error")
    _own_flags(serve, GRPOConfig, commands.SERVE_KEYS)

    _own_flags(sub.add_parser("recipes", help="list the recipes packaged with grpokit (`grpokit train recipe:NAME`)",
                              allow_abbrev=False))

    plot = sub.add_parser("plot", help="learning curves of a run directory as PNG (needs matplotlib)",
                          allow_abbrev=False)
    plot.add_argument("run_dir", help="a run's output_dir (holds metrics.jsonl)")
    plot.add_argument("--output", metavar="DIR", help="folder for the PNG (default: RUN_DIR/plots)")
    _own_flags(plot)

    report = sub.add_parser("report", help="one self-contained HTML page: config, curves, completions",
                            allow_abbrev=False)
    report.add_argument("run_dir", help="a run's output_dir")
    report.add_argument("--output", metavar="FILE", help="the HTML file (default: RUN_DIR/report.html)")
    _own_flags(report)

    convert = sub.add_parser(
        "convert", help="a llama.cpp GGUF file → a Hugging Face model directory (float32, safetensors) to train",
        description="Dequantize a GGUF file's weights to float32 and save them with its tokenizer and chat "
        "template (save_pretrained), loadable by plain transformers and by `model:` in a config. Needs "
        "pip install 'grpokit[gguf]'. A config may also say `model: gguf:FILE` to convert once and cache.",
        usage="grpokit convert GGUF_FILE --output DIR", allow_abbrev=False,
    )
    convert.add_argument("gguf_file", help="the .gguf file")
    convert.add_argument("--output", metavar="DIR", help="the directory to create (required; must not exist, or be "
                         "empty)")
    _own_flags(convert)
    return parser


def _run(args: argparse.Namespace, extra: list[str]) -> int:
    if args.command in ("train", "sft", "reward"):
        return commands.run_training("reward train" if args.command == "reward" else args.command, extra)
    with_keys = {"demo": commands.cmd_demo, "sample": commands.cmd_sample, "bootstrap": commands.cmd_bootstrap,
                 "eval": commands.cmd_eval, "serve": commands.cmd_serve}
    if args.command in with_keys:
        return with_keys[args.command](args, extra)
    refuse_options(extra, args.command, args.own_flags)
    without_keys = {"recipes": commands.cmd_recipes, "plot": commands.cmd_plot, "report": commands.cmd_report,
                    "convert": commands.cmd_convert}
    return without_keys[args.command](args)


def main(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(normalize_flags(sys.argv[1:] if argv is None else argv))
    try:
        return _run(args, extra)
    except ValueError as error:  # ConfigError, DataError, RewardError and other bad input
        print(f"error: {error}", file=sys.stderr)
        return 2
    except SandboxUnavailable as error:  # the run's isolation cannot start here: name the key that chooses it
        print(f"error: sandbox: {error}\n{SANDBOX_FIX}", file=sys.stderr)
        return 2
    except (TrainingError, EnvironmentFailure) as error:  # the run failed; its message says where it stopped
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as interrupt:  # TrainingInterrupted says where its checkpoint is
        print(f"interrupted: {interrupt}" if str(interrupt) else "interrupted", file=sys.stderr)
        return 130
