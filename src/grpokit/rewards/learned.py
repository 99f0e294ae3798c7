"""Learned reward models as reward functions (docs/data_and_rewards.md, "Reward models").

``OutcomeRewardModel``: a Hugging Face ``AutoModelForSequenceClassification`` directory with one label; a
completion's reward is its logit on prompt + completion. ``ProcessRewardModel``: an
``AutoModelForTokenClassification`` directory; each step's reward is its probability read at the step's last
token, returned as the ``(character offset where the step ends, reward)`` pairs of ``supervision: process``.

Both are called like any reward function (by keyword, as TRL calls them) and re-tokenize the decoded text with
their own tokenizer, so they need not share the policy's. In a config: ``model:PATH``, ``process_model:PATH``,
or a bare directory (an outcome model, as in TRL).
"""

from __future__ import annotations

import bisect
import warnings
from pathlib import Path
from typing import Any

import torch

from grpokit.core.answers import Text, text_of
from grpokit.models.loading import DTYPES, dtype_options
from grpokit.runtime.device import autocast, resolve_device, resolve_precision

MODEL_PREFIX, PROCESS_MODEL_PREFIX = "model:", "process_model:"
# Stands in for the completion while a chat template renders, to find where the completion starts.
_SENTINEL = "\u2063grpokit-completion\u2063"


class _RewardModel:
    """What both kinds share: loading and checking the directory, building the texts, tokenizing, the
    batched forward."""

    head = ""  # the architecture suffix expected, e.g. "ForSequenceClassification"
    spec = ""  # how a config names this kind, for error messages
    num_labels: tuple[int, ...] = ()

    def __init__(self, path: str | Path, *, batch_size: int = 16, device: str | torch.device | None = None,
                 dtype: str = "auto", mixed_precision: str = "no"):
        if batch_size < 1:
            raise ValueError(f"{self.spec}{path}: batch_size must be at least 1, got {batch_size}")
        self.path, self.batch_size = Path(path), batch_size
        self.__name__ = self.path.resolve().name  # reward_name(): the name in logs and metrics
        self.device = resolve_device(str(device) if device is not None else "auto")
        self.mixed_precision = resolve_precision(mixed_precision, self.device)  # 'auto' decided for the device
        self.model, self.tokenizer = self._load(dtype)
        self.pad_id = self._pad_id()
        self.context = context_length(self.tokenizer, self.model.config)
        self.truncated = 0  # texts cut to the context so far

    def _fail(self, problem: str) -> ValueError:
        return ValueError(f"reward_funcs: {self.spec}{self.path}: {problem}")

    def _load(self, dtype: str):
        import transformers
        from transformers import AutoConfig, AutoTokenizer

        if not self.path.is_dir():
            raise self._fail("no such directory" if not self.path.exists() else "is a file, not a model directory")
        if not (self.path / "config.json").is_file():  # transformers 4.50 made one up for an empty folder
            raise self._fail("not a Hugging Face model directory (it has no config.json)")
        try:
            config = AutoConfig.from_pretrained(self.path)
        except (OSError, ValueError) as error:
            raise self._fail(f"not a Hugging Face model directory ({error})") from None
        # A causal LM loads into a classifier without complaint, its head freshly random: refuse it by name.
        architectures = getattr(config, "architectures", None) or []
        if not any(name.endswith(self.head) for name in architectures):
            found = f"holds a {', '.join(architectures)}" if architectures else "names no architecture in config.json"
            hint = {"ForCausalLM": "; a causal LM predicts tokens, not rewards: train a reward model from it first",
                    "ForTokenClassification": "; a token classifier is a process reward model: use process_model:",
                    "ForSequenceClassification": "; a sequence classifier is an outcome reward model: use model:"}
            extra = next((h for suffix, h in hint.items() if any(a.endswith(suffix) for a in architectures)), "")
            raise self._fail(f"{found}, not an AutoModel{self.head} (architectures ending in {self.head!r}){extra}")
        if config.num_labels not in self.num_labels:
            raise self._fail(self._labels_problem(config.num_labels))
        if dtype != "auto" and dtype not in DTYPES:
            raise self._fail(f"dtype {dtype!r} is not one of 'auto', {', '.join(map(repr, DTYPES))}")
        auto = getattr(transformers, f"AutoModel{self.head}")
        model, info = auto.from_pretrained(self.path, output_loading_info=True, **dtype_options(dtype))
        if info.get("missing_keys"):  # e.g. a head that was never trained, hence random
            raise self._fail(f"its weights lack {sorted(info['missing_keys'])[:4]}: not a trained model of this kind")
        try:
            tokenizer = AutoTokenizer.from_pretrained(self.path)
        except (OSError, ValueError, TypeError) as error:
            raise self._fail(f"has no usable tokenizer ({error}); save the tokenizer next to the model") from None
        return model.eval().requires_grad_(False).to(self.device), tokenizer

    def _labels_problem(self, num_labels: int) -> str:
        raise NotImplementedError

    def _pad_id(self) -> int:
        # The sequence classifier reads the last token that is not config.pad_token_id, so pad with that id.
        pad = self.model.config.pad_token_id
        for fallback in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id):
            pad = fallback if pad is None else pad
        if pad is None:
            raise self._fail("neither the model's config nor its tokenizer names a pad or EOS token")
        self.model.config.pad_token_id = pad
        return pad

    def _text(self, prompt: Text, completion: Text, locate: bool = False) -> tuple[str, int]:
        return reward_text(self.tokenizer, prompt, completion, locate)

    def _encode(self, texts: list[str], keep_end: bool) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
        ids, spans, cut = encode_texts(self.tokenizer, texts, self.context, keep_end)
        if cut and not self.truncated:
            kept = "end" if keep_end else "start"
            warnings.warn(f"reward model {self.__name__!r}: {len(cut)} of {len(texts)} texts are longer than its "
                          f"context of {self.context} tokens and were cut, keeping their {kept} (counted in "
                          ".truncated; warned once)", stacklevel=3)
        self.truncated += len(cut)
        return ids, spans

    def _logits(self, ids: list[list[int]]) -> list[torch.Tensor]:
        """The model's logits for each row, batched; shortest rows together, to pad little. A token classifier's
        (tokens, labels) stop where the row's ids do: what a row gets never depends on the rows batched with it."""
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        out: list[torch.Tensor] = [torch.empty(0)] * len(ids)
        for first in range(0, len(order), self.batch_size):
            rows = order[first:first + self.batch_size]
            input_ids, mask = right_pad([ids[i] for i in rows], self.pad_id)
            with torch.inference_mode(), autocast(self.mixed_precision, self.device):
                logits = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device)).logits
            for j, i in enumerate(rows):
                out[i] = (logits[j, :len(ids[i])] if logits.dim() == 3 else logits[j]).float().cpu()
        return out


