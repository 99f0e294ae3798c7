"""The fast path (grpokit.models.fast.llama_family) computes what the models' own forward computes: log-probs,
entropies and gradients on fixed batches, sampled log-probs, greedy completions, and the trainer's loss
and gradient; it refuses what it cannot run exactly."""

import copy

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from grpokit.config import ConfigError, GRPOConfig
from grpokit.models.fast import decode, fused_linear, hidden_states, parts
from grpokit.models.fast.llama_family import LlamaFamily, unsupported
from grpokit.models.logprobs import sequence_logprobs
from grpokit.rollout.generate import generate
from grpokit.tasks.tiny_model import TinyModelSpec, build_model
from grpokit.training.update import UpdateBatch
from helpers import FAMILY_SHAPE, ROWS, fixed_batch, loss_and_gradient, make_trainer, models


@pytest.mark.parametrize("name", ["llama", "qwen2-gqa-bias", "mistral"])
@pytest.mark.parametrize("attention", ["matmuls, groups of 3 rows", "sdpa, one group"])
def test_logprobs_entropy_and_gradients_equal_the_model_forward(tokenizer, name, attention, monkeypatch):
    if attention.startswith("sdpa"):  # the fused kernel, which long rows take
        monkeypatch.setattr(hidden_states, "MATMUL_ATTENTION_MAX_SCORES", 0)
    monkeypatch.setattr(hidden_states, "ATTENTION_GROUP_ROWS", 3 if "groups of 3" in attention else 8)
    model = models(tokenizer)[name].train()
    assert unsupported(model) is None
    prompt_ids, prompt_mask, completions, mask = fixed_batch(tokenizer)
    results = {}
    for fast in (False, True):
        model.zero_grad()
        logp, entropy = sequence_logprobs(model, prompt_ids, prompt_mask, completions, mask, temperature=0.7,
                                          with_entropy=True, fast=fast)
        (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
        results[fast] = logp.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()}
    (logp_hf, entropy_hf, grads_hf), (logp_fast, entropy_fast, grads_fast) = results[False], results[True]
    assert torch.allclose(logp_fast, logp_hf, atol=1e-5)
    assert torch.allclose(entropy_fast, entropy_hf, atol=1e-5)
    assert (logp_fast[mask == 0] == 0).all() and (logp_hf[mask == 0] == 0).all()
    for key, grad in grads_hf.items():
        assert torch.allclose(grads_fast[key], grad, atol=1e-6, rtol=1e-4), key


