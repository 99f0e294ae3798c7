"""``GRPOConfig``, ``SFTConfig`` and ``RewardConfig``: flat, documented, validated dataclasses for a GRPO
run, a supervised cold start (``grpokit sft``) and the training of a reward model (``grpokit reward train``).

Every field has a ``help`` text (shown by ``grpokit train --help`` / ``grpokit sft --help`` and in the
docs). Values are checked on construction; unknown keys, wrong types and out-of-range values raise
:class:`ConfigError` naming the key. Load one from YAML with :func:`load_config`, with ``--key value`` overrides.
The keys a resumed run may change are declared with the keys (``resumable_keys()``).

``fields`` holds what every config is made of, ``grpo`` the GRPO run's keys, ``supervised`` SFT's and the
reward model's, ``loading`` the YAML and ``--key value`` reading.
"""

from grpokit.config.fields import TRL_OPTIM, ConfigError, check_reward_weights
from grpokit.config.grpo import DEFAULT_CHUNK_MB, GRPOConfig
from grpokit.config.grpo_checks import ENGINES, TRACKERS, reward_funcs_of
from grpokit.config.loading import CONFIG_CLASSES, config_class_of, load_config, parse_overrides
from grpokit.config.supervised import REWARD_FORMS, TRL_SFT_NAMES, RewardConfig, SFTConfig

__all__ = [
    "CONFIG_CLASSES", "DEFAULT_CHUNK_MB", "ENGINES", "REWARD_FORMS", "TRACKERS", "TRL_OPTIM", "TRL_SFT_NAMES",
    "ConfigError", "GRPOConfig", "RewardConfig", "SFTConfig", "check_reward_weights", "config_class_of", "load_config",
    "parse_overrides", "reward_funcs_of",
]
