"""The code_tests reward: where the program is read, what the tests column may hold, the scores of correct,
partial, wrong, malformed and missing programs on assert and stdin/stdout tests, programs that try to fool the
harness, timeouts and sandbox failures, one concurrent batch per call equal to sequential runs, and a GRPO step."""

import json
import re

import pytest

import grpokit
from grpokit import GRPOConfig
from grpokit.config import ConfigError
from grpokit.resolve import code_options, reward_function
from grpokit.rewards import code
from grpokit.rewards.calling import RewardError, score_completions
from grpokit.rewards.code import extract_program, make_code_tests, parse_tests, same_output
from grpokit.rollout.python_tool import sandbox_limits
from grpokit.sandbox import Limits, Result, Sandbox
from helpers import documented_metrics, logged_keys, make_trainer


def fenced(program: str, language: str = "python") -> str:
    return f"Here it is:\n```{language}\n{program}\n```\nDone."


ADD = "def add(a, b):\n    return a + b"
ASSERTS = ["assert add(1, 2) == 3", "assert add(0, 5) == 5", "assert add(-1, 1) == 0"]
SUM_STDIN = "a, b = map(int, input().split())\nprint(a + b)"
CASES = {"inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7\n"]}


# ---- the program --------------------------------------------------------------------------------


@pytest.mark.parametrize("completion, program", [
    (fenced("print(1)"), "print(1)"),
    (fenced("print(1)", "py"), "print(1)"),
    (fenced("print(1)", ""), "print(1)"),
    (fenced("print(1)") + "\n" + fenced("print(2)", "py"), "print(2)"),  # the last block
    (fenced("print(1)") + "\n" + fenced("ls", "bash"), "print(1)"),  # other languages are skipped
    ("```python\nprint(1)", None),  # never closed
    ("<think>plan</think><answer>def f():\n    return 3</answer>", "def f():\n    return 3"),
    ("<answer>" + fenced("print(3)") + "</answer>\n" + fenced("print(4)"), "print(3)"),  # a block in the answer first
    (fenced("print(5)") + "<answer>5</answer>", "print(5)"),  # a block before the bare answer text
    ("no code here", None),
    ("<answer>  </answer>", None),
    ([{"role": "assistant", "content": fenced("print(6)")}], "print(6)"),
    ([{"role": "assistant", "content": fenced("print(7)")}, {"role": "tool", "content": fenced("print(8)")},
      {"role": "assistant", "content": "that is it"}], "print(7)"),  # the assistant's text, not the tool's
])
def test_extract_program(completion, program):
    assert extract_program(completion) == program


# ---- the tests column -----------------------------------------------------------------------------


def test_parse_tests_reads_every_form():
    assert parse_tests(ASSERTS).statements == tuple(ASSERTS)
    assert parse_tests(json.dumps(ASSERTS)).statements == tuple(ASSERTS)  # JSON text, as a CSV column holds
    pairs = (("1 2\n", "3\n"), ("10 -3\n", "7\n"))
    assert parse_tests(CASES).cases == pairs
    assert parse_tests(json.dumps(CASES)).cases == pairs
    listed = [{"input": i, "output": o} for i, o in pairs]
    assert parse_tests(listed).cases == parse_tests(json.dumps(listed)).cases == pairs
    assert parse_tests({"input": ["x"], "output": ["y"]}).cases == (("x", "y"),)  # CodeContests' names
    assert [parse_tests(empty) for empty in (None, [], "", "  ")] == [None] * 4


@pytest.mark.parametrize("value, message", [
    (5, "expected a list of assert statements or stdin/stdout cases, got int 5"),
    ("assert f(1) == 1", "text that is not JSON"),
    (["assert f(1) == 1", 3], "test 1 is int 3; expected an assert statement"),
    (["assert f(1) ==", "assert True"], "test 0 is not valid Python"),
    ({"inputs": ["1"]}, "has the keys 'inputs' and 'outputs'"),
    ({"inputs": ["1", "2"], "outputs": ["1"]}, "lists of equal length"),
    ([{"input": "1", "expected": "1"}], "case 0 has the keys ['expected', 'input']"),
    ({"inputs": [1], "outputs": ["1"]}, "case 0's input and output must be text, got int and str"),
])
def test_malformed_tests_are_named(value, message):
    with pytest.raises(ValueError, match="^where: .*" + re.escape(message)):
        parse_tests(value, "where")


