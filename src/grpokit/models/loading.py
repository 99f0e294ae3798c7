"""Hugging Face models in and out: loading a local directory (names such as ``builtin:`` and ``gguf:`` are
:mod:`grpokit.resolve`'s), the tokenizer's pad token, and saving a trained model in the one layout every trainer
writes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from grpokit.models.lora import is_lora

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_options(dtype: str | torch.dtype) -> dict[str, torch.dtype]:
    """``from_pretrained``'s (and ``from_config``'s) keyword for the weights' dtype: nothing for ``"auto"`` (as
    saved), else one of :data:`DTYPES` or a ``torch.dtype``, applied while loading (no float32 copy first)."""
    import transformers
    from packaging.version import Version

    if dtype == "auto":
        return {}
    # transformers renamed `torch_dtype` to `dtype` in 4.56
    keyword = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return {keyword: DTYPES[dtype] if isinstance(dtype, str) else dtype}


def load_pretrained(directory: str, dtype: str = "auto", head: str = "ForCausalLM", **options: Any):
    """The model (``AutoModel{head}``, by default a causal LM) and tokenizer of a local Hugging Face directory;
    ``dtype``: ``"auto"`` (as saved) or one of :data:`DTYPES`; ``options`` go to ``from_pretrained``."""
    import transformers
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
        model = getattr(transformers, f"AutoModel{head}").from_pretrained(directory, **dtype_options(dtype), **options)
    except (OSError, ValueError) as error:  # missing files; or, on older transformers, an invalid repo id
        raise ValueError(f"model: cannot load {directory!r} as an AutoModel{head}: {error}") from None
    return model, tokenizer


def ensure_pad_token(tokenizer: Any, model: str = "the model") -> int:
    """The tokenizer's pad id, its EOS made its pad token first where it has none (the loss masks never read pad
    ids, and the reward models pad as their config says, so any id serves); a clear error where it has neither."""
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"model: the tokenizer of {model} has neither a pad nor an EOS token; set one")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer.pad_token_id


def save_pretrained(model: torch.nn.Module, tokenizer: Any, path: str | Path,
                    state_dict: dict[str, torch.Tensor] | None = None, adapter: str | Path | None = None) -> None:
    """The trained model at ``path`` with ``save_pretrained`` (safetensors) and its tokenizer: full weights,
    loadable by plain transformers (``AutoModelForCausalLM.from_pretrained(path)``) and as a run's ``model``. A LoRA
    model's adapter is merged into those weights, and the adapter alone (adapter_model.safetensors +
    adapter_config.json, for peft) is written to ``adapter`` beside ``path`` (or to ``adapter``, given). ``state_dict``:
    the model's full weights when its own parameters are shards."""
    path = Path(path)
    if is_lora(model):
        adapter = path.parent / "adapter" if adapter is None else Path(adapter)
        model.save_pretrained(adapter, safe_serialization=True)
        tokenizer.save_pretrained(adapter)
        model = copy.deepcopy(model).merge_and_unload()
        state_dict = None
    model.save_pretrained(path, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(path)
