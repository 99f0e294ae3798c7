"""Training reward models (``grpokit reward train``): each form learns a separable toy task on the tiny
model, the saved model loads with plain transformers and scores through OutcomeRewardModel /
ProcessRewardModel exactly as it was trained, resume is bit-exact, bad rows fail naming file, row and column."""

import json

import pytest
import torch
import yaml
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoTokenizer

import grpokit
from grpokit import OutcomeRewardModel, ProcessRewardModel, RewardConfig, RewardTrainer
from grpokit.algorithms.reward import RewardBatch, detect_form, parse_rows, tokenize_rows
from grpokit.cli.main import main
from grpokit.config import ConfigError
from grpokit.data import DataError
from grpokit.tasks.tiny_model import TinyModelSpec, build_model
from grpokit.training.distributed import SINGLE
from helpers import assert_resume_is_bit_exact, reward_config, reward_rows, reward_trainer

# A chat template whose assistant turn holds the content verbatim (so step ends can be located in it).
CHAT = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


@pytest.mark.parametrize("form, steps", [("labelled", 40), ("pairs", 10), ("steps", 30)])
def test_each_form_learns_a_separable_task(tmp_path, tiny_model_dir, form, steps):
    trainer = reward_trainer(tmp_path, tiny_model_dir, reward_rows(form), max_steps=steps, eval_every=10)
    assert trainer.form == form and (len(trainer.train_examples), len(trainer.eval_examples)) == (64, 16)
    head = {"steps": "LlamaForTokenClassification"}.get(form, "LlamaForSequenceClassification")
    assert type(trainer.model).__name__ == head and trainer.model.config.num_labels == 1
    before = trainer.evaluate()
    history = trainer.train()
    first, last = sum(m["loss"] for m in history[:5]) / 5, sum(m["loss"] for m in history[-5:]) / 5
    assert last < 0.6 * first
    assert history[-1]["eval_accuracy"] >= 0.75 and history[-1]["eval_loss"] < before["eval_loss"]
    lines = [json.loads(line) for line in (tmp_path / "rm" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    assert [m["step"] for m in lines if "eval_accuracy" in m] == list(range(10, steps + 1, 10))
    assert {"loss", "accuracy", "grad_norm", "lr", "rows", "units", "tokens", "truncated"} <= set(lines[0])
    if form == "steps":  # units are steps: 3 per row
        assert lines[0]["units"] == 3 * lines[0]["rows"] == 48


def test_labels_choose_the_loss(tmp_path, tiny_model_dir):
    rows = [{"prompt": "q", "completion": "a", "label": v} for v in (0.5, 2.0, -1.0, 3.0)]
    trainer = reward_trainer(tmp_path, tiny_model_dir, rows, eval_fraction=0.0, batch_size=4)
    assert trainer.label_loss == "mse"
    r = trainer.scores(trainer.model, trainer.train_examples)
    losses, right = trainer.unit_losses(trainer.model, trainer.train_examples)
    torch.testing.assert_close(losses, (r - torch.tensor([0.5, 2.0, -1.0, 3.0])) ** 2)
    assert right is None and trainer.training_step()["accuracy"] is None
    binary = reward_trainer(tmp_path, tiny_model_dir, [{**row, "label": float(i % 2)} for i, row in enumerate(rows)],
                            eval_fraction=0.0)
    assert binary.label_loss == "bce"
    r = binary.scores(binary.model, binary.train_examples)
    losses, right = binary.unit_losses(binary.model, binary.train_examples)
    y = torch.tensor([0.0, 1.0, 0.0, 1.0])
    torch.testing.assert_close(losses, torch.nn.functional.binary_cross_entropy_with_logits(r, y, reduction="none"))
    assert right.tolist() == ((r > 0) == (y == 1)).tolist()
    pairs = reward_trainer(tmp_path, tiny_model_dir, reward_rows("pairs", 4), eval_fraction=0.0)
    r = pairs.scores(pairs.model, pairs.train_examples)  # chosen, rejected, chosen, ...
    losses, right = pairs.unit_losses(pairs.model, pairs.train_examples)
    torch.testing.assert_close(losses, -torch.nn.functional.logsigmoid(r[0::2] - r[1::2]))
    assert right.tolist() == (r[0::2] > r[1::2]).tolist()


def test_the_loss_does_not_depend_on_the_micro_batch_size(tmp_path, tiny_model_dir):
    def gradient(micro):
        trainer = reward_trainer(tmp_path, tiny_model_dir, reward_rows("steps", 20), micro_batch_size=micro,
                                 eval_fraction=0.0)
        batch = RewardBatch(trainer.train_examples[:7])  # the step's rows, in micro-batches as update() takes them
        loss, counts = 0.0, batch.counts(SINGLE)
        for start in range(0, len(batch), micro):
            share, _ = trainer.loss(trainer.model, batch.select(slice(start, start + micro)), counts, True)
            share.backward()
            loss += share.item()
        return loss, torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])

    (loss_1, grad_1), (loss_7, grad_7) = gradient(1), gradient(7)
    assert loss_1 == pytest.approx(loss_7, rel=1e-5)
    torch.testing.assert_close(grad_1, grad_7, rtol=1e-4, atol=1e-7)


