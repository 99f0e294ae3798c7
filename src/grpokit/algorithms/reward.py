"""``RewardTrainer``: training the reward models of :mod:`grpokit.rewards.learned` (docs/reward_models.md).

    grpokit sample runs/sft/model --dataset train.jsonl --num_generations 4 --output samples.jsonl
    grpokit reward train reward.yaml            # writes runs/reward/model
    grpokit train grpo.yaml --reward_funcs "[model:runs/reward/model]"

Three forms of rows (``RewardConfig.form``): labelled ``{prompt, completion, label}`` and preference pairs
``{prompt, chosen, rejected}`` train an outcome model (``AutoModelForSequenceClassification``, one label),
step-labelled ``{prompt, completion, steps: [[offset, label], ...]}`` a process model
(``AutoModelForTokenClassification``, one label). The backbone is a causal LM; its classification head is new.

Each text is built, tokenized, cut and read exactly as :class:`~grpokit.rewards.learned.OutcomeRewardModel`
and :class:`~grpokit.rewards.learned.ProcessRewardModel` build, tokenize, cut and read it when scoring (the
helpers are theirs), so the saved model scores as it was trained. The run loop, checkpoints and metrics are
:class:`~grpokit.training.engine.Trainer`'s; the epoch order, evaluation schedule and step budget are shared with
SFT (:class:`~grpokit.training.supervised.SupervisedTrainer`). One process (no torchrun).
"""

from __future__ import annotations

import json
import math
import numbers
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from grpokit.config import ConfigError, RewardConfig
from grpokit.core.answers import Text, text_of
from grpokit.data import DataError, check_columns, given_rows, row_place
from grpokit.models.loading import ensure_pad_token, load_pretrained, save_pretrained
from grpokit.resolve import dataset_options, load_rows, model_directory
from grpokit.rewards.learned import context_length, encode_texts, reward_text, right_pad, step_tokens
from grpokit.runtime.device import autocast
from grpokit.training.distributed import SINGLE, World
from grpokit.training.supervised import SupervisedTrainer, split
from grpokit.training.update import LossCounts, update

__all__ = ["RewardExample", "RewardTrainer", "detect_form", "parse_rows", "tokenize_rows"]

# The columns (config keys) each form needs besides the prompt.
FORMS = {"labelled": ("completion_column", "label_column"), "pairs": ("chosen_column", "rejected_column"),
         "steps": ("completion_column", "steps_column")}
HEADS = {"labelled": "ForSequenceClassification", "pairs": "ForSequenceClassification",
         "steps": "ForTokenClassification"}


@dataclass
class RewardExample:
    """One row as the reward model reads it."""

    sequences: list[list[int]]  # the token ids of its text, or of (chosen, rejected)
    targets: list[float]  # the label (labelled), each kept step's label (steps); none for pairs
    positions: list[int]  # steps: the token read for each kept step
    truncated: bool  # a text cut to the context

    @property
    def units(self) -> int:
        """What the loss averages over: the row (or pair), or each of its steps."""
        return len(self.positions) or 1


# ---- rows → examples -----------------------------------------------------------------------------


def detect_form(rows: Sequence[dict[str, Any]], config: RewardConfig, source: str) -> str:
    """``config.form``, or for 'auto' the form the first row's columns make: steps, then pairs, then labelled."""
    if config.form != "auto":
        return config.form
    first = rows[0] if rows else {}
    for form in ("steps", "pairs", "labelled"):
        if all(getattr(config, key) in first for key in FORMS[form]):
            return form
    wanted = "; ".join(f"{form}: {[config.prompt_column, *(getattr(config, k) for k in keys)]}"
                       for form, keys in FORMS.items())
    raise DataError(f"{source}: {row_place(first, 0)}'s columns {sorted(first)} make none of the three forms "
                    f"({wanted}); rename the columns or set the *_column keys")


def _text(value: Any, where: str, allow_empty: bool) -> Text:
    if isinstance(value, list):
        if not value or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in value):
            raise DataError(f"{where} must be text or a non-empty list of {{\"role\": ..., \"content\": ...}} messages")
    elif not isinstance(value, str):
        raise DataError(f"{where} must be text (or a list of chat messages), got {type(value).__name__} {value!r:.40}")
    if not allow_empty and not text_of(value).strip():
        raise DataError(f"{where} is empty: a pair needs a completion on each side")
    return value


def _number(value: Any, where: str) -> float:
    if isinstance(value, str):  # CSV holds text
        try:
            value = float(value)
        except ValueError:
            pass
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise DataError(f"{where} must be a finite number, got {type(value).__name__} {value!r:.40}")
    return float(value)


