"""``SFTTrainer``: supervised fine-tuning on prompt/completion rows — DeepSeek-R1's "cold start", the
stage before RL that teaches a model the format GRPO's rewards look for (docs/sft.md).

    grpokit sft examples/sft.yaml                      # writes runs/sft/model
    grpokit train examples/jsonl_dataset.yaml --model runs/sft/model

    trainer = SFTTrainer(SFTConfig(model="path/to/model", dataset="cold_start.jsonl"))
    trainer.train()

Each row becomes exactly the token sequence ``grpokit train`` would score had the model sampled the
completion: the prompt rendered by :func:`~grpokit.data.render_prompt` and tokenized as the sampler
tokenizes it, then the completion's own tokens, ending at a stop token (EOS appended unless the
completion already ends with one). Prompt and completion are tokenized apart, as in sampling, so no
token merges across their border. The loss is the negative log-likelihood of the completion tokens
alone (:meth:`SFTTrainer.loss`), computed by the same :func:`~grpokit.models.logprobs.sequence_logprobs` and
optimizer step (:func:`~grpokit.training.update.update`) as GRPO's; the run loop and checkpoints are the engine's
(:mod:`grpokit.training.engine`).

It runs in one process (no torchrun).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from grpokit.config import ConfigError, SFTConfig
from grpokit.data import DataError, check_columns, given_rows, render_prompt, row_place
from grpokit.models.loading import ensure_pad_token, save_pretrained
from grpokit.models.logprobs import sequence_logprobs
from grpokit.models.lora import with_lora
from grpokit.resolve import dataset_options, load_model_and_tokenizer, load_rows
from grpokit.rollout.generate import Rollout, stop_token_ids
from grpokit.runtime.device import autocast
from grpokit.training.supervised import SupervisedTrainer, split
from grpokit.training.update import LossCounts, UpdateBatch, update

__all__ = ["Example", "SFTTrainer", "collate", "completion_text", "tokenize_rows"]


# ---- rows → tokens -------------------------------------------------------------------------------


@dataclass
class Example:
    """One row as the model reads it."""

    prompt_ids: list[int]  # the rendered prompt, tokenized as the sampler tokenizes prompts
    completion_ids: list[int]  # the completion's tokens, ending at a stop token unless truncated
    truncated: bool  # cut to max_length


def check_completions(rows: Sequence[dict[str, Any]], column: str, source: str) -> None:
    """Every completion is non-empty text or a non-empty list of ``{role, content}`` messages (the
    column's presence is :func:`~grpokit.data.check_columns`'s)."""
    for index, row in enumerate(rows):
        value, where = row[column], f"{source}: {row_place(row, index)} column {column!r}"
        if isinstance(value, list):
            if not value or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                    and isinstance(m.get("content"), str) for m in value):
                raise DataError(f"{where} must be text or a non-empty list of {{\"role\": ..., \"content\": ...}} "
                                "messages")
            if not any(m["content"] for m in value):
                raise DataError(f"{where} has no content")
        elif not isinstance(value, str):
            raise DataError(f"{where} must be text (or a list of chat messages), got {type(value).__name__} "
                            f"{value!r:.40}")
        elif not value:
            raise DataError(f"{where} is empty")


def completion_text(tokenizer: Any, prompt: str | list[dict[str, str]], completion: str | list[dict[str, str]],
                    prompt_text: str, *, system_prompt: str | None = None, chat_template: bool | None = None) -> str:
    """The text that follows ``prompt_text`` (the prompt as :func:`~grpokit.data.render_prompt`
    renders it). Text is itself; a list of assistant messages is what the chat template renders after the
    prompt when the conversation continues with them (its end-of-turn token included), as TRL does."""
    if isinstance(completion, str):
        return completion
    if getattr(tokenizer, "chat_template", None) is None or (chat_template is False and isinstance(prompt, str)):
        raise ValueError("a completion given as chat messages needs the tokenizer's chat template "
                         "(it has none, or chat_template is false)")
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    full = tokenizer.apply_chat_template([*messages, *completion], tokenize=False)
    if not full.startswith(prompt_text):
        raise ValueError("the chat template renders the prompt differently when a reply follows it, so the "
                         "completion cannot be told apart; give the completion as text")
    return full[len(prompt_text):]


def tokenize_rows(rows: Sequence[dict[str, Any]], tokenizer: Any, config: SFTConfig, stop_ids: Sequence[int],
                  max_length: int | None, source: str) -> list[Example | None]:
    """Each row's :class:`Example`; None for a row whose prompt alone fills ``max_length`` (no completion
    token would remain). A completion ends at its last stop token (a chat template's text after the
    end-of-turn token, such as a newline, is dropped: sampling stops there); one without gets
    ``tokenizer.eos_token_id`` appended. Errors name ``source``, the row and the column."""
    prompts, completions = [], []
    for index, row in enumerate(rows):
        prompt = row[config.prompt_column]
        column = config.prompt_column
        try:
            text = render_prompt(tokenizer, prompt, system_prompt=config.system_prompt,
                                 chat_template=config.chat_template)
            prompts.append(text)
            column = config.completion_column
            completions.append(completion_text(tokenizer, prompt, row[config.completion_column], text,
                                               system_prompt=config.system_prompt, chat_template=config.chat_template))
        except ValueError as error:
            raise DataError(f"{source}: {row_place(row, index)} column {column!r}: {error}") from None
    # Prompts as Sampler.tokenize_prompts tokenizes them (special tokens included); completions bare.
    prompt_ids = tokenizer(prompts)["input_ids"]
    completion_ids = tokenizer(completions, add_special_tokens=False)["input_ids"]
    examples: list[Example | None] = []
    stops = set(stop_ids)
    for prompt, completion in zip(prompt_ids, completion_ids):
        ends = [i for i, token in enumerate(completion) if token in stops]
        completion = completion[: ends[-1] + 1] if ends else [*completion, tokenizer.eos_token_id]
        if max_length is not None and len(prompt) >= max_length:
            examples.append(None)
            continue
        room = len(completion) if max_length is None else max_length - len(prompt)
        examples.append(Example(prompt, completion[:room], truncated=len(completion) > room))
    return examples


def collate(examples: Sequence[Example], pad_token_id: int, device: torch.device | str = "cpu") -> Rollout:
    """The examples in the layout a rollout has (what :func:`~grpokit.models.logprobs.sequence_logprobs` reads):
    prompts left-padded, completions right-padded; the completion mask is 1 on every completion token.
    ``logp`` is unused (zeros); ``truncated`` marks the examples cut to ``max_length``."""
    prompt_width = max(len(e.prompt_ids) for e in examples)
    width = max(len(e.completion_ids) for e in examples)
    prompt_ids = [[pad_token_id] * (prompt_width - len(e.prompt_ids)) + e.prompt_ids for e in examples]
    prompt_mask = [[0] * (prompt_width - len(e.prompt_ids)) + [1] * len(e.prompt_ids) for e in examples]
    completion_ids = [e.completion_ids + [pad_token_id] * (width - len(e.completion_ids)) for e in examples]
    completion_mask = [[1] * len(e.completion_ids) + [0] * (width - len(e.completion_ids)) for e in examples]
    tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return Rollout(tensor(prompt_ids), tensor(prompt_mask), tensor(completion_ids), tensor(completion_mask),
                   logp=torch.zeros(len(examples), width, device=device),
                   truncated=torch.tensor([e.truncated for e in examples], device=device))


def trim(rollout: Rollout) -> Rollout:
    """The rollout without the columns that are padding in every row (a micro-batch selected from a
    wider batch)."""
    prompt_width = int(rollout.prompt_mask.sum(dim=1).max())
    width = int(rollout.completion_mask.sum(dim=1).max())
    return Rollout(rollout.prompt_ids[:, -prompt_width:], rollout.prompt_mask[:, -prompt_width:],
                   rollout.completion_ids[:, :width], rollout.completion_mask[:, :width], rollout.logp[:, :width],
                   rollout.truncated)


# ---- the trainer ---------------------------------------------------------------------------------


class SFTTrainer(SupervisedTrainer):
    """Supervised fine-tuning of a causal LM on prompt/completion rows, on the run loop of
    :class:`~grpokit.training.engine.Trainer`. Anything not passed is built from the config;
    ``train_dataset`` / ``eval_dataset``: rows (dicts, or a ``datasets.Dataset``) instead of the config's."""

    label, postfix = "SFT", ("loss", "eval_loss")

    def __init__(self, config: SFTConfig, *, model: torch.nn.Module | None = None, tokenizer: Any = None,
                 train_dataset: Iterable[dict[str, Any]] | None = None,
                 eval_dataset: Iterable[dict[str, Any]] | None = None):
        super().__init__()
        self.start(config, "grpokit sft", train_dataset, "prompt/completion rows")
        rows, source = _rows(train_dataset, config.dataset, "train_dataset", config)
        eval_rows, eval_source = _rows(eval_dataset, config.eval_dataset, "eval_dataset", config, held_out=True)
        if eval_rows and config.eval_fraction:
            raise ConfigError("eval_fraction and an eval dataset both choose held-out rows; set one of them")

        if model is None:
            model, tokenizer = load_model_and_tokenizer(config.model, config.seed, config.progress_bar, config.dtype)
        elif tokenizer is None:
            raise ValueError("a tokenizer is required when a model is passed")
        if tokenizer.eos_token_id is None:
            raise ValueError(f"model: the tokenizer of {config.model!r} has no eos_token; a completion must end "
                             "with one to learn where to stop")
        ensure_pad_token(tokenizer, repr(config.model))
        self.model, self.tokenizer = with_lora(model, config).to(self.device), tokenizer

        context = getattr(self.model.config, "max_position_embeddings", None)
        if config.max_length is not None and context is not None and config.max_length > context:
            raise ConfigError(f"max_length={config.max_length} exceeds the model's context of {context} tokens")
        max_length = config.max_length or context
        stops = stop_token_ids(self.model, tokenizer)
        examples = tokenize_rows(rows, tokenizer, config, stops, max_length, source)
        held_out = tokenize_rows(eval_rows, tokenizer, config, stops, max_length, eval_source) if eval_rows else []
        if config.eval_fraction:
            examples, held_out = split(examples, config.eval_fraction, config.seed)
        self.use_examples(examples, held_out, {"max_length": max_length},
                          f"{source}: no training row left: every prompt fills max_length={max_length}")

    # ---- the step --------------------------------------------------------------------------------

    def loss(self, model: torch.nn.Module, batch: UpdateBatch, counts: LossCounts,
             first_pass: bool) -> tuple[torch.Tensor, dict[str, float]]:
        """The micro-batch's share of the step's loss: the sum of −log π(token) over its completion tokens,
        divided by ``counts.tokens``, the completion tokens of the whole step (every micro-batch).

        So the step's loss is the mean over all its completion tokens, every token weighing the same, and
        neither the loss nor the gradient depends on ``micro_batch_size`` (a memory setting; averaging
        each micro-batch first would weigh the tokens of short micro-batches more — the "gradient
        accumulation" error transformers fixed in 4.46). Prompt and padding tokens are outside
        ``completion_mask`` and contribute nothing."""
        return self.completion_nll(model, batch.rollout) / counts.tokens, {}

    def completion_nll(self, model: torch.nn.Module, rollout: Rollout) -> torch.Tensor:
        """Σ −log π(token) over the rollout's completion tokens (a scalar, float32)."""
        rollout = trim(rollout)
        with autocast(self.mixed_precision, self.device, cache=False):
            logp, _ = sequence_logprobs(model, *rollout.sequences(), fast=self.config.fast_path,
                                        checkpoint_layers=self.config.gradient_checkpointing)  # (N, T)
        return -(logp * rollout.completion_mask).sum()

    def training_step(self) -> dict[str, float]:
        start = time.perf_counter()
        examples = [self.train_examples[i] for i in self.batch_indices(self.step)]
        rollout = collate(examples, self.tokenizer.pad_token_id, self.device)
        # SFT has no advantages; update() only carries them along.
        batch = UpdateBatch(rollout, rollout.completion_mask, advantages=rollout.logp)
        (stats,) = update([self.learner], batch, micro_batch_size=self.config.micro_batch_size,
                          max_grad_norm=self.config.max_grad_norm, guard=self.guard)
        self.step += 1
        elapsed = time.perf_counter() - start
        tokens = int(rollout.prompt_mask.sum() + rollout.completion_mask.sum())
        metrics: dict[str, float] = {
            "step": self.step, "epoch": self.step / self.steps_per_epoch,
            "loss": stats["loss"], "grad_norm": stats["grad_norm"], "lr": stats["lr"],
            "skipped_updates": stats["skipped_updates"],
            "tokens": tokens, "completion_tokens": int(rollout.completion_mask.sum()),
            "truncated": int(rollout.truncated.sum()), "time_step": elapsed, "tokens_per_sec": tokens / elapsed,
        }
        if self.evaluates():
            metrics["eval_loss"] = self.evaluate()
        self.log(metrics)
        return metrics

    @torch.no_grad()
    def evaluate(self, examples: Sequence[Example] | None = None) -> float:
        """The mean −log π(token) over the completion tokens of ``examples`` (default: the held-out rows),
        normalised as the training loss is."""
        examples = self.eval_examples if examples is None else examples
        was_training = self.model.training
        self.model.eval()
        total, tokens = 0.0, 0
        size = self.config.micro_batch_size
        for start in range(0, len(examples), size):
            rollout = collate(examples[start: start + size], self.tokenizer.pad_token_id, self.device)
            total += self.completion_nll(self.model, rollout).item()
            tokens += int(rollout.completion_mask.sum())
        self.model.train(was_training)
        return total / max(tokens, 1)

    # ---- the run -------------------------------------------------------------------------------------

    def announce(self) -> None:
        s = self.summary
        print(f"SFT: {s['rows']} training rows, {s['eval_rows']} held out; {self.max_steps} steps of "
              f"{self.config.batch_size} rows ({self.steps_per_epoch} per epoch); max_length {s['max_length']}: "
              f"{s['truncated_rows']} rows truncated, {s['dropped_rows']} left out (prompt too long)")

    def save(self, path: str | Path) -> None:
        """The model and tokenizer at ``path`` (``save_pretrained``, safetensors): full weights, loadable by
        plain transformers and by ``grpokit train`` as ``model``. With LoRA, ``path`` holds the adapter
        merged into the weights and ``adapter`` beside it the adapter alone."""
        save_pretrained(self.model, self.tokenizer, path)


def _rows(given: Iterable[dict[str, Any]] | None, file: str | None, name: str, config: SFTConfig,
          held_out: bool = False) -> tuple[list[dict[str, Any]], str]:
    """Rows passed in (a list of dicts or a datasets.Dataset, named ``name`` in errors), else loaded from ``file``
    (None: no rows; ``held_out``: its test split), checked: both columns present, prompts and completions non-empty
    text or chat messages."""
    if given is None and file is None:
        return [], name
    rows, source = (given_rows(given, name), name) if given is not None else (
        load_rows(file, config.seed, dataset_options(config, held_out)), file)
    check_columns(rows, [config.prompt_column, config.completion_column], source=source)
    check_completions(rows, config.completion_column, source)
    return rows, source
