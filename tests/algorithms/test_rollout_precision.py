"""`rollout_precision`: the sampler reads a bfloat16 copy of the policy that is never stale, or the policy under
bfloat16 autocast; the loss is corrected by importance sampling (by default per completion) and its mismatch logged;
with fp32 the sampler is the policy and nothing changes."""

import inspect
import json

import pytest
import torch

import grpokit.algorithms.grpo
import grpokit.models.fast.fused_linear
import grpokit.rollout.engines
from grpokit.config import ConfigError, GRPOConfig
from grpokit.core.importance import importance_weights
from helpers import documented_metrics, logged_keys, make_trainer


def test_the_bf16_sampler_holds_the_policys_weights_at_every_step(tokenizer, tiny_model, tmp_path, monkeypatch):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, max_steps=3, rollout_precision="bf16")
    seen, real = [], grpokit.rollout.engines.generate

    def generate(model, *args, **kwargs):
        assert model is not trainer.model
        # the weights it samples with are the policy's now, in bfloat16: after each optimizer step, refreshed
        for mine, theirs in zip(model.parameters(), trainer.model.parameters(), strict=True):
            assert mine.dtype == torch.bfloat16 and torch.equal(mine, theirs.detach().to(torch.bfloat16))
        seen.append({name: p.detach().clone() for name, p in model.named_parameters()})
        return real(model, *args, **kwargs)

    monkeypatch.setattr(grpokit.rollout.engines, "generate", generate)
    history = trainer.train()
    assert len(seen) == 3 and any(not torch.equal(seen[0][k], seen[1][k]) for k in seen[0])  # the policy moved
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert logged_keys(metrics[0]) == documented_metrics(lowered=True)[0] - {"accuracy", "format_rate"}
    for m in history:  # bfloat16 differs from float32, a little
        assert 0 < m["sampler_kl"] < 0.05 and m["is_weight_mean"] == pytest.approx(1.0, abs=0.1)


def test_bf16_autocast_samples_the_policy_itself_under_bf16_autocast(tokenizer, tiny_model, tmp_path, monkeypatch):
    # the tiny model's products are all below the size the CPU fast path computes in bfloat16 under autocast
    monkeypatch.setattr(grpokit.models.fast.fused_linear, "ONEDNN_MIN_WEIGHTS", 0)
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, max_steps=2, rollout_precision="bf16_autocast")
    seen, real = [], grpokit.rollout.engines.generate

    def generate(model, *args, **kwargs):
        seen.append((model is trainer.model, torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(grpokit.rollout.engines, "generate", generate)
    assert trainer.engine.weights.current() is trainer.model  # no copy to refresh or go stale
    history = trainer.train()
    assert len(seen) == 2 and all(s == (True, True, torch.bfloat16) for s in seen)
    assert not torch.is_autocast_enabled("cpu")  # only the sampling ran under it
    for m in history:  # bfloat16 products differ from float32's, a little; the loss is corrected for it
        assert 0 < m["sampler_kl"] < 0.05 and m["is_weight_mean"] == pytest.approx(1.0, abs=0.1)


def test_the_loss_gets_the_samplers_logprobs_only_with_a_lower_precision(tokenizer, tiny_model, tmp_path,
                                                                          monkeypatch):
    given, real = [], grpokit.algorithms.grpo.grpo_loss
    monkeypatch.setattr(grpokit.algorithms.grpo, "grpo_loss", lambda *args, **kwargs: given.append(
        (kwargs["sample_logp"], kwargs["is_cap"], kwargs["is_mode"])) or real(*args, **kwargs))
    plain = make_trainer(tokenizer, tiny_model, tmp_path / "fp32", max_steps=1)
    assert plain.engine.weights.current() is plain.model  # no copy
    plain.train()
    assert given and all(sample is None for sample, _, _ in given)
    given.clear()
    lowered = make_trainer(tokenizer, tiny_model, tmp_path / "bf16", max_steps=1, rollout_precision="bf16",
                           rollout_is_cap=1.5, rollout_is_mode="token_truncate")
    lowered.train()
    assert given and all(sample is not None and (cap, mode) == (1.5, "token_truncate") for sample, cap, mode in given)


def test_the_default_correction_is_trls_per_completion_mask_in_the_config_and_the_loss():
    # sequence_mask at C = 3: TRL's default, and what kept the SmolLM2 recipe's carry (docs/sampling.md)
    config = GRPOConfig()
    assert (config.rollout_is_mode, config.rollout_is_cap) == ("sequence_mask", 3.0)
    loss_defaults = inspect.signature(grpokit.algorithms.grpo.grpo_loss).parameters
    assert (loss_defaults["is_mode"].default, loss_defaults["is_cap"].default) == ("sequence_mask", 3.0)
    assert inspect.signature(importance_weights).parameters["mode"].default == "sequence_mask"


def test_rollout_precision_is_checked():
    with pytest.raises(ConfigError, match="rollout_precision"):
        GRPOConfig(rollout_precision="int4")
    for precision in ("bf16", "bf16_autocast", "int8"):
        with pytest.raises(ConfigError, match="rollout_precision with parallelism: fsdp is not supported"):
            GRPOConfig(rollout_precision=precision, parallelism="fsdp")
    with pytest.raises(ConfigError, match="rollout_is_cap"):
        GRPOConfig(rollout_is_cap=0.5)
    with pytest.raises(ConfigError, match="rollout_is_mode"):
        GRPOConfig(rollout_is_mode="sequence")
    with pytest.raises(ConfigError, match="TRL's 'vllm_importance_sampling_mode' is rollout_is_mode"):
        GRPOConfig.from_dict({"vllm_importance_sampling_mode": "sequence_mask"})
