"""Learned reward models as reward functions: outcome (a sequence classifier's logit) and process (a token
classifier's probability at each step's last token), on tiny classifiers built locally, checked against
scoring the same texts directly with transformers."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, processors
from transformers import (
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedTokenizerFast,
)

import grpokit
from grpokit import GRPOConfig, GRPOTrainer, OutcomeRewardModel, ProcessRewardModel
from grpokit.resolve import resolve_reward_functions
from grpokit.rewards.calling import score_steps
from grpokit.rewards.learned import context_length, reward_text
from grpokit.tasks.tiny_model import build_tokenizer
from helpers import documented_metrics, logged_keys, save_classifier, tokenizer_with

CHAT = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
MERGES = [("1", "2"), ("a", "b"), ("ab", "c"), (" ", "="), ("=", " "), ("\n", "["), ("5", "\n")]
PROMPTS = ["What is 12 + 30?", "abc", "Say 7.", "What is 1 + 1?"]
COMPLETIONS = ["<think>2+0=2\n1+3=4</think><answer>42</answer>", "abcabc =", "", "2"]


def bpe_tokenizer(chat: bool) -> PreTrainedTokenizerFast:
    """Unlike the policy's character tokenizer: other ids, merged tokens, a BOS, and (``chat``) a template."""
    characters = [chr(i) for i in range(32, 127)] + ["\n"]
    tokens = ["<pad>", "<eos>", "<unk>", "<bos>", *characters, *dict.fromkeys(a + b for a, b in MERGES)]
    vocab = {token: i for i, token in enumerate(reversed(tokens))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=MERGES, unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(["<pad>", "<eos>", "<unk>", "<bos>"])
    bos = [("<bos>", vocab["<bos>"])]
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=bos)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<bos>", model_input_names=["input_ids", "attention_mask"])
    if chat:
        fast.chat_template = CHAT
    return fast


@pytest.fixture(scope="session")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward-models")
    char, chat, plain = build_tokenizer(), bpe_tokenizer(chat=True), bpe_tokenizer(chat=False)
    return {
        "orm_char": save_classifier(root / "orm_char", char),
        "orm_chat": save_classifier(root / "orm_chat", chat, max_positions=128, seed=1),
        "orm_bos": save_classifier(root / "orm_bos", plain, max_positions=128, seed=2),
        "orm_2_labels": save_classifier(root / "orm_2_labels", char, num_labels=2),
        "prm_1": save_classifier(root / "prm_1", char, head="token", num_labels=1, max_positions=48),
        "prm_2": save_classifier(root / "prm_2", chat, head="token", num_labels=2, max_positions=128),
        "prm_3": save_classifier(root / "prm_3", char, head="token", num_labels=3),
    }


def direct_text(tokenizer, prompt, completion):
    """The text scored, built here from the definition: the rendered turns, or prompt + completion."""
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        return tokenizer.apply_chat_template(messages, tokenize=False), False
    return prompt + completion, True


def direct_outcome(path, prompts, completions, keep=None):
    """Each text alone, through plain transformers: the logit (of its last ``keep`` tokens)."""
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    scores = []
    for prompt, completion in zip(prompts, completions):
        text, special = direct_text(tokenizer, prompt, completion)
        ids = tokenizer(text, add_special_tokens=special)["input_ids"][-keep if keep else 0:]
        with torch.no_grad():
            scores.append(model(input_ids=torch.tensor([ids])).logits[0, 0].item())
    return scores


@pytest.mark.parametrize("name", ["orm_char", "orm_chat", "orm_bos"])
def test_outcome_scores_equal_transformers_on_the_same_text(dirs, name):
    reward = OutcomeRewardModel(dirs[name], batch_size=16)
    scores = reward(prompts=PROMPTS, completions=COMPLETIONS)
    assert scores == pytest.approx(direct_outcome(dirs[name], PROMPTS, COMPLETIONS), abs=1e-5)
    assert len(set(scores)) == len(scores) and reward.truncated == 0
    assert reward.__name__ == name  # reward_name() in the logs: the directory's name
    if name == "orm_chat":  # the template is used: not the plain concatenation
        model = AutoModelForSequenceClassification.from_pretrained(dirs[name]).eval()
        with torch.no_grad():
            plain = [model(**reward.tokenizer(p + c, return_tensors="pt")).logits[0, 0].item()
                     for p, c in zip(PROMPTS, COMPLETIONS)]
        assert all(abs(a - b) > 1e-4 for a, b in zip(scores, plain))


def test_without_a_pad_token_it_pads_with_eos(tmp_path):
    tokenizer = build_tokenizer()
    tokenizer.pad_token = None
    path = save_classifier(tmp_path / "no_pad", tokenizer, seed=3)  # config.pad_token_id None too
    reward = OutcomeRewardModel(path)
    assert reward.pad_id == tokenizer.eos_token_id == reward.model.config.pad_token_id
    # One text at a time, transformers reads the last token; in a padded batch, the last before the padding.
    assert reward(prompts=PROMPTS, completions=COMPLETIONS) == pytest.approx(
        direct_outcome(path, PROMPTS, COMPLETIONS), abs=1e-5)