def _steps(value: Any, length: int, where: str) -> tuple[list[int], list[float]]:
    if isinstance(value, str):  # CSV holds the list as JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise DataError(f"{where} is text that is not a JSON list of [offset, label] pairs") from None
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(f"{where} must be a non-empty list of [offset, label] pairs, got {value!r:.60}")
    ends, labels = [], []
    for j, pair in enumerate(value):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or isinstance(pair[0], bool) \
                or not isinstance(pair[0], numbers.Integral):
            raise DataError(f"{where}: step {j} is {pair!r:.40}; expected [offset, label] with an integer offset")
        end = int(pair[0])
        if not 1 <= end <= length:
            raise DataError(f"{where}: step {j} ends at character {end}, outside the completion's 1..{length}")
        if ends and end <= ends[-1]:
            raise DataError(f"{where}: step {j} ends at character {end}, not after step {j - 1} ({ends[-1]}): "
                            "offsets must increase")
        label = _number(pair[1], f"{where}: step {j}'s label")
        if not 0 <= label <= 1:
            raise DataError(f"{where}: step {j}'s label {label} is out of range: binary cross-entropy takes "
                            "labels in [0, 1]")
        ends.append(end)
        labels.append(label)
    return ends, labels


def parse_rows(rows: Sequence[dict[str, Any]], form: str, config: RewardConfig,
               source: str) -> tuple[list[tuple[Text, list[Text], list[float], list[int]]], str]:
    """Each row checked as ``(prompt, texts, targets, step ends)`` and the labelled loss ('bce', 'mse';
    '' for the other forms). Errors name ``source``, the row, the column (and the step)."""
    columns = [getattr(config, key) for key in FORMS[form]]
    check_columns(rows, [config.prompt_column, *columns], source=source)
    parsed = []
    for index, row in enumerate(rows):
        where = {c: f"{source}: {row_place(row, index)} column {c!r}" for c in columns}
        texts = [_text(row[c], where[c], allow_empty=form != "pairs") for c in columns[:2 if form == "pairs" else 1]]
        targets: list[float] = []
        ends: list[int] = []
        if form == "labelled":
            targets = [_number(row[columns[1]], where[columns[1]])]
        elif form == "steps":
            ends, targets = _steps(row[columns[1]], len(text_of(texts[0])), where[columns[1]])
        parsed.append((row[config.prompt_column], texts, targets, ends))
    loss = ""
    if form == "labelled":
        binary = all(t[0] in (0.0, 1.0) for _, _, t, _ in parsed)
        loss = config.label_loss if config.label_loss != "auto" else "bce" if binary else "mse"
        for index, (_, _, (label,), _) in enumerate(parsed):
            if loss == "bce" and not 0 <= label <= 1:
                raise DataError(f"{source}: {row_place(rows[index], index)} column {config.label_column!r}: label "
                                f"{label} is out of range for binary cross-entropy (label_loss: bce takes labels in "
                                "[0, 1]; label_loss: mse any number)")
    return parsed, loss


def tokenize_rows(parsed: Sequence[tuple[Text, list[Text], list[float], list[int]]], form: str, tokenizer: Any,
                  context: int | None, source: str) -> tuple[list[RewardExample | None], int]:
    """Each parsed row's :class:`RewardExample` (None for a step row none of whose steps fit ``context``) and
    the steps dropped past the cut. Texts, cuts and step tokens are the reward models' own."""
    steps = form == "steps"
    if steps and not tokenizer.is_fast:
        raise ValueError("model: a process reward model needs a fast tokenizer (tokenizer.json) to map step ends "
                         "to tokens")
    located = [(i, *reward_text(tokenizer, prompt, text, locate=steps))
               for i, (prompt, texts, _, _) in enumerate(parsed) for text in texts]
    for index, _, start in located:
        if steps and start < 0:
            raise DataError(f"{source}: row {index}: the tokenizer's chat template changes the assistant's text, so "
                            "step ends cannot be located in it")
    ids, spans, cut = encode_texts(tokenizer, [text for _, text, _ in located], context, keep_end=not steps)
    cut, examples, dropped, k = set(cut), [], 0, 0
    for _, texts, targets, ends in parsed:
        sequences, truncated = ids[k:k + len(texts)], any(j in cut for j in range(k, k + len(texts)))
        positions, kept = [], []
        if steps:
            for j, label in zip(step_tokens(spans[k], located[k][2], ends), targets):
                if j is not None and j < len(ids[k]):  # else past the cut: the scorer gives it no reward
                    positions.append(j)
                    kept.append(label)
            dropped += len(ends) - len(kept)
            targets = kept
        k += len(texts)
        examples.append(None if steps and not positions else RewardExample(sequences, targets, positions, truncated))
    return examples, dropped


