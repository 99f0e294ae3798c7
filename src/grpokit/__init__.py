"""grpokit: GRPO (Group Relative Policy Optimization) for causal language models.

The objective's pure functions (``group_advantages``, ``process_advantages``, ``kl_penalty``,
``grpo_loss``) are the public core; ``GRPOTrainer`` and ``GRPOConfig`` run the loop, GRPO's or (with
``algorithm: ppo``) that of PPO, the baseline it replaces, whose GAE is ``gae``; ``format_reward`` and
``accuracy_reward`` are the built-in rule-based rewards, ``code_tests`` runs the programs in completions against
test cases in a sandbox (docs/data_and_rewards.md), ``OutcomeRewardModel`` and ``ProcessRewardModel`` are learned
ones, which ``RewardTrainer`` and ``RewardConfig`` train (docs/reward_models.md); ``SFTTrainer`` and ``SFTConfig``
run the supervised cold start before it (docs/sft.md).
``docs/architecture.md`` maps the modules.
"""

from grpokit.algorithms.grpo import GRPOTrainer
from grpokit.algorithms.reward import RewardTrainer
from grpokit.algorithms.sft import SFTTrainer
from grpokit.config import ConfigError, GRPOConfig, RewardConfig, SFTConfig, load_config
from grpokit.core.objective import (
    aggregate_loss,
    group_advantages,
    grpo_loss,
    kl_penalty,
    process_advantages,
    token_logprobs,
)
from grpokit.core.ppo_objective import gae, value_loss
from grpokit.data import DataError, load_jsonl
from grpokit.rewards.builtin import accuracy_reward, format_reward
from grpokit.rewards.calling import RewardError
from grpokit.rewards.code import code_tests
from grpokit.rewards.learned import OutcomeRewardModel, ProcessRewardModel
from grpokit.rollout.generate import Rollout, generate
from grpokit.runtime.versions import installed_version

__version__ = installed_version()

__all__ = [
    "ConfigError", "DataError", "GRPOConfig", "GRPOTrainer", "OutcomeRewardModel", "ProcessRewardModel",
    "RewardConfig", "RewardError", "RewardTrainer", "Rollout", "accuracy_reward",
    "aggregate_loss", "code_tests", "format_reward", "gae", "generate", "group_advantages", "grpo_loss", "kl_penalty",
    "SFTConfig", "SFTTrainer", "load_config", "load_jsonl", "process_advantages", "token_logprobs", "value_loss",
]
