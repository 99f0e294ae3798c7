"""Reading answers and scoring them, at the boundaries: numbers of either sign and zero, each answer-extraction
method on what models write and on hostile text, the rule rewards on both sides of each tolerance, and the checks
reward values pass (offsets from both ends, NaN and infinities, the message's cut). Expected values by hand."""

import math
import re
from decimal import Decimal

import pytest
import torch

from grpokit.core.answers import answers_match, extract_answer, extract_by, last_number, parse_number, text_of
from grpokit.rewards.builtin import accuracy_reward, format_reward, lenient_accuracy_reward, math_accuracy_reward
from grpokit.rewards.calling import RewardError, _short, score_completions, score_steps


@pytest.mark.parametrize("text, expected", [
    ("0", "0"), ("-0", "0"), ("+0", "0"), ("-5", "-5"), ("+5", "5"), ("-.5", "-0.5"), (".5", "0.5"),
    ("-0.50", "-0.50"), ("1,234", "1234"), ("-1,234", "-1234"), ("-1,234.5", "-1234.5"), ("12,345,678", "12345678"),
    ("1,2345", None), ("1,23", None), (",123", None), ("1,,234", None), ("1234,567", None), ("--5", None),
    ("+-5", None), ("5-", None), ("- 5", None), ("5.", None), (".", None), ("", None), ("   ", None), ("1e3", None),
    ("nan", None), ("inf", None), ("-inf", None), ("0x10", None), ("١", None), ("1_000", None), (" -7 ", "-7"),
])
def test_parse_number_of_either_sign(text, expected):
    assert parse_number(text) == (None if expected is None else Decimal(expected))


@pytest.mark.parametrize("predicted, reference, expected", [
    ("-5", -5, True), ("-5", 5, False), ("5", -5, False), ("-5", "-5.0", True), ("-0", 0, True), ("0", "-0", True),
    ("+3", 3, True), ("-3", "+3", False), ("0.1", 0.1, True), ("-0.1", 0.1, False), ("1,000", 1000, True),
    ("-1,000", -1000, True), ("-1,000", 1000, False), ("1000", "1,000", True), (" 42 ", 42, True),
    ("42", 42.5, False), ("abc", "abc", True), ("a  b", " a b ", True), ("", "", False), ("  ", "", False),
    ("x", "X", False), ("5", "five", False), ("five", "5", False),
])
def test_answers_match_numbers_by_value_and_sign(predicted, reference, expected):
    assert answers_match(predicted, reference) is expected


@pytest.mark.parametrize("text, expected", [
    ("the answer is -12", "-12"), ("from -3 to 4", "4"), ("it is 4 or -3", "-3"), ("x-1", "-1"),
    ("1,234,567", "1,234,567"), ("1,2345", "5"),  # "1,234" then "5": thousands separators are tried first
    ("total: -1,024.5!", "-1,024.5"), ("v1.2.3", ".3"), ("no digits", None), ("", None),
    ("12abc34", "34"), ("-.5", "-.5"), ("3.", "3"),
])
def test_the_last_number_keeps_its_sign(text, expected):
    found = last_number(text)
    assert (found.group() if found else None) == expected


@pytest.mark.parametrize("completion, expected", [
    ("<answer>-3</answer>", "-3"), ("<answer></answer>", ""), ("<answer>a\nb</answer>", "a\nb"),
    ("<answer>1</answer><answer>2</answer>", None), ("<answer>1</answer> <answer>", None), ("<answer>1", None),
    ("1</answer>", None), ("<answer><answer>1</answer>", None), ("<ANSWER>1</ANSWER>", None), ("", None),
])
def test_extract_answer_reads_only_a_single_tag(completion, expected):
    assert extract_answer(completion) == expected


