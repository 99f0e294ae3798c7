"""Reward models' texts, cuts and steps, as scoring (grpokit.rewards.learned) and training (grpokit.algorithms.reward)
share them, on a character tokenizer whose every token is one character, so each expected id and offset is counted
by hand: which end of a text longer than the context each cut keeps, and exactly how much; the context's bounds;
the steps' ends and tokens; and each bound of the rows' values from both sides, with NaN and infinities."""

import math
import os

import pytest
import torch

from grpokit import RewardConfig
from grpokit.algorithms.reward import _number, _steps, parse_rows, tokenize_rows
from grpokit.data import DataError
from grpokit.rewards.learned import (
    context_length,
    encode_texts,
    reward_text,
    right_pad,
    step_ends,
    step_tokens,
)

BOS = 1


class Characters:
    """A fast tokenizer of one token per character (its id: the code point), BOS first with an empty span."""

    is_fast = True

    def __init__(self, chat_template=None, model_max_length=None):
        self.chat_template, self.model_max_length = chat_template, model_max_length

    def __call__(self, texts, add_special_tokens=True, return_offsets_mapping=False):
        ids = [[BOS] * add_special_tokens + [ord(c) for c in text] for text in texts]
        spans = [[(0, 0)] * add_special_tokens + [(i, i + 1) for i in range(len(text))] for text in texts]
        return {"input_ids": ids, **({"offset_mapping": spans} if return_offsets_mapping else {})}

    def apply_chat_template(self, messages, tokenize=False):
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)


def ids(text: str, bos: bool = True) -> list[int]:
    return [BOS] * bos + [ord(c) for c in text]


# ---- the cut -----------------------------------------------------------------------------------------------


def test_the_outcome_cut_keeps_the_end_and_the_step_cut_keeps_the_start():
    text = "0123456789"  # BOS + 10 tokens
    kept, spans, cut = encode_texts(Characters(), [text], 4, keep_end=True)
    assert kept == [ids("6789", bos=False)] and cut == [0]
    assert spans == [[(0, 0)] + [(i, i + 1) for i in range(10)]]  # spans stay whole
    kept, _, cut = encode_texts(Characters(), [text], 4, keep_end=False)
    assert kept == [ids("012")] and cut == [0]


@pytest.mark.parametrize("keep_end", [True, False])
def test_a_text_of_exactly_the_context_is_not_cut_and_one_more_token_is(keep_end):
    kept, _, cut = encode_texts(Characters(), ["abc", "abcd", "", "ab"], 4, keep_end=keep_end)
    assert kept[0] == ids("abc") and kept[2] == [BOS] and kept[3] == ids("ab")
    assert kept[1] == (ids("abcd", bos=False) if keep_end else ids("abc"))  # BOS + 4 is one more than 4
    assert cut == [1]


@pytest.mark.parametrize("context", [None, 0])
def test_no_context_cuts_nothing(context):
    kept, _, cut = encode_texts(Characters(), ["x" * 100], context, keep_end=True)
    assert kept == [ids("x" * 100)] and cut == []


def test_a_chat_text_gets_no_bos_and_is_cut_the_same_way():
    kept, spans, cut = encode_texts(Characters(chat_template="t"), ["abcdef"], 2, keep_end=True)
    assert kept == [ids("ef", bos=False)] and spans == [[(i, i + 1) for i in range(6)]] and cut == [0]


@pytest.mark.parametrize("tokenizer_limit, positions, expected", [
    (512, 1024, 512), (2048, 1024, 1024), (1024, 1024, 1024), (int(1e30), 1024, 1024), (None, None, None),
    (0, 5, 5), (-1, 5, 5), (5, -1, 5), (5, 0, 5), (10**8, None, None), (10**8 - 1, None, 10**8 - 1), (1, None, 1),
    (None, 1, 1), (512.0, None, None), (None, "512", None), (-(10**9), -(10**9), None),
])
def test_the_context_is_the_smaller_real_limit_of_either_sign(tokenizer_limit, positions, expected):
    class Config:
        max_position_embeddings = positions

    assert context_length(Characters(model_max_length=tokenizer_limit), Config()) == expected


# ---- what the reward model reads ------------------------------------------------------------------------------


def test_the_plain_text_and_where_the_completion_starts():
    assert reward_text(Characters(), "Q: 1+1?", "A: 2") == ("Q: 1+1?A: 2", 7)
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "uu"}]
    assert reward_text(Characters(), messages, "c") == ("s\nuuc", 4)
    assert reward_text(Characters(), "p", [{"role": "assistant", "content": "c"}]) == ("pc", 1)


