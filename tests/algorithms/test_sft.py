"""Supervised fine-tuning (``grpokit sft``): the tokens in the loss, the loss and its gradient, chat rows,
truncation, the held-out split, resume, bad input, and the cold start → GRPO path through the CLI."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from grpokit.algorithms.sft import Example, SFTTrainer, collate, tokenize_rows
from grpokit.cli.main import main
from grpokit.config import ConfigError, SFTConfig, load_config
from grpokit.data import DataError
from grpokit.rollout.generate import stop_token_ids
from grpokit.training.update import LossCounts, UpdateBatch
from helpers import assert_resume_is_bit_exact

EXAMPLES = Path(__file__).parents[2] / "examples"
ROWS = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a, b in [(1, 2), (12, 30), (7, 8), (40, 2), (5, 5),
                                                                      (9, 9), (23, 4), (6, 1)]]
# A ChatML-like template: every message ends with the end-of-turn token (here the tokenizer's EOS) and a newline.
CHAT = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}<eos>\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}")


def sft_config(tmp_path, **overrides) -> SFTConfig:
    values = dict(model="unused", output_dir=str(tmp_path / "sft"), learning_rate=1e-2,
                  lr_schedule="constant", batch_size=4, micro_batch_size=4, max_steps=4, progress_bar=False,
                  mixed_precision="no")  # exact comparisons: never bf16, whatever 'auto' finds on this machine
    return SFTConfig(**{**values, **overrides})


def make_trainer(tokenizer, model, tmp_path, rows=ROWS, **overrides) -> SFTTrainer:
    return SFTTrainer(sft_config(tmp_path, **overrides), model=model, tokenizer=tokenizer, train_dataset=rows)


def examples_of(tokenizer, rows, model=None, max_length=None, **overrides):
    config = SFTConfig(model="m", dataset="d", **overrides)
    stops = [tokenizer.eos_token_id] if model is None else stop_token_ids(model, tokenizer)
    return tokenize_rows(rows, tokenizer, config, stops, max_length, "rows.jsonl")


def test_the_loss_mask_covers_exactly_the_completion_tokens(tokenizer):
    rollout = collate(examples_of(tokenizer, ROWS[:3]), tokenizer.pad_token_id)
    for i, row in enumerate(ROWS[:3]):
        completion = rollout.completion_ids[i][rollout.completion_mask[i].bool()]
        prompt = rollout.prompt_ids[i][rollout.prompt_mask[i].bool()]
        assert tokenizer.decode(completion) == row["completion"] + "<eos>"
        assert tokenizer.decode(prompt) == row["prompt"]
        # everything else is padding: prompts on the left, completions on the right
        assert (rollout.completion_ids[i][~rollout.completion_mask[i].bool()] == tokenizer.pad_token_id).all()
    assert rollout.prompt_mask[0].tolist() == [0, 0, 1, 1, 1, 1]  # "1+2=" in a batch whose widest prompt is 6
    assert rollout.completion_mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 1, 1]]  # "3<eos>", "42<eos>", "15<eos>"


def test_the_loss_is_the_mean_nll_of_the_completion_tokens(tokenizer, tiny_model, tmp_path):
    """Against transformers' own loss on each unpadded row, labels -100 on the prompt: the rows' sums over
    their completion tokens, divided by the batch's completion tokens."""
    trainer = make_trainer(tokenizer, tiny_model, tmp_path)
    examples = trainer.train_examples[:3]
    rollout = collate(examples, tokenizer.pad_token_id)
    total = int(rollout.completion_mask.sum())
    ours, _ = trainer.loss(tiny_model, UpdateBatch(rollout, rollout.completion_mask, rollout.logp),
                           LossCounts(sequences=3, tokens=total), True)
    expected = 0.0
    for e in examples:
        ids = torch.tensor([e.prompt_ids + e.completion_ids])
        labels = torch.tensor([[-100] * len(e.prompt_ids) + e.completion_ids])
        expected += tiny_model(input_ids=ids, labels=labels).loss.item() * len(e.completion_ids)
    assert ours.item() == pytest.approx(expected / total, rel=1e-5)


