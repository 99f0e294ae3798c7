"""The built-in python tool: what the model reads back from a run (output, error, timeout, sandbox failure), its
description to chat templates, its settings from a config, and a rollout in which completions call it, its results
inserted and masked out of what the policy is trained on."""

import pytest
from transformers.utils import get_json_schema

import grpokit.rollout.python_tool
from grpokit import GRPOConfig
from grpokit.config import ConfigError
from grpokit.rollout.generate import generate
from grpokit.rollout.python_tool import make_python_tool, result_text, sandbox_limits, start_sandboxes
from grpokit.rollout.tools import ToolBox, python, resolve_tools
from grpokit.sandbox import Result
from grpokit.tasks.tiny_model import build_model, build_tokenizer
from helpers import TOOL_SPEC, Scripted


def result(stdout="", stderr="", exit_code=0, timed_out=False, sandbox_error=None, truncated=False):
    return Result(stdout=stdout, stderr=stderr, exit_code=exit_code, timed_out=timed_out,
                  sandbox_error=sandbox_error, seconds=0.1, truncated=truncated)


@pytest.mark.parametrize("run, text", [
    (result("42\n"), "42"),
    (result(" \n"), "(no output)"),
    (result("x" * 1500), "x" * 1000 + " …(cut)"),
    (result("x" * 1000 + "\n"), "x" * 1000),  # exactly the limit: nothing was cut
    (result("x", truncated=True), "x …(cut)"),
    (result("half", "Traceback (most recent call last):\n  ...\nZeroDivisionError: division by zero\n", 1),
     "error: Traceback (most recent call last):\n  ...\nZeroDivisionError: division by zero"),
    (result("", "", 3), "error: exit code 3"),
    (result("partial", exit_code=None, timed_out=True), "error: timed out"),
    (result(exit_code=None, sandbox_error="bwrap: setting up uid map: Permission denied"),
     "error: the sandbox failed: bwrap: setting up uid map: Permission denied"),
])
def test_what_the_model_reads_back(run, text):
    assert result_text(run) == text


def test_a_long_traceback_keeps_its_end():
    text = result_text(result(stderr="frame\n" * 500 + "ValueError: the end", exit_code=1))
    assert text.startswith("error: ") and text.endswith("ValueError: the end") and len(text) == len("error: ") + 1000


def test_each_sandbox_starts_once_and_each_kind_is_said_once(any_isolation):
    class User:
        def __init__(self, said):
            self.said, self.started = said, 0

        def start_sandbox(self):
            self.started += 1
            return type("Started", (), {"describe": lambda _: self.said})()

    users = [User("sandbox: one"), len, User("sandbox: one"), User("sandbox: two")]
    assert start_sandboxes(users) == ["sandbox: one", "sandbox: two"]
    assert [u.started for u in users if isinstance(u, User)] == [1, 1, 1]
    tool = make_python_tool(any_isolation, sandbox_limits(2.0))
    sandbox = tool.start_sandbox()
    assert tool.start_sandbox() is sandbox and sandbox.isolation == any_isolation  # made once, at the first ask
    assert sandbox.limits == sandbox_limits(2.0) and make_python_tool(any_isolation).start_sandbox().limits == \
        sandbox_limits()
    assert sandbox_limits() == sandbox_limits(5.0) and sandbox_limits(0.2).cpu_seconds == 1


def test_the_tool_runs_on_the_isolation_it_was_made_for(monkeypatch):
    made = []
    monkeypatch.setattr(grpokit.rollout.python_tool, "Sandbox", lambda **options: made.append(options) or options)
    make_python_tool("process", sandbox_limits(2.0)).start_sandbox()
    make_python_tool().start_sandbox()
    assert made == [{"isolation": "process", "limits": sandbox_limits(2.0)},
                    {"isolation": "bwrap", "limits": sandbox_limits()}]  # by default, the strong one


def test_runs_programs_in_the_sandbox(isolation):
    tool = make_python_tool(isolation)
    assert tool("print(sum(range(10)))\nprint('done')") == "45\ndone"
    assert tool("x = 1") == "(no output)"
    failed = tool("print('before')\n1 / 0")
    assert failed.startswith("error: Traceback") and failed.endswith("ZeroDivisionError: division by zero")
    assert tool("print(input())").endswith("EOFError: EOF when reading a line")  # no stdin
    assert tool(["print(1)"]) == "error: code must be text, got list"


def test_the_config_sets_its_sandbox_and_timeout(any_isolation):
    (tool,), _ = resolve_tools(GRPOConfig(tools=["python"], sandbox=any_isolation, sandbox_timeout=1.0))
    assert tool.__name__ == "python" and tool is not python
    assert tool("import time\ntime.sleep(5)") == "error: timed out"
    assert sandbox_limits(2.5).wall_seconds == 2.5 and sandbox_limits(2.5).cpu_seconds == 3
    with pytest.raises(ConfigError, match="tool_timeout=5.0 must exceed sandbox_timeout=5.0"):
        GRPOConfig(tools=["python"], tool_timeout=5.0, sandbox_timeout=5.0)


def test_chat_templates_read_its_signature_and_docstring():
    schema = get_json_schema(python)["function"]
    assert schema["name"] == "python" and "Run a Python program" in schema["description"]
    assert schema["parameters"]["properties"]["code"]["type"] == "string"
    assert schema["parameters"]["required"] == ["code"]


def call(code: str) -> str:
    escaped = code.replace("\n", "\\n").replace('"', '\\"')
    return f'<tool>{{"name": "python", "arguments": {{"code": "{escaped}"}}}}</tool>'


def test_a_rollout_with_the_python_tool(isolation):
    """Completions that call the tool (well, badly) and one that does not: each result is inserted after its call,
    and the tool mask covers exactly the inserted tokens, which the policy's own mask leaves out."""
    tok = build_tokenizer(tool_tags=True)
    model = build_model(tok, TOOL_SPEC, seed=0).eval()
    texts = [f"<think>{call('print(6 * 7)')}</think><answer>42</answer>",
             f"{call('print(1 / 0)')}oops", "<answer>41</answer>"]
    session = Scripted(ToolBox(tok, [make_python_tool(isolation)]), texts, 300)
    encoded = tok(["Q?"], return_tensors="pt")
    rollout = generate(model, encoded["input_ids"], encoded["attention_mask"], num_generations=3, max_new_tokens=300,
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tools=session)
    decoded = rollout.decode(tok)
    assert decoded[0] == f"<think>{call('print(6 * 7)')}<result>42</result></think><answer>42</answer>"
    assert decoded[2] == texts[2]
    inserted = [tok.decode(rollout.completion_ids[i][rollout.tool_mask[i].bool()].tolist()) for i in range(3)]
    assert inserted[0] == "<result>42</result>" and inserted[2] == ""
    assert inserted[1].startswith("<result>error: Traceback") and inserted[1].endswith("division by zero</result>")
    assert decoded[1] == f"{call('print(1 / 0)')}{inserted[1]}oops"
    assert [[(c.name, c.failed) for c in calls] for calls in session.calls] == [[("python", False)],
                                                                                 [("python", True)], []]
    assert (rollout.model_mask == rollout.completion_mask * (1 - rollout.tool_mask)).all()
    assert (rollout.logp[rollout.tool_mask.bool()] == 0).all()  # inserted: not the policy's picks
