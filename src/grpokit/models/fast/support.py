"""Which models the fast path runs: :func:`unsupported` (None, or the reason a model cannot take it, so
that callers use the model's own forward) and :func:`unwrap_peft` (the model under a peft wrapper)."""

from __future__ import annotations

from torch import nn

SUPPORTED = ("llama", "qwen2", "mistral")


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` under a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def unsupported(model: nn.Module) -> str | None:
    """None when :class:`~grpokit.models.fast.llama_family.LlamaFamily` runs ``model`` exactly; otherwise
    the reason it cannot."""
    inner = unwrap_peft(model)
    config = getattr(inner, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        return f"model_type {model_type!r} is not one of {SUPPORTED}"
    backbone = getattr(inner, "model", None)
    if backbone is None or not hasattr(backbone, "layers") or not hasattr(backbone, "rotary_emb"):
        return "no model.layers / model.rotary_emb (an older transformers layout)"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (only silu)"
    if getattr(config, "use_sliding_window", False) or (model_type == "mistral" and config.sliding_window):
        return "a sliding attention window"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return "layer_types other than full_attention"
    if inner.training and getattr(config, "attention_dropout", 0.0):
        return "attention dropout in training mode"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    if any(type(p).__name__ == "DTensor" for p in inner.parameters()):  # no torch.distributed import needed
        return "sharded (FSDP) parameters"
    return None
