"""The built-in task: two-digit addition, a character-level tokenizer, a tiny Llama, and a warm start
from a deliberately flawed corpus — so that GRPO has something real to fix.

Prompts read ``What is 47 + 85?``; a worked solution adds column by column::

    <think>
    7+5=12
    4+8+1=13
    </think>
    <answer>132</answer>

The warm-start corpus is *systematically* wrong: on problems whose units column carries, most of its
solutions forget the carry (``4+8=12`` → ``122``). The warm-started model therefore formats well and
adds carry-free problems correctly, but its most likely (greedy) answer on the carry class is wrong;
it still samples the right method now and then, which is the signal GRPO amplifies. Random errors
would not do: the model would learn to sample noise while its greedy answer stayed right.

Everything is built locally from config classes and the ``tokenizers`` library; nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from grpokit.rewards import answers_match, extract_answer

TASK_VERSION = 1  # bump when prompts, solutions or the tokenizer change, to invalidate the cache
SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
TAG_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]


# ---- problems and worked solutions ---------------------------------------------------------------


def has_carry(a: int, b: int) -> bool:
    """Whether the units column of a + b carries (the class the corpus gets wrong)."""
    return a % 10 + b % 10 >= 10


def prompt_text(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def worked_solution(a: int, b: int, *, forget_carry: bool = False) -> str:
    """Column addition of two two-digit numbers; ``forget_carry`` makes the corpus's mistake.

    >>> worked_solution(47, 85)
    '<think>\\n7+5=12\\n4+8+1=13\\n</think>\\n<answer>132</answer>'
    >>> worked_solution(47, 85, forget_carry=True)
    '<think>\\n7+5=12\\n4+8=12\\n</think>\\n<answer>122</answer>'
    """
    units = a % 10 + b % 10
    carry = units // 10 if not forget_carry else 0
    tens = a // 10 + b // 10 + carry
    tens_line = f"{a // 10}+{b // 10}+1={tens}" if carry else f"{a // 10}+{b // 10}={tens}"
    answer = tens * 10 + units % 10
    return f"<think>\n{a % 10}+{b % 10}={units}\n{tens_line}\n</think>\n<answer>{answer}</answer>"


_PROMPT_RE = re.compile(r"(\d+)\s*\+\s*(\d+)", re.ASCII)
# One line of column arithmetic: "7+5=12" or "4+8+1=13" (digits, plus signs, one equals sign).
_STEP_RE = re.compile(r"[ \t]*(\d+(?:[ \t]*\+[ \t]*\d+)*)[ \t]*=[ \t]*(\d+)[ \t]*", re.ASCII)
_THINK_RE = re.compile(r"<think>(.*?)</think>", re.DOTALL)


def expected_steps(a: int, b: int) -> list[tuple[list[int], int]]:
    """The correct column steps of a + b as (operands, result): units, then tens with its carry.

    >>> expected_steps(47, 85)
    [([7, 5], 12), ([4, 8, 1], 13)]
    """
    units = a % 10 + b % 10
    tens_operands = [a // 10, b // 10] + ([1] if units >= 10 else [])
    return [([a % 10, b % 10], units), (tens_operands, sum(tens_operands))]


def arithmetic_steps_reward(
    prompts: Sequence[str], completions: Sequence[str], **columns: Any
) -> list[list[tuple[int, float]] | None]:
    """Process reward for the built-in task: one step per arithmetic line of the ``<think>`` block,
    then the final answer as the last step (GRPO.md §2, process supervision).

    A line ``x+y(+c)=z`` scores 1.0 when it is the correct column step at its position (the right
    digits, the carry included, the right sum) and 0.0 otherwise, a forgotten carry included; lines
    are parsed, never evaluated. The final step, ending with the completion, scores 1.0 when the single
    ``<answer>`` holds a + b. Each step is ``(character offset where it ends, reward)``. Prompts that
    name no ``a + b`` get None.

    >>> arithmetic_steps_reward(["What is 47 + 85?"], [worked_solution(47, 85, forget_carry=True)])
    [[(14, 1.0), (21, 0.0), (51, 0.0)]]
    """
    results: list[list[tuple[int, float]] | None] = []
    for prompt, completion in zip(prompts, completions):
        match = _PROMPT_RE.search(prompt)
        if match is None:
            results.append(None)
            continue
        a, b = int(match.group(1)), int(match.group(2))
        expected = expected_steps(a, b)
        steps: list[tuple[int, float]] = []
        think = _THINK_RE.search(completion)
        if think is not None:
            offset = think.start(1)
            for line in think.group(1).split("\n"):
                parsed = _STEP_RE.fullmatch(line)
                if parsed is not None:
                    operands = [int(x) for x in parsed.group(1).split("+")]
                    index = len(steps)
                    right = index < len(expected) and expected[index] == (operands, int(parsed.group(2)))
                    steps.append((offset + len(line.rstrip()), 1.0 if right else 0.0))
                offset += len(line) + 1
        predicted = extract_answer(completion)
        correct = predicted is not None and answers_match(predicted, a + b)
        steps.append((len(completion), 1.0 if correct else 0.0))
        results.append(steps)
    return results


def _is_held_out(a: int, b: int) -> bool:
    # A fixed ~10 % of all pairs, never seen in warm-start or GRPO training, whatever the seed.
    return int(hashlib.sha256(f"{a}+{b}".encode()).hexdigest(), 16) % 10 == 0


ALL_PAIRS = [(a, b) for a in range(10, 100) for b in range(10, 100)]
TRAIN_PAIRS = [p for p in ALL_PAIRS if not _is_held_out(*p)]
HELD_OUT_PAIRS = [p for p in ALL_PAIRS if _is_held_out(*p)]


def make_row(a: int, b: int) -> dict:
    return {"prompt": prompt_text(a, b), "answer": str(a + b), "carry": has_carry(a, b)}


def train_rows(num_rows: int, seed: int) -> list[dict]:
    """Rows of the GRPO training set: prompts from the training pairs, in a seeded order."""
    rng = random.Random(seed)
    return [make_row(*rng.choice(TRAIN_PAIRS)) for _ in range(num_rows)]


def held_out_rows(num_rows: int = 400) -> list[dict]:
    """A fixed evaluation set from the held-out pairs (the same for every seed)."""
    pairs = sorted(HELD_OUT_PAIRS)
    random.Random(1234).shuffle(pairs)
    return [make_row(*p) for p in pairs[:num_rows]]


# ---- tokenizer and model -------------------------------------------------------------------------


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over printable ASCII and newline, with the think/answer tags as
    single (ordinary, decoded) tokens. Offsets map every token back to its characters."""
    characters = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + characters)}
    # BPE with no merges splits text into single characters and keeps character offsets.
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        padding_side="left", model_input_names=["input_ids", "attention_mask"],  # no token_type_ids for a Llama
    )


