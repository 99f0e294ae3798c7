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
from grpokit.tasks.arithmetic import HELD_OUT_PAIRS, has_carry, worked_solution
from helpers import no_sandbox

ROOT = Path(__file__).resolve().parents[2]
SFT_CONFIGS = ["examples/sft.yaml", "examples/smollm2/sft.yaml", "examples/answers_only/sft.yaml",
               "examples/reasoning_gym/sft.yaml"]
TRAIN_CONFIGS = ["examples/jsonl_dataset.yaml", "examples/smollm2/grpo.yaml", "examples/answers_only/grpo.yaml",
                 "examples/reasoning_gym/grpo.yaml", "examples/environments/verifiers.yaml",
                 "examples/environments/openenv.yaml",
                 "src/grpokit/tasks/recipes/arithmetic.yaml",
                 "src/grpokit/tasks/recipes/tools.yaml",
                 "src/grpokit/tasks/recipes/arithmetic_process.yaml"]


@pytest.mark.parametrize("path", SFT_CONFIGS + TRAIN_CONFIGS)
def test_example_configs_are_valid(path):
    values = yaml.safe_load((ROOT / path).read_text())
    (SFTConfig if path in SFT_CONFIGS else GRPOConfig).from_dict(values)  # raises ConfigError naming the key


@pytest.mark.parametrize("path", TRAIN_CONFIGS)
def test_each_recipe_pins_its_own_settings_over_the_real_model_defaults(path):
    """GRPOConfig's defaults suit a pretrained model (REAL_MODEL: TRL's learning rate and lengths) and name no model
    or data: a recipe tuned for its model writes its own, so that its numbers do not move with the defaults."""
    values = yaml.safe_load((ROOT / path).read_text())
    assert {"model", "learning_rate", "max_completion_length"} <= set(values), path
    assert "dataset" in values or "environment" in values


@pytest.mark.parametrize("recipe", ["smollm2", "answers_only", "reasoning_gym"])
def test_the_recipe_stages_share_their_system_prompt(recipe):
    sft, grpo = (yaml.safe_load((ROOT / f"examples/{recipe}/{name}.yaml").read_text()) for name in ("sft", "grpo"))
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


def test_the_recipe_data_takes_the_cold_starts_carry_share(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "examples/smollm2/make_data.py"), str(tmp_path), "0.5"], check=True,
                   capture_output=True)
    rows = [json.loads(line) for line in (tmp_path / "cold_start.jsonl").read_text().splitlines()]
    pairs = [row["prompt"].removeprefix("What is ").removesuffix("?").split(" + ") for row in rows]
    assert sum(has_carry(int(a), int(b)) for a, b in pairs) == 150
    for carry, extra_lines in (("line", {True: 1, False: 0}), ("always", {True: 0, False: 0}),
                               ("line_always", {True: 1, False: 1})):  # lines added, by whether a row carries
        subprocess.run([sys.executable, str(ROOT / "examples/smollm2/make_data.py"), str(tmp_path), "0.5",
                        "--carry", carry], check=True, capture_output=True)
        styled = [json.loads(line) for line in (tmp_path / "cold_start.jsonl").read_text().splitlines()]
        assert [row["prompt"] for row in styled] == [row["prompt"] for row in rows]  # the same problems
        assert [r["completion"] for r in styled] == [worked_solution(int(a), int(b), carry=carry) for a, b in pairs]
        assert [row["completion"].count("\n") for row in styled] == [
            row["completion"].count("\n") + extra_lines[has_carry(int(a), int(b))] for row, (a, b) in zip(rows, pairs)]


