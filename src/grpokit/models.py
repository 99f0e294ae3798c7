"""Models: loading a local Hugging Face checkpoint or the built-in tiny model, LoRA, the reference
policy, saving; choosing devices; the CPU allocator's settings for training."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpokit.config import ConfigError
from grpokit.data import BUILTIN


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device={name!r} is not a device; use 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available here; use 'auto' or 'cpu'")
    return device


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse; True if it took the settings (Linux with glibc).

    A training step allocates and frees the same large tensors every step. By default glibc returns
    the top of its heap to the system when much of it is free, and serves allocations above a moving
    threshold (128 KB at first) with fresh mappings, so the next step takes the memory back one zeroed
    4 KB page at a time: thousands of page faults per update (docs/benchmarks.md). Here allocations up to
    32 MB (glibc's largest threshold) come from the heap, and the heap is trimmed only beyond 1 GB free.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the process already runs
    except (OSError, AttributeError):  # a C library without mallopt (musl)
        return False
    trim_threshold, mmap_threshold = -1, -3  # M_TRIM_THRESHOLD, M_MMAP_THRESHOLD in malloc.h
    # Both, or neither: setting one stops glibc from raising the mmap threshold by itself.
    return bool(mallopt(mmap_threshold, 32 << 20)) and bool(mallopt(trim_threshold, 1 << 30))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def autocast(mixed_precision: str, device: torch.device):
    """The autocast context for ``mixed_precision`` ('no' or 'bf16') on ``device``."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed_precision == "bf16")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model_and_tokenizer(name: str, seed: int = 0, progress: bool = True, dtype: str = "auto"):
    """A local HF causal LM directory, or the built-in warm-started arithmetic model; ``dtype``:
    ``"auto"`` (as saved) or one of ``DTYPES``, applied while loading (no float32 copy first)."""
    import transformers
    from packaging.version import Version
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()
    if name == BUILTIN:
        from grpokit.warm_start import warm_started_model_path

        name = str(warm_started_model_path(seed=seed, progress=progress))
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        # transformers renamed `torch_dtype` to `dtype` in 4.56
        keyword = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
        options = {} if dtype == "auto" else {keyword: DTYPES[dtype]}
        model = AutoModelForCausalLM.from_pretrained(name, **options)
    except (OSError, ValueError) as error:  # missing files; or, on older transformers, an invalid repo id
        raise ValueError(f"model: cannot load {name!r} as a Hugging Face causal LM: {error}") from None
    return model, tokenizer


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a peft model, whose only trained weights are its adapter's."""
    return hasattr(model, "peft_config")


def with_lora(model: torch.nn.Module, config: Any) -> torch.nn.Module:
    """The model with a LoRA adapter (peft) when ``config.lora_rank`` > 0: only the adapter trains."""
    if not config.lora_rank:
        return model
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ConfigError("lora_rank needs peft: pip install 'grpokit[lora]'") from None
    lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=config.lora_target_modules, task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, lora)
    except ValueError as error:  # e.g. no default target modules for this architecture
        raise ConfigError(f"lora_target_modules: {error}") from None


@dataclass
class Reference:
    """π_ref, the frozen starting policy (docs/math.md, "KL to the reference"): a frozen copy of its
    weights, or, with LoRA, the policy itself with its adapter disabled (no second copy)."""

    model: torch.nn.Module
    adapter_disabled: bool = False

    def active(self) -> contextlib.AbstractContextManager:
        """The context in which ``model`` computes π_ref."""
        return self.model.disable_adapter() if self.adapter_disabled else contextlib.nullcontext()


def build_reference(policy: torch.nn.Module, beta: float) -> Reference | None:
    """π_ref for ``policy`` as it is now; None when β = 0, which turns the reference off entirely: it is
    then never created nor run."""
    if beta == 0:
        return None
    if is_lora(policy):
        return Reference(policy, adapter_disabled=True)
    return Reference(copy.deepcopy(policy).eval().requires_grad_(False))


def save_pretrained(model: torch.nn.Module, tokenizer: Any, path: str | Path,
                    state_dict: dict[str, torch.Tensor] | None = None, merged_path: str | Path | None = None) -> None:
    """``save_pretrained`` (safetensors) of the model and the tokenizer: loadable by plain transformers. A
    LoRA model saves its adapter alone (adapter_model.safetensors + adapter_config.json), and with
    ``merged_path`` also the adapter merged into the base weights there. ``state_dict``: the model's
    full weights when its own parameters are shards."""
    lora = is_lora(model)
    model.save_pretrained(path, state_dict=None if lora else state_dict, safe_serialization=True)
    tokenizer.save_pretrained(path)
    if lora and merged_path is not None:
        copy.deepcopy(model).merge_and_unload().save_pretrained(merged_path, safe_serialization=True)
        tokenizer.save_pretrained(merged_path)
