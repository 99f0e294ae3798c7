"""The bad-input battery: each case gets a clear error naming the culprit, or a documented outcome —
never a deep traceback or a silent NaN. (Checkpoint cases: tests/training/test_checkpoint.py.)"""

import json
import time

import pytest
import yaml

from grpokit import GRPOConfig
from grpokit.config import ConfigError, load_config
from grpokit.data import DataError, check_columns, load_csv, load_jsonl, rename_columns
from grpokit.resolve import model_directory
from grpokit.rewards.builtin import accuracy_reward, format_reward
from grpokit.rewards.calling import RewardError, score_completions, score_steps
from grpokit.tasks.arithmetic import arithmetic_steps_reward
from helpers import each_one, make_trainer, ones

# ---- data files ------------------------------------------------------------------------------------

GOOD = '{"prompt": "What is 1 + 1?", "answer": "2"}\n'

DATA_CASES = {
    "missing column": ('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n', r"line 2 has no column 'answer'"),
    # the line an editor shows, blank lines counted: not the row's index (1)
    "after a blank line": ('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b"}\n', r": line 3 has no column 'answer'"),
    "misnamed column": ('{"prompt": "a", "answr": "1"}\n', r"no column 'answer' .*did you mean 'answr'\?"),
    "empty file": ("", r"has no rows"),
    "only blank lines": ("\n\n  \n", r"has no rows"),
    "non-UTF-8": (b'{"prompt": "caf\xe9", "answer": "1"}\n', r"line 1 is not valid UTF-8"),
    "broken JSON": (GOOD + '{"prompt": "a", \n', r"line 2 is not valid JSON"),
    "not an object": (GOOD + "[1, 2]\n", r"line 2 is a JSON list, expected an object"),
    "duplicate ids": ('{"id": 7, "prompt": "a", "answer": "1"}\n{"id": 8, "prompt": "b", "answer": "1"}\n'
                      '{"id": 7, "prompt": "c", "answer": "1"}\n', r"line 1 and line 3 share id 7"),
    "null answer": ('{"prompt": "a", "answer": null}\n', r"line 1 column 'answer' is null"),
    "empty prompt": ('{"prompt": "", "answer": "1"}\n', r"line 1 column 'prompt' must be a non-empty string"),
}


@pytest.mark.parametrize("content, match", DATA_CASES.values(), ids=DATA_CASES.keys())
def test_bad_data_files(tmp_path, content, match):
    path = tmp_path / "train.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DataError, match=match) as error:
        check_columns(load_jsonl(path), ["prompt", "answer"], source=str(path))
    assert str(path) in str(error.value)  # the file is named


