"""A run never loses another (training/run_dir.py): a run into a folder that holds a run's files is refused before it
writes anything — every file a run writes stays byte for byte, whichever command or trainer tried — and the error
names both ways out; --overwrite_output_dir starts over leaving nothing of the old run; --resume reads only the
folder's own run's checkpoints, or one named by its path outside the folder."""

import json
import shutil
from pathlib import Path

import pytest

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.algorithms.sft import SFTTrainer
from grpokit.cli.main import main
from grpokit.config import SFTConfig
from grpokit.training.run_dir import RUN_FILE, RUN_FILES, OutputDirInUse, held_files
from helpers import ROWS, ones, write_config

WAYS_OUT = ("--resume latest", "--overwrite_output_dir")


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def run_id(folder: Path) -> str:
    return json.loads((folder / RUN_FILE).read_text())["run_id"]


def metric_steps(folder: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def checkpoints(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def used(tmp_path_factory, tiny_model_dir):
    """A finished run's folder holding every file a run writes: a LoRA run (adapter/) of 2 steps with a checkpoint
    after each, TensorBoard's events, `grpokit report`'s page and `grpokit plot`'s curves; and, written here because
    their runs are too slow for this test (a wandb service, a reward model retrained, a warm start), the files of
    Weights & Biases (wandb/), iterative RL (reward_model/) and the demo (demo.json). Returns (its config file, the
    folder)."""
    tmp = tmp_path_factory.mktemp("used")
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + 1?", "answer": str(a + 1)}) + "\n"
                            for a in range(10, 20)))
    config = write_config(tmp, tiny_model_dir, data, save_every=1, lora_rank=2, report_to=["tensorboard"])
    folder = tmp / "run"
    assert main(["train", str(config)]) == 0
    assert main(["report", str(folder)]) == 0
    assert main(["plot", str(folder)]) == 0
    (folder / "wandb" / "run-1").mkdir(parents=True)
    (folder / "wandb" / "run-1" / "run-1.wandb").write_bytes(b"events")
    (folder / "reward_model" / "iteration-1").mkdir(parents=True)
    (folder / "reward_model" / "iterations.jsonl").write_text('{"iteration": 1}\n')
    (folder / "demo.json").write_text('{"seed": 0}')
    assert held_files(folder) == list(RUN_FILES)  # every one of them, so that the tests below cover each
    assert checkpoints(folder) == ["step-000001", "step-000002"]
    return config, folder


def assert_refused(err: str, folder: Path, held) -> None:
    assert f"output_dir {folder} already holds a run" in err
    assert all(name in err for name in held) and all(way in err for way in WAYS_OUT)


@pytest.mark.parametrize("command", [
    ["train", "{config}"],
    ["train", "{config}", "--max_steps", "1"],
    ["sft", "--model", "{model}", "--dataset", "rows.jsonl", "--output_dir", "{folder}"],
    ["reward", "train", "--model", "{model}", "--dataset", "rows.jsonl", "--output_dir", "{folder}"],
    ["demo", "--output_dir", "{folder}"],
], ids=["train", "train-shorter", "sft", "reward-train", "demo"])
def test_every_command_refuses_a_used_folder_and_changes_nothing(used, tiny_model_dir, capsys, command):
    config, folder = used
    before = snapshot(folder)
    args = [arg.format(config=config, model=tiny_model_dir, folder=folder) for arg in command]
    assert main(args) == 2
    assert_refused(capsys.readouterr().err, folder, RUN_FILES)
    assert snapshot(folder) == before


