"""Every objective option of the trainer reaches the loss as the formula says, and process
supervision, dynamic sampling and truncation masking work end to end."""

import copy
import json

import pytest
import torch

from grpokit import group_advantages, grpo_loss, process_advantages
from grpokit.algorithms import grpo as grpokit_trainer
from grpokit.models.logprobs import sequence_logprobs
from grpokit.training.sampling import group_relative_advantages
from grpokit.training.update import UpdateBatch
from helpers import brute_force_ends, each_one, fixed_rollout, loss_and_gradient, make_trainer, ones


@pytest.mark.parametrize(
    "option",
    [dict(aggregation="token"), dict(aggregation="constant"), dict(ratio_level="sequence"), dict(epsilon=0.05),
     dict(epsilon_high=0.6), dict(beta=0.5), dict(kl_kind="k1"), dict(kl_kind="k2")],
    ids=lambda option: "-".join(f"{k}={v}" for k, v in option.items()),
)
def test_each_option_changes_the_loss_as_the_formula_says(tokenizer, tiny_model, tmp_path, option):
    """π_old and π_ref are moved away from π_θ so that the clip, the ratio and the KL are all active;
    the trainer's loss must equal ``grpo_loss`` with the option, and differ from the default's."""
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, **option)
    rollout = fixed_rollout(trainer, tokenizer)
    mask = rollout.completion_mask
    with torch.no_grad():
        logp, _ = sequence_logprobs(tiny_model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, mask)
    gen = torch.Generator().manual_seed(1)
    old_logp = logp + 0.3 * torch.randn(logp.shape, generator=gen)
    ref_logp = logp + torch.randn(logp.shape, generator=gen)  # large enough for k1, k2 and k3 to differ clearly
    advantages = torch.randn(32, generator=gen)

    loss = loss_and_gradient(trainer, UpdateBatch(rollout, mask, advantages, old_logp, ref_logp))[0]["loss"]

    c = trainer.config
    expected, _ = grpo_loss(logp, old_logp, ref_logp, advantages, mask, epsilon=c.epsilon, epsilon_high=c.epsilon_high,
                            beta=c.beta, aggregation=c.aggregation, ratio_level=c.ratio_level,
                            max_completion_length=c.max_completion_length, kl_kind=c.kl_kind)
    default, _ = grpo_loss(logp, old_logp, ref_logp, advantages, mask)
    assert loss == pytest.approx(expected.item(), abs=1e-5)
    assert abs(expected.item() - default.item()) > 1e-4


def spy_on_update(monkeypatch) -> dict:
    """The batch each training step hands to the update, recorded under ``"batch"``."""
    seen = {}
    real = grpokit_trainer.update
    monkeypatch.setattr(grpokit_trainer, "update", lambda learners, batch, **kw: seen.update(batch=batch)
                        or real(learners, batch, **kw))
    return seen


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_scale_rewards_reaches_the_advantages(tokenizer, tiny_model, tmp_path, scale, monkeypatch):
    """The training step's advantages are group_advantages of the batch's rewards with the configured scale,
    on every token of each completion."""
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, scale_rewards=scale)
    seen, sample = spy_on_update(monkeypatch), trainer.sampler.sample
    monkeypatch.setattr(trainer.sampler, "sample",
                        lambda *args: seen.update(sampled=sample(*args)) or seen["sampled"])
    trainer.training_step()
    batch, mask = seen["sampled"][0], seen["batch"].loss_mask
    expected = group_advantages(batch.rewards, 8, scale=scale).unsqueeze(1) * mask
    assert torch.allclose(seen["batch"].advantages, expected, atol=1e-6)
    if scale != "group":
        assert not torch.allclose(expected, group_advantages(batch.rewards, 8).unsqueeze(1) * mask, atol=1e-3)


def test_several_iterations_compute_old_logprobs_once_per_batch(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, num_iterations=3, beta=0.0, learning_rate=5e-2)
    calls, old_logps = [], []
    frozen, loss = trainer.frozen_logprobs, trainer.policy.loss
    trainer.frozen_logprobs = lambda model, rollout: calls.append(1) or frozen(model, rollout)
    trainer.policy.loss = lambda model, batch, *args: old_logps.append(batch.old_logp) or loss(model, batch, *args)
    metrics = trainer.training_step()
    assert len(calls) == 1 and len(old_logps) == 3 * 3  # μ passes of 3 micro-batches (12, 12, 8 completions)
    assert all(torch.equal(u, old_logps[k % 3]) for k, u in enumerate(old_logps))  # one π_old for all μ updates
    assert metrics["ratio_mean"] != pytest.approx(1.0, abs=1e-6)  # the last update has moved away from it


