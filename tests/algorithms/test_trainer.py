"""The trainer end to end on a tiny model, its invariances, its outputs, and its errors on bad input."""

import json
import platform
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpokit.algorithms import grpo as grpokit_trainer
from grpokit.data import DataError
from grpokit.rewards.builtin import accuracy_reward, format_reward
from grpokit.rewards.calling import RewardError
from grpokit.rollout.generate import generate
from grpokit.runtime import memory
from grpokit.training.update import UpdateBatch
from helpers import ROWS, documented_metrics, logged_keys, loss_and_gradient, make_trainer, ones


def test_cpu_training_keeps_freed_memory_for_the_next_step(tokenizer, tiny_model, tmp_path, monkeypatch):
    """On the CPU the trainer has malloc keep freed memory (``grpokit.runtime.memory.keep_freed_memory``) unless
    ``keep_freed_memory: false``, and on Linux with glibc the settings take. What they save (page faults,
    seconds per step) depends on the machine's state: ``benchmarks/freed_memory.py`` measures it."""
    returned = []
    real = memory.keep_freed_memory
    monkeypatch.setattr(grpokit_trainer, "keep_freed_memory", lambda: returned.append(real()) or returned[-1])
    make_trainer(tokenizer, tiny_model, tmp_path / "off", keep_freed_memory=False, device="cpu")
    assert returned == []
    make_trainer(tokenizer, tiny_model, tmp_path / "on", device="cpu")
    assert len(returned) == 1
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        assert returned == [True]


def test_tiny_run_changes_every_parameter_and_raises_the_reward(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path)
    before = {name: p.detach().clone() for name, p in tiny_model.named_parameters()}
    history = trainer.train()
    unchanged = [name for name, p in trainer.model.named_parameters() if torch.equal(before[name], p)]
    assert unchanged == []
    first, last = [sum(m["reward"] for m in chunk) / 3 for chunk in (history[:3], history[-3:])]
    assert last > first + 0.1, (first, last)
    # μ = 1: π_old is π_θ itself, so the ratio is exactly 1 and the clip never binds
    assert all(m["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and m["clipfrac"] == 0.0 for m in history)
    # the reference stays frozen at the starting weights
    for name, p in trainer.reference.model.named_parameters():
        assert torch.equal(p, before[name])


def test_run_directory_outputs(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, max_steps=3,
                           reward_funcs=(ones, accuracy_reward, format_reward), log_completions=2)
    trainer.train()
    run = tmp_path / "run"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    # every logged key is documented in docs/metrics.md, and every documented key is logged
    assert logged_keys(metrics[0]) == documented_metrics()[0]
    completions = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert len(completions) == 6 and {"prompt", "completion", "reward", "advantage", "ones"} <= set(completions[0])
    assert "reward_funcs" in (run / "config.yaml").read_text()
    # the saved model loads with plain transformers and generates
    model = AutoModelForCausalLM.from_pretrained(run / "model")
    tok = AutoTokenizer.from_pretrained(run / "model")
    assert (run / "model" / "model.safetensors").is_file()
    out = model.generate(**tok(["Count 1:"], return_tensors="pt"), max_new_tokens=3, do_sample=False)
    assert out.shape[1] > 0


@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
def test_gradient_does_not_depend_on_micro_batch_size(tokenizer, tiny_model, tmp_path, aggregation):
    """Whole-batch normalisers: gradients accumulated over micro-batches of 5 equal one pass over all 32."""
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, aggregation=aggregation)
    prompt_ids, prompt_mask = trainer.sampler.tokenize_prompts([row["prompt"] for row in ROWS[:4]])
    rollout = generate(tiny_model, prompt_ids, prompt_mask, num_generations=8, max_new_tokens=8,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       generator=torch.Generator().manual_seed(0))
    advantages = torch.randn(32, 1) * rollout.completion_mask
    batch = UpdateBatch(rollout, rollout.completion_mask, advantages, ref_logp=trainer.reference_logprobs(rollout))
    results = []
    for micro in (32, 5):
        trainer.config.micro_batch_size = micro
        results.append(loss_and_gradient(trainer, batch))
    assert results[0][0]["loss"] == pytest.approx(results[1][0]["loss"], abs=1e-6)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-6)
    assert results[0][1].abs().sum() > 0


