"""Models: loading a local Hugging Face directory (names such as ``builtin:`` and ``gguf:`` are
:mod:`grpokit.resolve`'s), grpokit's cache, the precision and autocast, LoRA, the reference policy, saving; choosing
devices; the CPU allocator's settings for training."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import os
import platform
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpokit.config import ConfigError


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


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse; True if it took the settings (Linux with glibc).

    A training step allocates and frees the same large tensors every step. By default glibc returns
    the top of its heap to the system when much of it is free, and serves allocations above a moving
    threshold (128 KB at first) with fresh mappings, so the next step takes the memory back one zeroed
    4 KB page at a time: thousands of page faults per update (docs/memory.md). Here allocations up to
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


# CPU feature flags (Linux /proc/cpuinfo) of bfloat16 arithmetic in hardware: AVX512-BF16 and AMX on x86
# (Intel Cooper Lake / Sapphire Rapids and later, AMD Zen 4 and later), FEAT_BF16 on Arm (Neoverse V1/N2,
# e.g. Graviton 3), which oneDNN's bfloat16 kernels use. Without them bfloat16 products are emulated, slower
# than float32 (docs/benchmarks.md).
NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags as Linux lists them (``flags`` on x86, ``Features`` on Arm); empty where the
    file is missing (macOS, Windows)."""
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def native_bf16(device: torch.device, cpuinfo: str | Path = "/proc/cpuinfo") -> str | None:
    """What computes bfloat16 natively on ``device`` (e.g. ``"amx_bf16"``, ``"CUDA compute capability 9.0"``),
    or None where it would be emulated: CUDA below compute capability 8 (before Ampere), CPUs without one of
    :data:`NATIVE_BF16_CPU_FLAGS`, CPUs whose flags cannot be read, and every other device."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"CUDA compute capability {major}.{minor}" if major >= 8 else None
    if device.type == "cpu":
        found = [flag for flag in NATIVE_BF16_CPU_FLAGS if flag in cpu_flags(cpuinfo)]
        return found[0] if found else None
    return None


def cpu_model(cpuinfo: str | Path = "/proc/cpuinfo") -> dict:
    """The CPU's model name, family and model numbers and the bfloat16-related flags it reports (Linux:
    /proc/cpuinfo), which the benchmarks and the examples record beside their timings: one model name covers
    several generations, and bfloat16 is fast only where the hardware computes it."""
    try:
        info = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {"model": platform.processor(), "bf16_flags": None}
    fields = {key.strip(): value.strip() for key, value in (line.split(":", 1) for line in info.splitlines()
                                                           if ":" in line)}
    return {"model": fields.get("model name", ""), "family": fields.get("cpu family"),
            "model_number": fields.get("model"),
            "bf16_flags": sorted(cpu_flags(cpuinfo) & {"avx512_bf16", "amx_bf16", "avx_ne_convert"})}


def resolve_precision(setting: str, device: torch.device, cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """``mixed_precision`` as run on ``device``: ``"bf16"`` or ``"no"``. ``"auto"`` is ``"bf16"`` only where the
    hardware computes bfloat16 natively (:func:`native_bf16`); an explicit ``"bf16"`` or ``"no"`` is kept."""
    if setting == "auto":
        return "bf16" if native_bf16(device, cpuinfo) else "no"
    if setting not in ("no", "bf16"):
        raise ValueError(f"mixed_precision={setting!r} is not valid; choose one of 'auto', 'no', 'bf16'")
    return setting


def describe_precision(setting: str, device: torch.device, cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """One line saying what ``mixed_precision`` runs as on ``device``, and why."""
    resolved, native = resolve_precision(setting, device, cpuinfo), native_bf16(device, cpuinfo)
    hardware = f"native bfloat16: {native}" if native else f"no native bfloat16 on this {device.type}"
    if setting == "auto":
        return f"mixed_precision: auto -> {resolved} ({'bfloat16 autocast' if native else 'float32'}; {hardware})"
    if setting == "bf16" and not native:
        return f"mixed_precision: bf16 (as set; {hardware}: emulated, likely slower than float32)"
    return f"mixed_precision: {setting} (as set; {hardware})"


def autocast(mixed_precision: str, device: torch.device, *, cache: bool = True):
    """The autocast context for a resolved ``mixed_precision`` ('no' or 'bf16', :func:`resolve_precision`)
    on ``device``. ``cache``: keep each weight's bfloat16 copy until the context exits, which saves casts
    when a pass reads a weight many times (decoding through the model's own forward, token after token);
    a training pass reads each once, and with activation checkpointing the copies would otherwise pile up
    (the whole model's again, in bfloat16) until the forward ends."""
    if mixed_precision not in ("no", "bf16"):
        raise ValueError(f"autocast takes a resolved mixed_precision ('no' or 'bf16'), got {mixed_precision!r}; "
                         "see models.resolve_precision")
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed_precision == "bf16", cache_enabled=cache)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_dir() -> Path:
    """grpokit's cache: the warm-started built-in models and converted GGUF files (``$GRPOKIT_CACHE``, else
    ``~/.cache/grpokit``)."""
    return Path(os.environ.get("GRPOKIT_CACHE", Path.home() / ".cache" / "grpokit"))


def load_pretrained(directory: str, dtype: str = "auto"):
    """The causal LM and tokenizer of a local Hugging Face directory (names such as ``builtin:`` and ``gguf:`` are
    :mod:`grpokit.resolve`'s); ``dtype``: ``"auto"`` (as saved) or one of ``DTYPES``, applied while loading (no
    float32 copy first)."""
    import transformers
    from packaging.version import Version
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
        # transformers renamed `torch_dtype` to `dtype` in 4.56
        keyword = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
        options = {} if dtype == "auto" else {keyword: DTYPES[dtype]}
        model = AutoModelForCausalLM.from_pretrained(directory, **options)
    except (OSError, ValueError) as error:  # missing files; or, on older transformers, an invalid repo id
        raise ValueError(f"model: cannot load {directory!r} as a Hugging Face causal LM: {error}") from None
    return model, tokenizer


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether FSDP2 has sharded ``module`` in place (its parameters are gathered only inside its own forward)."""
    return hasattr(module, "set_requires_gradient_sync")


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


def build_reference(policy: torch.nn.Module, beta: float, mixed_precision: str = "no") -> Reference | None:
    """π_ref for ``policy`` as it is now; None when β = 0, which turns the reference off entirely: it is
    then never created nor run. With ``mixed_precision: bf16`` its linear layers are stored in bfloat16 (see
    :func:`store_linear_layers_in_bf16`)."""
    if beta == 0:
        return None
    if is_lora(policy):
        return Reference(policy, adapter_disabled=True)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    if mixed_precision == "bf16":
        store_linear_layers_in_bf16(reference)
    return Reference(reference)


def store_linear_layers_in_bf16(model: torch.nn.Module) -> None:
    """The float32 weights (and biases) of ``model``'s linear layers in bfloat16, for a frozen model that only
    runs under bf16 autocast: autocast casts every linear layer's weight to bfloat16 anyway, so the model
    computes the very same numbers (tested bit for bit) in half the memory for those weights. The embeddings and
    norms, which autocast leaves in float32, stay float32, and so does the LM head (the chunked head reads its
    weight as stored, and it is often the embeddings' own)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for module in model.modules():
        if type(module) is torch.nn.Linear and module is not head and module.weight.dtype == torch.float32:
            module.to(torch.bfloat16)


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