# ---- mask_truncated_completions ------------------------------------------------------------------


def test_masked_truncations_leave_the_loss_like_a_batch_without_them(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, max_completion_length=3, mask_truncated_completions=True)
    rollout = fixed_rollout(trainer, tokenizer, max_new_tokens=3)
    # make some completions stop early (EOS) so the batch mixes both kinds
    kept = torch.arange(32) % 3 == 0
    rollout.completion_ids[kept, 1] = tokenizer.eos_token_id
    rollout.completion_mask[kept, 2] = 0
    rollout.truncated = ~kept
    advantages = torch.randn(32, generator=torch.Generator().manual_seed(2))

    grads = []
    for sub, mask, sub_advantages in ((rollout, rollout.completion_mask * kept.unsqueeze(1), advantages),
                                      (rollout.select(kept), rollout.select(kept).completion_mask, advantages[kept])):
        grads.append(loss_and_gradient(trainer, UpdateBatch(sub, mask, sub_advantages,
                                                            ref_logp=trainer.reference_logprobs(sub))))
    assert grads[0][0]["loss"] == pytest.approx(grads[1][0]["loss"], abs=1e-6)
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-6)


def test_training_step_masks_truncated_completions(tokenizer, tiny_model, tmp_path, monkeypatch):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, max_completion_length=2, mask_truncated_completions=True)
    seen = spy_on_update(monkeypatch)
    metrics = trainer.training_step()
    rollout, loss_mask = seen["batch"].rollout, seen["batch"].loss_mask
    truncated = rollout.truncated
    assert metrics["truncated_frac"] > 0
    assert loss_mask[truncated].sum() == 0
    assert torch.equal(loss_mask[~truncated], rollout.completion_mask[~truncated])


# ---- dynamic sampling ----------------------------------------------------------------------------


def half_constant(prompts, completions, constant, **kw):
    """Constant (no signal) on rows marked so, else a spread-out score of the text."""
    return [1.0 if const else float(sum(map(ord, c)) % 7) for c, const in zip(completions, constant)]


DYNAMIC_ROWS = [{"prompt": f"Count {i}:", "constant": i % 2 == 0} for i in range(32)]


def test_dynamic_sampling_drops_groups_without_signal_and_keeps_the_batch_size(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, rows=DYNAMIC_ROWS, reward_funcs=(half_constant,),
                           dynamic_sampling=True, max_sampling_rounds=5)
    for _ in range(3):
        batch, sampled, stats = trainer.sampler.sample()
        assert len(batch.rows) == 4 and batch.rollout.completion_ids.shape[0] == 32 and len(batch.completions) == 32
        assert not any(row["constant"] for row in batch.rows)  # every group kept carries signal
        assert not trainer.sampler.no_signal_groups(batch).any()
        assert stats["refilled_groups"] == 0 and stats["sampling_rounds"] >= 2
        assert stats["dropped_groups"] == sum(row["constant"] for row in sampled.rows)
        assert len(sampled.rows) == 4 * stats["sampling_rounds"]
        # the groups' rows, completions and rewards stay aligned through the selection
        assert batch.rewards.tolist() == half_constant(None, batch.completions, [False] * 32)
    metrics = trainer.training_step()
    assert metrics["dropped_groups"] >= 2 and metrics["sampling_rounds"] >= 2


def test_dynamic_sampling_fills_the_batch_when_the_rounds_run_out(tokenizer, tiny_model, tmp_path):
    rows = [{"prompt": f"Count {i}:", "constant": True} for i in range(32)]
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, rows=rows, reward_funcs=(half_constant,),
                           dynamic_sampling=True, max_sampling_rounds=3)
    metrics = trainer.training_step()
    assert (metrics["sampling_rounds"], metrics["dropped_groups"], metrics["refilled_groups"]) == (3, 8, 4)
    assert metrics["frac_zero_std_groups"] == 1.0


def test_without_dynamic_sampling_one_round(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, rows=DYNAMIC_ROWS, reward_funcs=(half_constant,))
    metrics = trainer.training_step()
    assert (metrics["sampling_rounds"], metrics["dropped_groups"], metrics["refilled_groups"]) == (1, 0, 0)
    assert metrics["frac_zero_std_groups"] == 0.5


