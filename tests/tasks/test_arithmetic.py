"""Reading what the built-in task's completions write in the tens column of a carry problem (the recipe's summary
and benchmarks/sampler_carry.py count these)."""

import pytest

from grpokit.tasks.arithmetic import (
    CARRY_STYLES,
    carry_mistakes,
    prompt_operands,
    prompt_text,
    tens_column,
    worked_solution,
)


def test_prompt_operands_reads_back_the_prompt():
    assert prompt_operands(prompt_text(47, 85)) == (47, 85)
    with pytest.raises(ValueError, match="no a \\+ b"):
        prompt_operands("What is seven plus eight?")


@pytest.mark.parametrize("carry", CARRY_STYLES)
def test_every_worked_solution_of_a_carry_problem_is_right(carry):
    assert tens_column(47, 85, worked_solution(47, 85, carry=carry)) == "right"


@pytest.mark.parametrize("tens, kind", [
    ("4+8=12", "forgot"), ("4+8+0=12", "forgot"),  # the corpus's mistake
    ("4+8+1=12", "added_wrong"), ("4+8=12\n12+1=14", "added_wrong"),  # the carry written, the sum wrong
    ("4+8+1=13", "right"), ("4+8=12\n12+1=13", "right"),
    ("4+7=11", "other"), ("", "other"),  # other digits; no tens line at all
])
def test_the_tens_column_tells_the_mistakes_apart(tens, kind):
    assert tens_column(47, 85, f"<think>\n7+5=12\n{tens}\n</think>\n<answer>1</answer>") == kind


def test_carry_mistakes_counts_carry_problems_in_the_first_and_last_steps():
    records = [{"step": 1, "prompt": "What is 47 + 85?", "completion": worked_solution(47, 85, forget_carry=True)},
               {"step": 2, "prompt": "What is 47 + 85?", "completion": worked_solution(47, 85)},
               {"step": 2, "prompt": "What is 12 + 13?", "completion": "anything"},  # no carry: not counted
               {"step": 9, "prompt": "What is 19 + 19?", "completion": worked_solution(19, 19)}]
    assert carry_mistakes(records, steps=2) == {
        "first": {"forgot": 0.5, "added_wrong": 0.0, "right": 0.5, "other": 0.0},
        "last": {"forgot": 0.0, "added_wrong": 0.0, "right": 1.0, "other": 0.0}}
    assert carry_mistakes(records[2:3], steps=2) == {"first": {}, "last": {}}
