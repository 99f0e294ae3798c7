"""What every grpokit config is made of: ``_field`` (a key's default, help, bounds and whether a resumed run may
change it), the options the configs share (``_COMMON``, taken with ``_common``), and ``_Config``, the base that
coerces and bound-checks each key, builds a config from a dict (refusing unknown keys, naming the one at fault),
dumps and documents it. :class:`ConfigError` is what every config check raises.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import types
import typing
from dataclasses import field
from typing import Any

from grpokit.core.optim import NO_BITSANDBYTES, OPTIMIZER_HELP, OPTIMIZERS

TRL_OPTIM = "optimizer ('adamw', or 'adamw_8bit' for TRL's 'adamw_8bit')"  # what TRL's `optim` is here


class ConfigError(ValueError):
    """A configuration value is unknown, ill-typed or out of range; the message names the key."""


def _field(default: Any, help: str, **kwargs: Any) -> Any:
    """A config key: its default, its ``help`` text, and in its metadata the bounds ``_check_bounds`` reads
    (``choices``, ``min``, ``max``, ``gt``, ``lt``) and ``resumable=True`` for a key a resumed run may change
    (``_Config.resumable_keys``)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kwargs})
    return field(default=default, metadata={"help": help, **kwargs})




# Options that `grpokit train`, `grpokit sft` and `grpokit reward train` share, each decided here once (help,
# bounds, whether a resume may change it, default); a config class takes one with ``_common(name)``, changing the
# default where it differs.
_COMMON: dict[str, tuple[Any, str, dict[str, Any]]] = {
    # how `dataset` and `eval_dataset` read a source that has configs and splits (TRL's ScriptArguments' names)
    "dataset_config": (None, "The config (subset) of a dataset that has several: a Hugging Face Hub id or a dataset "
                       "folder (e.g. 'main' for openai/gsm8k); None: its only or default one. Applies to dataset and "
                       "eval_dataset.", {}),
    "dataset_train_split": ("train", "The split `dataset` reads from a source with splits: a Hub id, a dataset "
                            "folder, a save_to_disk DatasetDict.", {}),
    "dataset_test_split": ("test", "The split `eval_dataset` (and `grpokit eval`'s dataset) reads from a source with "
                           "splits.", {}),
    "dataset_columns": (None, "Columns renamed as dataset and eval_dataset load, {old: new} (e.g. {question: prompt}): "
                        "a Hub dataset's or a file's rows (rows passed in Python are taken as they are).", {}),
    "device": ("auto", "'auto' (CUDA when available, else CPU), 'cpu', 'cuda' or 'cuda:N'.", {"resumable": True}),
    "dtype": ("auto", "Weights' dtype when loading `model`: 'auto' (as saved), 'float32', 'bfloat16' or 'float16'. "
              "Losses, and the log-probabilities GRPO and SFT read, are computed in float32 whatever it is.",
              {"choices": ("auto", "float32", "bfloat16", "float16")}),
    "learning_rate": (2e-4, "Peak AdamW learning rate.", {"gt": 0}),
    "lr_schedule": ("linear", "After warmup: 'linear' decay to 0, 'cosine' decay to 0, or 'constant'.",
                    {"choices": ("linear", "cosine", "constant")}),
    "warmup_steps": (0, "Optimizer steps of linear warmup from 0.", {"min": 0}),
    "weight_decay": (0.0, "AdamW weight decay.", {"min": 0}),
    "adam_beta1": (0.9, "AdamW β1, the decay of the gradient's running mean.", {"min": 0, "lt": 1}),
    "adam_beta2": (0.999, "AdamW β2, the decay of the squared gradient's running mean.", {"min": 0, "lt": 1}),
    "optimizer": ("adamw", OPTIMIZER_HELP, {"choices": OPTIMIZERS}),
    "max_grad_norm": (1.0, "Clip the gradient's global norm to this (0 disables).", {"min": 0}),
    "lora_alpha": (16.0, "LoRA scaling α (the update is scaled by α / r).", {"gt": 0}),
    "lora_dropout": (0.0, "Dropout on the LoRA branch.", {"min": 0, "lt": 1}),
    "lora_target_modules": (None, "Module names to adapt (e.g. [q_proj, v_proj]); [all-linear]: every linear "
                            "layer but the output head (peft's 'all-linear'); None: peft's default for the "
                            "architecture.", {}),
    "keep_checkpoints": (2, "Keep this many most recent checkpoints in output_dir/checkpoints.",
                         {"min": 1, "resumable": True}),
    "resume": (None, "Resume from a checkpoint: 'latest' (the newest under output_dir/checkpoints), 'auto' (the "
               "newest if there is one, else start: for torchrun --max-restarts) or its path.",
               {"resumable": True}),
    "overwrite_output_dir": (False, "Start this run in an output_dir that holds another run's files (run.json, "
                             "config.yaml, metrics.jsonl, checkpoints/, model/, ...), deleting them first; false: "
                             "such a run is refused (resume: latest continues the old run instead). Other files in the "
                             "folder are left alone.", {"resumable": True}),
    "max_nonfinite_updates": (3, "A non-finite loss or gradient norm skips the update; this many in a row stop "
                              "training.", {"min": 1, "resumable": True}),
    "progress_bar": (True, "Show a progress bar on the console.", {"resumable": True}),
}


