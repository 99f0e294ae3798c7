"""The process's global random streams: seeding them, and saving and restoring their states."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_states() -> dict[str, Any]:
    """The global random streams' states: torch's, Python's, NumPy's and, where there is CUDA, every device's."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                              "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what :func:`rng_states` returned (CUDA's where it was saved and there is CUDA)."""
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """The global random streams as they were on entry, whatever ran inside: code after the block draws exactly
    what it would have drawn had the block not run."""
    states = rng_states()
    try:
        yield
    finally:
        set_rng_states(states)