class OutcomeRewardModel(_RewardModel):
    """A sequence-classification reward model as a reward function: one float per completion, the raw
    logit of prompt + completion as one text (rendered as a user and an assistant turn by the reward
    tokenizer's chat template when it has one).

    >>> reward = OutcomeRewardModel("runs/rm/model", batch_size=16)              # doctest: +SKIP
    >>> reward(prompts=["What is 2 + 2?"], completions=["<answer>4</answer>"])  # doctest: +SKIP
    [1.73]
    """

    head, spec, num_labels = "ForSequenceClassification", MODEL_PREFIX, (1,)

    def _labels_problem(self, num_labels: int) -> str:
        return (f"has {num_labels} labels; an outcome reward model has exactly one (num_labels=1), whose logit is "
                "the reward")

    def __call__(self, prompts: list[Text], completions: list[Text], **kwargs: Any) -> list[float]:
        texts = [self._text(p, c)[0] for p, c in zip(prompts, completions)]
        ids, _ = self._encode(texts, keep_end=True)
        return [float(row[0]) for row in self._logits(ids)]


class ProcessRewardModel(_RewardModel):
    """A token-classification reward model as a process reward: per completion, ``[(character offset where
    a step ends, reward), ...]``, a step being each non-blank piece of the completion between
    ``step_separator`` s (ending before trailing whitespace), its reward the model's probability at the
    step's last token: the sigmoid of the logit (one label) or the softmax probability of label 1 (two).
    Steps past the reward model's context get no reward (counted in ``truncated``)."""

    head, spec, num_labels = "ForTokenClassification", PROCESS_MODEL_PREFIX, (1, 2)

    def __init__(self, path: str | Path, *, step_separator: str = "\n", batch_size: int = 16,
                 device: str | torch.device | None = None, dtype: str = "auto", mixed_precision: str = "no"):
        if not step_separator:
            raise ValueError(f"{PROCESS_MODEL_PREFIX}{path}: step_separator must not be empty")
        super().__init__(path, batch_size=batch_size, device=device, dtype=dtype, mixed_precision=mixed_precision)
        self.step_separator = step_separator
        if not self.tokenizer.is_fast:
            raise self._fail("needs a fast tokenizer (tokenizer.json) to map step ends to tokens")

    def _labels_problem(self, num_labels: int) -> str:
        return (f"has {num_labels} labels; a process reward model has 1 (sigmoid of the logit) or 2 "
                "(probability of label 1)")

    def step_ends(self, completion: str) -> list[int]:
        """Where each step ends in ``completion`` (exclusive character offsets)."""
        return step_ends(completion, self.step_separator)

    def __call__(self, prompts: list[Text], completions: list[Text], **kwargs: Any) -> list[list[tuple[int, float]]]:
        located = [self._text(p, c, locate=True) for p, c in zip(prompts, completions)]
        if any(start < 0 for _, start in located):
            raise self._fail("its chat template changes the assistant's text, so step ends cannot be located in it")
        ids, spans = self._encode([text for text, _ in located], keep_end=False)
        starts = [start for _, start in located]
        results = []
        for logits, row_spans, start, completion in zip(self._logits(ids), spans, starts, completions):
            probabilities = torch.sigmoid(logits[:, 0]) if logits.shape[-1] == 1 else logits.softmax(-1)[:, 1]
            ends = self.step_ends(text_of(completion))
            steps = [(end, float(probabilities[j])) for end, j in zip(ends, step_tokens(row_spans, start, ends))
                     if j is not None and j < len(probabilities)]  # else cut with the context: no reward
            results.append(steps)
        return results


