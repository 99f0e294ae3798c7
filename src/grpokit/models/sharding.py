"""FSDP2 (``parallelism: fsdp``): everything that differs for a model sharded in place, in one place. The rest of
grpokit asks :func:`is_sharded` where a sharded model needs another path (decoding every pass on every process,
the model's own forward for the log-probs) and calls these functions for the rest."""

from __future__ import annotations

import copy

import torch


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether FSDP2 has sharded ``module`` in place (its parameters are gathered only inside its own forward)."""
    return hasattr(module, "set_requires_gradient_sync")


def shard(module: torch.nn.Module, offload: bool = False) -> torch.nn.Module:
    """``fully_shard`` on every decoder layer, then the root: each process keeps a shard of the parameters,
    gradients and optimizer states, and gathers a layer's parameters for its passes. In place. ``offload``: the
    shards stay in CPU memory and each layer's are copied to the device for its passes (FSDP2's CPUOffloadPolicy)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    # pinned memory speeds the copies to a GPU, and needs one (a CPU-only torch refuses to pin)
    options = {"offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())} if offload else {}
    for layer in [m for m in module.modules() if type(m).__name__.endswith("DecoderLayer")]:
        fully_shard(layer, **options)
    fully_shard(module, **options)
    return module


def skeleton(module: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of ``module`` whose parameters are on the meta device (no memory) and whose buffers are real
    copies: the frame of a copy that :func:`fill_shards` shards and fills without the whole of it ever existing on a
    process. Tied parameters stay tied."""
    memo: dict[int, object] = {id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
                               for p in module.parameters()}
    return copy.deepcopy(module, memo).eval().requires_grad_(False)


def fill_shards(frame: torch.nn.Module, source: torch.nn.Module, offload: bool = False) -> torch.nn.Module:
    """Shard ``frame`` (a :func:`skeleton` of ``source`` before ``source`` was sharded) as ``source`` is, and fill
    each process's shards from its own shards of ``source``'s parameters (cast to ``frame``'s dtypes): no gather,
    no process holds more than its shards. ``offload``: as :func:`shard`'s. In place."""
    shard(frame, offload)
    # to_empty allocates the shards, and would empty the buffers (the rotary frequencies, computed at init) too
    buffers = [(m, name, b) for m in frame.modules() for name, b in m._buffers.items() if b is not None]
    theirs = next(source.parameters())
    frame.to_empty(device="cpu" if offload else local(theirs).device)
    for module, name, buffer in buffers:
        module._buffers[name] = buffer
    copy_parameters(frame, source)
    return frame


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a sharded parameter (a DTensor); the tensor itself otherwise."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@torch.no_grad()
def copy_parameters(target: torch.nn.Module, source: torch.nn.Module) -> None:
    """``source``'s parameter values into ``target``'s (the same architecture, sharded alike or both whole), shard by
    shard where sharded, cast to ``target``'s dtypes."""
    # parameters() lists a tied weight once, in the same order in both
    for mine, theirs in zip(target.parameters(), source.parameters(), strict=True):
        local(mine).copy_(local(theirs))


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
