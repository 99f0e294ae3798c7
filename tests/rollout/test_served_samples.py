"""Token in, token out (rollout/served_samples.py): an episode's served requests become samples of exactly the
tokens sampled; what came between the turns is context, masked from the loss; a history that does not extend
token for token makes one sample per request."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpokit.rollout.served_samples import MERGED, PER_TURN, ServedTurn, episode_samples, extends


def test_turns_that_extend_each_other_are_one_sample_with_the_between_masked():
    # system+user (10, 11), the model's call (20, 21, EOS 2), a tool's result (30, 31), the model's answer (40, 2)
    first = ServedTurn([10, 11], [20, 21, 2], [-0.1, -0.2, -0.3])
    second = ServedTurn([10, 11, 20, 21, 2, 30, 31], [40, 2], [-0.4, -0.5])
    samples, mode = episode_samples([first, second])
    assert mode == MERGED and len(samples) == 1
    sample = samples[0]
    assert sample.prompt_ids == [10, 11]
    assert sample.completion_ids == [20, 21, 2, 30, 31, 40, 2]
    assert sample.loss_mask == [1, 1, 1, 0, 0, 1, 1]
    assert sample.logprobs == [-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5]
    # the whole conversation, as the last request saw it plus what it sampled
    assert sample.prompt_ids + sample.completion_ids == list(second.prompt_ids) + list(second.completion_ids)


def test_a_request_straight_after_the_last_turn_puts_nothing_between():
    samples, mode = episode_samples([ServedTurn([1], [2], [-1.0]), ServedTurn([1, 2], [3], [-2.0])])
    assert mode == MERGED and samples[0].completion_ids == [2, 3] and samples[0].loss_mask == [1, 1]


@pytest.mark.parametrize("second_prompt", [
    [10, 11, 20, 99, 30],  # the template re-rendered the earlier turn (a token differs)
    [10, 11, 20],  # the agent cut the earlier turn short
    [10, 12, 20, 21, 30],  # the agent rewrote its own prompt
])
def test_a_history_that_does_not_extend_makes_a_sample_per_request(second_prompt):
    first = ServedTurn([10, 11], [20, 21], [-0.1, -0.2])
    second = ServedTurn(second_prompt, [40], [-0.4])
    assert not extends([first, second])
    samples, mode = episode_samples([first, second])
    assert mode == PER_TURN
    assert [(s.prompt_ids, s.completion_ids, s.loss_mask, s.logprobs) for s in samples] == [
        ([10, 11], [20, 21], [1, 1], [-0.1, -0.2]), (second_prompt, [40], [1], [-0.4])]


def test_one_request_is_its_own_sample():
    samples, mode = episode_samples([ServedTurn([5, 6], [7], [-0.7])])
    assert mode == MERGED and (samples[0].prompt_ids, samples[0].completion_ids) == ([5, 6], [7])


@pytest.mark.parametrize("turns, message", [
    ([], "no request to the policy"),
    ([ServedTurn([1], [2, 3], [-1.0])], "request 0 recorded 2 sampled tokens but 1 log-probs"),
    ([ServedTurn([1], [2], [-1.0]), ServedTurn([], [3], [-1.0])], "request 1 has an empty prompt"),
])
def test_an_episode_that_cannot_be_trained_is_refused_by_request(turns, message):
    with pytest.raises(ValueError, match=message):
        episode_samples(turns)


tokens = st.lists(st.integers(0, 50), min_size=1, max_size=6)


@given(st.lists(st.tuples(tokens, tokens), min_size=1, max_size=5), tokens)
def test_the_tokens_trained_are_the_tokens_sampled_in_order(episode, first_prompt):
    """Any episode built by extension: the loss-masked tokens are every request's sampled tokens, in order, and
    their log-probs with them."""
    turns, history = [], list(first_prompt)
    for n, (between, sampled) in enumerate(episode):
        prompt = history + (between if n else [])
        turns.append(ServedTurn(prompt, sampled, [-float(t) for t in sampled]))
        history = prompt + sampled
    (sample,), mode = episode_samples(turns)
    assert mode == MERGED
    trained = [t for t, m in zip(sample.completion_ids, sample.loss_mask) if m]
    assert trained == [t for turn in turns for t in turn.completion_ids]
    assert [p for p, m in zip(sample.logprobs, sample.loss_mask) if m] == [p for turn in turns for p in turn.logprobs]
    assert sample.prompt_ids + sample.completion_ids == history