def test_a_chat_text_and_where_the_completion_starts_in_it():
    chat = Characters(chat_template="t")
    assert reward_text(chat, "q", "ans") == ("<user>q</user><assistant>ans</assistant>", -1)  # not asked
    text, start = reward_text(chat, "q", "ans", locate=True)
    assert start == len("<user>q</user><assistant>") and text[start:start + 3] == "ans"

    class Rewrites(Characters):
        def apply_chat_template(self, messages, tokenize=False):
            return "".join(f"[{m['content'].strip()}]" for m in messages)

    assert reward_text(Rewrites(chat_template="t"), "q", " ans ", locate=True) == ("[q][ans]", -1)


# ---- steps ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("completion, separator, expected", [
    ("a\n\nb  \n c", "\n", [1, 4, 9]), ("one", "\n", [3]), ("", "\n", []), ("\n\n", "\n", []), ("a\n", "\n", [1]),
    ("ab||cd||", "||", [2, 6]), (" x ", "\n", [2]),
])
def test_step_ends(completion, separator, expected):
    assert step_ends(completion, separator) == expected


def test_each_step_is_read_at_the_token_holding_its_last_character():
    spans = [(0, 0), (0, 1), (1, 3), (3, 4)]  # BOS, "a", "bc", "d"
    assert step_tokens(spans, 0, [1, 2, 3, 4]) == [1, 2, 2, 3]
    assert step_tokens(spans, 1, [1, 2, 3]) == [2, 2, 3]  # the completion starting at character 1
    assert step_tokens([(2, 3)], 0, [1, 2, 3]) == [None, None, 0]  # before the first token: none
    assert step_tokens([], 0, [1]) == [None]


def test_right_pad():
    input_ids, mask = right_pad([[5], [6, 7, 8], []], 0)
    assert input_ids.tolist() == [[5, 0, 0], [6, 7, 8], [0, 0, 0]]
    assert mask.tolist() == [[1, 0, 0], [1, 1, 1], [0, 0, 0]] and input_ids.dtype == mask.dtype == torch.long
    assert right_pad([], 9)[0].shape == (0, 1) and right_pad([[]], 9)[0].tolist() == [[9]]


# ---- training's rows: tokenized and cut as scoring cuts them ------------------------------------------------


def test_training_cuts_an_outcome_text_at_its_start_as_scoring_does():
    (example,), dropped = tokenize_rows([("PROMPT:", ["answer"], [1.0], [])], "labelled", Characters(), 5, "d")
    assert example.sequences == [ids("nswer", bos=False)] and example.truncated and dropped == 0
    (short,), _ = tokenize_rows([("P", ["a"], [1.0], [])], "labelled", Characters(), 3, "d")
    assert short.sequences == [ids("Pa")] and not short.truncated and short.targets == [1.0]


def test_training_cuts_each_side_of_a_pair_on_its_own():
    (example,), _ = tokenize_rows([("p", ["good!", "b"], [], [])], "pairs", Characters(), 4, "d")
    assert example.sequences == [ids("ood!", bos=False), ids("pb")]
    assert example.truncated and example.positions == [] and example.targets == []
    (uncut,), _ = tokenize_rows([("p", ["ab", "c"], [], [])], "pairs", Characters(), 4, "d")
    assert not uncut.truncated


def test_training_cuts_a_step_text_at_its_end_and_drops_the_steps_past_it():
    # "q:" then "ab\ncd\nef": BOS q : a b \n c d \n e f -> ids 0..11; steps end at characters 2, 5, 8
    row = ("q:", ["ab\ncd\nef"], [0.0, 1.0, 0.5], [2, 5, 8])
    (example,), dropped = tokenize_rows([row], "steps", Characters(), 8, "d")
    assert example.sequences == [ids("q:ab\ncd")] and example.truncated
    assert example.positions == [4, 7] and example.targets == [0.0, 1.0] and dropped == 1
    (last,), dropped = tokenize_rows([row], "steps", Characters(), 7, "d")  # "d", step 1's last token, cut
    assert last.positions == [4] and last.targets == [0.0] and dropped == 2
    (whole,), dropped = tokenize_rows([row], "steps", Characters(), None, "d")
    assert whole.positions == [4, 7, 10] and whole.targets == [0.0, 1.0, 0.5] and dropped == 0
    examples, dropped = tokenize_rows([row, ("q:", ["ab"], [1.0], [2])], "steps", Characters(), 3, "d")
    assert examples == [None, None] and dropped == 4  # no step of either fits: the rows are left out


