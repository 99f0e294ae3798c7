"""Process supervision: advantages against hand-computed values and a slow reference, character
offsets mapped to tokens with two tokenizers, the built-in step reward, and step scoring."""

import math
import random
import statistics

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from grpokit import group_advantages, process_advantages
from grpokit.core.answers import extract_answer
from grpokit.core.offsets import step_token_ends
from grpokit.rewards.builtin import accuracy_reward
from grpokit.rewards.calling import RewardError, score_completions, score_steps
from grpokit.tasks.arithmetic import (
    CARRY_STYLES,
    arithmetic_steps_reward,
    arithmetic_substeps_reward,
    worked_solution,
)
from helpers import brute_force_ends

EPS = 1e-4


# ---- process_advantages: hand-computed -----------------------------------------------------------


def test_multi_step_hand_computed():
    # group of 2; completion 0 has steps ending at tokens 0 (r=1) and 2 (r=0), completion 1 one step at 1 (r=1).
    # pooled R = [1, 0, 1]: mean 2/3, unbiased std sqrt(((1/3)² + (2/3)² + (1/3)²) / 2) = sqrt(1/3)
    # r̃ = [1/3, -2/3, 1/3] / (sqrt(1/3) + eps); A[i, t] sums the r̃ of i's steps ending at or after t
    adv = process_advantages([[1.0, 0.0], [1.0]], [[0, 2], [1]], torch.ones(2, 4), 2)
    s = math.sqrt(1 / 3) + EPS
    expected = [[(1 / 3 - 2 / 3) / s, -2 / 3 / s, -2 / 3 / s, 0.0], [1 / 3 / s, 1 / 3 / s, 0.0, 0.0]]
    assert adv.tolist() == [pytest.approx(row, abs=1e-6) for row in expected]


def test_ties_give_exactly_zero_and_other_groups_are_untouched():
    # group 0: every step reward is 0.1 (no signal); group 1: R = [1, 0]: mean 0.5, std sqrt(0.5)
    adv = process_advantages([[0.1, 0.1], [0.1], [1.0], [0.0]], [[0, 1], [2], [2], [0]], torch.ones(4, 3), 2)
    assert torch.equal(adv[:2], torch.zeros(2, 3))
    a = 0.5 / (math.sqrt(0.5) + EPS)
    assert adv[2:].tolist() == [pytest.approx([a, a, a], abs=1e-6), pytest.approx([-a, 0.0, 0.0], abs=1e-6)]


def test_completion_without_steps_gets_zero_and_does_not_enter_the_statistics():
    # completion 1 has no steps; R = [1, 0] from completion 0 alone: mean 0.5, std sqrt(0.5)
    adv = process_advantages([[1.0, 0.0], []], [[0, 1], []], torch.ones(2, 3), 2)
    a = 0.5 / (math.sqrt(0.5) + EPS)
    assert adv[0].tolist() == pytest.approx([a - a, -a, 0.0], abs=1e-6)
    assert torch.equal(adv[1], torch.zeros(3))
    assert torch.equal(process_advantages([[], []], [[], []], torch.ones(2, 3), 2), torch.zeros(2, 3))


def test_masked_tokens_are_zero():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    adv = process_advantages([[1.0], [0.0]], [[1], [3]], mask, 2)
    assert adv[0, 2:].tolist() == [0.0, 0.0] and adv[0, :2].abs().min() > 0


def test_scales():
    rewards, ends, mask = [[2.0], [0.0], [1.0], [1.0]], [[0], [0], [0], [0]], torch.ones(4, 1)
    # group means 1, 1 → centred [1, -1, 0, 0]; batch std of [2, 0, 1, 1] = sqrt(2/3)
    assert process_advantages(rewards, ends, mask, 2, scale="none").view(-1).tolist() == [1.0, -1.0, 0.0, 0.0]
    batch = process_advantages(rewards, ends, mask, 2, scale="batch").view(-1)
    b = 1 / (math.sqrt(2 / 3) + EPS)
    assert batch.tolist() == pytest.approx([b, -b, 0.0, 0.0], abs=1e-6)


