"""LoRA (peft): the adapter put on a model, and the one layout every trainer saves a LoRA model in: the merged
weights in ``model/`` (plain transformers loads them) and the adapter alone in ``adapter/`` beside it."""

from __future__ import annotations

from typing import Any

import torch

from grpokit.config import ConfigError


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
    targets = config.lora_target_modules
    lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules="all-linear" if targets == ["all-linear"] else targets, task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, lora)
    except ValueError as error:  # e.g. no default target modules for this architecture
        raise ConfigError(f"lora_target_modules: {error}") from None
