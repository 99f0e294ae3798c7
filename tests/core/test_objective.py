"""The objective against hand-computed values (arithmetic in comments) and its properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpokit import aggregate_loss, group_advantages, grpo_loss, kl_penalty, token_logprobs

LN = math.log


# ---- group_advantages ----------------------------------------------------------------------------


def test_group_scale_hand_computed():
    # group 1: rewards [1, 0]: mean 0.5, unbiased std sqrt(0.5) = 0.70711 → ±0.5 / (0.70711 + 1e-4)
    # group 2: rewards [3, 1, 2]? no — groups have equal size; use [2, 2]: zero variance → exactly 0
    adv = group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), 2)
    expected = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert adv.tolist() == pytest.approx([expected, -expected, 0.0, 0.0], abs=1e-6)


def test_batch_and_none_scales():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    # group means: 0.5, 0 → centred [0.5, -0.5, 0, 0]; batch std of [1,0,0,0] = sqrt(0.25) = 0.5
    assert group_advantages(rewards, 2, scale="none").tolist() == [0.5, -0.5, 0.0, 0.0]
    batch = group_advantages(rewards, 2, scale="batch")
    assert batch.tolist() == pytest.approx([0.5 / (0.5 + 1e-4), -0.5 / (0.5 + 1e-4), 0.0, 0.0], abs=1e-6)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_zero_variance_group_is_exactly_zero(scale):
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 1.0, 0.0, 0.5])
    adv = group_advantages(rewards, 3, scale=scale)
    assert torch.equal(adv[:6], torch.zeros(6))
    assert torch.isfinite(adv).all()


def test_group_of_one_gives_zero_not_nan():
    assert torch.equal(group_advantages(torch.tensor([1.0, 2.0]), 1), torch.zeros(2))


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.lists(st.integers(-400, 400), min_size=8, max_size=8), st.integers(-200, 200))
def test_group_advantages_properties(values, shift):
    # rewards on a grid of 1/4 (as rule-based rewards are), so float32 represents them and their shifts exactly
    rewards, shift = torch.tensor(values, dtype=torch.float32) / 4, shift / 4
    adv = group_advantages(rewards, 4)
    # zero mean within each group; invariant to shifting the rewards
    assert adv.view(2, 4).sum(dim=1).abs().max() < 1e-3
    assert torch.allclose(adv, group_advantages(rewards + shift, 4), atol=1e-3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(group_size=3), "group_size=3 does not divide .* N=4"),
        (dict(group_size=2, scale="std"), "scale='std' is not valid; choose one of 'group', 'batch', 'none'"),
        (dict(group_size=0), "group_size must be a positive int"),
    ],
)
def test_group_advantages_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(torch.zeros(4), **kwargs)


def test_group_advantages_rejects_nan():
    with pytest.raises(ValueError, match="NaN or inf"):
        group_advantages(torch.tensor([1.0, float("nan")]), 2)


# ---- kl_penalty ----------------------------------------------------------------------------------


def test_kl_kinds_hand_computed():
    logp, ref = torch.tensor([LN(0.5)]), torch.tensor([LN(0.25)])
    # k1 = logp - ref = ln 2; k2 = ½ (ln 2)²; k3: π_ref/π = 0.5 → 0.5 − ln 0.5 − 1 = ln 2 − 0.5
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(LN(2))
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * LN(2) ** 2)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(LN(2) - 0.5)
    assert kl_penalty(logp, logp, "k3").item() == 0.0


def test_k3_keeps_its_precision_for_nearly_equal_policies():
    # k3 ≈ r²/2 for a small log-ratio r: 5e-9 at r = 1e-4, below float32's spacing near 1 (exp(r) − r − 1 gives 0)
    r = torch.tensor([1e-4, -3e-4, 1e-3])
    k3 = kl_penalty(torch.zeros(3), r, "k3")
    assert k3.dtype == torch.float32
    assert torch.allclose(k3.double(), r.double().exp() - r.double() - 1, rtol=1e-3, atol=0)


def test_kl_errors():
    with pytest.raises(ValueError, match="kind='k4' is not valid"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k4")
    with pytest.raises(ValueError, match=r"\(2,\).*\(3,\)"):
        kl_penalty(torch.zeros(2), torch.zeros(3))


# ---- grpo_loss: hand-computed values -------------------------------------------------------------
# Two completions, two token slots. old_logp = 0 and logp = ln ρ give ratios ρ = [[1.5, 0.5], [1.5, 0.5]].
# Completion 0 has A = +1 and both tokens; completion 1 has A = −1 and only its first token.
#   completion 0: min(1.5·1, 1.2·1) = 1.2 ; min(0.5, 0.8) = 0.5          → sum 1.7, mean 0.85
#   completion 1: min(−1.5, −1.2) = −1.5 ; (second token masked)         → sum −1.5, mean −1.5

RATIOS = torch.tensor([[1.5, 0.5], [1.5, 0.5]])
MASK = torch.tensor([[1, 1], [1, 0]])
ADV = torch.tensor([1.0, -1.0])


def loss_of(**kwargs):
    logp = RATIOS.log()
    kwargs.setdefault("beta", 0.0)
    return grpo_loss(logp, torch.zeros(2, 2), kwargs.pop("ref_logp", None), ADV, MASK, **kwargs)


def test_sequence_aggregation_hand_computed():
    loss, stats = loss_of()
    assert loss.item() == pytest.approx(-(0.85 - 1.5) / 2)  # 0.325
    # clip binds above on 1 of 3 tokens (ρ=1.5 > 1.2 with A>0); below never (ρ=0.5 sits on A>0)
    assert stats["clipfrac_high"] == pytest.approx(1 / 3)
    assert stats["clipfrac_low"] == 0.0
    assert stats["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.5) / 3)


def test_token_aggregation_hand_computed():
    loss, _ = loss_of(aggregation="token")
    assert loss.item() == pytest.approx(-(1.7 - 1.5) / 3)


def test_constant_aggregation_hand_computed():
    loss, _ = loss_of(aggregation="constant", max_completion_length=4)
    assert loss.item() == pytest.approx(-(1.7 - 1.5) / (2 * 4))


def test_epsilon_high_hand_computed():
    # ε_high = 0.6 → ρ = 1.5 is no longer clipped for A > 0: completion 0 mean (1.5 + 0.5)/2 = 1.0
    loss, stats = loss_of(epsilon_high=0.6)
    assert loss.item() == pytest.approx(-(1.0 - 1.5) / 2)
    assert stats["clipfrac_high"] == 0.0


def test_clipfrac_low_hand_computed():
    # ε = 0.2, A = −1 on both completions: ρ = 0.5 < 0.8 with A < 0 binds on 1 of 3 tokens
    _, stats = grpo_loss(RATIOS.log(), torch.zeros(2, 2), None, -torch.ones(2), MASK, beta=0.0)
    assert stats["clipfrac_low"] == pytest.approx(1 / 3)


def test_sequence_ratio_hand_computed():
    # completion 0: ρ = exp((ln 1.5 + ln 0.5)/2) = sqrt(0.75) = 0.8660, inside [0.8, 1.2] → 0.8660
    # completion 1: ρ = 1.5 (its only token), A = −1 → min(−1.5, −1.2) = −1.5
    loss, _ = loss_of(ratio_level="sequence")
    assert loss.item() == pytest.approx(-(math.sqrt(0.75) - 1.5) / 2)


def test_kl_term_hand_computed():
    # ref_logp = logp + ln 2 → π_ref/π = 2 → k3 = 2 − ln 2 − 1 = 0.30685 on every token
    k3 = 1 - LN(2)
    loss, stats = loss_of(beta=0.1, ref_logp=RATIOS.log() + LN(2))
    assert loss.item() == pytest.approx(-(0.85 - 1.5) / 2 + 0.1 * k3)
    assert stats["kl"] == pytest.approx(k3)


def test_kl_weighted_by_the_ratio_hand_computed():
    # TRL's use_bias_correction_kl: each token's k3 times its ρ (1.5, 0.5 | 1.5): sequence means k3 and 1.5·k3
    k3 = 1 - LN(2)
    loss, stats = loss_of(beta=0.1, ref_logp=RATIOS.log() + LN(2), kl_weighted=True)
    assert loss.item() == pytest.approx(-(0.85 - 1.5) / 2 + 0.1 * 1.25 * k3)
    assert stats["kl"] == pytest.approx(k3)  # the estimate itself, as logged without the weight
    assert loss_of(kl_weighted=True)[0].item() == pytest.approx(loss_of()[0].item())  # beta = 0: nothing to weigh


def test_kl_kind_option():
    loss, stats = loss_of(beta=0.1, ref_logp=RATIOS.log() + LN(2), kl_kind="k2")
    assert stats["kl"] == pytest.approx(0.5 * LN(2) ** 2)
    assert loss.item() == pytest.approx(-(0.85 - 1.5) / 2 + 0.1 * 0.5 * LN(2) ** 2)


def test_per_token_advantages():
    # (N, T) advantages equal to the (N,) ones broadcast give the same loss
    loss_1d, _ = loss_of()
    loss_2d, _ = grpo_loss(RATIOS.log(), torch.zeros(2, 2), None, ADV[:, None].expand(2, 2), MASK, beta=0.0)
    assert loss_2d.item() == pytest.approx(loss_1d.item())


def test_empty_completion_counts_but_adds_nothing():
    mask = torch.tensor([[1, 1], [0, 0]])
    loss, _ = grpo_loss(RATIOS.log(), torch.zeros(2, 2), None, ADV, mask, beta=0.0)
    assert loss.item() == pytest.approx(-0.85 / 2)  # completion 1 adds 0 and still counts in the 1/N
    loss, _ = grpo_loss(torch.zeros(2, 3), None, None, ADV, torch.zeros(2, 3), beta=0.0, aggregation="token")
    assert loss.item() == 0.0


def test_whole_batch_counts_make_micro_batches_add_up():
    torch.manual_seed(0)
    logp, old, adv = torch.randn(6, 5), torch.randn(6, 5), torch.randn(6)
    mask = (torch.rand(6, 5) > 0.3).long()
    for aggregation in ("sequence", "token", "constant"):
        kw = dict(beta=0.0, aggregation=aggregation, max_completion_length=5)
        whole, _ = grpo_loss(logp, old, None, adv, mask, **kw)
        counts = dict(num_sequences=6, num_tokens=float(mask.sum()))  # aggregate_loss picks its denominator
        parts = sum(grpo_loss(logp[s], old[s], None, adv[s], mask[s], **counts, **kw)[0]
                    for s in (slice(0, 2), slice(2, 6)))
        assert parts.item() == pytest.approx(whole.item(), abs=1e-6)


# ---- grpo_loss: properties -----------------------------------------------------------------------


@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_padding_changes_nothing(aggregation, ratio_level):
    torch.manual_seed(1)
    logp = torch.randn(4, 3, requires_grad=True)
    old, ref, adv = torch.randn(4, 3), torch.randn(4, 3), torch.randn(4)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]])
    kw = dict(aggregation=aggregation, ratio_level=ratio_level, max_completion_length=8)
    loss, stats = grpo_loss(logp, old, ref, adv, mask, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    # Extra padded columns holding garbage — values whose exp overflows float32 — must change neither
    # the loss, nor the diagnostics, nor the gradient (and must not turn them into NaN).
    pad_logp = torch.cat([logp.detach(), torch.full((4, 2), 1e4)], dim=1).requires_grad_()
    pad = lambda x: torch.cat([x, torch.full((4, 2), -1e4)], dim=1)  # noqa: E731
    pad_mask = torch.cat([mask, torch.zeros(4, 2, dtype=torch.long)], dim=1)
    loss_p, stats_p = grpo_loss(pad_logp, pad(old), pad(ref), adv, pad_mask, **kw)
    (grad_p,) = torch.autograd.grad(loss_p, pad_logp)
    assert loss_p.item() == pytest.approx(loss.item(), abs=1e-6)
    assert torch.allclose(grad_p[:, :3], grad, atol=1e-6) and torch.equal(grad_p[:, 3:], torch.zeros(4, 2))
    assert stats_p == pytest.approx(stats)


def test_zero_variance_group_gives_zero_gradient():
    logp = torch.randn(4, 3, requires_grad=True)
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0, 1.0]), 2)
    loss, _ = grpo_loss(logp, None, None, adv, torch.ones(4, 3), beta=0.0)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.equal(grad, torch.zeros(4, 3))


@pytest.mark.parametrize(
    "aggregation, ratio_level",
    [("sequence", "token"), ("token", "token"), ("constant", "token"), ("sequence", "sequence")],
)
def test_gradient_equals_policy_gradient_formula(aggregation, ratio_level):
    """β = 0, μ = 1: ∇loss = −Σ_i Σ_t w_{i,t} A_i ∇log π(o_{i,t}), with w = 1/(N|o_i|) (sequence),
    1/Σ|o_i| (token) or 1/(N·L) (constant). A per-sequence ratio exp(mean_t(logp − logp_old)) has
    ∂ρ_i/∂logp_{i,t} = 1/|o_i| at ρ = 1, so under sequence aggregation it gives the same gradient.
    Checked on the parameters of a tiny policy, not just on logp."""
    torch.manual_seed(2)
    n, t, v, d = 4, 5, 7, 3
    weight = torch.randn(v, d, requires_grad=True)
    features = torch.randn(n, t, d)
    tokens = torch.randint(0, v, (n, t))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])
    logp = token_logprobs(features @ weight.T, tokens)
    loss, _ = grpo_loss(logp, None, None, adv, mask, beta=0.0, aggregation=aggregation, ratio_level=ratio_level,
                        max_completion_length=8)
    (grad,) = torch.autograd.grad(loss, weight)

    lengths = mask.sum(dim=1, keepdim=True).float()
    w = {"sequence": mask / (n * lengths), "token": mask / mask.sum(), "constant": mask / (n * 8)}[aggregation]
    logp = token_logprobs(features @ weight.T, tokens)
    (formula,) = torch.autograd.grad(-(w * adv[:, None] * logp).sum(), weight)
    assert torch.allclose(grad, formula, atol=1e-6)


# ---- grpo_loss: bad input ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(aggregation="mean"), "aggregation='mean' is not valid; choose one of 'sequence', 'token', 'constant'"),
        (dict(ratio_level="word"), "ratio_level='word' is not valid; choose one of 'token', 'sequence'"),
        (dict(kl_kind="k9"), "kl_kind='k9' is not valid"),
        (dict(aggregation="constant"), "requires max_completion_length"),
        (dict(beta=0.04), "ref_logp is None but beta=0.04"),
        (dict(epsilon=-0.1), "epsilon and epsilon_high must be >= 0"),
    ],
)
def test_grpo_loss_option_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        grpo_loss(torch.zeros(2, 2), None, None, torch.zeros(2), torch.ones(2, 2), **{"beta": 0.0, **kwargs})


def test_grpo_loss_shape_errors_name_both_shapes():
    with pytest.raises(ValueError, match=r"logp has shape \(2, 3\) but mask has shape \(2, 2\)"):
        grpo_loss(torch.zeros(2, 3), None, None, torch.zeros(2), torch.ones(2, 2), beta=0.0)
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\) but logp has shape \(2, 2\)"):
        grpo_loss(torch.zeros(2, 2), None, None, torch.zeros(3), torch.ones(2, 2), beta=0.0)
    with pytest.raises(ValueError, match=r"logp has shape \(2, 2\) but old_logp has shape \(2, 1\)"):
        grpo_loss(torch.zeros(2, 2), torch.zeros(2, 1), None, torch.zeros(2), torch.ones(2, 2), beta=0.0)


def test_aggregate_loss_rejects_bad_mode():
    with pytest.raises(ValueError, match="aggregation='sum'"):
        aggregate_loss(torch.zeros(1, 1), torch.ones(1, 1), "sum")


# ---- token_logprobs ------------------------------------------------------------------------------


def test_token_logprobs_match_log_softmax_and_temperature():
    torch.manual_seed(3)
    logits, tokens = torch.randn(3, 4, 11), torch.randint(0, 11, (3, 4))
    expected = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    assert torch.allclose(token_logprobs(logits, tokens, 0.7), expected, atol=1e-6)
    half = token_logprobs(logits.bfloat16(), tokens, 0.7)
    assert half.dtype == torch.float32
    assert torch.allclose(half, token_logprobs(logits.bfloat16().float(), tokens, 0.7), atol=1e-6)
