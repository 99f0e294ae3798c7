"""The code_tests reward at its boundaries, on a stand-in sandbox that answers each run as told (what the real sandbox
does is test_code.py's): the score from no test passed to all, binary and as a fraction; which runs count; the
counts; where a program is found in what models write and in hostile text; the tests' forms and their refusals
(their messages keep the start of the value); the harness's marks; output comparison."""

import json
import time

import pytest

from grpokit.rewards.code import (
    AssertTests,
    CodeTestCounts,
    CodeTests,
    StdioTests,
    assistant_text,
    code_counts,
    extract_program,
    make_code_tests,
    parse_tests,
    passed_asserts,
    same_output,
)
from grpokit.sandbox import Result


def ran(stdout="", exit_code=0, timed_out=False, error=None):
    return Result(stdout, "", exit_code, timed_out, error, 0.25, False)


class StandIn:
    """A sandbox answering run_many with ``answer(code, stdin)`` for each job, recording the jobs."""

    def __init__(self, answer):
        self.answer, self.jobs = answer, []

    def run_many(self, jobs):
        self.jobs += jobs
        return [self.answer(*job) for job in jobs]


def reward_on(answer, binary=False):
    reward = CodeTests(binary=binary)
    reward._sandbox = StandIn(answer)
    return reward


def marks(passed: list[int], failed: list[int], ran_first=True):
    """The harness's stdout for tests ``passed`` and ``failed``, with the nonce it is given on stdin."""
    def answer(code, stdin):
        nonce = stdin.strip()
        lines = [f"{nonce} RAN"] * ran_first + [f"{nonce} PASS {i}" for i in passed] + \
            [f"{nonce} FAIL {i}" for i in failed] + [f"{nonce} END"]
        return ran("\n" + "\n".join(lines) + "\n")
    return answer


PROGRAM = "```python\ndef f(x):\n    return x\n```"
THREE = ["assert f(1) == 1", "assert f(-1) == -1", "assert f(0) == 0"]


@pytest.mark.parametrize("passed, fraction, binary", [
    ([], 0.0, 0.0), ([0], 1 / 3, 0.0), ([0, 2], 2 / 3, 0.0), ([0, 1, 2], 1.0, 1.0),
])
def test_the_score_from_none_passed_to_all(passed, fraction, binary):
    answer = marks(passed, [i for i in range(3) if i not in passed])
    assert reward_on(answer)(completions=[PROGRAM], tests=[THREE]) == [pytest.approx(fraction)]
    assert reward_on(answer, binary=True)(completions=[PROGRAM], tests=[THREE]) == [binary]


def test_marks_before_the_program_ran_or_with_another_nonce_do_not_count():
    assert passed_asserts("n PASS 0\nn RAN\nn PASS 1\n", "n", 2) == 1
    assert passed_asserts("n PASS 0\nn PASS 1\n", "n", 2) == 0  # no RAN mark: the program never finished
    assert passed_asserts("n RAN\nm PASS 0\nn PASS 0 \nn PASS 2\n", "n", 2) == 0  # another nonce; index 2 of 2
    assert passed_asserts("n RAN\nn PASS 1\nn PASS 1\nn PASS 0", "n", 2) == 2  # each test counted once
    assert passed_asserts("n RAN\nn PASS 10\n", "n", 2) == 0 and passed_asserts("", "n", 0) == 0


def test_stdio_cases_each_one_run_passing_on_exit_zero_and_equal_output():
    cases = {"inputs": ["1\n", "2\n", "3\n", "4\n"], "outputs": ["1", "2", "3", "4"]}
    answers = {"1\n": ran("1\n"), "2\n": ran("2\n", exit_code=1), "3\n": ran("3", timed_out=True, exit_code=None),
               "4\n": ran("5\n")}
    reward = reward_on(lambda code, stdin: answers[stdin])
    assert reward(completions=[PROGRAM], tests=[cases]) == [0.25]
    assert [stdin for _, stdin in reward._sandbox.jobs] == ["1\n", "2\n", "3\n", "4\n"]
    assert reward.counts == CodeTestCounts(runs=4, tests=4, passed=1, timeouts=1, seconds=reward.counts.seconds)