# ---- the rows' values at their bounds ----------------------------------------------------------------------------


@pytest.mark.parametrize("steps, error", [
    ([[1, 0.0]], None), ([[5, 1.0]], None), ([[1, 0], [5, 1]], None), ([[0, 1]], "ends at character 0, outside"),
    ([[-1, 1]], "ends at character -1, outside"), ([[6, 1]], "ends at character 6, outside"),
    ([[2, 1], [2, 1]], "step 1 ends at character 2, not after step 0 (2)"),
    ([[3, 1], [2, 1]], "step 1 ends at character 2, not after step 0 (3)"),
    ([[2, -0.01]], "label -0.01 is out of range"), ([[2, 1.01]], "label 1.01 is out of range"),
    ([[2, -0.0]], None), ([[2, math.nan]], "must be a finite number, got float nan"),
    ([[2, math.inf]], "must be a finite number, got float inf"), ([[2, -math.inf]], "got float -inf"),
    ([[2, "nan"]], "got float nan"), ([[2.0, 1]], "expected [offset, label] with an integer offset"),
    ([], "must be a non-empty list"),
])
def test_each_step_bound_from_both_sides(steps, error):
    if error is None:
        ends, labels = _steps(steps, 5, "w")
        assert ends == [int(e) for e, _ in steps] and labels == [float(v) for _, v in steps]
    else:
        with pytest.raises(DataError) as caught:
            _steps(steps, 5, "w")
        assert error in str(caught.value)


@pytest.mark.parametrize("value, expected", [
    (0, 0.0), (-2.5, -2.5), ("0.5", 0.5), ("-3", -3.0), (True, 1.0), (1e308, 1e308),
    (math.nan, None), (math.inf, None), (-math.inf, None), ("nan", None), ("-inf", None), ("x", None), (None, None),
])
def test_a_label_is_a_finite_number_of_either_sign(value, expected):
    if expected is None:
        with pytest.raises(DataError, match="^w must be a finite number, got "):
            _number(value, "w")
    else:
        assert _number(value, "w") == expected


@pytest.mark.parametrize("labels, loss, error", [
    ((0, 1), "bce", None), ((0.0, 1.0, 1), "bce", None), ((-1, 1), "mse", None), ((0, 2), "mse", None),
    ((0.5,), "mse", None), ((-0.0, 1), "bce", None),
])
def test_the_labels_choose_the_loss_of_either_sign(labels, loss, error):
    rows = [{"prompt": "q", "completion": "a", "label": v} for v in labels]
    assert parse_rows(rows, "labelled", RewardConfig(model="m"), "d")[1] == loss


@pytest.mark.parametrize("label, allowed", [(-0.01, False), (0, True), (0.5, True), (1, True), (1.01, False)])
def test_binary_cross_entropy_takes_labels_in_zero_one_from_both_sides(label, allowed):
    rows = [{"prompt": "q", "completion": "a", "label": label}]
    config = RewardConfig(model="m", label_loss="bce")
    if allowed:
        assert parse_rows(rows, "labelled", config, "d") == ([("q", ["a"], [float(label)], [])], "bce")
    else:
        with pytest.raises(DataError, match=f"^d: row 0 column 'label': label {float(label)} is out of range"):
            parse_rows(rows, "labelled", config, "d")


def test_an_empty_side_of_a_pair_is_refused_and_an_empty_completion_is_not():
    config = RewardConfig(model="m")
    with pytest.raises(DataError, match="^d: row 0 column 'rejected' is empty: a pair needs a completion on each"):
        parse_rows([{"prompt": "q", "chosen": "a", "rejected": " \n"}], "pairs", config, "d")
    assert parse_rows([{"prompt": "q", "completion": "", "label": 1}], "labelled", config, "d")[0] == [
        ("q", [""], [1.0], [])]


@pytest.mark.parametrize("batch_size, message", [(0, "batch_size must be at least 1, got 0"),
                                                 (-1, "batch_size must be at least 1, got -1"),
                                                 (1, "no such directory")])
def test_a_reward_models_batch_size_from_both_sides_of_one(tmp_path, batch_size, message):
    from grpokit.rewards.learned import OutcomeRewardModel, ProcessRewardModel

    for kind in (OutcomeRewardModel, ProcessRewardModel):
        with pytest.raises(ValueError, match=message):
            kind(tmp_path / "absent", batch_size=batch_size)


