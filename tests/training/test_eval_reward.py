"""eval_reward: the user's metric judges held-out evaluation, `grpokit eval` and the alarm; partial credit is
reported as a mean score, full credit as a solve rate; a judge that returns the wrong thing is named."""

import json

import pytest

from grpokit.cli.main import main
from grpokit.rewards.calling import RewardError
from grpokit.training.evaluation import check_eval_rows, evaluate, summarize
from helpers import make_trainer

ROWS = [{"prompt": f"Count {i}:", "answer": "1", "weight": i % 4} for i in range(8)]

JUDGE = '''
def by_weight(completions, weight, **kwargs):
    """A quarter of credit per unit of the row's weight: rows of weight 0 score 0, of weight 3 0.75, never 1."""
    return [w / 4 for w in weight]


def solved_at_two(completions, weight, **kwargs):
    return [1.0 if w >= 2 else None for w in weight]
'''


def by_weight(completions, weight, **kwargs):
    return [w / 4 for w in weight]


def test_a_judge_gives_the_mean_score_and_the_solve_rate(tokenizer, tiny_model):
    scores = evaluate(tiny_model, tokenizer, ROWS, samples_per_prompt=2, max_new_tokens=4, progress=False,
                      judge=lambda completions, weight, **kw: [float(w >= 2) + w / 8 for w in weight], pass_ks=[1, 2])
    expected = [0.0, 1 / 8, 1 + 2 / 8, 1 + 3 / 8] * 2  # by the rows' weights 0, 1, 2, 3
    assert scores["greedy_score"] == pytest.approx(expected) == scores["sampled_score"]
    assert scores["greedy_correct"] == [0.0, 0.0, 1.0, 1.0] * 2 == scores["sampled_correct"]
    assert scores["pass@2"] == [0.0, 0.0, 1.0, 1.0] * 2 and "greedy_lenient" not in scores
    summary = summarize(scores)
    assert summary["greedy_correct"] == 0.5 and summary["greedy_score"] == pytest.approx(sum(expected) / 8)


def test_without_a_judge_accuracy_reads_the_answer_as_before(tokenizer, tiny_model):
    scores = evaluate(tiny_model, tokenizer, ROWS, samples_per_prompt=0, max_new_tokens=4, progress=False)
    assert set(scores) == {"greedy_correct", "greedy_lenient", "greedy_format"}


@pytest.mark.parametrize("judge, match", [
    (lambda completions, **kw: ["high"] * len(completions), r"eval_reward: reward function '<lambda>' returned str "
                                                            r"'high' for completion 0; expected a float or None"),
    (lambda completions, **kw: [[(1, 1.0)]] * len(completions), r"eval_reward: .*returned step rewards .* one number"),
    (lambda completions, **kw: [1.0], r"eval_reward: reward function '<lambda>' returned 1 values for 4 completions"),
])
def test_a_judge_that_returns_the_wrong_thing_is_named(tokenizer, tiny_model, judge, match):
    with pytest.raises(RewardError, match=match):
        evaluate(tiny_model, tokenizer, ROWS[:4], samples_per_prompt=0, max_new_tokens=4, progress=False, judge=judge)


def test_the_rows_must_hold_what_the_judge_takes():
    check_eval_rows(ROWS, by_weight, "prompt", "answer", "held.jsonl")
    check_eval_rows([{"prompt": "p", "answer": "1"}], None, "prompt", "answer", "held.jsonl")
    with pytest.raises(ValueError, match=r"by_weight' needs 'weight'.*held.jsonl \(eval_reward\)"):
        check_eval_rows([{"prompt": "p", "answer": "1"}], by_weight, "prompt", "answer", "held.jsonl")
    with pytest.raises(ValueError, match=r"held.jsonl: row 1 has no column 'weight'"):
        check_eval_rows([ROWS[0], {"prompt": "p", "answer": "1", "other": 2}], by_weight, "prompt", "answer",
                        "held.jsonl")


def test_a_run_evaluates_held_out_rows_by_its_eval_reward(tokenizer, tiny_model, tmp_path):
    judge_file = tmp_path / "judges.py"
    judge_file.write_text(JUDGE)
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, rows=ROWS * 2, eval_fraction=0.5, eval_samples=2,
                           max_steps=1, eval_reward=f"{judge_file}:by_weight")
    held = trainer.held_out.rows
    history = trainer.train()
    for m in (history[0], history[-1]):
        assert m["eval_score"] == pytest.approx(sum(r["weight"] for r in held) / 4 / len(held))
        assert m["eval_sampled_score"] == m["eval_score"] and m["eval_accuracy"] == 0.0  # never full credit
        assert "eval_lenient_accuracy" not in m and m["eval_alarm"] == 0.0


def test_a_run_refuses_held_out_rows_without_the_judges_column(tokenizer, tiny_model, tmp_path):
    judge_file = tmp_path / "judges.py"
    judge_file.write_text(JUDGE)
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"prompt": "a", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"reward function 'by_weight' needs 'weight'"):
        make_trainer(tokenizer, tiny_model, tmp_path, rows=ROWS, eval_dataset=str(held),
                     eval_reward=f"{judge_file}:by_weight")


def test_grpokit_eval_takes_an_eval_reward(tmp_path, tiny_model_dir):
    judge_file, data = tmp_path / "judges.py", tmp_path / "rows.jsonl"
    judge_file.write_text(JUDGE)
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    out, completions = tmp_path / "eval.json", tmp_path / "eval.jsonl"
    assert main(["eval", str(tiny_model_dir), "--dataset", str(data), "--num_generations", "2", "--eval_reward",
                 f"{judge_file}:solved_at_two", "--max_completion_length", "4", "--progress_bar", "false",
                 "--output", str(out), "--completions", str(completions)]) == 0
    summary = json.loads(out.read_text())
    # None (not applicable) scores 0: rows of weight 0 and 1 are unsolved
    assert summary["greedy_correct"] == summary["greedy_score"] == summary["sampled_correct"] == 0.5
    records = [json.loads(line) for line in completions.read_text().splitlines()]
    assert [r["score"] for r in records] == [float(row["weight"] >= 2) for row in ROWS]
    assert all("lenient" not in r for r in records)


def test_grpokit_eval_names_an_eval_reward_it_cannot_find(tmp_path, tiny_model_dir, data_file, capsys):
    assert main(["eval", str(tiny_model_dir), "--dataset", str(data_file), "--eval_reward", "acuracy"]) == 2
    assert "eval_reward: unknown reward 'acuracy'; did you mean 'accuracy'?" in capsys.readouterr().err
