"""Wiring of PPO's options (``algorithm: ppo``): whitening, γ/λ, vf_coef, cliprange_value and the value model's
optimizer reach the functions that use them, checked against the formulas with code the trainer does not share."""

import math

import pytest
import torch

from grpokit.algorithms import grpo as grpokit_trainer
from grpokit.algorithms.grpo import GRPOTrainer
from grpokit.algorithms.ppo import token_rewards
from grpokit.config import GRPOConfig
from grpokit.core.ppo_objective import gae, value_loss, whiten
from grpokit.training.update import NonfiniteGuard, UpdateBatch, update

ROWS = [{"prompt": f"Count {i}:", "answer": "1"} for i in range(32)]


def spread(prompts, completions, **kw):
    """A reward with spread in every group."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


def ppo_trainer(tokenizer, model, tmp_path, **overrides) -> GRPOTrainer:
    """A tiny PPO run: 2 prompts × 4 completions of at most 6 tokens, one micro-batch, float32."""
    values = dict(algorithm="ppo", output_dir=str(tmp_path / "run"), prompts_per_step=2, num_generations=4,
                  max_completion_length=6, learning_rate=1e-2, max_steps=4, micro_batch_size=8, progress_bar=False,
                  lr_schedule="constant", mixed_precision="no", device="cpu")
    values.update(overrides)
    return GRPOTrainer(GRPOConfig(**values), model=model, tokenizer=tokenizer, train_dataset=ROWS,
                       reward_funcs=[spread])


def test_whiten_hand_computed():
    """whiten is (x − mean) / √(var + 1e-8) over the unmasked entries, with the (biased) variance, not E[x²]; masked
    entries are 0 (planted: ``var = E[x²]``)."""
    x = torch.tensor([[2.0, 4.0, 99.0], [6.0, -50.0, 7.0]])  # unmasked 2, 4, 6: mean 4, variance 8/3
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    w = whiten(x, mask)
    scale = 1 / math.sqrt(8 / 3 + 1e-8)
    torch.testing.assert_close(w, torch.tensor([[-2 * scale, 0.0, 0.0], [2 * scale, 0.0, 0.0]]))
    assert w[mask.bool()].mean().abs() < 1e-6 and (w[mask.bool()] ** 2).mean() == pytest.approx(1.0, abs=1e-6)


def test_the_critic_whitens_the_gae_advantages_the_policy_trains_on(tokenizer, tiny_model, tmp_path, monkeypatch):
    """A PPO step's advantages are GAE (the run's γ, λ, β) over the loss mask (truncated completions masked out),
    whitened to masked mean 0 and variance 1; the returns are not whitened; the policy's loss gets exactly those
    per-token advantages with no KL term (planted: the whitening's variance as E[a²]; whiten_advantages ignored;
    γ and λ swapped; β in the loss; GAE over model_mask instead of the loss mask)."""
    trainer = ppo_trainer(tokenizer, tiny_model, tmp_path, gamma=0.9, lam=0.8, beta=0.1,
                          mask_truncated_completions=True)
    seen, sample, real_update, real_loss = {}, trainer.sampler.sample, grpokit_trainer.update, grpokit_trainer.grpo_loss

    def sampled(*args):
        seen["out"] = sample(*args)
        rollout = seen["out"][0].rollout
        rollout.truncated = torch.arange(len(rollout)) % 3 == 0  # a known mix of truncated and finished completions
        return seen["out"]

    monkeypatch.setattr(trainer.sampler, "sample", sampled)
    monkeypatch.setattr(grpokit_trainer, "update", lambda learners, fixed, **kw: seen.update(fixed=fixed)
                        or real_update(learners, fixed, **kw))
    monkeypatch.setattr(grpokit_trainer, "grpo_loss", lambda *a, **kw: seen.update(loss=(a, kw)) or real_loss(*a, **kw))
    trainer.training_step()
    batch, fixed = seen["out"][0], seen["fixed"]
    assert torch.equal(fixed.loss_mask, batch.rollout.model_mask * ~batch.rollout.truncated.unsqueeze(1))
    mask = fixed.loss_mask.bool()
    raw, returns = gae(token_rewards(batch, fixed.old_logp, fixed.ref_logp, 0.1), fixed.old_values, fixed.loss_mask,
                       gamma=0.9, lam=0.8)
    picked = raw[mask].double()
    assert picked.mean().abs() > 0.05  # a raw mean far from 0, so E[a²] and the variance differ
    expected = torch.where(mask, (raw - picked.mean()) / torch.sqrt(picked.var(unbiased=False) + 1e-8), 0.0)
    torch.testing.assert_close(fixed.advantages, expected.float(), atol=1e-5, rtol=1e-5)
    assert fixed.advantages[mask].mean().abs() < 1e-5
    assert fixed.advantages[mask].var(unbiased=False).item() == pytest.approx(1.0, abs=1e-4)
    torch.testing.assert_close(fixed.returns, returns)
    assert fixed.advantages[batch.rollout.truncated].abs().sum() == 0
    (logp, old_logp, ref_logp, advantages, loss_mask), options = seen["loss"]
    assert torch.equal(advantages, fixed.advantages) and options["beta"] == 0.0  # PPO's KL is in the reward


def test_vf_coef_and_cliprange_value_reach_the_value_update(tokenizer, tiny_model, tmp_path):
    """The critic's loss is value_loss with the run's cliprange_value, and its gradient is vf_coef times that loss's
    (planted: the clip range fixed at its default; the loss weight left out of the backward)."""
    trainer = ppo_trainer(tokenizer, tiny_model, tmp_path, vf_coef=0.25, cliprange_value=0.05)
    batch, _, _ = trainer.sampler.sample()
    rollout, mask = batch.rollout, batch.rollout.completion_mask
    critic = trainer.critic
    values = critic.value_model(*rollout.sequences())
    gen = torch.Generator().manual_seed(0)
    # V_old away from V, so that the clip is active for many tokens
    old_values, returns = values.detach() + 0.3 * torch.randn(mask.shape, generator=gen), torch.randn(mask.shape)
    expected, _ = value_loss(values, old_values, returns, mask, clip_range=0.05)
    default, _ = value_loss(values, old_values, returns, mask, clip_range=0.2)
    assert abs(expected.item() - default.item()) > 1e-3
    params = list(critic.value_model.parameters())
    expected_grad = torch.cat([g.flatten() for g in torch.autograd.grad(expected, params)])

    applied = []
    critic.learner.optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: applied.append(torch.cat([p.grad.flatten() for p in params]).clone()))
    fixed = UpdateBatch(rollout, mask, torch.zeros(mask.shape), returns=returns, old_values=old_values)
    (stats,) = update([critic.learner], fixed, micro_batch_size=8, max_grad_norm=0, guard=NonfiniteGuard(1))
    assert stats["value_loss"] == pytest.approx(expected.item(), abs=1e-6)
    torch.testing.assert_close(applied[0], 0.25 * expected_grad, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("value_learning_rate", [None, 3e-3])
def test_the_value_models_optimizer_takes_the_runs_settings(tokenizer, tiny_model, tmp_path, value_learning_rate):
    """value_learning_rate (else learning_rate), adam_beta1/2, weight_decay and the schedule reach the value model's
    AdamW (planted: the critic's optimizer at learning_rate whatever value_learning_rate says)."""
    trainer = ppo_trainer(tokenizer, tiny_model, tmp_path, learning_rate=1e-2, value_learning_rate=value_learning_rate,
                          adam_beta1=0.8, adam_beta2=0.95, weight_decay=0.05, warmup_steps=2)
    (group,) = trainer.critic.learner.optimizer.param_groups
    assert (group["initial_lr"], group["betas"], group["weight_decay"]) == (value_learning_rate or 1e-2, (0.8, 0.95),
                                                                            0.05)
    assert group["lr"] == pytest.approx(0.5 * group["initial_lr"])  # the first of 2 warmup updates
    assert {id(p) for p in group["params"]} == {id(p) for p in trainer.critic.value_model.parameters()}