@pytest.mark.parametrize("completion, method, expected", [
    ("\\boxed{-3}", "boxed", "-3"), ("\\boxed{1} then \\boxed{2}", "boxed", "2"), ("\\boxed{a{b}c}", "boxed", "a{b}c"),
    ("\\boxed{1} then \\boxed{2", "boxed", "1"), ("\\boxed{1} \\boxed{2} \\boxed{3", "boxed", "2"),
    ("\\boxed{}", "boxed", None), ("\\boxed{ }", "boxed", None),
    ("\\boxed{{}", "boxed", None), ("\\boxed{x}}", "boxed", "x"), ("no box", "boxed", None),
    ("\\boxed{\\frac{1}{2}}", "boxed", "\\frac{1}{2}"), ("\\boxed {1}", "boxed", None),
    ("a\nb\n  \n", "last_line", "b"), ("a\n  c  \n\n", "last_line", "c"), ("\n\n", "last_line", None),
    ("only", "last_line", "only"), ("x = -4", "last_number", "-4"), ("none", "last_number", None),
    ("  text \n", "whole", "text"), ("", "whole", None), ("<answer> 7 </answer>", "tag", "7"),
    ("<answer> </answer>", "tag", None), ("7", "tag", None),
])
def test_extract_by_each_method(completion, method, expected):
    assert extract_by(completion, method) == expected


def test_extract_by_refuses_an_unknown_method():
    with pytest.raises(ValueError, match="^answer_extraction='last' is not one of 'tag', 'boxed', 'last_line', "
                                         "'last_number', 'whole'$"):
        extract_by("x", "last")


def test_text_of_reads_the_last_message():
    assert text_of("t") == "t" and text_of([]) == ""
    assert text_of([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]) == "b"


# ---- the rule rewards -------------------------------------------------------------------------------------


@pytest.mark.parametrize("answer, reference, expected", [
    ("-3", -3, 1.0), ("-3", 3, 0.0), ("3", -3, 0.0), ("-0", 0, 1.0), ("-1,000", "-1000", 1.0), ("-1,000", 1000, 0.0),
    ("-2.50", -2.5, 1.0), ("-2.5", 2.5, 0.0),
])
def test_each_rule_reward_tells_the_sign(answer, reference, expected):
    completion = f"<think>t</think><answer>{answer}</answer>"
    for reward in (accuracy_reward, lenient_accuracy_reward, math_accuracy_reward):
        assert reward(["q"], [completion], answer=[reference]) == [expected], reward.__name__
    assert lenient_accuracy_reward(["q"], [f"so the result is {answer}."], answer=[reference]) == [expected]


def test_the_rule_rewards_read_chat_completions_and_score_each_row_against_its_own_answer():
    chat = [[{"role": "assistant", "content": "<answer>1</answer>"}], [{"role": "assistant", "content": "<answer>2"
                                                                                                        "</answer>"}]]
    assert accuracy_reward(["q", "q"], chat, answer=[1, 1]) == [1.0, 0.0]
    assert accuracy_reward(["q", "q"], chat, answer=[2, 2]) == [0.0, 1.0]
    assert lenient_accuracy_reward(["q", "q"], ["is 1", "is 2"], answer=[2, 1]) == [0.0, 0.0]
    assert math_accuracy_reward(["q", "q"], ["<answer> </answer>", "<answer>2</answer>"], answer=["", 2]) == [0.0, 1.0]


def test_math_accuracy_without_math_verify_scores_only_plain_numbers(monkeypatch):
    import builtins

    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name == "math_verify" else real_import(name, *a, **k))
    assert math_accuracy_reward(["q"] * 3, ["<answer>-4</answer>", "<answer>\\frac{1}{2}</answer>",
                                            "<answer>x</answer>"], answer=[-4, "0.5", "x"]) == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("completion, expected", [
    ("<think>a</think><answer>b</answer>", 1.0), ("\n<think>a</think>\n\n<answer>b</answer>\n", 1.0),
    ("<think>a\nb</think><answer>c\nd</answer>", 1.0), ("<think>a</think>x<answer>b</answer>", 0.0),
    ("<think>a</think><answer>b</answer>.", 0.0), ("<think>a</think><answer>b</answer></answer>", 0.0),
    ("<think>a</think></think><answer>b</answer>", 0.0), ("<think>a</think><answer>b<think></answer>", 0.0),
    ("<think>a<answer></think><answer>b</answer>", 0.0),
])
def test_the_format_reward_on_both_sides_of_its_shape(completion, expected):
    assert format_reward(["q"], [completion]) == [expected]


