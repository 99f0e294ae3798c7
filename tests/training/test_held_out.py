"""Held-out evaluation during a GRPO run (eval_dataset / eval_fraction / eval_every) and the reward-gaming alarm."""

import json

import pytest

from grpokit import GRPOTrainer
from grpokit.algorithms.sft import SFTConfig, SFTTrainer
from grpokit.config import ConfigError, GRPOConfig
from grpokit.rewards.builtin import accuracy_reward
from grpokit.training.evaluation import evaluate, reward_gaming_alarm, summarize
from grpokit.training.report import write_report
from helpers import make_trainer

ROWS = [{"prompt": f"Count {i}:", "answer": "1"} for i in range(16)]
EVAL_KEYS = {"eval_accuracy", "eval_lenient_accuracy", "eval_format_rate", "eval_sampled_accuracy",
             "eval_sampled_lenient_accuracy", "eval_sampled_format_rate", "eval_pass@1", "eval_pass@2", "eval_prompts",
             "eval_alarm", "time_eval"}


def test_eval_fraction_holds_rows_out_and_evaluates_before_every_and_after(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, rows=ROWS, reward_funcs=(accuracy_reward,),
                           eval_fraction=0.25, eval_every=2, eval_samples=2, max_steps=3)
    held = trainer.held_out.rows
    assert len(held) == 4 and len(trainer.sampler.rows) == 12
    assert not {r["prompt"] for r in held} & {r["prompt"] for r in trainer.sampler.rows}  # never trained on
    history = trainer.train()
    assert [m["step"] for m in history] == [0, 1, 2, 3]
    assert set(history[0]) == {"step"} | EVAL_KEYS  # the starting policy
    assert EVAL_KEYS <= set(history[2]) and EVAL_KEYS <= set(history[3]) and not EVAL_KEYS & set(history[1])
    assert all(m["eval_prompts"] == 4 and m["eval_alarm"] == 0.0 for m in history if "eval_prompts" in m)
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [0, 1, 2, 3]


def test_the_held_out_metrics_are_grpokit_evals(tokenizer, tiny_model, tmp_path):
    """Step 0's metrics are evaluate()'s on the starting policy, with the run's prompts, temperature and seed."""
    rows = [{"prompt": f"Count {i}:", "answer": str(i % 3)} for i in range(8)]
    path = tmp_path / "held.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, eval_dataset=str(path), eval_samples=4, max_steps=1)
    scores = summarize(evaluate(tiny_model, tokenizer, rows, samples_per_prompt=4, max_new_tokens=8, seed=0,
                                batch_size=4, progress=False, pass_ks=[1, 4]))
    first = trainer.train()[0]
    assert first["eval_accuracy"] == scores["greedy_correct"]
    assert first["eval_sampled_format_rate"] == scores["sampled_format"]
    assert first["eval_pass@4"] == scores["pass@4"]


def test_evaluating_leaves_training_as_it_was(tokenizer, tmp_path):
    """The evaluation draws from its own generator: the run's samples and updates are those of a run without it."""
    from grpokit.tasks.tiny_model import build_model
    from helpers import TINY

    plain = make_trainer(tokenizer, build_model(tokenizer, TINY, seed=0), tmp_path / "a", rows=ROWS, max_steps=3)
    watched = make_trainer(tokenizer, build_model(tokenizer, TINY, seed=0), tmp_path / "b", rows=ROWS, max_steps=3,
                           eval_dataset="builtin:arithmetic", eval_every=1, eval_samples=1)
    watched.held_out.rows, watched.held_out.prompts = watched.held_out.rows[:4], watched.held_out.prompts[:4]
    watched.held_out.counted, watched.held_out.size = watched.held_out.counted[:4], 4
    a, b = plain.train(), [m for m in watched.train() if m["step"] > 0]
    assert [m["reward"] for m in a] == [m["reward"] for m in b] and [m["loss"] for m in a] == [m["loss"] for m in b]


def test_held_out_settings_are_checked(tokenizer, tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="eval_dataset and eval_fraction both choose the held-out rows"):
        GRPOConfig(eval_dataset="h.jsonl", eval_fraction=0.1)
    # checked by the trainer, which also knows the rows passed as eval_dataset= (then eval_every is fine)
    with pytest.raises(ConfigError, match="eval_every needs held-out rows: set eval_dataset or eval_fraction"):
        make_trainer(tokenizer, tiny_model, tmp_path, eval_every=5)
    trainer = GRPOTrainer(GRPOConfig(eval_every=5, max_completion_length=8, output_dir=str(tmp_path / "run"),
                                     progress_bar=False),
                          model=tiny_model, tokenizer=tokenizer, train_dataset=ROWS, eval_dataset=ROWS[:2],
                          reward_funcs=[accuracy_reward])
    assert trainer.held_out.rows == ROWS[:2]


