"""The command line: train with a YAML file, a recipe and overrides, one flag scheme for every command, eval (its
tools' protocol as training chooses it), the demo's plumbing, and clean errors."""

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import grpokit.from_config
from grpokit import GRPOTrainer
from grpokit.cli.main import main
from grpokit.cli.options import load_run_config, parse_config_args
from grpokit.config import ConfigError, GRPOConfig, SFTConfig, load_config
from grpokit.rollout.tool_templates import TemplateProtocol
from grpokit.rollout.tools import PlainProtocol
from grpokit.sandbox import Sandbox, SandboxUnavailable
from grpokit.tasks.demo import DEMO_CONFIG
from helpers import write_config

EXAMPLES = Path(__file__).parents[2] / "examples"
RECIPES = Path(__file__).parents[2] / "src" / "grpokit" / "tasks" / "recipes"


def test_train_with_yaml_and_overrides(tmp_path, tiny_model_dir, data_file, capsys):
    config = write_config(tmp_path, tiny_model_dir, data_file)
    assert main(["train", str(config), "--max_steps", "3", "--beta", "0"]) == 0
    run = tmp_path / "run"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3
    assert yaml.safe_load((run / "config.yaml").read_text())["beta"] == 0.0
    assert (run / "model" / "model.safetensors").is_file()
    assert "done: 3 steps" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--bta", "0"], "unknown config key 'bta'; did you mean 'beta'"),
        (["--num_generations", "1"], "num_generations=1 is out of range"),
        (["--dataset", "missing.jsonl"], "dataset file 'missing.jsonl' does not exist"),
        (["--model", "no/such/dir"], "model: 'no/such/dir' does not exist"),
        (["--reward_funcs", "[accuracy, vibes]"], "unknown reward 'vibes'"),
    ],
)
def test_train_bad_input_is_one_clear_line(tmp_path, tiny_model_dir, data_file, capsys, extra, message):
    config = write_config(tmp_path, tiny_model_dir, data_file)
    assert main(["train", str(config), *extra]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("error: ") and message in err and "Traceback" not in err


def test_a_sandbox_that_cannot_start_is_an_error_naming_the_sandbox_key(tmp_path, tiny_model_dir, data_file, capsys,
                                                                        monkeypatch):
    """As `--sandbox process` as root with an interpreter others cannot read: no traceback, exit 2, the key named."""
    def cannot_start(self, isolation="bwrap", **options):
        raise SandboxUnavailable(f"isolation: {isolation}: cannot run a program here: (this test)")

    monkeypatch.setattr(Sandbox, "__init__", cannot_start)
    config = write_config(tmp_path, tiny_model_dir, data_file)
    assert main(["train", str(config), "--sandbox", "process", "--tools", "[python]"]) == 2
    err = capsys.readouterr().err
    assert "error: sandbox: isolation: process: cannot run a program here: (this test)" in err
    assert "The config key `sandbox` chooses" in err and "--sandbox bwrap" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_train_without_a_model_or_a_dataset_says_what_to_give(tmp_path, tiny_model_dir, data_file, monkeypatch,
                                                            capsys):
    """The defaults suit a real model and name none: a run without one is refused naming the key, on the command line
    and in Python, before anything loads."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", f"--dataset={data_file}"]) == 2
    assert "error: model is required" in capsys.readouterr().err
    assert main(["train", f"--model={tiny_model_dir}"]) == 2
    assert "error: dataset is required" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="dataset is required"):
        GRPOTrainer(GRPOConfig(output_dir=str(tmp_path / "run"), progress_bar=False))
    assert not (tmp_path / "runs").exists() and not (tmp_path / "run" / "model").exists()


def test_eval_writes_a_summary(tmp_path, tiny_model_dir, data_file, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", str(tiny_model_dir), "--dataset", str(data_file), "--num_generations", "2",
                 "--max_completion_length", "6", "--output", str(out), "--progress_bar", "false"]) == 0
    summary = json.loads(out.read_text())
    assert summary["num_prompts"] == 10 and summary["num_generations"] == 2
    assert {"greedy_correct", "sampled_correct", "greedy_lenient", "sampled_lenient", "greedy_format", "sampled_format",
            "pass@1", "pass@2"} <= set(summary)
    assert summary["greedy_lenient"] >= summary["greedy_correct"]  # lenient accepts all that strict does
    assert summary["pass@1"] == pytest.approx(summary["sampled_correct"])  # pass@1 is the mean accuracy
    assert summary["pass@2"] >= summary["pass@1"]
    assert "pass@2" in capsys.readouterr().out


def test_eval_with_tools_reports_their_use(tmp_path, tiny_model_dir, data_file, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", str(tiny_model_dir), "--dataset", str(data_file), "--num_generations", "2",
                 "--max_completion_length", "6", "--tools", "calculator", "--output", str(out), "--progress_bar",
                 "false"]) == 0
    summary = json.loads(out.read_text())
    assert {"greedy_tool_rate", "sampled_tool_calls", "sampled_tool_errors"} <= set(summary)
    assert main(["eval", str(tiny_model_dir), "--dataset", str(data_file), "--tools", "abacus", "--progress_bar",
                 "false"]) != 0
    assert "tools: unknown tool 'abacus'" in capsys.readouterr().err


def test_eval_writes_each_greedy_completion(tmp_path, tiny_model_dir, data_file):
    out = tmp_path / "completions.jsonl"
    assert main(["eval", str(tiny_model_dir), "--dataset", str(data_file), "--num_generations", "0",
                 "--max_completion_length", "6", "--system_prompt", "Be brief.", "--completions", str(out),
                 "--progress_bar", "false"]) == 0
    rows = [json.loads(line) for line in data_file.read_text().splitlines()]
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["prompt"] for w in written] == [r["prompt"] for r in rows]  # as in the data, not as rendered
    assert [w["answer"] for w in written] == [r["answer"] for r in rows]
    assert all(isinstance(w["completion"], str) and w["correct"] in (0, 1) and w["format"] in (0, 1)
               and w["lenient"] >= w["correct"] for w in written)


def test_eval_pass_k_larger_than_the_samples_is_refused(tmp_path, tiny_model_dir, data_file, capsys):
    assert main(["eval", str(tiny_model_dir), "--dataset", str(data_file), "--num_generations", "2", "--pass_k", "3",
                 "--max_completion_length", "4", "--progress_bar", "false"]) == 2
    assert "pass@3 needs 1 <= k <= samples_per_prompt=2" in capsys.readouterr().err


def test_every_command_reads_options_alike():
    """CONFIG first (or none), --key value or --key=value, `-` or `_`, text kept as written, a list as YAML or as
    several values, a bare --resume; sample and eval: a first positional that is no config is the MODEL."""
    source, overrides = parse_config_args(
        ["c.yaml", "--max-steps", "3", "--reward_funcs", "[accuracy, format]", "--system_prompt", "Answer: 42",
         "--beta=0", "--tools", "calculator", "--resume"], GRPOConfig)
    assert source == "c.yaml" and overrides == {"max_steps": 3, "reward_funcs": ["accuracy", "format"],
                                                "system_prompt": "Answer: 42", "beta": 0, "tools": ["calculator"],
                                                "resume": "latest"}
    assert parse_config_args(["--reward_weights", "1", "0.5", "--chat_template", "false", "--system_prompt", "null",
                              "--model", "123"], GRPOConfig) == (None, {"reward_weights": [1, 0.5],
                                                                         "chat_template": False,
                                                                         "system_prompt": None, "model": "123"})
    assert parse_config_args(["--resume", "runs/x/step-2", "--system_prompt", "--no-think mode"], SFTConfig) == (
        None, {"resume": "runs/x/step-2", "system_prompt": "--no-think mode"})
    assert parse_config_args(["recipe:tools", "m"], GRPOConfig, model_first=True) == ("recipe:tools", {"model": "m"})
    assert parse_config_args(["m", "run.yaml"], GRPOConfig, model_first=True) == ("run.yaml", {"model": "m"})


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "d.jsonl"], "--data was renamed --dataset"),
        (["--samples", "2"], "--samples was renamed --num_generations"),
        (["--max-new-tokens", "8"], "--max_new_tokens was renamed --max_completion_length"),
        (["--no-chat-template"], "--no_chat_template was renamed --chat_template false"),
        (["--out", "x.json"], "--out was renamed --output"),
        (["--beta", "0"], "grpokit eval does not use the config key 'beta'; it reads model, dataset,"),
        (["--pass_kk", "2"], "grpokit eval has no option --pass_kk; did you mean --pass_k?"),
        (["--temperature", "0.5", "0.7"], "--temperature takes one value, got 2"),
        (["--temperature"], "--temperature needs a value"),
        (["--num_generations", "-1"], "num_generations must be an integer >= 0, got -1"),
        (["other_model"], "unexpected argument 'other_model': the model is"),
        (["recipe:arithmetc"], "no recipe 'arithmetc'; the packaged recipes: recipe:arithmetic, "
                               "recipe:arithmetic_process, recipe:tools"),
    ],
)
def test_bad_eval_options_are_one_clear_line(tiny_model_dir, capsys, args, message):
    assert main(["eval", str(tiny_model_dir), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_recipes_are_listed_and_named(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert all(f"recipe:{name} " in out for name in ("arithmetic", "arithmetic_process", "tools"))
    assert load_run_config("recipe:tools", {"max_steps": 3}, GRPOConfig) == load_config(RECIPES / "tools.yaml",
                                                                                        {"max_steps": 3})


def test_version(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.strip() == f"grpokit {importlib.metadata.version('grpokit')}"


def spy_on_evaluate(monkeypatch) -> dict:
    seen, real = {}, grpokit.from_config.evaluate

    def spy(model, tokenizer, rows, **kwargs):
        seen.update(kwargs)
        return real(model, tokenizer, rows, **kwargs)

    monkeypatch.setattr(grpokit.from_config, "evaluate", spy)
    return seen


def test_eval_and_sample_read_a_training_config(tmp_path, tiny_model_dir, data_file, monkeypatch, capsys):
    """Given the run's CONFIG, eval and sample sample as it trains: its prompts' rendering, G, temperature, top_p,
    lengths; a flag overrides it."""
    config = write_config(tmp_path, tiny_model_dir, data_file, system_prompt="Be brief.", temperature=0.7,
                          top_p=0.9, num_generations=3)
    seen = spy_on_evaluate(monkeypatch)
    assert main(["eval", str(config), "--max_completion_length", "4", "--num_prompts", "2", "--progress_bar",
                 "false"]) == 0
    assert (seen["samples_per_prompt"], seen["temperature"], seen["top_p"], seen["max_new_tokens"]) == (3, 0.7, 0.9, 4)
    assert seen["prompts"] == ["Be brief.\nWhat is 10 + 1?", "Be brief.\nWhat is 11 + 1?"]
    out = tmp_path / "rows.jsonl"
    assert main(["sample", str(config), "--output", str(out), "--num_prompts", "2", "--progress_bar",
                 "false"]) == 0
    assert len(out.read_text().splitlines()) == 2 * 3
    assert main(["sample", str(config), "--num_prompts", "2"]) == 2
    assert "grpokit sample needs --output FILE" in capsys.readouterr().err


def test_eval_chooses_the_tools_protocol_as_training_does(tmp_path, tiny_model_dir, data_file, monkeypatch):
    """`eval --tools`: the chat template's own tool format (the tools listed in the prompt) where the template knows
    tools, unless chat_template is false; the plain <tool> protocol otherwise (build_toolbox, as a run)."""
    from grpokit.tasks.tiny_model import build_model
    from helpers import HERMES, tokenizer_with
    from helpers import TEMPLATE_SPEC as SPEC

    hermes = tmp_path / "hermes"
    tokenizer = tokenizer_with(HERMES)
    build_model(tokenizer, SPEC, seed=0).save_pretrained(hermes)
    tokenizer.save_pretrained(hermes)
    seen = spy_on_evaluate(monkeypatch)
    command = ["--dataset", str(data_file), "--tools", "calculator", "--num_generations", "0",
               "--max_completion_length", "2", "--num_prompts", "1", "--progress_bar", "false"]
    assert main(["eval", str(hermes), *command]) == 0
    assert isinstance(seen["toolbox"].protocol, TemplateProtocol)
    assert '"name": "calculator"' in seen["prompts"][0] and seen["prompts"][0].endswith("<|im_start|>assistant\n")
    assert main(["eval", str(hermes), *command, "--chat_template", "false"]) == 0
    assert isinstance(seen["toolbox"].protocol, PlainProtocol) and seen["prompts"] == ["What is 10 + 1?"]
    assert main(["eval", str(tiny_model_dir), *command]) == 0  # no chat template
    assert isinstance(seen["toolbox"].protocol, PlainProtocol)


def test_demo_plumbing(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """The demo end to end with the warm start replaced by the tiny model (the real one is a benchmark); a GRPOConfig
    key as a flag sets the demo's run."""
    import grpokit.algorithms.demo

    monkeypatch.setattr(grpokit.algorithms.demo, "warm_started_model_path", lambda seed, progress, task: tiny_model_dir)
    assert main(["demo", "--max_steps", "2", "--eval_prompts", "8", "--output_dir", str(tmp_path / "demo"),
                 "--beta", "0", "--progress_bar", "false"]) == 0
    out = capsys.readouterr().out
    assert "accuracy, greedy" in out and "carry class: accuracy, greedy" in out
    assert "greedy:\n  before: '" in out and "\n  after:  '" in out
    result = json.loads((tmp_path / "demo" / "demo.json").read_text())
    assert set(result["before"]) == {"all", "carry", "no_carry"} and result["config"]["max_steps"] == 2
    assert result["config"]["beta"] == 0 and result["config"]["learning_rate"] == DEMO_CONFIG["learning_rate"]


def test_tools_demo_plumbing(tmp_path, monkeypatch, capsys):
    """``demo --task tools`` end to end on an untrained tiny model with the tool tags."""
    import grpokit.algorithms.demo
    from grpokit.tasks.tiny_model import TinyModelSpec, build_model, build_tokenizer

    tokenizer = build_tokenizer(tool_tags=True)
    build_model(tokenizer, TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                                         max_positions=160)).save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    monkeypatch.setattr(grpokit.algorithms.demo, "warm_started_model_path",
                        lambda seed, progress, task: tmp_path / "tiny")
    assert main(["demo", "--task", "tools", "--max-steps", "1", "--eval-prompts", "4", "--output-dir",
                 str(tmp_path / "demo"), "--progress-bar", "false"]) == 0  # hyphens as well as underscores
    out = capsys.readouterr().out
    assert "tool-call rate, greedy" in out and "tool errors per completion, sampled" in out
    result = json.loads((tmp_path / "demo" / "demo.json").read_text())
    assert result["task"] == "tools" and result["config"]["tools"] == ["calculator"]
    assert {"greedy_tool_rate", "sampled_tool_calls", "sampled_tool_errors"} <= set(result["after"]["all"])


