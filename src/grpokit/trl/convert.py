"""What :class:`grpokit.trl.GRPOTrainer` translates besides the config: TRL's reward functions and models, a peft
``LoraConfig``, the dataset's prompt format, and grpokit's metrics under TRL's names."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from grpokit.config import ConfigError

# grpokit's metric → TRL's name for it (the grpokit name is logged too)
TRL_METRICS = {
    "completion_length_mean": "completions/mean_length", "completion_length_min": "completions/min_length",
    "completion_length_max": "completions/max_length", "truncated_frac": "completions/clipped_ratio",
    "clipfrac_low": "clip_ratio/low_mean", "clipfrac_high": "clip_ratio/high_mean",
    "clipfrac": "clip_ratio/region_mean", "lr": "learning_rate", "frac_zero_std_groups": "frac_reward_zero_std",
}
_LORA_DEFAULTS = {"bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None,
                  "layers_to_transform": None, "init_lora_weights": True}


def trl_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` (one grpokit step's) with TRL's names added: ``rewards/NAME/mean``, ``completions/...``,
    ``clip_ratio/...``, ``learning_rate``, ``frac_reward_zero_std``."""
    named = dict(metrics)
    for key, value in metrics.items():
        if key.startswith("rewards/") and key.count("/") == 1:
            named[f"{key}/mean"] = value
        elif key in TRL_METRICS:
            named[TRL_METRICS[key]] = value
    return named


def window_mean(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Each numeric metric's mean over the steps since the last log (TRL logs such means), None values left out;
    ``learning_rate`` is the last step's."""
    logs: dict[str, float] = {}
    for key in dict.fromkeys(k for record in records for k in record):
        values = [r[key] for r in records if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        values = [float(v) for v in values if not math.isnan(v)]
        if values and key not in ("step", "learning_rate", "lr"):
            logs[key] = sum(values) / len(values)
    if records and "learning_rate" in records[-1]:
        logs["learning_rate"] = records[-1]["learning_rate"]
    return logs


def reward_functions(reward_funcs: Any) -> list[str | Callable]:
    """TRL's ``reward_funcs`` (one or a list: callables, or reward model ids / paths) as grpokit's entries."""
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not funcs:
        raise ConfigError("reward_funcs is empty; give at least one reward function")
    entries: list[str | Callable] = []
    for fn in funcs:
        if isinstance(fn, str):
            entries.append(fn if fn.startswith(("model:", "process_model:")) else f"model:{fn}")
        elif hasattr(fn, "config") and hasattr(fn, "forward"):
            raise ConfigError("reward_funcs: a loaded reward model is not supported; pass its path or Hub id "
                              "(saved with save_pretrained: grpokit loads it as 'model:DIR')")
        elif callable(fn):
            entries.append(fn)
        else:
            raise ConfigError(f"reward_funcs: {fn!r} is neither a callable nor a reward model's path or id")
    return entries


def lora_settings(peft_config: Any) -> dict[str, Any]:
    """A peft ``LoraConfig`` as grpokit's keys (``lora_rank``, ``lora_alpha``, ``lora_dropout``,
    ``lora_target_modules``); anything else it sets is refused, naming it."""
    if peft_config is None:
        return {}
    if type(peft_config).__name__ != "LoraConfig":
        raise ConfigError(f"peft_config: a {type(peft_config).__name__} is not supported; grpokit trains LoRA adapters "
                          "(peft.LoraConfig)")
    for key, default in _LORA_DEFAULTS.items():
        value = getattr(peft_config, key, default)
        if value != default:
            raise ConfigError(f"peft_config: {key}={value!r} is not supported by grpokit's LoRA; leave it {default!r}")
    targets = peft_config.target_modules
    if targets == "all-linear":
        targets = ["all-linear"]  # grpokit's lora_target_modules: [all-linear]
    elif isinstance(targets, str):
        raise ConfigError(f"peft_config: target_modules={targets!r} (a pattern) is not supported; list the module "
                          "names (e.g. ['q_proj', 'v_proj']), 'all-linear', or None (peft's default)")
    return {"lora_rank": int(peft_config.r), "lora_alpha": float(peft_config.lora_alpha),
            "lora_dropout": float(peft_config.lora_dropout),
            "lora_target_modules": sorted(targets) if targets is not None else None}


def prompt_format(rows: Sequence[dict[str, Any]]) -> bool | None:
    """grpokit's ``chat_template`` for TRL's formats: a conversational prompt (a list of messages) is rendered with the
    chat template (None: grpokit requires it), a standard one (text) is read as it is (False), as TRL does."""
    if not rows or "prompt" not in rows[0]:
        raise ConfigError("train_dataset: TRL's prompt-only format needs a 'prompt' column (text, or a list of "
                          "{role, content} messages)")
    return None if isinstance(rows[0]["prompt"], list) else False