def test_the_gradient_is_clipped_to_max_grad_norm(tmp_path, tiny_model_dir):
    trainer = reward_trainer(tmp_path, tiny_model_dir, reward_rows("labelled", 20), max_grad_norm=1e-3,
                             eval_fraction=0.0)
    stepped, step = [], trainer.learner.optimizer.step

    def recorded(*args, **kwargs):  # the norm of the gradient the optimizer steps with
        stepped.append(float(torch.cat([p.grad.flatten() for p in trainer.model.parameters()
                                        if p.grad is not None]).norm()))
        return step(*args, **kwargs)

    trainer.learner.optimizer.step = recorded
    metrics = trainer.training_step()
    assert metrics["grad_norm"] > 1e-2 and stepped == [pytest.approx(1e-3, rel=1e-3)]  # the norm before clipping


@pytest.mark.parametrize("chat", [False, True])
def test_the_outcome_model_loads_and_scores_as_trained(tmp_path, tiny_model_dir, tokenizer, chat):
    if chat:
        tokenizer.chat_template = CHAT
    backbone = build_model(tokenizer, TinyModelSpec(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                                                   max_positions=64), seed=0)
    path = tmp_path / "backbone"
    backbone.save_pretrained(path)
    tokenizer.save_pretrained(path)
    rows = reward_rows("labelled", 12)
    trainer = RewardTrainer(reward_config(tmp_path, model=str(path), max_steps=3, eval_fraction=0.0),
                            train_dataset=rows)
    trainer.train()
    saved = tmp_path / "rm" / "model"
    plain = AutoModelForSequenceClassification.from_pretrained(saved).eval()
    for (name, a), b in zip(trainer.model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name
    assert plain.config.pad_token_id == tokenizer.pad_token_id and plain.config.num_labels == 1
    assert bool(AutoTokenizer.from_pretrained(saved).chat_template) == chat
    trainer.model.eval()
    with torch.no_grad():
        trained = trainer.scores(trainer.model, trainer.train_examples).tolist()
    prompts, completions = [r["prompt"] for r in rows], [r["completion"] for r in rows]
    assert OutcomeRewardModel(saved, batch_size=5)(prompts=prompts, completions=completions) == pytest.approx(
        trained, abs=1e-5)
    # and the text is the template's turns (or plain prompt + completion), as plain transformers reads it
    text = (tokenizer.apply_chat_template([{"role": "user", "content": "q:"}, {"role": "assistant", "content": "ab"}],
                                          tokenize=False) if chat else "q:ab")
    with torch.no_grad():
        direct = plain(**tokenizer(text, add_special_tokens=not chat, return_tensors="pt")).logits[0, 0].item()
    assert OutcomeRewardModel(saved)(prompts=["q:"], completions=["ab"]) == pytest.approx([direct], abs=1e-5)


def test_the_process_model_loads_and_scores_as_trained(tmp_path, tiny_model_dir):
    rows = reward_rows("steps", 12)
    rows[0]["completion"] += "\n"  # a trailing separator is no step, in training as in scoring
    trainer = reward_trainer(tmp_path, tiny_model_dir, rows, max_steps=3, eval_fraction=0.0)
    trainer.train()
    saved = tmp_path / "rm" / "model"
    plain = AutoModelForTokenClassification.from_pretrained(saved)
    for (name, a), b in zip(trainer.model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name
    trainer.model.eval()
    with torch.no_grad():
        trained = torch.sigmoid(trainer.scores(trainer.model, trainer.train_examples)).tolist()
    scored = ProcessRewardModel(saved)(prompts=[r["prompt"] for r in rows], completions=[r["completion"] for r in rows])
    assert [[end for end, _ in s] for s in scored] == [[end for end, _ in r["steps"]] for r in rows]
    assert [p for s in scored for _, p in s] == pytest.approx(trained, abs=1e-5)


def test_steps_past_the_context_are_dropped_as_the_scorer_drops_them(tmp_path, tiny_model_dir):
    completion = "\n".join(["abcdefghi"] * 8)  # steps end at 9, 19, ..., 79; the context is 64 tokens
    rows = [{"prompt": "q", "completion": completion, "steps": [[10 * k + 9, k % 2] for k in range(8)]}] * 2
    trainer = reward_trainer(tmp_path, tiny_model_dir, rows, eval_fraction=0.0, max_steps=1)
    (example, _) = trainer.train_examples
    assert example.positions == [9, 19, 29, 39, 49, 59] and example.targets == [0, 1, 0, 1, 0, 1]
    assert trainer.summary["dropped_steps"] == 4 and trainer.summary["truncated_rows"] == 2
    short = reward_trainer(tmp_path, tiny_model_dir, rows, eval_fraction=0.0, max_length=20)
    assert short.train_examples[0].positions == [9, 19]


def test_resume_is_bit_exact(tmp_path, tiny_model_dir):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in reward_rows("pairs", 24)))
    values = dict(model=str(tiny_model_dir), dataset=str(data), max_steps=6, save_every=3, batch_size=4,
                  micro_batch_size=2, lr_schedule="cosine", warmup_steps=2, eval_every=2)
    assert_resume_is_bit_exact(lambda name, **resume: RewardTrainer(
        reward_config(tmp_path, output_dir=str(tmp_path / name), **resume, **values)), steps_before=3)
    assert len((tmp_path / "parts" / "metrics.jsonl").read_text().splitlines()) == 6
    with pytest.raises(ValueError, match="different config"):
        RewardTrainer(reward_config(tmp_path, output_dir=str(tmp_path / "parts"), resume="latest",
                                    **{**values, "learning_rate": 0.5})).train()


