"""What the reward trainer is handed, each route to it: the config's datasets (splits, renamed columns, held-out
rows), rows and a model passed in Python (its pad token, its context, the device), and the scoring pass itself
(padding masked, ties and zero logits counted as they are). test_reward_train.py trains; these build the trainer,
or take one step, and check what it made of its input."""

import contextlib
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    BertConfig,
    BertForSequenceClassification,
)

import grpokit.algorithms.reward as reward_module
from grpokit import RewardConfig, RewardTrainer
from grpokit.algorithms.reward import parse_rows, tokenize_rows
from grpokit.config import ConfigError
from grpokit.data import DataError
from grpokit.tasks.tiny_model import build_tokenizer
from grpokit.training.supervised import split
from helpers import reward_config, reward_rows, reward_trainer

datasets = pytest.importorskip("datasets")

# Steps whose assistant text the template rewrites (so they cannot be located) hold "zz"; the others are kept.
REWRITES_ZZ = "{% for m in messages %}{{ m['content'] | replace('zz', 'Z') }}\n{% endfor %}"


def classifier(tiny_model_dir, head=AutoModelForSequenceClassification):
    return head.from_pretrained(tiny_model_dir, num_labels=1)


def given(tmp_path, model, tokenizer, rows, **overrides):
    return RewardTrainer(reward_config(tmp_path, model="my-classifier", **overrides), model=model, tokenizer=tokenizer,
                         train_dataset=rows)


# ---- the datasets ------------------------------------------------------------------------------------------


def test_the_config_datasets_read_their_own_split_with_the_columns_renamed(tmp_path, tiny_model_dir):
    def renamed(rows):
        return [{"question": r["prompt"], "text": r["completion"], "good": r["label"]} for r in rows]

    train, test = reward_rows("labelled", 12, seed=1), reward_rows("labelled", 5, seed=2)
    folder = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(renamed(train)),
                          "test": datasets.Dataset.from_list(renamed(test))}).save_to_disk(str(folder))
    columns = {"question": "prompt", "text": "completion", "good": "label"}
    trainer = RewardTrainer(reward_config(tmp_path, model=str(tiny_model_dir), dataset=str(folder),
                                          eval_dataset=str(folder), dataset_columns=columns, eval_fraction=0.5))
    # eval_dataset given: no row of the training split is held out, whatever eval_fraction says
    settings = trainer.config
    expected = [tokenize_rows(parse_rows(rows, "labelled", settings, "d")[0], "labelled", trainer.tokenizer, 64,
                              "d")[0] for rows in (train, test)]
    assert trainer.train_examples == expected[0]
    assert trainer.eval_examples == expected[1] and trainer.summary["eval_rows"] == 5
    # the test split, however the training split is named
    swapped = RewardTrainer(reward_config(tmp_path, model=str(tiny_model_dir), dataset=str(folder),
                                          eval_dataset=str(folder), dataset_columns=columns,
                                          dataset_train_split="test", dataset_test_split="train"))
    assert swapped.eval_examples == expected[0] and len(swapped.train_examples) == 5


def test_a_bad_held_out_row_is_named_by_its_own_file(tmp_path, tiny_model_dir):
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    row = '{"prompt": "q", "completion": "%s", "label": %s}\n'
    train.write_text(row % ("a", 1) + row % ("b", 0))
    held.write_text(row % ("a", 1) + row % ("b", '"x"'))
    with pytest.raises(DataError) as caught:
        RewardTrainer(reward_config(tmp_path, model=str(tiny_model_dir), dataset=str(train), eval_dataset=str(held)))
    assert str(caught.value) == f"{held}: line 2 column 'label' must be a finite number, got str 'x'"


def test_labelled_held_out_rows_with_the_training_loss_are_taken(tmp_path, tiny_model_dir):
    rows = reward_rows("labelled", 8)
    trainer = reward_trainer(tmp_path, tiny_model_dir, rows, eval_fraction=0.0)
    with_held = RewardTrainer(reward_config(tmp_path, model=str(tiny_model_dir), eval_fraction=0.0), train_dataset=rows,
                              eval_dataset=rows[:3])
    assert with_held.label_loss == "bce" and with_held.eval_examples == trainer.train_examples[:3]


def test_rows_passed_in_python_are_named_as_passed(tmp_path, tiny_model_dir):
    rows = reward_rows("labelled", 4)
    splits = {"train": rows}
    with pytest.raises(DataError) as caught:
        RewardTrainer(reward_config(tmp_path, model=str(tiny_model_dir)), train_dataset=splits)
    assert str(caught.value).startswith("train_dataset: a mapping (['train']), not rows; pass a list of dicts or one "
                                        "split of a DatasetDict, e.g. train_dataset=dataset['train']")
    with pytest.raises(DataError) as caught:
        RewardTrainer(reward_config(tmp_path, model=str(tiny_model_dir)), train_dataset=rows, eval_dataset=splits)
    assert str(caught.value).startswith("eval_dataset: a mapping (['train']), not rows;")
    with pytest.raises(ConfigError) as caught:
        RewardTrainer(RewardConfig(model="m"))
    assert str(caught.value).startswith("dataset is required: a file of labelled, pair or step rows (JSONL, CSV, "
                                        "Parquet, or a directory written by datasets' save_to_disk)")