# ---- the checks on what reward functions return --------------------------------------------------------------


def returning(*values):
    def reward(completions, **kwargs):
        return list(values)
    return reward


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, float("-nan"), 1e39, -1e39])
def test_a_reward_that_is_not_finite_is_refused_of_either_sign(value):
    with pytest.raises(RewardError, match=re.escape(f"reward function 'reward' returned {value} for completion 0 (")):
        score_completions([returning(value)], [1.0], ["q"], ["c"], {})
    with pytest.raises(RewardError, match=re.escape(f"reward function 'reward' returned {value} for completion 0, "
                                                    "step 0 (prompt 'q', completion 'c')")):
        score_steps([returning([(1, value)])], [1.0], ["q"], ["c"], {})


@pytest.mark.parametrize("value, expected", [(-2.5, -2.5), (0, 0.0), (-0.0, 0.0), (True, 1.0), (3e38, 3e38),
                                             (-3e38, -3e38)])
def test_finite_rewards_of_either_sign_are_kept(value, expected):
    total, per_function = score_completions([returning(value)], [2.0], ["q"], ["c"], {})
    assert per_function["reward"].tolist() == [torch.tensor(expected).item()]
    assert total.tolist() == [torch.tensor(expected).mul(2).item()]


@pytest.mark.parametrize("offset, allowed", [(-1, False), (0, True), (1, True), (3, True), (4, False)])
def test_a_step_offset_lies_within_the_completion_from_both_ends(offset, allowed):
    reward = returning([(offset, 0.5)])
    if allowed:
        total, _, steps = score_steps([reward], [2.0], ["q"], ["abc"], {})
        assert steps == [[(offset, 1.0)]] and total.tolist() == [1.0]
    else:
        with pytest.raises(RewardError, match=f"ends at character {offset}, outside the completion's \\[0, 3\\]$"):
            score_steps([reward], [2.0], ["q"], ["abc"], {})


def test_steps_at_one_offset_add_up_and_per_function_is_their_mean():
    process, outcome = returning([(1, 0.5), (3, -1.5)]), returning(-2.0)
    total, per_function, steps = score_steps([process, outcome], [2.0, 0.5], ["q"], ["abc"], {})
    assert steps == [[(1, 1.0), (3, -3.0 - 1.0)]]
    assert per_function["reward"].tolist() == [-2.0]  # (both named 'reward': the last one's)
    assert total.tolist() == [2.0 * -0.5 + 0.5 * -2.0]
    total, per_function, steps = score_steps([returning([])], [1.0], ["q"], ["abc"], {})
    assert steps == [[]] and math.isnan(per_function["reward"][0]) and total.tolist() == [0.0]


@pytest.mark.parametrize("pair", [(1.0, 0.5), (True, 0.5), [1], (1, 0.5, 2), "ab"])
def test_a_step_that_is_not_an_integer_offset_and_a_reward_is_refused(pair):
    if pair[0] is True:  # a bool is an Integral: offset 1
        assert score_steps([returning([pair])], [1.0], ["q"], ["abc"], {})[2] == [[(1, 0.5)]]
        return
    with pytest.raises(RewardError, match="expected a pair \\(character offset where the step ends, reward\\)$"):
        score_steps([returning([pair])], [1.0], ["q"], ["abc"], {})


def test_a_reward_that_is_not_a_number_names_its_type():
    with pytest.raises(RewardError, match="^reward function 'reward' returned str '1' for completion 0; expected a "
                                          "float or None$"):
        score_completions([returning("1")], [1.0], ["q"], ["c"], {})


def test_no_function_applying_scores_zero_and_nan_per_function():
    total, per_function = score_completions([returning(None, 1.0)], [3.0], ["q", "q"], ["a", "b"], {})
    assert total.tolist() == [0.0, 3.0] and math.isnan(per_function["reward"][0])
    assert torch.equal(per_function["reward"][1:], torch.tensor([1.0]))