def load_backbone(config: RewardConfig, head: str) -> tuple[torch.nn.Module, Any]:
    """``config.model`` (a causal LM, ``gguf:FILE``, ``builtin:arithmetic``) as an ``AutoModel{head}`` with one
    label: the backbone's weights, a new head."""
    return load_pretrained(model_directory(config.model, config.seed, config.progress_bar), config.dtype, head,
                           num_labels=1)


# ---- the trainer ---------------------------------------------------------------------------------


@dataclass
class RewardBatch:
    """A step's rows as :func:`~grpokit.training.update.update` trains on them (its ``Minibatchable``)."""

    examples: list[RewardExample]

    def __len__(self) -> int:
        return len(self.examples)

    def select(self, index: torch.Tensor | slice) -> RewardBatch:
        if isinstance(index, slice):
            return RewardBatch(self.examples[index])
        return RewardBatch([self.examples[i] for i in index.tolist()])

    def units(self) -> float:
        return float(sum(e.units for e in self.examples))

    def counts(self, world: World) -> LossCounts:
        return LossCounts(sequences=float(len(self.examples)), tokens=self.units())


class RewardTrainer(SupervisedTrainer):
    """Trains an outcome or process reward model on rows of one of the three forms, on the run loop of
    :class:`~grpokit.training.engine.Trainer` (the data order, checkpoints and saved layout of SFT's). Anything not
    passed is built from the config; ``model``: a classifier (``AutoModel...Classification``, one label) with its
    ``tokenizer``; ``train_dataset`` / ``eval_dataset``: rows (dicts, or a ``datasets.Dataset``) instead of the
    config's."""

    label, postfix = "reward", ("loss", "accuracy", "eval_accuracy")

    def __init__(self, config: RewardConfig, *, model: torch.nn.Module | None = None, tokenizer: Any = None,
                 train_dataset: Iterable[dict[str, Any]] | None = None,
                 eval_dataset: Iterable[dict[str, Any]] | None = None):
        super().__init__()
        # (start seeds every stream: the new head's initialisation)
        self.start(config, "grpokit reward train", train_dataset, "labelled, pair or step rows")
        rows, source = (given_rows(train_dataset, "train_dataset"), "train_dataset") if train_dataset is not None \
            else (load_rows(config.dataset, config.seed, dataset_options(config)), config.dataset)
        self.form = detect_form(rows, config, source)
        parsed, self.label_loss = parse_rows(rows, self.form, config, source)
        held: list = []
        eval_source = "eval_dataset"
        if eval_dataset is not None or config.eval_dataset is not None:
            if eval_dataset is not None:
                eval_rows, eval_source = given_rows(eval_dataset, "eval_dataset"), "eval_dataset"
            else:
                eval_rows = load_rows(config.eval_dataset, config.seed, dataset_options(config, held_out=True))
                eval_source = config.eval_dataset
            held, eval_loss = parse_rows(eval_rows, self.form, config, eval_source)
            if self.form == "labelled" and eval_loss != self.label_loss:
                raise DataError(f"{eval_source}: its labels make the loss {eval_loss}, the training rows' "
                                f"{self.label_loss}; set label_loss")

        if model is None:
            model, tokenizer = load_backbone(config, HEADS[self.form])
        elif tokenizer is None:
            raise ValueError("a tokenizer is required when a model is passed")
        # As the reward models pad: config.pad_token_id, else the tokenizer's pad, else EOS; saved in the config.
        if model.config.pad_token_id is None:
            model.config.pad_token_id = ensure_pad_token(tokenizer, repr(config.model))
        self.pad_id = model.config.pad_token_id
        self.model, self.tokenizer = model.to(self.device), tokenizer

        context = context_length(tokenizer, model.config)
        if config.max_length is not None and context is not None and config.max_length > context:
            raise ConfigError(f"max_length={config.max_length} exceeds the model's context of {context} tokens")
        self.context = config.max_length or context
        examples, dropped = tokenize_rows(parsed, self.form, tokenizer, self.context, source)
        held_out, eval_dropped = tokenize_rows(held, self.form, tokenizer, self.context, eval_source) if held \
            else ([], 0)
        if not held and config.eval_fraction:
            examples, held_out = split(examples, config.eval_fraction, config.seed)
        self.use_examples(examples, held_out, {"dropped_steps": dropped + eval_dropped, "max_length": self.context},
                          f"{source}: no training row left: every row's steps lie past max_length={self.context}")

    # ---- the loss ---------------------------------------------------------------------------------

    def scores(self, model: torch.nn.Module, examples: Sequence[RewardExample]) -> torch.Tensor:
        """The logits the reward model scores by (float32): per sequence for an outcome model, (S,); for a
        process model, at each example's step tokens, concatenated."""
        sequences = [ids for e in examples for ids in e.sequences]
        input_ids, mask = right_pad(sequences, self.pad_id)
        with autocast(self.mixed_precision, self.device, cache=False):
            logits = model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device)).logits
        logits = logits.float()[..., 0]
        if self.form != "steps":
            return logits
        return torch.cat([logits[i, e.positions] for i, e in enumerate(examples)])

    def unit_losses(self, model: torch.nn.Module,
                    examples: Sequence[RewardExample]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each unit's loss (a row, a pair, a step) and whether the model got it right (None for mse)."""
        r = self.scores(model, examples)
        if self.form == "pairs":  # Bradley–Terry: −log σ(r_chosen − r_rejected)
            margin = r[0::2] - r[1::2]
            return -F.logsigmoid(margin), margin > 0
        y = torch.tensor([t for e in examples for t in e.targets], device=r.device)
        if self.label_loss == "mse":
            return (r - y) ** 2, None
        return F.binary_cross_entropy_with_logits(r, y, reduction="none"), (r > 0) == (y > 0.5)

    def loss(self, model: torch.nn.Module, batch: RewardBatch, counts: LossCounts,
             first_pass: bool) -> tuple[torch.Tensor, dict[str, float]]:
        """The micro-batch's share of the step's loss: the sum of its units' losses over ``counts.tokens``, the
        units of the whole step (every unit weighs the same, whatever ``micro_batch_size``); and its accuracy."""
        losses, right = self.unit_losses(model, batch.examples)
        return losses.sum() / counts.tokens, {} if right is None else {"accuracy": float(right.sum()) / batch.units()}

    def training_step(self) -> dict[str, float]:
        start = time.perf_counter()
        examples = [self.train_examples[i] for i in self.batch_indices(self.step)]
        (stats,) = update([self.learner], RewardBatch(examples), micro_batch_size=self.config.micro_batch_size,
                          max_grad_norm=self.config.max_grad_norm, guard=self.guard)
        self.step += 1
        elapsed = time.perf_counter() - start
        metrics: dict[str, float] = {
            "step": self.step, "epoch": self.step / self.steps_per_epoch, "loss": stats["loss"],
            "accuracy": stats.get("accuracy"), "grad_norm": stats["grad_norm"], "lr": stats["lr"],
            "skipped_updates": stats["skipped_updates"], "rows": len(examples),
            "units": sum(e.units for e in examples), "tokens": sum(len(s) for e in examples for s in e.sequences),
            "truncated": sum(e.truncated for e in examples), "time_step": elapsed,
        }
        if self.evaluates():
            metrics.update(self.evaluate())
        self.log(metrics)
        return metrics

    @torch.no_grad()
    def evaluate(self, examples: Sequence[RewardExample] | None = None) -> dict[str, float]:
        """``eval_loss`` and ``eval_accuracy`` over ``examples`` (default: the held-out rows): the accuracy of
        sign(logit) against 0/1 labels, of r_chosen > r_rejected for pairs, per step for steps (None for mse)."""
        examples = self.eval_examples if examples is None else examples
        was_training = self.model.training
        self.model.eval()
        batch, loss, correct = RewardBatch(list(examples)), 0.0, 0
        counts = batch.counts(SINGLE)
        for start in range(0, len(batch), self.config.micro_batch_size):
            losses, right = self.unit_losses(self.model, batch.examples[start:start + self.config.micro_batch_size])
            loss += (losses.sum() / counts.tokens).item()
            correct = None if right is None else correct + int(right.sum())
        self.model.train(was_training)
        return {"eval_loss": loss, "eval_accuracy": None if correct is None else correct / counts.tokens}

    def announce(self) -> None:
        s, kind = self.summary, "process" if self.form == "steps" else "outcome"
        loss = {"pairs": "Bradley-Terry", "steps": "bce per step"}.get(self.form, self.label_loss)
        print(f"reward model ({kind}, {self.form} rows, {loss}): {s['rows']} training rows, {s['eval_rows']} held "
              f"out; {self.max_steps} steps of {self.config.batch_size} rows; max_length {s['max_length']}: "
              f"{s['truncated_rows']} rows truncated, {s['dropped_steps']} steps and {s['dropped_rows']} rows "
              "left out (past the cut)")

    def save(self, path: str | Path) -> None:
        """The reward model and tokenizer at ``path`` (``save_pretrained``, safetensors)."""
        save_pretrained(self.model, self.tokenizer, path)
