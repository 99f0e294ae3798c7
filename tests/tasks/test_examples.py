"""The shipped example configs are valid, the SmolLM2 recipe's data script writes what its README says, and the
README's tools and code-rewards examples run as written."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpokit.config import GRPOConfig, SFTConfig
from grpokit.sandbox import Sandbox, SandboxUnavailable
from grpokit.tasks.arithmetic import HELD_OUT_PAIRS, has_carry

ROOT = Path(__file__).resolve().parents[2]
SFT_CONFIGS = ["examples/sft.yaml", "examples/smollm2/sft.yaml"]
TRAIN_CONFIGS = ["examples/jsonl_dataset.yaml", "examples/smollm2/grpo.yaml",
                 "src/grpokit/tasks/recipes/arithmetic.yaml",
                 "src/grpokit/tasks/recipes/tools.yaml",
                 "src/grpokit/tasks/recipes/arithmetic_process.yaml"]


@pytest.mark.parametrize("path", SFT_CONFIGS + TRAIN_CONFIGS)
def test_example_configs_are_valid(path):
    values = yaml.safe_load((ROOT / path).read_text())
    (SFTConfig if path in SFT_CONFIGS else GRPOConfig).from_dict(values)  # raises ConfigError naming the key


def test_the_recipe_stages_share_their_system_prompt():
    sft, grpo = (yaml.safe_load((ROOT / f"examples/smollm2/{name}.yaml").read_text()) for name in ("sft", "grpo"))
    assert sft["system_prompt"] == grpo["system_prompt"] and "<answer>" in grpo["system_prompt"]


def test_the_recipe_data(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "examples/smollm2/make_data.py"), str(tmp_path)], check=True,
                   capture_output=True)
    read = {name: [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
            for name in ("cold_start", "train", "held_out")}
    assert [len(rows) for rows in read.values()] == [300, len(read["train"]), 200]

    def pair(prompt):
        a, b = prompt.removeprefix("What is ").removesuffix("?").split(" + ")
        return int(a), int(b)

    cold = [pair(row["prompt"]) for row in read["cold_start"]]
    assert sum(has_carry(*p) for p in cold) == 75  # a minority of the cold start carries
    assert len(set(cold)) == len(cold)
    held_out = {pair(row["prompt"]) for row in read["held_out"]}
    assert held_out <= set(HELD_OUT_PAIRS) and not held_out & {pair(r["prompt"]) for r in read["train"]}
    assert not held_out & set(cold)
    assert all(str(sum(pair(r["prompt"]))) == r["answer"] for r in read["train"][:50] + read["held_out"])
    assert sum(r["carry"] for r in read["held_out"]) > 0


def test_the_readme_tools_example_runs_as_written(tmp_path):
    readme = (ROOT / "README.md").read_text()
    code = readme.split("<!-- tools-example -->\n```python\n", 1)[1].split("```", 1)[0]
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("tool-call rate ") and (tmp_path / "runs/my-tools/model").is_dir()


def test_the_readme_code_rewards_example_runs_as_written(tmp_path):
    try:
        Sandbox(isolation="bwrap")  # the example's default
    except SandboxUnavailable as error:
        pytest.skip(f"bwrap cannot start here: {error}")
    section = (ROOT / "README.md").read_text().split("## Code rewards\n", 1)[1]
    code = section.split("```python\n", 1)[1].split("\n```\n", 1)[0]
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "[1.0, 0.5, 0.0]\n"
