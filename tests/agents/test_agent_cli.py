"""``grpokit train --agent FILE.py:NAME`` in a real interpreter: it trains and writes one completions.jsonl record per
episode; an agent that fails or hangs ends the process with a one-line error naming it, the row and the episode."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

GRACE = 60  # seconds from the error on stderr to the exit (a torch process's teardown on a loaded 2-core machine)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}

AGENTS = '''
import time

async def counts(client, model, question, answer):
    """Two requests, the second's prompt extending the first's text."""
    first = await client.completions.create(model=model, prompt=question, max_tokens=4)
    second = await client.completions.create(model=model, prompt=question + first.choices[0].text + " So", max_tokens=4)
    return {"said": float(answer in second.choices[0].text), "length": len(first.choices[0].text) / 10}

async def raises(client, model, **row):
    await client.completions.create(model=model, prompt="Hi", max_tokens=2)
    raise RuntimeError("the tool is down")

def hangs(client, model, **row):
    time.sleep(3600)
'''


@pytest.fixture
def agents(tmp_path) -> Path:
    (tmp_path / "agents.py").write_text(AGENTS)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n"
                                                 for q, a in (("1+1=", "2"), ("2+2=", "4"))))
    return tmp_path


def train(tmp_path: Path, model: Path, *flags: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "grpokit", "train", f"--model={model}", f"--output_dir={tmp_path / 'run'}",
               "--dataset=rows.jsonl", "--prompts_per_step=2", "--num_generations=2", "--max_completion_length=8",
               "--max_steps=1", "--progress_bar=false", "--mixed_precision=no", *flags]
    with open(tmp_path / "stderr.txt", "w") as err:
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=ENV, cwd=tmp_path)


def test_the_cli_trains_an_agent_named_in_the_config(agents, tiny_model_dir):
    process = train(agents, tiny_model_dir, "--agent=agents.py:counts", "--reward_weights=[1.0, 0.5]")
    assert process.wait(timeout=600) == 0, (agents / "stderr.txt").read_text()[-3000:]
    [metrics] = [json.loads(line) for line in (agents / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics["agent_episodes"] == 4 and metrics["agent_turns"] == 8
    assert metrics["reward"] == pytest.approx(metrics["rewards/said"] + 0.5 * metrics["rewards/length"], abs=1e-6)
    records = [json.loads(line) for line in (agents / "run" / "completions.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(len(r["turns"]) == 2 and r["samples"] in ("merged", "per_turn") for r in records)
    for record in records:
        assert record["reward"] == pytest.approx(record["said"] + 0.5 * record["length"], abs=1e-6)
    assert "accuracy_reward" not in metrics and "rewards/format_reward" not in metrics  # no default reward


@pytest.mark.parametrize("agent, flags, error", [
    ("raises", [], r"error: agent 'raises' raised RuntimeError: the tool is down \(line \d of rows.jsonl, episode "
                   r"\w+-\d-\d\)"),
    # the agent's thread, asleep for an hour, is abandoned: the exit does not wait for it
    ("hangs", ["--agent_timeout=2"], r"error: agent 'hangs' did not finish within agent_timeout=2.0 s \(line \d of "
                                     r"rows.jsonl, episode"),
])
def test_an_agent_that_fails_ends_the_run_naming_it(agents, tiny_model_dir, agent, flags, error):
    process = train(agents, tiny_model_dir, f"--agent=agents.py:{agent}", *flags)
    stderr, deadline = agents / "stderr.txt", time.monotonic() + 300
    try:
        while not re.search(error, stderr.read_text()) and process.poll() is None:
            assert time.monotonic() < deadline, stderr.read_text()[-3000:]
            time.sleep(0.1)
        code = process.wait(timeout=GRACE)
    finally:
        process.kill()
        process.wait()
    text = stderr.read_text()
    assert code == 1 and re.search(error, text) and "no step was done" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


@pytest.mark.slow_distributed
def test_under_torchrun_each_process_serves_its_share_of_the_episodes(agents, tiny_model_dir):
    """DDP with 2 processes: each serves its own copy of the policy to the episodes of its row, and the step's
    metrics count every process's."""
    from helpers import torchrun_processes

    main = Path(__file__).parents[2] / "src" / "grpokit" / "__main__.py"
    torchrun_processes(main, ["train", f"--model={tiny_model_dir}", f"--output_dir={agents / 'run'}",
                              f"--dataset={agents / 'rows.jsonl'}", "--agent", str(agents / "agents.py") + ":counts",
                              "--prompts_per_step=2", "--num_generations=2", "--max_completion_length=8",
                              "--max_steps=2", "--progress_bar=false", "--mixed_precision=no", "--device=cpu"],
                       env={"PYTHONPATH": ENV["PYTHONPATH"]})
    history = [json.loads(line) for line in (agents / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["agent_episodes"] for m in history] == [4, 4] and [m["agent_turns"] for m in history] == [8, 8]
    assert all(m["sampler_kl"] < 1e-5 for m in history)