def test_the_reward_tokenizer_need_not_be_the_policys(dirs):
    """The decoded text is re-tokenized by the reward model's own tokenizer (other ids, merged tokens)."""
    policy, reward = build_tokenizer(), OutcomeRewardModel(dirs["orm_bos"])
    text = PROMPTS[1] + COMPLETIONS[1]
    assert reward.tokenizer(text)["input_ids"] != policy(text)["input_ids"]
    assert len(reward.tokenizer(text)["input_ids"]) < len(text)  # merges: fewer tokens than characters
    assert reward(prompts=[PROMPTS[1]], completions=[COMPLETIONS[1]]) == pytest.approx(
        direct_outcome(dirs["orm_bos"], [PROMPTS[1]], [COMPLETIONS[1]]), abs=1e-5)


@pytest.mark.parametrize("name", ["orm_char", "orm_chat"])
def test_small_batches_give_the_same_scores(dirs, name):
    prompts, completions = PROMPTS * 3, COMPLETIONS[::-1] * 3  # lengths vary within every batch: padding
    whole = OutcomeRewardModel(dirs[name], batch_size=64)(prompts=prompts, completions=completions)
    assert OutcomeRewardModel(dirs[name], batch_size=1)(prompts=prompts, completions=completions) == pytest.approx(
        whole, abs=1e-5)
    assert OutcomeRewardModel(dirs[name], batch_size=5)(prompts=prompts, completions=completions) == pytest.approx(
        whole, abs=1e-5)


def test_conversational_prompts_and_completions(dirs):
    chat, plain = OutcomeRewardModel(dirs["orm_chat"]), OutcomeRewardModel(dirs["orm_char"])
    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    replies = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    # A user turn and an assistant turn, whichever form they come in.
    assert chat(prompts=messages, completions=replies) == pytest.approx(
        chat(prompts=PROMPTS, completions=COMPLETIONS), abs=1e-6)
    # A system turn is rendered too.
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[0]}]
    model = AutoModelForSequenceClassification.from_pretrained(dirs["orm_chat"]).eval()
    text = chat.tokenizer.apply_chat_template([*system, *replies[0]], tokenize=False)
    assert text.startswith("[system] Be brief.\n[user] What is 12 + 30?\n[assistant] <think>")
    with torch.no_grad():
        expected = model(**chat.tokenizer(text, add_special_tokens=False, return_tensors="pt")).logits[0, 0].item()
    assert chat(prompts=[system], completions=replies[:1]) == pytest.approx([expected], abs=1e-5)
    # Without a template: the messages' contents, one per line, then the completion's text.
    assert plain(prompts=[system], completions=replies[:1]) == pytest.approx(
        direct_outcome(dirs["orm_char"], ["Be brief.\n" + PROMPTS[0]], [COMPLETIONS[0]]), abs=1e-5)


def test_texts_longer_than_the_context_are_cut_at_the_start_and_counted(dirs):
    reward = OutcomeRewardModel(dirs["orm_char"])
    assert reward.context == 64
    long = ["x" * 50 + "1" * 30, "y" * 70]
    with pytest.warns(UserWarning, match=r"'orm_char': 2 of 3 texts are longer than its context of 64 tokens and were "
                                        r"cut, keeping their end"):
        scores = reward(prompts=["p", "p", "q"], completions=[*long, "short"])
    assert reward.truncated == 2
    assert scores[:2] == pytest.approx(direct_outcome(dirs["orm_char"], ["p", "p"], long, keep=64), abs=1e-5)
    reward(prompts=["p"], completions=long[:1])
    assert reward.truncated == 3


def assert_same_steps(got, expected, tolerance=1e-5):
    assert [end for end, _ in got] == [end for end, _ in expected]
    assert [r for _, r in got] == pytest.approx([r for _, r in expected], abs=tolerance)


def direct_steps(path, prompt, completion, ends):
    """The token classifier's probability at the token holding each step's last character, from one
    forward of the whole text through plain transformers."""
    model = AutoModelForTokenClassification.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    text, special = direct_text(tokenizer, prompt, completion)
    start = text.index(completion)
    encoded = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([encoded["input_ids"]])).logits[0]
    probabilities = logits[:, 0].sigmoid() if logits.shape[-1] == 1 else logits.softmax(-1)[:, 1]
    last = [next(j for j, (a, b) in enumerate(encoded["offset_mapping"]) if a <= start + end - 1 < b) for end in ends]
    return [(end, probabilities[j].item()) for end, j in zip(ends, last)]


