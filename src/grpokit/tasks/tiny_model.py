"""The built-in task's tiny model: a character-level tokenizer and a small Llama (~0.8 M parameters at
the defaults), both built locally from config classes and the ``tokenizers`` library; nothing is
downloaded.

The tokenizer covers printable ASCII and newline, with the ``<think>``/``<answer>`` tags as single
tokens, so the worked solutions of :mod:`grpokit.tasks.arithmetic` tokenize character by character.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
TAG_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]
TOOL_TAG_TOKENS = ["<tool>", "</tool>", "<result>", "</result>"]  # the tools task's (grpokit.rollout.tools)


def build_tokenizer(tool_tags: bool = False) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over printable ASCII and newline, with the think/answer tags (and with
    ``tool_tags`` the tool-call and result tags) as single (ordinary, decoded) tokens. Offsets map every
    token back to its characters."""
    characters = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + characters)}
    # BPE with no merges splits text into single characters and keeps character offsets.
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()
    tags = TAG_TOKENS + (TOOL_TAG_TOKENS if tool_tags else [])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in tags])
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
