"""PPO: GAE against a plain loop, the value loss against hand-computed values, the value model, and
tiny runs through the Python API and the CLI."""

import json
import random

import pytest
import torch
from transformers import AutoModel

from grpokit import GRPOConfig, GRPOTrainer, gae
from grpokit.algorithms.ppo import ValueModel, token_rewards
from grpokit.cli.main import main
from grpokit.config import ConfigError
from grpokit.core.ppo_objective import explained_variance, value_loss, whiten
from grpokit.training.update import UpdateBatch
from helpers import (
    ROWS,
    documented_metrics,
    each_one,
    fixed_rollout,
    logged_keys,
    loss_and_gradient,
    make_trainer,
    ones,
    write_config,
)

# ---- GAE -----------------------------------------------------------------------------------------


def test_gae_hand_computed():
    # γ = 0.9, λ = 0.8, γλ = 0.72; V after the last token is 0
    # δ2 = 1 + 0 − 0.7 = 0.3                A2 = 0.3
    # δ1 = 0 + 0.9·0.7 − 0.6 = 0.03         A1 = 0.03 + 0.72·0.3 = 0.246
    # δ0 = 0 + 0.9·0.6 − 0.5 = 0.04         A0 = 0.04 + 0.72·0.246 = 0.21712
    rewards, values = torch.tensor([[0.0, 0.0, 1.0, 9.0]]), torch.tensor([[0.5, 0.6, 0.7, 9.0]])  # 9: padding
    adv, ret = gae(rewards, values, torch.tensor([[1, 1, 1, 0]]), gamma=0.9, lam=0.8)
    assert adv.tolist()[0] == pytest.approx([0.21712, 0.246, 0.3, 0.0], abs=1e-6)
    assert ret.tolist()[0] == pytest.approx([0.71712, 0.846, 1.0, 0.0], abs=1e-6)


def reference_gae(rewards, values, lengths, gamma, lam):
    """GAE for one completion at a time, straight from the definition."""
    n, width = rewards.shape
    adv, ret = torch.zeros(n, width), torch.zeros(n, width)
    for i in range(n):
        length = lengths[i]
        for t in range(length):
            total = 0.0
            for k in range(t, length):
                next_value = values[i, k + 1].item() if k + 1 < length else 0.0
                delta = rewards[i, k].item() + gamma * next_value - values[i, k].item()
                total += (gamma * lam) ** (k - t) * delta
            adv[i, t] = total
            ret[i, t] = total + values[i, t].item()
    return adv, ret


def test_gae_matches_the_loop_reference_on_random_inputs():
    rng = random.Random(0)
    for _ in range(30):
        n, width = rng.randint(1, 5), rng.randint(1, 9)
        lengths = [rng.randint(0, width) for _ in range(n)]
        mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).long()
        gen = torch.Generator().manual_seed(rng.randint(0, 10**6))
        rewards = torch.randn(n, width, generator=gen)
        values = torch.randn(n, width, generator=gen)
        # garbage (even inf) in the padding must not leak in
        rewards, values = rewards.masked_fill(mask == 0, float("inf")), values.masked_fill(mask == 0, 1e6)
        gamma, lam = rng.choice([1.0, 0.99, 0.5]), rng.choice([1.0, 0.95, 0.0])
        adv, ret = gae(rewards, values, mask, gamma, lam)
        ref_adv, ref_ret = reference_gae(rewards, values, lengths, gamma, lam)
        assert torch.allclose(adv, ref_adv, atol=1e-5) and torch.allclose(ret, ref_ret, atol=1e-5)


def test_gae_shape_errors():
    with pytest.raises(ValueError, match=r"one \(N, T\) shape"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))


# ---- value loss, whitening, explained variance ------------------------------------------------------


def test_value_loss_clipping_hand_computed():
    values = torch.tensor([[2.0, 0.5, 1.0, 1.1]], requires_grad=True)
    old, returns = torch.tensor([[1.0, 1.0, 1.0, 1.0]]), torch.tensor([[3.0, 0.0, 1.0, 3.0]])
    # clip 0.2 → clipped V = [1.2, 0.8, 1.0, 1.1]
    # token 0: (2−3)² = 1    vs (1.2−3)² = 3.24 → 3.24 (clipped larger)
    # token 1: (0.5−0)² = .25 vs (0.8−0)² = 0.64 → 0.64 (clipped larger)
    # token 2: 0 vs 0 → 0;  token 3: V inside the range: (1.1−3)² = 3.61 both → 3.61
    loss, stats = value_loss(values, old, returns, torch.ones(1, 4), clip_range=0.2)
    assert loss.item() == pytest.approx(0.5 * (3.24 + 0.64 + 0 + 3.61) / 4, abs=1e-6)
    assert stats["value_clipfrac"] == pytest.approx(2 / 4)
    loss.backward()
    # where the clipped term wins and V is outside the range, the loss does not depend on V
    assert values.grad[0, :2].tolist() == [0.0, 0.0]
    assert values.grad[0, 3].item() == pytest.approx(0.5 * 2 * (1.1 - 3.0) / 4, abs=1e-6)