@dataclass
class TinyModelSpec:
    """Shape of the built-in Llama (~0.8 M parameters at the defaults)."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512
    max_positions: int = 128


def build_model(
    tokenizer: PreTrainedTokenizerFast, spec: TinyModelSpec | None = None, seed: int = 0
) -> LlamaForCausalLM:
    spec = spec or TinyModelSpec()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


# ---- warm start ----------------------------------------------------------------------------------


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


def supervised_batch(tokenizer, pairs: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """Right-padded prompt+completion+EOS ids with labels only on the completion and EOS."""
    sequences, labels = [], []
    for prompt, completion in pairs:
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        sequences.append(prompt_ids + completion_ids)
        labels.append([-100] * len(prompt_ids) + completion_ids)
    width = max(map(len, sequences))
    pad = tokenizer.pad_token_id
    return {
        "input_ids": torch.tensor([s + [pad] * (width - len(s)) for s in sequences]),
        "attention_mask": torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences]),
        "labels": torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels]),
    }


def warm_start(model, tokenizer, spec: WarmStartSpec, seed: int, progress: bool = True) -> list[float]:
    """Supervised training on the flawed corpus; returns the loss per step."""
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=0.01)

    def lr_at(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / spec.warmup_steps
        progress_ = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * progress_))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    model.train()
    losses = []
    bar = tqdm(range(spec.steps), desc="warm start", disable=not progress, dynamic_ncols=True)
    for _ in bar:
        examples = [corpus_example(rng, spec.forget_carry_rate) for _ in range(spec.batch_size)]
        batch = supervised_batch(tokenizer, examples)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return losses


def cache_dir() -> Path:
    return Path(os.environ.get("GRPOKIT_CACHE", Path.home() / ".cache" / "grpokit"))


def warm_started_model_path(
    seed: int = 0,
    model_spec: TinyModelSpec | None = None,
    warm_spec: WarmStartSpec | None = None,
    *,
    progress: bool = True,
) -> Path:
    """Directory of the warm-started model and tokenizer (``save_pretrained`` format), built and
    cached on first use, keyed by everything that determines it."""
    model_spec, warm_spec = model_spec or TinyModelSpec(), warm_spec or WarmStartSpec()
    key = json.dumps([TASK_VERSION, asdict(model_spec), asdict(warm_spec), seed], sort_keys=True)
    target = cache_dir() / f"arithmetic-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (target / "grpokit_warm_start.json").is_file():
        return target
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, model_spec, seed=seed)
    losses = warm_start(model, tokenizer, warm_spec, seed=seed, progress=progress)
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
