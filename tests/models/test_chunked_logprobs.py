"""Log-probs through the LM head in chunks (grpokit.models.chunked_logprobs) equal the plain path's full logits —
values and gradients, in float64 — on their own and end to end through ``sequence_logprobs``; the
fallbacks to the full logits are taken by name; the trainer passes ``logprob_chunk_mb`` to every pass."""

import contextlib

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from grpokit.config import GRPOConfig
from grpokit.core.objective import token_entropy, token_logprobs
from grpokit.models import chunked_logprobs, logprobs
from grpokit.models.chunked_logprobs import (
    ChunkedTokenLogprobs,
    chunk_rows,
    chunked_logprobs_and_entropy,
    chunked_token_logprobs,
)
from grpokit.models.logprobs import full_logits_reason, sequence_logprobs
from helpers import fixed_batch, make_trainer, models

K, H, V = 11, 6, 13


def head_problem(bias: bool, seed: int = 0):
    """Hidden states (K, H), a head (V, H) (+ bias), target tokens (K,) and per-token loss weights, float64,
    logits of order 1 to 10 so the softmax is neither flat nor one-hot."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(K, H, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = (2 * torch.randn(V, H, generator=gen, dtype=torch.float64)).requires_grad_()
    b = torch.randn(V, generator=gen, dtype=torch.float64, requires_grad=True) if bias else None
    tokens = torch.randint(0, V, (K,), generator=gen)
    loss_weights = torch.randn(K, generator=gen, dtype=torch.float64)
    return hidden, weight, b, tokens, loss_weights


def values_and_grads(logp_fn, hidden, weight, bias, loss_weights):
    inputs = [t for t in (hidden, weight, bias) if t is not None]
    logp = logp_fn()
    return logp.detach(), torch.autograd.grad((logp * loss_weights).sum(), inputs)


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 11, 64])  # 11 tokens: chunks that do and do not divide K
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
def test_values_and_gradients_equal_the_full_logits(chunk_size, temperature, bias):
    hidden, weight, b, tokens, loss_weights = head_problem(bias)
    full = lambda: token_logprobs(torch.nn.functional.linear(hidden, weight, b), tokens, temperature)  # noqa: E731
    chunked = lambda: chunked_token_logprobs(hidden, weight, b, tokens, temperature, chunk_size)  # noqa: E731
    expected, expected_grads = values_and_grads(full, hidden, weight, b, loss_weights)
    logp, grads = values_and_grads(chunked, hidden, weight, b, loss_weights)
    assert logp.dtype == torch.float64
    assert torch.allclose(logp, expected, rtol=0, atol=1e-12)
    for grad, expected_grad in zip(grads, expected_grads):  # hidden, weight, bias
        assert torch.allclose(grad, expected_grad, rtol=0, atol=1e-12)
    # the entropy from the same pass: equal to the full logits' too, no gradient, and the log-probs unchanged
    both = lambda: chunked_logprobs_and_entropy(hidden, weight, b, tokens, temperature, chunk_size, True)  # noqa: E731
    logp_too, entropy = both()
    expected_entropy = token_entropy(torch.nn.functional.linear(hidden, weight, b), temperature)
    assert torch.allclose(entropy, expected_entropy, rtol=0, atol=1e-12) and not entropy.requires_grad
    assert torch.equal(logp_too.detach(), logp)
    assert all(torch.equal(g, e) for g, e in zip(values_and_grads(lambda: both()[0], hidden, weight, b,
                                                                  loss_weights)[1], grads))
    assert chunked_logprobs_and_entropy(hidden, weight, b, tokens, temperature, chunk_size)[1] is None


@pytest.mark.parametrize("bias", [False, True])
def test_gradcheck(bias):
    hidden, weight, b, tokens, _ = head_problem(bias, seed=1)
    for chunk_size in (3, 4):
        function = lambda h, w, b, c=chunk_size: ChunkedTokenLogprobs.apply(h, w, b, tokens, 0.7, c)[0]  # noqa: E731
        assert torch.autograd.gradcheck(function, (hidden, weight, b))


def test_a_tied_head_gets_both_gradients():
    """The head's weight is also the embedding that made the hidden states: its gradient sums both uses."""
    gen = torch.Generator().manual_seed(2)
    table = torch.randn(V, H, generator=gen, dtype=torch.float64, requires_grad=True)
    mix = torch.randn(H, H, generator=gen, dtype=torch.float64)
    ids, tokens = torch.randint(0, V, (K,), generator=gen), torch.randint(0, V, (K,), generator=gen)
    grads = []
    for logp_of in (lambda h: token_logprobs(h @ table.T, tokens, 1.3),
                    lambda h: chunked_token_logprobs(h, table, None, tokens, 1.3, chunk_size=4)):
        (grad,) = torch.autograd.grad(logp_of(torch.tanh(table[ids] @ mix)).sum(), table)
        grads.append(grad)
    assert torch.allclose(grads[1], grads[0], rtol=0, atol=1e-12)


