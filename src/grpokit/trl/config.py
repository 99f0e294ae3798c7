"""``GRPOConfig`` with TRL 1.16's names, defaults and meanings, and its translation to grpokit's (``to_grpokit``).

It is a ``transformers.TrainingArguments``, as TRL's is, with TRL's GRPO keys and TRL's own defaults
(``learning_rate=1e-6``, ``beta=0.0``, ``loss_type='dapo'``, ``logging_steps=10``, ``bf16`` on unless ``fp16``,
``gradient_checkpointing=True``, ...). What each key becomes is in :mod:`grpokit.trl.keys`; a key grpokit cannot
honour is refused at construction with a :class:`~grpokit.config.ConfigError` naming it, and an unknown keyword
names the closest TRL key.

Units: TRL's ``per_device_train_batch_size`` counts completions; a generation batch holds
``generation_batch_size`` = ``per_device_train_batch_size × processes × steps_per_generation`` completions
(``steps_per_generation`` defaults to ``gradient_accumulation_steps``), i.e. ``generation_batch_size /
num_generations`` prompts: grpokit's step (``prompts_per_step``). TRL's steps are optimizer steps: each generation
batch makes ``num_iterations × steps_per_generation / gradient_accumulation_steps`` of them (grpokit's
``num_iterations × num_minibatches``), so ``max_steps``, ``save_steps`` and ``logging_steps`` are divided by that.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from dataclasses import dataclass
from typing import Any

from transformers import TrainingArguments

from grpokit.config import ConfigError
from grpokit.config import GRPOConfig as GrpokitConfig
from grpokit.config.grpo import REAL_MODEL
from grpokit.trl import settings as values
from grpokit.trl.keys import MAPPED, NO_EFFECT, refusal


@dataclass
class GRPOConfig(TrainingArguments):
    """TRL 1.16's ``GRPOConfig``: the same keys and defaults; :meth:`to_grpokit` gives grpokit's config."""

    _given = {}  # noqa: RUF012 (not a field) the keywords given, set by __init__ before the dataclass's own
    _VALID_DICT_FIELDS = [*TrainingArguments._VALID_DICT_FIELDS, "model_init_kwargs",
                          "transformers_continuous_batching_config", "generation_kwargs", "chat_template_kwargs"]

    # TRL's defaults for TrainingArguments' keys (trl.trainer.base_config._BaseConfig). Those that suit a pretrained
    # model, and that grpokit's own GRPOConfig shares, are REAL_MODEL's (tested equal to TRL's).
    logging_steps: float = 10
    gradient_checkpointing: bool = True
    bf16: bool | None = None
    lr_scheduler_kwargs: dict | str | None = None
    use_liger_kernel: bool = False
    torch_empty_cache_steps: int | None = None
    learning_rate: float = REAL_MODEL["learning_rate"]
    # the model
    model_init_kwargs: dict[str, Any] | str | None = None
    trust_remote_code: bool = False
    router_aux_loss_coef: float | None = None
    disable_dropout: bool = False
    cast_lm_head_to_fp32: bool = False
    # the data
    remove_unused_columns: bool | None = False
    num_generations: int | None = REAL_MODEL["num_generations"]
    num_generations_eval: int | None = None
    max_completion_length: int | None = REAL_MODEL["max_completion_length"]
    ds3_gather_for_generation: bool = True
    shuffle_dataset: bool | None = True
    pad_to_multiple_of: int | str | None = "auto"
    # generation
    generation_batch_size: int | None = None
    steps_per_generation: int | None = None
    temperature: float = REAL_MODEL["temperature"]
    top_p: float = REAL_MODEL["top_p"]
    top_k: int = REAL_MODEL["top_k"]
    min_p: float | None = None
    generation_kwargs: dict | str | None = None
    chat_template_kwargs: dict | str | None = None
    repetition_penalty: float = REAL_MODEL["repetition_penalty"]
    cache_implementation: str | None = None
    use_vllm: bool = False
    vllm_mode: str = "colocate"
    vllm_model_impl: str = "vllm"
    vllm_enable_sleep_mode: bool = False
    vllm_structured_outputs_regex: str | None = None
    vllm_server_base_url: str | None = None
    vllm_server_host: str = "0.0.0.0"  # noqa: S104 (TRL's default)
    vllm_server_port: int = 8000
    vllm_server_timeout: float = 240.0
    vllm_group_port: int = 51216
    vllm_gpu_memory_utilization: float = 0.3
    vllm_max_model_length: int | None = None
    vllm_tensor_parallel_size: int = 1
    # training
    beta: float = 0.0
    num_iterations: int = REAL_MODEL["num_iterations"]
    epsilon: float = REAL_MODEL["epsilon"]
    delta: float | None = None
    epsilon_high: float | None = None
    sapo_temperature_neg: float = 1.05
    sapo_temperature_pos: float = 1.0
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    importance_sampling_level: str = "token"
    reward_weights: list[float] | None = None
    multi_objective_aggregation: str = "sum_then_normalize"
    scale_rewards: str = REAL_MODEL["scale_rewards"]
    loss_type: str = "dapo"
    mask_truncated_completions: bool = REAL_MODEL["mask_truncated_completions"]
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    use_adaptive_entropy: bool = False
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    entropy_target: float = 0.2
    max_tool_calling_iterations: int | None = None
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_max: float | None = 3.0
    vllm_importance_sampling_clip_min: float | None = None
    off_policy_mask_threshold: float | None = None
    use_bias_correction_kl: bool = True
    # logging
    log_completions: bool = False
    log_multimodal: bool = True
    num_completions_to_print: int | None = None
    log_unique_prompts: bool = False
    log_completions_hub_repo: str | None = None
    use_transformers_continuous_batching: bool = False
    transformers_continuous_batching_config: dict | str | None = None
    use_transformers_paged: bool = False
    vllm_importance_sampling_cap: float | None = None

    def __post_init__(self) -> None:
        values.precision(self)  # fp16: refused before transformers checks the hardware for it
        if self.bf16 is None and not self.fp16 and not self.use_cpu and not values.accelerator():
            # TRL's default bf16 stops a machine without a GPU ("use_cpu"); grpokit runs there: on the CPU, in fp32
            self.use_cpu, self.bf16 = True, False
        self.bf16 = not self.fp16 if self.bf16 is None else self.bf16
        # Refused keys away from their defaults, before transformers acts on them; an empty value (an argument parser
        # gives debug=None for the default '') is compared after transformers has normalised both, below.
        refused = {name: value for name, value in self._given.items()
                   if name not in MAPPED and name not in NO_EFFECT and value != _default(name)}
        for name, value in refused.items():
            if value not in (None, "", [], {}):
                raise ConfigError(refusal(name, value, _default(name)))
        if self.activation_checkpointing is None:  # transformers' newer name: TRL's default, without its warning
            self.activation_checkpointing = self.gradient_checkpointing
        super().__post_init__()
        for name, value in refused.items():
            if getattr(self, name) != getattr(_defaults(), name):
                raise ConfigError(refusal(name, value, _default(name)))
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)  # type: ignore
        if self.vllm_importance_sampling_cap is not None:
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        values.batch_arithmetic(self)
        self.grpokit_settings()  # every mapped key's value checked now, before any model is loaded

    @property
    def updates_per_generation(self) -> int:
        """TRL's optimizer steps per generation batch: grpokit's ``num_iterations × num_minibatches``."""
        return self.num_iterations * (self.steps_per_generation // self.gradient_accumulation_steps)

    @property
    def prompts_per_generation(self) -> int:
        return self.generation_batch_size // self.num_generations

    def grpokit_steps(self, num_rows: int | None = None) -> int:
        """grpokit's ``max_steps``: ``max_steps`` optimizer steps, or ``num_train_epochs`` passes over ``num_rows``
        prompts (as TRL counts them: whole generation batches only), in generation batches."""
        k = self.updates_per_generation
        if self.max_steps > 0:
            if self.max_steps % k:
                raise ConfigError(f"max_steps={self.max_steps} is not a whole number of generation batches: each makes "
                                  f"{k} optimizer steps (num_iterations × steps_per_generation / "
                                  "gradient_accumulation_steps); use a multiple of it")
            return self.max_steps // k
        if num_rows is None:
            raise ConfigError("max_steps=-1 (train for num_train_epochs) needs the dataset's size: pass train_dataset")
        batches = num_rows // self.prompts_per_generation
        if not batches:
            raise ConfigError(f"the dataset's {num_rows} prompts do not fill one generation batch of "
                              f"{self.prompts_per_generation} prompts (generation_batch_size / num_generations)")
        return math.ceil(math.ceil(self.num_train_epochs * batches * k) / k)

    def grpokit_settings(self, num_rows: int | None = None) -> dict[str, Any]:
        """The grpokit config keys with this config's meaning (``max_steps`` needs ``num_rows`` when it is -1)."""
        k = self.updates_per_generation
        settings: dict[str, Any] = {
            "output_dir": self.output_dir, "seed": self.seed, "device": "cpu" if self.use_cpu else "auto",
            "prompts_per_step": self.prompts_per_generation, "num_generations": self.num_generations,
            "micro_batch_size": self.per_device_train_batch_size, "num_iterations": self.num_iterations,
            "num_minibatches": self.steps_per_generation // self.gradient_accumulation_steps,
            "max_completion_length": self.max_completion_length, "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k or 0, "min_p": self.min_p or 0.0, "repetition_penalty": self.repetition_penalty,
            "aggregation": values.loss_type(self), "beta": self.beta, "kl_kind": "k3",
            "kl_ratio_weighted": self.use_bias_correction_kl and self.beta != 0, "epsilon": self.epsilon,
            "epsilon_high": self.epsilon_high,
            "scale_rewards": values.choice("scale_rewards", self.scale_rewards, ("group", "batch", "none")),
            "ratio_level": values.choice("importance_sampling_level", self.importance_sampling_level,
                                         ("token", "sequence")),
            "mask_truncated_completions": self.mask_truncated_completions, "reward_weights": self.reward_weights,
            "prompt_sampling": "uniform" if self.shuffle_dataset is not False else "in_order",
            "learning_rate": self.learning_rate, "lr_schedule": values.schedule(self),
            "warmup_steps": values.warmup(self, num_rows), "weight_decay": self.weight_decay,
            "adam_beta1": self.adam_beta1,
            "adam_beta2": self.adam_beta2, "optimizer": values.optimizer(self), "max_grad_norm": self.max_grad_norm,
            "mixed_precision": values.precision(self), "gradient_checkpointing": bool(self.gradient_checkpointing),
            "dtype": values.dtype(self), "report_to": values.trackers(self), "run_name": self.run_name,
            "project": self.project,
            "progress_bar": not self.disable_tqdm,
            "log_completions": (self.num_completions_to_print or self.generation_batch_size)
            if self.log_completions else 0,
            # checkpoints: TRL's every save_steps optimizer steps, grpokit's every save_every generation batches
            "save_every": 0 if values.save_strategy(self) == "no" else max(1, math.ceil(self.save_steps / k)),
            "keep_checkpoints": values.KEEP_ALL if self.save_total_limit is None else max(1, self.save_total_limit),
            **values.vllm(self),
        }
        values.refuse_values(self)
        if self.max_steps > 0 or num_rows is not None:
            settings["max_steps"] = self.grpokit_steps(num_rows)
        return settings

    def to_grpokit(self, num_rows: int | None = None, **overrides: Any) -> GrpokitConfig:
        """grpokit's :class:`~grpokit.config.GRPOConfig` with this config's meaning; ``overrides``: further grpokit keys
        (``model``, ``dataset``, ...)."""
        settings = {**self.grpokit_settings(num_rows), **overrides}
        settings.setdefault("max_steps", self.grpokit_steps(num_rows))
        return GrpokitConfig.from_dict(settings)


_FIELDS = {f.name: f for f in dataclasses.fields(GRPOConfig) if f.init}
_NAMES = [name for name in _FIELDS]


def _default(name: str) -> Any:
    f = _FIELDS[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


@functools.cache
def _defaults() -> GRPOConfig:
    """A config of TRL's defaults, as transformers normalises them (made once)."""
    return GRPOConfig(output_dir="defaults")


_dataclass_init = GRPOConfig.__init__


def _init(self: GRPOConfig, *args: Any, **kwargs: Any) -> None:
    for key in kwargs:
        if key not in _FIELDS:
            close = difflib.get_close_matches(key, _NAMES, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"grpokit.trl.GRPOConfig: {key!r} is not a key of TRL 1.16's GRPOConfig{hint}")
    object.__setattr__(self, "_given", {**dict(zip(_NAMES, args)), **kwargs})
    _dataclass_init(self, *args, **kwargs)


GRPOConfig.__init__ = _init  # type: ignore[method-assign]