# ---- process supervision in the trainer ----------------------------------------------------------


def test_process_advantages_come_from_the_steps_mapped_to_tokens(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, reward_funcs=(each_one, ones),
                           reward_weights=[1.0, 0.5], supervision="process")
    batch = trainer.sampler.generate_and_score([0, 1, 2, 3])
    # each character's step ends on the token that holds it; the outcome reward `ones` ends with the EOS
    for i, (text, steps) in enumerate(zip(batch.completions, batch.steps)):
        ids = batch.rollout.completion_ids[i, : int(batch.rollout.lengths[i])].tolist()
        ends = brute_force_ends(tokenizer, ids, text, [k + 1 for k in range(len(text))] + [len(text)])
        rewards = [float(ch == "1") for ch in text] + [0.5 * ones(None, [text])[0]]
        expected: dict[int, float] = {}
        for end, reward in zip(ends, rewards):
            expected[end] = expected.get(end, 0.0) + reward
        assert steps == sorted(expected.items())
    advantages = group_relative_advantages(batch, 8, "group")
    assert advantages.shape == batch.rollout.completion_ids.shape
    assert torch.equal(advantages, process_advantages(
        [[r for _, r in s] for s in batch.steps], [[e for e, _ in s] for s in batch.steps],
        batch.rollout.completion_mask, 8))


def test_process_supervision_learns_and_logs_its_steps(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, reward_funcs=(each_one,), supervision="process",
                           log_completions=2)
    history = trainer.train()
    first, last = [sum(m["rewards/each_one"] for m in chunk) / 3 for chunk in (history[:3], history[-3:])]
    assert last > first + 0.1, (first, last)
    record = json.loads((tmp_path / "run" / "completions.jsonl").read_text().splitlines()[0])
    assert record["steps"] and all(len(step) == 2 for step in record["steps"])


# ---- wiring: which setting and which model reach the math ------------------------------------------


def test_temperature_reaches_every_log_prob(tokenizer, tiny_model, tmp_path):
    """The loss's log-probs, and the frozen π_ref ones, are those of softmax(logits / T) at the sampling T."""
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, temperature=0.5)
    rollout = fixed_rollout(trainer, tokenizer)
    mask = rollout.completion_mask
    with torch.no_grad():
        logp = {t: sequence_logprobs(tiny_model, *rollout.sequences(), temperature=t)[0] for t in (0.5, 1.0)}
    assert torch.allclose(trainer.reference_logprobs(rollout), logp[0.5], atol=1e-5)
    gen = torch.Generator().manual_seed(4)
    old_logp, ref_logp = logp[0.5] + 0.3 * torch.randn(mask.shape, generator=gen), logp[0.5] + 0.5
    advantages = torch.randn(32, generator=gen)
    loss = loss_and_gradient(trainer, UpdateBatch(rollout, mask, advantages, old_logp, ref_logp))[0]["loss"]
    expected, at_one = (grpo_loss(logp[t], old_logp, ref_logp, advantages, mask)[0].item() for t in (0.5, 1.0))
    assert loss == pytest.approx(expected, abs=1e-5)
    assert abs(expected - at_one) > 1e-3


def test_the_kl_is_to_the_reference_not_to_the_policy(tokenizer, tiny_model, tmp_path, monkeypatch):
    """Once the policy has moved, π_ref's log-probs come from the frozen starting weights: the step's
    ref_logp equals a separate copy's, differs from the policy's, and the logged KL is not 0."""
    separate = copy.deepcopy(tiny_model)  # the starting weights, apart from the trainer
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, beta=0.1)
    with torch.no_grad():  # move the policy away from where the reference was copied
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    seen = spy_on_update(monkeypatch)
    metrics = trainer.training_step()
    rollout, ref_logp = seen["batch"].rollout, seen["batch"].ref_logp
    with torch.no_grad():
        frozen = sequence_logprobs(separate.eval(), *rollout.sequences())[0]
        policy = sequence_logprobs(trainer.model.eval(), *rollout.sequences())[0]
    assert torch.allclose(ref_logp, frozen, atol=1e-5)
    assert not torch.allclose(ref_logp, policy, atol=1e-3)
    assert metrics["kl"] > 1e-4