def test_half_precision_weights_compute_the_head_in_their_dtype_and_return_float32():
    hidden, weight, _, tokens, loss_weights = head_problem(False)
    hidden, weight = hidden.detach().float().requires_grad_(), weight.detach().bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # off inside: the head runs in the weight's dtype
        logp = chunked_token_logprobs(hidden, weight, None, tokens, 0.7, chunk_size=4)
    expected = token_logprobs(hidden.bfloat16() @ weight.T, tokens, 0.7)  # bfloat16 logits, log-probs in float32
    assert logp.dtype == torch.float32 and torch.allclose(logp, expected, rtol=0, atol=1e-6)
    (logp * loss_weights.float()).sum().backward()
    assert hidden.grad.dtype == torch.float32 and weight.grad.dtype == torch.bfloat16


def test_chunk_rows_and_bad_arguments():
    assert chunk_rows(49152, 64) == 341  # 341 × 49,152 × 4 bytes ≤ 64 MiB
    assert chunk_rows(10**9, 1) == 1
    hidden, weight, _, tokens, _ = head_problem(False)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_token_logprobs(hidden, weight, None, tokens, chunk_size=0)
    with pytest.raises(ValueError, match="temperature"):
        chunked_token_logprobs(hidden, weight, None, tokens, temperature=0.0)
    with pytest.raises(ValueError, match=r"\(K, H\)"):
        chunked_token_logprobs(hidden, weight[:, :3], None, tokens)
    assert GRPOConfig().logprob_chunk_mb == logprobs.DEFAULT_CHUNK_MB  # sequence_logprobs' default is the config's


# ---- end to end, through sequence_logprobs --------------------------------------------------------------------


def with_padding_row(batch):
    """``fixed_batch`` with a ninth row whose completion is all padding (no token of it is scored)."""
    prompt_ids, prompt_mask, completions, mask = batch
    return (torch.cat([prompt_ids, prompt_ids[:1]]), torch.cat([prompt_mask, prompt_mask[:1]]),
            torch.cat([completions, completions[:1]]), torch.cat([mask, torch.zeros_like(mask[:1])]))


def untied_llama(tokenizer):
    torch.manual_seed(3)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=64,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id)
    return LlamaForCausalLM(config)


def gpt2_with_head_bias(tokenizer):
    torch.manual_seed(4)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=len(tokenizer), n_positions=64,
                                       tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       bos_token_id=None, eos_token_id=tokenizer.eos_token_id))
    model.lm_head.bias = torch.nn.Parameter(torch.randn(len(tokenizer)))  # a head with a bias, as Phi's
    return model


@pytest.mark.parametrize("name", ["llama (tied)", "qwen2-gqa-bias (tied)", "llama (untied)", "gpt2 (head bias)"])
@pytest.mark.parametrize("fast", [True, False])
def test_sequence_logprobs_chunked_equal_full_logits(tokenizer, name, fast, monkeypatch, request):
    """float64: log-probs, entropies and every parameter's gradient, chunked (5 tokens a chunk, which does
    not divide the batch's 38) vs the full logits of the same path."""
    if "gpt2" in name:
        request.getfixturevalue("float64_default")
    model = {"llama (tied)": lambda: models(tokenizer)["llama"], "qwen2-gqa-bias (tied)": lambda: models(tokenizer)[
        "qwen2-gqa-bias"], "llama (untied)": lambda: untied_llama(tokenizer),
        "gpt2 (head bias)": lambda: gpt2_with_head_bias(tokenizer)}[name]().double().train()
    batch = with_padding_row(fixed_batch(tokenizer))
    five_rows = 5 * 4 * len(tokenizer) / 2**20
    assert full_logits_reason(model, five_rows, fast=fast and "gpt2" not in name) is None
    chunks = []
    head_logits = chunked_logprobs._logits
    monkeypatch.setattr(chunked_logprobs, "_logits", lambda h, *a: chunks.append(len(h)) or head_logits(h, *a))
    results = {}
    for chunk_mb in (0, five_rows):
        model.zero_grad()
        logp, entropy = sequence_logprobs(model, *batch, temperature=0.7, with_entropy=True, fast=fast,
                                          chunk_mb=chunk_mb)
        (logp * torch.linspace(-1, 1, logp.numel(), dtype=logp.dtype).view_as(logp)).sum().backward()
        results[chunk_mb] = logp.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()}
    assert chunks == ([5] * 7 + [3]) * 2  # 38 tokens: 8 chunks for the log-probs with the entropy, 8 in backward
    (logp_full, entropy_full, grads_full), (logp, entropy, grads) = results.values()
    assert logp.dtype == torch.float64 and (logp[batch[3] == 0] == 0).all() and (logp[-1] == 0).all()
    assert torch.allclose(logp, logp_full, rtol=0, atol=1e-10)
    assert torch.allclose(entropy, entropy_full, rtol=0, atol=1e-10)
    for key, grad in grads_full.items():
        assert torch.allclose(grads[key], grad, rtol=0, atol=1e-10), key


