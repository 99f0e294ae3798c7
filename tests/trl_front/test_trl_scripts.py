"""Public TRL GRPO scripts run on grpokit with only their import lines changed (docs/trl.md, "Scripts that run").

Each script is TRL's own, as published: TRL's quick start and the multi-task example of TRL's GRPO docs (quoted below,
Apache-2.0, from huggingface/trl docs/source/grpo_trainer.md), and TRL's command-line script ``trl/scripts/grpo.py``,
read from the installed TRL. :func:`switch_imports` moves ``GRPOConfig`` and ``GRPOTrainer`` from ``trl`` to
``grpokit.trl``, and the test checks that nothing else changed. The scripts name Hub ids; offline, those ids are local
folders of the same names in the working directory (``from_pretrained`` and ``load_dataset`` read a folder of that
name first): a tiny chat model as ``Qwen/Qwen2.5-0.5B-Instruct`` and small datasets of the published columns.
"""

import difflib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from grpokit.tasks.tiny_model import TinyModelSpec, build_model, build_tokenizer
from helpers import CHAT_TEMPLATE

trl = pytest.importorskip("trl")

SRC = Path(__file__).resolve().parents[2] / "src"
MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
DEEPMATH = [("What is 2 + 2?", "4"), ("What is 3 * 3?", "9"), ("What is 10 - 7?", "3")]

QUICKSTART = '''\
# train_grpo.py
from datasets import load_dataset
from trl import GRPOTrainer
from trl.rewards import accuracy_reward

dataset = load_dataset("trl-lib/DeepMath-103K", split="train")

trainer = GRPOTrainer(
    model="Qwen/Qwen2.5-0.5B-Instruct",
    reward_funcs=accuracy_reward,
    train_dataset=dataset,
)
trainer.train()
'''

# TRL's "Example 4: Multi-task reward functions". It calls two helpers that the docs leave to the user
# (check_math_solution, test_code_solution): the user's own, defined here above the example.
USER_HELPERS = '''\
def check_math_solution(prompt, completion):
    return completion.strip().startswith("4")


def test_code_solution(prompt, completion):
    return "return" in completion

'''
MULTI_TASK = '''\
from datasets import Dataset
from trl import GRPOTrainer

# Define a dataset that contains both math and coding problems
dataset = Dataset.from_list(
    [
        {"prompt": "What is 2+2?", "task": "math"},
        {"prompt": "Write a function that returns the sum of two numbers.", "task": "code"},
        {"prompt": "What is 3*4?", "task": "math"},
        {"prompt": "Write a function that returns the product of two numbers.", "task": "code"},
    ]
)

# Math-specific reward function
def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            # Calculate math-specific reward
            correct = check_math_solution(prompt, completion)
            reward = 1.0 if correct else -1.0
            rewards.append(reward)
        else:
            # Return None for non-math tasks
            rewards.append(None)
    return rewards

# Coding-specific reward function
def coding_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "coding":
            # Calculate coding-specific reward
            works = test_code_solution(prompt, completion)
            reward = 1.0 if works else -1.0
            rewards.append(reward)
        else:
            # Return None for non-coding tasks
            rewards.append(None)
    return rewards

# Use both task-specific reward functions
trainer = GRPOTrainer(
    model="Qwen/Qwen2.5-0.5B-Instruct",
    reward_funcs=[math_reward_func, coding_reward_func],
    train_dataset=dataset,
)

trainer.train()
'''


def switch_imports(source: str) -> str:
    """``source`` with ``GRPOConfig`` and ``GRPOTrainer`` imported from ``grpokit.trl`` instead of ``trl``: the one
    change a TRL script needs. Other names stay imported from ``trl``."""
    def rewrite(match: re.Match) -> str:
        indent, names = match.group(1), [n.strip() for n in match.group(2).split(",") if n.strip()]
        ours = [n for n in names if n in ("GRPOConfig", "GRPOTrainer")]
        theirs = [n for n in names if n not in ours]
        lines = [f"{indent}from trl import {', '.join(theirs)}"] if theirs else []
        return "\n".join([*lines, f"{indent}from grpokit.trl import {', '.join(ours)}"]) if ours else match.group(0)

    return re.sub(r"^([ \t]*)from trl import ([\w, ]+)$", rewrite, source, flags=re.MULTILINE)


def changed_lines(before: str, after: str) -> list[str]:
    return [line for line in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]


@pytest.fixture(scope="module")
def hub_folders(tmp_path_factory) -> Path:
    """A working directory where the scripts' Hub ids are local folders: the model (a tiny chat model: character
    tokens, room for TRL's default 512 completion tokens) and DeepMath-shaped rows (conversational prompt, solution)."""
    root = tmp_path_factory.mktemp("trl-scripts")
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    model = build_model(tokenizer, TinyModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                                                 max_positions=1024), seed=0)
    model.save_pretrained(root / MODEL)
    tokenizer.save_pretrained(root / MODEL)
    data = root / "trl-lib" / "DeepMath-103K"
    data.mkdir(parents=True)
    for split, rows in (("train", DEEPMATH[:1]), ("test", DEEPMATH[1:])):
        (data / f"{split}.jsonl").write_text("".join(
            json.dumps({"prompt": [{"role": "user", "content": q}], "solution": a}) + "\n" for q, a in rows))
    return root