def test_the_recipe_summary_splits_accuracy_by_carry(tmp_path):
    """summarize.py's numbers, on a run directory written by hand: greedy accuracy by carry per stage,
    and the sampled training accuracy per window of steps, judged from the logged completions."""
    run = tmp_path / "process" / "seed1"
    (run / "grpo").mkdir(parents=True)
    (run / "times.json").write_text('{"sft": 60, "sft_eval": 120, "grpo": 1800, "grpo_eval": 1900}')
    for stage, correct in (("base", [0, 0, 0]), ("sft", [1, 0, 0]), ("grpo", [1, 1, 0])):
        (run / f"eval_{stage}.json").write_text(json.dumps({"greedy_correct": sum(correct) / 3, "greedy_format": 1}))
        rows = [{"prompt": p, "answer": "", "completion": "", "correct": bool(c)}
                for p, c in zip(["What is 12 + 13?", "What is 47 + 85?", "What is 19 + 19?"], correct)]
        (run / f"completions_{stage}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    logged = [(1, "What is 47 + 85?", "<think>\n7+5=12\n4+8+1=13\n</think>\n<answer>132</answer>"),
              (2, "What is 47 + 85?", "<think>\n7+5=12\n4+8=12\n</think>\n<answer>122</answer>"),
              (3, "What is 12 + 13?", "<answer>25</answer>"), (11, "What is 47 + 85?", "<answer>132</answer>"),
              (4, "What is 47 + 85?", "<think>\n7+5=12\n4+8=12\n12+1=14\n</think>\n<answer>142</answer>")]
    (run / "grpo" / "completions.jsonl").write_text("".join(
        json.dumps({"step": s, "prompt": p, "completion": c}) + "\n" for s, p, c in logged))
    metrics = [{"step": 1, "time_generate": 2.5, "completion_length_mean": 10, "sampler_kl": 0.01,
                "is_weight_mean": 1.0, "is_capped_frac": 0.0},
               {"step": 2, "time_generate": 3.5, "completion_length_mean": 20, "sampler_kl": 0.03,
                "is_weight_mean": 0.98, "is_capped_frac": 0.02}]
    (run / "grpo" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (run / "grpo" / "config.yaml").write_text("prompts_per_step: 2\nnum_generations: 2\n")  # 4 per step
    done = subprocess.run([sys.executable, str(ROOT / "examples/smollm2/summarize.py"), str(tmp_path),
                           "--out", str(tmp_path / "out.json")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (result,) = json.loads((tmp_path / "out.json").read_text())["runs"]
    assert (result["variant"], result["seed"], result["minutes_total"]) == ("process", 1, 1900 / 60)
    assert result["greedy_correct_by_carry"]["sft"] == {"carry": 0.0, "no_carry": 1.0}
    assert result["greedy_correct_by_carry"]["grpo"] == {"carry": 0.5, "no_carry": 1.0}
    assert result["training_accuracy_by_window"] == {"carry": [1 / 3, 1.0], "no_carry": [1.0, None]}
    assert "| process | 1 | **GRPO's gain** | **+33.3 points** | +0.0 | +50.0 |" in done.stdout
    assert result["sampling"] == pytest.approx({"seconds": 6.0, "ms_per_token": 6000 / (4 * 30), "sampler_kl": 0.02,
                                                "is_weight": 0.99, "is_capped": 0.01})
    assert "| process | 1 | 6 | 50.00 | 2.0e-02 | 0.9900 | 1.00% |" in done.stdout
    # the carry problem's tens column, steps 1, 2, 4, 11: right, the carry forgotten, the carry in its own line
    # added wrong, no column
    assert result["carry_mistakes"]["first"] == {"forgot": 0.25, "added_wrong": 0.25, "right": 0.25, "other": 0.25}
    # --keep: an earlier summary's runs join those on disk, each with its CPU; a run on disk replaces its namesake
    earlier = {"machine": {"cpu": {"model": "Intel Xeon", "family": "6", "model_number": "207"}},
               "runs": [{k: v for k, v in result.items() if k != "machine"} | {"variant": "outcome"},
                        result | {"greedy_correct": {"base": 0, "sft": 0, "grpo": 0}}]}
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    done = subprocess.run([sys.executable, str(ROOT / "examples/smollm2/summarize.py"), str(tmp_path), "--keep",
                           str(tmp_path / "earlier.json"), "--out", str(tmp_path / "out.json")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    runs = json.loads((tmp_path / "out.json").read_text())["runs"]
    assert [(r["variant"], r["machine"]["model"]) for r in runs] == [("outcome", "Intel Xeon"),
                                                                     ("process", result["machine"]["model"])]
    assert runs[1]["greedy_correct"] == result["greedy_correct"] and "(Intel Xeon 6/207) |" in done.stdout


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
        no_sandbox(f"bwrap cannot start here: {error}")
    section = (ROOT / "README.md").read_text().split("## Code rewards\n", 1)[1]
    code = section.split("```python\n", 1)[1].split("\n```\n", 1)[0]
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "[1.0, 0.5, 0.0]\n"