def test_held_out_step_rows_are_cut_and_located_as_the_training_rows(tmp_path, tiny_model_dir):
    completion = "\n".join(["abcdefghi"] * 4)  # steps end at 9, 19, 29, 39
    long = {"prompt": "q", "completion": completion, "steps": [[10 * k + 9, k % 2] for k in range(4)]}
    trainer = reward_trainer(tmp_path, tiny_model_dir, [long] * 3, max_length=24, eval_fraction=0.5,
                             max_steps=1)
    held = RewardTrainer(reward_config(tmp_path, model=str(tiny_model_dir), max_length=24, max_steps=1),
                         train_dataset=[long] * 3, eval_dataset=[long] * 2)
    (example, _) = held.eval_examples
    assert example == trainer.train_examples[0] and example.positions == [9, 19] and example.targets == [0, 1]
    assert held.summary["dropped_steps"] == 5 * 2 and held.summary["truncated_rows"] == 5


def test_a_template_that_rewrites_a_step_row_names_its_dataset_and_row(tmp_path, tiny_model_dir):
    tokenizer = build_tokenizer()
    tokenizer.chat_template = REWRITES_ZZ
    model = classifier(tiny_model_dir, AutoModelForTokenClassification)
    good = {"prompt": "q", "completion": "ab\ncd", "steps": [[2, 1], [5, 0]]}
    rewritten = {**good, "completion": "zz\ncd"}
    trainer = given(tmp_path, model, tokenizer, [good, good], eval_fraction=0.0)
    assert len(trainer.train_examples) == 2  # the template keeps these
    with pytest.raises(DataError) as caught:
        given(tmp_path, model, tokenizer, [good, rewritten])
    assert str(caught.value).startswith("train_dataset: row 1: the tokenizer's chat template changes the assistant's")
    with pytest.raises(DataError) as caught:
        RewardTrainer(reward_config(tmp_path, model="my-classifier"), model=model, tokenizer=tokenizer,
                      train_dataset=[good, good], eval_dataset=[rewritten])
    assert str(caught.value).startswith("eval_dataset: row 0: the tokenizer's chat template changes the assistant's")


# ---- the model passed in -----------------------------------------------------------------------------------


def test_a_passed_model_keeps_its_pad_else_takes_the_tokenizers_else_eos(tmp_path, tiny_model_dir):
    rows = reward_rows("labelled", 4)
    model = classifier(tiny_model_dir)
    model.config.pad_token_id = 7  # its own: kept
    assert given(tmp_path, model, build_tokenizer(), rows).pad_id == 7 == model.config.pad_token_id
    model.config.pad_token_id = None
    tokenizer = build_tokenizer()
    trainer = given(tmp_path, model, tokenizer, rows)
    assert trainer.pad_id == tokenizer.pad_token_id == model.config.pad_token_id == 0
    trainer.training_step()
    model.config.pad_token_id, tokenizer = None, build_tokenizer()
    tokenizer.pad_token = None
    assert given(tmp_path, model, tokenizer, rows).pad_id == tokenizer.eos_token_id == model.config.pad_token_id
    model.config.pad_token_id, tokenizer.pad_token, tokenizer.eos_token = None, None, None
    with pytest.raises(ValueError) as caught:
        given(tmp_path, model, tokenizer, rows)
    assert str(caught.value) == ("model: the tokenizer of 'my-classifier' has neither a pad nor an EOS token; "
                                 "set one")
    with pytest.raises(ValueError) as caught:
        RewardTrainer(reward_config(tmp_path), model=model, train_dataset=rows)
    assert str(caught.value) == "a tokenizer is required when a model is passed"


def test_the_context_is_the_tokenizers_or_the_models_whichever_is_smaller(tmp_path, tiny_model_dir):
    rows = reward_rows("labelled", 4)
    assert reward_trainer(tmp_path, tiny_model_dir, rows, max_length=64).context == 64  # exactly the model's: allowed
    tokenizer = build_tokenizer()
    tokenizer.model_max_length = 32
    trainer = given(tmp_path, classifier(tiny_model_dir), tokenizer, rows)
    assert trainer.context == trainer.summary["max_length"] == 32
    with pytest.raises(ConfigError, match="max_length=33 exceeds the model's context of 32 tokens"):
        given(tmp_path, classifier(tiny_model_dir), tokenizer, rows, max_length=33)


def test_the_model_is_moved_to_the_trainers_device(tmp_path, tiny_model_dir):
    model, moved = classifier(tiny_model_dir), []
    to = model.to
    model.to = lambda *args, **options: moved.append(args) or to(*args, **options)
    trainer = given(tmp_path, model, build_tokenizer(), reward_rows("labelled", 4))
    assert moved == [(trainer.device,)]