def test_same_output_ignores_trailing_whitespace_only():
    assert same_output("3  \n7\n\n\n", "3\n7")
    assert same_output("3\r\n7\r\n", "3\n7\n")
    assert not same_output("3 7", "3  7") and not same_output("\n3", "3") and not same_output("3", "3\n7")


# ---- scores -------------------------------------------------------------------------------------


@pytest.fixture
def reward(isolation):
    return make_code_tests(isolation=isolation)


PROGRAMS = {
    "correct": (fenced(ADD), 1.0),
    "partial": (fenced("def add(a, b):\n    return a + b if a > 0 else -1"), 1 / 3),  # passes add(1, 2) only
    "wrong": (fenced("def add(a, b):\n    return a * b"), 0.0),
    "malformed": (fenced("def add(a, b)\n    return a + b"), 0.0),  # a syntax error
    "raises at the top": (fenced(ADD + "\nraise RuntimeError('boom')"), 0.0),
    "missing": ("I would add them.", 0.0),
}


def test_assert_tests_score_the_fraction_passed(reward):
    completions, expected = zip(*PROGRAMS.values())
    assert reward(completions=list(completions), tests=[ASSERTS] * len(completions)) == pytest.approx(expected)
    counts = reward.counts
    assert (counts.runs, counts.missing, counts.tests, counts.passed) == (5, 1, 18, 4)
    assert counts.timeouts == counts.sandbox_errors == 0 and counts.seconds > 0


def test_binary_scores_all_or_nothing(isolation):
    completions, _ = zip(*PROGRAMS.values())
    scores = make_code_tests(binary=True, isolation=isolation)(completions=list(completions),
                                                               tests=[ASSERTS] * len(completions))
    assert scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_stdin_stdout_tests(reward):
    completions = [
        fenced(SUM_STDIN),
        fenced("a, b = map(int, input().split())\nprint(a + b if a < 5 else 0, ' ')"),  # trailing space: fine
        fenced("print(input())"),
        fenced(SUM_STDIN + "\nraise SystemExit(3)"),  # the right output, but a failing exit code
        "none",
    ]
    tests = [CASES, json.dumps(CASES), [{"input": "1 2", "output": "3"}], CASES, CASES]
    assert reward(completions=completions, tests=tests) == [1.0, 0.5, 0.0, 0.0, 0.0]
    assert (reward.counts.runs, reward.counts.missing, reward.counts.tests) == (7, 1, 9)


def test_rows_without_tests_do_not_apply(reward):
    completions = [fenced(ADD), fenced(ADD), "no code"]
    assert reward(completions=completions, tests=[ASSERTS, None, []]) == [1.0, None, None]
    assert reward.counts.missing == 0 and reward.counts.runs == 1


FOOLS = {
    "prints the marks": "import sys\nprint('RAN'); print('PASS 0'); print('PASS 1'); print('PASS 2')\n"
                        "sys.stdout.flush()",
    "writes marks to every descriptor": "import os\nfor fd in range(1, 20):\n    try:\n"
                                        "        os.write(fd, b'\\nRAN\\nPASS 0\\nPASS 1\\nPASS 2\\n')\n"
                                        "    except OSError:\n        pass",
    "reads stdin for the nonce": "import sys\nnonce = sys.stdin.read()\nprint(nonce + ' RAN')\n"
                                 "for i in range(3):\n    print(nonce + ' PASS %d' % i)",
    "exits early": "import sys\nsys.exit(0)",
    "exits hard": "import os\nos._exit(0)",
    "replaces the builtins": "import builtins\nbuiltins.exec = lambda *a, **k: None\n"
                             "builtins.compile = lambda *a, **k: None\nbuiltins.enumerate = lambda t: []\n"
                             "def add(a, b):\n    return 0",  # passes add(-1, 1) == 0 honestly
}


