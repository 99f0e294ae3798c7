"""Reading a config: ``--key value`` overrides (:func:`parse_overrides`), a YAML file plus overrides
(:func:`load_config`), and which config class a dumped config belongs to (:func:`config_class_of`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from grpokit.config.fields import ConfigError, _Config
from grpokit.config.grpo import GRPOConfig
from grpokit.config.supervised import RewardConfig, SFTConfig

CONFIG_CLASSES: tuple[type[_Config], ...] = (GRPOConfig, SFTConfig, RewardConfig)


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``["--beta", "0", "--reward_funcs", "[accuracy]"]`` → ``{"beta": 0, "reward_funcs": [...]}``.

    Values are read as YAML, so numbers, booleans, ``null`` and ``[a, b]`` lists work; ``-`` and
    ``_`` are interchangeable in keys.
    """
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"expected --key value, got {arg!r}")
        key, _, value = arg[2:].partition("=")
        if not _:
            if i + 1 >= len(args):
                raise ConfigError(f"--{key} needs a value")
            value = args[i + 1]
            i += 1
        overrides[key.replace("-", "_")] = yaml.safe_load(value)
        i += 1
    return overrides


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None,
                config_class: type = GRPOConfig) -> Any:
    """Read a YAML config (or none: defaults) and apply overrides; errors name the file and key.
    ``config_class``: :class:`GRPOConfig` (``grpokit train``), :class:`SFTConfig` (``grpokit sft``) or
    :class:`RewardConfig` (``grpokit reward train``)."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file {str(path)!r} does not exist") from None
        except yaml.YAMLError as error:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {error}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of key: value")
        values.update(loaded or {})
    values.update(overrides or {})
    try:
        return config_class.from_dict(values)
    except ConfigError as error:
        where = f" (in {path})" if path is not None else ""
        raise ConfigError(f"{error}{where}") from None



def config_class_of(values: Mapping[str, Any]) -> type[_Config]:
    """The config class whose dump (``to_dict()``) ``values`` is: of :data:`CONFIG_CLASSES`, the one sharing the
    most keys with it (so a dump written by an older grpokit, a key short, still finds its class)."""
    return max(CONFIG_CLASSES, key=lambda cls: len(cls.help().keys() & values.keys()))