@pytest.mark.parametrize("name", ["prm_1", "prm_2"])  # one label (sigmoid), two (softmax; a chat template)
def test_process_rewards_equal_a_direct_forward_at_the_step_ends(dirs, name):
    reward = ProcessRewardModel(dirs[name])
    completions = ["12+30\n\n2+0=2 \nabc=42", "ab\n"]
    (first, second) = reward(prompts=PROMPTS[:2], completions=completions)
    assert [end for end, _ in first] == [5, 12, 20]  # blank steps skipped; trailing spaces not part of a step
    assert [completions[0][a:b] for a, b in [(0, 5), (7, 12), (14, 20)]] == ["12+30", "2+0=2", "abc=42"]
    assert_same_steps(first, direct_steps(dirs[name], PROMPTS[0], completions[0], [5, 12, 20]))
    assert_same_steps(second, direct_steps(dirs[name], PROMPTS[1], completions[1], [2]))
    # A token across a step's end ('5\n' for the chat model's tokenizer) belongs to the step it starts in.
    (third,) = reward(prompts=["q"], completions=["1+4=5\n2"])
    assert_same_steps(third, direct_steps(dirs[name], "q", "1+4=5\n2", [5, 7]))
    if name == "prm_2":
        assert "5\n" in reward.tokenizer.convert_ids_to_tokens(reward.tokenizer("1+4=5\n2")["input_ids"])
    assert all(0 < r < 1 for _, r in first) and len({r for _, r in first}) == 3


def test_process_steps_feed_process_supervision_and_any_separator(dirs):
    reward = ProcessRewardModel(dirs["prm_1"], step_separator="; ", batch_size=1)
    assert reward.step_ends("a; bb; ; c") == [1, 5, 10]
    completions = ["1+1=2; 2", "x"]
    steps = reward(prompts=["q", "q"], completions=completions)
    total, per_function, combined = score_steps([reward], [1.0], ["q", "q"], completions, {})
    assert [[end for end, _ in s] for s in combined] == [[5, 8], [1]]
    for got, expected in zip(combined, steps):
        assert_same_steps(got, expected, 1e-6)
    assert per_function["prm_1"][0].item() == pytest.approx((steps[0][0][1] + steps[0][1][1]) / 2, abs=1e-6)
    assert total.shape == (2,)


def test_process_steps_past_the_context_get_no_reward(dirs):
    reward = ProcessRewardModel(dirs["prm_1"])  # 48 positions
    completion = "\n".join(["abcdefghi"] * 8)  # steps end at 9, 19, ..., 79: past token 48 from the fifth on
    with pytest.warns(UserWarning, match="keeping their start"):
        (steps,) = reward(prompts=["q"], completions=[completion])
    assert [end for end, _ in steps] == [9, 19, 29, 39]  # ends at tokens 9, ..., 39 ('q' first); 49 is cut
    assert reward.truncated == 1
    # A causal model's earlier tokens do not see the later ones: the kept steps score as without a cut.
    assert_same_steps(steps, direct_steps(dirs["prm_1"], "q", completion[:45], [9, 19, 29, 39]))


def test_process_model_reads_message_completions(dirs):
    reward = ProcessRewardModel(dirs["prm_2"])
    messages = [[{"role": "user", "content": "Add."}]]
    replies = [[{"role": "assistant", "content": "1+1=2\n2"}]]
    (steps,) = reward(prompts=messages, completions=replies)
    assert_same_steps(steps, reward(prompts=["Add."], completions=["1+1=2\n2"])[0], 1e-6)
    assert_same_steps(steps, direct_steps(dirs["prm_2"], "Add.", "1+1=2\n2", [5, 7]))


def test_config_entries_resolve_to_reward_models(dirs):
    specs = [f"model:{dirs['orm_chat']}", f"process_model:{dirs['prm_1']}", str(dirs["orm_char"]), "accuracy"]
    functions, weights = resolve_reward_functions(specs, [1.0, 0.5, 2.0, 1.0], device="cpu", batch_size=3)
    assert [type(f) for f in functions[:3]] == [OutcomeRewardModel, ProcessRewardModel, OutcomeRewardModel]
    assert [f.__name__ for f in functions[:3]] == ["orm_chat", "prm_1", "orm_char"] and weights == [1.0, 0.5, 2.0, 1.0]
    assert functions[0].batch_size == 3 and functions[0].device == torch.device("cpu")
    assert grpokit.OutcomeRewardModel is OutcomeRewardModel and "ProcessRewardModel" in grpokit.__all__
    config = GRPOConfig(reward_funcs=[f"model:{dirs['orm_chat']}"], output_dir="unused")
    (loaded,), _ = resolve_reward_functions(config.reward_funcs)
    assert loaded(prompts=PROMPTS, completions=COMPLETIONS) == pytest.approx(
        direct_outcome(dirs["orm_chat"], PROMPTS, COMPLETIONS), abs=1e-5)


