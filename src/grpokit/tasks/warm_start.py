"""The supervised warm start of the tiny model on a deliberately flawed corpus, and its cache.

The warm-start corpus is *systematically* wrong: on problems whose units column carries, most of its
solutions forget the carry (``4+8=12`` → ``122``). The warm-started model therefore formats well and
adds carry-free problems correctly, but its most likely (greedy) answer on the carry class is wrong;
it still samples the right method now and then, which is the signal GRPO amplifies. Random errors
would not do: the model would learn to sample noise while its greedy answer stayed right.

:func:`warm_started_model_path` builds the warm-started model (:mod:`grpokit.tasks.tiny_model`) once per
seed and spec and caches it under :func:`cache_dir` (``$GRPOKIT_CACHE``, else ``~/.cache/grpokit``).
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from grpokit.core.optim import lr_factor
from grpokit.runtime.cache import cache_dir
from grpokit.tasks import tool_task
from grpokit.tasks.arithmetic import TASK_VERSION, TRAIN_PAIRS, has_carry, prompt_text, worked_solution
from grpokit.tasks.tiny_model import TinyModelSpec, build_model, build_tokenizer
from grpokit.training.distributed import World
from grpokit.training.update import Learner, LossCounts, NonfiniteGuard, update


@dataclass
class WarmStartSpec:
    """The supervised warm start on the flawed corpus."""

    steps: int = 1000
    batch_size: int = 64
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    forget_carry_rate: float = 0.8  # share of carry problems whose solution forgets the carry


def corpus_example(rng: random.Random, forget_carry_rate: float) -> tuple[str, str]:
    a, b = rng.choice(TRAIN_PAIRS)
    forget = has_carry(a, b) and rng.random() < forget_carry_rate
    return prompt_text(a, b), worked_solution(a, b, forget_carry=forget)


def supervised_batch(tokenizer, examples: list[tuple[str, str | list[tuple[str, bool]]]]) -> dict[str, torch.Tensor]:
    """Right-padded prompt + completion + EOS ids with labels only on the completion and EOS. A completion is its
    text, or ``(text, written_by_the_model)`` pieces whose other pieces (a tool's results) are context: not
    labelled, as GRPO's loss leaves them out."""
    sequences, labels = [], []
    for prompt, completion in examples:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        label = [-100] * len(ids)
        for text, written in [(completion, True)] if isinstance(completion, str) else completion:
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids, label = ids + piece, label + (piece if written else [-100] * len(piece))
        sequences.append(ids + [tokenizer.eos_token_id])
        labels.append(label + [tokenizer.eos_token_id])
    width = max(map(len, sequences))
    pad = tokenizer.pad_token_id
    return {
        "input_ids": torch.tensor([s + [pad] * (width - len(s)) for s in sequences]),
        "attention_mask": torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences]),
        "labels": torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels]),
    }


def arithmetic_batch(tokenizer, rng: random.Random, spec: WarmStartSpec) -> dict[str, torch.Tensor]:
    """A batch of the addition task's flawed corpus."""
    return supervised_batch(tokenizer, [corpus_example(rng, spec.forget_carry_rate) for _ in range(spec.batch_size)])


def tools_batch(tokenizer, rng: random.Random, spec: WarmStartSpec) -> dict[str, torch.Tensor]:
    """A batch of the tools task's corpus (:mod:`grpokit.tasks.tool_task`): a minority of calculator calls."""
    return supervised_batch(tokenizer, [tool_task.corpus_example(rng) for _ in range(spec.batch_size)])


# task → (its batches, its version, whether its tokenizer has the tool tags, its model's positions)
TASKS = {"arithmetic": (arithmetic_batch, TASK_VERSION, False, 128),
         "tools": (tools_batch, tool_task.TASK_VERSION, True, 160)}


class LabelledRows:
    """A batch of :func:`supervised_batch` as the engine's :func:`~grpokit.training.update.update` trains on it
    (its ``Minibatchable``): the loss averages over the labelled tokens."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors["input_ids"])

    def select(self, index: torch.Tensor | slice) -> LabelledRows:
        return LabelledRows({key: value[index] for key, value in self.tensors.items()})

    def units(self) -> float:
        return float((self.tensors["labels"] != -100).sum())

    def counts(self, world: World) -> LossCounts:
        return LossCounts(sequences=float(len(self)), tokens=max(1.0, self.units()))


def warm_start(model, tokenizer, spec: WarmStartSpec, seed: int, progress: bool = True,
               task: str = "arithmetic") -> list[float]:
    """Supervised training on the task's flawed corpus, each step through the engine's update (one minibatch, the
    gradient clipped at 1); returns the loss per step."""
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=0.01)
    # Linear warmup, then cosine decay to 0 over the run: GRPO's own schedule (optim.py).
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(spec.warmup_steps, "cosine", spec.steps))
    learner = Learner("", model, model, optimizer, scheduler,
                      loss=lambda module, rows, counts, first: (module(**rows.tensors).loss, {}))
    guard = NonfiniteGuard(limit=3)
    losses = []
    bar = tqdm(range(spec.steps), desc="warm start", disable=not progress, dynamic_ncols=True)
    for _ in bar:
        rows = LabelledRows(TASKS[task][0](tokenizer, rng, spec))
        (step,) = update([learner], rows, micro_batch_size=len(rows), max_grad_norm=1.0, guard=guard)
        losses.append(step["loss"])
        bar.set_postfix(loss=f"{step['loss']:.3f}")
    model.eval()
    return losses


def warm_started_model_path(
    seed: int = 0,
    model_spec: TinyModelSpec | None = None,
    warm_spec: WarmStartSpec | None = None,
    *,
    progress: bool = True,
    task: str = "arithmetic",
) -> Path:
    """Directory of the warm-started model and tokenizer (``save_pretrained`` format) of ``task``
    ('arithmetic' or 'tools'), built and cached on first use, keyed by everything that determines it."""
    _, version, tool_tags, positions = TASKS[task]
    model_spec, warm_spec = model_spec or TinyModelSpec(max_positions=positions), warm_spec or WarmStartSpec()
    key = json.dumps([version, asdict(model_spec), asdict(warm_spec), seed], sort_keys=True)
    target = cache_dir() / f"{task}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (target / "grpokit_warm_start.json").is_file():
        return target
    tokenizer = build_tokenizer(tool_tags=tool_tags)
    model = build_model(tokenizer, model_spec, seed=seed)
    losses = warm_start(model, tokenizer, warm_spec, seed=seed, progress=progress, task=task)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename, so an interrupted build never looks complete.
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / "grpokit_warm_start.json").write_text(
        json.dumps({"key": json.loads(key), "final_loss": losses[-1]}, indent=2)
    )
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
    return target