@pytest.mark.parametrize("name", FOOLS)
def test_the_harness_is_not_fooled(reward, name):
    honest = 1 / 3 if name == "replaces the builtins" else 0.0
    assert reward(completions=[fenced(FOOLS[name])], tests=[ASSERTS]) == [pytest.approx(honest)]


def test_an_exit_during_a_test_keeps_the_tests_before_it(reward):
    program = "import os\ndef add(a, b):\n    if a == 0:\n        os._exit(0)\n    return a + b"
    assert reward(completions=[fenced(program)], tests=[ASSERTS]) == [pytest.approx(1 / 3)]


def test_a_timeout_keeps_what_passed_before_it(any_isolation):
    reward = make_code_tests(isolation=any_isolation, limits=Limits(wall_seconds=1.0, cpu_seconds=1))
    hangs = "def add(a, b):\n    while a == 0:\n        pass\n    return a + b"
    scores = reward(completions=[fenced(hangs), fenced("while True:\n    pass")], tests=[ASSERTS, ASSERTS])
    assert scores == [pytest.approx(1 / 3), 0.0]
    assert reward.counts.timeouts == 2


def test_sandbox_failures_score_none_and_are_counted(monkeypatch, any_isolation):
    reward = make_code_tests(isolation=any_isolation)
    failed = Result(stdout="", stderr="", exit_code=None, timed_out=False, sandbox_error="bwrap: no namespaces",
                    seconds=0.0, truncated=False)
    monkeypatch.setattr(reward.start_sandbox(), "run_many", lambda jobs: [failed] * len(jobs))
    assert reward(completions=[fenced(ADD), "no code"], tests=[ASSERTS, ASSERTS]) == [None, 0.0]
    assert (reward.counts.sandbox_errors, reward.counts.missing, reward.counts.tests) == (1, 1, 3)


def test_one_concurrent_batch_per_call_equals_sequential_runs(monkeypatch, any_isolation):
    completions = [PROGRAMS[name][0] for name in ("correct", "partial", "wrong", "malformed")] * 3
    completions += [fenced(SUM_STDIN), fenced("print(input())")] * 3
    tests = [ASSERTS] * 12 + [CASES] * 6
    batched = make_code_tests(isolation=any_isolation, workers=4)
    sandbox, batches = batched.start_sandbox(), []
    run_many = sandbox.run_many
    monkeypatch.setattr(sandbox, "run_many", lambda jobs: batches.append(len(jobs)) or run_many(jobs))
    together = batched(completions=completions, tests=tests)
    alone = make_code_tests(isolation=any_isolation, workers=1)
    assert together == [alone(completions=[c], tests=[t])[0] for c, t in zip(completions, tests)]
    assert batches == [12 + 12]  # one program per assert row, one per stdin/stdout case, in one call


def test_a_bad_tests_column_names_the_row(any_isolation):
    reward = make_code_tests(isolation=any_isolation)
    with pytest.raises(ValueError, match=r"column 'tests' \(the row of completion 1\): test 0 is not valid Python"):
        reward(completions=[fenced(ADD)] * 2, tests=[ASSERTS, ["assert add(1,"]])
    with pytest.raises(RewardError, match=r"'code_tests' raised ValueError: column 'tests': expected .*, got int 7 "
                                          r"on completion 1 \(prompt 'q'"):
        score_completions([reward], [1.0], ["q", "q"], [fenced(ADD)] * 2, {"tests": [ASSERTS, 7]})


# ---- names, settings, start-up ---------------------------------------------------------------------


