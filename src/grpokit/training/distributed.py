"""Data parallelism with ``torch.distributed``: one process per device, launched by ``torchrun``.

    torchrun --nproc_per_node 2 -m grpokit train CONFIG.yaml

A single process needs no launcher and takes the same code path with a world of size 1 (every
collective below is then the identity). The layout (docs/distributed.md):

- every rank walks the same seeded data order and takes its contiguous share of the step's B prompts,
  so groups are never split across ranks and the shards never overlap;
- each rank samples its groups with its own generator, seeded ``seed + 1000 · rank``;
- loss normalisers (token and sequence counts) are summed over ranks, so each rank's loss is its exact
  share of the global batch's loss, and the gradients are summed by DDP (its average, undone by
  scaling the loss by the world size): the update does not depend on the number of processes;
- metrics are computed by rank 0 from every rank's completions; only rank 0 prints, logs and writes
  checkpoints.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from grpokit.config import ConfigError
from grpokit.models.sharding import shard, sharded_part

RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


SINGLE = World()  # one process, no launcher


def require_one_process(command: str) -> None:
    """Refuse a torchrun launch of a trainer that runs in one process, where every process would train its own
    copy. A process group already up is allowed: iterative RL retrains its reward model on the first process."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized():
        raise ConfigError(f"{command} runs in one process; launch it without torchrun")


def init_world(device: str, prompts_per_step: int, environ: dict[str, str] | None = None) -> World:
    """The process's place in the world, from torchrun's environment; starts the process group (gloo on
    CPU, NCCL on CUDA) when there is more than one process. Bad settings fail here, before any work."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" not in env or int(env["WORLD_SIZE"]) == 1:
        return SINGLE
    missing = [key for key in RENDEZVOUS if key not in env]
    if missing:
        raise ConfigError(f"WORLD_SIZE={env['WORLD_SIZE']} but {', '.join(missing)} not set: launch with torchrun "
                          "(torchrun --nproc_per_node N -m grpokit train CONFIG.yaml)")
    world = World(rank=int(env["RANK"]), size=int(env["WORLD_SIZE"]), local_rank=int(env["LOCAL_RANK"]))
    if prompts_per_step % world.size:
        raise ConfigError(f"prompts_per_step={prompts_per_step} is not divisible by the world size {world.size}: "
                          "each process takes an equal share of whole groups")
    if not dist.is_initialized():
        cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        if cuda:
            torch.cuda.set_device(world.local_rank)
        dist.init_process_group("nccl" if cuda else "gloo", rank=world.rank, world_size=world.size,
                                store=_attempt_store(env, world))
        # Tear the group down before the interpreter does: a backend thread still running at exit
        # aborts the process ("terminate called without an active exception").
        atexit.register(_destroy)
    return world


def _attempt_store(env: Any, world: World) -> dist.Store | None:
    """The rendezvous store, under a prefix of this torchrun attempt's own, where torchrun shares its store with the
    processes (its default): a restarted attempt (``--max-restarts``) reaches the store its killed predecessor used,
    and without the prefix would read the dead processes' addresses there and fail to connect (torch issues 135712,
    167288). None (torch's own ``env://`` store) otherwise."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from datetime import timedelta

    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world.size, is_master=False,
                          timeout=timedelta(minutes=30))  # torch's default for a process group
    return dist.PrefixStore(f"grpokit/attempt-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _destroy() -> None:
    # no barrier: a process leaving on an error must not wait for the others
    if dist.is_initialized():
        dist.destroy_process_group()


def device_for(world: World, device: torch.device) -> torch.device:
    """CUDA processes use the GPU of their local rank."""
    if world.distributed and device.type == "cuda":
        return torch.device("cuda", world.local_rank)
    return device


def all_sum(value: float | torch.Tensor, world: World) -> Any:
    """Sum over ranks (identity in a world of one)."""
    if not world.distributed:
        return value
    tensor = torch.as_tensor(value, dtype=torch.float64).clone()
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor)
    return tensor.item() if not torch.is_tensor(value) else tensor.to(value.dtype).to(value.device)


def all_max(value: float, world: World) -> float:
    if not world.distributed:
        return value
    tensor = torch.tensor(value, dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def gather(obj: Any, world: World) -> list[Any]:
    """Every rank's ``obj`` (on CPU), in rank order, on every rank."""
    if not world.distributed:
        return [obj]
    objects: list[Any] = [None] * world.size
    dist.all_gather_object(objects, _move(obj))  # tensors travel on CPU, whatever the backend
    return objects


def _move(obj: Any) -> Any:
    """``obj`` with every tensor in it on the CPU."""
    if torch.is_tensor(obj):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _move(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_move(v) for v in obj)
    if hasattr(obj, "__dataclass_fields__"):
        return type(obj)(**{f: _move(getattr(obj, f)) for f in obj.__dataclass_fields__})
    return obj


def broadcast_from_main(module: torch.nn.Module, value: Any, world: World) -> Any:
    """The first process's weights of ``module`` (in place) and its ``value``, on every process: no shared
    filesystem needed."""
    if not world.distributed:
        return value
    with torch.no_grad():
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, src=0)
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_object(value: Any, world: World) -> Any:
    """The first process's ``value`` (picklable), on every process."""
    if not world.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def data_parallel(module: torch.nn.Module, world: World, parallelism: str = "ddp") -> torch.nn.Module:
    """The module to run training passes through, with several processes: DDP around it (gradients
    averaged over processes in backward), or FSDP2 applied in place (``fully_shard`` on every decoder
    layer, then the root: each process keeps a shard of the parameters, gradients and optimizer states,
    and gathers a layer's parameters for its passes). The module itself in a world of one."""
    if not world.distributed:
        return module
    if parallelism == "fsdp":
        return shard(module)
    from torch.nn.parallel import DistributedDataParallel

    on_cuda = next(module.parameters()).is_cuda
    return DistributedDataParallel(module, device_ids=[world.local_rank] if on_cuda else None)


@contextlib.contextmanager
def gradient_sync(module: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient reduction in this forward/backward (all micro-batches but the last). ``module``: DDP
    around the pass, or a module holding an FSDP2-sharded model."""
    sharded = sharded_part(module)
    if sharded is not None:
        sharded.set_requires_gradient_sync(enabled)
        yield
    elif enabled or not hasattr(module, "no_sync"):
        yield
    else:
        with module.no_sync():
            yield


def all_sum_dict(values: dict[str, float], world: World) -> dict[str, float]:
    """Each value summed over processes, in one collective."""
    if not world.distributed:
        return values
    summed = all_sum(torch.tensor([values[k] for k in values], dtype=torch.float64), world)
    return dict(zip(values, summed.tolist()))
