"""`grpokit serve MODEL` in a subprocess: it says its URL, answers /v1/models and a completion through the openai SDK,
and exits cleanly on SIGINT (Ctrl-C) and on SIGTERM."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from helpers import kill_tree

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_grpokit_serve_answers_and_exits_on_a_signal(tiny_model_dir, stop):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "grpokit", "serve", str(tiny_model_dir), "--port", "0", "--model_name", "tiny",
               "--progress_bar", "false", "--device", "cpu"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = process.stdout.readline()
        found = re.search(r"at (http://127\.0\.0\.1:\d+/v1)", line)
        assert found, line + process.stdout.read()
        ai = openai.OpenAI(base_url=found.group(1), api_key="none", max_retries=0)
        assert [m.id for m in ai.models.list().data] == ["tiny"]
        assert ai.completions.create(model="tiny", prompt="Count 1:", max_tokens=3).choices[0].text is not None
        process.send_signal(stop)
        assert process.wait(timeout=60) == 0
        assert "stopped" in process.stdout.read()
    finally:
        if process.poll() is None:
            kill_tree(process.pid)


def test_grpokit_serve_refuses_an_unknown_engine_and_a_missing_model(capsys):
    from grpokit.cli.main import main

    assert main(["serve", "some/model", "--generation_engine", "sglang"]) == 2
    assert "generation_engine" in capsys.readouterr().err
    assert main(["serve"]) == 2
    assert "error: model is required" in capsys.readouterr().err


def test_grpokit_serve_on_vllm_without_vllm_says_so_before_loading_the_model(capsys):
    """(tests/serving/test_vllm_server.py serves on vLLM where it is installed.)"""
    import importlib.util

    from grpokit.cli.main import main

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    assert main(["serve", "some/model", "--generation_engine", "vllm"]) == 2
    assert "needs vLLM in this environment" in capsys.readouterr().err