def test_every_trainer_refuses_a_used_folder_before_writing(used, tokenizer, tiny_model):
    """The trainers themselves (the Python API, no command line in front): refused when train() starts."""
    _, folder = used
    before = snapshot(folder)
    grpo = GRPOTrainer(GRPOConfig(output_dir=str(folder), prompts_per_step=2, num_generations=4,
                                  max_completion_length=4, max_steps=1, progress_bar=False),
                       model=tiny_model, tokenizer=tokenizer, train_dataset=ROWS, reward_funcs=[ones])
    sft = SFTTrainer(SFTConfig(model="unused", output_dir=str(folder), max_steps=1, progress_bar=False),
                     model=tiny_model, tokenizer=tokenizer,
                     train_dataset=[{"prompt": "1+2=", "completion": "3"}] * 8)
    for trainer in (grpo, sft):
        with pytest.raises(OutputDirInUse) as refusal:
            trainer.train()
        assert_refused(str(refusal.value), folder, RUN_FILES)
    assert snapshot(folder) == before


@pytest.mark.parametrize("name", RUN_FILES)
def test_each_file_a_run_writes_marks_the_folder_used(tmp_path, tiny_model_dir, data_file, capsys, name):
    """A folder holding any single one of them is refused, and that file is left as it was."""
    folder = tmp_path / "run"
    folder.mkdir()
    if "." in name:
        (folder / name).write_text("the old run's\n")
    else:
        (folder / name).mkdir()
        (folder / name / "old.bin").write_bytes(b"the old run's")
    before = snapshot(folder)
    assert main(["train", str(write_config(tmp_path, tiny_model_dir, data_file))]) == 2
    assert_refused(capsys.readouterr().err, folder, [name])
    assert snapshot(folder) == before


def test_a_folder_of_other_files_is_run_into_and_they_stay(tmp_path, tiny_model_dir, data_file):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    assert main(["train", str(write_config(tmp_path, tiny_model_dir, data_file))]) == 0
    assert (folder / "notes.txt").read_text() == "mine" and metric_steps(folder) == [1, 2]


def test_overwrite_leaves_nothing_of_the_old_run(used, tmp_path, capsys):
    """--overwrite_output_dir: the old run's files are gone (its step-000002 above all, which --resume latest would
    otherwise continue), other files stay, and --resume latest then continues the new run."""
    config, used_folder = used
    folder = tmp_path / "run"
    shutil.copytree(used_folder, folder)
    (folder / "notes.txt").write_text("mine")
    old_id = run_id(folder)
    new = ["train", str(config), "--output_dir", str(folder), "--lora_rank", "0", "--report_to", "[]"]
    assert main([*new, "--max_steps", "1", "--overwrite_output_dir"]) == 0
    assert sorted(held_files(folder)) == sorted([RUN_FILE, "config.yaml", "metrics.jsonl", "completions.jsonl",
                                                 "checkpoints", "model"])
    assert checkpoints(folder) == ["step-000001"] and metric_steps(folder) == [1]
    assert run_id(folder) != old_id and (folder / "notes.txt").read_text() == "mine"
    capsys.readouterr()
    assert main([*new, "--max_steps", "2", "--resume", "latest"]) == 0
    assert f"from {folder / 'checkpoints' / 'step-000001'} (step 1)" in capsys.readouterr().err
    assert metric_steps(folder) == [1, 2]


def test_resume_refuses_a_checkpoint_of_another_run(used, tmp_path, capsys):
    """A checkpoint of another run in the folder (copied there, or left by a run before) is not read, by latest nor
    by its path, and nothing changes."""
    config, used_folder = used
    folder = tmp_path / "run"
    args = ["train", str(config), "--output_dir", str(folder)]
    assert main([*args, "--max_steps", "1"]) == 0
    stranger = folder / "checkpoints" / "step-000009"
    shutil.copytree(used_folder / "checkpoints" / "step-000002", stranger)
    before = snapshot(folder)
    for resume in ("latest", str(stranger)):
        assert main([*args, "--max_steps", "10", "--resume", resume]) == 2
        err = capsys.readouterr().err
        assert f"checkpoint {stranger} was written by run {run_id(used_folder)}, but {folder} holds run " \
               f"{run_id(folder)}" in err
    assert snapshot(folder) == before


