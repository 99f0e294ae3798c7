"""π_ref, the frozen starting policy the KL term measures against (docs/math.md, "KL to the reference")."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch

from grpokit.models.lora import is_lora


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
