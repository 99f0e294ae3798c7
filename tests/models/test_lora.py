"""LoRA: only the adapter trains, the reference is the base model with the adapter disabled (no copy),
adapters save, load and merge, and checkpoints restore them."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpokit.training.checkpoint import find_checkpoint
from helpers import make_trainer

peft = pytest.importorskip("peft")


def lora_trainer(tokenizer, model, tmp_path, **overrides):
    return make_trainer(tokenizer, model, tmp_path, lora_rank=4, lora_alpha=8.0,
                        lora_target_modules=["q_proj", "v_proj"], **overrides)


def test_only_the_adapter_trains_and_the_reference_is_the_base(tokenizer, tiny_model, tmp_path):
    base = {name: p.detach().clone() for name, p in tiny_model.named_parameters()}
    trainer = lora_trainer(tokenizer, tiny_model, tmp_path, max_steps=4)
    assert trainer.reference.model is trainer.model and trainer.reference.adapter_disabled  # no second copy
    history = trainer.train()
    assert history[0]["kl"] == 0.0  # the adapter starts at zero: policy = base = reference
    assert history[-1]["kl"] > 0.0
    changed = {name for name, p in trainer.model.named_parameters() if p.requires_grad}
    assert changed and all("lora_" in name for name in changed)
    for name, p in trainer.model.get_base_model().named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, base[name.replace(".base_layer", "")]), name


def test_model_is_merged_and_the_adapter_sits_beside_it(tokenizer, tiny_model, tiny_model_dir, tmp_path):
    trainer = lora_trainer(tokenizer, tiny_model, tmp_path, max_steps=2)
    trainer.train()
    adapter_dir, merged_dir = tmp_path / "run" / "adapter", tmp_path / "run" / "model"
    assert (adapter_dir / "adapter_model.safetensors").is_file() and (adapter_dir / "adapter_config.json").is_file()
    ids = tokenizer(["Count 1:"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = trainer.model(input_ids=ids).logits
        loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter_dir)
        merged = AutoModelForCausalLM.from_pretrained(merged_dir)  # plain transformers, no peft
        assert torch.allclose(loaded(input_ids=ids).logits, expected, atol=1e-5)
        assert torch.allclose(merged(input_ids=ids).logits, expected, atol=1e-5)


def test_checkpoint_restores_the_adapter(tokenizer, tiny_model, tmp_path):
    from grpokit.tasks.tiny_model import build_model
    from helpers import TINY

    trainer = lora_trainer(tokenizer, tiny_model, tmp_path, max_steps=2, save_every=1)
    trainer.train()
    fresh = lora_trainer(tokenizer, build_model(tokenizer, TINY, seed=0), tmp_path, max_steps=2)
    fresh.resume(find_checkpoint(tmp_path / "run", "latest"))
    for (name, a), b in zip(trainer.model.named_parameters(), fresh.model.parameters()):
        assert torch.equal(a, b), name


def test_a_checkpoint_in_the_old_layout_still_resumes(tokenizer, tiny_model, tmp_path):
    """Checkpoints written before the merged layout held the adapter in model/ and no adapter/."""
    import shutil

    from grpokit.tasks.tiny_model import build_model
    from helpers import TINY

    trainer = lora_trainer(tokenizer, tiny_model, tmp_path, max_steps=2, save_every=1)
    trainer.train()
    checkpoint = find_checkpoint(tmp_path / "run", "latest")
    shutil.rmtree(checkpoint / "model")
    (checkpoint / "adapter").rename(checkpoint / "model")
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"] = {name.replace("adapter/", "model/"): digest for name, digest in manifest["files"].items()
                         if not name.startswith("model/")}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    fresh = lora_trainer(tokenizer, build_model(tokenizer, TINY, seed=0), tmp_path, max_steps=2)
    fresh.resume(checkpoint)
    for (name, a), b in zip(trainer.model.named_parameters(), fresh.model.parameters()):
        assert torch.equal(a, b), name


def test_merge_lora_is_refused_naming_the_layout():
    from grpokit import ConfigError, GRPOConfig

    with pytest.raises(ConfigError, match="merge_lora.*was removed.*output_dir/model.*output_dir/adapter"):
        GRPOConfig.from_dict({"merge_lora": True})


def test_lora_with_ppo_is_refused():
    from grpokit import GRPOConfig
    from grpokit.config import ConfigError

    with pytest.raises(ConfigError, match="lora_rank with algorithm: ppo is not supported yet"):
        GRPOConfig(lora_rank=4, algorithm="ppo")
