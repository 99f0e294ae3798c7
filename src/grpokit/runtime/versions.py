"""Installed packages' versions."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def installed_version(package: str = "grpokit") -> str:
    """``package``'s version as installed (grpokit's: pyproject.toml's, the one source); ``"0+unknown"`` for a
    source tree never installed."""
    try:
        return version(package)
    except PackageNotFoundError:
        return "0+unknown"