def test_config_checks():
    assert {"RewardTrainer", "RewardConfig"} <= set(grpokit.__all__)
    assert all(text.strip() for text in RewardConfig.help().values())  # every key documented
    with pytest.raises(ConfigError, match="model is required"):
        RewardConfig(dataset="d.jsonl")
    with pytest.raises(ConfigError, match="dataset is required"):
        RewardTrainer(RewardConfig(model="m"))
    with pytest.raises(ConfigError, match="form='pair' is not valid; choose one of 'auto', 'labelled', 'pairs'"):
        RewardConfig(model="m", form="pair")
    with pytest.raises(ConfigError, match="unknown config key 'label_los'; did you mean 'label_loss'"):
        RewardConfig.from_dict({"model": "m", "label_los": "bce"})
    with pytest.raises(ConfigError, match="eval_fraction=1.0 is out of range"):
        RewardConfig(model="m", eval_fraction=1.0)
    with pytest.raises(ConfigError, match="max_length=1 is out of range"):
        RewardConfig(model="m", max_length=1)


# ---- each check of the rows, and of what the trainer is handed, alone --------------------------------------


def parse(rows, form, **keys):
    return parse_rows(rows, form, RewardConfig(model="m", **keys), "d.jsonl")


def test_texts_labels_and_steps_are_read_as_written():
    messages = [{"role": "assistant", "content": "a"}]
    parsed, loss = parse([{"prompt": "q", "completion": messages, "label": "1"},
                          {"prompt": "q", "completion": "", "label": 0}], "labelled")  # CSV text; empty allowed
    assert parsed == [("q", [messages], [1.0], []), ("q", [""], [0.0], [])] and loss == "bce"
    parsed, _ = parse([{"prompt": "q", "completion": "ab\ncd", "steps": "[[1, 0], [5, 1]]"}], "steps")
    assert parsed == [("q", ["ab\ncd"], [0.0, 1.0], [1, 5])]  # the first and the last character end steps
    parsed, loss = parse([{"prompt": "q", "chosen": "a", "rejected": "b"}], "pairs")
    assert parsed == [("q", ["a", "b"], [], [])] and loss == ""
    # the labels choose the loss unless label_loss says
    assert parse([{"prompt": "q", "completion": "a", "label": v} for v in (0, 1)], "labelled")[1] == "bce"
    assert parse([{"prompt": "q", "completion": "a", "label": v} for v in (0, 0.5)], "labelled")[1] == "mse"
    assert parse([{"prompt": "q", "completion": "a", "label": 1}], "labelled", label_loss="mse")[1] == "mse"
    assert parse([{"prompt": "q", "completion": "a", "label": v} for v in (0, 0.5)], "labelled",
                 label_loss="bce")[1] == "bce"