def run_script(source: str, cwd: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``source`` run as a script in ``cwd``, offline, with grpokit's sources importable."""
    script = cwd / "train_grpo.py"
    script.write_text(source)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(cwd / "hf_home"),
           "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_switch_imports_changes_only_the_import_lines():
    assert switch_imports("from trl import GRPOTrainer\n") == "from grpokit.trl import GRPOTrainer\n"
    assert switch_imports("    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig, TrlParser\n") == (
        "    from trl import DatasetMixtureConfig, ModelConfig, TrlParser\n"
        "    from grpokit.trl import GRPOConfig\n")
    assert switch_imports("from trl.rewards import accuracy_reward\n") == "from trl.rewards import accuracy_reward\n"


def test_trls_quickstart_runs_with_trls_defaults(hub_folders):
    source = switch_imports(QUICKSTART)
    assert changed_lines(QUICKSTART, source) == ["-from trl import GRPOTrainer", "+from grpokit.trl import GRPOTrainer"]
    run_script(source, hub_folders)
    # TRL's defaults: output_dir named after the model, 8 completions of 1 prompt per step (per_device_train_batch_size
    # 8, num_generations 8), 3 epochs over the 1 prompt, up to 512 tokens each, accuracy_reward on the solution column
    run = hub_folders / "Qwen2.5-0.5B-Instruct-GRPO"
    steps = metrics(run)
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all("rewards/accuracy_reward" in m for m in steps)
    assert (run / "checkpoints" / "step-000003").is_dir()
    config = (run / "config.yaml").read_text()
    assert "max_completion_length: 512" in config and "learning_rate: 1.0e-06" in config


def test_trls_multi_task_example_runs(hub_folders, tmp_path):
    original = USER_HELPERS + MULTI_TASK
    source = switch_imports(original)
    assert changed_lines(original, source) == ["-from trl import GRPOTrainer", "+from grpokit.trl import GRPOTrainer"]
    for folder in ("Qwen",):  # the model's folder, under this test's own working directory
        os.symlink(hub_folders / folder, tmp_path / folder)
    run_script(source, tmp_path)
    steps = metrics(tmp_path / "Qwen2.5-0.5B-Instruct-GRPO")
    assert len(steps) == 12  # 4 prompts, 1 per step, 3 epochs
    # the docs' coding reward tests t == "coding" while the rows say "code": it applies to no row, and is logged as such
    assert all(m["rewards/coding_reward_func"] is None for m in steps)
    assert all(m["rewards/math_reward_func"] is not None or m["unscored_groups"] == 1 for m in steps)


def test_trls_grpo_script_runs_with_lora_and_evaluation(hub_folders, tmp_path):
    original = Path(trl.__file__).parent.joinpath("scripts", "grpo.py").read_text()
    source = switch_imports(original)
    assert changed_lines(original, source) == [
        "-    from trl import GRPOTrainer, get_dataset, get_peft_config, get_quantization_config",
        "+    from trl import get_dataset, get_peft_config, get_quantization_config",
        "+    from grpokit.trl import GRPOTrainer",
        "-    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig, TrlParser",
        "+    from trl import DatasetMixtureConfig, ModelConfig, TrlParser",
        "+    from grpokit.trl import GRPOConfig"]
    for folder in ("Qwen", "trl-lib"):
        os.symlink(hub_folders / folder, tmp_path / folder)
    out = tmp_path / "out"
    result = run_script(source, tmp_path, "--model_name_or_path", MODEL, "--dataset_name", "trl-lib/DeepMath-103K",
                        "--reward_funcs", "accuracy_reward", "think_format_reward", "--output_dir", str(out),
                        "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length",
                        "16", "--max_steps", "2", "--learning_rate", "1e-3", "--logging_steps", "1",
                        "--eval_strategy", "steps", "--eval_steps", "1", "--use_peft", "--lora_r", "4",
                        "--lora_alpha", "8", "--lora_target_modules", "q_proj", "v_proj", "--dtype", "float32")
    assert "Training completed." in result.stdout and f"Model saved to {out}." in result.stdout
    state = json.loads((out / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    evals = [entry for entry in state["log_history"] if "eval_reward" in entry]
    assert [entry["step"] for entry in evals] == [1, 2]  # 2 held-out prompts × 4 completions, as TRL's eval
    assert {"eval_rewards/accuracy_reward/mean", "eval_rewards/think_format_reward/mean"} <= set(evals[0])
    config = (out / "config.yaml").read_text()
    assert "lora_rank: 4" in config and "lora_target_modules:\n- q_proj\n- v_proj" in config
    assert (out / "adapter" / "adapter_config.json").is_file() and (out / "config.json").is_file()