@pytest.mark.parametrize("fast", [True, False])
def test_reference_pass_without_gradient(tokenizer, fast):
    model = models(tokenizer)["qwen2-gqa-bias"].eval()
    batch = fixed_batch(tokenizer)
    with torch.no_grad():
        full, _ = sequence_logprobs(model, *batch, fast=fast, chunk_mb=0)
        chunked, _ = sequence_logprobs(model, *batch, fast=fast, chunk_mb=3 * 4 * len(tokenizer) / 2**20)
    assert not chunked.requires_grad and torch.allclose(chunked, full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("fast", [True, False])
def test_under_bf16_autocast_the_head_keeps_each_paths_dtype(tokenizer, fast):
    """The fast path's head runs in the weights' dtype (float32) under autocast, the model's own forward's in
    autocast's (bfloat16): chunked, each computes what its full logits compute."""
    model = models(tokenizer)["qwen2-gqa-bias"].train()
    batch = fixed_batch(tokenizer)
    results = []
    for chunk_mb in (0, 4 * 4 * len(tokenizer) / 2**20):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp, _ = sequence_logprobs(model, *batch, fast=fast, chunk_mb=chunk_mb)
        logp.sum().backward()
        results.append((logp.detach(), model.lm_head.weight.grad.clone()))
    (full, full_grad), (chunked, grad) = results
    assert chunked.dtype == torch.float32 and grad.dtype == torch.float32
    assert torch.allclose(chunked, full, rtol=0, atol=1e-5 if fast else 2e-2)
    assert torch.allclose(grad, full_grad, rtol=1e-2, atol=1e-2 if fast else 5e-2)


def test_the_full_logits_are_used_by_name_where_chunks_cannot_be(tokenizer):
    model = models(tokenizer)["llama"]
    assert full_logits_reason(model, 0, fast=True) == "logprob_chunk_mb is 0"
    # What FSDP2 adds (and its hooks): its own forward runs, the head set aside (test_distributed.py runs it)
    model.set_requires_gradient_sync = lambda enabled: None
    model.register_forward_pre_hook(lambda module, args: None)
    assert full_logits_reason(model, 64, fast=False) is None
    hooked = models(tokenizer)["llama"]
    hooked.lm_head.register_forward_hook(lambda module, args, out: out * 0.5)
    assert full_logits_reason(hooked, 64, fast=True) == "forward hooks on the LM head"
    capped = Gemma2ForCausalLM(Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, head_dim=8,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer)))
    assert "model_type 'gemma2'" in full_logits_reason(capped, 64, fast=False)  # soft-caps its logits
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=len(tokenizer)))
    gpt2.register_forward_pre_hook(lambda module, args: None)
    assert full_logits_reason(gpt2, 64, fast=False) == "forward hooks on the model"


def test_a_lora_head_uses_the_full_logits_and_keeps_its_adapter(tokenizer):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(untied_llama(tokenizer), LoraConfig(r=4, init_lora_weights=False,
                                                               target_modules=["q_proj", "lm_head"]))
    assert "not a plain torch.nn.Linear" in full_logits_reason(model, 64, fast=True)
    batch = fixed_batch(tokenizer)
    with torch.no_grad():
        logp = {fast: sequence_logprobs(model, *batch, fast=fast)[0] for fast in (True, False)}
        with model.disable_adapter():
            base = sequence_logprobs(model, *batch)[0]
    assert torch.allclose(logp[True], logp[False], atol=1e-5)
    assert (logp[True] - base).abs().max() > 1e-3  # the adapter is in the path


def test_a_lora_model_with_a_plain_head_is_chunked(tokenizer):
    """The default LoRA targets (projections) leave the head a plain Linear: chunks, off the fast path too,
    through the base model under the adapter (and with it disabled, for π_ref)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(models(tokenizer)["llama"], LoraConfig(r=4, init_lora_weights=False,
                                                                  target_modules=["q_proj", "v_proj"]))
    batch = fixed_batch(tokenizer)
    for fast in (True, False):
        assert full_logits_reason(model, 64, fast=fast) is None
        with torch.no_grad():
            for adapter in (True, False):
                with contextlib.nullcontext() if adapter else model.disable_adapter():
                    chunked, _ = sequence_logprobs(model, *batch, fast=fast)
                    full, _ = sequence_logprobs(model, *batch, fast=fast, chunk_mb=0)
                assert torch.allclose(chunked, full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunk_mb", [0.0, 0.5])
def test_the_trainer_passes_logprob_chunk_mb_to_every_pass(tokenizer, tiny_model, tmp_path, monkeypatch, chunk_mb):
    from grpokit.algorithms import grpo as trainer_module

    calls = []

    def recorded(*args, **kwargs):
        calls.append(kwargs["chunk_mb"])
        return sequence_logprobs(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "sequence_logprobs", recorded)
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, max_steps=1, num_iterations=2, logprob_chunk_mb=chunk_mb)
    trainer.training_step()
    assert len(calls) >= 4 and set(calls) == {chunk_mb}  # π_ref, π_old, and the policy's passes