def test_example_configs_are_valid_and_match_the_demo():
    demo = load_config(RECIPES / "arithmetic.yaml")
    assert all(getattr(demo, key) == value for key, value in DEMO_CONFIG.items())
    load_config(EXAMPLES / "jsonl_dataset.yaml")
    process = load_config(RECIPES / "arithmetic_process.yaml")
    assert process.supervision == "process"
    # the same run as the demo's but for the rewards
    assert all(getattr(process, key) == value for key, value in DEMO_CONFIG.items()
               if key not in ("reward_funcs", "reward_weights"))


def test_console_entry_point_help():
    result = subprocess.run([sys.executable, "-m", "grpokit", "train", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "num_generations" in result.stdout and "G: completions" in result.stdout


def test_readme_python_examples_run(tmp_path, tiny_model_dir, monkeypatch):
    """The README's Python examples (outcome, then process supervision), pointed at the tiny model and
    shortened, run as written."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    readme = readme.split("<!-- tools-example -->")[0]  # that one runs as it is (test_examples.py)
    blocks = [block.split("```", 1)[0] for block in readme.split("```python\n")[1:]]
    assert len(blocks) == 2
    namespace: dict = {}
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        for old, new in [('"path/to/your/hf-model"', repr(str(tiny_model_dir))), ("max_steps=100", "max_steps=2"),
                         ("max_completion_length=256", "max_completion_length=8")]:
            assert old in code
            code = code.replace(old, new)
        exec(compile(code, "README.md", "exec"), namespace)
    for run in ("mine", "steps"):
        assert len((tmp_path / "runs" / run / "metrics.jsonl").read_text().splitlines()) == 2
    steps = json.loads((tmp_path / "runs" / "steps" / "completions.jsonl").read_text().splitlines()[0])["steps"]
    assert steps


def test_resume_through_the_cli(tmp_path, tiny_model_dir, data_file, capsys):
    path = write_config(tmp_path, tiny_model_dir, data_file, save_every=1)
    assert main(["train", str(path)]) == 0
    assert main(["train", str(path), "--resume", "--max_steps", "3"]) == 0
    assert "done: 3 steps" in capsys.readouterr().out
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert main(["train", str(path), "--resume", str(tmp_path / "nowhere")]) == 2
    assert f"error: resume: {tmp_path / 'nowhere'} is not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_plot_writes_the_learning_curves(tmp_path, tiny_model_dir, data_file, capsys, algorithm):
    path = write_config(tmp_path, tiny_model_dir, data_file, algorithm=algorithm)
    assert main(["train", str(path)]) == 0
    assert main(["plot", str(tmp_path / "run")]) == 0
    png = tmp_path / "run" / "plots" / "curves.png"
    assert capsys.readouterr().out.strip().endswith(str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_plot_of_a_directory_without_metrics_is_one_line(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert "no metrics.jsonl (is it a grpokit run directory?)" in capsys.readouterr().err


def test_tensorboard_events(tmp_path, tiny_model_dir, data_file):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    path = write_config(tmp_path, tiny_model_dir, data_file, tensorboard=True)
    assert main(["train", str(path)]) == 0
    events = event_accumulator.EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    rewards = events.Scalars("reward")
    logged = [json.loads(line)["reward"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e.step for e in rewards] == [1, 2]
    assert [e.value for e in rewards] == pytest.approx(logged)
    assert "kl" in events.Tags()["scalars"] and "time_generate" in events.Tags()["scalars"]