def test_a_sandbox_failure_scores_none_and_no_program_scores_zero_and_no_tests_does_not_apply():
    cases = {"inputs": ["a", "b"], "outputs": ["x", "x"]}
    answer = lambda code, stdin: ran("x") if stdin == "a" else ran(exit_code=None, error="broken")  # noqa: E731
    reward = reward_on(answer)
    scores = reward(completions=[PROGRAM, "no program", PROGRAM, PROGRAM], tests=[cases, cases, None, "[]"])
    assert scores == [None, 0.0, None, None]
    assert reward.counts == CodeTestCounts(runs=2, missing=1, tests=2, passed=0, sandbox_errors=1,
                                           seconds=reward.counts.seconds)
    assert code_counts([reward, reward, len]) == reward.counts + reward.counts and code_counts([len]) is None


def test_counts_add_and_subtract_field_by_field():
    a, b = CodeTestCounts(1, 2, 3, 4, 5, 6, 0.5), CodeTestCounts(10, 20, 30, 40, 50, 60, 1.5)
    assert b - a == CodeTestCounts(9, 18, 27, 36, 45, 54, 1.0) and a + b == CodeTestCounts(11, 22, 33, 44, 55, 66, 2.0)
    assert a.stats() == {"code_tests_runs": 1, "code_tests_missing": 2, "code_tests_passed": 4, "code_tests_tests": 3,
                         "code_tests_timeouts": 5, "code_tests_sandbox_errors": 6, "time_sandbox": 0.5}


def test_completions_and_tests_must_pair_up():
    with pytest.raises(ValueError, match="^code_tests: 2 completions but 1 tests$"):
        reward_on(marks([], []))(completions=["a", "b"], tests=[THREE])


@pytest.mark.parametrize("completion, program", [
    ("```python\nprint(1)\n```", "print(1)"), ("```py\nprint(1)\n```", "print(1)"), ("```\nprint(1)\n```", "print(1)"),
    ("```Python3\nprint(1)\n```", "print(1)"), ("  ```python  \nprint(1)\n  ```", "print(1)"),
    ("```python\nprint(1)", None), ("```bash\nls\n```", None), ("```python\n\n```", None), ("", None),
    ("```js\nx\n```\n```python\ny\n```", "y"), ("```python\na\n```\n```js\nb\n```", "a"),
    ("<answer>```python\na\n```</answer>\n```python\nb\n```", "a"),  # a block in the last answer first
    ("<answer>x = 1</answer>", "x = 1"), ("<answer>1</answer><answer>2</answer>", "2"), ("<answer> </answer>", None),
    ("```python\nx = '```'\n```", "x = '```'"), ("```python\n```python\nx\n```", "```python\nx"),
    ("```python\na\n```  # not a close\nb\n```", "a\n```  # not a close\nb"),  # a closing fence has nothing after it
    ([{"role": "assistant", "content": "```python\na\n```"}, {"role": "tool", "content": "```python\nb\n```"}], "a"),
])
def test_where_a_program_is_found(completion, program):
    assert extract_program(completion) == program


@pytest.mark.parametrize("value, expected", [
    (None, None), ("", None), ("  ", None), ([], None), ({}, None), ("[]", None),
    (["assert 1"], AssertTests(("assert 1",))), ('["assert 1"]', AssertTests(("assert 1",))),
    ({"inputs": ["a"], "outputs": ["b"]}, StdioTests((("a", "b"),))),
    ({"input": ["a", "c"], "output": ["b", "d"]}, StdioTests((("a", "b"), ("c", "d")))),
    ([{"input": "a", "output": "b"}], StdioTests((("a", "b"),))),
    (json.dumps({"inputs": ["a"], "outputs": ["b"]}), StdioTests((("a", "b"),))),
])
def test_each_form_of_tests(value, expected):
    assert parse_tests(value) == expected