def test_one_final_step_each_is_outcome_supervision():
    """One step per completion at its last token gives the outcome advantage on every token."""
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.5, 3.0, -1.0])
    lengths = [3, 5, 1, 4, 2, 5]
    mask = (torch.arange(5) < torch.tensor(lengths).unsqueeze(1)).long()
    adv = process_advantages([[r] for r in rewards.tolist()], [[n - 1] for n in lengths], mask, 3)
    assert torch.allclose(adv, group_advantages(rewards, 3).unsqueeze(1) * mask, atol=1e-6)


@pytest.mark.parametrize(
    "args, match",
    [
        (([[1.0]], [[0]], torch.ones(2, 3), 2), "one list per completion: N=2"),
        (([[1.0], [1.0, 2.0]], [[0], [1]], torch.ones(2, 3), 2), "completion 1: 2 step rewards but 1 step ends"),
        (([[1.0], [1.0]], [[0], [3]], torch.ones(2, 3), 2), r"completion 1: step 0 ends at token 3, outside \[0, 3\)"),
        (([[1.0], [1.0]], [[-1], [0]], torch.ones(2, 3), 2), "completion 0: step 0 ends at token -1"),
        (([[1.0, 2.0], [1.0]], [[1, 1], [0]], torch.ones(2, 3), 2), "completion 0: step ends must increase"),
        (([[float("nan")], [1.0]], [[0], [0]], torch.ones(2, 3), 2), "completion 0: step 0 has reward nan"),
        (([[1.0], [1.0]], [[0], [0]], torch.ones(2, 3), 3), "group_size=3 does not divide .* N=2"),
    ],
)
def test_errors_name_the_completion(args, match):
    with pytest.raises(ValueError, match=match):
        process_advantages(*args)


# ---- process_advantages: against a slow loop, on random inputs ---------------------------------------


def reference_process_advantages(step_rewards, step_ends, mask, group_size, scale="group", eps=EPS):
    """docs/math.md's process supervision written as loops over groups, completions, tokens and steps."""
    n, width = mask.shape
    every_step = [r for rewards in step_rewards for r in rewards]
    adv = [[0.0] * width for _ in range(n)]
    for start in range(0, n, group_size):
        members = range(start, start + group_size)
        pooled = [r for i in members for r in step_rewards[i]]
        if len(set(pooled)) <= 1:
            continue
        mean = sum(pooled) / len(pooled)
        std = {"group": statistics.stdev(pooled), "batch": statistics.stdev(every_step), "none": None}[scale]
        for i in members:
            for t in range(width):
                if mask[i, t]:
                    adv[i][t] = sum(
                        (r - mean) / (std + eps) if std is not None else r - mean
                        for r, end in zip(step_rewards[i], step_ends[i]) if end >= t
                    )
    return torch.tensor(adv)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_matches_the_loop_reference_on_random_inputs(scale):
    rng = random.Random(0)
    for _ in range(60):
        g, groups, width = rng.randint(2, 4), rng.randint(1, 3), rng.randint(1, 8)
        lengths = [rng.randint(0, width) for _ in range(g * groups)]
        mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).long()
        step_ends = [sorted(rng.sample(range(n), rng.randint(0, n))) for n in lengths]
        # rewards on a small grid, so that ties (zero-variance groups) happen too
        step_rewards = [[rng.choice([0.0, 0.5, 1.0, 2.0]) for _ in ends] for ends in step_ends]
        got = process_advantages(step_rewards, step_ends, mask, g, scale=scale)
        assert torch.allclose(got, reference_process_advantages(step_rewards, step_ends, mask, g, scale), atol=1e-5)


# ---- character offsets → token indices -------------------------------------------------------------


