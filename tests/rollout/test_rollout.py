"""Rollouts: masks from where generation stopped, log-probs that match a full forward pass."""

import pytest
import torch

from grpokit.models.logprobs import sequence_logprobs
from grpokit.rollout import generate as rollout_module
from grpokit.rollout.generate import (
    generate,
    min_p_filter,
    penalize_repeats,
    sample_tokens,
    top_k_filter,
    top_p_filter,
)


class ScriptedLM(torch.nn.Module):
    """Emits script[row][t] at completion step t, whatever the input: a stand-in to test stopping."""

    def __init__(self, script, vocab_size=8):
        super().__init__()
        self.script, self.vocab_size = script, vocab_size
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask, cache=None, logits_to_keep=1, **kwargs):
        step = 0 if cache is None else cache + 1
        logits = torch.full((input_ids.shape[0], 1, self.vocab_size), -1e4)
        for row, tokens in enumerate(self.script):
            logits[row, 0, tokens[min(step, len(tokens) - 1)]] = 1e4
        return type("Out", (), {"logits": logits, "cache": step})()


def run_script(script, *, eos, pad, max_new_tokens=5):
    prompts = torch.ones(len(script), 2, dtype=torch.long)
    return generate(ScriptedLM(script), prompts, torch.ones_like(prompts), num_generations=1,
                    max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad)


def test_mask_is_built_from_where_each_completion_stopped():
    eos, pad = 1, 0
    # row 0 stops at step 2 (EOS included), row 1 emits the pad id as a real token, row 2 never stops
    rollout = run_script([[3, 4, 1, 5, 5], [0, 0, 1, 5, 5], [3, 3, 3, 3, 3]], eos=eos, pad=pad)
    assert rollout.completion_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert rollout.completion_ids.tolist() == [[3, 4, 1, 0, 0], [0, 0, 1, 0, 0], [3, 3, 3, 3, 3]]
    assert rollout.truncated.tolist() == [False, False, True]
    assert rollout.lengths.tolist() == [3, 3, 5]
    # log-probs past the stop are 0 (and masked)
    assert (rollout.logp[0, 3:] == 0).all()


def test_pad_equal_to_eos_keeps_the_eos_in_the_mask():
    rollout = run_script([[3, 1, 5], [1, 5, 5]], eos=1, pad=1, max_new_tokens=3)
    # a `!= pad_id` mask would drop the EOS tokens and teach the model never to stop
    assert rollout.completion_mask.tolist() == [[1, 1], [1, 0]]


def test_stops_early_when_all_finished():
    rollout = run_script([[1], [2, 1]], eos=1, pad=0, max_new_tokens=50)
    assert rollout.completion_ids.shape == (2, 2)


@pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "hf-forward"])
def test_generation_logprobs_match_a_full_forward_pass(tiny_model, tokenizer, fast):
    """KV-cached, left-padded sampling reports the same log-probs as one forward pass over the
    whole sequence (the model's own), at the sampling temperature."""
    tiny_model.eval()
    enc = tokenizer(["What is 1 + 2?", "Hi", "What is 47 + 85? Think."], padding=True, padding_side="left",
                    return_tensors="pt")
    gen = torch.Generator().manual_seed(0)
    rollout = generate(tiny_model, enc["input_ids"], enc["attention_mask"], num_generations=3, max_new_tokens=12,
                       temperature=0.7, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       generator=gen, fast=fast)
    assert rollout.completion_ids.shape[0] == 9
    assert rollout.logp.dtype == torch.float32
    with torch.no_grad():
        logp, entropy = sequence_logprobs(tiny_model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                          rollout.completion_mask, temperature=0.7, with_entropy=True, fast=False)
    mask = rollout.completion_mask.bool()
    assert torch.allclose(logp[mask], rollout.logp[mask], atol=1e-5)
    assert (entropy[mask] > 0).all()


def test_same_seed_same_rollout(tiny_model, tokenizer):
    enc = tokenizer(["What is 1 + 2?"], return_tensors="pt")
    kw = dict(num_generations=4, max_new_tokens=8, eos_token_id=tokenizer.eos_token_id,
              pad_token_id=tokenizer.pad_token_id)
    a = generate(tiny_model, enc["input_ids"], enc["attention_mask"], generator=torch.Generator().manual_seed(5), **kw)
    b = generate(tiny_model, enc["input_ids"], enc["attention_mask"], generator=torch.Generator().manual_seed(5), **kw)
    assert torch.equal(a.completion_ids, b.completion_ids)


