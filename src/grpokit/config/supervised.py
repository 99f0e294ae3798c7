"""``SFTConfig`` (``grpokit sft``) and ``RewardConfig`` (``grpokit reward train``): the two supervised trainers'
configs. Each one's own keys (model, data, held-out rows, ...) come first; the keys both take (device, dtype,
optimisation, checkpoints, logging) are declared once, in ``_SupervisedKeys``, and follow them.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

from grpokit.config.fields import TRL_OPTIM, ConfigError, _common, _Config, _DataKeys, _field, _with_default

# Names TRL's SFTConfig uses for what SFTConfig calls otherwise: an unknown key says which one it is.
TRL_SFT_NAMES = {
    "num_train_epochs": "epochs", "per_device_train_batch_size": "micro_batch_size",
    "gradient_accumulation_steps": "batch_size (sequences per optimizer step = micro_batch_size × accumulation)",
    "optim": TRL_OPTIM,
    "max_seq_length": "max_length", "save_steps": "save_every", "save_total_limit": "keep_checkpoints",
    "eval_steps": "eval_every", "lr_scheduler_type": "lr_schedule", "model_name_or_path": "model",
    "dataset_text_field": "prompt_column and completion_column", "resume_from_checkpoint": "resume",
    "dataset_name": "dataset (a Hub id, or 'hf:ID')",
}
REWARD_FORMS = ("auto", "labelled", "pairs", "steps")


@dataclass
class _SupervisedKeys(_Config):
    """The keys ``grpokit sft`` and ``grpokit reward train`` both take, with SFT's defaults (RewardConfig starts
    some elsewhere), and the checks both make (``model`` is each config's own key: its help differs)."""

    # ---- device ----------------------------------------------------------------------------------
    device: str = _common("device")
    dtype: str = _common("dtype")

    # ---- optimisation ----------------------------------------------------------------------------
    epochs: float = _field(3.0, "Passes over the training rows (fractions allowed); max_steps overrides it.", gt=0)
    max_steps: int | None = _field(
        None, "Optimizer steps to run; None: as many as `epochs` takes.", min=1, resumable=True
    )
    batch_size: int = _field(8, "Rows per optimizer step.", min=1)
    micro_batch_size: int = _field(
        8, "Rows per forward/backward pass; gradients accumulate over the step's rows (the loss does not "
        "depend on it).", min=1, resumable=True,
    )
    learning_rate: float = _common("learning_rate", 2e-5)
    lr_schedule: str = _common("lr_schedule")
    warmup_steps: int = _common("warmup_steps")
    weight_decay: float = _common("weight_decay")
    adam_beta1: float = _common("adam_beta1")
    adam_beta2: float = _common("adam_beta2")
    optimizer: str = _common("optimizer")
    max_grad_norm: float = _common("max_grad_norm")

    # ---- reliability and logging -----------------------------------------------------------------
    save_every: int = _field(
        100, "Write a checkpoint every this many steps, and always at the end and on SIGINT/SIGTERM; 0: only then.",
        min=0, resumable=True,
    )
    keep_checkpoints: int = _common("keep_checkpoints")
    resume: str | None = _common("resume")
    overwrite_output_dir: bool = _common("overwrite_output_dir")
    max_nonfinite_updates: int = _common("max_nonfinite_updates")
    tensorboard: bool = _field(
        False, "Also write every metric to output_dir/tensorboard (pip install 'grpokit[tensorboard]').",
        resumable=True,
    )
    progress_bar: bool = _common("progress_bar")

    def __post_init__(self) -> None:
        self._check_fields()
        if not self.model:
            raise ConfigError(f"model is required: {self.help()['model'].removeprefix('Required. ')}")
        if self.max_steps is not None and self.warmup_steps >= self.max_steps:
            raise ConfigError(f"warmup_steps={self.warmup_steps} leaves no step after warmup: max_steps is "
                              f"{self.max_steps}")


# A dataclass lists its bases' keys from the last base to the first: a config that subclasses
# (_SupervisedKeys, _ItsOwnKeys) lists its own keys first, then the shared ones.

@dataclass
class _SFTKeys(_DataKeys):
    """SFTConfig's own keys."""

    # ---- model and data --------------------------------------------------------------------------
    model: str | None = _field(None, "Required. A Hugging Face causal LM (AutoModelForCausalLM + AutoTokenizer): a "
                               "local directory or a Hub model id (as grpokit train's model), or 'builtin:arithmetic'.")
    dataset: str | None = _field(
        None, "Required (unless rows are passed in Python). Rows with a prompt and a completion column: a JSONL "
        "file, a CSV file with a header, a .parquet file, a directory written by datasets' save_to_disk, a dataset "
        "folder, or a Hugging Face Hub dataset id (as grpokit train's dataset)."
    )
    prompt_column: str = _field(
        "prompt", "Column holding the prompt: text, or a list of {role, content} chat messages."
    )
    completion_column: str = _field(
        "completion", "Column holding the completion to learn: text (followed by EOS), or a list of assistant "
        "{role, content} messages rendered by the chat template after the prompt."
    )
    system_prompt: str | None = _field(
        None, "A system message put before every prompt, as in grpokit train (use the same one in both)."
    )
    chat_template: bool | None = _field(None, "Render prompts with the tokenizer's chat template (with the "
                                        "generation prompt), as grpokit train does: None = when it has one.")
    max_length: int | None = _field(
        None, "Tokens of prompt + completion kept per row; longer completions are cut at the end (counted, "
        "metric 'truncated'); rows whose prompt alone fills it are left out (counted). None: the model's "
        "context (max_position_embeddings).", min=2,
    )
    eval_fraction: float = _field(
        0.0, "Share of the rows held out (a seeded draw) to measure the held-out loss 'eval_loss'; 0: none.",
        min=0, lt=1,
    )
    eval_dataset: str | None = _field(
        None, "Held-out rows of their own (the dataset's formats and columns; a Hub id: its dataset_test_split), "
        "instead of eval_fraction."
    )
    eval_every: int = _field(
        0, "Measure the held-out loss every this many steps, and always after the last; 0: after the last only.",
        min=0,
    )
    output_dir: str = _field(
        "runs/sft", "Run directory: config.yaml, metrics.jsonl, checkpoints/, and the trained model in model/.",
        resumable=True,
    )
    seed: int = _field(0, "Seed for the held-out draw, the data order and LoRA's initialisation.")

    # ---- LoRA (pip install 'grpokit[lora]'; docs/lora.md) ----------------------------------------
    lora_rank: int = _field(
        0, "LoRA rank r (peft); 0 trains every weight. The final model/ holds the adapter merged into the "
        "weights (what grpokit train loads); adapter/ the adapter alone.", min=0
    )
    lora_alpha: float = _common("lora_alpha")
    lora_dropout: float = _common("lora_dropout")
    lora_target_modules: list[str] | None = _common("lora_target_modules")

    # ---- the passes ------------------------------------------------------------------------------
    mixed_precision: str = _field(
        "auto", "'bf16': forward passes under bfloat16 autocast; weights, gradients, optimizer states and the "
        "loss stay float32. 'no': float32 throughout. 'auto': as in `grpokit train` (bf16 only where the hardware "
        "computes it natively), decided at start-up and printed.", choices=("auto", "no", "bf16"), resumable=True,
    )
    fast_path: bool = _field(
        True, "Run Llama-family models through grpokit's own forward, which computes no padding (same math; "
        "see GRPOConfig.fast_path)."
    )
    gradient_checkpointing: bool = _field(
        False, "Recompute each decoder layer's activations in backward (see GRPOConfig.gradient_checkpointing).",
        resumable=True,
    )


@dataclass
class SFTConfig(_SupervisedKeys, _SFTKeys):
    """Supervised fine-tuning on prompt/completion rows (``grpokit sft``; docs/sft.md): the cold start
    whose output directory ``grpokit train`` takes as ``model``."""

    TRL_NAMES: typing.ClassVar[dict[str, str]] = TRL_SFT_NAMES

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eval_fraction and self.eval_dataset:
            raise ConfigError("eval_fraction and eval_dataset both choose held-out rows; set one of them")


@dataclass
class _RewardKeys(_DataKeys):
    """RewardConfig's own keys: the model, the rows and their form, the held-out rows, the run directory, the
    seed and the precision."""

    model: str | None = _field(
        None, "Required. The backbone: a Hugging Face causal LM, a local directory or a Hub id (DeepSeekMath "
        "initialises its reward model from the policy's SFT model: give grpokit sft's output_dir/model), "
        "'gguf:FILE', or 'builtin:arithmetic'. Its LM head is dropped and a new, randomly initialised classification "
        "head with one label is trained with it (a directory already holding such a classifier continues from its "
        "head)."
    )
    dataset: str | None = _field(
        None, "Required (unless rows are passed in Python). A JSONL file, a CSV file with a header, a .parquet "
        "file, a directory written by datasets' save_to_disk, a dataset folder, or a Hugging Face Hub dataset id (as "
        "grpokit train's dataset), in one of the three forms of `form` (what `grpokit sample` writes)."
    )
    form: str = _field(
        "auto", "The rows' form: 'labelled' {prompt, completion, label} (outcome model), 'pairs' {prompt, "
        "chosen, rejected} (outcome model, Bradley-Terry), 'steps' {prompt, completion, steps: [[offset, "
        "label], ...]} (process model). 'auto': from the first row's columns, steps before pairs before "
        "labelled.", choices=REWARD_FORMS,
    )
    label_loss: str = _field(
        "auto", "Labelled rows: 'bce' (binary cross-entropy with logits: labels in [0, 1]), 'mse' (mean squared "
        "error of the logit: any real label), or 'auto' (bce when every label is 0 or 1, else mse).",
        choices=("auto", "bce", "mse"),
    )
    prompt_column: str = _field("prompt", "Column holding the prompt: text, or a list of {role, content} messages.")
    completion_column: str = _field(
        "completion", "Labelled and step rows: the column holding the completion (text, or assistant messages)."
    )
    label_column: str = _field("label", "Labelled rows: the column holding each completion's label (a number).")
    chosen_column: str = _field("chosen", "Pairs: the column holding the preferred completion.")
    rejected_column: str = _field("rejected", "Pairs: the column holding the other completion.")
    steps_column: str = _field(
        "steps", "Step rows: the column holding [[offset, label], ...]: each step's end (an exclusive character "
        "offset into the completion, increasing, 1 to its length) and its label in [0, 1] (a JSON string in CSV)."
    )
    max_length: int | None = _field(
        None, "Tokens kept per text; longer texts are cut as the reward model cuts them when scoring (an "
        "outcome text keeps its end, a step text its start, the steps past the cut dropped), counted. None: "
        "the model's context.",
        min=2,
    )
    eval_fraction: float = _field(
        0.1, "Share of the rows held out (a seeded draw) for eval_loss and eval_accuracy; 0: none. Not used "
        "when eval_dataset is given.", min=0, lt=1,
    )
    eval_dataset: str | None = _field(
        None, "Held-out rows of their own (the dataset's formats, form and columns; a Hub id: its "
        "dataset_test_split), instead of eval_fraction."
    )
    eval_every: int = _field(
        0, "Measure the held-out loss and accuracy every this many steps, and always after the last; 0: after "
        "the last only.", min=0,
    )
    output_dir: str = _field(
        "runs/reward", "Run directory: config.yaml, metrics.jsonl, checkpoints/, and the trained reward model "
        "in model/ (with its tokenizer).", resumable=True,
    )
    seed: int = _field(0, "Seed for the new head's initialisation, the held-out draw and the data order.")
    mixed_precision: str = _field(
        "auto", "'bf16': forward passes under bfloat16 autocast; weights, gradients, optimizer states and the "
        "loss stay float32. 'no': float32 throughout. 'auto': as in `grpokit train`, decided at start-up and "
        "printed.", choices=("auto", "no", "bf16"), resumable=True,
    )


@dataclass
class RewardConfig(_SupervisedKeys, _RewardKeys):
    """Training a reward model (``grpokit reward train``; docs/reward_models.md): an outcome model from
    labelled rows or preference pairs, a process model from step-labelled rows, its output directory what
    ``grpokit train`` takes as ``reward_funcs: [model:DIR]`` or ``[process_model:DIR]``."""

    TRL_NAMES: typing.ClassVar[dict[str, str]] = TRL_SFT_NAMES

    # Shared keys it starts elsewhere (they keep their place in the listing); a batch of pairs counts pairs.
    epochs: float = _with_default(_SupervisedKeys, "epochs", 1.0)
    batch_size: int = _field(16, "Rows (pairs, for pairs) per optimizer step.", min=1)
    micro_batch_size: int = _with_default(_SupervisedKeys, "micro_batch_size", 16)
    learning_rate: float = _with_default(_SupervisedKeys, "learning_rate", 1e-5)
