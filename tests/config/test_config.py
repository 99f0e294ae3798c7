"""Config validation: every bad value names its key."""

import pytest

from grpokit.config import ConfigError, GRPOConfig, load_config, parse_overrides


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
        ({"reward_weights": [1.0]}, "reward_weights has 1 values but reward_funcs has 2"),
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
    from grpokit.models.loading import resolve_device

    with pytest.raises(ValueError, match="device='gpu0' is not a device"):
        resolve_device("gpu0")
