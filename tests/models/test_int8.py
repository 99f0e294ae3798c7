"""``rollout_precision: int8``: activations smoothed into the weights, a few outlier channels in float and the rest
an exact integer product rescaled; decoding quantizes the policy's weights as they are at each call (never stale),
samples close to float32, and the trainer corrects the loss for the difference; what cannot is refused."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from grpokit.config import ConfigError, GRPOConfig
from grpokit.models.fast import int8
from grpokit.models.fast.int8 import Int8Product, quantize_rows, smoothing
from grpokit.models.logprobs import sequence_logprobs
from grpokit.models.rollout_weights import RolloutWeights
from grpokit.rollout.generate import generate
from helpers import documented_metrics, logged_keys, make_trainer, models


def test_quantize_rows_by_hand():
    q, scale = quantize_rows(torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]]))
    # row 0: scale 2/127; 1/scale = 63.5 rounds to even (64), -2 → -127, 0.5 → 31.75 → 32; a zero row: scale 1
    assert q.dtype == torch.int8 and q.tolist() == [[64, -127, 32], [0, 0, 0]]
    assert torch.allclose(scale, torch.tensor([2 / 127, 1.0]))


def test_smoothing_by_hand():
    weight = torch.tensor([[1.0, -4.0, 0.0], [0.5, 2.0, 0.0]])  # w = (1, 4, 0)
    s = smoothing(torch.tensor([100.0, 1.0, 3.0]), weight)
    # a = (100, max(1, 0.05·100) = 5, 5): s = √(100/1), √(5/4); a column of zero weights is left alone
    assert torch.allclose(s, torch.tensor([10.0, 5 ** 0.5 / 2, 1.0]))


def test_the_first_call_is_exact_and_calibrates_the_later_ones(monkeypatch):
    monkeypatch.setattr(int8, "OUTLIERS", 1)
    weight = torch.tensor([[1.0, 0.5, 0.25], [-0.5, 1.0, -1.0], [0.25, -0.5, 0.5]])
    bias, add = torch.tensor([0.5, -1.0, 2.0]), torch.ones(2, 3)
    product = Int8Product(weight, bias)
    calibration = torch.tensor([[8.0, 1.0, -2.0], [-1.0, 4.0, 4.0]])
    assert torch.equal(product(calibration), F.linear(calibration, weight, bias))  # calibrating: exact
    # a = (8, 4, 4), w = (1, 1, 1): s = (√8, 2, 2), a / s = (√8, 2, 2): channel 0 is the outlier
    assert torch.equal(product.inverse, torch.tensor([0.0, 0.5, 0.5])) and product.outliers.tolist() == [0]
    x = torch.tensor([[3.0, 2.0, -1.0], [0.5, -4.0, 2.0]])
    assert torch.allclose(product(x, add=add), F.linear(x, weight, bias) + add, atol=0.05)
    assert product(x.view(1, 2, 3)).shape == (1, 2, 3)  # prefill's (B, P, in)


def test_an_outlier_channel_costs_plain_rowwise_int8_most_of_its_precision():
    """Channel 0 is 300× the others: plain per-row int8 rounds the others to a level or two; smoothed, with
    the outlier in float, the product stays close."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 96, generator=generator)
    x = torch.randn(40, 96, generator=generator)
    x[:, 0] *= 300
    exact = F.linear(x, weight)
    product = Int8Product(weight, None)
    product(x[:32])  # calibrate on "the prompts"
    error = (product(x[32:]) - exact[32:]).abs().max()
    x_q, x_scale = quantize_rows(x[32:].clone())
    w_q, w_scale = quantize_rows(weight.clone())
    plain = (x_q.float() @ w_q.float().t()) * x_scale[:, None] * w_scale
    assert error < 0.02 * exact.abs().max() and error < (plain - exact[32:]).abs().max() / 10


def prompts(tokenizer):
    enc = tokenizer(["What is 1 + 2?", "Hi", "Add 3 and 4."], padding=True, padding_side="left", return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


@pytest.mark.parametrize("name", ["llama", "qwen2-gqa-bias"])
def test_int8_sampling_stays_close_to_the_policy(tokenizer, name):
    """The log-probs int8 decoding reports are the int8 model's, close to the policy's for the same tokens."""
    model = models(tokenizer)[name].eval()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    ids, mask = prompts(tokenizer)
    rollout = generate(model, ids, mask, num_generations=4, max_new_tokens=12, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id, generator=torch.Generator().manual_seed(0), int8=True)
    assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items())  # quantizing changed no weight
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                    rollout.completion_mask, fast=False)
    real = rollout.completion_mask.bool()
    gap = (logp - rollout.logp)[real].abs()
    assert 0 < gap.max() < 0.1  # int8 differs from float32, a little


def test_int8_decoding_reads_the_weights_as_they_are_now(tokenizer):
    """No quantized copy outlives a weight update: after the weights move in place (as an optimizer step moves
    them), int8 sampling gives what a model that never sampled before gives."""
    model = models(tokenizer)["llama"].eval()
    ids, mask = prompts(tokenizer)
    kw = dict(num_generations=1, max_new_tokens=10, eos_token_id=tokenizer.eos_token_id,
              pad_token_id=tokenizer.pad_token_id, greedy=True, int8=True)
    before = generate(model, ids, mask, **kw)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    after, fresh = generate(model, ids, mask, **kw), generate(copy.deepcopy(model), ids, mask, **kw)
    assert not torch.equal(before.logp, after.logp)
    assert torch.equal(after.completion_ids, fresh.completion_ids) and torch.equal(after.logp, fresh.logp)


def test_the_int8_trainer_corrects_the_loss_and_logs_the_mismatch(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, max_steps=2, rollout_precision="int8")
    assert trainer.engine.weights.current() is trainer.model and trainer.engine.lowered  # no copy
    history = trainer.train()
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert logged_keys(json.loads(metrics[0])) == documented_metrics(lowered=True)[0] - {"accuracy", "format_rate"}
    for m in history:
        assert 0 < m["sampler_kl"] < 0.05 and m["is_weight_mean"] == pytest.approx(1.0, abs=0.1)


def test_what_cannot_sample_in_int8_is_refused(tokenizer):
    ids = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, **ids))
    with pytest.raises(ValueError, match="rollout_precision: int8.*model_type 'gpt2'"):
        RolloutWeights(gpt2, "int8")
    enc = tokenizer(["Hi"], return_tensors="pt")
    with pytest.raises(ValueError, match="int8 decoding needs a model the fast path runs"):
        generate(gpt2, enc["input_ids"], enc["attention_mask"], num_generations=2, max_new_tokens=2,
                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, int8=True)
    with pytest.raises(ConfigError, match="fast_path"):
        GRPOConfig(rollout_precision="int8", fast_path=False)
    with pytest.raises(ValueError, match="on the CPU"):
        Int8Product(torch.ones(2, 2, device="meta"), None)
