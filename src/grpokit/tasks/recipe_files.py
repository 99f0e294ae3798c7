"""The recipes packaged with grpokit, ``grpokit/tasks/recipes/NAME.yaml``: a config named ``recipe:NAME`` wherever a
CONFIG goes (``grpokit recipes`` lists them), and the demo's settings (:mod:`grpokit.tasks.demo`)."""

from __future__ import annotations

from importlib import resources
from importlib.abc import Traversable
from typing import Any

import yaml

from grpokit.config import ConfigError

RECIPE = "recipe:"


def recipe_folder() -> Traversable:
    return resources.files("grpokit.tasks").joinpath("recipes")


def recipe_names() -> list[str]:
    """The packaged recipes' names (``recipe:NAME``)."""
    return sorted(p.name.removesuffix(".yaml") for p in recipe_folder().iterdir() if p.name.endswith(".yaml"))


def recipe_file(name: str) -> Traversable:
    """``grpokit/tasks/recipes/NAME.yaml`` in the installed package; an unknown name lists the recipes."""
    if name not in recipe_names():
        raise ConfigError(f"no recipe {name!r}; the packaged recipes: "
                          + ", ".join(RECIPE + n for n in recipe_names()))
    return recipe_folder().joinpath(f"{name}.yaml")


def recipe_summary(name: str) -> str:
    """A recipe's first comment line: what it runs."""
    first = recipe_file(name).read_text(encoding="utf-8").splitlines()[0]
    return first.lstrip("# ").strip() if first.startswith("#") else ""


def recipe(name: str) -> dict[str, Any]:
    """The settings of a packaged recipe, as a dict."""
    return yaml.safe_load(recipe_file(name).read_text(encoding="utf-8"))
