"""One convention for every ``grpokit`` command (docs/usage.md, "The command line"), read from ``build_parser()`` and
checked by running each command only as far as its arguments: ``--help``; config keys as flags; one progress switch;
one output flag; one default per key; old spellings refused naming the new ones."""

import argparse
import dataclasses
import re

import pytest

from grpokit.cli.main import build_parser, main
from grpokit.cli.options import load_run_config
from grpokit.config import GRPOConfig


def commands() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, by its words ("train", "reward train", ...)."""
    found = {}

    def walk(parser: argparse.ArgumentParser, words: list[str]) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        for name, sub in (choice for action in subs for choice in action.choices.items()):
            walk(sub, [*words, name])
        if words and not subs:
            found[" ".join(words)] = parser

    walk(build_parser(), [])
    return found


COMMANDS = commands()
WITH_KEYS = sorted(name for name, parser in COMMANDS.items() if parser.get_default("config_class") is not None)
# The positional arguments a command needs before its options are read (none is opened before they are checked).
POSITIONALS = {"plot": ["some_run"], "report": ["some_run"], "convert": ["model.gguf"]}


def config_keys(parser: argparse.ArgumentParser) -> list[str]:
    """The config keys a command takes as flags: all of its config class's, or the few it reads."""
    keys = parser.get_default("config_keys")
    return list(keys) if keys is not None else [f.name for f in dataclasses.fields(parser.get_default("config_class"))]


def listed(parser: argparse.ArgumentParser) -> dict[str, str]:
    """The config keys a command's --help lists, each with its line: `  key   help [default]`."""
    return {m.group(1): m.group(0) for m in re.finditer(r"^  (\w+) .*$", parser.epilog or "", flags=re.M)}


def test_every_command_is_checked():
    assert sorted(COMMANDS) == ["bootstrap", "convert", "demo", "eval", "plot", "recipes", "report", "reward train",
                                "sample", "serve", "sft", "train"]
    assert WITH_KEYS == ["bootstrap", "demo", "eval", "reward train", "sample", "serve", "sft", "train"]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit:
        main([*command.split(), "--help"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: grpokit {command}")


@pytest.mark.parametrize("command", WITH_KEYS)
def test_config_keys_are_flags_and_the_progress_switch_is_one_of_them(command, capsys):
    """Every key a command reads is listed with its default in its --help, and a key given as a flag is read and
    checked as its config checks it, before any work: the one progress switch, --progress_bar, with a bad value."""
    parser = COMMANDS[command]
    assert set(config_keys(parser)) == set(listed(parser)) and "progress_bar" in config_keys(parser)
    model = [] if command == "demo" else ["--model", "some/model"]  # the demo's is its warm start
    assert main([*command.split(), *model, "--progress_bar", "sometimes"]) == 2
    assert "progress_bar must be bool, got str 'sometimes'" in capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("old, new", [("--quiet", "--progress_bar false"), ("--steps", "--max_steps"),
                                      ("--out", "--output")])
def test_old_spellings_fail_naming_the_new_ones(command, old, new, capsys):
    assert main([*command.split(), *POSITIONALS.get(command, []), old, "3"]) == 2
    assert f"error: {old} was renamed {new}" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["sample", "bootstrap", "eval"])
def test_sampling_reads_prompts_per_step_not_batch_size(command, capsys):
    """`--batch_size` is a training key (SFT's and reward training's rows per optimizer step); the commands that
    sample read the prompts per generation pass as a run does, `prompts_per_step`."""
    assert "prompts_per_step" in config_keys(COMMANDS[command])
    assert main([command, "--batch_size", "16"]) == 2
    assert "error: --batch_size was renamed --prompts_per_step" in capsys.readouterr().err


def test_one_output_flag():
    """A command that writes a run directory names it --output_dir (a config key); any other file or folder a command
    writes is --output; no output is a positional argument."""
    for name, parser in COMMANDS.items():
        options = {s for action in parser._actions for s in action.option_strings}
        positionals = [action.dest for action in parser._actions if not action.option_strings]
        assert not [p for p in positionals if "out" in p], name
        assert not [o for o in options if "out" in o and o != "--output"], name
        run_dir = name in WITH_KEYS and "output_dir" in config_keys(parser)
        assert run_dir != ("--output" in options) or name in ("recipes", "serve"), name  # they write nothing
    assert sorted(n for n in WITH_KEYS if "output_dir" in config_keys(COMMANDS[n])) == ["demo", "reward train", "sft",
                                                                                        "train"]


def test_convert_refuses_its_old_positional_output(capsys):
    assert main(["convert", "model.gguf", "models/mine"]) == 2
    assert "error: unexpected argument 'models/mine'; the output is --output PATH" in capsys.readouterr().err
    assert main(["convert", "model.gguf"]) == 2
    assert "error: grpokit convert needs --output DIR" in capsys.readouterr().err


def test_one_default_per_key():
    """An option of a command's own has one default wherever it appears; a config key has its config's default in
    every command that reads that config (the demo: its recipe's, as `grpokit train recipe:arithmetic`)."""
    own: dict[str, set] = {}
    for parser in COMMANDS.values():
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                own.setdefault(action.dest, set()).add(repr(action.default))
    assert {dest: values for dest, values in own.items() if len(values) > 1} == {}

    for name in WITH_KEYS:
        parser, config_class = COMMANDS[name], COMMANDS[name].get_default("config_class")
        base = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
                for f in dataclasses.fields(config_class)}
        if name == "demo":  # what the demo sets itself is its own: the warm start, the task's data, runs/demo, seed 0
            recipe = load_run_config("recipe:arithmetic", {}, GRPOConfig)
            base = {key: getattr(recipe, key) for key in base if key not in ("model", "dataset", "output_dir", "seed")}
        lines = listed(parser)
        assert [lines[key] for key in base if key in lines and not lines[key].endswith(f" [{base[key]!r}]")] == [], name
