"""grpokit bootstrap: a cold start sampled from the model, judged by the run's rewards, capped, deduplicated,
rewritten into the reply format; resumable after a crash without sampling again; iterated with SFT between rounds."""

import json

import pytest
import yaml

from grpokit.algorithms.bootstrap import BootstrapSettings, bootstrap_prompt, rewrite_to_tags, select
from grpokit.algorithms.bootstrap_log import BootstrapError, SamplesLog
from grpokit.cli.main import main

ROWS = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in [(12, 30), (47, 85), (20, 21), (33, 44)]]

# TRL-signature rewards, loaded from a file as a user's would be
REWARDS = '''
import os

def has_a(completions, **kwargs):
    return [float("a" in c) for c in completions]

def flaky(completions, **kwargs):
    if os.environ.get("BREAK_REWARD"):
        raise RuntimeError("the grader is down")
    return [float("a" in c) for c in completions]
'''


@pytest.fixture
def files(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    return data, rewards


def run(model_dir, data, out, *flags):
    return main(["bootstrap", str(model_dir), "--dataset", str(data), "--output", str(out), "--num_generations", "6",
                 "--max_completion_length", "10", "--no_instruction", "--progress_bar", "false", *flags])


# ---- the pieces ---------------------------------------------------------------------------------------------


def test_the_prompt_holds_the_instruction_and_the_demonstrations():
    demos = [{"prompt": "1+1?", "completion": "<answer>2</answer>"}]
    assert bootstrap_prompt("2+2?", "Tag it.", demos, chat=True) == [
        {"role": "user", "content": "Tag it.\n\n1+1?"}, {"role": "assistant", "content": "<answer>2</answer>"},
        {"role": "user", "content": "Tag it.\n\n2+2?"}]
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert bootstrap_prompt(conversation, "Tag it.", demos, chat=True) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tag it.\n\n1+1?"},
        {"role": "assistant", "content": "<answer>2</answer>"}, {"role": "user", "content": "Tag it.\n\n2+2?"}]
    assert bootstrap_prompt("2+2?", None, [], chat=False) == "2+2?"
    with pytest.raises(BootstrapError, match="no chat template"):
        bootstrap_prompt(conversation, None, [], chat=False)


@pytest.mark.parametrize("sample, rewritten", [
    ("The sum is 42.", "<think>The sum is</think><answer>42</answer>"),
    ("<think>4+2</think><answer>6</answer>", "<think>4+2</think><answer>6</answer>"),  # already shaped: as it is
    ("<think>x <answer>7</answer> tail", "<think>x</think><answer>7</answer>"),  # stray tags dropped
    ("1,024 it is", "<think></think><answer>1,024</answer>"),
    ("no number at all", None),
])
def test_rewrite_puts_the_answer_in_tags(sample, rewritten):
    assert rewrite_to_tags(sample) == rewritten


def logged(tmp_path, completions, scores, candidates=None):
    log = SamplesLog(tmp_path / "log.jsonl", {"test": 1})
    rows = list(range(len(completions)))
    log.add_completions(rows, completions)
    log.add_scores([{"row": i, "candidates": (candidates or completions)[i], "scores": scores[i]} for i in rows])
    return log


def test_selection_judges_caps_and_removes_duplicates(tmp_path):
    rows = [{"prompt": "p0", "answer": "1"}, {"prompt": "p1", "answer": "2"}, {"prompt": "p2", "answer": "3"}]
    completions = [["a", "a ", "b", "c"], ["x", "y", "z", "w"], ["k", "l", "m", "n"]]
    scores = [{"acc": [1.0, 1.0, 1.0, 1.0], "fmt": [1.0, 1.0, 0.0, 1.0]},
              {"acc": [0.0, 1.0, None, 0.5], "fmt": [1.0, 1.0, 1.0, 1.0]},
              {"acc": [0.0, 0.0, 0.0, 0.0], "fmt": [1.0, 1.0, 1.0, 1.0]}]
    log = logged(tmp_path, completions, scores)
    settings = BootstrapSettings(keep_per_prompt=2)
    kept, counts = select(rows, [log], settings, ["acc"])
    assert [(r["row"], r["completion"]) for r in kept] == [(0, "a"), (0, "b"), (1, "y")]
    assert kept[0] | {} == {"prompt": "p0", "completion": "a", "row": 0, "iteration": 1, "sample": "a",
                            "rewards": {"acc": 1.0, "fmt": 1.0}, "answer": "1"}
    # "a " is "a" again; "c" is over the cap of 2; a None score or one below min_score is not correct
    assert (counts["correct"], counts["duplicates"], counts["over_cap"], counts["kept"]) == (5, 1, 1, 3)
    assert counts["coverage"] == pytest.approx(2 / 3) and counts["kept_rate"] == 3 / 12
    assert counts["kept_per_prompt"] == {"0": 1, "1": 1, "2": 1}
    both, _ = select(rows, [log], settings, ["acc", "fmt"])  # every judge must pass
    assert [(r["row"], r["completion"]) for r in both] == [(0, "a"), (0, "c"), (1, "y")]
    lenient, _ = select(rows, [log], BootstrapSettings(keep_per_prompt=2, min_score=0.5), ["acc"])
    assert [(r["row"], r["completion"]) for r in lenient] == [(0, "a"), (0, "b"), (1, "y"), (1, "w")]