def test_a_csv_row_is_named_by_its_line_the_header_and_a_quoted_line_break_counted(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text('prompt,answer\n"two\nlines",1\n,2\n')
    with pytest.raises(DataError, match=r"train.csv: line 4 column 'prompt' must be a non-empty string"):
        check_columns(load_csv(path), ["prompt", "answer"], source=str(path))
    with pytest.raises(DataError, match=r"train.csv: line 2 has no column 'solution'"):
        check_columns(load_csv(path), ["prompt", "solution"], source=str(path))


def test_rows_from_python_are_named_by_index_and_renaming_keeps_the_line(tmp_path):
    with pytest.raises(DataError, match=r"^rows: row 1 has no column 'answer'"):
        check_columns([{"prompt": "a", "answer": "1"}, {"prompt": "b"}], ["prompt", "answer"], source="rows")
    path = tmp_path / "train.jsonl"
    path.write_text('{"q": "a"}\n\n{"q": ""}\n')
    renamed = rename_columns(load_jsonl(path), {"q": "prompt"}, str(path))
    with pytest.raises(DataError, match=r"line 3 column 'prompt' must be a non-empty string"):
        check_columns(renamed, ["prompt"], source=str(path))


def test_a_10_megabyte_line_is_named_by_row(tokenizer, tiny_model, tmp_path):
    rows = [{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": "x" * 10_000_000, "answer": "1"}]
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    match = r"row 1: prompt of 10000000 characters \(at least \d+ tokens\) .* exceeds the model's context of 64"
    with pytest.raises(DataError, match=match):
        make_trainer(tokenizer, tiny_model, tmp_path, rows=load_jsonl(path), reward_funcs=(accuracy_reward,))


def test_extra_columns_reach_the_reward_functions(tokenizer, tiny_model, tmp_path):
    seen = {}

    def uses_difficulty(prompts, completions, difficulty, **kw):
        seen["difficulty"] = set(difficulty)
        return [0.0] * len(completions)

    rows = [{"prompt": f"Q{i}", "answer": "1", "difficulty": i % 3} for i in range(8)]
    make_trainer(tokenizer, tiny_model, tmp_path, rows=rows, reward_funcs=(uses_difficulty,), max_steps=1).train()
    assert seen["difficulty"] <= {0, 1, 2}


# ---- config ----------------------------------------------------------------------------------------

CONFIG_CASES = {
    "unknown key": ({"learning_rat": 1e-4}, r"unknown config key 'learning_rat'.*did you mean 'learning_rate'"),
    "wrong type": ({"max_steps": "many"}, r"max_steps"),
    "out of range": ({"epsilon": -1}, r"epsilon=-1.* must be >= 0"),
    "not a choice": ({"aggregation": "mean"}, r"aggregation='mean' is not valid"),
    "warmup longer than the run": ({"max_steps": 5, "warmup_steps": 5}, r"warmup_steps=5 leaves no step"),
    "ppo with dynamic sampling": ({"algorithm": "ppo", "dynamic_sampling": True}, r"PPO has no groups"),
    "weights for the wrong number of rewards": ({"reward_funcs": ["accuracy", "format"], "reward_weights": [1.0]},
                                                r"reward_weights has 1 values"),
    "more minibatches than completions": ({"num_minibatches": 1000}, r"num_minibatches=1000 exceeds the 128"),
    "a group of one": ({"num_generations": 1}, r"num_generations=1 is out of range"),
}


@pytest.mark.parametrize("values, match", CONFIG_CASES.values(), ids=CONFIG_CASES.keys())
def test_bad_config_values(values, match):
    with pytest.raises(ConfigError, match=match):
        GRPOConfig.from_dict(values)


@pytest.mark.parametrize("text, match", [("- a\n- b\n", r"must hold a mapping"), ("beta: [1,\n", r"line")],
                         ids=["not a mapping", "YAML syntax"])
def test_bad_config_files_name_the_file(tmp_path, text, match):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as error:
        load_config(path)
    assert "run.yaml" in str(error.value)


@pytest.mark.parametrize("name, match", [
    ("model.safetensors", r"model: 'model.safetensors' is a file; give the directory save_pretrained wrote"),
    ("tiny.gguf", r"model: 'tiny.gguf' is a file; .*a llama.cpp GGUF file is 'gguf:tiny.gguf'"),
    ("./missing", r"model: './missing' does not exist \(relative to "),
    ("/no/such/model", r"model: '/no/such/model' does not exist"),
    ("runs/grpo/model", r"model: 'runs/grpo/model' does not exist"),
])
def test_a_model_path_that_is_a_file_or_missing_names_the_model_key(tmp_path, monkeypatch, name, match):
    """Before transformers reads it as a Hub repo id ("Repo id must be in the form ...")."""
    monkeypatch.chdir(tmp_path)
    for file in ("model.safetensors", "tiny.gguf"):
        (tmp_path / file).write_bytes(b"\0")
    with pytest.raises(ConfigError, match=match):
        model_directory(name)


def test_a_hub_id_or_a_directory_is_left_to_from_pretrained(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "model").mkdir(parents=True)
    assert model_directory("owner/name") == "owner/name" and model_directory("gpt2") == "gpt2"
    assert model_directory("runs/model") == "runs/model" and model_directory("./runs/model") == "runs/model"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert model_directory("~/runs/model") == str(tmp_path / "runs" / "model")


# ---- reward functions ------------------------------------------------------------------------------


def wrong_length(prompts, completions, **kw):
    return [1.0]


def gives_text(prompts, completions, **kw):
    return ["1"] * len(completions)


def gives_nan(prompts, completions, **kw):
    return [float("nan")] * len(completions)


def gives_inf(prompts, completions, **kw):
    return [0.0, float("inf")]


def gives_dict(prompts, completions, **kw):
    return {"a": 1.0}


def raises_on_b(prompts, completions, **kw):
    return [1.0 / (c != "b") for c in completions]


def very_slow(prompts, completions, **kw):
    time.sleep(5)
    return [0.0] * len(completions)


def bad_step(prompts, completions, **kw):
    return [[(0, 1.0), ("end", 1.0)]] * len(completions)


REWARD_CASES = {
    "wrong length": (wrong_length, {}, r"'wrong_length' returned 1 values for 2 completions"),
    "text instead of a number": (gives_text, {}, r"'gives_text' returned str '1' for completion 0"),
    "NaN": (gives_nan, {}, r"'gives_nan' returned nan for completion 0 \(prompt 'q', completion 'a'\)"),
    "inf": (gives_inf, {}, r"'gives_inf' returned inf for completion 1 \(prompt 'q', completion 'b'\)"),
    "a dict": (gives_dict, {}, r"'gives_dict' returned dict for 2 completions; expected a list of 2"),
    "an exception": (raises_on_b, {}, r"'raises_on_b' raised ZeroDivisionError: .* on completion 1 "
                                      r"\(prompt 'q', completion 'b'\)"),
    "too slow": (very_slow, {"timeout": 0.2}, r"^reward function 'very_slow' took longer than reward_timeout=0.2 s "
                                              r"on a batch of 2 completions$"),
}


@pytest.mark.parametrize("fn, options, match", REWARD_CASES.values(), ids=REWARD_CASES.keys())
def test_bad_reward_functions(fn, options, match):
    with pytest.raises(RewardError, match=match):
        score_completions([fn], [1.0], ["q", "q"], ["a", "b"], {}, **options)


def never_applies(completions, **kwargs):
    return [None] * len(completions)


def test_rewards_that_all_return_none_on_the_first_step_stop_the_run_naming_them(tokenizer, tiny_model, tmp_path):
    """None is 'not applicable': a run in which no completion has a reward cannot learn, so it stops at step 1."""
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, reward_funcs=(never_applies,), max_steps=3)
    with pytest.raises(RewardError, match=r"step 1: every reward function \(never_applies\) returned None for every "
                                          r"completion.*return a number"):
        trainer.train()


def test_a_reward_that_returns_none_for_a_whole_step_is_named_once(tokenizer, tiny_model, tmp_path, capsys):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, reward_funcs=(format_reward, never_applies), max_steps=2)
    history = trainer.train()
    assert [m["rewards/never_applies"] for m in history] == [None, None]
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert warnings == ["warning: reward function 'never_applies' returned None ('not applicable') for every "
                        "completion of step 1, so it gave the step no signal (said once per function; its metric "
                        "rewards/never_applies is null on such steps)"]


def test_bad_step_is_named():
    with pytest.raises(RewardError, match=r"'bad_step': step 1 of completion 0 is \('end', 1.0\)"):
        score_steps([bad_step], [1.0], ["q", "q"], ["a", "b"], {})


def test_skip_scores_the_failing_completion_none_and_counts_it():
    errors = []
    total, per_fn = score_completions([raises_on_b], [1.0], ["q", "q", "q"], ["a", "b", "c"], {},
                                      on_error="skip", errors=errors)
    assert per_fn["raises_on_b"][[0, 2]].tolist() == [1.0, 1.0] and per_fn["raises_on_b"][1].isnan()
    assert errors == [{"function": "raises_on_b", "completion": 1,
                       "error": "ZeroDivisionError: float division by zero"}]


# ---- hostile model output for the built-in parsers -----------------------------------------------------

ANSWER = "132"
HOSTILE = {
    "nested tags": "<think>x</think><answer><answer>132</answer></answer>",
    "repeated answers": "<think>x</think><answer>131</answer><answer>132</answer>",
    "an expression": "<think>x</think><answer>130+2</answer>",
    "empty answer": "<think>x</think><answer></answer>",
    "A or B": "<think>x</think><answer>132 or 133</answer>",
    "unicode digits": "<think>x</think><answer>١٣٢</answer>",
    "answer outside the tags": "<think>the answer is 132</think> 132",
    "exponent": "<think>x</think><answer>1.32e2</answer>",
    "hex": "<think>x</think><answer>0x84</answer>",
    "a megabyte of text": "<think>" + "7+5=12\n" * 150_000 + "</think><answer>13</answer>",
}


@pytest.mark.parametrize("completion", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_output_earns_no_accuracy(completion):
    assert accuracy_reward(["What is 47 + 85?"], [completion], answer=[ANSWER]) == [0.0]
    steps = arithmetic_steps_reward(["What is 47 + 85?"], [completion])[0]
    assert steps[-1] == (len(completion), 0.0)  # the answer step
    assert sum(reward for _, reward in steps) <= 2  # at most the two real column steps, whatever is repeated


def test_format_reward_refuses_the_structural_hacks():
    hacks = [HOSTILE["nested tags"], HOSTILE["repeated answers"], "<answer>132</answer>",
             "<think>x</think>132", "<think><think>x</think></think><answer>132</answer>"]
    assert format_reward(["q"] * len(hacks), hacks) == [0.0] * len(hacks)


def test_config_file_round_trip_of_every_reliability_key(tmp_path):
    values = {"save_every": 5, "keep_checkpoints": 3, "resume": "latest", "on_reward_error": "skip",
              "reward_timeout": 2.5, "max_nonfinite_updates": 4}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(values))
    config = load_config(path)
    assert {k: getattr(config, k) for k in values} == values


def test_reward_weights_are_checked_against_the_functions_passed(tokenizer, tiny_model, tmp_path):
    # three functions passed in Python, three weights: not checked against the config's default two
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, reward_funcs=(ones, each_one, lambda **kw: [0.0] * 32),
                           reward_weights=[1.0, 2.0, 3.0], max_steps=1)
    assert trainer.reward_weights == [1.0, 2.0, 3.0]
    with pytest.raises(ConfigError, match="reward_weights has 1 values but reward_funcs has 2"):
        make_trainer(tokenizer, tiny_model, tmp_path, reward_funcs=(ones, each_one), reward_weights=[1.0])
