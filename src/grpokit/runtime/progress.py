"""transformers' own progress bars (loading weights, writing checkpoints), switched as a run's
``progress_bar`` says."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def transformers_progress_bars(enabled: bool) -> Iterator[None]:
    """transformers' own progress bars (loading weights, "Writing model shards") on or off within the block."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def quiet_unless(progress: bool) -> contextlib.AbstractContextManager[None]:
    """transformers' bars off within the block where ``progress`` is false, and back as they were after it
    (never switched off for the rest of the process); left alone where it is true."""
    return contextlib.nullcontext() if progress else transformers_progress_bars(False)


def follows_progress_bar(train: Callable[..., Any]) -> Callable[..., Any]:
    """A trainer's ``train`` with transformers' bars as its ``config.progress_bar`` says: ``progress_bar: false``
    silences the checkpoints' "Writing model shards" too."""

    @functools.wraps(train)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        with transformers_progress_bars(self.config.progress_bar):
            return train(self, *args, **kwargs)

    return wrapped
