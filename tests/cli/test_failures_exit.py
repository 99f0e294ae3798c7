"""Every failure exits: each kind of failure a run can meet, in a real interpreter (``python -m grpokit train`` on the
tiny model, in a process of its own), ends that process nonzero within seconds of its error, the error on stderr.

A test that raises inside pytest's own process never sees the exit, where a failed run used to hang: a finalizer
that waited on a thread (an OpenEnv client's close, tests/tasks/test_openenv.py), a pool thread still in a call that
never returns. Each test here waits for its error on stderr, then gives the process GRACE seconds to be gone."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

GRACE = 60  # seconds from the error on stderr to the exit (a torch process's teardown on a loaded 2-core machine)
# this interpreter's import path, so that the process imports the grpokit under test
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}

USER_CODE = '''
import time

def raises(completions, **kwargs):
    raise RuntimeError("the reward broke")

def wrong_type(completions, **kwargs):
    return "one"

def hangs(completions, **kwargs):
    time.sleep(3600)

def varied(completions, **kwargs):
    return [float(i % 2) for i in range(len(completions))]

class ResetRaises:
    def reset(self, **row):
        raise RuntimeError("no game today")

class ReplyRaises:
    def reset(self, **row):
        return None

    def reply(self, turn):
        raise RuntimeError("the game broke")

class OneResetHangs:
    """The first episode's reset raises, every other one's waits an hour."""
    made = 0

    def __init__(self):
        OneResetHangs.made += 1
        self.number = OneResetHangs.made

    def reset(self, **row):
        if self.number == 2:  # the first made is the tool box's probe, never reset
            raise RuntimeError("no game today")
        time.sleep(3600)
'''


@pytest.fixture
def user_code(tmp_path) -> Path:
    path = tmp_path / "user.py"
    path.write_text(USER_CODE)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n"
                                                 for p, a in (("1+1=", "2"), ("2+2=", "4"))))
    return path


def start(tmp_path: Path, model: Path, *flags: str, prefix: tuple[str, ...] = ("-m", "grpokit")) -> subprocess.Popen:
    """``python -m grpokit train`` on the tiny model (2 prompts x 2 completions a step), its stderr to a file."""
    command = [sys.executable, *prefix, "train", f"--model={model}", f"--output_dir={tmp_path / 'run'}",
               "--prompts_per_step=2", "--num_generations=2", "--max_completion_length=8", "--max_steps=3",
               "--progress_bar=false", "--mixed_precision=no", *flags]
    with open(tmp_path / "stderr.txt", "w") as err:
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=ENV, cwd=tmp_path)


def exits_after(process: subprocess.Popen, stderr: Path, error: str, seconds: float = 300) -> tuple[int, str]:
    """Once ``error`` (a regular expression) is on stderr (within ``seconds`` of the start), the process must be gone
    within GRACE seconds: its exit status and stderr."""
    deadline = time.monotonic() + seconds
    try:
        while not re.search(error, stderr.read_text()):
            if process.poll() is not None:
                break
            assert time.monotonic() < deadline, f"no {error!r} after {seconds} s: {stderr.read_text()[-3000:]}"
            time.sleep(0.1)
        try:
            code = process.wait(timeout=GRACE)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run was still running {GRACE} s after its error: {stderr.read_text()[-3000:]}")
    finally:
        process.kill()
        process.wait()
    text = stderr.read_text()
    assert re.search(error, text), text[-3000:]
    return code, text


@pytest.mark.parametrize("flags, error", [
    (["--dataset=builtin:arithmetic", "--reward_funcs=user.py:raises"],
     "error: reward function 'raises' raised RuntimeError: the reward broke"),
    (["--dataset=builtin:arithmetic", "--reward_funcs=user.py:wrong_type"],
     "error: reward function 'wrong_type' returned str"),
    # the reward's thread, asleep for an hour, is abandoned: the exit does not wait for it
    (["--dataset=builtin:arithmetic", "--reward_funcs=user.py:hangs", "--reward_timeout=1"],
     r"error: reward function 'hangs' took longer than reward_timeout=1\.0 s"),
], ids=["raises", "wrong_type", "hangs"])
def test_a_reward_that_fails_ends_the_run(tmp_path, tiny_model_dir, user_code, flags, error):
    code, _ = exits_after(start(tmp_path, tiny_model_dir, *flags), tmp_path / "stderr.txt", error)
    assert code == 2


def test_the_trackers_do_not_hold_up_a_failed_run(tmp_path, tiny_model_dir, user_code, monkeypatch):
    """Every tracker at once (tensorboard, wandb offline, trackio in a folder of the test's), then a reward that
    raises: their threads and exit handlers end with the process."""
    monkeypatch.setitem(ENV, "WANDB_MODE", "offline")
    monkeypatch.setitem(ENV, "TRACKIO_DIR", str(tmp_path / "trackio"))
    process = start(tmp_path, tiny_model_dir, "--dataset=builtin:arithmetic", "--reward_funcs=user.py:raises",
                    "--report_to=[tensorboard, wandb, trackio]")
    code, _ = exits_after(process, tmp_path / "stderr.txt", "error: reward function 'raises' raised RuntimeError")
    assert code == 2


def test_a_bad_row_ends_the_run(tmp_path, tiny_model_dir):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": 5, "answer": "3"}\n')
    process = start(tmp_path, tiny_model_dir, "--dataset=bad.jsonl", "--reward_funcs=accuracy")
    code, text = exits_after(process, tmp_path / "stderr.txt", "error: ")
    assert code == 2 and "bad.jsonl" in text and "'prompt'" in text


@pytest.mark.parametrize("factory, error", [
    ("ResetRaises", "environment ResetRaises.reset raised RuntimeError: no game today"),
    # a turn the model ends (a stop token) goes to reply, which raises mid-rollout
    ("ReplyRaises", "environment ReplyRaises.reply raised RuntimeError: the game broke"),
    # the other resets still running (asleep for an hour, in the tool box's threads) do not hold up the exit
    ("OneResetHangs", "environment OneResetHangs.reset raised RuntimeError: no game today"),
], ids=["reset_raises", "reply_raises", "other_resets_hang"])
def test_an_environment_that_fails_ends_the_run(tmp_path, tiny_model_dir, user_code, factory, error):
    # temperature 2: near-uniform picks, so that a completion soon ends a turn with the stop token (reply's cue)
    process = start(tmp_path, tiny_model_dir, "--dataset=rows.jsonl", "--reward_funcs=accuracy",
                    f"--environment_factory=user.py:{factory}", "--max_completion_length=56", "--temperature=2")
    code, text = exits_after(process, tmp_path / "stderr.txt", f"error: {error}")
    assert code == 1 and re.search("no step was done|continue with --resume latest", text)
    assert "Traceback" not in text, text[-3000:]  # a failed run's one-line error, as every other failure's


def test_a_sandbox_that_cannot_start_ends_the_run(tmp_path, tiny_model_dir):
    """code_tests where bwrap cannot start (here: no bwrap binary, as without grpokit[sandbox]): the run stops at
    start-up naming the sandbox and the fix."""
    (tmp_path / "code.jsonl").write_text('{"prompt": "Write f.", "tests": ["assert f() == 1"]}\n')
    without_bwrap = ("import sys, grpokit.sandbox.bwrap as bwrap; bwrap.bwrap_path = lambda: None; "
                     "from grpokit.cli.main import main; sys.exit(main())")
    process = start(tmp_path, tiny_model_dir, "--dataset=code.jsonl", "--reward_funcs=code_tests",
                    prefix=("-c", without_bwrap))
    code, text = exits_after(process, tmp_path / "stderr.txt", "no bubblewrap binary here")
    assert code != 0 and "grpokit[sandbox]" in text


def test_a_policy_that_diverges_ends_the_run(tmp_path, tiny_model_dir, user_code):
    """learning_rate 1e30: after the first update the weights overflow and the native engine fails at run time,
    decoding from logits that are not finite."""
    process = start(tmp_path, tiny_model_dir, "--dataset=builtin:arithmetic", "--reward_funcs=user.py:varied",
                    "--learning_rate=1e30", "--max_steps=5")
    code, _ = exits_after(process, tmp_path / "stderr.txt", "(?i)error")
    assert code != 0


def test_sigterm_mid_run_ends_it_after_a_checkpoint(tmp_path, tiny_model_dir):
    process = start(tmp_path, tiny_model_dir, "--dataset=builtin:arithmetic", "--reward_funcs=accuracy",
                    "--max_steps=1000")
    metrics, deadline = tmp_path / "run" / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().strip()):
        assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr.txt").read_text()[-3000:]
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    code, text = exits_after(process, tmp_path / "stderr.txt", "interrupted: stopped by SIGTERM")
    assert code == 130 and "continue with --resume latest" in text