class LogitsSpy(torch.nn.Module):
    """The model, computing the logits of every position and keeping their gradient."""

    def __init__(self, model):
        super().__init__()
        self.model, self.logits = model, None

    def forward(self, logits_to_keep=None, **inputs):
        output = self.model(**inputs)
        output.logits.retain_grad()
        self.logits = output.logits
        return output


def test_prompt_and_padding_positions_get_no_gradient(tokenizer, tiny_model, tmp_path):
    """d loss / d logits is (softmax − one-hot(next token)) / completion tokens where the next token is a
    completion token, and exactly 0 everywhere else: prompt tokens, padding, the last position."""
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, fast_path=False)
    rollout = collate(trainer.train_examples[:4], tokenizer.pad_token_id)
    spy = LogitsSpy(tiny_model)
    total = int(rollout.completion_mask.sum())
    loss, _ = trainer.loss(spy, UpdateBatch(rollout, rollout.completion_mask, rollout.logp),
                           LossCounts(sequences=4, tokens=total), True)
    loss.backward()
    grad = spy.logits.grad  # (N, P + T, V)
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], dim=1)
    in_loss = torch.cat([torch.zeros_like(rollout.prompt_mask), rollout.completion_mask], dim=1).bool()
    predicts = torch.zeros_like(in_loss)
    predicts[:, :-1] = in_loss[:, 1:]  # position t predicts token t + 1
    expected = torch.softmax(spy.logits.detach(), dim=-1)
    expected[:, :-1] -= torch.nn.functional.one_hot(ids[:, 1:], expected.shape[-1])
    expected = expected / total * predicts.unsqueeze(-1)
    assert (grad.abs().sum(dim=-1) > 0).equal(predicts)
    torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-7)


def test_the_gradient_does_not_depend_on_the_micro_batch_size(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path)
    rollout = collate(trainer.train_examples[:5], tokenizer.pad_token_id)
    batch = UpdateBatch(rollout, rollout.completion_mask, rollout.logp)
    counts = LossCounts(sequences=5, tokens=float(rollout.completion_mask.sum()))

    def gradient(micro_batch_size):
        tiny_model.zero_grad()
        for start in range(0, 5, micro_batch_size):
            trainer.loss(tiny_model, batch.select(slice(start, start + micro_batch_size)), counts, True)[0].backward()
        return torch.cat([p.grad.flatten() for p in tiny_model.parameters()])

    torch.testing.assert_close(gradient(1), gradient(5), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gradient(2), gradient(5), rtol=1e-5, atol=1e-7)


def test_gradient_checkpointing_recomputes_and_gives_the_same_gradient(tokenizer, tiny_model, tmp_path):
    calls = []  # the first layer's MLP runs again in backward when the layer is recomputed
    tiny_model.model.layers[0].mlp.up_proj.register_forward_hook(lambda *a: calls.append(1))

    def gradient(checkpointing):
        trainer = make_trainer(tokenizer, tiny_model, tmp_path / str(checkpointing),
                               gradient_checkpointing=checkpointing)
        rollout = collate(trainer.train_examples[:5], tokenizer.pad_token_id)
        counts = LossCounts(sequences=5, tokens=float(rollout.completion_mask.sum()))
        tiny_model.zero_grad()
        calls.clear()
        batch = UpdateBatch(rollout, rollout.completion_mask, rollout.logp)
        trainer.loss(tiny_model, batch, counts, True)[0].backward()
        return torch.cat([p.grad.flatten() for p in tiny_model.parameters()]), len(calls)

    (with_checkpoints, recomputed), (plain, once) = gradient(True), gradient(False)
    assert (recomputed, once) == (2, 1)
    torch.testing.assert_close(with_checkpoints, plain, rtol=1e-5, atol=1e-7)


def test_the_loss_falls_and_the_metrics_are_logged(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, max_steps=30, eval_fraction=0.25, eval_every=10)
    assert (len(trainer.train_examples), len(trainer.eval_examples)) == (6, 2)
    history = trainer.train()
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]
    lines = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, 31))
    assert [m["step"] for m in lines if "eval_loss" in m] == [10, 20, 30]
    assert {"loss", "grad_norm", "lr", "tokens", "completion_tokens", "truncated", "tokens_per_sec", "epoch"} <= set(
        lines[0])
    assert lines[2]["epoch"] == 1.5  # 6 rows in batches of 4: 2 steps per epoch
    assert lines[0]["completion_tokens"] == sum(
        len(trainer.train_examples[i].completion_ids) for i in trainer.batch_indices(0))