def test_precision_options(dirs):
    reward = OutcomeRewardModel(dirs["orm_char"], dtype="bfloat16", device="cpu", mixed_precision="no")
    assert next(reward.model.parameters()).dtype == torch.bfloat16
    assert reward(prompts=PROMPTS, completions=COMPLETIONS) == pytest.approx(
        direct_outcome(dirs["orm_char"], PROMPTS, COMPLETIONS), abs=0.1)
    with pytest.raises(ValueError, match="mixed_precision='fp8' is not valid"):
        OutcomeRewardModel(dirs["orm_char"], mixed_precision="fp8")


@pytest.mark.parametrize("spec, message", [
    ("model:{tiny}", "holds a LlamaForCausalLM, not an AutoModelForSequenceClassification (architectures ending in "
                     "'ForSequenceClassification'); a causal LM predicts tokens, not rewards"),
    ("{tiny}", "holds a LlamaForCausalLM"),  # a bare directory is taken for an outcome model, and checked
    ("process_model:{tiny}", "holds a LlamaForCausalLM, not an AutoModelForTokenClassification"),
    ("model:{prm_1}", "holds a LlamaForTokenClassification, not an AutoModelForSequenceClassification "
                      "(architectures ending in 'ForSequenceClassification'); a token classifier is a process reward "
                      "model: use process_model:"),
    ("process_model:{orm_char}", "holds a LlamaForSequenceClassification, not an AutoModelForTokenClassification "
                                 "(architectures ending in 'ForTokenClassification'); a sequence classifier is an "
                                 "outcome reward model: use model:"),
    ("model:{anonymous}", "names no architecture in config.json, not an AutoModelForSequenceClassification"),
    ("process_model:{prm_3}", "has 3 labels; a process reward model has 1 (sigmoid of the logit) or 2"),
    ("model:{orm_2_labels}", "has 2 labels; an outcome reward model has exactly one (num_labels=1)"),
    ("model:{missing}", "no such directory"),
    ("process_model:{missing}", "no such directory"),
    ("model:{file}", "is a file, not a model directory"),
    ("model:{empty}", "not a Hugging Face model directory"),
])
def test_bad_reward_models_fail_naming_the_path(dirs, tiny_model_dir, tmp_path, spec, message):
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    anonymous = shutil.copytree(dirs["orm_char"], tmp_path / "anonymous")  # a config.json without architectures
    config = json.loads((anonymous / "config.json").read_text())
    (anonymous / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "architectures"}))
    paths = {**dirs, "tiny": tiny_model_dir, "missing": tmp_path / "nowhere", "file": tmp_path / "file.txt",
             "empty": tmp_path / "empty", "anonymous": anonymous}
    spec = spec.format(**paths)
    with pytest.raises(ValueError) as error:
        resolve_reward_functions([spec])
    shown = spec if ":" in spec.split("/")[0] else f"model:{spec}"
    assert str(error.value).startswith(f"reward_funcs: {shown}: ") and message in str(error.value)


def test_trains_with_a_reward_model_named_in_the_config(dirs, tokenizer, tiny_model, tmp_path):
    """GRPO end to end on the policy's character tokenizer, rewarded by a model with its own (chat) tokenizer;
    every logged reward is the model's score of the logged completion."""
    rows = [{"prompt": f"Count {i}:", "answer": "1"} for i in range(8)]
    config = GRPOConfig(output_dir=str(tmp_path / "run"), reward_funcs=[f"model:{dirs['orm_chat']}"],
                        prompts_per_step=2, num_generations=4, max_completion_length=8, learning_rate=1e-2,
                        max_steps=2, progress_bar=False, mixed_precision="no", device="cpu")
    trainer = GRPOTrainer(config, model=tiny_model, tokenizer=tokenizer, train_dataset=rows)
    trainer.train()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all("rewards/orm_chat" in m for m in metrics)
    records = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    reward = OutcomeRewardModel(dirs["orm_chat"])
    expected = reward(prompts=[r["prompt"] for r in records], completions=[r["completion"] for r in records])
    assert [r["orm_chat"] for r in records] == pytest.approx(expected, abs=1e-4)
    assert [r["reward"] for r in records] == pytest.approx(expected, abs=1e-4)


