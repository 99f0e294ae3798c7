"""PPO, the baseline GRPO replaces (docs/math.md, "PPO"): a value model beside the policy, GAE advantages.

Per token ``t`` of completion ``i`` the reward is ``−β (logp − ref_logp)``, plus the completion's
rule-based reward at its last token (or, with ``supervision: process``, each step's reward at the
token that ends it). GAE over those rewards and the value model's estimates gives the advantages
(whitened over the batch) and the returns; the policy takes the same clipped surrogate as GRPO
(``grpo_loss`` with per-token advantages and no KL term: the KL is in the reward), and the value model
a clipped squared error on the returns. Everything else — rollout, rewards, the update's loops,
logging, saving, the CLI — is GRPO's: with ``algorithm: ppo`` the trainer holds a :class:`Critic` (the
value model, its optimizer and loss) and trains it as a second learner of the same update.

The value model is the cost GRPO removes: as many weights as the policy again, their gradients and
Adam states, and a forward and backward pass per batch. ``benchmarks/grpo_vs_ppo.py`` measures it.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from grpokit.core.objective import kl_penalty
from grpokit.core.optim import adamw_with_schedule
from grpokit.core.ppo_objective import explained_variance_from_moments, gae, value_loss, whiten
from grpokit.models.logprobs import sequence_inputs
from grpokit.models.sharding import full_state_dict
from grpokit.rollout.generate import Rollout
from grpokit.training.distributed import World, all_sum_dict, data_parallel
from grpokit.training.sampling import Batch
from grpokit.training.update import Learner, LossCounts, UpdateBatch

# --------------------------------------------------------------------------------------------------
# The value model


class ValueModel(nn.Module):
    """The policy's transformer (without its LM head), copied, with a scalar head: ``V(s)`` per position.

    Initialised from the policy's weights, so it starts with the policy's features; the head starts
    small so the first values are near 0.
    """

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.backbone = copy.deepcopy(policy.base_model)  # e.g. LlamaModel inside LlamaForCausalLM
        hidden = policy.config.hidden_size
        self.head = nn.Linear(hidden, 1)
        nn.init.normal_(self.head.weight, std=1 / math.sqrt(hidden + 1))
        nn.init.zeros_(self.head.bias)
        self.backbone.requires_grad_(True)

    def forward(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor
    ) -> Tensor:
        """``V(s_t)`` (N, T) float32 for each completion token: the state before the token, i.e. the
        hidden state at the position that predicted it (as ``sequence_logprobs`` reads the logits)."""
        width = completion_ids.shape[1]
        hidden = self.backbone(
            **sequence_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask), use_cache=False
        ).last_hidden_state[:, -width - 1 : -1]  # (N, T, H)
        return self.head(hidden).squeeze(-1).float()

    def save(self, path: str | Path, state_dict: dict[str, Tensor] | None = None) -> None:
        """The backbone with ``save_pretrained`` (safetensors) and the head in ``value_head.safetensors``;
        ``state_dict``: this module's full state when its own parameters are shards."""
        path, state = Path(path), self.state_dict() if state_dict is None else state_dict
        part = lambda prefix: {k[len(prefix):]: v.detach().contiguous() for k, v in state.items()  # noqa: E731
                               if k.startswith(prefix)}
        self.backbone.save_pretrained(path, state_dict=part("backbone."), safe_serialization=True)
        save_file(part("head."), path / "value_head.safetensors")


# --------------------------------------------------------------------------------------------------
# The critic: PPO's state beside the policy, and its part of the step


def token_rewards(batch: Batch, old_logp: Tensor | None, ref_logp: Tensor | None, beta: float) -> Tensor:
    """(N, T): ``−β (old_logp − ref_logp)`` per token, plus each step's weighted reward at the token that
    ends it (outcome supervision: one step, the completion's reward at its last token)."""
    mask = batch.rollout.model_mask
    rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if ref_logp is not None:
        rewards -= beta * torch.where(mask.bool(), old_logp - ref_logp, 0.0)
    for i, steps in enumerate(batch.steps):
        for end, reward in steps:
            rewards[i, end] += reward
    return rewards