def test_each_epoch_reads_every_row_once(tokenizer, tiny_model, tmp_path):
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, batch_size=3)  # 8 rows: batches of 3, 3, 2
    for epoch in range(2):
        steps = [trainer.batch_indices(epoch * 3 + k) for k in range(3)]
        assert [len(s) for s in steps] == [3, 3, 2]
        assert sorted(i for s in steps for i in s) == list(range(8))
    assert trainer.batch_indices(0) != trainer.batch_indices(3)  # a fresh order each epoch


def test_the_held_out_rows_are_a_seeded_draw(tokenizer, tiny_model, tmp_path):
    def held_out(seed):
        trainer = make_trainer(tokenizer, tiny_model, tmp_path, eval_fraction=0.25, seed=seed)
        return [e.completion_ids for e in trainer.eval_examples], [e.completion_ids for e in trainer.train_examples]

    (held, kept), (again, _), (other, _) = held_out(0), held_out(0), held_out(1)
    assert len(held) == 2 and held == again and held != other
    assert sorted(held + kept) == sorted(e.completion_ids for e in examples_of(tokenizer, ROWS))
    with pytest.raises(ConfigError, match="eval_fraction=0.95 holds out all 8 rows"):
        make_trainer(tokenizer, tiny_model, tmp_path, eval_fraction=0.95)


def test_chat_rows(tokenizer):
    """A message-list completion is what the template renders after the prompt, cut after its end-of-turn
    token; a text completion after a chat prompt gets EOS; the system prompt is in both."""
    tokenizer.chat_template = CHAT
    rows = [{"prompt": [{"role": "user", "content": "Q"}], "completion": [{"role": "assistant", "content": "A"}]},
            {"prompt": [{"role": "user", "content": "Q"}], "completion": "A"},
            {"prompt": "Q", "completion": [{"role": "assistant", "content": "A"}]}]
    for example in examples_of(tokenizer, rows, system_prompt="S"):
        assert tokenizer.decode(example.prompt_ids) == "[system] S<eos>\n[user] Q<eos>\n[assistant] "
        assert tokenizer.decode(example.completion_ids) == "A<eos>"
    plain = examples_of(tokenizer, [{"prompt": "Q", "completion": "A"}], chat_template=False)[0]
    assert tokenizer.decode(plain.prompt_ids + plain.completion_ids) == "QA<eos>"


def test_chat_rows_that_cannot_be_split_are_refused(tokenizer):
    tokenizer.chat_template = CHAT.replace("[assistant] {% endif %}", "[bot] {% endif %}")  # prompt ≠ prefix
    rows = [{"prompt": "Q", "completion": [{"role": "assistant", "content": "A"}]}]
    with pytest.raises(DataError, match=r"rows.jsonl: row 0 column 'completion': the chat template renders the "
                                        r"prompt differently"):
        examples_of(tokenizer, rows)
    with pytest.raises(DataError, match=r"row 0 column 'completion': a completion given as chat messages needs"):
        examples_of(tokenizer, rows, chat_template=False)


def test_max_length_truncates_and_leaves_out(tokenizer, tiny_model, tmp_path):
    rows = [{"prompt": "ab", "completion": "cdef"}, {"prompt": "abcdef", "completion": "g"},
            {"prompt": "a", "completion": "b"}]
    long, dropped, short = examples_of(tokenizer, rows, max_length=5)
    assert tokenizer.decode(long.completion_ids) == "cde" and long.truncated  # EOS cut too
    assert dropped is None
    assert tokenizer.decode(short.completion_ids) == "b<eos>" and not short.truncated
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, rows=rows, max_length=5, batch_size=2, max_steps=1)
    assert (trainer.summary["rows"], trainer.summary["dropped_rows"], trainer.summary["truncated_rows"]) == (2, 1, 1)
    assert trainer.training_step()["truncated"] == 1
    with pytest.raises(ConfigError, match="max_length=65 exceeds the model's context of 64 tokens"):
        make_trainer(tokenizer, tiny_model, tmp_path, max_length=65)