def test_process_supervision_with_a_process_reward_model(dirs, tokenizer, tiny_model, tmp_path):
    rows = [{"prompt": f"Count {i}:", "answer": "1"} for i in range(8)]
    config = GRPOConfig(output_dir=str(tmp_path / "run"), reward_funcs=[f"process_model:{dirs['prm_2']}"],
                        supervision="process", prompts_per_step=2, num_generations=4, max_completion_length=8,
                        max_steps=1, progress_bar=False, mixed_precision="no", device="cpu")
    GRPOTrainer(config, model=tiny_model, tokenizer=tokenizer, train_dataset=rows).train()
    records = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    reward = ProcessRewardModel(dirs["prm_2"])
    for record in records:
        (steps,) = reward(prompts=[record["prompt"]], completions=[record["completion"]])
        expected = sum(r for _, r in steps) / len(steps) if steps else None
        assert record["prm_2"] == (pytest.approx(expected, abs=1e-4) if steps else None)
    assert any(record["prm_2"] is not None for record in records)


@pytest.mark.parametrize("supervision", ["outcome", "process"])
def test_each_step_logs_how_many_completions_a_reward_model_cut(tokenizer, tiny_model, tmp_path, supervision):
    """A reward model of 15 positions reads prompts of 8 characters with completions of up to 8 tokens: each step
    logs how many of its completions it cut, those whose text is longer than 15 of its tokens; rule rewards log
    no count."""
    head, prefix = {"outcome": ("sequence", "model:"), "process": ("token", "process_model:")}[supervision]
    path = save_classifier(tmp_path / "short_rm", build_tokenizer(), head=head, max_positions=15, seed=4)
    rows = [{"prompt": f"Count {i}:", "answer": "1"} for i in range(8)]
    config = GRPOConfig(output_dir=str(tmp_path / "run"), reward_funcs=["accuracy", "format", f"{prefix}{path}"],
                        supervision=supervision, prompts_per_step=2, num_generations=4, max_completion_length=8,
                        max_steps=3, log_completions=8, progress_bar=False, mixed_precision="no", device="cpu")
    trainer = GRPOTrainer(config, model=tiny_model, tokenizer=tokenizer, train_dataset=rows)
    with pytest.warns(UserWarning, match="'short_rm': .* longer than its context of 15 tokens"):
        trainer.train()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    records = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert len(records) == 3 * 8  # every completion of every step
    reader = AutoTokenizer.from_pretrained(path)
    cut = [sum(len(reader(r["prompt"] + r["completion"])["input_ids"]) > 15 for r in records if r["step"] == step)
           for step in (1, 2, 3)]
    assert [m["reward_truncated/short_rm"] for m in metrics] == cut
    assert 0 < sum(cut) < 24 and trainer.reward_funcs[2].truncated == sum(cut)  # some cut, not all
    assert logged_keys(metrics[0]) == documented_metrics(reward_models=True)[0]
    assert not any(key.startswith("reward_truncated/") and key != "reward_truncated/short_rm" for key in metrics[0])


@pytest.mark.parametrize("supervision", ["outcome", "process"])
def test_ppo_trains_with_a_reward_model(dirs, tokenizer, tiny_model, tmp_path, supervision):
    """algorithm: ppo rewarded by an outcome model (one reward at the last token) or a process model (a reward at
    each step's last token): the logged rewards are the model's scores of the logged completions, and the policy
    and the value model move."""
    name = {"outcome": "orm_chat", "process": "prm_2"}[supervision]
    prefix = {"outcome": "model:", "process": "process_model:"}[supervision]
    rows = [{"prompt": f"Count {i}:"} for i in range(8)]
    config = GRPOConfig(output_dir=str(tmp_path / "run"), algorithm="ppo", reward_funcs=[f"{prefix}{dirs[name]}"],
                        supervision=supervision, prompts_per_step=2, num_generations=4, max_completion_length=8,
                        learning_rate=1e-2, max_steps=2, log_completions=8, progress_bar=False, mixed_precision="no",
                        device="cpu")
    trainer = GRPOTrainer(config, model=tiny_model, tokenizer=tokenizer, train_dataset=rows)
    policy = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    values = {n: p.detach().clone() for n, p in trainer.critic.value_model.named_parameters()}
    trainer.train()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    records = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and len(records) == 2 * 8  # every completion of every step
    prompts, completions = [r["prompt"] for r in records], [r["completion"] for r in records]
    if supervision == "outcome":
        expected = OutcomeRewardModel(dirs[name])(prompts=prompts, completions=completions)
        assert [[reward for _, reward in r["steps"]] for r in records] == [pytest.approx([e], abs=1e-4)
                                                                          for e in expected]  # one step each
    else:
        steps = ProcessRewardModel(dirs[name])(prompts=prompts, completions=completions)
        assert [[reward for _, reward in r["steps"]] for r in records] == [
            pytest.approx([reward for _, reward in s], abs=1e-4) for s in steps]
        assert sum(len(s) > 1 for s in steps) >= 2  # completions of several steps among them
        expected = [sum(reward for _, reward in s) / len(s) if s else None for s in steps]
        assert all(e is not None for e in expected)  # every completion has a step to score
    assert [r[name] for r in records] == pytest.approx(expected, abs=1e-4)
    assert [r["reward"] for r in records] == pytest.approx(expected, abs=1e-4)
    for step, m in zip((1, 2), metrics):
        scores = [e for r, e in zip(records, expected) if r["step"] == step]
        assert m["reward"] == pytest.approx(sum(scores) / 8, abs=1e-5) == m[f"rewards/{name}"]
        assert m[f"reward_truncated/{name}"] == 0 and "value_loss" in m
    assert all(not torch.equal(p, policy[n]) for n, p in trainer.model.named_parameters() if n.endswith("proj.weight"))
    assert all(not torch.equal(p, values[n]) for n, p in trainer.critic.value_model.named_parameters()
               if n.endswith("proj.weight") or n.startswith("head."))


