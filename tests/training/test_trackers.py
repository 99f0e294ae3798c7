"""``report_to``: tensorboard, wandb (offline) and trackio (local) receive every step's metrics under its step
number, and the config; a missing package stops start-up, before the model loads, naming the pip install."""

import importlib.util
import json
import struct

import pytest

import grpokit.training.runlog
from grpokit.algorithms.grpo import GRPOTrainer
from grpokit.config import ConfigError, GRPOConfig
from helpers import ROWS, make_trainer, ones


def test_report_to_and_the_tensorboard_alias_are_one_list():
    assert GRPOConfig().trackers == []
    assert GRPOConfig(tensorboard=True).trackers == ["tensorboard"]
    assert GRPOConfig(report_to=["wandb", "tensorboard"], tensorboard=True).trackers == ["wandb", "tensorboard"]
    assert GRPOConfig(report_to="wandb").trackers == ["wandb"]  # one name, as TRL takes it
    with pytest.raises(ConfigError, match="report_to: 'mlflow' is not a tracker; choose from tensorboard, wandb, "
                                          "trackio"):
        GRPOConfig(report_to=["mlflow"])


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "trackio"])
def test_a_missing_tracker_package_stops_start_up_before_the_model_loads(monkeypatch, tmp_path, name):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda module, *a: None if module == name else real(module, *a))
    config = GRPOConfig(model=str(tmp_path / "no-such-model"), report_to=[name], output_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=rf"report_to: {name} needs the {name} package: pip install "
                                          rf"'grpokit\[{name}\]'"):
        GRPOTrainer(config, train_dataset=ROWS, reward_funcs=[ones])  # not a model-loading error: checked first


def spy_on(monkeypatch, cls):
    """Record every (metrics, step) a tracker class logs, and still log it."""
    logged = []
    real = cls.log
    monkeypatch.setattr(cls, "log", lambda self, metrics, step: logged.append((dict(metrics), step))
                        or real(self, metrics, step))
    return logged


def check_logged(logged, history):
    assert [step for _, step in logged] == [m["step"] for m in history] == [1, 2]
    for (metrics, _), expected in zip(logged, history):
        assert metrics == {k: v for k, v in expected.items() if k != "step" and v is not None}


def test_tensorboard_through_report_to(tokenizer, tiny_model, tmp_path):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, max_steps=2, report_to=["tensorboard"])
    history = trainer.train()
    events = accumulator.EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward")] == [1, 2]
    assert [e.value for e in events.Scalars("reward")] == pytest.approx([m["reward"] for m in history])
    assert "config/text_summary" in events.Tags()["tensors"]  # add_text


def wandb_records(path):
    """The records of an offline run's ``run-*.wandb`` file: LevelDB's log format (32 KiB blocks of records, each
    with a 7-byte header: CRC-32, length, kind) after a 7-byte file header, each record a ``Record`` protobuf."""
    from wandb.proto import wandb_internal_pb2

    data, block, position, pending = path.read_bytes(), 32768, 7, b""
    assert data.startswith(b":W&B")
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0:
            break
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one split across blocks
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def test_wandb_offline(tokenizer, tiny_model, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="pip install 'grpokit[wandb]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged = spy_on(monkeypatch, grpokit.training.runlog.WandbTracker)
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, max_steps=2, report_to=["wandb"], run_name="tiny",
                           project="grpokit-tests")
    history = trainer.train()
    check_logged(logged, history)
    # run.finish() can return before wandb's service process has written the run file out (1 run in ~6 here);
    # teardown stops that process, so the file is whole.
    wandb.teardown()
    (path,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    records = list(wandb_records(path))
    steps = [record.history for record in records if record.WhichOneof("record_type") == "history"]
    assert [step.step.num for step in steps] == [1, 2]
    for step, expected in zip(steps, history):
        values = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in step.item}
        assert values["reward"] == pytest.approx(expected["reward"]) and values["_step"] == expected["step"]
    (run,) = [record.run for record in records if record.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["beta"] == trainer.config.beta and config["run_name"] == "tiny" and run.display_name == "tiny"
    assert run.project == "grpokit-tests"


def test_trackio_local(tokenizer, tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read when trackio is first imported
    trackio = pytest.importorskip("trackio", reason="pip install 'grpokit[trackio]'")
    from trackio.sqlite_storage import SQLiteStorage

    if SQLiteStorage.get_project_db_path("grpokit-tests").parent != tmp_path / "trackio":
        pytest.skip(f"trackio was imported earlier in this process with another TRACKIO_DIR ({trackio.__name__})")
    logged = spy_on(monkeypatch, grpokit.training.runlog.TrackioTracker)
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, max_steps=2, report_to=["trackio"], run_name="tiny",
                           project="grpokit-tests")
    history = trainer.train()
    check_logged(logged, history)
    stored = SQLiteStorage.get_logs("grpokit-tests", "tiny")
    assert [row["step"] for row in stored] == [1, 2]
    assert [row["reward"] for row in stored] == pytest.approx([m["reward"] for m in history])
    assert SQLiteStorage.get_run_config("grpokit-tests", "tiny")["beta"] == trainer.config.beta