def merge_tokenizer():
    """A BPE over characters with merges, one of which ("2\\n") spans the end of a step line."""
    characters = [chr(i) for i in range(32, 127)] + ["\n"]
    merged = ["2\n", "12", "<t", "<th", "+1"]
    vocab = {token: i for i, token in enumerate(["<eos>"] + characters + merged)}
    merges = [("2", "\n"), ("1", "2"), ("<", "t"), ("<t", "h"), ("+", "1")]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(["<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


def byte_level_tokenizer():
    """A GPT-2 style byte-level BPE trained here; its offsets are trimmed of whitespace."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    corpus = [worked_solution(a, b) + " Café déjà vu" for a in range(10, 99, 7) for b in range(10, 99, 11)]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


TEXTS = [worked_solution(47, 85), worked_solution(12, 30, forget_carry=True) + " Café", "", "  x\n\n y "]


@pytest.mark.parametrize("make", ["builtin", "merge", "byte_level"])
@pytest.mark.parametrize("text", TEXTS)
def test_step_token_ends_match_decoded_prefixes(make, text, tokenizer):
    tok = {"builtin": lambda: tokenizer, "merge": merge_tokenizer, "byte_level": byte_level_tokenizer}[make]()
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    offsets = list(range(len(text) + 1))
    assert step_token_ends(tok, ids, text, offsets) == brute_force_ends(tok, ids, text, offsets)


def test_token_spanning_a_step_boundary_ends_the_step_it_starts_in():
    tok = merge_tokenizer()
    text = worked_solution(47, 85)  # "<think>\n7+5=12\n4+8+1=13\n</think>\n<answer>132</answer>"
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    pieces = tok.convert_ids_to_tokens(ids)
    steps = arithmetic_steps_reward(["What is 47 + 85?"], [text])[0]  # ends after "7+5=12", "4+8+1=13", the text
    ends = step_token_ends(tok, ids, text, [offset for offset, _ in steps])
    # "...=", "1", "2\n": the step "7+5=12" ends on the merged "2\n" token that also opens the next line
    assert pieces[ends[0] - 1 : ends[0] + 1] == ["1", "2\n"]
    assert pieces[ends[1]] == "3" and ends[2] == len(ids) - 1  # the final step takes the EOS


def test_non_canonical_sample_is_mapped_exactly():
    """A model may sample "1","2" where the tokenizer would write "12": offsets then come from decoding."""
    tok = merge_tokenizer()
    text = "7+5=12\n"
    ids = [tok.convert_tokens_to_ids(c) for c in text] + [tok.eos_token_id]  # one token per character
    assert ids[:-1] != tok(text, add_special_tokens=False)["input_ids"]
    offsets = list(range(len(text) + 1))
    assert step_token_ends(tok, ids, text, offsets) == brute_force_ends(tok, ids, text, offsets)
    assert step_token_ends(tok, ids, text, [6]) == [5]  # the '2', the step's last character


def test_offsets_outside_the_text_are_refused(tokenizer):
    ids = tokenizer("ab", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match=r"step offset 3 is outside the completion's text \[0, 2\]"):
        step_token_ends(tokenizer, ids, "ab", [3])


# ---- the built-in step reward --------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, expected",
    [
        (worked_solution(47, 85), [1.0, 1.0, 1.0]),
        (worked_solution(47, 85, forget_carry=True), [1.0, 0.0, 0.0]),  # "4+8=12": true, but not the step
        ("<think>\n7 + 5 = 12\n4+8+1=13\n</think>\n<answer>132</answer>", [1.0, 1.0, 1.0]),  # spaces
        ("<think>\n7+5=13\n4+8+1=14\n</think><answer>142</answer>", [0.0, 0.0, 0.0]),  # wrong sums
        ("<think>\n4+8+1=13\n7+5=12\n</think><answer>132</answer>", [0.0, 0.0, 1.0]),  # steps out of order
        ("<think>\n7+5=12\n4+8+1=13\n1+1=2\n</think><answer>132</answer>", [1.0, 1.0, 0.0, 1.0]),  # extra step
        # not steps: the two columns are missing (a wrong step where the block closes), then the answer
        ("<think>\n__import__('os')=1\n7*5=35\n</think><answer>132</answer>", [0.0, 1.0]),
        ("<think>\n7+5=12\n</think>\n<answer>122</answer>", [1.0, 0.0, 0.0]),  # the carry's column left out
        ("<answer>132</answer>", [1.0]),
        ("garbage", [0.0]),
    ],
)
def test_arithmetic_steps_reward(completion, expected):
    steps = arithmetic_steps_reward(["What is 47 + 85?"], [completion])[0]
    assert [reward for _, reward in steps] == expected
    assert steps[-1][0] == len(completion)  # the answer is the last step, ending with the completion
    assert [offset for offset, _ in steps] == sorted({offset for offset, _ in steps})


@pytest.mark.parametrize(
    "completion, expected",
    [
        (worked_solution(47, 85), [1.0, 1.0, 1.0, 1.0, 1.0]),  # operands, result per column; the answer
        (worked_solution(47, 85, forget_carry=True), [1.0, 1.0, 0.0, 0.0, 0.0]),  # "4+8=": the carry forgotten
        ("<think>\n7+5=12\n4+8+1=12\n</think><answer>122</answer>", [1.0, 1.0, 1.0, 0.0, 0.0]),  # added wrong
        ("<think>\n7+5=12\n4+8=13\n</think><answer>132</answer>", [1.0, 1.0, 0.0, 1.0, 1.0]),  # carried silently
        ("<think>\n7+5=12\n4+8+1=13\n1+1=2\n</think><answer>132</answer>", [1.0] * 4 + [0.0, 1.0]),  # extra line
        ("<think>\n7+5=12\n</think>\n<answer>122</answer>", [1.0, 1.0, 0.0, 0.0]),  # the carry's column left out
        ("<answer>132</answer>", [1.0]),
        # the carry in a line of its own: 4+8=12, then 12+1=13; a wrong sum, a wrong operand
        (worked_solution(47, 85, carry="line"), [1.0] * 7),
        ("<think>\n7+5=12\n4+8=12\n12+1=14\n</think><answer>142</answer>", [1.0] * 5 + [0.0, 0.0]),
        ("<think>\n7+5=12\n4+8=12\n12+2=14\n</think><answer>142</answer>", [1.0] * 4 + [0.0, 0.0, 0.0]),
        ("<think>\n7+5=12\n4+8=11\n11+1=12\n</think><answer>122</answer>", [1.0] * 3 + [0.0] * 4),
        # without a carry there is no third line to write
        ("<think>\n7+5=12\n4+8+1=13\n13+1=14\n</think><answer>132</answer>", [1.0] * 4 + [0.0, 1.0]),
    ],
)
def test_arithmetic_substeps_reward(completion, expected):
    steps = arithmetic_substeps_reward(["What is 47 + 85?"], [completion])[0]
    assert [reward for _, reward in steps] == expected
    assert [offset for offset, _ in steps] == sorted({offset for offset, _ in steps})
    assert steps[-1][0] == len(completion)


def test_substeps_end_with_the_equals_sign_then_the_line():
    text = worked_solution(47, 85)
    offsets = [offset for offset, _ in arithmetic_substeps_reward(["What is 47 + 85?"], [text])[0]]
    assert [text[:o].rsplit("\n", 1)[-1] for o in offsets[:4]] == ["7+5=", "7+5=12", "4+8+1=", "4+8+1=13"]
    # the line-level reward's steps are the substeps' second halves, with the same rewards
    for completion in (text, worked_solution(47, 85, forget_carry=True)):
        lines = arithmetic_steps_reward(["What is 47 + 85?"], [completion])[0]
        halves = arithmetic_substeps_reward(["What is 47 + 85?"], [completion])[0]
        assert [end for end, _ in lines] == [end for end, _ in halves[1:4:2]] + [halves[-1][0]]


@pytest.mark.parametrize("carry", CARRY_STYLES)
def test_every_carry_style_is_a_correct_plan(carry):
    for a, b in ((47, 85), (41, 35), (19, 81), (10, 10)):
        text = worked_solution(a, b, carry=carry)
        assert extract_answer(text) == str(a + b)
        for reward in (arithmetic_steps_reward, arithmetic_substeps_reward):
            assert all(r == 1.0 for _, r in reward([f"What is {a} + {b}?"], [text])[0]), (text, reward)


@pytest.mark.parametrize("completion, expected", [
    ("<think>\n7+5=12\n4+8=12\n</think><answer>122</answer>", [1.0, 0.0, 0.0]),  # the carry left out
    ("<think>\n7+5=12\n4+8+0=12\n</think><answer>122</answer>", [1.0, 0.0, 0.0]),  # a carry of 0 where it is 1
    ("<think>\n7+5=12\n4+8=12\n12+0=12\n</think><answer>122</answer>", [1.0, 1.0, 0.0, 0.0]),  # its own line, 0
])
def test_a_carry_left_out_is_wrong_in_every_style(completion, expected):
    assert [r for _, r in arithmetic_steps_reward(["What is 47 + 85?"], [completion])[0]] == expected


def test_a_carry_where_there_is_none_is_wrong():
    text = "<think>\n1+5=06\n4+3+1=8\n</think><answer>86</answer>"
    assert [r for _, r in arithmetic_steps_reward(["What is 41 + 35?"], [text])[0]] == [1.0, 0.0, 0.0]
    assert worked_solution(41, 35, carry="line") == worked_solution(41, 35)  # no carry, no line for it
    with pytest.raises(ValueError, match="carry must be one of"):
        worked_solution(41, 35, carry="sideways")


def test_step_offsets_point_at_the_end_of_each_line():
    text = worked_solution(47, 85)
    offsets = [offset for offset, _ in arithmetic_steps_reward(["What is 47 + 85?"], [text])[0]]
    assert [text[:o].rsplit("\n", 1)[-1] for o in offsets[:2]] == ["7+5=12", "4+8+1=13"]


def test_arithmetic_steps_reward_needs_an_addition_prompt():
    assert arithmetic_steps_reward(["Say hi"], ["hi"]) == [None]


# ---- scoring steps -------------------------------------------------------------------------------


def two_steps(prompts, completions, **kw):
    return [[(1, 1.0), (len(c), 0.5)] for c in completions]


def test_score_steps_mixes_outcome_and_process_rewards_by_weight():
    completions = ["<answer>3</answer>", "<answer>4</answer>"]
    total, per_fn, steps = score_steps(
        [two_steps, accuracy_reward], [2.0, 1.0], ["q", "q"], completions, {"answer": ["3", "3"]}
    )
    end = len(completions[0])
    # outcome rewards become a step at the end of the completion, summed with the process step there
    assert steps == [[(1, 2.0), (end, 2 * 0.5 + 1.0)], [(1, 2.0), (end, 2 * 0.5 + 0.0)]]
    assert per_fn["two_steps"].tolist() == [0.75, 0.75]  # mean step reward, for logging
    assert total.tolist() == [2 * 0.75 + 1.0, 2 * 0.75]


def test_none_and_empty_step_lists_add_no_step():
    _, per_fn, steps = score_steps([lambda completions, **k: [None, []]], [1.0], ["q", "q"], ["a", "b"], {})
    assert steps == [[], []] and torch.isnan(per_fn["<lambda>"]).all()


@pytest.mark.parametrize(
    "value, match",
    [
        ([(0, 1.0), (9, 1.0)], r"'bad': step 1 of completion 0 ends at character 9, outside the completion's \[0, 2\]"),
        ([(0.5, 1.0)], r"'bad': step 0 of completion 0 is \(0.5, 1.0\); expected a pair"),
        ([(1, float("inf"))], r"'bad' returned inf for completion 0, step 0"),
        ([(1, "1")], r"'bad' returned str '1' for completion 0, step 0"),
    ],
)
def test_bad_steps_name_function_completion_and_step(value, match):
    def bad(prompts, completions, **kw):
        return [value, []]

    with pytest.raises(RewardError, match=match):
        score_steps([bad], [1.0], ["q", "q"], ["ab", "cd"], {})


def test_process_reward_under_outcome_supervision_says_what_to_do():
    with pytest.raises(RewardError, match="'two_steps' returned step rewards .* set supervision: process"):
        score_completions([two_steps], [1.0], ["q"], ["ab"], {})