def test_value_loss_masks_and_normalizer():
    values, old = torch.tensor([[2.0, 5.0]]), torch.tensor([[1.0, 0.0]])
    returns, mask = torch.tensor([[3.0, -7.0]]), torch.tensor([[1, 0]])
    loss, stats = value_loss(values, old, returns, mask, clip_range=0.2)
    assert loss.item() == pytest.approx(0.5 * 3.24) and stats["value_clipfrac"] == 1.0
    half, _ = value_loss(values, old, returns, mask, clip_range=0.2, normalizer=2.0)
    assert half.item() == pytest.approx(0.5 * 3.24 / 2)


def test_whiten_and_explained_variance():
    x, mask = torch.tensor([[1.0, 2.0, 3.0, 100.0]]), torch.tensor([[1, 1, 1, 0]])
    w = whiten(x, mask)
    assert w[0, 3] == 0 and w[0, :3].mean().abs() < 1e-6 and (w[0, :3] ** 2).mean() == pytest.approx(1.0, abs=1e-4)
    returns = torch.tensor([[1.0, 2.0, 4.0, 0.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 5.0), returns, mask) == pytest.approx(0.0, abs=1e-6)


# ---- the value model -----------------------------------------------------------------------------


def test_value_model_starts_from_the_policy_and_owns_its_weights(tiny_model):
    value_model = ValueModel(tiny_model)
    policy = dict(tiny_model.base_model.named_parameters())
    for name, p in value_model.backbone.named_parameters():
        assert torch.equal(p, policy[name]) and p.data_ptr() != policy[name].data_ptr()


def test_values_do_not_depend_on_left_padding(tiny_model, tokenizer):
    """The value of token t comes from the hidden state that predicted it, wherever the prompt starts."""
    value_model = ValueModel(tiny_model).eval()
    prompts = tokenizer(["Count 1:", "Count 100000:"], padding=True, padding_side="left", return_tensors="pt")
    completion = torch.tensor([tokenizer("12", add_special_tokens=False)["input_ids"]] * 2)
    with torch.no_grad():
        batch = value_model(prompts["input_ids"], prompts["attention_mask"], completion,
                                              torch.ones_like(completion))
        alone = tokenizer(["Count 1:"], return_tensors="pt")
        single = value_model(alone["input_ids"], alone["attention_mask"], completion[:1],
                                               torch.ones_like(completion[:1]))
        # by hand: the backbone's last hidden states at the positions before each completion token
        ids = torch.cat([alone["input_ids"], completion[:1]], dim=1)
        hidden = value_model.backbone(input_ids=ids).last_hidden_state
        by_hand = value_model.head(hidden[:, -3:-1]).squeeze(-1)
    assert torch.allclose(batch[0], single[0], atol=1e-5)
    assert torch.allclose(single, by_hand, atol=1e-5)


# ---- the trainer ---------------------------------------------------------------------------------


def make_ppo(tokenizer, model, tmp_path, **overrides):
    return make_trainer(tokenizer, model, tmp_path, algorithm="ppo", **overrides)


def test_token_rewards_outcome_and_kl(tokenizer, tiny_model, tmp_path):
    trainer = make_ppo(tokenizer, tiny_model, tmp_path, beta=0.5)
    batch = trainer.sampler.generate_and_score([0, 1, 2, 3])
    mask = batch.rollout.completion_mask
    logp = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
    ref = logp + 0.25
    rewards = token_rewards(batch, logp, ref, beta=0.5)
    last = batch.rollout.lengths - 1
    expected = torch.where(mask.bool(), torch.full(mask.shape, 0.5 * 0.25), 0.0)  # −β(logp − ref) = +0.125
    expected[torch.arange(32), last] += batch.rewards
    assert torch.allclose(rewards, expected, atol=1e-6)


def test_token_rewards_process_steps(tokenizer, tiny_model, tmp_path):

    trainer = make_ppo(tokenizer, tiny_model, tmp_path, beta=0.0, supervision="process", reward_funcs=(each_one,))
    batch = trainer.sampler.generate_and_score([0, 1, 2, 3])
    rewards = token_rewards(batch, None, None, beta=0.0)
    assert any(len(steps) > 1 for steps in batch.steps)  # a step per character
    for i, steps in enumerate(batch.steps):
        expected = torch.zeros(rewards.shape[1])
        for end, reward in steps:
            expected[end] += reward
        assert torch.equal(rewards[i], expected)


def test_tiny_ppo_run_changes_every_parameter_and_the_value_loss_falls(tokenizer, tiny_model, tmp_path):
    trainer = make_ppo(tokenizer, tiny_model, tmp_path, max_steps=16, num_minibatches=2, num_iterations=2,
                       value_learning_rate=3e-3)
    before = {f"policy.{n}": p.detach().clone() for n, p in trainer.model.named_parameters()}
    before.update({f"value.{n}": p.detach().clone() for n, p in trainer.critic.value_model.named_parameters()})
    history = trainer.train()
    after = {f"policy.{n}": p for n, p in trainer.model.named_parameters()}
    after.update({f"value.{n}": p for n, p in trainer.critic.value_model.named_parameters()})
    assert [name for name, p in after.items() if torch.equal(p, before[name])] == []
    first, last = [sum(m["value_loss"] for m in chunk) / 4 for chunk in (history[:4], history[-4:])]
    assert last < 0.5 * first, (first, last)
    assert trainer.policy.scheduler.last_epoch == trainer.critic.learner.scheduler.last_epoch == 16 * 2 * 2
    # the critic starts from the policy's features and a random head, and learns to predict the returns
    explained = [m["explained_variance"] for m in history]
    assert all(e <= 1 for e in explained) and sum(explained[-4:]) / 4 > sum(explained[:4]) / 4 + 1
    assert (tmp_path / "run" / "value_model" / "value_head.safetensors").is_file()
    # the saved value backbone is a plain transformers model
    assert AutoModel.from_pretrained(tmp_path / "run" / "value_model") is not None


def test_ppo_raises_the_reward(tokenizer, tiny_model, tmp_path):
    trainer = make_ppo(tokenizer, tiny_model, tmp_path, max_steps=20, beta=0.0)
    history = trainer.train()
    first, last = [sum(m["reward"] for m in chunk) / 3 for chunk in (history[:3], history[-3:])]
    assert last > first + 0.1, (first, last)


def test_value_gradient_does_not_depend_on_micro_batch_size(tokenizer, tiny_model, tmp_path):
    """The critic's update: its loss and gradient with micro-batches of 5 equal one pass over all 32, and
    its loss is value_loss of the value model's predictions (vf_coef weighs the gradient only)."""
    trainer = make_ppo(tokenizer, tiny_model, tmp_path, vf_coef=0.5)
    rollout = fixed_rollout(trainer, tokenizer)
    mask = rollout.completion_mask
    gen = torch.Generator().manual_seed(3)
    returns, old_values = torch.randn(mask.shape, generator=gen), torch.randn(mask.shape, generator=gen)
    batch = UpdateBatch(rollout, mask, torch.zeros(mask.shape), returns=returns, old_values=old_values)
    results = []
    for micro in (32, 5):
        trainer.config.micro_batch_size = micro
        results.append(loss_and_gradient(trainer, batch, trainer.critic.learner))
    with torch.no_grad():
        expected, _ = value_loss(trainer.critic.value_model(*rollout.sequences()), old_values, returns, mask,
                                 clip_range=trainer.config.cliprange_value)
    for stats, _ in results:
        assert stats["value_loss"] == pytest.approx(expected.item(), abs=1e-5)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-6) and results[0][1].abs().sum() > 0