def test_a_tokenizer_and_a_config_that_state_no_limit():
    from types import SimpleNamespace

    assert context_length(SimpleNamespace(), SimpleNamespace()) is None
    assert context_length(SimpleNamespace(), SimpleNamespace(max_position_embeddings=64)) == 64
    assert context_length(SimpleNamespace(model_max_length=32), SimpleNamespace()) == 32


def test_a_reward_model_cuts_counts_and_warns_once_naming_the_kept_end():
    import warnings

    from grpokit.rewards.learned import OutcomeRewardModel

    model = OutcomeRewardModel.__new__(OutcomeRewardModel)
    model.tokenizer, model.context, model.truncated, model.__name__ = Characters(), 3, 0, "rm"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept, _ = model._encode(["abcdef", "a", "xyz"], keep_end=True)
        assert kept == [ids("def", bos=False), ids("a"), ids("xyz", bos=False)] and model.truncated == 2
        kept, _ = model._encode(["abcdef"], keep_end=False)
        assert kept == [ids("ab")] and model.truncated == 3
    assert [str(w.message) for w in caught] == [
        "reward model 'rm': 2 of 3 texts are longer than its context of 3 tokens and were cut, keeping their end "
        "(counted in .truncated; warned once)"]
    fresh = OutcomeRewardModel.__new__(OutcomeRewardModel)
    fresh.tokenizer, fresh.context, fresh.truncated, fresh.__name__ = Characters(), 3, 0, "rm"
    with pytest.warns(UserWarning, match="keeping their start"):
        fresh._encode(["abcdef"], keep_end=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fresh._encode(["ab"], keep_end=False)[0] == [ids("ab")] and fresh.truncated == 1


def test_no_form_names_every_forms_columns_and_what_to_do():
    from grpokit.algorithms.reward import detect_form

    with pytest.raises(DataError) as caught:
        detect_form([{"q": 1}], RewardConfig(model="m"), "d")
    assert str(caught.value) == (
        "d: row 0's columns ['q'] make none of the three forms (labelled: ['prompt', 'completion', 'label']; pairs: "
        "['prompt', 'chosen', 'rejected']; steps: ['prompt', 'completion', 'steps']); rename the columns or set the "
        "*_column keys")


def test_special_tokens_empty_spans_hold_no_step_wherever_they_are():
    # a fast tokenizer gives the special tokens it adds, BOS first and EOS last, the span (0, 0)
    assert step_tokens([(0, 0), (0, 1), (1, 2), (0, 0)], 0, [1, 2]) == [1, 2]
    assert step_tokens([(0, 0), (0, 2), (2, 2), (2, 4), (0, 0)], 0, [2, 4]) == [1, 3]


def test_a_slow_tokenizer_is_refused_for_steps_with_the_whole_reason():
    from types import SimpleNamespace

    with pytest.raises(ValueError) as caught:
        tokenize_rows([], "steps", SimpleNamespace(is_fast=False), None, "d")
    assert str(caught.value) == ("model: a process reward model needs a fast tokenizer (tokenizer.json) to map step "
                                 "ends to tokens")


def test_each_row_gets_its_own_ids_and_its_own_cut():
    rows = [("P", ["abcdef"], [1.0], []), ("P", ["x"], [0.0], []), ("P", ["yz"], [1.0], [])]
    examples, _ = tokenize_rows(rows, "labelled", Characters(), 4, "d")
    assert [e.sequences for e in examples] == [[ids("cdef", bos=False)], [ids("Px")], [ids("Pyz")]]
    assert [e.truncated for e in examples] == [True, False, False] and [e.targets for e in examples] == [[1.0], [0.0],
                                                                                                        [1.0]]
    pairs = [("p", ["a", "b"], [], []), ("p", ["cccccc", "d"], [], []), ("p", ["e", "f"], [], [])]
    examples, _ = tokenize_rows(pairs, "pairs", Characters(), 4, "d")
    assert [e.sequences for e in examples] == [[ids("pa"), ids("pb")], [ids("cccc", bos=False), ids("pd")],
                                               [ids("pe"), ids("pf")]]
    assert [e.truncated for e in examples] == [False, True, False]


def test_steps_in_a_chat_text_are_located_after_the_template_s_prefix():
    row = ("q", ["ab\ncd"], [0.0, 1.0], [2, 5])
    (example,), dropped = tokenize_rows([row], "steps", Characters(chat_template="t"), None, "d")
    start = len("<user>q</user><assistant>")  # a chat text has no BOS: token i is character i
    assert example.positions == [start + 1, start + 4] and dropped == 0

    class Rewrites(Characters):
        def apply_chat_template(self, messages, tokenize=False):
            return "".join(m["content"].upper() for m in messages)

    with pytest.raises(DataError) as caught:
        tokenize_rows([row], "steps", Rewrites(chat_template="t"), None, "d")
    assert str(caught.value) == ("d: row 0: the tokenizer's chat template changes the assistant's text, so step ends "
                                 "cannot be located in it")


def test_chat_messages_are_rendered_as_they_are():
    chat = Characters(chat_template="t")
    prompt = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    completion = [{"role": "assistant", "content": "c"}]
    text, start = reward_text(chat, prompt, completion, locate=True)
    assert text == "<system>s</system><user>u</user><assistant>c</assistant>"
    assert start == len("<system>s</system><user>u</user><assistant>")


def test_a_tokenizer_without_a_chat_template_attribute_reads_plain_text():
    class Bare:
        def __call__(self, *args, **kwargs):
            raise AssertionError("not called")

    assert reward_text(Bare(), "p", "c") == ("pc", 1)


def test_a_slow_tokenizer_gives_no_spans_and_a_tokenizer_without_template_attribute_gets_bos():
    class Slow(Characters):
        is_fast = False

    kept, spans, cut = encode_texts(Slow(), ["ab", "c"], None, keep_end=True)
    assert kept == [ids("ab"), ids("c")] and spans == [[], []] and cut == []

    class NoTemplate:
        is_fast = True

        def __call__(self, texts, add_special_tokens=True, return_offsets_mapping=False):
            return Characters()(texts, add_special_tokens, return_offsets_mapping)

    assert encode_texts(NoTemplate(), ["ab"], None, keep_end=True)[0] == [ids("ab")]


def test_the_completions_last_message_is_located_after_the_turns_before_it():
    completion = [{"role": "assistant", "content": "a1"}, {"role": "tool", "content": "r"},
                  {"role": "assistant", "content": "a2"}]
    text, start = reward_text(Characters(chat_template="t"), "q", completion, locate=True)
    assert text == "<user>q</user><assistant>a1</assistant><tool>r</tool><assistant>a2</assistant>"
    assert start == text.index("a2")


def test_a_completion_at_the_very_start_of_a_chat_text_is_located_at_zero():
    class ContentsOnly(Characters):
        def apply_chat_template(self, messages, tokenize=False):
            return "".join(m["content"] for m in messages)

    assert reward_text(ContentsOnly(chat_template="t"), "", "ans", locate=True) == ("ans", 0)


def test_the_step_refusals_whole():
    with pytest.raises(DataError) as caught:
        _steps([[2, 1], [2, 1]], 5, "w")
    assert str(caught.value) == "w: step 1 ends at character 2, not after step 0 (2): offsets must increase"
    with pytest.raises(DataError) as caught:
        _steps([[2, 1.5]], 5, "w")
    assert str(caught.value) == ("w: step 0's label 1.5 is out of range: binary cross-entropy takes labels in "
                                 "[0, 1]")


def test_row_refusals_name_the_source_and_say_the_whole_rule():
    config = RewardConfig(model="m")
    with pytest.raises(DataError) as caught:
        parse_rows([{"prompt": "q", "completion": "a"}], "labelled", config, "d.jsonl")
    assert str(caught.value) == "d.jsonl: row 0 has no column 'label' (its columns: ['completion', 'prompt'])"
    with pytest.raises(DataError) as caught:
        parse_rows([{"prompt": "q", "completion": "a", "label": 2}], "labelled",
                   RewardConfig(model="m", label_loss="bce"), "d.jsonl")
    assert str(caught.value) == ("d.jsonl: row 0 column 'label': label 2.0 is out of range for binary cross-entropy "
                                 "(label_loss: bce takes labels in [0, 1]; label_loss: mse any number)")


@pytest.mark.skipif("MUTANT_UNDER_TEST" in os.environ, reason="mutmut's trampolines add stack frames: the warning's "
                    "stacklevel cannot be judged in its copy (docs/reliability.md)")
def test_the_cut_warning_points_at_the_code_that_called_the_reward_model():
    from grpokit.rewards.learned import OutcomeRewardModel

    model = OutcomeRewardModel.__new__(OutcomeRewardModel)
    model.tokenizer, model.context, model.truncated, model.__name__ = Characters(), 3, 0, "rm"
    model._logits = lambda rows: [torch.tensor([0.5]) for _ in rows]
    with pytest.warns(UserWarning, match="keeping their end") as caught:
        assert model(prompts=["p"], completions=["abcdef"]) == [0.5]
    assert caught[0].filename == __file__