def test_beta_zero_never_creates_a_reference(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, beta=0.0, max_steps=2)
    assert trainer.reference is None
    assert all(m["kl"] == 0.0 for m in trainer.train())


def test_several_iterations_use_old_logprobs(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, num_iterations=3, max_steps=2, learning_rate=5e-2)
    history = trainer.train()
    assert trainer.policy.scheduler.last_epoch == 6  # μ optimizer steps per batch
    # on the later passes the policy has moved away from π_old, so the ratio is no longer 1
    assert any(m["ratio_mean"] != pytest.approx(1.0, abs=1e-7) for m in history)


# ---- bad input: each names the culprit -----------------------------------------------------------


def test_missing_answer_column_names_row_and_column(tokenizer, tiny_model, tmp_path):
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "solution": "2"}]
    with pytest.raises(DataError, match=r"row 1 has no column 'answer'"):
        make_trainer(tokenizer, tiny_model, tmp_path, rows=rows, reward_funcs=(accuracy_reward,))


def test_answer_column_mapping(tokenizer, tiny_model, tmp_path):
    """answer_column's values reach reward functions as `answer` (over a column of that name) and under their own
    name; the other columns by name; the prompt only positionally."""
    seen = []

    def spy(prompts, completions, **columns):
        seen.append(columns)
        return [0.0] * len(completions)

    rows = [{"prompt": f"p{i}", "solution": str(i), "answer": "decoy", "level": i % 2} for i in range(4)]
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, rows=rows, reward_funcs=(spy,),
                           answer_column="solution", max_steps=1)
    trainer.train()
    (columns,) = seen
    by_prompt = {row["solution"]: row for row in rows}
    assert "prompt" not in columns and set(columns["answer"]) <= set(by_prompt)
    assert columns["answer"] == columns["solution"]
    assert [by_prompt[a]["level"] for a in columns["answer"]] == columns["level"]


def test_prompt_longer_than_context_names_the_row(tokenizer, tiny_model, tmp_path):
    rows = ROWS[:3] + [{"prompt": "x" * 60}]
    with pytest.raises(DataError, match=r"row 3: prompt of 60 tokens \+ max_completion_length 8 exceeds .* 64"):
        make_trainer(tokenizer, tiny_model, tmp_path, rows=rows)


def crashes(prompts, completions, **kw):
    raise ZeroDivisionError("division by zero")


def wrong_count(prompts, completions, **kw):
    return [0.0] * (len(completions) - 1)


def nan_reward(prompts, completions, **kw):
    return [float("nan")] * len(completions)


@pytest.mark.parametrize(
    "fn, match",
    [(crashes, "reward function 'crashes' raised ZeroDivisionError"),
     (wrong_count, "reward function 'wrong_count' returned 31 values for 32 completions"),
     (nan_reward, "reward function 'nan_reward' returned nan for completion 0")],
)
def test_bad_reward_function_stops_with_its_name(tokenizer, tiny_model, tmp_path, fn, match):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, reward_funcs=(fn,))
    with pytest.raises(RewardError, match=match):
        trainer.train()


def test_duplicate_reward_names_refused(tokenizer, tiny_model, tmp_path):
    with pytest.raises(ValueError, match="names must be unique"):
        make_trainer(tokenizer, tiny_model, tmp_path, reward_funcs=(ones, ones))


def test_progress_bar_false_silences_transformers_bars_too(tokenizer, tiny_model, tmp_path, capfd):
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()
    make_trainer(tokenizer, tiny_model, tmp_path, max_steps=1, progress_bar=False).train()
    assert "Writing model shards" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()  # as it was before the run