def test_min_agreement_keeps_the_answers_several_samples_give(tmp_path):
    """Self-consistency: a correct sample whose answer fewer than min_agreement of its prompt's samples give (a lucky
    guess) is dropped; the answer is read from the tag, else the last number; a sample without one agrees with none."""
    rows = [{"prompt": "p0", "answer": "12"}, {"prompt": "p1", "answer": "7"}]
    completions = [["so 12", "it is <answer>12</answer>", "maybe 13", "no idea"],
                   ["7 it is", "9", "9 again", "<answer> 9 </answer>"]]
    scores = [{"acc": [1.0, 1.0, 0.0, 0.0]}, {"acc": [1.0, 0.0, 0.0, 0.0]}]
    log = logged(tmp_path, completions, scores)
    kept, counts = select(rows, [log], BootstrapSettings(keep_per_prompt=4, min_agreement=2), ["acc"])
    assert [(r["row"], r["completion"]) for r in kept] == [(0, "so 12"), (0, "it is <answer>12</answer>")]
    assert (counts["correct"], counts["disagreed"], counts["kept"]) == (3, 1, 2)  # "7" was given once: a guess
    assert select(rows, [log], BootstrapSettings(keep_per_prompt=4), ["acc"])[1]["kept"] == 3  # default: no filter
    with pytest.raises(BootstrapError, match="min_agreement must be between 1 and the samples per prompt"):
        BootstrapSettings(samples=4, min_agreement=5)


def test_a_log_of_other_settings_is_refused_and_a_torn_line_dropped(tmp_path):
    log = SamplesLog(tmp_path / "log.jsonl", {"samples": 4})
    log.add_completions([0, 1], [["a"], ["b"]])
    with open(log.path, "a") as handle:
        handle.write('{"row": 2, "compl')  # a crash mid-write
    again = SamplesLog(tmp_path / "log.jsonl", {"samples": 4})
    assert again.completions == {0: ["a"], 1: ["b"]}
    assert log.path.read_text().endswith('"completions": ["b"]}\n')
    with pytest.raises(BootstrapError, match=r"sampled with other settings \(samples: 4 there, 8 now\)"):
        SamplesLog(tmp_path / "log.jsonl", {"samples": 8})


# ---- the command --------------------------------------------------------------------------------------------


def test_bootstrap_writes_rows_with_provenance_and_a_summary(tmp_path, tiny_model_dir, files, capsys):
    data, rewards = files
    out = tmp_path / "cold" / "start.jsonl"
    assert run(tiny_model_dir, data, out, "--reward_funcs", f"{rewards}:has_a", "format") == 0
    said = capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    summary = json.loads((tmp_path / "cold" / "start.summary.json").read_text())
    assert rows and all("a" in r["completion"] and r["rewards"]["has_a"] == 1.0 for r in rows)
    assert all(r["prompt"] == ROWS[r["row"]]["prompt"] and r["answer"] == ROWS[r["row"]]["answer"] for r in rows)
    per_prompt = [sum(r["row"] == i for r in rows) for i in range(4)]
    assert max(per_prompt) <= 2 and summary["samples"] == 24 and summary["judge"] == ["has_a"]
    assert summary["kept"] == len(rows) and summary["coverage"] == sum(n > 0 for n in per_prompt) / 4
    assert f"wrote {len(rows)} rows to {out}" in said and "judged correct by has_a" in said