def test_the_reward_model_examples_in_the_docs_run(tmp_path, monkeypatch):
    import yaml

    doc = (Path(__file__).parents[2] / "docs" / "data_and_rewards.md").read_text().split("## Reward models")[1]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(doc.split("```python\n")[1].split("```")[0], namespace)
    assert len(namespace["scores"]) == 2 and namespace["reward"].__name__ == "my-rm"
    config = yaml.safe_load(doc.split("```yaml\n")[1].split("```")[0])
    functions, weights = resolve_reward_functions(config["reward_funcs"], config["reward_weights"])
    assert functions[0](prompts=["q"], completions=["c"]) == namespace["reward"](prompts=["q"], completions=["c"])
    assert isinstance(resolve_reward_functions(["runs/my-rm"])[0][0], OutcomeRewardModel)


def test_process_steps_do_not_depend_on_the_rows_batched_with_them(dirs):
    """A completion's steps are the same scored alone, beside longer or cut texts, or in batches of any size:
    whether a step falls past the context is decided by the row's own tokens, not by the batch's padded width."""
    reward = ProcessRewardModel(dirs["prm_1"])  # 48 positions
    long_text = "\n".join(["abcdefghi"] * 8)  # cut: its later steps get no reward
    completions = ["1+1=2\n2", long_text, "x", "ab\ncd\n" * 4, long_text[:44]]
    prompts = ["q"] * len(completions)
    with pytest.warns(UserWarning, match="keeping their start"):
        together = reward(prompts=prompts, completions=completions)
    for batch_size in (1, 2):
        apart = ProcessRewardModel(dirs["prm_1"], batch_size=batch_size)
        with pytest.warns(UserWarning, match="keeping their start"):
            got = apart(prompts=prompts, completions=completions)
        for a, b in zip(got, together):
            assert_same_steps(a, b)
    alone = [reward(prompts=["q"], completions=[c])[0] for c in completions]
    for a, b in zip(alone, together):
        assert_same_steps(a, b)
    assert [end for end, _ in together[1]] == [9, 19, 29, 39] and len(together[3]) == 8


def test_an_empty_step_separator_is_refused_before_anything_loads(tmp_path):
    with pytest.raises(ValueError, match=r"^process_model:nowhere: step_separator must not be empty$"):
        ProcessRewardModel("nowhere", step_separator="")


def test_a_reward_model_whose_head_was_never_saved_is_refused_naming_the_weights(dirs, tmp_path):
    """A directory whose classifier head is missing would load with a random head: refused, naming what is missing."""
    import shutil

    from safetensors.torch import load_file, save_file

    target = tmp_path / "headless"
    shutil.copytree(dirs["orm_char"], target)
    weights = target / "model.safetensors"
    save_file({k: v for k, v in load_file(str(weights)).items() if not k.startswith("score.")}, str(weights),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"reward_funcs: model:.*headless: its weights lack \['score\.weight'\]: not a "
                                         r"trained model of this kind"):
        resolve_reward_functions([f"model:{target}"])


def test_a_token_classifiers_logits_stop_where_each_row_does(dirs):
    """Batched rows are padded to the longest; each row's (tokens, labels) logits are cut back to its own length."""
    reward = ProcessRewardModel(dirs["prm_1"])
    short, long = reward._logits([[5, 6, 7], [5, 6, 7, 8, 9]])
    assert short.shape == (3, 1) and long.shape == (5, 1)


def test_the_context_is_the_smaller_of_the_real_limits():
    tokenizer, config = SimpleNamespace, SimpleNamespace
    assert context_length(tokenizer(model_max_length=512), config(max_position_embeddings=1024)) == 512
    assert context_length(tokenizer(model_max_length=int(1e30)), config(max_position_embeddings=64)) == 64  # "none"
    assert context_length(tokenizer(model_max_length=int(1e30)), config()) is None


def test_a_completion_at_the_very_start_of_the_text_is_located():
    only_replies = "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}{% endif %}{% endfor %}"
    assert reward_text(tokenizer_with(only_replies), "q", "a\nb", locate=True) == ("a\nb", 0)


# ---- the reward models at their edges: devices, batching, padding, limits, and each refusal's whole message --------


