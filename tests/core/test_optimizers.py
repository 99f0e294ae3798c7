"""``optimizer: adamw_8bit`` (bitsandbytes' AdamW8bit): 8-bit moments for the large weights, float32 ones for
embeddings and small tensors; an update close to AdamW's; bit-exact resume; SFT and PPO take it too; clear
errors where it cannot run."""

import importlib.util

import pytest
import torch

from grpokit.config import ConfigError, GRPOConfig, SFTConfig
from grpokit.tasks.tiny_model import TinyModelSpec, build_model
from helpers import make_trainer

pytest.importorskip("bitsandbytes")

# every linear weight at least 4,096 values: bitsandbytes keeps float32 moments below that
WIDE = TinyModelSpec(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, max_positions=64)


def trainer_for(tokenizer, tmp_path, name="run", **overrides):
    return make_trainer(tokenizer, build_model(tokenizer, WIDE, seed=0), tmp_path / name,
                        **{"max_steps": 2, "learning_rate": 1e-3, **overrides})


def moments(trainer):
    return {name: trainer.policy.optimizer.state[p] for name, p in trainer.model.named_parameters()}


def test_large_weights_get_8_bit_moments_and_embeddings_float32(tokenizer, tmp_path):
    trainer = trainer_for(tokenizer, tmp_path, optimizer="adamw_8bit")
    trainer.training_step()
    states = moments(trainer)
    assert states["model.layers.0.mlp.up_proj.weight"]["state1"].dtype == torch.uint8
    assert states["model.layers.0.mlp.up_proj.weight"]["state2"].dtype == torch.uint8
    assert states["model.embed_tokens.weight"]["state1"].dtype == torch.float32  # 6,592 values, kept in float32
    assert states["model.norm.weight"]["state1"].dtype == torch.float32  # too small to quantise


def test_the_first_update_is_close_to_adamws(tokenizer, tmp_path):
    """Both start from zero moments, so their first steps differ only by the quantisation of the moments."""
    deltas = {}
    for optimizer in ("adamw", "adamw_8bit"):
        trainer = trainer_for(tokenizer, tmp_path, optimizer, optimizer=optimizer, max_grad_norm=0.0)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.training_step()
        deltas[optimizer] = torch.cat([(p.detach() - before[n]).flatten()
                                       for n, p in trainer.model.named_parameters()])
    full, eight = deltas["adamw"], deltas["adamw_8bit"]
    assert full.abs().sum() > 0
    assert torch.nn.functional.cosine_similarity(full, eight, dim=0) > 0.99
    assert (eight - full).norm() < 0.1 * full.norm()


def test_a_resumed_8_bit_run_is_bit_exact(tokenizer, tmp_path):
    straight = trainer_for(tokenizer, tmp_path, "straight", optimizer="adamw_8bit", max_steps=4)
    straight.train()
    trainer_for(tokenizer, tmp_path, "split", optimizer="adamw_8bit", max_steps=2, save_every=2).train()
    resumed = trainer_for(tokenizer, tmp_path, "split", optimizer="adamw_8bit", max_steps=4, resume="latest")
    resumed.train()
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name
    for name, state in moments(straight).items():
        other = moments(resumed)[name]
        assert all(torch.equal(state[k], other[k]) for k in state if torch.is_tensor(state[k])), name


def test_ppo_steps_its_value_model_with_it_too(tokenizer, tmp_path):
    trainer = trainer_for(tokenizer, tmp_path, optimizer="adamw_8bit", algorithm="ppo")
    history = trainer.train()
    value_optimizer = trainer.critic.learner.optimizer
    assert type(value_optimizer) is type(trainer.policy.optimizer)
    assert all(torch.isfinite(torch.tensor(m["value_loss"])) for m in history)


def test_sft_takes_it(tiny_model_dir, tmp_path):
    from grpokit.algorithms.sft import SFTTrainer

    rows = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(16)]
    config = SFTConfig(model=str(tiny_model_dir), output_dir=str(tmp_path / "sft"), max_steps=2, batch_size=8,
                       micro_batch_size=8, progress_bar=False, optimizer="adamw_8bit", mixed_precision="no")
    trainer = SFTTrainer(config, train_dataset=rows)
    assert "8bit" in type(trainer.learner.optimizer).__name__
    trainer.train()


def test_without_bitsandbytes_the_error_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(ConfigError, match=r"adamw_8bit needs bitsandbytes: pip install 'grpokit\[8bit\]'"):
        GRPOConfig(optimizer="adamw_8bit")


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="optimizer: adamw_8bit with parallelism: fsdp is not supported"):
        GRPOConfig(optimizer="adamw_8bit", parallelism="fsdp")
    with pytest.raises(ConfigError, match="optimizer"):
        GRPOConfig(optimizer="sgd")
    with pytest.raises(ConfigError, match="TRL's 'optim' is optimizer"):
        GRPOConfig.from_dict({"optim": "adamw_8bit"})


def test_float32_moments_step_as_torchs_adamw_on_the_cpu():
    """The embedding (float32 moments) takes torch's fused AdamW update bit for bit; a quantised weight is
    only close to it."""
    from grpokit.core.optim import adamw_8bit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(100, 64), torch.nn.Linear(64, 128))
    twin = torch.nn.Sequential(torch.nn.Embedding(100, 64), torch.nn.Linear(64, 128))
    twin.load_state_dict(model.state_dict())
    settings = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    eight = adamw_8bit(model, list(model.parameters()), **settings)
    full = torch.optim.AdamW(twin.parameters(), fused=True, **settings)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in model.parameters()]
        for params, optimizer in ((model.parameters(), eight), (twin.parameters(), full)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            optimizer.step()
    assert eight.state[model[0].weight]["state1"].dtype == torch.float32
    assert torch.equal(model[0].weight, twin[0].weight)
    assert eight.state[model[1].weight]["state1"].dtype == torch.uint8
    assert not torch.equal(model[1].weight, twin[1].weight)
    assert torch.allclose(model[1].weight, twin[1].weight, atol=5e-3)
