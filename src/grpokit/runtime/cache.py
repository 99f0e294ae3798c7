"""grpokit's cache folder."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """grpokit's cache: the warm-started built-in models and converted GGUF files (``$GRPOKIT_CACHE``, else
    ``~/.cache/grpokit``)."""
    return Path(os.environ.get("GRPOKIT_CACHE", Path.home() / ".cache" / "grpokit"))