class Recorder(torch.nn.Module):
    """Stands in for a classifier: records each forward's input shape and devices and its mask; the logits are
    zeros on the CPU, (rows, 1), or (rows, tokens, 1) with ``tokens``."""

    def __init__(self, tokens=False):
        super().__init__()
        self.tokens, self.calls = tokens, []

    def forward(self, input_ids, attention_mask=None):
        mask = None if attention_mask is None else (attention_mask.device.type, attention_mask.tolist()
                                                    if attention_mask.device.type == "cpu" else None)
        self.calls.append((tuple(input_ids.shape), input_ids.device.type, mask))
        shape = (*input_ids.shape, 1) if self.tokens else (input_ids.shape[0], 1)
        return SimpleNamespace(logits=torch.zeros(shape))


def test_rows_are_batched_shortest_together_with_their_mask(dirs):
    """batch_size rows a forward, sorted by length so that a batch pads little; each with its attention mask, which
    a bidirectional reward model needs (a causal one would not show it)."""
    reward = OutcomeRewardModel(dirs["orm_char"], batch_size=2)
    reward.model = Recorder()
    out = reward._logits([[7] * 5, [7], [7] * 4, [7]])
    assert [shape for shape, _, _ in reward.model.calls] == [(2, 1), (2, 5)]
    assert [mask for _, _, mask in reward.model.calls] == [("cpu", [[1], [1]]), ("cpu", [[1, 1, 1, 1, 0], [1] * 5])]
    assert [tuple(row.shape) for row in out] == [(1,)] * 4


def test_inputs_go_to_the_models_device(dirs, monkeypatch):
    import contextlib

    import grpokit.rewards.learned as learned

    monkeypatch.setattr(learned, "autocast", lambda precision, device: contextlib.nullcontext())  # none on meta
    reward = ProcessRewardModel(dirs["prm_1"])
    reward.model, reward.device = Recorder(tokens=True), torch.device("meta")
    reward._logits([[7, 8], [9]])
    assert [(device, mask[0]) for _, device, mask in reward.model.calls] == [("meta", "meta")]


def test_the_model_loads_onto_the_device_asked_frozen_in_the_dtype_asked(dirs, monkeypatch):
    """device= is resolved as given (None: 'auto') and the weights go there (meta: a device this machine has besides
    the CPU), requiring no gradient; dtype= and mixed_precision= reach the loading of both kinds ('auto' decided for
    that device)."""
    import grpokit.rewards.learned as learned

    asked = []
    monkeypatch.setattr(learned, "resolve_device", lambda device: asked.append(device) or torch.device("meta"))
    for kind, name in ((OutcomeRewardModel, "orm_char"), (ProcessRewardModel, "prm_1")):
        reward = kind(dirs[name], device="cuda:3", dtype="bfloat16", mixed_precision="auto")
        weights = list(reward.model.parameters())
        assert {w.device.type for w in weights} == {"meta"} and {w.dtype for w in weights} == {torch.bfloat16}
        assert not any(w.requires_grad for w in weights) and not reward.model.training
        assert reward.mixed_precision == "no" and reward.batch_size == 16  # no native bfloat16 on meta; the default
        with pytest.raises(ValueError, match="mixed_precision='fp8' is not valid"):
            kind(dirs[name], mixed_precision="fp8")
    kind(dirs[name])
    assert asked == ["cuda:3", "auto", "cuda:3", "auto", "auto"]


def test_auto_precision_is_decided_for_the_device(dirs):
    from grpokit.runtime.device import resolve_precision

    reward = OutcomeRewardModel(dirs["orm_char"], device="cpu", mixed_precision="auto")
    assert reward.mixed_precision == resolve_precision("auto", torch.device("cpu"))


def test_the_pad_id_is_the_models_then_the_tokenizers_pad_then_its_eos(tmp_path):
    tokenizer = build_tokenizer()
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    path = save_classifier(tmp_path / "pads", tokenizer, seed=4)
    config = json.loads((path / "config.json").read_text())
    for model_pad, expected in ((tokenizer.eos_token_id, tokenizer.eos_token_id), (None, tokenizer.pad_token_id)):
        (path / "config.json").write_text(json.dumps({**config, "pad_token_id": model_pad}))
        reward = OutcomeRewardModel(path)
        assert reward.pad_id == expected == reward.model.config.pad_token_id
    tokenizer.pad_token, tokenizer.eos_token = None, None
    bare = save_classifier(tmp_path / "bare", tokenizer, seed=4)
    with pytest.raises(ValueError) as error:
        OutcomeRewardModel(bare)
    assert str(error.value) == (f"reward_funcs: model:{bare}: neither the model's config nor its tokenizer names a pad "
                                "or EOS token")


