"""Built-in rewards (including the known hacks) and how reward functions are called and combined."""

import math

import pytest

from grpokit.resolve import resolve_reward_functions
from grpokit.rewards.builtin import accuracy_reward, format_reward, lenient_accuracy_reward
from grpokit.rewards.calling import RewardError, score_completions

GOOD = "<think>\n7+5=12\n4+8+1=13\n</think>\n<answer>132</answer>"


@pytest.mark.parametrize(
    "completion, expected",
    [
        (GOOD, 1.0),
        ("  <think>x</think> <answer>1</answer>\n", 1.0),
        ("<think></think><answer></answer>", 1.0),  # shape only; the empty answer scores 0 on accuracy
        ("<answer>132</answer>", 0.0),
        ("<think>x</think>", 0.0),
        ("<think>x</think><answer>1</answer> trailing text", 0.0),
        ("preamble <think>x</think><answer>1</answer>", 0.0),
        ("<think>x</think><answer>1</answer><answer>2</answer>", 0.0),
        ("<think><think>x</think></think><answer>1</answer>", 0.0),
        ("<think>x<answer>1</answer></think><answer>1</answer>", 0.0),
        ("<answer>1</answer><think>x</think>", 0.0),
        ("", 0.0),
    ],
)
def test_format_reward(completion, expected):
    assert format_reward(["q"], [completion]) == [expected]


@pytest.mark.parametrize(
    "answer_text, reference, expected",
    [
        ("132", "132", 1.0),
        (" 132 ", 132, 1.0),
        ("+132", "132", 1.0),
        ("0132", "132", 1.0),
        ("132.0", "132", 1.0),
        ("1,320", "1320", 1.0),
        ("-5", "-5", 1.0),
        ("131", "132", 0.0),
        ("", "0", 0.0),  # empty answer
        ("   ", "0", 0.0),
        ("130+2", "132", 0.0),  # an expression is never evaluated
        ("131 or 132", "132", 0.0),
        ("١٣٢", "132", 0.0),  # non-ASCII digits are not numbers here
        ("13,20", "1320", 0.0),  # malformed thousands separator
        ("Paris", "paris", 0.0),
        ("New  York", "New York", 1.0),  # text answers compare with whitespace collapsed
    ],
)
def test_accuracy_reward_tolerances(answer_text, reference, expected):
    completion = f"<think>x</think><answer>{answer_text}</answer>"
    assert accuracy_reward(["q"], [completion], answer=[reference]) == [expected]


@pytest.mark.parametrize(
    "completion",
    [
        "The answer is 132",  # outside the tags
        "<answer></answer>",  # empty
        "<answer>131</answer><answer>132</answer>",  # several answers
        "<answer>132</answer><answer>132</answer>",
        "<answer><answer>132</answer></answer>",  # nested
        "<answer>132",  # unclosed
    ],
)
def test_accuracy_reward_is_not_fooled(completion):
    assert accuracy_reward(["q"], [completion], answer=["132"]) == [0.0]


@pytest.mark.parametrize("completion, expected", [
    ("So 47 + 85 = 132.", 1.0),  # prose: its last number
    ("It is 1,320? No: 132", 1.0),
    ("132, or rather 131", 0.0),  # the last number is the answer given
    ("<think>132</think><answer>131</answer>", 0.0),  # a tagged answer is read as the strict reward reads it
    ("<answer>132</answer> and 7 more", 1.0),
    ("<answer>1</answer><answer>132</answer>", 1.0),  # no single tag: the last number
    ("no number", 0.0),
    ("132abc", 1.0),
])
def test_lenient_accuracy_reads_the_last_number_without_an_answer_tag(completion, expected):
    assert lenient_accuracy_reward(["q"], [completion], answer=["132"]) == [expected]
    if expected == 0.0:
        assert accuracy_reward(["q"], [completion], answer=["132"]) == [0.0]  # strict never accepts more


def test_accuracy_reward_survives_a_megabyte_of_text():
    assert accuracy_reward(["q"], ["9" * 1_000_000], answer=["9"]) == [0.0]
    assert format_reward(["q"], ["<think>" + "x" * 1_000_000]) == [0.0]


def length_penalty(prompts, completions, **kw):
    return [-len(c) / 100 for c in completions]


def sometimes(prompts, completions, **kw):
    return [None, 1.0]


def test_score_completions_weights_and_none():
    total, per_fn = score_completions(
        [accuracy_reward, length_penalty, sometimes], [2.0, 1.0, 0.5], ["q", "q"],
        ["<answer>3</answer>", "<answer>4</answer>"], {"answer": ["3", "3"]},
    )
    # completion 0: 2·1 − 0.18 + (None → not applied); completion 1: 2·0 − 0.18 + 0.5·1
    assert total.tolist() == pytest.approx([2 - 0.18, -0.18 + 0.5])
    assert math.isnan(per_fn["sometimes"][0]) and per_fn["sometimes"][1] == 1.0
    assert list(per_fn) == ["accuracy_reward", "length_penalty", "sometimes"]


def test_numpy_and_bool_rewards_are_numbers():
    np = pytest.importorskip("numpy")
    total, _ = score_completions([lambda completions, **k: [np.float32(0.5), True]], [1.0], ["q", "q"], ["a", "b"], {})
    assert total.tolist() == [0.5, 1.0]


def raises(prompts, completions, **kw):
    raise KeyError("boom")


def too_few(prompts, completions, **kw):
    return [1.0]


def gives_nan(prompts, completions, **kw):
    return [1.0, float("nan")]


def gives_inf(prompts, completions, **kw):
    return [float("inf"), 1.0]


def gives_text(prompts, completions, **kw):
    return ["1", 1.0]


def gives_scalar(prompts, completions, **kw):
    return 1.0


@pytest.mark.parametrize(
    "fn, match",
    [
        (raises, r"reward function 'raises' raised KeyError: 'boom' on completion 0 \(prompt 'q0', completion 'c0'\)"),
        (too_few, r"reward function 'too_few' returned 1 values for 2 completions"),
        (gives_nan, r"reward function 'gives_nan' returned nan for completion 1 \(prompt 'q1', completion 'c1'\)"),
        (gives_inf, r"reward function 'gives_inf' returned inf for completion 0"),
        (gives_text, r"reward function 'gives_text' returned str '1' for completion 0"),
        (gives_scalar, r"reward function 'gives_scalar' returned float for 2 completions"),
    ],
)
def test_bad_reward_functions_are_named(fn, match):
    with pytest.raises(RewardError, match=match):
        score_completions([fn], [1.0], ["q0", "q1"], ["c0", "c1"], {})


def test_unknown_reward_name():
    with pytest.raises(ValueError, match="unknown reward 'acuracy'"):
        resolve_reward_functions(["acuracy"])


def test_the_reward_examples_in_the_docs_run():
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "data_and_rewards.md").read_text()
    namespace: dict = {}
    exec(doc.split("```python\n")[1].split("```")[0], namespace)
    total, per_fn = score_completions(
        [namespace["length_penalty"], namespace["answer_in_units"]], [1.0, 1.0], ["q"] * 3,
        ["x" * 100, "x" * 600, "it is 5 kg"], {"answer": ["5"] * 3, "unit": ["kg"] * 3},
    )
    assert per_fn["length_penalty"].tolist() == [0.0, -0.5, 0.0]
    assert per_fn["answer_in_units"].tolist() == [0.0, 0.0, 1.0]
