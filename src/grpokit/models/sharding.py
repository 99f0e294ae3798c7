"""FSDP2 (``parallelism: fsdp``): everything that differs for a model sharded in place, in one place. The rest of
grpokit asks :func:`is_sharded` where a sharded model needs another path (decoding every pass on every process,
the model's own forward for the log-probs) and calls these functions for the rest."""

from __future__ import annotations

import torch


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether FSDP2 has sharded ``module`` in place (its parameters are gathered only inside its own forward)."""
    return hasattr(module, "set_requires_gradient_sync")


def shard(module: torch.nn.Module) -> torch.nn.Module:
    """``fully_shard`` on every decoder layer, then the root: each process keeps a shard of the parameters,
    gradients and optimizer states, and gathers a layer's parameters for its passes. In place."""
    from torch.distributed.fsdp import fully_shard

    for layer in [m for m in module.modules() if type(m).__name__.endswith("DecoderLayer")]:
        fully_shard(layer)
    fully_shard(module)
    return module


def sharded_part(module: torch.nn.Module) -> torch.nn.Module | None:
    """The first FSDP2-sharded module in ``module`` (itself included); None where nothing is sharded."""
    return next((m for m in module.modules() if is_sharded(m)), None)


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A value computed over sharded parameters (e.g. the gradient norm, a DTensor) as one plain tensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def full_state_dict(module: torch.nn.Module, main: bool) -> dict[str, torch.Tensor] | None:
    """The unsharded state dict (on CPU, on the main process; None elsewhere) of a module sharded by FSDP2;
    the plain state dict otherwise. A collective when sharded: every process calls it."""
    if not is_sharded(module):
        return module.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not main:
        return None
    # A tied parameter (e.g. the LM head sharing the embedding) is saved once, as save_pretrained does.
    first: dict[int, str] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        if first.setdefault(id(parameter), name) != name:
            state.pop(name, None)
    return state