def test_the_context_is_the_tokenizers_limit_where_it_is_the_smaller(tmp_path):
    tokenizer = build_tokenizer()
    tokenizer.model_max_length = 16
    reward = OutcomeRewardModel(save_classifier(tmp_path / "short", tokenizer, max_positions=64))
    assert reward.context == 16


def test_a_process_model_locates_a_completion_at_the_start_and_refuses_a_template_that_rewrites_it(tmp_path):
    only_replies = "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}{% endif %}{% endfor %}"
    path = save_classifier(tmp_path / "replies", tokenizer_with(only_replies), head="token", max_positions=64)
    steps = ProcessRewardModel(path)(prompts=["q"], completions=["a\nb"])
    assert [end for end, _ in steps[0]] == [1, 3]
    upper = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    rewriting = save_classifier(tmp_path / "upper", tokenizer_with(upper), head="token", max_positions=64)
    with pytest.raises(ValueError) as error:
        ProcessRewardModel(rewriting)(prompts=["q"], completions=["a\nb"])
    assert str(error.value) == (f"reward_funcs: process_model:{rewriting}: its chat template changes the assistant's "
                                "text, so step ends cannot be located in it")


def test_a_process_model_needs_a_fast_tokenizer(dirs, monkeypatch):
    class Slow:
        def __init__(self, tokenizer):
            self.tokenizer = tokenizer

        def __getattr__(self, name):
            return False if name == "is_fast" else getattr(self.tokenizer, name)

    load = ProcessRewardModel._load

    def slow_load(self, dtype):
        model, tokenizer = load(self, dtype)
        return model, Slow(tokenizer)

    monkeypatch.setattr(ProcessRewardModel, "_load", slow_load)
    with pytest.raises(ValueError) as error:
        ProcessRewardModel(dirs["prm_1"])
    assert str(error.value) == (f"reward_funcs: process_model:{dirs['prm_1']}: needs a fast tokenizer (tokenizer.json) "
                                "to map step ends to tokens")


def test_refusals_give_their_whole_message(dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    def refusal(kind, path, **options):
        with pytest.raises(ValueError) as error:
            kind(path, **options)
        return str(error.value).removeprefix(f"reward_funcs: {kind.spec}{path}: ")

    assert refusal(OutcomeRewardModel, tmp_path / "nowhere") == "no such directory"
    (tmp_path / "file").write_text("x")
    assert refusal(OutcomeRewardModel, tmp_path / "file") == "is a file, not a model directory"
    (tmp_path / "empty").mkdir()
    assert refusal(OutcomeRewardModel, tmp_path / "empty") == ("not a Hugging Face model directory (it has no "
                                                               "config.json)")
    broken = shutil.copytree(dirs["orm_char"], tmp_path / "broken")
    (broken / "config.json").write_text("{")
    assert refusal(OutcomeRewardModel, broken).startswith("not a Hugging Face model directory (")
    two = shutil.copytree(dirs["orm_char"], tmp_path / "two")
    config = json.loads((two / "config.json").read_text())
    (two / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM", "LlamaModel"]}))
    assert refusal(OutcomeRewardModel, two) == (
        "holds a LlamaForCausalLM, LlamaModel, not an AutoModelForSequenceClassification (architectures ending in "
        "'ForSequenceClassification'); a causal LM predicts tokens, not rewards: train a reward model from it first")
    (two / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "architectures"}))
    assert refusal(OutcomeRewardModel, two) == (
        "names no architecture in config.json, not an AutoModelForSequenceClassification (architectures ending in "
        "'ForSequenceClassification')")
    assert refusal(OutcomeRewardModel, dirs["orm_2_labels"]) == (
        "has 2 labels; an outcome reward model has exactly one (num_labels=1), whose logit is the reward")
    assert refusal(ProcessRewardModel, dirs["prm_3"]) == (
        "has 3 labels; a process reward model has 1 (sigmoid of the logit) or 2 (probability of label 1)")
    assert refusal(OutcomeRewardModel, dirs["orm_char"], dtype="float8") == (
        "dtype 'float8' is not one of 'auto', 'float32', 'bfloat16', 'float16'")
    headless = shutil.copytree(dirs["orm_char"], tmp_path / "headless")
    weights = load_file(str(headless / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if not k.startswith(("score.", "model.layers.1."))},
              str(headless / "model.safetensors"), metadata={"format": "pt"})
    missing = sorted(k for k in weights if k.startswith(("score.", "model.layers.1.")))
    assert len(missing) > 4 and refusal(OutcomeRewardModel, headless) == (
        f"its weights lack {missing[:4]}: not a trained model of this kind")
    untokenized = shutil.copytree(dirs["orm_char"], tmp_path / "untokenized")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (untokenized / name).unlink(missing_ok=True)
    said = refusal(OutcomeRewardModel, untokenized)
    assert said.startswith("has no usable tokenizer (") and said.endswith("); save the tokenizer next to the model")

