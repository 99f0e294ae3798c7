"""The part of a checkpoint that FSDP2 (``parallelism: fsdp``) writes: every process's shards of the models and of
their optimizers' states, with ``torch.distributed.checkpoint`` (DCP), in ``shards/`` of the checkpoint directory.

:mod:`grpokit.training.checkpoint` writes the rest as for any run (the exported model in ``model/``, the schedules and
every process's random streams in ``trainer_state.pt``, ``state.json``) and publishes the whole directory
atomically, with the manifest covering the shard files too. Only tensors go to DCP: an optimizer's
``param_groups`` (learning rate, betas, parameter names) go to ``trainer_state.pt``, so that DCP's loader never
unpickles a stored object; its ``.metadata`` file (a pickle of DCP's own dataclasses) is read by an unpickler that
accepts those classes and torch's sizes and dtypes only.

Resharding (a checkpoint of W processes read by another number) is refused by the caller: each process's
sampling stream is seeded by its rank, so another layout could not continue the run exactly.
"""

from __future__ import annotations

import enum
import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

SHARDS = "shards"  # the DCP directory in a checkpoint
DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
SAFE_GLOBALS = {("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
                ("collections", "OrderedDict")}


def write_shards(state: dict[str, Any], staging: Path) -> dict[str, Any]:
    """Every process writes its shards of ``state["modules"]`` and of the optimizers in ``state["sharded"]`` (a
    collective; DCP's coordinator writes ``.metadata`` once every process has written). Returns what goes to
    ``trainer_state.pt`` instead: each optimizer's ``param_groups`` (None for an optimizer that has taken no step
    yet, whose state is not written: initialising it here would count a step the run did not take)."""
    tensors: dict[str, Any] = {name: get_model_state_dict(module) for name, module in state["modules"].items()}
    groups: dict[str, Any] = {}
    for name, (module, optimizer) in state.get("sharded", {}).items():
        if not optimizer.state:
            groups[name] = None
            continue
        saved = get_optimizer_state_dict(module, optimizer)
        tensors[name], groups[name] = saved["state"], saved["param_groups"]
    dcp_save(tensors, storage_writer=FileSystemWriter(str(staging / SHARDS)))
    return groups


def read_shards(path: Path, state: dict[str, Any], groups: dict[str, Any]) -> None:
    """Load the shards of ``path/shards`` into the modules and optimizers of ``state`` in place (a collective). Each
    process reads the pieces of its own shards, whichever files hold them. ``groups``: :func:`write_shards`'s value,
    read back from ``trainer_state.pt``."""
    modules = {name: get_model_state_dict(module) for name, module in state["modules"].items()}
    optimizers = {}
    for name, (module, optimizer) in state.get("sharded", {}).items():
        if groups.get(name) is not None:  # the target's tensors: DCP loads in place (a fresh optimizer is initialised)
            optimizers[name] = get_optimizer_state_dict(module, optimizer)
    dcp_load({**modules, **{name: saved["state"] for name, saved in optimizers.items()}},
             storage_reader=SafeReader(str(path / SHARDS)))
    for name, module in state["modules"].items():
        set_model_state_dict(module, modules[name])
    for name, saved in optimizers.items():
        module, optimizer = state["sharded"][name]
        set_optimizer_state_dict(module, optimizer, {"state": saved["state"], "param_groups": groups[name]})


def _enum_member(cls: Any, name: Any) -> Any:
    """``getattr(cls, name)`` for a member of an enum the unpickler allowed, and nothing else (a general getattr
    would reach any attribute, a method to call among them)."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"getattr({cls!r}, {name!r}) is not part of a checkpoint's shard metadata")


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds DCP's metadata and nothing else: any other global (a function a crafted file would call) is
    refused before anything runs."""

    def find_class(self, module: str, name: str) -> Any:
        if module in DCP_MODULES:
            found = getattr(__import__(module, fromlist=[name]), name, None)
            if isinstance(found, type):
                return found
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None),
                                                               (torch.dtype, torch.layout, torch.memory_format))):
            return getattr(torch, name)
        if (module, name) in SAFE_GLOBALS:  # a layout looked up by its name; the path the checkpoint was written to
            return getattr(__import__(module, fromlist=[name]), name)
        if (module, name) == ("builtins", "getattr"):  # how some Pythons (3.11.2, Debian 12's) pickle an enum member
            return _enum_member
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's shard metadata")


class SafeReader(FileSystemReader):
    """DCP's file reader with ``.metadata`` read by :class:`_MetadataUnpickler` (DCP's own reader unpickles it
    unrestricted; the tensors it reads with ``torch.load(weights_only=True)``)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        raw = (Path(self.path) / ".metadata").read_bytes()
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
