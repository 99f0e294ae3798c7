"""Config validation: every bad value names its key."""

import pytest

from grpokit.config import (
    ConfigError,
    GRPOConfig,
    RewardConfig,
    SFTConfig,
    config_class_of,
    load_config,
    parse_overrides,
)


@pytest.mark.parametrize(
    "values, match",
    [
        ({"learning_rte": 1e-4}, "unknown config key 'learning_rte'; did you mean 'learning_rate'"),
        ({"beta": -0.1}, "beta=-0.1 is out of range; it must be >= 0"),
        ({"num_generations": 1}, "num_generations=1 is out of range; it must be >= 2"),
        ({"temperature": 0}, "temperature=0.0 is out of range; it must be > 0"),
        ({"top_p": 1.5}, "top_p=1.5 is out of range; it must be <= 1"),
        ({"aggregation": "mean"}, "aggregation='mean' is not valid; choose one of 'sequence', 'token', 'constant'"),
        ({"scale_rewards": "std"}, "scale_rewards='std' is not valid"),
        ({"max_steps": "ten"}, "max_steps must be int, got str 'ten'"),
        ({"max_steps": 2.5}, "max_steps must be int, got float 2.5"),
        ({"progress_bar": "yes"}, "progress_bar must be bool"),
        ({"reward_funcs": "accuracy"}, "reward_funcs must be a list"),
        ({"reward_funcs": []}, "reward_funcs is empty"),
        ({"reward_funcs": ["accuracy", "format"], "reward_weights": [1.0]},
         "reward_weights has 1 values but reward_funcs has 2"),
        ({"learning_rate": "fast"}, "learning_rate must be float, got str 'fast'"),
    ],
)
def test_bad_config_values_name_the_key(values, match):
    with pytest.raises(ConfigError, match=match):
        GRPOConfig.from_dict(values)


def test_yaml_numbers_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 1e-4\nbeta: 0\nreward_funcs: [accuracy]\n")  # YAML reads 1e-4 as a string
    config = load_config(path, parse_overrides(["--max-steps", "3", "--epsilon_high=0.28", "--top_p", "0.9"]))
    assert config.learning_rate == 1e-4 and config.beta == 0.0 and isinstance(config.beta, float)
    assert config.max_steps == 3 and config.epsilon_high == 0.28 and config.top_p == 0.9
    assert config.reward_funcs == ["accuracy"]
    assert config.num_completions == 16 * 8


def test_config_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n- not a mapping\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(bad)
    bad.write_text("beta: -1\n")
    with pytest.raises(ConfigError, match=r"beta=-1.0 is out of range.*\(in .*bad.yaml\)"):
        load_config(bad)


def test_overrides_need_values():
    with pytest.raises(ConfigError, match="--beta needs a value"):
        parse_overrides(["--beta"])
    with pytest.raises(ConfigError, match="expected --key value"):
        parse_overrides(["beta", "0"])


def test_every_field_is_documented():
    assert all(len(text) > 10 for text in GRPOConfig.help().values())


def test_bad_device_is_named():
    from grpokit.runtime.device import resolve_device

    with pytest.raises(ValueError, match="device='gpu0' is not a device"):
        resolve_device("gpu0")


# What a resumed run may change, per trainer (the math stays the same): pinned, as checkpoints rely on it.
RESUMABLE_ANYWHERE = {"max_steps", "output_dir", "progress_bar", "save_every", "keep_checkpoints", "resume", "device",
                      "overwrite_output_dir", "micro_batch_size", "max_nonfinite_updates", "mixed_precision",
                      "tensorboard"}


@pytest.mark.parametrize("config_class, also", [
    (GRPOConfig, {"log_completions", "logprob_chunk_mb", "gradient_checkpointing", "reward_timeout", "on_reward_error",
                  "report_to", "project", "run_name", "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode",
                  "vllm_sync_check", "eval_every", "eval_samples", "eval_alarm_drop", "reference_placement",
                  "agent_concurrency", "agent_timeout"}),
    (SFTConfig, {"gradient_checkpointing"}),
    (RewardConfig, set()),
])
def test_resumable_keys_per_config(config_class, also):
    assert config_class.resumable_keys() == RESUMABLE_ANYWHERE | also


@pytest.mark.parametrize("config", [GRPOConfig(), SFTConfig(model="m"), RewardConfig(model="m")])
def test_a_dumped_config_names_its_class(config):
    dump = config.to_dict()
    assert config_class_of(dump) is type(config)
    del dump["progress_bar"], dump["seed"]  # a dump written before a key existed
    assert config_class_of(dump) is type(config)


def test_supervised_configs_list_their_own_keys_then_the_shared_ones():
    sft, reward = list(SFTConfig.help()), list(RewardConfig.help())
    assert sft[0] == reward[0] == "model"
    shared = sft[sft.index("device"):]
    assert reward[-len(shared):] == shared and shared[-1] == "progress_bar"
    starts = {name: (getattr(SFTConfig(model="m"), name), getattr(RewardConfig(model="m"), name))
              for name in ("epochs", "batch_size", "micro_batch_size", "learning_rate")}
    assert starts == {"epochs": (3.0, 1.0), "batch_size": (8, 16), "micro_batch_size": (8, 16),
                      "learning_rate": (2e-5, 1e-5)}
    assert [name for name in shared if SFTConfig.help()[name] != RewardConfig.help()[name]] == ["batch_size"]


def test_grpokit_config_hints_point_to_the_right_key():
    with pytest.raises(ConfigError, match="ratio_level") as error:
        GRPOConfig.from_dict({"importance_sampling_level": "sequence"})
    assert "prompt_sampling_floor" not in str(error.value)
    with pytest.raises(ConfigError, match="micro_batch_size.*grpokit.trl.GRPOConfig"):
        GRPOConfig.from_dict({"per_device_train_batch_size": 4})
    with pytest.raises(ConfigError, match="'per_device_train_batch_size'.*micro_batch_size"):  # the constructor too
        GRPOConfig(per_device_train_batch_size=4)