def test_greedy_repeats_the_argmax(tiny_model, tokenizer):
    enc = tokenizer(["What is 1 + 2?"], return_tensors="pt")
    rollout = generate(tiny_model, enc["input_ids"], enc["attention_mask"], num_generations=3, max_new_tokens=6,
                       greedy=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    assert (rollout.completion_ids == rollout.completion_ids[0]).all()


def test_top_p_filter_hand_computed():
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    # cumulative probability before each token: 0, 0.5, 0.8 → top_p 0.6 keeps the first two
    assert torch.isinf(top_p_filter(logits, 0.6)).tolist() == [[False, False, True]]
    assert torch.isinf(top_p_filter(logits, 0.5)).tolist() == [[False, True, True]]
    assert torch.equal(top_p_filter(logits, 1.0), logits)
    # any leading shape: each row along the last (vocabulary) dimension on its own
    batch = torch.randn(2, 4, 5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(top_p_filter(batch, 0.7), torch.stack([top_p_filter(rows, 0.7) for rows in batch]))


def test_sample_tokens_follows_the_probabilities_and_never_picks_a_zero(monkeypatch):
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.5, 0.3, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    chosen = sample_tokens(probs.repeat(50_000, 1), torch.Generator().manual_seed(0)).view(50_000, 2)
    for row in range(2):
        frequencies = torch.bincount(chosen[:, row], minlength=6).float() / 50_000
        assert torch.allclose(frequencies, probs[row], atol=0.01)
        assert (frequencies[probs[row] == 0] == 0).all()
    # The uniform draw at its top (u · total rounded up to total) still lands on a token of positive probability.
    monkeypatch.setattr(rollout_module.torch, "rand", lambda shape, **kwargs: torch.ones(shape))
    assert sample_tokens(probs).tolist() == [4, 0]


def test_top_k_min_p_and_the_repetition_penalty_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 2.0]])
    assert torch.isinf(top_k_filter(logits, 2)).tolist() == [[False, True, True, False]]
    assert torch.isinf(top_k_filter(logits, 3)).tolist() == [[False, True, False, False]]
    assert torch.equal(top_k_filter(logits, 0), logits) and torch.equal(top_k_filter(logits, 9), logits)
    # probabilities relative to the top: e^(x - 2) = 1, 0.0498, 0.2231, 1 → min_p 0.2 drops only the second
    assert torch.isinf(min_p_filter(logits, 0.2)).tolist() == [[False, True, False, False]]
    assert torch.isinf(min_p_filter(logits, 0.25)).tolist() == [[False, True, True, False]]
    assert torch.isinf(min_p_filter(logits, 1.0)).tolist() == [[False, True, True, False]]  # the top ones stay
    assert torch.equal(min_p_filter(logits, 0.0), logits)
    seen = torch.tensor([[True, True, False, False]])
    assert penalize_repeats(logits, seen, 2.0).tolist() == [[1.0, -2.0, 0.5, 2.0]]  # positive ÷ 2, negative × 2


def test_the_filters_are_transformers_own():
    from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TopKLogitsWarper

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(1))
    assert torch.equal(top_k_filter(logits, 5), TopKLogitsWarper(5)(ids, logits.clone()))
    assert torch.equal(torch.isinf(min_p_filter(logits, 0.1)), torch.isinf(MinPLogitsWarper(0.1)(ids, logits.clone())))
    seen = torch.zeros(3, 50, dtype=torch.bool).scatter_(1, ids, True)
    torch.testing.assert_close(penalize_repeats(logits, seen, 1.3),
                               RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone()))