def test_resume_is_bit_exact(tmp_path, tiny_model_dir):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    config = dict(model=str(tiny_model_dir), dataset=str(data), max_steps=6, save_every=3, eval_fraction=0.25,
                  lr_schedule="cosine", warmup_steps=2)

    assert_resume_is_bit_exact(lambda name, **resume: SFTTrainer(
        sft_config(tmp_path, output_dir=str(tmp_path / name), **resume, **config)), steps_before=3)
    assert len((tmp_path / "parts" / "metrics.jsonl").read_text().splitlines()) == 6
    with pytest.raises(ValueError, match="different config"):
        SFTTrainer(sft_config(tmp_path, output_dir=str(tmp_path / "parts"), resume="latest",
                              **{**config, "learning_rate": 0.5})).train()


def test_the_final_model_loads_with_plain_transformers(tokenizer, tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = make_trainer(tokenizer, tiny_model, tmp_path, max_steps=2)
    trainer.train()
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "sft" / "model")
    for (name, a), b in zip(trainer.model.state_dict().items(), saved.state_dict().values()):
        assert torch.equal(a, b), name
    assert AutoTokenizer.from_pretrained(tmp_path / "sft" / "model").eos_token == "<eos>"


def test_lora_saves_the_merged_model_and_the_adapter(tokenizer, tiny_model, tmp_path):
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, lora_rank=4, lora_target_modules=["q_proj", "v_proj"],
                           max_steps=3)
    trainer.train()
    assert (tmp_path / "sft" / "adapter" / "adapter_model.safetensors").is_file()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "sft" / "model").state_dict()
    changed = [k for k in before if not torch.equal(before[k], merged[k])]
    assert changed and all("q_proj" in k or "v_proj" in k for k in changed)


def test_config_checks():
    with pytest.raises(ConfigError, match="model is required"):
        SFTConfig(dataset="d.jsonl")
    with pytest.raises(ConfigError, match="dataset is required: a file of prompt/completion rows"):
        SFTTrainer(SFTConfig(model="m"))
    with pytest.raises(ConfigError, match="unknown config key 'num_train_epochs'; TRL's 'num_train_epochs' is epochs"):
        SFTConfig.from_dict({"model": "m", "dataset": "d", "num_train_epochs": 2})
    with pytest.raises(ConfigError, match="unknown config key 'batch_sise'; did you mean 'batch_size'"):
        SFTConfig.from_dict({"model": "m", "dataset": "d", "batch_sise": 2})
    with pytest.raises(ConfigError, match="eval_fraction=1.0 is out of range"):
        SFTConfig(model="m", dataset="d", eval_fraction=1.0)
    with pytest.raises(ConfigError, match="eval_fraction and eval_dataset"):
        SFTConfig(model="m", dataset="d", eval_fraction=0.1, eval_dataset="e.jsonl")
    with pytest.raises(ConfigError, match="warmup_steps=5 leaves no step"):
        SFTConfig(model="m", dataset="d", max_steps=5, warmup_steps=5)
    assert load_config(EXAMPLES / "sft.yaml", {"epochs": 1}, config_class=SFTConfig).epochs == 1.0


# ---- the command line ----------------------------------------------------------------------------


