"""The device a run uses, what computes bfloat16 natively on it, the ``mixed_precision`` it runs as and the
autocast context for it; the CPU's model, for benchmark records."""

from __future__ import annotations

import platform
from pathlib import Path

import torch


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
                         "see runtime.device.resolve_precision")
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed_precision == "bf16", cache_enabled=cache)


def cpu_model(cpuinfo: str | Path = "/proc/cpuinfo") -> dict:
    """The CPU's model name and the bfloat16-related flags it reports (Linux), for the records of benchmarks."""
    try:
        info = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {"model": platform.processor(), "bf16_flags": None}
    fields = {key.strip(): value.strip() for key, _, value in
              (line.partition(":") for line in info.splitlines() if ":" in line)}
    return {"model": fields.get("model name", ""), "family": fields.get("cpu family"),
            "model_number": fields.get("model"),
            "bf16_flags": sorted(cpu_flags(cpuinfo) & {"avx512_bf16", "amx_bf16", "avx_ne_convert"})}
