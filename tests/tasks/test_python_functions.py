"""The generated programming problems: every reference solution passes its own tests in the sandbox, the prompt
shows the first two tests, and the held-out split is fixed and disjoint from training."""

from grpokit.rewards.code import CodeTests
from grpokit.sandbox import Limits
from grpokit.tasks.python_functions import FAMILIES, TESTS_PER_PROBLEM, held_out_problems, problems, train_problems
from helpers import sandbox_or_skip


def test_every_reference_solution_passes_its_tests_and_a_wrong_one_does_not():
    sandbox_or_skip("bwrap", Limits())
    every = problems()
    judge = CodeTests(binary=True)
    assert judge([p.solution for p in every], tests=[list(p.tests) for p in every]) == [1.0] * len(every)
    # the tests tell the constant apart: the solution of the same family at another constant fails
    for family in FAMILIES:
        same = [p for p in every if p.family == family.name]
        for p, other in zip(same, same[1:]):
            wrong = other.solution.replace(f"def {family.name.replace('{k}', str(other.constant))}(",
                                           f"def {family.name.replace('{k}', str(p.constant))}(")
            assert judge([wrong], tests=[list(p.tests)]) == [0.0], (p.family, p.constant, other.constant)


def test_a_problem_shows_its_first_two_tests_as_examples():
    for p in problems():
        assert len(set(p.tests)) == TESTS_PER_PROBLEM
        for test in p.tests[:2]:
            call, expected = test.removeprefix("assert ").split(" == ")
            assert f">>> {call}\n{expected}" in p.prompt
        assert p.row() == {"prompt": p.prompt, "tests": list(p.tests), "family": p.family}


def test_the_held_out_split_is_fixed_and_disjoint():
    train, held_out = train_problems(), held_out_problems()
    assert (len(train), len(held_out)) == (210, 76)  # a change here changes every published result
    assert {p.prompt for p in train}.isdisjoint({p.prompt for p in held_out})
    assert sorted(p.prompt for p in train + held_out) == sorted(p.prompt for p in problems())
    assert [p.prompt for p in held_out_problems()] == [p.prompt for p in held_out]  # the same every time