def write_sft_config(tmp_path, tiny_model_dir, rows, **extra) -> Path:
    data = tmp_path / "cold_start.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    values = dict(model=str(tiny_model_dir), dataset=str(data), output_dir=str(tmp_path / "sft"), batch_size=4,
                  micro_batch_size=2, epochs=2, learning_rate=1e-2, progress_bar=False, **extra)
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def test_sft_then_grpo_through_the_cli(tmp_path, tiny_model_dir, capsys):
    rows = [{"prompt": f"What is {a} + 1?", "completion": f"<answer>{a + 1}</answer>", "answer": str(a + 1)}
            for a in range(10, 20)]
    config = write_sft_config(tmp_path, tiny_model_dir, rows, eval_fraction=0.2)
    assert main(["sft", str(config), "--save_every", "2"]) == 0
    out = capsys.readouterr().out
    assert "SFT: 8 training rows, 2 held out; 4 steps" in out and "done: 4 steps" in out
    model = tmp_path / "sft" / "model"
    assert (model / "model.safetensors").is_file() and (model / "tokenizer.json").is_file()
    assert len(list((tmp_path / "sft" / "checkpoints").glob("step-*"))) == 2

    grpo = tmp_path / "grpo.yaml"
    grpo.write_text(yaml.safe_dump(dict(model=str(model), dataset=str(tmp_path / "cold_start.jsonl"),
                                        output_dir=str(tmp_path / "grpo"), prompts_per_step=2, num_generations=2,
                                        max_completion_length=8, max_steps=2, progress_bar=False)))
    assert main(["train", str(grpo)]) == 0
    assert len((tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()) == 2


def test_sft_from_flags_alone_through_the_cli(tmp_path, tiny_model_dir, capsys):
    """No CONFIG: every key a flag (a positional CONFIG once took --model's value for the config file)."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    assert main(["sft", "--model", str(tiny_model_dir), "--dataset", str(data), "--output_dir", str(tmp_path / "out"),
                 "--max_steps", "2", "--progress-bar", "false"]) == 0
    assert "done: 2 steps" in capsys.readouterr().out
    assert (tmp_path / "out" / "model" / "model.safetensors").is_file()


@pytest.mark.parametrize(
    "rows, extra, message",
    [
        ([{"prompt": "1+1=", "completions": "2"}], [], "line 1 has no column 'completion' (its columns: "
                                                       "['completions', 'prompt']); did you mean 'completions'?"),
        ([{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2=", "completion": ""}], [],
         "line 2 column 'completion' is empty"),
        ([{"prompt": "1+1=", "completion": 2}], [], "line 1 column 'completion' must be text (or a list of chat "
                                                    "messages), got int 2"),
        ([{"prompt": 11, "completion": "2"}], [], "line 1 column 'prompt' must be a non-empty string"),
        ([{"prompt": "1+1=", "completion": [{"role": "assistant"}]}], [], "line 1 column 'completion' must be text "
                                                                         "or a non-empty list"),
        ([{"q": "1+1=", "a": "2"}], ["--prompt_column", "q", "--completion_column", "b"], "line 1 has no column 'b'"),
        (ROWS, ["--num_train_epochs", "2"], "TRL's 'num_train_epochs' is epochs here"),
        (ROWS, ["--epochs", "0"], "epochs=0.0 is out of range"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, tiny_model_dir, capsys, rows, extra, message):
    config = write_sft_config(tmp_path, tiny_model_dir, rows)
    assert main(["sft", str(config), *extra]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("error: ") and message in err and "Traceback" not in err
    if "line" in message or "row" in message:
        assert str(tmp_path / "cold_start.jsonl") in err


def test_sft_help_lists_every_key(capsys):
    with pytest.raises(SystemExit):
        main(["sft", "--help"])
    out = capsys.readouterr().out
    assert all(key in out for key in SFTConfig.help())


def test_collate_keeps_truncation_flags(tokenizer):
    rollout = collate([Example([5, 6], [7], truncated=True), Example([5], [7, 8, 1], truncated=False)], 0)
    assert rollout.truncated.tolist() == [True, False]
    assert rollout.prompt_ids.tolist() == [[5, 6], [0, 5]] and rollout.completion_ids.tolist() == [[7, 0, 0], [7, 8, 1]]


def test_mixed_precision_auto_is_decided_once_at_start_up(tokenizer, tiny_model, tmp_path, monkeypatch):
    import grpokit.runtime.device

    monkeypatch.setattr(grpokit.runtime.device, "native_bf16", lambda *args: "amx_bf16")
    assert make_trainer(tokenizer, tiny_model, tmp_path, mixed_precision="auto").mixed_precision == "bf16"
    monkeypatch.setattr(grpokit.runtime.device, "native_bf16", lambda *args: None)
    assert make_trainer(tokenizer, tiny_model, tmp_path, mixed_precision="auto").mixed_precision == "no"
    assert make_trainer(tokenizer, tiny_model, tmp_path, mixed_precision="bf16").mixed_precision == "bf16"