@pytest.mark.parametrize("length, shown", [(0, "''"), (120, repr("x" * 120)), (121, repr("x" * 120) + "… (121 "
                                                                                              "characters)")])
def test_a_long_text_in_a_message_keeps_its_first_120_characters(length, shown):
    assert _short("x" * length) == shown
    assert _short("ab" * 100, limit=3) == "'aba'… (200 characters)"


def test_a_failing_completion_is_named_by_the_start_of_its_text():
    def fails(completions, **kwargs):
        if any(c.startswith("bad") for c in completions):
            raise ValueError("no")
        return [1.0] * len(completions)

    long = "bad" + "x" * 200
    with pytest.raises(RewardError, match=f"on completion 1 \\(prompt 'p', completion '{long[:120]}'… \\(203 "
                                          "characters\\)\\)$"):
        score_completions([fails], [1.0], ["p", "p"], ["good", long], {})


def test_outcome_scoring_refuses_step_lists_and_weights_of_either_sign_count():
    with pytest.raises(RewardError, match="^reward function 'reward' returned step rewards \\(a list\\) for completion "
                                          "1: it is a process reward; set supervision: process to use it$"):
        score_completions([returning(1.0, [(1, 1.0)])], [1.0], ["q", "q"], ["a", "b"], {})
    total, _ = score_completions([returning(2.0, -1.0), returning(None, 4.0)], [-0.5, 0.0], ["q", "q"], ["a", "b"], {})
    assert total.tolist() == [-1.0, 0.5]
    total, per_function, steps = score_steps([returning([(1, -1.0), (2, 3.0)], -2.0)], [-2.0], ["q", "q"], ["ab", "cd"],
                                             {})
    assert steps == [[(1, 2.0), (2, -6.0)], [(2, 4.0)]] and per_function["reward"].tolist() == [1.0, -2.0]
    assert total.tolist() == [-2.0, 4.0]


def test_chat_prompts_get_the_completion_as_the_assistants_message_or_the_tools_messages():
    seen = []

    def reward(prompts, completions, **kwargs):
        seen.append(completions)
        return [1.0] * len(completions)

    chat = [{"role": "user", "content": "q"}]
    score_completions([reward], [1.0], [chat, "plain"], ["a", "b"], {})
    assert seen[-1] == [[{"role": "assistant", "content": "a"}], "b"]
    tools = [[{"role": "assistant", "content": "a1"}, {"role": "tool", "content": "r"}], [{"role": "x"}]]
    score_completions([reward], [1.0], [chat, "plain"], ["a", "b"], {}, messages=tools)
    assert seen[-1] == [tools[0], "b"]


def test_math_accuracy_never_hands_model_output_to_sympys_parse_expr(monkeypatch):
    """math-verify's plain-expression reader runs sympy's parse_expr, an eval: the model's answer is read as LaTeX
    only (its reference, the dataset's, may be read either way)."""
    parser = pytest.importorskip("math_verify.parser")
    evaluated = []
    real = parser.parse_expr
    monkeypatch.setattr(parser, "parse_expr", lambda text, **kw: evaluated.append(text) or real(text, **kw))
    assert math_accuracy_reward(["q"], ["<answer>y = 2**3 + 0*17</answer>"], answer=["8"]) == [0.0]
    assert evaluated == []
    from math_verify import parse

    assert parse("$y = 2**3 + 0*19$") and evaluated  # (the default reader would have evaluated it)


def test_math_accuracy_reads_a_latex_symbol_answer():
    pytest.importorskip("math_verify")
    assert math_accuracy_reward(["q"] * 2, ["<answer>X</answer>", "<answer>$X$</answer>"], answer=["X", "X"]) == [1.0,
                                                                                                                1.0]