def test_built_without_starting_a_sandbox(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a sandbox was started")

    monkeypatch.setattr(code.Sandbox, "__init__", refuse)
    assert reward_function("code_tests") is grpokit.code_tests
    built = reward_function("code_tests", code_options(GRPOConfig(sandbox="process")))
    assert built.__name__ == "code_tests" and built._sandbox is None


def test_by_default_the_fraction_passed_under_bwrap():
    for built in (grpokit.code_tests, make_code_tests(), code.CodeTests()):
        assert (built.binary, built.isolation, built.limits) == (False, "bwrap", Limits())


def test_only_the_harness_marks_after_the_program_ran_count():
    lines = ["n0 PASS 0", "n0 RAN", "n0 PASS 1", "n0 PASS 1", "n0 FAIL 2", "n0 PASS 7", "n1 PASS 2", "n0 END"]
    assert code.passed_asserts("\n".join(lines), "n0", 3) == 1  # test 1, once: not 0 (before), 7 (none), 2 (n1)
    assert code.passed_asserts("n0 PASS 0\nn0 PASS 1", "n0", 2) == 0  # the program never finished


def test_config_keys_reach_the_reward():
    config = GRPOConfig(sandbox="process", sandbox_timeout=2.5, code_tests_mode="binary")
    built = reward_function("code_tests", code_options(config))
    assert (built.binary, built.isolation, built.limits.wall_seconds, built.limits.cpu_seconds) == \
        (True, "process", 2.5, 3)
    with pytest.raises(ConfigError, match="sandbox"):
        GRPOConfig(sandbox="none")


def test_a_grpo_step_with_code_tests_logs_its_metrics(tokenizer, tiny_model, tmp_path, monkeypatch, any_isolation):
    """The tiny model writes no program: every completion is missing one. Then, with a program put in its place,
    every completion's program runs in the sandbox and passes."""
    rows = [{"prompt": f"Add {i}:", "answer": "", "tests": ASSERTS} for i in range(4)]
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, rows=rows, reward_funcs=["code_tests"], max_steps=1,
                           sandbox=any_isolation)
    assert trainer.notes[-1] == trainer.reward_funcs[0].start_sandbox().describe()  # said at start-up
    (first,) = trainer.train()
    n = trainer.config.num_completions
    # every key documented (but those of the accuracy and format rewards, not used here)
    assert logged_keys(first) == documented_metrics(code_rewards=True)[0] - {"accuracy", "format_rate"}
    assert (first["code_tests_missing"], first["code_tests_runs"], first["code_tests_pass_rate"]) == (n, 0, 0.0)
    assert first["rewards/code_tests"] == 0.0

    monkeypatch.setattr(code, "extract_program", lambda completion: ADD)
    second = make_trainer(tokenizer, tiny_model, tmp_path / "2", rows=rows, reward_funcs=["code_tests"], max_steps=1,
                          sandbox=any_isolation).train()[0]
    assert (second["code_tests_missing"], second["code_tests_runs"], second["code_tests_pass_rate"]) == (0, n, 1.0)
    assert second["rewards/code_tests"] == 1.0 and second["code_tests_timeouts"] == 0 and second["time_sandbox"] > 0


def test_grpokit_sample_scores_with_code_tests_and_says_its_sandbox(tmp_path, tiny_model_dir, any_isolation, capsys):
    from grpokit.cli.main import main

    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Add {i}:", "tests": ASSERTS}) + "\n" for i in range(2)))
    out = tmp_path / "samples.jsonl"
    assert main(["sample", str(tiny_model_dir), "--dataset", str(data), "--num_generations", "2", "--output", str(out),
                 "--reward_funcs", "code_tests", "--sandbox", any_isolation, "--code_tests_mode", "binary",
                 "--max_completion_length", "8"]) == 0
    said = Sandbox(isolation=any_isolation, limits=sandbox_limits(GRPOConfig().sandbox_timeout)).describe()
    assert said in capsys.readouterr().err  # before sampling
    assert [json.loads(line)["label"] for line in out.read_text().splitlines()] == [0.0] * 4  # the tiny model: no code


def test_the_sandbox_is_made_once_with_the_rewards_settings(monkeypatch):
    made = []
    monkeypatch.setattr(code, "Sandbox", lambda **settings: made.append(settings) or settings)
    limits = Limits(wall_seconds=3)
    reward = make_code_tests(limits=limits, isolation="process", workers=3)
    assert reward.start_sandbox() is reward.start_sandbox()
    assert made == [{"isolation": "process", "limits": limits, "workers": 3}]
