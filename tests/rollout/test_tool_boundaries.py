"""The tool layer at its boundaries: each of the calculator's bounds from both sides, with both signs and zero; the
plain protocol's call limit and result cut (which end is kept, and exactly how much); what the python tool gives
back of a run at each of its cuts. Expected values are computed by hand."""

import pytest

from grpokit.rollout.calculator import MAX_DEPTH, MAX_DIGITS, MAX_EXPRESSION, calculator
from grpokit.rollout.python_tool import MAX_TEXT, result_text, sandbox_limits
from grpokit.rollout.tool_calls import MAX_CALL, MAX_RESULT, PlainProtocol, ToolCall, parse_tool_call, run_tool
from grpokit.sandbox import Limits, Result

TOO_LARGE = "error: the result is too large"
NINES = "9" * MAX_DIGITS  # 10**30 - 1, the largest number one can write (an operation rounds it to 28 digits: 10**30)
BELOW = "9" * 28 + "00"  # 10**30 - 100: the largest result of 28 significant digits below the bound


# ---- the calculator -------------------------------------------------------------------------------------


@pytest.mark.parametrize("expression, expected", [
    # |result| < 10**30 passes, = 10**30 does not, for a sum, a difference, a product and a quotient, either sign
    (f"{'9' * 28} * 100", BELOW), (f"-{'9' * 28} * 100", f"-{BELOW}"), (f"{'9' * 28} * -100", f"-{BELOW}"),
    (f"{BELOW} + 0", BELOW), (f"-{BELOW} - 0", f"-{BELOW}"), (f"{BELOW} / 1", BELOW), (f"{BELOW} / -1", f"-{BELOW}"),
    (f"{BELOW} + 100", TOO_LARGE), (f"-{BELOW} - 100", TOO_LARGE), (f"0 - {BELOW} - 100", TOO_LARGE),
    (f"{NINES} + 0", TOO_LARGE), (f"-{NINES} - 0", TOO_LARGE),
    (f"{NINES} + 1", TOO_LARGE), (f"-{NINES} - 1", TOO_LARGE), (f"0 - {NINES} - 1", TOO_LARGE),
    (f"1 - -{NINES}", TOO_LARGE), (f"-1 + -{NINES}", TOO_LARGE),
    ("1000000000000000 * 1000000000000000", TOO_LARGE), ("-1000000000000000 * 1000000000000000", TOO_LARGE),
    ("1000000000000000 * -1000000000000000", TOO_LARGE), ("-1000000000000000 * -1000000000000000", TOO_LARGE),
    ("999999999999999 * 1000000000000000", "999999999999999000000000000000"),
    ("-999999999999999 * 1000000000000000", "-999999999999999000000000000000"),
    (f"{NINES} / 0.1", TOO_LARGE), (f"-{NINES} / 0.1", TOO_LARGE), (f"{NINES} / -0.1", TOO_LARGE),
    (f"{BELOW} / 10", BELOW[:-1]), (f"-{BELOW} / 10", f"-{BELOW[:-1]}"), (f"{BELOW} / -10", f"-{BELOW[:-1]}"),
    # zero, and results that stay small
    ("0 * -5", "0"), ("-0", "0"), ("0 - 0", "0"), ("-5 * 0", "0"), ("0 / -7", "0"), ("-1 - -1", "0"),
    ("-10 / 4", "-2.5"), ("10 / -4", "-2.5"), ("-10 / -4", "2.5"), ("0.5 - 1", "-0.5"), ("-0.25 * 4", "-1"),
    ("-1 / 3", "-0.3333333333333333333333333333"), ("2 / 3", "0.6666666666666666666666666667"),
    ("1 / 1000000000000", "0.000000000001"), ("100 * 1.5", "150"), ("1000000 * 1000000", "1000000000000"),
    ("1.10 + 0", "1.1"), ("-1.10 + 0", "-1.1"), ("+7", "7"), ("+-7", "-7"), ("-+7", "-7"),
    ("1 - 2 + 3", "2"), ("8 / 4 / 2", "1"), ("2 * 3 - 4 / 2", "4"), ("-(2 + 3) * 2", "-10"),
])
def test_each_result_within_the_magnitude_bound_of_either_sign(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize("expression", ["1 / 0", "-1 / 0", "0 / 0", "-0 / 0", "1 / -0", "5 / (3 - 3)", "1 / 0.0"])
def test_division_by_zero_of_either_sign(expression):
    assert calculator(expression) == "error: division by zero"


def test_the_length_bound_of_an_expression_from_both_sides():
    at_limit = "1+" * ((MAX_EXPRESSION - 1) // 2) + "1"  # 199 characters
    at_limit += " " * (MAX_EXPRESSION - len(at_limit))
    assert len(at_limit) == MAX_EXPRESSION and calculator(at_limit) == "100"
    assert calculator(at_limit + " ") == f"error: the expression is longer than {MAX_EXPRESSION} characters"
    assert calculator("-" + " " * (MAX_EXPRESSION - 2) + "1") == "-1"


def test_the_digit_bound_counts_digits_of_either_sign_not_points():
    assert calculator(NINES) == NINES and calculator("-" + NINES) == "-" + NINES
    assert not calculator("." + NINES).startswith("error") and calculator("0" * MAX_DIGITS) == "0"
    assert calculator("1" + "0" * MAX_DIGITS) == f"error: a number has more than {MAX_DIGITS} digits"
    assert calculator("-1" + "0" * MAX_DIGITS) == f"error: a number has more than {MAX_DIGITS} digits"
    assert calculator("0" * (MAX_DIGITS + 1)) == f"error: a number has more than {MAX_DIGITS} digits"
    assert not calculator("1" * 15 + "." + "1" * 15).startswith("error")  # 30 digits and a point
    assert calculator("1" * 14 + "." + "1" * 14) == "1" * 14 + "." + "1" * 14
    assert calculator("1" * 15 + "." + "1" * 16) == f"error: a number has more than {MAX_DIGITS} digits"


def test_the_depth_bound_counts_signs_and_parentheses_together():
    assert calculator("(-" * (MAX_DEPTH // 2) + "1" + ")" * (MAX_DEPTH // 2)) == "1"
    deeper = "(-" * (MAX_DEPTH // 2) + "-1" + ")" * (MAX_DEPTH // 2)
    assert calculator(deeper) == f"error: nested more than {MAX_DEPTH} deep"
    assert calculator("1 + " + "-" * MAX_DEPTH + "2") == "3"  # a term's sign starts at depth 0 again
    assert calculator("1 + " + "-" * (MAX_DEPTH + 1) + "2") == f"error: nested more than {MAX_DEPTH} deep"


@pytest.mark.parametrize("expression, expected", [
    ("1 2", "error: unexpected '2'"), ("(1) (2)", "error: unexpected '('"), ("1 + * 2", "error: unexpected '*'"),
    ("1 / / 2", "error: unexpected '/'"), ("()", "error: unexpected ')'"),
    ("-", "error: the expression ends too early"),
    ("((1)", "error: the expression ends too early"), ("1..2", "error: '1..2' is not a number"),
    ("1 ** 2", "error: powers are not supported (only + - * /)"),
    ("1,000", "error: unsupported character ',' (only digits, '.', + - * / and parentheses)"),
    ("1\n+\t2", "3"), ("3 × 4 ÷ 6 − 1", "1"), ("\x00", "error: unsupported character 'U+0000' (only digits, '.', "
                                              "+ - * / and parentheses)"),
    ("", "error: the expression is empty"), (" \t\n", "error: the expression is empty"),
    ("X", "error: unsupported character 'X' (only digits, '.', + - * / and parentheses)"),
    (None, "error: the expression must be text, got NoneType"), (12, "error: the expression must be text, got int"),
])
def test_the_calculator_reads_what_a_model_writes_and_refuses_the_rest(expression, expected):
    assert calculator(expression) == expected


# ---- the plain protocol ----------------------------------------------------------------------------------


def call_of(body: str) -> str:
    return f"<tool>{body}</tool>"


def test_a_call_of_exactly_max_call_characters_is_read_and_one_more_is_not():
    head, tail = '{"name": "f", "arguments": {"x": "', '"}}'
    body = head + "a" * (MAX_CALL - len(head) - len(tail)) + tail
    assert len(body) == MAX_CALL
    assert parse_tool_call("prose " + call_of(body)) == ToolCall("f", {"x": "a" * (MAX_CALL - len(head) - len(tail))})
    longer = head + "a" * (MAX_CALL + 1 - len(head) - len(tail)) + tail
    assert parse_tool_call(call_of(longer)) == ToolCall(error=f"the call is longer than {MAX_CALL} characters")


@pytest.mark.parametrize("text, expected", [
    ('<tool>{"name": "f", "arguments": {"a": -1.5}}</tool>', ToolCall("f", {"a": -1.5})),
    ('<tool> {"name": "f"} </tool>', ToolCall("f", {})),
    ('<tool>{"name": "f", "parameters": {"a": 1}}</tool>', ToolCall("f", {"a": 1})),
    ('<tool>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool>', ToolCall("f", {"a": 2})),
    ('<tool>{"name": "f", "arguments": " "}</tool>', ToolCall("f", {})),
    ('<tool>{"name": "f", "arguments": {"a": 1}, "parameters": {"b": 2}}</tool>', ToolCall("f", {"a": 1})),
    ('<tool>{"name": "f"}</tool> ', None),  # not at the end: the rollout has not paused at it
    ('no call', None),
    ('<tool>{"name": "a"}</tool><tool>{"name": "b"}</tool>', ToolCall("b", {})),  # the last call, after a closed one
    ('<tool><tool>{"name": "b"}</tool>', ToolCall(error="nested <tool> tags: a call is one JSON object between one "
                                                         "<tool> and </tool>")),
    ('<tool>{"name": "a"}</tool> then <tool>x <tool>{"name": "b"}</tool>',  # the last open tag is unclosed
     ToolCall(error="nested <tool> tags: a call is one JSON object between one <tool> and </tool>")),
    ('{"name": "f"}</tool>', ToolCall(error="</tool> without a <tool> before it")),
    ('<tool></tool></tool>', ToolCall(error="</tool> without a <tool> before it")),
    ('<tool>{"name": ""}</tool>', ToolCall(error='the call has no "name" (the tool\'s name, as text)')),
    ('<tool>{"name": 5}</tool>', ToolCall(error='the call has no "name" (the tool\'s name, as text)')),
    ('<tool>{"arguments": {}}</tool>', ToolCall(error='the call has no "name" (the tool\'s name, as text)')),
    ('<tool>["f"]</tool>', ToolCall(error='the call must be a JSON object: {"name": ..., "arguments": {...}}')),
    ('<tool>{"name": "f", "arguments": [1]}</tool>',
     ToolCall("f", error='"arguments" must be a JSON object of the tool\'s parameters')),
    ('<tool>{"name": "f", "arguments": "x"}</tool>',
     ToolCall("f", error='"arguments" is text that is not JSON of the tool\'s parameters')),
    ('<tool>{"name": "f", "arguments": "[1]"}</tool>',
     ToolCall("f", error='"arguments" must be a JSON object of the tool\'s parameters')),
    ('<tool>' + "[" * 100_000 + '</tool>', ToolCall(error=f"the call is longer than {MAX_CALL} characters")),
    ('<tool>{"name": "f",}</tool>', ToolCall(error="the call is not valid JSON (Expecting property name enclosed in "
                                                    "double quotes)")),
])
def test_calls_a_model_writes_and_hostile_ones(text, expected):
    assert parse_tool_call(text) == expected
    assert PlainProtocol().parse(text) == expected


def test_a_deeply_nested_call_within_the_limit_is_an_error_not_a_crash():
    found = parse_tool_call(call_of("[" * 4000 + "]" * 40))
    assert found.name is None and found.error.startswith("the call is not valid JSON (")


def test_the_open_tag_is_looked_for_before_the_close_tag_only():
    # tags where the close tag holds the open tag: the open tag inside the close tag is not the call's start
    assert parse_tool_call('<t>{"name": "f"}<t>!', "<t>", "<t>!") == ToolCall("f", {})
    assert parse_tool_call('{"name": "f"}<t>!', "<t>", "<t>!") == ToolCall(error="<t>! without a <t> before it")


def test_a_chat_templates_own_tags():
    text = 'x<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert parse_tool_call(text, "<tool_call>", "</tool_call>") == ToolCall("f", {})
    assert parse_tool_call(text) is None


@pytest.mark.parametrize("limit, expected", [(None, "0123456789"), (10, "0123456789"), (9, "012345678"),
                                             (1, "0"), (0, "")])
def test_a_result_keeps_its_first_limit_characters(limit, expected):
    assert run_tool(ToolCall("f", {}), {"f": lambda: "0123456789"}, limit=limit) == (expected, False)


def test_the_default_cut_keeps_the_start_of_results_and_errors():
    text = "".join(chr(ord("a") + i % 26) for i in range(3 * MAX_RESULT))
    assert run_tool(ToolCall("f", {}), {"f": lambda: text}) == (text[:MAX_RESULT], False)
    assert run_tool(ToolCall("f", {}), {"f": lambda: text[:MAX_RESULT]}) == (text[:MAX_RESULT], False)

    def raises():
        raise ValueError(text)

    said, failed = run_tool(ToolCall("g", {}), {"g": raises})
    assert failed and said == ("error: g raised ValueError: " + text)[:MAX_RESULT] and len(said) == MAX_RESULT
    said, failed = run_tool(ToolCall("g", {"x" * 2000: 1}), {"g": lambda: 1})
    assert failed and len(said) == MAX_RESULT and said.startswith("error: g: ")
    assert "() got an unexpected keyword" in said


def test_what_a_tool_returns_becomes_text_and_its_own_errors_count():
    tools = {"n": lambda: -1.5, "none": lambda: None, "err": lambda: "error: bad", "text": lambda: " error: no"}
    assert run_tool(ToolCall("n", {}), tools) == ("-1.5", False)
    assert run_tool(ToolCall("none", {}), tools) == ("null", False)
    assert run_tool(ToolCall("err", {}), tools) == ("error: bad", True)
    assert run_tool(ToolCall("text", {}), tools) == (" error: no", False)
    assert run_tool(ToolCall(error="bad"), tools) == ("error: bad", True)
    assert run_tool(ToolCall("x" * 100, {}), {"b": 1, "a": 2}) == (
        f"error: unknown tool {'x' * 100!r:.60}; the tools are a, b", True)


def test_the_plain_protocol_wraps_results_as_text_only():
    assert PlainProtocol().result_pieces("</result><tool>", ToolCall("f")) == [
        ("<result></result><tool></result>", False)]


# ---- what the python tool gives back -----------------------------------------------------------------------


def run(stdout="", stderr="", exit_code=0, timed_out=False, error=None, truncated=False) -> Result:
    return Result(stdout, stderr, exit_code, timed_out, error, 0.1, truncated)


def numbered(n: int) -> str:
    """n characters, each telling its position: '0123456789' repeated."""
    return "".join(str(i % 10) for i in range(n))


def test_output_keeps_its_start_cut_at_max_text():
    assert result_text(run(numbered(MAX_TEXT))) == numbered(MAX_TEXT)
    assert result_text(run(numbered(MAX_TEXT + 1))) == numbered(MAX_TEXT) + " …(cut)"
    assert result_text(run("ab" * MAX_TEXT)) == ("ab" * MAX_TEXT)[:MAX_TEXT] + " …(cut)"
    assert result_text(run("x", truncated=True)) == "x …(cut)"  # the sandbox cut it already
    assert result_text(run(numbered(MAX_TEXT) + " \n\n")) == numbered(MAX_TEXT)  # trailing blanks are not text
    assert result_text(run("  x\n")) == "  x" and result_text(run(" \n")) == "(no output)"


def test_a_traceback_keeps_its_end_cut_at_max_text():
    trace = "Traceback\n" + numbered(3 * MAX_TEXT) + "\nZeroDivisionError: division by zero"
    said = result_text(run(stderr=trace + "\n", exit_code=1))
    assert said == "error: " + trace[-MAX_TEXT:] and said.endswith("ZeroDivisionError: division by zero")
    assert result_text(run(stderr=numbered(MAX_TEXT), exit_code=1)) == "error: " + numbered(MAX_TEXT)
    assert result_text(run(stdout="ignored", stderr="", exit_code=-9)) == "error: exit code -9"
    assert result_text(run(stdout="out", exit_code=2)) == "error: exit code 2"


def test_a_sandbox_failure_keeps_its_start_and_a_timeout_says_so():
    said = result_text(run(error=numbered(2 * MAX_TEXT), exit_code=None))
    assert said == ("error: the sandbox failed: " + numbered(2 * MAX_TEXT))[:MAX_TEXT] and len(said) == MAX_TEXT
    assert result_text(run(error="x", exit_code=None)) == "error: the sandbox failed: x"
    assert result_text(run(stdout="partial", timed_out=True, exit_code=None)) == "error: timed out"


@pytest.mark.parametrize("seconds, cpu", [(0.001, 1), (0.5, 1), (1, 1), (1.0, 1), (1.01, 2), (2.5, 3), (5, 5)])
def test_the_sandbox_limits_of_a_timeout(seconds, cpu):
    assert sandbox_limits(seconds) == Limits(wall_seconds=seconds, cpu_seconds=cpu)


def test_the_default_python_tool_timeout():
    assert sandbox_limits() == Limits(wall_seconds=5.0, cpu_seconds=5)


def test_the_limits_are_the_documented_ones():
    """docs/tools.md and docs/sandbox.md state these numbers; the tests above use the constants, so a constant that
    drifts from the docs would pass them."""
    from decimal import Decimal

    from grpokit.rollout.calculator import MAX_MAGNITUDE, PRECISION

    assert (MAX_EXPRESSION, MAX_DIGITS, MAX_DEPTH, MAX_MAGNITUDE, PRECISION) == (200, 30, 32, Decimal(10) ** 30, 28)
    assert (MAX_CALL, MAX_RESULT, MAX_TEXT) == (4096, 1024, 1000)
    assert Limits() == Limits(wall_seconds=10, cpu_seconds=5, memory_mb=512, processes=32, file_size_mb=16,
                              open_files=64, output_bytes=65_536, disk_mb=64)


def test_values_json_cannot_hold_become_their_text():
    from decimal import Decimal

    tools = {"d": lambda: {"x": Decimal("-1.50"), "s": [None, True]}, "o": lambda: object}
    assert run_tool(ToolCall("d", {}), tools) == ('{"x": "-1.50", "s": [null, true]}', False)
    assert run_tool(ToolCall("o", {}), tools) == ('"<class \'object\'>"', False)


def test_a_tool_under_a_timeout_runs_in_a_thread_named_after_it():
    import threading

    # an overrunning call's thread is abandoned, not killed: its name tells which tool it was
    assert run_tool(ToolCall("f", {}), {"f": lambda: threading.current_thread().name}, timeout=30) == ("tool f", False)
