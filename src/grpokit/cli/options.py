"""How the ``grpokit`` commands read their arguments, one scheme for all: ``[CONFIG.yaml | recipe:NAME] [--key value
...]`` against a config class (``train``, ``sft``, ``reward train``, and ``demo`` without a CONFIG; ``sample``,
``bootstrap`` and ``eval`` against the keys of :class:`~grpokit.config.GRPOConfig` they use, after an optional MODEL),
flag names spelled with ``_`` or ``-``, and the old flag names, each refused naming its successor in every command.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Sequence
from importlib import resources
from typing import Any

import yaml

from grpokit.config import ConfigError, load_config
from grpokit.tasks.recipe_files import RECIPE, recipe_file

# A flag's name: "--max-steps", or "--max_steps" in "--max_steps=3"; "--- a note ---" is text, not a flag.
FLAG = re.compile(r"--[A-Za-z][\w-]*")
# Flags renamed to the config keys' names (and `--output`): an old spelling fails naming the new one, in every command.
RENAMED = {"data": "--dataset", "samples": "--num_generations", "max_new_tokens": "--max_completion_length",
           "no_chat_template": "--chat_template false", "out": "--output", "quiet": "--progress_bar false",
           "steps": "--max_steps"}
# Renamed only where the name is not a config key: sample, bootstrap and eval's prompts per generation pass (SFT's and
# reward training's batch_size, rows per optimizer step, is another key).
RENAMED_FOR_SAMPLING = {"batch_size": "--prompts_per_step"}
# A flag given without a value means this: --resume (continue from the newest checkpoint), --overwrite_output_dir.
BARE = {"resume": "latest", "overwrite_output_dir": "true"}


def is_flag(arg: str) -> bool:
    """``--name`` or ``--name=value``; ``--no-think mode`` (a value with a space) is text."""
    match = FLAG.match(arg)
    return match is not None and arg[match.end():match.end() + 1] in ("", "=")


def normalize_flags(argv: Sequence[str]) -> list[str]:
    """``--max-steps 3`` → ``--max_steps 3``: every flag's name with underscores, so each command accepts either
    spelling of every flag while its parser knows one."""
    out = []
    for arg in argv:
        if is_flag(arg):
            name, equals, value = arg[2:].partition("=")
            arg = f"--{name.replace('-', '_')}{equals}{value}"
        out.append(arg)
    return out


def is_config(arg: str) -> bool:
    """Whether a positional argument of ``sample`` or ``eval`` names a config rather than a model."""
    return arg.startswith(RECIPE) or arg.lower().endswith((".yaml", ".yml"))


def parse_config_args(
    args: Sequence[str], config_class: type, *, keys: Sequence[str] | None = None, model_first: bool = False,
    others: Sequence[str] = (), command: str = "",
) -> tuple[str | None, dict[str, Any]]:
    """``[CONFIG] [--key value ...]`` → ``(CONFIG or None, overrides)``. A key takes one value, read as YAML (a
    number, true/false, null, ``[a, b]``) except where the key holds text, which is kept as written; a list key
    also takes several values (``--tools calculator FILE.py:NAME``) or one (a list of one). A bare ``--resume``
    means ``latest``, a bare ``--overwrite_output_dir`` ``true``. ``model_first``: the first positional is a MODEL
    unless it is a config (``is_config``).
    ``keys``: the only config keys accepted as flags (``sample``, ``eval``), ``others`` the command's own flags,
    for suggestions; without ``keys`` an unknown key is left for the config class to refuse, with its hints."""
    hints = typing.get_type_hints(config_class)
    source: str | None = None
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(args) and not is_flag(args[i]):
        arg = args[i]
        if arg.startswith("-"):
            raise ConfigError(f"unexpected argument {arg!r}: options come as --key value")
        if model_first and not is_config(arg):
            if "model" in overrides:
                raise ConfigError(f"unexpected argument {arg!r}: the model is {overrides['model']!r}")
            overrides["model"] = arg
        elif source is None:
            source = arg
        else:
            raise ConfigError(f"unexpected argument {arg!r}: the config is {source!r}; options come as --key value")
        i += 1
    while i < len(args):
        name, equals, inline = args[i][2:].partition("=")
        key = name.replace("-", "_")
        values = [inline] if equals else []
        i += 1
        while i < len(args) and not is_flag(args[i]):
            values.append(args[i])
            i += 1
        if key in RENAMED:
            raise ConfigError(f"--{name} was renamed {RENAMED[key]}")
        if keys is not None and key in RENAMED_FOR_SAMPLING and key not in keys:
            raise ConfigError(f"--{name} was renamed {RENAMED_FOR_SAMPLING[key]}")
        if keys is not None and key not in keys:
            raise ConfigError(_not_an_option(key, hints, keys, others, command))
        if not values:
            if key not in BARE:
                raise ConfigError(f"--{name} needs a value")
            values = [BARE[key]]
        overrides[key] = _value(name, values, hints.get(key))
    return source, overrides


def refuse_options(args: Sequence[str], command: str, others: Sequence[str]) -> None:
    """Refuse what argparse left over of a command that reads no config keys (``recipes``, ``plot``, ``report``,
    ``convert``) as the others refuse it: an old spelling names its successor, an unknown flag the closest one."""
    for arg in args:
        if not is_flag(arg):
            where = "; the output is --output PATH" if "output" in others else ""
            raise ConfigError(f"unexpected argument {arg!r}{where}")
        key = arg[2:].partition("=")[0]
        if key in RENAMED:
            raise ConfigError(f"--{key} was renamed {RENAMED[key]}")
        raise ConfigError(_not_an_option(key, {}, (), others, command))


def _not_an_option(key: str, hints: dict[str, Any], keys: Sequence[str], others: Sequence[str], command: str) -> str:
    if key in hints:
        return f"grpokit {command} does not use the config key {key!r}; it reads {', '.join(keys)}"
    close = difflib.get_close_matches(key, sorted([*keys, *others]), n=1)
    return f"grpokit {command} has no option --{key}" + (f"; did you mean --{close[0]}?" if close else "")


def _value(name: str, values: list[str], hint: Any) -> Any:
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)
    if optional:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(values) == 1 and optional and values[0] in ("null", "~"):
        return None
    if typing.get_origin(hint) is list:
        (inner,) = typing.get_args(hint)
        if len(values) == 1 and values[0].lstrip().startswith("["):
            return _yaml(name, values[0])
        return [_scalar(name, v, inner) for v in values]
    if len(values) > 1:
        raise ConfigError(f"--{name} takes one value, got {len(values)}: {values} (quote a value with spaces; "
                          "CONFIG comes before the flags)")
    return _scalar(name, values[0], hint)


def _scalar(name: str, text: str, hint: Any) -> Any:
    # Text stays as written: YAML would read "Answer: 42" as a mapping and "123" as a number.
    return text if hint is str else _yaml(name, text)


def _yaml(name: str, text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"--{name} {text!r} is not valid YAML: {error}") from None


def load_run_config(source: str | None, overrides: dict[str, Any], config_class: type) -> Any:
    """The config of ``source`` (a YAML file, ``recipe:NAME`` or None for the defaults) with ``overrides``."""
    if source is not None and source.startswith(RECIPE):
        with resources.as_file(recipe_file(source.removeprefix(RECIPE))) as path:
            return load_config(path, overrides, config_class)
    return load_config(source, overrides, config_class)


def config_keys_epilog(config_class: type, keys: Sequence[str] | None = None, defaults: dict[str, Any] | None = None,
                       title: str = "config keys (YAML file or --key value), with their defaults:") -> str:
    """The config keys a command reads, with their help and defaults (the class's, unless ``defaults`` says: the
    demo's are its recipe's), for its ``--help``."""
    lines = [title]
    for f in dataclasses.fields(config_class):
        if keys is None or f.name in keys:
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            default = (defaults or {}).get(f.name, default)
            lines.append(f"  {f.name:<22} {f.metadata['help']} [{default!r}]")
    return "\n".join(lines)
