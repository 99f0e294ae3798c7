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


def verifiers_major_minor() -> tuple[int, int] | None:
    """The installed verifiers' (major, minor), read from its metadata without importing it; None where it is not
    installed. It picks the adapter: 0.3 (its v0 API) grpokit.tasks.verifiers, 0.4 (its v1 API)
    grpokit.agents.verifiers_v1."""
    try:
        found = version("verifiers")
    except PackageNotFoundError:
        return None
    parts = [int(part) for part in found.split(".")[:2] if part.isdigit()]
    return (parts[0], parts[1]) if len(parts) == 2 else (parts[0], 0) if parts else (0, 0)