@pytest.mark.parametrize("row, form, message", [
    ({"completion": [], "label": 1}, "labelled",
     "row 0 column 'completion' must be text or a non-empty list of {\"role\": ..., \"content\": ...} messages"),
    ({"completion": [{"role": "assistant", "content": 3}], "label": 1}, "labelled", "must be text or a non-empty"),
    ({"completion": 7, "label": 1}, "labelled", "row 0 column 'completion' must be text (or a list of chat "
                                                "messages), got int 7"),
    ({"completion": "a", "label": "inf"}, "labelled", "row 0 column 'label' must be a finite number, got float inf"),
    ({"completion": "a", "label": [1]}, "labelled", "row 0 column 'label' must be a finite number, got list [1]"),
    ({"completion": "ab", "steps": "[[2, 1]"}, "steps",
     "row 0 column 'steps' is text that is not a JSON list of [offset, label] pairs"),
    ({"completion": "ab", "steps": {"2": 1}}, "steps", "row 0 column 'steps' must be a non-empty list"),
    ({"completion": "ab", "steps": [[True, 1]]}, "steps", "step 0 is [True, 1]; expected [offset, label]"),
    ({"completion": "ab", "steps": [[2]]}, "steps", "step 0 is [2]; expected [offset, label]"),
    ({"completion": "ab", "steps": [(1, 0), [2, 1, 0]]}, "steps", "step 1 is [2, 1, 0]; expected"),
    ({"completion": "ab", "steps": [[2, -0.5]]}, "steps", "step 0's label -0.5 is out of range"),
    ({"completion": "ab", "steps": [[2, "x"]]}, "steps", "step 0's label must be a finite number, got str 'x'"),
    ({"completion": "a", "label": -1}, "labelled-bce", "row 0 column 'label': label -1.0 is out of range"),
])
def test_each_bad_value_is_named(row, form, message):
    form, _, loss = form.partition("-")
    with pytest.raises(DataError) as caught:
        parse([{"prompt": "q", **row}], form, **({"label_loss": loss} if loss else {}))
    assert message in str(caught.value) and str(caught.value).startswith("d.jsonl: row 0")


