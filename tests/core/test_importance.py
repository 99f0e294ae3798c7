"""Truncated importance sampling for a lower-precision sampler: the weights against hand-computed values, the loss
they reweight, and no change at all when the sampler is the policy."""

import math

import pytest
import torch

from grpokit.core.importance import truncated_importance_weights
from grpokit.core.objective import grpo_loss


def test_weights_are_the_capped_ratio_and_one_on_padding():
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    sample = torch.tensor([[-1.5, -1.0, -3.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    weights = truncated_importance_weights(old, sample, mask, cap=2.0)
    # e^0.5 = 1.6487 (under the cap), e^-1 = 0.3679, e^2.5 = 12.18 → 2 (capped), padding → 1
    assert weights[0].tolist() == pytest.approx([math.exp(0.5), math.exp(-1.0), 2.0, 1.0])
    with pytest.raises(ValueError, match="cap must be >= 1"):
        truncated_importance_weights(old, sample, mask, cap=0.5)


def test_the_loss_weights_each_tokens_clipped_term_and_not_the_kl():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -1.0]], requires_grad=True)
    sample = torch.tensor([[-1.2, -1.0], [-0.5, -4.0]])
    ref = torch.tensor([[-1.1, -2.2], [-0.4, -1.0]])
    advantages = torch.tensor([1.0, -0.5])
    mask = torch.ones(2, 2)
    loss, stats = grpo_loss(logp, None, ref, advantages, mask, beta=0.1, sample_logp=sample, is_cap=3.0)
    # μ = 1: ρ = 1, so each token's clipped term is A; weights min(e^(logp − sample), 3)
    w = [[math.exp(0.2), math.exp(-1.0)], [1.0, 3.0]]
    a = [1.0, -0.5]
    d = [[math.exp(r - p) - (r - p) - 1 for p, r in zip(pr, rr)] for pr, rr in zip(logp.tolist(), ref.tolist())]
    expected = -sum(sum(w[i][t] * a[i] - 0.1 * d[i][t] for t in range(2)) / 2 for i in range(2)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["is_weight_mean"] == pytest.approx((w[0][0] + w[0][1] + 1 + 3) / 4)
    assert stats["is_capped_frac"] == 0.25
    k3 = [math.exp(o - s) - (o - s) - 1 for o, s in zip([-1.0, -2.0, -0.5, -1.0], [-1.2, -1.0, -0.5, -4.0])]
    assert stats["sampler_kl"] == pytest.approx(sum(k3) / 4)


def test_a_sampler_equal_to_the_policy_leaves_the_loss_and_gradient_unchanged():
    torch.manual_seed(0)
    logp = torch.randn(4, 6, requires_grad=True)
    old, ref, advantages = logp.detach() + 0.1 * torch.randn(4, 6), torch.randn(4, 6), torch.randn(4)
    mask = (torch.rand(4, 6) > 0.2).float()
    plain, _ = grpo_loss(logp, old, ref, advantages, mask)
    (grad,) = torch.autograd.grad(plain, logp)
    weighted, stats = grpo_loss(logp, old, ref, advantages, mask, sample_logp=old.clone())
    (weighted_grad,) = torch.autograd.grad(weighted, logp)
    assert torch.equal(plain, weighted) and torch.equal(grad, weighted_grad)
    assert stats["is_weight_mean"] == 1.0 and stats["sampler_kl"] == 0.0 and stats["is_capped_frac"] == 0.0