def moments(tensors: dict[str, Tensor], mask: Tensor, world: World) -> dict[str, float]:
    """Means of each tensor and of its square over the unmasked tokens of the whole batch (every
    process's): ``{"x": E[x], "x²": E[x²]}``."""
    valid = mask.bool()
    sums = {"n": float(valid.sum())}
    for name, tensor in tensors.items():
        picked = tensor[valid].double()
        sums[name], sums[name + "²"] = picked.sum().item(), (picked**2).sum().item()
    sums = all_sum_dict(sums, world)
    n = max(sums.pop("n"), 1.0)
    return {name: value / n for name, value in sums.items()}


class Critic:
    """PPO's value model with its optimizer, its schedule and its loss: a :class:`~grpokit.training.update.Learner`
    trained beside the policy, and the GAE advantages it gives the step."""

    def __init__(self, policy: nn.Module, config: Any, world: World, device: torch.device):
        self.config, self.world = config, world
        self.value_model = ValueModel(policy).to(device)  # copied before the policy is sharded
        train_module = data_parallel(self.value_model, world, config.parallelism)  # FSDP shards it in place
        optimizer, scheduler = adamw_with_schedule(  # over the parameters as sharded
            self.value_model, config, config.value_learning_rate or config.learning_rate
        )
        self.learner = Learner(prefix="value_", module=self.value_model, train_module=train_module,
                               optimizer=optimizer, scheduler=scheduler, loss=self.loss, loss_weight=config.vf_coef)

    def loss(self, model: nn.Module, batch: UpdateBatch, counts: LossCounts, first_pass: bool):
        """The clipped value loss of a micro-batch, over the minibatch's tokens."""
        values = model(*batch.rollout.sequences())
        loss, stats = value_loss(values, batch.old_values, batch.returns, batch.loss_mask,
                                 clip_range=self.config.cliprange_value, normalizer=counts.tokens)
        return loss, {"clipfrac": stats["value_clipfrac"]}

    @torch.no_grad()
    def frozen_values(self, rollout: Rollout) -> Tensor:
        """V(s_t) (N, T) at sampling time, micro-batch by micro-batch."""
        self.value_model.eval()
        values = [self.value_model(*micro.sequences()) for micro in rollout.split(self.config.micro_batch_size)]
        self.value_model.train()
        return torch.cat(values)

    def update_batch(self, batch: Batch, loss_mask: Tensor, old_logp: Tensor, ref_logp: Tensor | None) -> UpdateBatch:
        """The step's per-token rewards, GAE advantages (whitened over the batch) and returns."""
        config = self.config
        old_values = self.frozen_values(batch.rollout)
        rewards = token_rewards(batch, old_logp, ref_logp, config.beta)
        advantages, returns = gae(rewards, old_values, loss_mask, gamma=config.gamma, lam=config.lam)
        if config.whiten_advantages:
            m = moments({"a": advantages}, loss_mask, self.world)
            advantages = whiten(advantages, loss_mask, moments=(m["a"], m["a²"] - m["a"] ** 2))
        return UpdateBatch(batch.rollout, loss_mask, advantages, old_logp, ref_logp, returns, old_values)

    def metrics(self, fixed: UpdateBatch, last_pass: dict[str, float]) -> dict[str, float]:
        """The KL of the rollout policy (it is in the reward, not the loss) and the critic's diagnostics."""
        old_logp, ref_logp = fixed.old_logp, fixed.ref_logp
        kl = kl_penalty(old_logp, ref_logp) if ref_logp is not None else torch.zeros_like(old_logp)
        m = moments({"kl": kl, "V": fixed.old_values, "R": fixed.returns, "R-V": fixed.returns - fixed.old_values},
                    fixed.loss_mask, self.world)
        return {
            "kl": m["kl"], "value_loss": last_pass["value_loss"], "value_clipfrac": last_pass["value_clipfrac"],
            "value_grad_norm": last_pass["value_grad_norm"],
            "explained_variance": explained_variance_from_moments(m["R"], m["R²"], m["R-V"], m["R-V²"]),
            "value_mean": m["V"], "return_mean": m["R"],
        }

    def save(self, path: str | Path) -> None:
        """The value model in ``path`` (every process calls it: a sharded model is gathered first)."""
        state = full_state_dict(self.value_model, self.world.main)
        if self.world.main:
            self.value_model.save(path, state)
