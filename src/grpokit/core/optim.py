"""The optimizer and its learning-rate schedule: AdamW (or bitsandbytes' 8-bit AdamW) with linear warmup,
then linear, cosine or constant."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

OPTIMIZERS = ("adamw", "adamw_8bit")
NO_BITSANDBYTES = "optimizer: adamw_8bit needs bitsandbytes: pip install 'grpokit[8bit]'"
OPTIMIZER_HELP = (
    "'adamw': torch's AdamW, its two moments in float32 (8 bytes per trained parameter). 'adamw_8bit': "
    "bitsandbytes' AdamW8bit (pip install 'grpokit[8bit]'; TRL's optim='adamw_8bit'): both moments "
    "block-wise quantised to 8 bits, 2 bytes per parameter, a slightly different update; embedding "
    "weights (and a head tied to them) keep float32 moments, as bitsandbytes advises (SmolLM2-135M: "
    "-0.6 GB; docs/benchmarks.md)."
)


def lr_factor(warmup: int, schedule: str, total: int) -> Callable[[int], float]:
    """The multiplier of the learning rate at optimizer update ``update`` (0-based) of ``total``."""

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / warmup
        progress = (update - warmup) / max(1, total - warmup)
        if schedule == "linear":
            return max(0.0, 1.0 - progress)
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return factor


def adamw_with_schedule(model: torch.nn.Module, config: Any, lr: float,
                        total_updates: int | None = None) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over the model's trainable parameters, and its warmup + decay schedule over ``total_updates``
    (default: a GRPO run's ``max_steps × num_iterations × num_minibatches`` updates)."""
    params = [p for p in model.parameters() if p.requires_grad]
    betas = (config.adam_beta1, config.adam_beta2)
    if config.optimizer == "adamw_8bit":
        optimizer = adamw_8bit(model, params, lr=lr, betas=betas, weight_decay=config.weight_decay)
    else:
        # The fused kernel (one pass over all parameters) is the same update at ~2.5× the speed of the
        # per-parameter loop on the CPU; sharded (FSDP) parameters keep the loop.
        fused = all(type(p) is torch.nn.Parameter and p.dtype.is_floating_point for p in params)
        optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=config.weight_decay, fused=fused)
    if total_updates is None:
        total_updates = config.max_steps * config.num_iterations * config.num_minibatches
    schedule = lr_factor(config.warmup_steps, config.lr_schedule, total_updates)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def adamw_8bit(model: nn.Module, params: list[nn.Parameter], **settings: Any) -> torch.optim.Optimizer:
    """bitsandbytes' AdamW8bit over ``params`` (Dettmers et al., "8-bit Optimizers via Block-wise
    Quantization"): each moment stored in 8 bits per value, with one float32 scale per block of 256 (its
    tensors under 4,096 values keep float32 moments). The weights of ``model``'s embeddings keep float32
    moments, as bitsandbytes' own StableEmbedding has them: quantising them is the unstable case the
    paper names."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return _adamw_8bit_class()(params, float32_moments=embeddings, **settings)


@functools.cache
def _adamw_8bit_class() -> type:
    # its CPU backend warns at import, on CPUs with AVX512-BF16, of a 4-bit matmul kernel this never uses
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        import bitsandbytes as bnb
    except ImportError as error:
        raise ImportError(NO_BITSANDBYTES) from error
    from torch.optim.adamw import adamw as fused_adamw  # torch's functional AdamW (fused=True below)

    class AdamW8bit(bnb.optim.AdamW8bit):
        """AdamW8bit with float32 moments for the parameters whose ids are in ``float32_moments``, set here
        rather than through bitsandbytes' process-wide GlobalOptimManager, which keys its settings by a
        parameter's position and so would hand them to every other 8-bit optimizer of the process."""

        def __init__(self, params: Any, *, float32_moments: set[int], **settings: Any):
            self.float32_moments = float32_moments
            super().__init__(params, **settings)

        def get_config(self, gindex: int, pindex: int, group: dict) -> dict:
            config = super().get_config(gindex, pindex, group)
            if id(group["params"][pindex]) in self.float32_moments:
                config["optim_bits"] = 32
            return config

        @torch.no_grad()
        def update_step(self, group: dict, p: nn.Parameter, gindex: int, pindex: int) -> None:
            # On the CPU, float32 moments take torch's fused AdamW kernel: bitsandbytes' CPU update holds
            # float32 temporaries the size of the tensor, which for an embedding set the step's peak memory.
            state = self.state[p]
            if p.device.type != "cpu" or state["state1"].dtype != torch.float32:
                return super().update_step(group, p, gindex, pindex)
            config = self.get_config(gindex, pindex, group)
            step = torch.tensor(float(state["step"]))  # the kernel counts it up to this step's
            state["step"] += 1
            fused_adamw(
                [p], [p.grad], [state["state1"]], [state["state2"]], [], [step], fused=True, amsgrad=False,
                beta1=config["betas"][0], beta2=config["betas"][1], lr=config["lr"],
                weight_decay=config["weight_decay"], eps=config["eps"], maximize=False,
            )

    return AdamW8bit
