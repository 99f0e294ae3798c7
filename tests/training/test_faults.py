"""Faults during training: non-finite updates, failing reward functions, empty and unscored completions."""

import pytest
import torch

from grpokit.algorithms.grpo import TrainingError
from grpokit.rewards.calling import RewardError
from helpers import make_trainer, ones


def poison_training_passes(model):
    """NaN logits in training mode (the update), finite ones in eval mode (sampling, reference)."""
    return model.lm_head.register_forward_hook(lambda module, args, out: out * float("nan") if module.training else out)


def test_nonfinite_updates_are_skipped_then_stop_training(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, max_nonfinite_updates=3, save_every=1)
    trainer.training_step()  # one good step first
    good = [p.detach().clone() for p in tiny_model.parameters()]
    poison_training_passes(tiny_model)
    history = [trainer.training_step() for _ in range(2)]
    assert [m["skipped_updates"] for m in history] == [1, 1]
    assert trainer.policy.scheduler.last_epoch == 1  # the schedule advanced for the good update only
    assert all(torch.equal(a, b) for a, b in zip(good, tiny_model.parameters()))  # weights untouched
    match = r"3 updates in a row had a non-finite loss or gradient norm \(last: loss nan"
    with pytest.raises(TrainingError, match=match):
        trainer.training_step()
    assert all(torch.isfinite(p).all() for p in tiny_model.parameters())


def test_a_good_update_resets_the_count(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, max_nonfinite_updates=2)
    hook = poison_training_passes(tiny_model)
    assert trainer.training_step()["skipped_updates"] == 1
    hook.remove()
    assert trainer.training_step()["skipped_updates"] == 0 and trainer.guard.streak == 0


def flaky(prompts, completions, **kw):
    """Raises on completions holding an 'a' (a reward function with a bug on some inputs)."""
    return [1 / 0 if "a" in c else float(len(c) % 3) for c in completions]


def test_reward_error_stops_naming_function_prompt_and_completion(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path,
                           reward_funcs=(lambda completions, **k: [1 / 0] * len(completions),))
    with pytest.raises(RewardError, match=r"'<lambda>' raised ZeroDivisionError: .* on completion 0 \(prompt 'Count"):
        trainer.training_step()


def test_on_reward_error_skip_counts_and_keeps_training(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, reward_funcs=(flaky, ones), on_reward_error="skip",
                           max_steps=3)
    history = trainer.train()
    assert sum(m["reward_errors"] for m in history) > 0
    assert all(m["rewards/flaky"] is None or m["rewards/flaky"] >= 0 for m in history)


def nothing_applies(prompts, completions, **kw):
    return [None] * len(completions)


def test_unscored_groups_and_empty_completions_are_counted(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, reward_funcs=(nothing_applies,))

    def eos_first(module, args, out):  # sampling (eval mode) always says EOS at once: empty completions
        if module.training:
            return out
        forced = torch.full_like(out, -1e4)
        forced[..., tokenizer.eos_token_id] = 1e4
        return forced

    tiny_model.lm_head.register_forward_hook(eos_first)
    trainer.rewards_checked = True  # as on a later step: said, not refused (a first step of none is: test_battery.py)
    metrics = trainer.training_step()
    assert metrics["empty_frac"] == 1.0 and metrics["completion_length_max"] == 1.0  # the EOS alone
    assert metrics["unscored_groups"] == 4 and metrics["reward"] == 0.0 and metrics["frac_zero_std_groups"] == 1.0
    assert all(torch.isfinite(torch.tensor(v)) for v in (metrics["loss"], metrics["grad_norm"]))