def test_algorithm_switch(tokenizer, tiny_model, tmp_path):
    """The algorithm is chosen once, by the config: PPO adds a critic as a second learner of the update."""
    def trainer_for(algorithm):
        config = GRPOConfig(algorithm=algorithm, output_dir=str(tmp_path), progress_bar=False, max_completion_length=8)
        return GRPOTrainer(config, model=tiny_model, tokenizer=tokenizer, train_dataset=ROWS, reward_funcs=[ones])

    grpo, ppo = trainer_for("grpo"), trainer_for("ppo")
    assert grpo.critic is None and grpo.learners == [grpo.policy]
    assert ppo.learners == [ppo.policy, ppo.critic.learner] and ppo.critic.learner.loss_weight == ppo.config.vf_coef
    with pytest.raises(ConfigError, match="PPO has no groups"):
        GRPOConfig(algorithm="ppo", dynamic_sampling=True)


def test_ppo_through_the_cli(tmp_path, tiny_model_dir, data_file, capsys):  # noqa: F811
    path = write_config(tmp_path, tiny_model_dir, data_file, algorithm="ppo")
    assert main(["train", str(path), "--num_minibatches", "2"]) == 0
    assert "done: 2 steps" in capsys.readouterr().out
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    common, ppo = documented_metrics()
    assert len(metrics) == 2 and logged_keys(metrics[0]) == common | ppo
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()
    assert (tmp_path / "run" / "value_model" / "model.safetensors").is_file()


def test_gamma_and_lam_reach_gae(tokenizer, tiny_model, tmp_path):
    """The critic's advantages and returns are gae(token rewards, V_old, mask) with the configured γ and λ."""
    trainer = make_ppo(tokenizer, tiny_model, tmp_path, gamma=0.9, lam=0.5, beta=0.2, whiten_advantages=False)
    batch = trainer.sampler.generate_and_score([0, 1, 2, 3])
    rollout, mask = batch.rollout, batch.rollout.completion_mask
    old_logp = trainer.frozen_logprobs(trainer.model, rollout)
    ref_logp = old_logp + 0.1
    fixed = trainer.critic.update_batch(batch, mask, old_logp, ref_logp)
    values = trainer.critic.frozen_values(rollout)
    rewards = token_rewards(batch, old_logp, ref_logp, beta=0.2)
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    swapped, _ = gae(rewards, values, mask, gamma=0.5, lam=0.9)
    assert torch.allclose(fixed.advantages, advantages, atol=1e-6) and torch.allclose(fixed.returns, returns, atol=1e-6)
    assert torch.equal(fixed.old_values, values)
    assert not torch.allclose(advantages, swapped, atol=1e-3)
