"""The math task for real models: a GSM8K-style loader and an accuracy reward that uses math-verify
when installed and the strict parser otherwise."""

import builtins
from pathlib import Path

import pytest

from grpokit.data import DataError, load_gsm8k
from grpokit.rewards.builtin import math_accuracy_reward

SAMPLE = Path(__file__).parent / "data" / "gsm8k_sample.jsonl"


def test_gsm8k_rows():
    rows = load_gsm8k(SAMPLE)
    assert [row["answer"] for row in rows] == ["72", "10", "5000", "1/4"]  # thousands separators dropped
    assert rows[0]["prompt"].startswith("Natalia sold clips") and rows[0]["solution"].endswith("April and May.")


@pytest.mark.parametrize("line, match", [('{"question": "q", "answer": "no marker"}', r"row 0 answer has no '#### "),
                                          ('{"question": "q"}', r"row 0 needs a text column 'answer'")])
def test_gsm8k_errors_name_the_row(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(DataError, match=match):
        load_gsm8k(path)


CASES = [
    ("<answer>72</answer>", "72", 1.0),
    ("<answer>5,000</answer>", "5000", 1.0),
    ("<answer>71</answer>", "72", 0.0),
    ("<answer></answer>", "72", 0.0),
    ("72", "72", 0.0),  # outside the tags
    ("<answer>\\frac{1}{4}</answer>", "1/4", 1.0),  # needs math-verify
    ("<answer>0.25</answer>", "1/4", 1.0),  # needs math-verify
    ("<answer>\\boxed{72}</answer>", "72", 1.0),  # needs math-verify
    ("<answer>__import__('os').system('x')</answer>", "72", 0.0),
]


@pytest.mark.parametrize("completion, reference, expected", CASES)
def test_math_accuracy_with_math_verify(completion, reference, expected):
    pytest.importorskip("math_verify")
    assert math_accuracy_reward(["q"], [completion], answer=[reference]) == [expected]


@pytest.mark.parametrize("completion, reference, expected", CASES)
def test_math_accuracy_falls_back_to_the_strict_parser(monkeypatch, completion, reference, expected):
    real_import = builtins.__import__

    def no_math_verify(name, *args, **kwargs):
        if name.startswith("math_verify"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_math_verify)
    strict = expected if "\\" not in completion and reference != "1/4" else 0.0  # only plain numbers score
    assert math_accuracy_reward(["q"], [completion], answer=[reference]) == [strict]


def test_gsm8k_dataset_through_the_trainer(tokenizer, tiny_model, tmp_path):
    from grpokit import GRPOConfig, GRPOTrainer

    config = GRPOConfig(dataset=f"gsm8k:{SAMPLE}", reward_funcs=["math_accuracy", "format"], prompts_per_step=2,
                        num_generations=2, max_completion_length=4, max_steps=1, output_dir=str(tmp_path / "run"),
                        progress_bar=False)
    tiny_model.config.max_position_embeddings = 512  # the sample's questions are longer than the tiny context
    trainer = GRPOTrainer(config, model=tiny_model, tokenizer=tokenizer)
    assert len(trainer.sampler.rows) == 4 and trainer.sampler.rows[0]["answer"] == "72"


def test_a_reference_that_is_no_number_is_read_as_latex():
    """A plain reference such as ``x+1`` is read inside $…$: parsed bare, math-verify's expression reader finds
    nothing in it (and ``3x`` would be read as 3)."""
    pytest.importorskip("math_verify")
    assert math_accuracy_reward(["q"] * 2, ["<answer>x+1</answer>", "<answer>3x</answer>"], answer=["x+1", "3x"]) \
        == [1.0, 1.0]