def test_the_backbone_loads_in_the_configs_dtype(tmp_path, tiny_model_dir):
    model, _ = reward_module.load_backbone(reward_config(tmp_path, model=str(tiny_model_dir), dtype="bfloat16"),
                                           "ForSequenceClassification")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


# ---- the scoring pass and the losses -----------------------------------------------------------------------


def test_an_encoder_classifier_scores_each_row_as_it_does_alone(tmp_path):
    """Padding is masked: a bidirectional model (a user's own classifier) would otherwise read the pads."""
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id, num_labels=1)).eval()
    rows = [{"prompt": "q", "completion": text, "label": 1.0} for text in ("a", "abcdefgh!")]
    trainer = given(tmp_path, model, tokenizer, rows, eval_fraction=0.0)
    together = trainer.scores(model, trainer.train_examples)
    alone = torch.cat([trainer.scores(model, [e]) for e in trainer.train_examples])
    assert len(set(map(len, (e.sequences[0] for e in trainer.train_examples)))) == 2  # so one row is padded
    torch.testing.assert_close(together, alone)


class OnDevice(torch.nn.Module):
    """A stand-in outcome classifier that records the devices of its inputs and answers a zero logit per sequence
    on that device."""

    def forward(self, input_ids, attention_mask):
        self.devices = (input_ids.device, attention_mask.device)
        return SimpleNamespace(logits=torch.zeros(len(input_ids), 1, device=input_ids.device))


@pytest.mark.parametrize("rows", ["labelled", "mse"])
def test_the_scoring_pass_runs_on_the_trainers_device_without_cached_weight_copies(tmp_path, tiny_model_dir,
                                                                                 monkeypatch, rows):
    """On the meta device (any device that is not the CPU's would do): inputs and targets go where the model is.
    A training pass reads each weight once, so autocast keeps no bfloat16 copies (runtime.device.autocast)."""
    labelled = reward_rows("labelled", 4) if rows == "labelled" else \
        [{"prompt": "q", "completion": "a", "label": v} for v in (0.5, 2.0)]
    trainer = reward_trainer(tmp_path, tiny_model_dir, labelled, eval_fraction=0.0)
    contexts = []
    monkeypatch.setattr(reward_module, "autocast", lambda *args, **options: contexts.append((args, options))
                        or contextlib.nullcontext())
    trainer.device, model = torch.device("meta"), OnDevice()
    losses, _ = trainer.unit_losses(model, trainer.train_examples)
    assert model.devices == (trainer.device, trainer.device) and losses.device == trainer.device
    assert contexts == [(("no", trainer.device), {"cache": False})]


def test_a_zero_logit_is_no_and_a_tie_is_wrong(tmp_path, tiny_model_dir):
    """With the head zeroed every logit is exactly 0: it says 'no' (right for label 0, wrong for 1), a pair scored
    alike is not ordered, and each loss is log 2."""
    rows = [{"prompt": "q", "completion": c, "label": v} for c, v in (("a", 1.0), ("b", 0.0), ("c", 0.5))]
    labelled = reward_trainer(tmp_path, tiny_model_dir, rows, label_loss="bce", eval_fraction=0.0)
    pairs = reward_trainer(tmp_path, tiny_model_dir, reward_rows("pairs", 3), eval_fraction=0.0)
    for trainer in (labelled, pairs):
        with torch.no_grad():
            trainer.model.score.weight.zero_()
        losses, right = trainer.unit_losses(trainer.model, trainer.train_examples)
        torch.testing.assert_close(losses, torch.full((3,), torch.log(torch.tensor(2.0)).item()))
        assert right.tolist() == ([False, True, True] if trainer is labelled else [False] * 3)
    assert labelled.evaluate(labelled.train_examples)["eval_accuracy"] == pytest.approx(2 / 3)


def test_a_step_reports_its_own_time_and_skipped_updates(tmp_path, tiny_model_dir):
    trainer = reward_trainer(tmp_path, tiny_model_dir, reward_rows("pairs", 8), eval_fraction=0.0, max_steps=1)
    before = time.perf_counter()
    metrics = trainer.training_step()
    assert 0 < metrics["time_step"] <= time.perf_counter() - before
    assert metrics["skipped_updates"] == 0  # a finite step skips nothing


def test_the_rows_held_out_are_the_seeds_draw(tmp_path, tiny_model_dir):
    rows = reward_rows("labelled", 20)
    whole = reward_trainer(tmp_path, tiny_model_dir, rows, eval_fraction=0.0).train_examples
    draws = []
    for seed in (0, 3):
        trainer = reward_trainer(tmp_path, tiny_model_dir, rows, eval_fraction=0.25, seed=seed)
        assert (trainer.train_examples, trainer.eval_examples) == split(whole, 0.25, seed)
        draws.append(trainer.eval_examples)
    assert draws[0] != draws[1]