def test_the_form_is_found_from_the_first_row_steps_then_pairs_then_labelled():
    every = {"prompt": "q", "completion": "a", "label": 1, "chosen": "a", "rejected": "b", "steps": [[1, 1]]}
    auto = RewardConfig(model="m")
    assert detect_form([every], auto, "d") == "steps"
    assert detect_form([{k: v for k, v in every.items() if k != "steps"}], auto, "d") == "pairs"
    assert detect_form([{"prompt": "q", "completion": "a", "label": 1, "chosen": "a"}], auto, "d") == "labelled"
    assert detect_form([every], RewardConfig(model="m", form="labelled"), "d") == "labelled"  # as set
    assert detect_form([{"prompt": "q", "text": "a", "score": 1}],
                       RewardConfig(model="m", completion_column="text", label_column="score"), "d") == "labelled"
    with pytest.raises(DataError, match=r"d: row 0's columns \[\] make none of the three forms \(labelled: \['prompt', "
                                        r"'completion', 'label'\]; pairs: \['prompt', 'chosen', 'rejected'\]; steps"):
        detect_form([], auto, "d")


def test_a_process_model_needs_a_fast_tokenizer_and_a_template_that_keeps_the_text(tokenizer):
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="a process reward model needs a fast tokenizer"):
        tokenize_rows([], "steps", SimpleNamespace(is_fast=False), None, "d")
    (example,), _ = tokenize_rows([("", ["ab"], [1.0], [2])], "steps", tokenizer, None, "d")  # at character 0
    assert example.targets == [1.0] and len(example.positions) == 1
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] | upper }}\n{% endfor %}"
    rows = [("q", ["ab"], [1.0], [2])]
    with pytest.raises(DataError, match="d: row 0: the tokenizer's chat template changes the assistant's text"):
        tokenize_rows(rows, "steps", tokenizer, None, "d")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] | replace('a', 'b') }}\n{% endfor %}"
    with pytest.raises(DataError, match="d: row 0: the tokenizer's chat template changes the assistant's text"):
        tokenize_rows(rows, "steps", tokenizer, None, "d")  # the completion found, but rewritten
    (example,), dropped = tokenize_rows([("q", ["ab"], [1.0], [])], "labelled", tokenizer, None, "d")
    assert dropped == 0 and example.positions == [] and example.units == 1  # the outcome model copes


def test_the_trainer_refuses_what_it_cannot_train(tmp_path, tiny_model_dir, monkeypatch):
    rows = reward_rows("labelled", 8)
    with pytest.raises(DataError, match="eval_dataset: its labels make the loss mse, the training rows' bce; "
                                        "set label_loss"):
        RewardTrainer(reward_config(tmp_path, model=str(tiny_model_dir)), train_dataset=rows,
                      eval_dataset=[{**row, "label": 0.5} for row in rows])
    with pytest.raises(ValueError, match="a tokenizer is required when a model is passed"):
        RewardTrainer(reward_config(tmp_path), model=torch.nn.Linear(1, 1), train_dataset=rows)
    with pytest.raises(ConfigError, match="max_length=65 exceeds the model's context of 64 tokens"):
        reward_trainer(tmp_path, tiny_model_dir, rows, max_length=65)
    steps = [{"prompt": "q", "completion": "x" * 80, "steps": [[80, 1]]}]
    with pytest.raises(DataError, match="train_dataset: no training row left: every row's steps lie past "
                                        "max_length=20"):
        reward_trainer(tmp_path, tiny_model_dir, steps, max_length=20, eval_fraction=0.0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="grpokit reward train runs in one process; launch it without torchrun"):
        reward_trainer(tmp_path, tiny_model_dir, rows)


# ---- bad input, through the command line -----------------------------------------------------------