@pytest.mark.parametrize("name", ["llama", "qwen2-gqa-bias"])
def test_rows_and_lengths_padded_for_onednn_change_nothing(tokenizer, name, monkeypatch):
    """Off float32 on the CPU (bfloat16: oneDNN, whose kernels are built per shape), the training passes
    compute extra rows up to a multiple of ONEDNN_ROW_BUCKET and pad each attention group's length to a
    multiple of ATTENTION_LENGTH_BUCKET, so that shapes recur from step to step. Float64 takes that path
    too, with rounding fine enough to show that the padding changes no log-prob and no gradient."""
    model = models(tokenizer)[name].double().train()
    monkeypatch.setattr(hidden_states, "ATTENTION_GROUP_ROWS", 3)
    rows = []
    model.model.embed_tokens.register_forward_hook(lambda module, args, out: rows.append(out.shape[0]))
    batch = fixed_batch(tokenizer)
    results = []
    for row_bucket, length_bucket in ((1, 1), (64, 8)):
        monkeypatch.setattr(hidden_states, "ONEDNN_ROW_BUCKET", row_bucket)
        monkeypatch.setattr(hidden_states, "ATTENTION_LENGTH_BUCKET", length_bucket)
        model.zero_grad()
        logp, _ = sequence_logprobs(model, *batch, fast=True)
        (logp * torch.linspace(-1, 1, logp.numel(), dtype=logp.dtype).view_as(logp)).sum().backward()
        results.append((logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert rows == [78, 128]  # 4 prompts once each and 8 completions: 78 tokens, padded to 2 × 64
    (logp, grads), (logp_padded, grads_padded) = results
    assert torch.allclose(logp_padded, logp, rtol=0, atol=1e-12)
    for key, grad in grads.items():
        assert torch.allclose(grads_padded[key], grad, rtol=1e-10, atol=1e-14), key


def test_onednn_linear_ops_still_work_as_called():
    """The decode products call torch's private oneDNN linear ops; this fails first if a torch changes
    them (the fast path would then quietly use MKL, slower)."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    assert fused_linear.onednn_works()


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-6), (torch.bfloat16, 3e-2)])
def test_rope_in_pair_layout_equals_the_models_rotate_half(dtype, atol):
    """Decoding's RoPE: with each head's features permuted into (i, i + D/2) pairs, one complex product
    gives the Hugging Face models' ``x · cos + rotate_half(x) · sin``, permuted alike."""
    from transformers.models.llama.modeling_llama import rotate_half

    d, gen = 8, torch.Generator().manual_seed(0)
    x, angles = torch.randn(3, 5, d, generator=gen), torch.randn(3, 1, d // 2, generator=gen)
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    expected = x * cos + rotate_half(x) * sin
    pairs = torch.arange(d).view(2, d // 2).t().reshape(d)  # 0, D/2, 1, D/2 + 1, ...
    got = parts.rope_pairs(x[..., pairs].to(dtype), torch.polar(torch.ones_like(angles), angles))
    assert torch.allclose(got.float(), expected[..., pairs], atol=atol)


@pytest.fixture(params=["mkl", "onednn"])
def decode_products(request, monkeypatch) -> str:
    """Decoding with every product on oneDNN's packed weights, or with none (tiny models' products are
    all below the size that takes oneDNN by default); the cache starts with room for 3 new tokens, so
    that it grows several times."""
    if request.param == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setattr(fused_linear, "ONEDNN_MIN_WEIGHTS", 0 if request.param == "onednn" else 2**62)
    monkeypatch.setattr(decode, "CACHE_ROOM", 3)
    return request.param


@pytest.mark.parametrize("name", ["llama", "qwen2-gqa-bias"])
def test_sampled_logprobs_match_the_model_forward_while_rows_stop_and_leave(tokenizer, name, decode_products,
                                                                           monkeypatch):
    """Many stop tokens make completions end at different steps, so finished rows leave the batch (and
    its cache) several times; the log-probs reported while sampling still match the model's own
    forward over the whole sequence, and every completion stops at its first stop token."""
    model = models(tokenizer)[name].eval()
    enc = tokenizer(["What is 1 + 2?", "Hi", "What is 47 + 85? Think.", "7", "Add 3 and 4."], padding=True,
                    padding_side="left", return_tensors="pt")
    stops = list(range(3, 13))  # ten ordinary tokens end a completion
    sizes, step = [], LlamaFamily._decode_step

    def recorded(self, x, *args):
        sizes.append(x.shape[0])
        return step(self, x, *args)

    monkeypatch.setattr(LlamaFamily, "_decode_step", recorded)
    rollout = generate(model, enc["input_ids"], enc["attention_mask"], num_generations=8, max_new_tokens=20,
                       temperature=1.3, eos_token_id=stops, pad_token_id=tokenizer.pad_token_id,
                       generator=torch.Generator().manual_seed(0), fast=True)
    assert sizes[0] == 40 and len(set(sizes)) >= 4  # the batch shrank at least three times
    lengths = rollout.lengths
    assert len(set(lengths.tolist())) > 4 and rollout.truncated.any() and not rollout.truncated.all()
    for row, n in zip(rollout.completion_ids, lengths):
        assert not any(t in stops for t in row[: n - 1].tolist())
        assert (row[n:] == tokenizer.pad_token_id).all()
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                    rollout.completion_mask, temperature=1.3, fast=False)
    mask = rollout.completion_mask.bool()
    assert torch.allclose(logp[mask], rollout.logp[mask], atol=1e-5)
    assert (rollout.logp[~mask] == 0).all()


@pytest.mark.parametrize("name", ["llama", "qwen2-gqa-bias"])
def test_fixed_shape_decoding_for_cuda_graphs_samples_the_same_tokens(tokenizer, name, decode_products):
    """generate(graph=True) keeps every shape fixed (finished rows stay in the batch, attention reads every
    column under a mask that opens one per step) so that CUDA can replay its decode step as a graph; on the
    CPU the step runs as it is and samples the same tokens with the same log-probs, while rows stop at
    different steps. Its test on CUDA, graph captured: tests/algorithms/test_cuda.py."""
    model = models(tokenizer)[name].eval()
    enc = tokenizer(["What is 1 + 2?", "Hi", "What is 47 + 85? Think."], padding=True, padding_side="left",
                    return_tensors="pt")
    kw = dict(num_generations=8, max_new_tokens=20, temperature=1.3, eos_token_id=list(range(3, 13)),
              pad_token_id=tokenizer.pad_token_id, fast=True)
    loop, fixed = (generate(model, enc["input_ids"], enc["attention_mask"], graph=graph,
                            generator=torch.Generator().manual_seed(0), **kw) for graph in (False, True))
    assert len(set(loop.lengths.tolist())) > 4 and loop.truncated.any() and not loop.truncated.all()
    assert torch.equal(fixed.completion_ids, loop.completion_ids)
    assert torch.equal(fixed.completion_mask, loop.completion_mask)
    assert torch.allclose(fixed.logp, loop.logp, atol=1e-6)
    with pytest.raises(ValueError, match="graph decoding runs on the fast path"):
        generate(model, enc["input_ids"], enc["attention_mask"], graph=True, **{**kw, "fast": False})
    with pytest.raises(ConfigError, match="cuda_graphs.*fast_path: true"):
        GRPOConfig(cuda_graphs=True, fast_path=False)


def test_greedy_completions_equal_the_model_forward_path(tokenizer, decode_products):
    model = models(tokenizer)["qwen2-gqa-bias"].eval()
    enc = tokenizer(["What is 1 + 2?", "Hi"], padding=True, padding_side="left", return_tensors="pt")
    kw = dict(num_generations=1, max_new_tokens=16, eos_token_id=tokenizer.eos_token_id,
              pad_token_id=tokenizer.pad_token_id, greedy=True)
    fast, slow = (generate(model, enc["input_ids"], enc["attention_mask"], fast=f, **kw) for f in (True, False))
    assert torch.equal(fast.completion_ids, slow.completion_ids)
    assert torch.allclose(fast.logp, slow.logp, atol=1e-5)
    # decoding runs in inference mode; what it returns must still be usable by autograd
    assert not any(torch.is_inference(t) for t in vars(fast).values() if t is not None)


@pytest.mark.parametrize("aggregation", ["sequence", "token"])
def test_trainer_loss_and_gradient_equal_the_unoptimised_path(tokenizer, tmp_path, aggregation):
    """The issue's equivalence: on a fixed batch, reference log-probs, the loss and the accumulated gradient
    of the trainer with ``fast_path`` (and micro-batches of 5) equal those of the model's own forward in
    one micro-batch, to float32 tolerance."""
    model = models(tokenizer)["llama"]
    trainers = {fast: make_trainer(tokenizer, copy.deepcopy(model), tmp_path / str(fast), fast_path=fast,
                                   aggregation=aggregation, micro_batch_size=5 if fast else 32)
                for fast in (True, False)}
    prompt_ids, prompt_mask = trainers[False].sampler.tokenize_prompts([row["prompt"] for row in ROWS[:4]])
    rollout = generate(model, prompt_ids, prompt_mask, num_generations=8, max_new_tokens=8,
                       eos_token_id=list(range(3, 9)), pad_token_id=tokenizer.pad_token_id,
                       generator=torch.Generator().manual_seed(0), fast=False)
    advantages = torch.randn(32, generator=torch.Generator().manual_seed(1))
    old_logp = rollout.logp + 0.05 * torch.randn(rollout.logp.shape, generator=torch.Generator().manual_seed(2))
    out = {}
    for fast, trainer in trainers.items():
        ref_logp = trainer.reference_logprobs(rollout)
        batch = UpdateBatch(rollout, rollout.completion_mask, advantages, old_logp, ref_logp)
        out[fast] = ref_logp, *loss_and_gradient(trainer, batch)
    (ref_fast, stats_fast, grad_fast), (ref_slow, stats_slow, grad_slow) = out[True], out[False]
    assert torch.allclose(ref_fast, ref_slow, atol=1e-5)
    assert stats_fast["loss"] == pytest.approx(stats_slow["loss"], abs=1e-6)
    for key in ("kl", "clipfrac", "entropy"):
        assert stats_fast[key] == pytest.approx(stats_slow[key], abs=1e-5), key
    assert torch.allclose(grad_fast, grad_slow, atol=1e-6, rtol=1e-4)


def test_gradient_is_reproducible_on_several_threads(tokenizer):
    """A row read several times (a group's shared prompt, padding) must get its gradient summed in a fixed
    order: on several CPU threads, indexing's backward adds with atomics, in a different order each run
    (for gathers of at least 2¹⁵ numbers, hence hidden size 128)."""
    model = build_model(tokenizer, TinyModelSpec(hidden_size=128, num_layers=1, num_heads=4, intermediate_size=128,
                                                 max_positions=64), seed=0)
    enc = tokenizer([row["prompt"] for row in ROWS[:4]], padding=True, padding_side="left", return_tensors="pt")
    rollout = generate(model, enc["input_ids"], enc["attention_mask"], num_generations=8, max_new_tokens=24,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        grads = []
        for _ in range(5):
            model.zero_grad()
            logp, _ = sequence_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                        rollout.completion_mask)
            logp.sum().backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(grads[0], g) for g in grads[1:])


def test_bf16_autocast_stays_close_to_float32(tokenizer):
    """Under bfloat16 autocast both paths give log-probs within bfloat16 rounding of float32's, and the
    fast path's weights, gradients and logits stay float32."""
    model = models(tokenizer)["qwen2-gqa-bias"].train()
    prompt_ids, prompt_mask, completions, mask = fixed_batch(tokenizer)
    exact, _ = sequence_logprobs(model, prompt_ids, prompt_mask, completions, mask, fast=False)
    for fast in (True, False):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp, _ = sequence_logprobs(model, prompt_ids, prompt_mask, completions, mask, fast=fast)
        assert logp.dtype == torch.float32
        assert (logp - exact).abs().max() < 0.1
        logp.sum().backward()
        assert all(p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all() for p in model.parameters())
    model.eval()
    enc = tokenizer(["What is 1 + 2?", "Hi"], padding=True, padding_side="left", return_tensors="pt")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rollout = generate(model, enc["input_ids"], enc["attention_mask"], num_generations=4, max_new_tokens=10,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                           generator=torch.Generator().manual_seed(0))
    logp, _ = sequence_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                rollout.completion_mask, fast=False)
    assert (logp - rollout.logp).abs().max() < 0.1


@pytest.mark.parametrize("fast, graph", [(True, False), (True, True), (False, False)])
def test_exact_prefill_reads_the_prompts_in_float32_under_bf16_autocast(tokenizer, fast, graph, monkeypatch):
    """``exact_prefill``: the first token's distribution is float32's (it depends on the prompts alone), the later
    ones under autocast; without it the first is bfloat16's too. Both decoders and the fixed-shape one the CUDA
    graph captures (the products switch to bfloat16 at the prefill, before any capture), the same generator."""
    monkeypatch.setattr(fused_linear, "ONEDNN_MIN_WEIGHTS", 0)  # the tiny products in bfloat16 too
    model = models(tokenizer)["qwen2-gqa-bias"].eval()
    enc = tokenizer(["What is 1 + 2?", "Hi"], padding=True, padding_side="left", return_tensors="pt")

    def sample(bf16: bool, exact_prefill: bool):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return generate(model, enc["input_ids"], enc["attention_mask"], num_generations=4, max_new_tokens=10,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, fast=fast,
                            graph=graph, generator=torch.Generator().manual_seed(0), exact_prefill=exact_prefill)

    exact, prefilled, autocast = sample(False, False), sample(True, True), sample(True, False)
    assert torch.equal(prefilled.completion_ids[:, 0], exact.completion_ids[:, 0])
    assert (prefilled.logp[:, 0] - exact.logp[:, 0]).abs().max() < 1e-5
    assert (autocast.logp[:, 0] - exact.logp[:, 0]).abs().max() > 1e-4  # bfloat16 products reading the prompts
    # the later tokens in bfloat16: float32's log-probs of the same tokens differ
    policy, _ = sequence_logprobs(model, prefilled.prompt_ids, prefilled.prompt_mask, prefilled.completion_ids,
                                  prefilled.completion_mask, fast=False)
    gap = (policy - prefilled.logp).abs()
    assert gap[:, 0].max() < 1e-5 and gap[:, 1:][prefilled.completion_mask[:, 1:].bool()].max() > 1e-4


def test_bf16_training_steps_run(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, mixed_precision="bf16", max_steps=2)
    history = trainer.train()
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert all(m["skipped_updates"] == 0 and m["loss"] == m["loss"] for m in history)


def test_what_it_cannot_run_exactly_is_refused_with_the_reason(tokenizer):
    ids = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, **ids))
    assert "model_type 'gpt2'" in unsupported(gpt2)
    windowed = Qwen2ForCausalLM(Qwen2Config(**FAMILY_SHAPE, **ids, use_sliding_window=True, sliding_window=8))
    assert "sliding" in unsupported(windowed)
    # the model's own forward takes over: sampling and log-probs still work
    enc = tokenizer(["Hi"], return_tensors="pt")
    rollout = generate(gpt2.eval(), enc["input_ids"], enc["attention_mask"], num_generations=2, max_new_tokens=4,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    logp, _ = sequence_logprobs(gpt2, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                rollout.completion_mask)
    assert torch.allclose(logp, rollout.logp, atol=1e-5)


def test_lora_layers_are_called_as_modules_and_sampling_stays_exact(tokenizer):
    """With a LoRA adapter the projections are not plain Linear layers: the fast path calls them as
    modules (rows for the prompt, transposed for the column-layout decode steps). Sampled log-probs must
    still match the model's own forward, with the adapter changing the outputs."""
    from peft import LoraConfig, get_peft_model

    base = models(tokenizer)["qwen2-gqa-bias"]
    lora = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(base, lora).eval()
    assert unsupported(model) is None
    enc = tokenizer(["What is 1 + 2?", "Hi"], padding=True, padding_side="left", return_tensors="pt")
    rollout = generate(model, enc["input_ids"], enc["attention_mask"], num_generations=4, max_new_tokens=12,
                       eos_token_id=list(range(3, 8)), pad_token_id=tokenizer.pad_token_id,
                       generator=torch.Generator().manual_seed(0), fast=True)
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                    rollout.completion_mask, fast=False)
        with model.disable_adapter():
            base_logp, _ = sequence_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                             rollout.completion_mask, fast=False)
    mask = rollout.completion_mask.bool()
    assert torch.allclose(logp[mask], rollout.logp[mask], atol=1e-5)
    assert (logp[mask] - base_logp[mask]).abs().max() > 1e-3  # the adapter is really in the path