def test_process_scoring_passes_ids_state_messages_and_options_on():
    from grpokit.rewards.calling import TrainerState

    seen = {}

    def process(prompts, completions, completion_ids, trainer_state, **kwargs):
        seen.update(completions=completions, ids=completion_ids, step=trainer_state.global_step)
        return [[(1, 0.5)]]

    chat = [{"role": "user", "content": "q"}]
    messages = [[{"role": "assistant", "content": "a"}, {"role": "tool", "content": "r"}]]
    score_steps([process], [1.0], [chat], ["ab"], {}, completion_ids=[[7, 8]], trainer_state=TrainerState(3),
                messages=messages)
    assert seen == {"completions": messages, "ids": [[7, 8]], "step": 3}

    def fails(completions, **kwargs):
        raise ValueError("no")

    errors = []
    total, per_function, steps = score_steps([fails], [1.0], ["q"], ["c"], {}, on_error="skip", errors=errors)
    assert steps == [[]] and math.isnan(per_function["fails"][0]) and errors == [
        {"function": "fails", "completion": 0, "error": "ValueError: no"}]


def test_the_largest_float32_reward_is_kept_of_either_sign():
    from grpokit.rewards.calling import FLOAT32_MAX

    for value in (FLOAT32_MAX, -FLOAT32_MAX):
        assert score_completions([returning(value)], [1.0], ["q"], ["c"], {})[1]["reward"].tolist() == [value]


def test_a_reward_timeout_bounds_the_call_in_a_thread_named_after_the_reward():
    import threading
    import time

    names = []

    def named(completions, **kwargs):
        names.append(threading.current_thread().name)
        return [1.0]

    score_completions([named], [1.0], ["q"], ["c"], {}, timeout=30)
    assert names == ["reward named"]

    def slow(completions, **kwargs):
        time.sleep(1)
        return [1.0]

    with pytest.raises(RewardError, match="^reward function 'slow' took longer than reward_timeout=0.05 s on a batch "
                                          "of 1 completions$"):
        score_completions([slow], [1.0], ["q"], ["c"], {}, timeout=0.05)


def test_every_function_is_checked_past_one_without_a_signature_or_with_defaults():
    from grpokit.rewards.calling import check_reward_functions

    def defaults_first(prompts, completions, *, level=1, missing):
        return []

    for functions in ([max, defaults_first], [defaults_first]):  # max: a builtin without a signature
        with pytest.raises(ValueError, match="^reward function 'defaults_first' needs 'missing', which is neither"):
            check_reward_functions(functions, ["answer"], "d")

    def by_position(prompts, /, completions):
        return []

    with pytest.raises(ValueError) as caught:
        check_reward_functions([by_position], [], "d")
    assert str(caught.value) == ("reward function 'by_position' takes 'prompts' by position only; reward functions are "
                                 "called by keyword (prompts, completions, completion_ids, trainer_state, log_extra, "
                                 "log_metric, and each column by name), as in TRL")


def test_a_failing_batch_is_retried_one_completion_at_a_time_under_the_same_timeout():
    import threading
    import time

    names = []

    def picky(completions, **kwargs):
        names.append(threading.current_thread().name)
        if len(completions) > 1:
            raise ValueError("batch")
        if completions[0] == "bad":
            raise KeyError("k")
        if completions[0] == "slow":
            time.sleep(1)
        return [1.0]

    errors = []
    _, per_function = score_completions([picky], [1.0], ["q"] * 3, ["bad", "ok", "ok"], {}, on_error="skip",
                                        errors=errors, timeout=30)
    assert per_function["picky"][1:].tolist() == [1.0, 1.0] and math.isnan(per_function["picky"][0])
    assert errors == [{"function": "picky", "completion": 0, "error": "KeyError: 'k'"}]
    assert names == ["reward picky"] * 4
    with pytest.raises(RewardError, match="^reward function 'picky' took longer than reward_timeout=0.05 s on "
                                          "completion 1$"):
        score_completions([picky], [1.0], ["q"] * 2, ["ok", "slow"], {}, on_error="skip", timeout=0.05)


def test_a_reward_gets_trainer_state_only_when_there_is_one():
    seen = []

    def anything(completions, **kwargs):
        seen.append(sorted(kwargs))
        return [1.0]

    score_completions([anything], [1.0], ["q"], ["c"], {"answer": ["1"]})
    assert seen == [["answer", "log_extra", "log_metric", "prompts"]]  # TRL's logging hooks always