def test_a_checkpoint_named_by_its_path_starts_a_new_run_in_a_free_folder(used, tmp_path, capsys):
    config, used_folder = used
    checkpoint = used_folder / "checkpoints" / "step-000001"
    folder = tmp_path / "branch"
    assert main(["train", str(config), "--output_dir", str(folder), "--resume", str(checkpoint)]) == 0
    assert metric_steps(folder) == [1, 2]
    record = json.loads((folder / RUN_FILE).read_text())
    assert record["resumed_from"] == str(checkpoint) and record["run_id"] != run_id(used_folder)
    state = json.loads((folder / "checkpoints" / "step-000002" / "state.json").read_text())
    assert state["run_id"] == record["run_id"]
    # into a used folder it is refused like any new run
    before = snapshot(folder)
    assert main(["train", str(config), "--output_dir", str(folder), "--resume", str(checkpoint)]) == 2
    assert_refused(capsys.readouterr().err, folder, ["checkpoints"])
    assert snapshot(folder) == before


def test_overwrite_and_a_resume_of_the_same_folder_are_refused_together(used, capsys):
    config, folder = used
    before = snapshot(folder)
    assert main(["train", str(config), "--resume", "latest", "--overwrite_output_dir"]) == 2
    assert "overwrite_output_dir would delete the run" in capsys.readouterr().err
    assert snapshot(folder) == before


def test_auto_starts_the_folders_run_again_where_it_has_no_checkpoint(used, tmp_path):
    """resume: auto (torchrun --max-restarts, bootstrap's fine-tuning) continues the folder's run; one that died
    before its first checkpoint starts again from step 0, under its own id."""
    config, used_folder = used
    folder = tmp_path / "run"
    shutil.copytree(used_folder, folder)
    shutil.rmtree(folder / "checkpoints")
    old_id = run_id(folder)
    assert main(["train", str(config), "--output_dir", str(folder), "--resume", "auto"]) == 0
    assert metric_steps(folder) == [1, 2] and run_id(folder) == old_id


def test_overwrite_never_deletes_what_the_run_reads(used, capsys):
    """Training on the old run's model/ in place of it: --overwrite_output_dir would delete the model being trained
    (and a resume rebuilds the reference from it), so it is refused."""
    config, folder = used
    before = snapshot(folder)
    assert main(["train", str(config), "--model", str(folder / "model"), "--overwrite_output_dir"]) == 2
    assert f"overwrite_output_dir would delete {folder / 'model'}, which this run reads" in capsys.readouterr().err
    assert snapshot(folder) == before


@pytest.mark.parametrize("given, replaced", [([], True), (["--output_dir", "runs/demo"], False)])
def test_the_demo_replaces_its_own_last_run_but_not_a_folder_the_user_named(tmp_path, monkeypatch, capsys, given,
                                                                             replaced):
    """`grpokit demo` twice: its own folder (runs/demo, not named by the user) holds the last demo, which the rerun
    replaces, saying so; named with --output_dir, the folder is the user's and the rule holds (refused)."""
    import grpokit.algorithms.demo as demo

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    (tmp_path / "runs" / "demo" / "demo.json").write_text('{"seed": 0}')
    seen = {}

    def stop_after_the_check(seed, output_dir, **kwargs):
        seen.update(kwargs, output_dir=output_dir)
        demo.check_early(demo.demo_config(kwargs["task"], seed, output_dir, False, **{
            key: value for key, value in kwargs.items() if key not in ("task", "eval_prompts", "progress")}))
        raise SystemExit("checked")

    monkeypatch.setattr(demo, "run_demo", stop_after_the_check)
    if replaced:
        with pytest.raises(SystemExit, match="checked"):
            main(["demo", *given])
        assert seen["overwrite_output_dir"] is True and seen["output_dir"] == "runs/demo"
        assert "runs/demo holds the last demo run: replacing it" in capsys.readouterr().out
    else:
        assert main(["demo", *given]) == 2
        err = capsys.readouterr().err
        assert all(way in err for way in WAYS_OUT), err
    assert (tmp_path / "runs" / "demo" / "demo.json").read_text() == '{"seed": 0}'  # nothing removed before the run