def test_forward_hooks_on_projections_and_the_head_are_honoured(tokenizer):
    """A hooked layer is called as a module (not folded into a fused product), in decoding and in the
    training passes: the hooks change the outputs exactly as in the model's own forward."""
    model = models(tokenizer)["llama"].eval()
    calls = []

    def halve(module, args, out):
        calls.append(module)
        return out * 0.5

    model.model.layers[0].mlp.down_proj.register_forward_hook(halve)
    model.lm_head.register_forward_hook(halve)
    enc = tokenizer(["What is 1 + 2?", "Hi"], padding=True, padding_side="left", return_tensors="pt")
    rollout = generate(model, enc["input_ids"], enc["attention_mask"], num_generations=4, max_new_tokens=8,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       generator=torch.Generator().manual_seed(0), fast=True)
    assert {model.lm_head, model.model.layers[0].mlp.down_proj} <= set(calls)
    with torch.no_grad():
        logp_hf, _ = sequence_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                       rollout.completion_mask, fast=False)
        logp_fast, _ = sequence_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                         rollout.completion_mask, fast=True)
    mask = rollout.completion_mask.bool()
    assert torch.allclose(rollout.logp[mask], logp_hf[mask], atol=1e-5)
    assert torch.allclose(logp_fast, logp_hf, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_down_equals_autograd_and_saves_only_gate_and_up(bias):
    gen = torch.Generator().manual_seed(5)
    gate, up = (torch.randn(7, 12, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    down = torch.nn.Linear(12, 5, bias=bias, dtype=torch.float64)
    inputs = [gate, up, *down.parameters()]
    assert torch.autograd.gradcheck(lambda g, u: fused_linear.swiglu_down(g, u, down), (gate, up))
    weights = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    expected = torch.autograd.grad((down(torch.nn.functional.silu(gate) * up) * weights).sum(), inputs)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fused_linear.swiglu_down(gate, up, down)
    got = torch.autograd.grad((out * weights).sum(), inputs)
    assert all(torch.allclose(g, e, rtol=0, atol=1e-12) for g, e in zip(got, expected))
    assert sum(t.numel() for t in saved) == 2 * gate.numel() + down.weight.numel()  # gate, up and the weight
    hooked = []
    down.register_forward_hook(lambda *a: hooked.append(1))
    fused_linear.swiglu_down(gate, up, down)  # a hooked layer is called as a module
    with torch.no_grad():
        fused_linear.swiglu_down(gate, up, torch.nn.Linear(12, 5, dtype=torch.float64))
    assert hooked == [1]