def write_config(tmp_path, model, rows, **extra):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    values = dict(model=str(model), dataset=str(data), output_dir=str(tmp_path / "rm"), batch_size=4,
                  micro_batch_size=4, max_steps=2, learning_rate=1e-3, progress_bar=False, eval_fraction=0.0, **extra)
    path = tmp_path / "reward.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


GOOD = {"prompt": "q", "completion": "ab\ncd", "steps": [[2, 1], [5, 0]]}


@pytest.mark.parametrize("rows, extra, message", [
    ([{"prompt": "q", "completion": "a", "label": 1}, {"prompt": "q", "completion": "b", "label": "yes"}], {},
     "line 2 column 'label' must be a finite number, got str 'yes'"),
    ([{"prompt": "q", "completion": "a", "label": 1}, {"prompt": "q", "completion": "b", "label": 2}],
     {"label_loss": "bce"}, "line 2 column 'label': label 2.0 is out of range for binary cross-entropy"),
    ([{"prompt": "q", "completion": "a", "label": None}], {}, "line 1 column 'label' is null"),
    ([{"prompt": "q", "chosen": "a", "rejected": "b"}, {"prompt": "q", "chosen": "a", "rejected": " "}], {},
     "line 2 column 'rejected' is empty: a pair needs a completion on each side"),
    ([{"prompt": "q", "chosen": "", "rejected": "b"}], {}, "line 1 column 'chosen' is empty"),
    ([{"prompt": "q", "chosen": "a"}], {"form": "pairs"}, "line 1 has no column 'rejected'"),
    ([{"prompt": "q", "completion": "a", "label": 1}, {"prompt": "q", "completion": "b"}], {},
     "line 2 has no column 'label'"),
    ([{"prompt": "q", "text": "a", "score": 1}], {}, "line 1's columns ['prompt', 'score', 'text'] make none of the "
                                                     "three forms"),
    ([GOOD, {**GOOD, "steps": [[2, 1], [9, 0]]}], {}, "line 2 column 'steps': step 1 ends at character 9, outside "
                                                      "the completion's 1..5"),
    ([GOOD, {**GOOD, "steps": [[0, 1]]}], {}, "step 0 ends at character 0, outside the completion's 1..5"),
    ([{**GOOD, "steps": [[5, 1], [2, 0]]}], {}, "line 1 column 'steps': step 1 ends at character 2, not after step 0 "
                                                "(5): offsets must increase"),
    ([{**GOOD, "steps": [[2, 1], [2, 0]]}], {}, "not after step 0 (2)"),
    ([{**GOOD, "steps": [[2, 1.5]]}], {}, "step 0's label 1.5 is out of range"),
    ([{**GOOD, "steps": [[2.5, 1]]}], {}, "step 0 is [2.5, 1]; expected [offset, label] with an integer offset"),
    ([{**GOOD, "steps": []}], {}, "line 1 column 'steps' must be a non-empty list of [offset, label] pairs"),
    ([GOOD], {"label_loss": "hinge"}, "label_loss='hinge' is not valid"),
])
def test_bad_input_is_one_clear_line(tmp_path, tiny_model_dir, capsys, rows, extra, message):
    path = write_config(tmp_path, tiny_model_dir, rows, **extra)
    assert main(["reward", "train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("error: ") and message in err and "Traceback" not in err
    if "line" in message or "row" in message:
        assert str(tmp_path / "rows.jsonl") in err


def test_csv_rows_and_the_cli(tmp_path, tiny_model_dir, capsys):
    csv = tmp_path / "steps.csv"
    lines = ["prompt,completion,steps"] + [f'q,"{r["completion"]}","{json.dumps(r["steps"])}"'
                                           for r in reward_rows("steps", 8)]
    csv.write_text("\n".join(lines) + "\n")
    path = write_config(tmp_path, tiny_model_dir, [GOOD])
    values = {**yaml.safe_load(path.read_text()), "dataset": str(csv), "eval_fraction": 0.25}
    path.write_text(yaml.safe_dump(values))
    assert main(["reward", "train", str(path), "--max_steps", "2", "--save_every", "1"]) == 0
    out = capsys.readouterr().out
    assert "reward model (process, steps rows, bce per step): 6 training rows, 2 held out; 2 steps" in out
    assert f"process_model:{tmp_path / 'rm' / 'model'}" in out
    assert len(list((tmp_path / "rm" / "checkpoints").glob("step-*"))) == 2
    ProcessRewardModel(tmp_path / "rm" / "model")  # a valid process reward model


def test_reward_train_help_lists_every_key(capsys):
    with pytest.raises(SystemExit):
        main(["reward", "train", "--help"])
    out = capsys.readouterr().out
    assert all(key in out for key in RewardConfig.help())


def test_a_steps_metrics_and_the_evaluation_count_what_they_say(tmp_path, tiny_model_dir):
    trainer = reward_trainer(tmp_path, tiny_model_dir, reward_rows("steps", 8), eval_fraction=0.25, batch_size=3,
                             micro_batch_size=2, max_steps=2)
    examples = [trainer.train_examples[i] for i in trainer.batch_indices(0)]
    metrics = trainer.training_step()
    assert (metrics["step"], metrics["rows"], metrics["units"], metrics["truncated"]) == (1, 3, 9, 0)
    assert metrics["tokens"] == sum(len(ids) for e in examples for ids in e.sequences)
    assert metrics["epoch"] == 1 / trainer.steps_per_epoch == 0.5 and 0 <= metrics["accuracy"] <= 1
    assert metrics["time_step"] > 0
    batch = RewardBatch(trainer.train_examples)
    assert batch.select(torch.tensor([2, 0])).examples == [batch.examples[2], batch.examples[0]]
    assert batch.select(slice(1, 3)).examples == batch.examples[1:3] and len(batch) == 6
    assert batch.units() == 18.0 and batch.counts(SINGLE).tokens == 18.0 and batch.counts(SINGLE).sequences == 6.0
    trainer.model.train()
    evaluation = trainer.evaluate()  # two micro-batches of the two held-out rows' six steps
    assert trainer.model.training  # left as it was
    trainer.model.eval()
    with torch.no_grad():
        losses, right = trainer.unit_losses(trainer.model, trainer.eval_examples)
    assert evaluation["eval_loss"] == pytest.approx(losses.mean().item(), rel=1e-5)
    assert evaluation["eval_accuracy"] == int(right.sum()) / 6


@pytest.mark.parametrize("form, said", [("pairs", "(outcome, pairs rows, Bradley-Terry)"),
                                        ("labelled", "(outcome, labelled rows, bce)"),
                                        ("steps", "(process, steps rows, bce per step)")])
def test_the_announcement_names_the_kind_and_the_loss(tmp_path, tiny_model_dir, capsys, form, said):
    reward_trainer(tmp_path, tiny_model_dir, reward_rows(form, 8), eval_fraction=0.25, batch_size=3).announce()
    assert capsys.readouterr().out == (f"reward model {said}: 6 training rows, 2 held out; 4 steps of 3 rows; "
                                       "max_length 64: 0 rows truncated, 0 steps and 0 rows left out (past the cut)\n")


def test_the_backbone_is_found_as_the_config_says(tmp_path, tiny_model_dir, monkeypatch):
    import grpokit.algorithms.reward as reward_module

    asked = []
    real = reward_module.model_directory
    monkeypatch.setattr(reward_module, "model_directory", lambda *args: asked.append(args) or real(*args))
    settings = reward_config(tmp_path, model=str(tiny_model_dir), seed=3)
    model, _ = reward_module.load_backbone(settings, "ForTokenClassification")
    assert asked == [(str(tiny_model_dir), 3, False)] and type(model).__name__ == "LlamaForTokenClassification"
