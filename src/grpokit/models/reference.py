"""π_ref, the frozen starting policy the KL term measures against (docs/math.md, "KL to the reference")."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from grpokit.models.lora import is_lora
from grpokit.models.sharding import copy_parameters, fill_shards, is_sharded, skeleton

# reference_placement's values; "auto": "shard" when the policy is sharded (parallelism: fsdp), else "replicate"
PLACEMENTS = ("auto", "replicate", "shard", "cpu_offload")


def resolve_placement(placement: str, policy_sharded: bool) -> str:
    """Where π_ref lives: ``placement`` (reference_placement) for a policy sharded by FSDP2; a whole copy
    ("replicate") beside a whole policy (one process, or DDP), which is what a world of one shards to."""
    if placement not in PLACEMENTS:
        raise ValueError(f"reference_placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    if not policy_sharded:
        return "replicate"
    return "shard" if placement == "auto" else placement


@dataclass
class Reference:
    """π_ref, the frozen starting policy (docs/math.md, "KL to the reference"): a frozen copy of its weights, whole
    ("replicate"), or sharded like the policy by FSDP2 ("shard"; "cpu_offload": the shards in CPU memory), or, with
    LoRA, the policy itself with its adapter disabled (no second copy)."""

    model: torch.nn.Module
    adapter_disabled: bool = False
    placement: str = "replicate"

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The context in which ``model`` computes π_ref."""
        with self.model.disable_adapter() if self.adapter_disabled else contextlib.nullcontext():
            yield
        if is_sharded(self.model):
            # The root's parameters (embeddings, LM head, final norm) stay gathered after a forward without
            # backward: shard them again, so that between passes a process holds its shards only.
            self.model.reshard()

    def shard_like(self, policy: torch.nn.Module) -> None:
        """Shard the reference's frame (built before ``policy`` was sharded) as ``policy`` now is, each process
        filling its shards from its own shards of the policy: the whole reference never exists anywhere."""
        if self.placement in ("shard", "cpu_offload"):
            fill_shards(self.model, policy, offload=self.placement == "cpu_offload")

    def reset(self, policy: torch.nn.Module) -> None:
        """π_ref := ``policy`` as it is now (iterative RL), shard by shard where both are sharded."""
        for model in (self.model, policy):
            if is_sharded(model):
                model.reshard()  # each parameter as its shard (a forward leaves the root's gathered)
        copy_parameters(self.model, policy)


def build_reference(policy: torch.nn.Module, beta: float, mixed_precision: str = "no",
                    placement: str = "replicate") -> Reference | None:
    """π_ref for ``policy`` as it is now; None when β = 0, which turns the reference off entirely: it is
    then never created nor run. With ``mixed_precision: bf16`` its linear layers are stored in bfloat16 (see
    :func:`store_linear_layers_in_bf16`). ``placement`` (:func:`resolve_placement`'s): "replicate", a whole copy now;
    "shard" or "cpu_offload", a frame without weights (no memory), which :meth:`Reference.shard_like` shards and
    fills once ``policy`` is sharded."""
    if beta == 0:
        return None
    if is_lora(policy):
        return Reference(policy, adapter_disabled=True)
    whole = placement == "replicate"
    reference = copy.deepcopy(policy).eval().requires_grad_(False) if whole else skeleton(policy)
    if mixed_precision == "bf16":
        store_linear_layers_in_bf16(reference)
    return Reference(reference, placement=placement)


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
