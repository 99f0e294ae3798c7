"""prompt_sampling 'signal': prompts whose groups' rewards differ are drawn more often, those always or
never solved less but never never; the draw is seeded and survives a checkpoint."""

from collections import Counter

import pytest
import torch

from grpokit.training.sampling import signal_weights
from helpers import make_trainer

ROWS = [{"prompt": f"Count {i}:", "constant": i % 2 == 0} for i in range(32)]


def half_constant(prompts, completions, constant, **kw):
    """1 on rows marked constant (no signal: always solved), else a spread-out score of the text."""
    return [1.0 if const else float(sum(map(ord, c)) % 7) for c, const in zip(completions, constant)]


def test_weights_follow_the_spread_above_the_floor_and_unseen_prompts_count_as_the_most_spread():
    weights = signal_weights({0: 2.0, 1: 1.0, 2: 0.0}, 4, 0.2)
    assert weights.tolist() == pytest.approx([1.0, 0.6, 0.2, 1.0])
    assert signal_weights({0: 0.0}, 3, 0.2).tolist() == [1.0, 1.0, 1.0]  # nothing spread yet: uniform
    assert signal_weights({}, 2, 0.5).tolist() == [1.0, 1.0]


def test_mixed_prompts_are_drawn_more_often_and_solved_ones_never_vanish(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, rows=ROWS, prompt_sampling="signal",
                           prompt_sampling_floor=0.1)
    sampler = trainer.sampler
    sampler.spread = {i: 0.0 if row["constant"] else 1.0 for i, row in enumerate(ROWS)}
    draws = [sampler.next_indices() for _ in range(500)]
    assert all(len(set(step)) == 4 for step in draws)  # no prompt twice in one step
    counts = Counter(i for step in draws for i in step)
    constant = sum(counts[i] for i, row in enumerate(ROWS) if row["constant"])
    assert constant / 2000 == pytest.approx(0.1 / 1.1, abs=0.03)  # 16 prompts at 0.1 against 16 at 1
    assert set(counts) == set(range(32))  # every prompt comes back


def test_a_dataset_smaller_than_the_batch_repeats_prompts(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, rows=ROWS[:3], prompt_sampling="signal")
    assert sorted(trainer.sampler.next_indices()) in ([0, 0, 1, 2], [0, 1, 1, 2], [0, 1, 2, 2])


def test_sampling_by_signal_raises_the_share_of_groups_with_signal(tokenizer, tiny_model, tmp_path):
    """Half the prompts always score 1: uniform draws give groups with signal half the time; drawing by the
    spread seen so far, far more often once the constant prompts are known."""
    share = {}
    for mode in ("uniform", "signal"):
        trainer = make_trainer(tokenizer, tiny_model, tmp_path / mode, rows=ROWS, reward_funcs=(half_constant,),
                               prompt_sampling=mode)
        stats = [trainer.sampler.sample()[2] for _ in range(24)]
        share[mode] = sum(1 - s["frac_zero_std_groups"] for s in stats[8:]) / 16
        spread = trainer.sampler.spread
    assert share["uniform"] == 0.5
    assert share["signal"] > 0.75
    assert all((spread[i] == 0) == row["constant"] for i, row in enumerate(ROWS) if i in spread)
    metrics = trainer.training_step()  # the share of groups with signal, as logged
    assert metrics["frac_signal_groups"] == 1 - metrics["frac_zero_std_groups"]


def test_the_spread_follows_each_new_group_halfway(tokenizer, tiny_model, tmp_path):
    sampler = make_trainer(tokenizer, tiny_model, tmp_path, rows=ROWS, prompt_sampling="signal").sampler
    sampler.observe_spread([3, 5], torch.tensor([[0.0, 2.0], [1.0, 1.0]]))
    sampler.observe_spread([3], torch.tensor([[0.0, 0.0]]))
    assert sampler.spread == pytest.approx({3: 2 ** 0.5 / 2, 5: 0.0})


def test_the_draws_resume_exactly_from_a_checkpoint(tokenizer, tiny_model, tmp_path):
    options = dict(rows=ROWS, reward_funcs=(half_constant,), prompt_sampling="signal", max_steps=4)
    first = make_trainer(tokenizer, tiny_model, tmp_path, **options)
    for _ in range(2):
        first.training_step()
    first.save_checkpoint()
    ahead = [first.sampler.next_indices() for _ in range(3)]
    second = make_trainer(tokenizer, tiny_model, tmp_path, **options)
    second.resume("latest")
    assert second.sampler.spread == first.sampler.spread and second.sampler.draws == first.sampler.draws - 3
    assert [second.sampler.next_indices() for _ in range(3)] == ahead