@pytest.mark.parametrize("value, message", [
    ("x" * 200, "tests: text that is not JSON (Expecting value): '" + "x" * 80 + "'"),
    (["assert (" + "y" * 200], "tests: test 0 is not valid Python ("),
    ([1], "tests: test 0 is int 1; expected an assert statement (text)"),
    ({"inputs": ["a"], "outputs": []}, "tests: 'inputs' and 'outputs' must be lists of equal length"),
    ({"inputs": ["a"]}, "tests: a dict of stdin/stdout cases has the keys 'inputs' and 'outputs'"),
    ({"inputs": [1], "outputs": ["b"]}, "tests: case 0's input and output must be text, got int and str"),
    ([{"input": "a"}], "tests: case 0 has the keys ['input']; a stdin/stdout case is {'input': ..., 'output': ...}"),
    ([{"input": 1, "output": "b"}], "tests: case 0's input and output must be text, got int and str"),
    ({"inputs": "ab", "outputs": ["x", "y"]}, "tests: 'inputs' and 'outputs' must be lists of equal length"),
    ({"inputs": ["a", "b"], "outputs": "xy"}, "tests: 'inputs' and 'outputs' must be lists of equal length"),
    (5, "tests: expected a list of assert statements or stdin/stdout cases, got int 5"),
])
def test_malformed_tests_are_refused_showing_their_start(value, message):
    with pytest.raises(ValueError) as caught:
        parse_tests(value)
    assert str(caught.value).startswith(message)
    if isinstance(value, list) and isinstance(value[0], str):
        assert str(caught.value).endswith(repr(value[0][:80]))


@pytest.mark.parametrize("got, expected, same", [
    ("1\n2\n", "1\n2", True), ("1  \n2\t\n\n\n", "1\n2", True), ("1\r\n2\r\n", "1\n2\n", True), ("", "\n\n", True),
    (" 1\n", "1\n", False), ("1\n\n2", "1\n2", False), ("1\n2", "2\n1", False), ("12", "1\n2", False),
    ("1\n", "", False),
])
def test_outputs_compare_without_trailing_whitespace_only(got, expected, same):
    assert same_output(got, expected) is same and same_output(expected, got) is same


def test_a_conversations_text_is_its_assistant_messages_one_per_line():
    conversation = [{"role": "assistant", "content": "a"}, {"role": "user", "content": "u"},
                    {"role": "assistant", "content": "b"}, {"role": "assistant", "content": None}, {"role": "tool"}]
    assert assistant_text(conversation) == "a\nb" and assistant_text("as it is") == "as it is"


def test_the_reward_is_named_as_made():
    assert make_code_tests(name="unit_tests").__name__ == "unit_tests"


def test_each_completion_is_judged_by_its_own_runs_only():
    """A sandbox failure in a later completion's run leaves an earlier one's score alone."""
    cases = {"inputs": ["a"], "outputs": ["x"]}
    answer = lambda code, stdin: ran(error="broken", exit_code=None) if "broken" in code else ran("x")  # noqa: E731
    broken = "```python\nprint('broken')\n```"
    assert reward_on(answer)(completions=[PROGRAM, broken, PROGRAM], tests=[cases, cases, cases]) == [1.0, None, 1.0]


def test_nothing_to_run_starts_no_sandbox_and_the_time_is_the_calls():
    """Rows without a program or without tests run nothing: no sandbox is started for them (bwrap may be missing
    where no program is ever run); the counts' seconds are the sandbox's wall time, within the call's."""
    reward = CodeTests()
    reward.start_sandbox = lambda: pytest.fail("a sandbox was started with nothing to run")
    assert reward(completions=["no program", PROGRAM], tests=[THREE, None]) == [0.0, None]
    assert reward.counts == CodeTestCounts(missing=1, tests=3, seconds=reward.counts.seconds)
    timed = reward_on(marks([0, 1, 2], []))
    before = time.perf_counter()
    timed(completions=[PROGRAM], tests=[THREE])
    assert 0 <= timed.counts.seconds <= time.perf_counter() - before