def context_length(tokenizer: Any, config: Any) -> int | None:
    """The most tokens the model reads: the tokenizer's limit (when it sets a real one) and the model's
    positions, whichever is smaller; None when neither says."""
    limits = [getattr(tokenizer, "model_max_length", None), getattr(config, "max_position_embeddings", None)]
    limits = [n for n in limits if isinstance(n, int) and 0 < n < 10**8]  # transformers' "no limit" is ~1e30
    return min(limits) if limits else None


# ---- what training (grpokit.algorithms.reward) shares, so that a trained model scores as it was trained -----


def reward_text(tokenizer: Any, prompt: Text, completion: Text, locate: bool = False) -> tuple[str, int]:
    """The text a reward model reads for ``prompt`` + ``completion`` and (``locate``) where in it the
    completion's text starts (-1 where a chat template rewrites the assistant's content)."""
    if not getattr(tokenizer, "chat_template", None):  # plain concatenation; message contents one per line
        prefix = prompt if isinstance(prompt, str) else "\n".join(str(m["content"]) for m in prompt)
        return prefix + text_of(completion), len(prefix)
    before = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    turns = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
    text = tokenizer.apply_chat_template([*before, *turns], tokenize=False)
    if not locate:
        return text, -1
    marked = tokenizer.apply_chat_template([*before, *turns[:-1], {**turns[-1], "content": _SENTINEL}],
                                           tokenize=False)
    start, content = marked.find(_SENTINEL), text_of(completion)
    if start < 0 or text[start:start + len(content)] != content:
        start = -1  # the template rewrites the assistant's content: only the outcome model can cope
    return text, start


def encode_texts(tokenizer: Any, texts: list[str], context: int | None,
                 keep_end: bool) -> tuple[list[list[int]], list[list[tuple[int, int]]], list[int]]:
    """Token ids cut to ``context``, each uncut token's character span, and the indices of the texts cut.
    ``keep_end``: cut the start (the outcome model reads the last token); else cut the end (a causal model's
    earlier tokens, and so earlier steps, then score exactly as uncut)."""
    chat = bool(getattr(tokenizer, "chat_template", None))
    # A rendered template holds its own special tokens; plain text gets the tokenizer's own (BOS).
    encoded = tokenizer(texts, add_special_tokens=not chat, return_offsets_mapping=tokenizer.is_fast)
    ids = [list(row) for row in encoded["input_ids"]]
    spans = [list(map(tuple, row)) for row in encoded.get("offset_mapping", [[]] * len(ids))]
    long = [i for i, row in enumerate(ids) if context and len(row) > context]
    for i in long:  # spans stay whole: a step whose last token was cut is found past the kept ids
        ids[i] = ids[i][-context:] if keep_end else ids[i][:context]
    return ids, spans, long


def step_ends(completion: str, separator: str) -> list[int]:
    """Where each step of ``completion`` ends (exclusive character offsets): each non-blank piece between
    ``separator`` s, before its trailing whitespace."""
    ends, offset = [], 0
    for piece in completion.split(separator):
        if piece.strip():
            ends.append(offset + len(piece.rstrip()))
        offset += len(piece) + len(separator)
    return ends


def step_tokens(spans: list[tuple[int, int]], start: int, ends: list[int]) -> list[int | None]:
    """The index of the token holding each step's last character (``start + end - 1`` in the text, the
    completion starting at ``start``): the last non-empty token starting before the step's end, so a token
    across the end belongs to the step it starts in; None before the first token. An index may lie past
    the ids kept by a cut (:func:`encode_texts`)."""
    kept = [(a, j) for j, (a, b) in enumerate(spans) if b > a]
    token_starts = [a for a, _ in kept]
    found = []
    for end in ends:
        k = bisect.bisect_left(token_starts, start + end) - 1
        found.append(kept[k][1] if k >= 0 else None)
    return found


def right_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of the rows, right-padded with ``pad_id``: a causal model's real tokens
    never see the pads after them, and a sequence classifier reads the last token that is not
    ``config.pad_token_id``."""
    width = max(1, max((len(row) for row in rows), default=1))
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for j, row in enumerate(rows):
        input_ids[j, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[j, :len(row)] = 1
    return input_ids, mask
