"""Importance sampling for a lower-precision sampler: the weights of each mode against hand-computed values, the loss
they reweight, and no change at all when the sampler is the policy."""

import math

import pytest
import torch

from grpokit.core.importance import IS_MODES, importance_weights
from grpokit.core.objective import grpo_loss


def test_weights_are_the_capped_ratio_and_one_on_padding():
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    sample = torch.tensor([[-1.5, -1.0, -3.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    weights = importance_weights(old, sample, mask, cap=2.0, mode="token_truncate")
    # e^0.5 = 1.6487 (under the cap), e^-1 = 0.3679, e^2.5 = 12.18 → 2 (capped), padding → 1
    assert weights[0].tolist() == pytest.approx([math.exp(0.5), math.exp(-1.0), 2.0, 1.0])
    # token_mask: the token over the cap left out, the others keep their ratio
    masked = importance_weights(old, sample, mask, cap=2.0, mode="token_mask")
    assert masked[0].tolist() == pytest.approx([math.exp(0.5), math.exp(-1.0), 0.0, 1.0])
    with pytest.raises(ValueError, match="cap must be >= 1"):
        importance_weights(old, sample, mask, cap=0.5)
    with pytest.raises(ValueError, match="token_truncate, token_mask, sequence_truncate, sequence_mask"):
        importance_weights(old, sample, mask, cap=2.0, mode="sequence")


def test_sequence_weights_are_the_completions_ratio_on_each_of_its_tokens():
    old = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -0.5, -0.2]])
    sample = torch.tensor([[-1.5, -1.0, 9.0], [-2.0, -1.0, -0.2]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # completion 0: e^(0.5 − 1) = e^-0.5 = 0.607 (padding left out); completion 1: e^(1 + 0.5 + 0) = e^1.5 = 4.48
    truncated = importance_weights(old, sample, mask, cap=3.0, mode="sequence_truncate")
    torch.testing.assert_close(truncated, torch.tensor([[math.exp(-0.5)] * 2 + [1.0], [3.0] * 3]))
    masked = importance_weights(old, sample, mask, cap=3.0, mode="sequence_mask")
    torch.testing.assert_close(masked, torch.tensor([[math.exp(-0.5)] * 2 + [1.0], [0.0] * 3]))
    under = importance_weights(old, sample, mask, cap=5.0, mode="sequence_mask")  # under the cap: the ratio itself
    assert under[1].tolist() == pytest.approx([math.exp(1.5)] * 3)


def test_the_loss_weights_each_tokens_clipped_term_and_not_the_kl():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -1.0]], requires_grad=True)
    sample = torch.tensor([[-1.2, -1.0], [-0.5, -4.0]])
    ref = torch.tensor([[-1.1, -2.2], [-0.4, -1.0]])
    advantages = torch.tensor([1.0, -0.5])
    mask = torch.ones(2, 2)
    loss, stats = grpo_loss(logp, None, ref, advantages, mask, beta=0.1, sample_logp=sample, is_cap=3.0,
                            is_mode="token_truncate")
    assert stats["is_capped_frac"] == 0.25
    # μ = 1: ρ = 1, so each token's clipped term is A; weights min(e^(logp − sample), 3)
    w = [[math.exp(0.2), math.exp(-1.0)], [1.0, 3.0]]
    a = [1.0, -0.5]
    d = [[math.exp(r - p) - (r - p) - 1 for p, r in zip(pr, rr)] for pr, rr in zip(logp.tolist(), ref.tolist())]
    expected = -sum(sum(w[i][t] * a[i] - 0.1 * d[i][t] for t in range(2)) / 2 for i in range(2)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["is_weight_mean"] == pytest.approx((w[0][0] + w[0][1] + 1 + 3) / 4)
    k3 = [math.exp(o - s) - (o - s) - 1 for o, s in zip([-1.0, -2.0, -0.5, -1.0], [-1.2, -1.0, -0.5, -4.0])]
    assert stats["sampler_kl"] == pytest.approx(sum(k3) / 4)


def test_a_sampler_equal_to_the_policy_leaves_the_loss_and_gradient_unchanged():
    torch.manual_seed(0)
    logp = torch.randn(4, 6, requires_grad=True)
    old, ref, advantages = logp.detach() + 0.1 * torch.randn(4, 6), torch.randn(4, 6), torch.randn(4)
    mask = (torch.rand(4, 6) > 0.2).float()
    plain, _ = grpo_loss(logp, old, ref, advantages, mask)
    (grad,) = torch.autograd.grad(plain, logp)
    for mode in IS_MODES:
        weighted, stats = grpo_loss(logp, old, ref, advantages, mask, sample_logp=old.clone(), is_mode=mode)
        (weighted_grad,) = torch.autograd.grad(weighted, logp)
        assert torch.equal(plain, weighted) and torch.equal(grad, weighted_grad), mode
        assert stats["is_weight_mean"] == 1.0 and stats["sampler_kl"] == 0.0 and stats["is_capped_frac"] == 0.0


def test_a_sequence_mode_weights_every_token_of_a_completion_alike_in_the_loss():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -1.0]], requires_grad=True)
    sample = torch.tensor([[-1.2, -1.0], [-0.5, -4.0]])
    advantages, mask = torch.tensor([1.0, -0.5]), torch.ones(2, 2)
    loss, stats = grpo_loss(logp, None, None, advantages, mask, beta=0.0, sample_logp=sample, is_cap=3.0,
                            is_mode="sequence_mask")
    # completion 0: e^(0.2 − 1) = e^-0.8 on both tokens; completion 1: e^3 = 20.1 > 3, left out
    expected = -(math.exp(-0.8) * 1.0 + 0.0) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["is_capped_frac"] == 0.5 and stats["is_weight_mean"] == pytest.approx(math.exp(-0.8) / 2)