def test_a_crash_in_a_reward_loses_no_sample_and_the_rerun_goes_on(tmp_path, tiny_model_dir, files, capsys,
                                                                     monkeypatch):
    data, rewards = files
    out = tmp_path / "start.jsonl"
    monkeypatch.setenv("BREAK_REWARD", "1")
    assert run(tiny_model_dir, data, out, "--reward_funcs", f"{rewards}:flaky", "--prompts_per_step", "2") == 2
    assert "flaky" in capsys.readouterr().err  # the function at fault is named
    log = tmp_path / "start.samples-1.jsonl"
    sampled = [json.loads(line) for line in log.read_text().splitlines()[1:]]
    assert [r["row"] for r in sampled] == [0, 1]  # the first batch's completions, kept though never scored
    monkeypatch.delenv("BREAK_REWARD")
    assert run(tiny_model_dir, data, out, "--reward_funcs", f"{rewards}:flaky", "--prompts_per_step", "2") == 0
    lines = [json.loads(line) for line in log.read_text().splitlines()[1:]]
    assert [r["completions"] for r in lines if "completions" in r][:2] == [r["completions"] for r in sampled]
    assert sorted(r["row"] for r in lines if "completions" in r) == [0, 1, 2, 3]  # rows 0 and 1 never sampled again
    assert sorted(r["row"] for r in lines if "scores" in r) == [0, 1, 2, 3]
    # choosing anew (another cap) reuses the samples; sampling otherwise (another K) is refused
    assert run(tiny_model_dir, data, out, "--reward_funcs", f"{rewards}:flaky", "--keep_per_prompt", "1") == 0
    assert log.read_text().count('"completions"') == 4
    assert run(tiny_model_dir, data, out, "--reward_funcs", f"{rewards}:flaky", "--num_generations", "3") == 2
    assert "sampled with other settings (samples: 6 there, 3 now)" in capsys.readouterr().err


def test_bad_input_is_one_clear_line(tmp_path, tiny_model_dir, files, capsys):
    data, rewards = files
    out = str(tmp_path / "out.jsonl")
    no_answer = tmp_path / "no_answer.jsonl"
    no_answer.write_text(json.dumps({"prompt": "What is 1 + 1?"}) + "\n")
    assert run(tiny_model_dir, no_answer, out) == 2
    assert "no_answer.jsonl: line 1 has no column 'answer'" in capsys.readouterr().err
    assert run(tiny_model_dir, data, out, "--reward_funcs", f"{rewards}:has_a", "--judge", "accuracy_reward") == 2
    assert "judge 'accuracy_reward' is not one of the run's reward functions (has_a)" in capsys.readouterr().err
    assert run(tiny_model_dir, data, out, "--reward_funcs", f"{rewards}:missing") == 2
    assert "missing" in capsys.readouterr().err
    demos = tmp_path / "demos.jsonl"
    demos.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
    assert run(tiny_model_dir, data, out, "--few_shot", str(demos)) == 2
    assert "--few_shot" in capsys.readouterr().err


def test_iterations_fine_tune_between_rounds_and_sample_from_the_new_model(tmp_path, tiny_model_dir, files, capsys):
    data, rewards = files
    sft = tmp_path / "sft.yaml"
    sft.write_text(yaml.safe_dump({"max_steps": 2, "batch_size": 4, "learning_rate": 1e-3, "mixed_precision": "no"}))
    out = tmp_path / "start.jsonl"
    assert run(tiny_model_dir, data, out, "--reward_funcs", f"{rewards}:has_a", "--iterations", "2",
               "--sft_config", str(sft), "--rewrite", "tags") == 0
    summary = json.loads((tmp_path / "start.summary.json").read_text())
    model = tmp_path / "start.sft-1" / "model"
    assert [it["model"] for it in summary["iterations"]] == [str(tiny_model_dir), str(model)]
    assert (model / "config.json").is_file() and (tmp_path / "start.samples-2.jsonl").is_file()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["iteration"] for r in rows} <= {1, 2} and summary["kept"] == len(rows)
    assert all(r["completion"].startswith("<think>") and r["completion"].endswith("</answer>") for r in rows)
    assert "iteration 2" in capsys.readouterr().out


ENVIRONMENT = '''
class Hint:
    """Shows a hint at reset; one turn; scores an episode by whether the answer was written."""

    def reset(self, answer, **row):
        self.answer = answer
        return "Hint: the answer is a number."

    def reply(self, turn):
        self.turn = turn
        return None

    def end(self, turn):
        if turn is not None:  # None: reply saw the last turn
            self.turn = turn

    def get_reward(self):
        return float(self.answer in self.turn)
'''


def test_tools_and_environments_sample_and_judge_as_in_training(tmp_path, tiny_model_dir, files):
    """An environment's reset observation reaches the prompt (logged, and kept for SFT), its own reward judges."""
    data, rewards = files
    (tmp_path / "env.py").write_text(ENVIRONMENT)
    out = tmp_path / "out.jsonl"
    assert run(tiny_model_dir, data, out, "--environment_factory", f"{tmp_path / 'env.py'}:Hint", "--tools",
               "calculator", "--reward_funcs", f"{rewards}:has_a", "--judge", "has_a", "--min_score", "0") == 0
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    assert summary["iterations"][0]["samples"] == 6 * len(ROWS)
    scored = [json.loads(line) for line in (tmp_path / "out.samples-1.jsonl").read_text().splitlines()[1:]
              if "scores" in line]
    assert scored and all(set(record["scores"]) == {"has_a", "Hint"} for record in scored)
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert kept and all(row["prompt"].endswith("\n\nHint: the answer is a number.") for row in kept)