@pytest.mark.parametrize("fast", [True, False])
def test_greedy_with_a_repetition_penalty_is_transformers_generate(tiny_model, tokenizer, fast):
    enc = tokenizer(["Count 1:", "What is 12?"], return_tensors="pt", padding=True, padding_side="left")
    ours = generate(tiny_model, enc["input_ids"], enc["attention_mask"], num_generations=1, max_new_tokens=12,
                    greedy=True, repetition_penalty=3.0, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id, fast=fast)
    plain = generate(tiny_model, enc["input_ids"], enc["attention_mask"], num_generations=1, max_new_tokens=12,
                     greedy=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, fast=fast)
    theirs = tiny_model.generate(**enc, max_new_tokens=12, do_sample=False, repetition_penalty=3.0,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    width = ours.completion_ids.shape[1]
    assert torch.equal(ours.completion_ids * ours.completion_mask,
                       theirs[:, enc["input_ids"].shape[1]:][:, :width] * ours.completion_mask)
    assert not torch.equal(ours.completion_ids, plain.completion_ids)  # the penalty changed something
    # the log-probs stay the policy's own (at the temperature, before the penalty), as the loss recomputes them
    with torch.no_grad():
        policy, _ = sequence_logprobs(tiny_model, ours.prompt_ids, ours.prompt_mask, ours.completion_ids,
                                      ours.completion_mask)
    torch.testing.assert_close(ours.logp * ours.completion_mask, policy, atol=1e-4, rtol=0)


def test_top_k_of_one_and_min_p_of_one_sample_the_argmax(tiny_model, tokenizer):
    enc = tokenizer(["What is 1 + 2?"], return_tensors="pt")
    kw = dict(num_generations=4, max_new_tokens=6, eos_token_id=tokenizer.eos_token_id,
              pad_token_id=tokenizer.pad_token_id)
    greedy = generate(tiny_model, enc["input_ids"], enc["attention_mask"], greedy=True, **kw).completion_ids
    for options in (dict(top_k=1), dict(min_p=1.0)):
        sampled = generate(tiny_model, enc["input_ids"], enc["attention_mask"], temperature=2.0,
                           generator=torch.Generator().manual_seed(0), **options, **kw).completion_ids
        assert torch.equal(sampled, greedy), options


@pytest.mark.parametrize("kwargs, match", [(dict(temperature=0), "temperature"), (dict(top_p=0), "top_p"),
                                           (dict(max_new_tokens=0), "max_new_tokens"), (dict(top_k=-1), "top_k"),
                                           (dict(min_p=1.5), "min_p"), (dict(repetition_penalty=0), "repetition")])
def test_generate_rejects_bad_options(tiny_model, kwargs, match):
    ids = torch.ones(1, 2, dtype=torch.long)
    options = {**dict(num_generations=1, max_new_tokens=2, eos_token_id=1, pad_token_id=0), **kwargs}
    with pytest.raises(ValueError, match=match):
        generate(tiny_model, ids, torch.ones_like(ids), **options)


def test_several_stop_ids():
    # 1 and 2 both stop a completion (e.g. end-of-turn and end-of-text)
    rollout = generate(ScriptedLM([[3, 2, 5], [1, 5, 5], [3, 3, 3]]), torch.ones(3, 1, dtype=torch.long),
                       torch.ones(3, 1, dtype=torch.long), num_generations=1, max_new_tokens=3,
                       eos_token_id=[1, 2], pad_token_id=0)
    assert rollout.completion_mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1]]


def test_stop_token_ids_join_tokenizer_and_generation_config(tiny_model, tokenizer):
    from grpokit.rollout.generate import stop_token_ids

    tiny_model.generation_config.eos_token_id = [tokenizer.eos_token_id, 7]
    assert stop_token_ids(tiny_model, tokenizer) == [tokenizer.eos_token_id, 7]


def test_rollouts_of_different_widths_stack_padded_on_their_sides():
    from grpokit.rollout.generate import Rollout

    def rollout(prompt, completion, tool_mask=None):
        prompt, completion = torch.tensor([prompt]), torch.tensor([completion])
        return Rollout(prompt, torch.ones_like(prompt), completion, torch.ones_like(completion),
                       completion.float(), torch.tensor([False]), tool_mask)

    stacked = Rollout.cat([rollout([5], [7, 8, 9], torch.tensor([[0, 1, 0]])), rollout([5, 6], [7])], pad_token_id=0)
    assert stacked.prompt_ids.tolist() == [[0, 5], [5, 6]] and stacked.prompt_mask.tolist() == [[0, 1], [1, 1]]
    assert stacked.completion_ids.tolist() == [[7, 8, 9], [7, 0, 0]]
    assert stacked.completion_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert stacked.logp.tolist() == [[7.0, 8.0, 9.0], [7.0, 0.0, 0.0]] and stacked.truncated.tolist() == [False] * 2
    assert stacked.tool_mask.tolist() == [[0, 1, 0], [0, 0, 0]]
    assert Rollout.cat([rollout([5], [7]), rollout([5], [7, 8])], pad_token_id=0).tool_mask is None


def test_decoding_keeps_its_cache_whatever_the_models_use_cache(tiny_model, tokenizer):
    """transformers' forward asks for the KV cache explicitly: a model saved with use_cache false decodes the same."""
    enc = tokenizer(["What is 1 + 2?"], return_tensors="pt")
    kw = dict(num_generations=1, max_new_tokens=6, greedy=True, eos_token_id=tokenizer.eos_token_id,
              pad_token_id=tokenizer.pad_token_id, fast=False)
    expected = generate(tiny_model, enc["input_ids"], enc["attention_mask"], **kw).completion_ids
    tiny_model.config.use_cache = False
    try:
        got = generate(tiny_model, enc["input_ids"], enc["attention_mask"], **kw).completion_ids
    finally:
        tiny_model.config.use_cache = True
    assert torch.equal(got, expected)


def test_a_peft_model_is_given_the_cache_keyword_of_the_model_it_wraps(tiny_model):
    """peft's forward passes keywords through; the name of the cache argument is the wrapped model's."""
    import copy

    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(copy.deepcopy(tiny_model), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert rollout_module._cache_argument(wrapped) == rollout_module._cache_argument(tiny_model)
