"""``gradient_checkpointing``: each decoder layer recomputed in backward, on the fast path and through the model's
own forward, with exactly the log-probs and gradients of the plain passes (float64); the flags it sets are put
back; the trainer and SFT pass the option to their training passes."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from grpokit.models import logprobs
from grpokit.models.logprobs import checkpointed_layers, sequence_logprobs
from helpers import fixed_batch, make_trainer, models


def gpt2(tokenizer):
    torch.manual_seed(4)
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=len(tokenizer), n_positions=64,
                                      bos_token_id=None, eos_token_id=tokenizer.eos_token_id))


def decoder_layers(model):
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


@pytest.mark.parametrize("name", ["llama", "qwen2-gqa-bias", "gpt2"])
@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("chunk_mb", [0.0, 64.0])
def test_checkpointed_passes_equal_the_plain_ones(tokenizer, name, fast, chunk_mb, request):
    if name == "gpt2":
        request.getfixturevalue("float64_default")
    model = (gpt2(tokenizer) if name == "gpt2" else models(tokenizer)[name]).double().eval()
    batch = fixed_batch(tokenizer)
    mlp_calls = []  # the first layer's MLP input product: run again in backward when its layer is recomputed
    first = decoder_layers(model)[0].mlp
    (first.c_fc if name == "gpt2" else first.up_proj).register_forward_hook(lambda *a: mlp_calls.append(1))
    results = {}
    for checkpoint in (False, True):
        model.zero_grad()
        mlp_calls.clear()
        logp, _ = sequence_logprobs(model, *batch, temperature=0.7, fast=fast, chunk_mb=chunk_mb,
                                    checkpoint_layers=checkpoint)
        (logp * torch.linspace(-1, 1, logp.numel(), dtype=logp.dtype).view_as(logp)).sum().backward()
        results[checkpoint] = logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, len(mlp_calls)
    (logp, grads, calls), (logp_ckpt, grads_ckpt, calls_ckpt) = results[False], results[True]
    assert (calls, calls_ckpt) == (1, 2)
    assert torch.allclose(logp_ckpt, logp, rtol=0, atol=1e-12)
    for key, grad in grads.items():
        assert torch.allclose(grads_ckpt[key], grad, rtol=0, atol=1e-12), key
    assert not model.training and not any(layer.training for layer in decoder_layers(model))


def test_flags_are_restored_and_no_grad_passes_are_left_alone(tokenizer):
    model = models(tokenizer)["llama"].eval()
    # the flag's owner
    layer = model.model.layers[0] if logprobs.GradientCheckpointingLayer is not None else model.model
    with checkpointed_layers(model):
        assert layer.gradient_checkpointing and layer.training
    assert not layer.gradient_checkpointing and not layer.training and "_gradient_checkpointing_func" not in vars(layer)
    with torch.no_grad(), checkpointed_layers(model):
        assert not layer.gradient_checkpointing  # nothing to recompute without a backward


def test_a_model_without_checkpointable_layers_is_named(tokenizer):
    class Bare(torch.nn.Module):
        pass

    with pytest.raises(ValueError, match="gradient_checkpointing: Bare has no transformers decoder layer"):
        with checkpointed_layers(Bare()):
            pass


def test_the_trainer_checkpoints_its_policy_passes_only(tokenizer, tiny_model, tmp_path, monkeypatch):
    from grpokit.algorithms import grpo as trainer_module

    calls = []

    def recorded(*args, **kwargs):
        calls.append((torch.is_grad_enabled(), kwargs.get("checkpoint_layers", False)))
        return sequence_logprobs(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "sequence_logprobs", recorded)  # the frozen passes
    monkeypatch.setattr(logprobs, "sequence_logprobs", recorded)  # the policy's (PolicyLogprobs)
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, max_steps=1, gradient_checkpointing=True)
    trainer.training_step()
    assert (True, True) in calls and all(checkpoint == grad for grad, checkpoint in calls if grad)