def _common(name: str, default: Any = dataclasses.MISSING) -> Any:
    value, help, bounds = _COMMON[name]
    return _field(value if default is dataclasses.MISSING else default, help, **bounds)


def _with_default(config: type, name: str, default: Any) -> Any:
    """``config``'s key ``name`` (help, bounds, resumable) with another default: for a config that shares a key
    declared elsewhere but starts it elsewhere."""
    (declared,) = [f for f in dataclasses.fields(config) if f.name == name]
    return _field(default, **declared.metadata)


class _Config:
    """What every grpokit config does with its fields: coerce and bound-check them, build from a dict refusing
    unknown keys (with a suggestion, and ``TRL_NAMES``' translations of TRL's names), dump, document."""

    TRL_NAMES: typing.ClassVar[dict[str, str]] = {}
    TRL_HINT: typing.ClassVar[str] = ""  # after a TRL name's translation
    # Keys grpokit no longer reads, with what replaced them: refused by name; ignored in old checkpoints' configs.
    REMOVED: typing.ClassVar[dict[str, str]] = {}

    def _check_fields(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = _coerce(f.name, getattr(self, f.name), hints[f.name])
            object.__setattr__(self, f.name, value)
            _check_bounds(f.name, value, f.metadata)
        if getattr(self, "optimizer", None) == "adamw_8bit" and importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(NO_BITSANDBYTES)

    def __new__(cls, *args: Any, **kwargs: Any) -> typing.Self:
        # An unknown keyword is refused as from_dict refuses it (a hint, not the dataclass's bare TypeError).
        cls._refuse_unknown(kwargs)
        return super().__new__(cls)

    @classmethod
    def _refuse_unknown(cls, values: typing.Iterable[str]) -> None:
        known = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key not in known:
                if key in cls.REMOVED:
                    raise ConfigError(f"config key {key!r} was removed: {cls.REMOVED[key]}")
                if key in cls.TRL_NAMES:
                    hint = f"; TRL's {key!r} is {cls.TRL_NAMES[key]} here{cls.TRL_HINT}"
                else:
                    close = difflib.get_close_matches(str(key), sorted(known), n=1)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"unknown config key {key!r}{hint}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> typing.Self:
        """Build a config, refusing unknown keys with a suggestion."""
        cls._refuse_unknown(values)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def help(cls) -> dict[str, str]:
        return {f.name: f.metadata["help"] for f in dataclasses.fields(cls)}

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every key's default."""
        return {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
                for f in dataclasses.fields(cls)}

    @classmethod
    def resumable_keys(cls) -> frozenset[str]:
        """The keys that may differ between a checkpoint's config and the run that resumes it (declared with
        ``resumable=True``): they do not change the math."""
        return frozenset(f.name for f in dataclasses.fields(cls) if f.metadata.get("resumable"))


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(name: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; allow int → float and numeric strings → float
    (YAML reads ``1e-4`` as a string)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(name, value, inner)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{name} must be a mapping, got {type(value).__name__} {value!r}")
        key_type, value_type = typing.get_args(tp)
        return {_coerce(f"{name} key", k, key_type): _coerce(f"{name}[{k!r}]", v, value_type) for k, v in value.items()}
    if origin is list:
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise ConfigError(f"{name} must be a list, got {type(value).__name__} {value!r}")
        (inner,) = typing.get_args(tp)
        return [_coerce(f"{name}[{i}]", item, inner) for i, item in enumerate(value)]
    if tp is float:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is str and callable(value) and name.startswith("reward_funcs"):
        return value  # the Python API accepts reward callables
    elif isinstance(value, tp):
        return value
    raise ConfigError(f"{name} must be {_type_name(tp)}, got {type(value).__name__} {value!r}")


def _check_bounds(name: str, value: Any, meta: typing.Mapping[str, Any]) -> None:
    if value is None:
        return
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(f"{name}={value!r} is not valid; choose one of {', '.join(map(repr, meta['choices']))}")
    checks = [("min", lambda v, b: v >= b, ">="), ("max", lambda v, b: v <= b, "<="),
              ("gt", lambda v, b: v > b, ">"), ("lt", lambda v, b: v < b, "<")]
    for key, ok, symbol in checks:
        if key in meta and not ok(value, meta[key]):
            raise ConfigError(f"{name}={value!r} is out of range; it must be {symbol} {meta[key]}")


def check_reward_weights(weights: list[float] | None, num_functions: int) -> None:
    """``reward_weights`` holds one weight per reward function, or is None (1.0 each)."""
    if weights is not None and len(weights) != num_functions:
        raise ConfigError(f"reward_weights has {len(weights)} values but reward_funcs has {num_functions}; give "
                          "one weight per function")


@dataclasses.dataclass
class _DataKeys(_Config):
    """The keys every trainer starts its listing with: ``model``, ``dataset``, then how the dataset's source is read
    (``_COMMON``'s four dataset keys, declared here once). Each config re-declares ``model`` and ``dataset`` with its
    own help; a re-declared dataclass field keeps its place, so the order holds."""

    model: str | None = _field(None, "Required. The model.")
    dataset: str | None = _field(None, "The rows.")
    dataset_config: str | None = _common("dataset_config")
    dataset_train_split: str = _common("dataset_train_split")
    dataset_test_split: str = _common("dataset_test_split")
    dataset_columns: dict[str, str] | None = _common("dataset_columns")
