"""grpokit.rollout.tools and tool_calls: the calculator (arithmetic parsed by hand; a hostile battery gets text back,
never an evaluation), the plain-text protocol (every malformed call gets a defined error text), and the empty
ToolBox of a run without tools."""

import builtins

import pytest
import torch

from grpokit.rollout.generate import generate
from grpokit.rollout.tool_calls import MAX_RESULT, ToolCall, parse_tool_call, run_tool
from grpokit.rollout.tool_templates import build_toolbox
from grpokit.rollout.tools import ToolBox, calculator
from grpokit.tasks.tiny_model import TinyModelSpec, build_model, build_tokenizer


@pytest.mark.parametrize("expression, expected", [
    ("1 + 2", "3"), ("123 × 45", "5535"), ("12345 + 67890", "80235"), ("7 ÷ 2", "3.5"),
    ("1/3", "0.3333333333333333333333333333"),
    ("2 + 3 * 4", "14"), ("(2 + 3) * 4", "20"), ("10 - 4 - 3", "3"), ("100 / 10 / 5", "2"), ("-3 + 5", "2"),
    ("−3 − −2", "-1"), ("--4", "4"), ("0.1 + 0.2", "0.3"), ("2.50 × 4", "10"), (".5 + 1.", "1.5"),
    ("  ( ( 1 ) )  ", "1"), ("1e3", "error: unsupported character 'e' (only digits, '.', + - * / and parentheses)"),
])
def test_arithmetic(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize("expression, message", [
    ("", "the expression is empty"),
    ("   ", "the expression is empty"),
    ("1 +", "ends too early"),
    ("(1 + 2", "ends too early"),
    ("1 + 2)", "unexpected ')'"),
    ("* 3", "unexpected '*'"),
    ("1 / 0", "division by zero"),
    ("0 / 0", "division by zero"),
    ("1 / (2 - 2)", "division by zero"),
    ("1.2.3", "is not a number"),
    (".", "is not a number"),
    ("9**9**9", "powers are not supported"),
    ("2 ^ 10", "unsupported character '^'"),
    ("__import__('os').system('echo hacked')", "unsupported character '_'"),
    ("abs(-1)", "unsupported character 'a'"),
    ("().__class__", "'.' is not a number"),
    ("x", "unsupported character 'x'"),
    ("1; 2", "unsupported character ';'"),
    ("\u0661\u0662 + 1", "unsupported character '\u0661'"),  # Arabic-Indic digits are not read as 12
    ("\uff11 + 1", "unsupported character '\uff11'"),  # a full-width 1
    ("1\u200b+ 1", "unsupported character 'U+200B'"),
    ("1" * 31, "more than 30 digits"),
    ("(" * 40 + "1" + ")" * 40, "nested more than 32 deep"),
    ("-" * 40 + "1", "nested more than 32 deep"),
    ("9" * 30 + " × " + "9" * 30, "too large"),
    ("1 +" * 100, "longer than 200 characters"),
    ("1" * 10**6, "longer than 200 characters"),
])
def test_hostile_input_gets_an_error_text(expression, message):
    result = calculator(expression)
    assert result.startswith("error: ") and message in result


def test_never_evaluates(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("eval or exec was called")

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    assert calculator("(1 + 2) × 3") == "9"
    assert calculator("__import__('os')").startswith("error: ")


def test_non_text_arguments_get_an_error_text():
    assert calculator(None) == "error: the expression must be text, got NoneType"
    assert calculator({"expression": "1"}).startswith("error: the expression must be text")


def test_the_signature_and_docstring_describe_it():
    import inspect

    assert str(inspect.signature(calculator)) == "(expression: 'str') -> 'str'"
    assert "expression:" in calculator.__doc__ and "Returns:" in calculator.__doc__


# ---- the plain-text protocol -------------------------------------------------------------------------

CALL = '<tool>{"name": "calculator", "arguments": {"expression": "12 × 3"}}</tool>'


def test_a_call_at_the_end_of_the_text_is_read():
    assert parse_tool_call("Let me compute. " + CALL) == ToolCall("calculator", {"expression": "12 × 3"})
    assert parse_tool_call("no call here") is None and parse_tool_call(CALL + " and more") is None
    earlier = CALL + "<result>36</result> so " + CALL.replace("12 × 3", "36 + 1")
    assert parse_tool_call(earlier) == ToolCall("calculator", {"expression": "36 + 1"})
    assert parse_tool_call('<tool>{"name": "now"}</tool>') == ToolCall("now", {})  # no arguments: none


@pytest.mark.parametrize("text, message", [
    ("</tool>", "</tool> without a <tool> before it"),
    ('<tool>{"name": "a"}</tool></tool>', "</tool> without a <tool> before it"),
    ('<tool><tool>{"name": "calculator"}</tool>', "nested <tool> tags"),
    ("<tool>{broken</tool>", "not valid JSON"),
    ("<tool></tool>", "not valid JSON"),
    ("<tool>" + "[" * 2000 + "]" * 2000 + "</tool>", "not valid JSON (too deeply nested)"),
    ("<tool>[1, 2]</tool>", "must be a JSON object"),
    ('<tool>{"arguments": {}}</tool>', 'has no "name"'),
    ('<tool>{"name": 7}</tool>', 'has no "name"'),
    ('<tool>{"name": "calculator", "arguments": [1]}</tool>', '"arguments" must be a JSON object'),
    ('<tool>{"name": "calculator", "arguments": {"expression": "' + "1" * 10**6 + '"}}</tool>',
     "longer than 4096 characters"),
])
def test_malformed_calls_get_a_defined_error(text, message):
    call = parse_tool_call(text)
    assert call is not None and message in call.error
    result, failed = run_tool(call, {"calculator": calculator})
    assert failed and result == f"error: {call.error}"


def slow() -> str:
    import time

    time.sleep(5)
    return "late"


@pytest.mark.parametrize("call, expected", [
    (ToolCall("calculator", {"expression": "12 × 3"}), ("36", False)),
    (ToolCall("calculator", {"expression": "1 / 0"}), ("error: division by zero", True)),  # its own error text
    (ToolCall("nope", {}), ("error: unknown tool 'nope'; the tools are boom, calculator, slow, table", True)),
    (ToolCall("calculator", {"expr": "1"}),
     ("error: calculator: calculator() got an unexpected keyword argument 'expr'", True)),
    (ToolCall("calculator", {}), ("error: calculator: calculator() missing 1 required positional argument: "
                                  "'expression'", True)),
    (ToolCall("boom", {}), ("error: boom raised KeyError: 'missing'", True)),
    (ToolCall("slow", {}), ("error: slow took longer than 0.2 s", True)),
    (ToolCall("table", {}), ('{"a": [1, 2]}', False)),  # not text: JSON
])
def test_running_a_call_answers_text(call, expected):
    tools = {"calculator": calculator, "boom": lambda: {}["missing"], "slow": slow, "table": lambda: {"a": [1, 2]}}
    assert run_tool(call, tools, timeout=0.2) == expected


def test_a_long_result_is_cut():
    text, failed = run_tool(ToolCall("long", {}), {"long": lambda: "x" * 10**6})
    assert text == "x" * MAX_RESULT and not failed


def test_without_tools_the_empty_box_does_nothing():
    """The empty box (a run without tools) scans no vocabulary, and its session is never handed a decode step:
    the same tokens as no session, no tool mask, nothing more for reward functions, no metrics."""
    tok = build_tokenizer(tool_tags=True)
    model = build_model(tok, TinyModelSpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32), seed=0)
    assert not ToolBox.NONE and not ToolBox(object()) and ToolBox(tok, [calculator])  # object(): never read
    assert build_toolbox(tok, [], None, chat_template=None, max_calls=4, timeout=None) is ToolBox.NONE
    session, encoded = ToolBox.NONE.session([{}], 4, 12), tok(["Q?"], return_tensors="pt")
    plain, inert = (generate(model, encoded["input_ids"], encoded["attention_mask"], num_generations=4,
                             max_new_tokens=12, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                             generator=torch.Generator().manual_seed(0), tools=tools) for tools in (None, session))
    assert torch.equal(plain.completion_ids, inert.completion_ids) and inert.tool_mask is None
    columns, steps = {}, [[(0, 1.0)]] * 4
    assert session.reward_inputs(inert, [[{"role": "user", "content": "Q?"}]] * 4, columns) is None and not columns
    assert session.own_steps(steps, inert) is steps and session.calls is None
    assert session.metrics() == {} and session.counts() == {}


def test_nesting_is_bounded_at_exactly_32():
    assert calculator("-" * 32 + "1") == "1" and calculator("(" * 32 + "1" + ")" * 32) == "1"
    assert calculator("-" * 33 + "1") == calculator("(" * 33 + "1" + ")" * 33) == "error: nested more than 32 deep"
    assert calculator("(1 + 2 3") == "error: a '(' is not closed"
