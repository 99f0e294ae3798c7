"""Prompts as chat: the tokenizer's template, a system prompt, message rows; and the dtype option."""

import pytest
import torch

from grpokit.data import DataError, check_columns, render_prompt
from grpokit.resolve import load_model_and_tokenizer
from helpers import CHAT_TEMPLATE as TEMPLATE
from helpers import make_trainer, ones


@pytest.fixture
def chat_tokenizer(tokenizer):
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def test_plain_prompts_use_the_template_when_there_is_one(chat_tokenizer, tokenizer):
    assert render_prompt(chat_tokenizer, "What is 1 + 1?") == "[user] What is 1 + 1?\n[assistant] "
    assert render_prompt(chat_tokenizer, "Q", system_prompt="Think first.") == (
        "[system] Think first.\n[user] Q\n[assistant] ")
    assert render_prompt(chat_tokenizer, "Q", chat_template=False) == "Q"


def test_without_a_template_the_system_prompt_is_a_first_line(tokenizer):
    assert render_prompt(tokenizer, "Q") == "Q"
    assert render_prompt(tokenizer, "Q", system_prompt="Think first.") == "Think first.\nQ"
    with pytest.raises(ValueError, match="chat_template is true but the tokenizer has no chat template"):
        render_prompt(tokenizer, "Q", chat_template=True)
    with pytest.raises(ValueError, match="list of chat messages but the tokenizer has no chat template"):
        render_prompt(tokenizer, [{"role": "user", "content": "Q"}])


def test_message_rows(chat_tokenizer):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert render_prompt(chat_tokenizer, messages, system_prompt="ignored: the row has one") == (
        "[system] S\n[user] Q\n[assistant] ")
    check_columns([{"prompt": messages}], ["prompt"])
    with pytest.raises(DataError, match=r"row 0 column 'prompt' must be text or a non-empty list"):
        check_columns([{"prompt": [{"role": "user"}]}], ["prompt"])


def test_training_on_chat_prompts(chat_tokenizer, tiny_model, tmp_path, monkeypatch):
    rows = [{"prompt": [{"role": "user", "content": f"Count {i}"}]} for i in range(8)]
    trainer = make_trainer(chat_tokenizer, tiny_model, tmp_path, rows=rows, system_prompt="Be brief.", max_steps=1)
    seen = []
    real = trainer.sampler.tokenize_prompts
    monkeypatch.setattr(trainer.sampler, "tokenize_prompts", lambda prompts: seen.extend(prompts) or real(prompts))
    trainer.train()
    assert seen and all(p.startswith("[system] Be brief.\n[user] Count ") and p.endswith("[assistant] ")
                        for p in seen)


@pytest.mark.parametrize("dtype, expected", [("auto", torch.float32), ("bfloat16", torch.bfloat16)])
def test_dtype_is_applied_while_loading(tiny_model_dir, dtype, expected):
    model, _ = load_model_and_tokenizer(str(tiny_model_dir), progress=False, dtype=dtype)
    assert next(model.parameters()).dtype == expected


def test_loading_quietly_leaves_transformers_bars_as_they_were(tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    real_load, bars_while_loading = AutoModelForCausalLM.from_pretrained, []
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: bars_while_loading.append(
        hf_logging.is_progress_bar_enabled()) or real_load(*a, **k))
    hf_logging.enable_progress_bar()
    load_model_and_tokenizer(str(tiny_model_dir), progress=False)
    assert bars_while_loading == [False] and hf_logging.is_progress_bar_enabled()


def test_a_bfloat16_run_trains(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model.to(torch.bfloat16), tmp_path, max_steps=2, reward_funcs=(ones,))
    history = trainer.train()
    assert all(torch.isfinite(torch.tensor([m["loss"], m["grad_norm"]])).all() for m in history)


def test_eval_renders_prompts_like_training(tmp_path, tiny_model_dir, monkeypatch):
    import json
    import shutil

    import grpokit.from_config
    from grpokit.cli.main import main
    from grpokit.tasks.tiny_model import build_tokenizer

    model_dir = tmp_path / "chat_model"
    shutil.copytree(tiny_model_dir, model_dir)
    chat = build_tokenizer()
    chat.chat_template = TEMPLATE
    chat.save_pretrained(model_dir)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "Q", "answer": "1"}) + "\n")
    seen = {}
    real = grpokit.from_config.evaluate

    def spy(model, tokenizer, rows, **kwargs):
        seen.update(kwargs)
        return real(model, tokenizer, rows, **kwargs)

    monkeypatch.setattr(grpokit.from_config, "evaluate", spy)
    assert main(["eval", str(model_dir), "--dataset", str(data), "--num_generations", "1", "--max_completion_length",
                 "2", "--system_prompt", "S", "--progress_bar", "false"]) == 0
    assert seen["prompts"] == ["[system] S\n[user] Q\n[assistant] "]