def test_held_out_rows_missing_the_answer_column_are_named(tokenizer, tiny_model, tmp_path):
    path = tmp_path / "held.jsonl"
    path.write_text(json.dumps({"prompt": "a", "answer": "1"}) + "\n" + json.dumps({"prompt": "b"}) + "\n")
    with pytest.raises(ValueError, match=r"held.jsonl.*line 2 has no column 'answer'"):
        make_trainer(tokenizer, tiny_model, tmp_path, eval_dataset=str(path))


@pytest.mark.parametrize("history, alarm", [
    # the reward rose 0.2 -> 0.8 while accuracy fell 0.9 -> 0.5 from its best: gaming
    ([(0, None, 0.9), (1, 0.2, None), (2, 0.5, 0.7), (3, 0.8, None), (4, 0.8, 0.5)], True),
    # accuracy fell as much but the reward fell too: a bad run, not gaming
    ([(0, None, 0.9), (1, 0.8, None), (2, 0.5, 0.7), (3, 0.3, None), (4, 0.2, 0.5)], False),
    # the reward rose, the accuracy rose: learning
    ([(0, None, 0.5), (1, 0.2, None), (2, 0.5, 0.7), (3, 0.8, None), (4, 0.8, 0.9)], False),
    # a fall within the noise of 20 prompts (0.9 -> 0.8, standard error ~0.11) does not count
    ([(0, None, 0.9), (1, 0.2, None), (2, 0.5, 0.85), (3, 0.8, None), (4, 0.8, 0.8)], False),
    # one evaluation: nothing to compare
    ([(0, None, 0.9), (1, 0.2, None)], False),
])
def test_the_alarm_goes_off_when_the_reward_rises_as_held_out_accuracy_falls(history, alarm):
    metrics = [{"step": s, **({"reward": r} if r is not None else {}),
                **({"eval_accuracy": a, "eval_prompts": 20} if a is not None else {})} for s, r, a in history]
    assert (reward_gaming_alarm(metrics, 2, 0.05) is not None) == alarm


def brevity(prompts, completions, **kw):
    """Pays for saying less: a reward a model games by dropping its answer."""
    return [1.0 - len(c) / 40 for c in completions]


def test_a_reward_that_pays_for_dropping_the_answer_raises_the_alarm(tokenizer, tiny_model, tmp_path, capsys):
    """The model first learns to answer (SFT), then GRPO pays only for brevity: its training reward rises as it drops
    the answer and held-out accuracy falls, and the alarm goes off in the metrics and on the console."""
    answer = "<think>one</think><answer>1</answer>"
    sft_rows = [{"prompt": f"Count {i}:", "completion": answer} for i in range(16)]
    SFTTrainer(SFTConfig(model="unused", output_dir=str(tmp_path / "sft"), learning_rate=1e-2, lr_schedule="constant",
                         batch_size=8, max_steps=40, progress_bar=False, mixed_precision="no"),
               model=tiny_model, tokenizer=tokenizer, train_dataset=sft_rows).train()
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, rows=ROWS, reward_funcs=(brevity,), eval_fraction=0.5,
                           eval_every=2, eval_samples=0, max_steps=12, max_completion_length=40, beta=0.0)
    history = trainer.train()
    evals = [m for m in history if "eval_accuracy" in m]
    assert evals[0]["eval_accuracy"] == 1.0  # it answers before GRPO
    assert history[-1]["reward"] > history[1]["reward"]
    assert evals[-1]["eval_accuracy"] <= 0.5
    assert any(m["eval_alarm"] == 1.0 for m in evals) and evals[0]["eval_alarm"] == 0.0
    assert "reward gaming? since step 0 the training reward rose" in capsys.readouterr().err
    # ... and in the report: a banner with the reason, the evaluations' table with the step marked
    page = write_report(trainer.config.output_dir).read_text()
    assert "<b>Reward gaming?</b> At step" in page and "since step 0 the training reward rose" in page
    assert "<h2>Held-out evaluation</h2>" in page and "<td>yes</td>" in page
