"""Calls and environment turns that do not stall the batch: a completion waiting for a call leaves holes (masked,
position not taken, nothing recorded) while the others decode; what it samples does not depend on how long the call
took; environments reply between turns, end episodes, start from their resets' observations, and fail by name."""

import random
import threading
import time

import pytest
import torch

from grpokit.rollout import episodes
from grpokit.rollout.episodes import EnvironmentFailure
from grpokit.rollout.generate import generate
from grpokit.rollout.tools import ToolBox, calculator, turn_markup, with_observation
from grpokit.tasks.tiny_model import build_model, build_tokenizer
from helpers import TOOL_SPEC, Scripted


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(tool_tags=True)


@pytest.fixture(scope="module")
def model(tok):
    return build_model(tok, TOOL_SPEC, seed=3).double().eval()


def rollout_of(model, tok, session, prompts=("What is 6*7?", "Hi"), g=8, max_new_tokens=60, fast=True, seed=1):
    encoded = tok(list(prompts), return_tensors="pt", padding=True, padding_side="left")
    return generate(model, encoded["input_ids"], encoded["attention_mask"], num_generations=g,
                    max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                    generator=torch.Generator().manual_seed(seed), fast=fast, tools=session)


def full_forward_logp(model, rollout):
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], dim=1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], dim=1)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    width = rollout.completion_ids.shape[1]
    return torch.log_softmax(logits[:, -width - 1:-1].double(), dim=-1).gather(
        2, rollout.completion_ids.unsqueeze(2)).squeeze(2)


@pytest.mark.parametrize("fast", [True, False])
def test_waiting_for_slow_calls_changes_no_token_and_leaves_no_trace(model, tok, monkeypatch, fast):
    """The same rollout with calls answered at once and after random delays (the rows that called wait in holes
    while the others decode): the same tokens, log-probs and inserted results; the log-probs recorded across the
    holes equal a plain forward over the finished sequences (the holes were never attended to)."""
    instant = rollout_of(model, tok, ToolBox(tok, [calculator]).session([{}, {}], 8, 60), fast=fast)
    run_tool, draw, steps = episodes.run_tool, random.Random(0), [0]

    class Counting(episodes.ToolSession):
        def intervene(self, *args):
            steps[0] += 1
            return super().intervene(*args)

    def slow(*args, **kwargs):  # a call that lasts a few decode steps (or 50 ms, when nothing else decodes)
        until, deadline = steps[0] + draw.choice([0, 2, 7]), time.perf_counter() + 0.05
        while steps[0] < until and time.perf_counter() < deadline:
            time.sleep(0.0005)
        return run_tool(*args, **kwargs)

    monkeypatch.setattr(episodes, "run_tool", slow)
    session = Counting(ToolBox(tok, [calculator]), 16, 60, None)
    waited = rollout_of(model, tok, session, fast=fast)
    assert session.holes > 0 and session.metrics()["wait_steps"] == session.holes
    called = waited.tool_mask.sum(dim=1) > 0
    assert 0 < called.sum() < len(waited)
    for name in ("completion_ids", "completion_mask", "tool_mask", "truncated"):
        assert torch.equal(getattr(instant, name), getattr(waited, name)), name
    torch.testing.assert_close(instant.logp, waited.logp, atol=1e-9, rtol=0)
    own = waited.model_mask.bool()
    torch.testing.assert_close(waited.logp[own].double(), full_forward_logp(model, waited)[own], atol=1e-6, rtol=0)


class Guess:
    """A multi-turn environment: replies 'higher' to each turn until its third, then ends the episode."""

    def __init__(self, delay=0.0, turns=3):
        self.delay, self.turns, self.seen, self.ended = delay, turns, [], "not called"

    def reset(self, **row):
        self.row = row
        return row.get("board")

    def reply(self, turn):
        time.sleep(self.delay)
        self.seen.append(turn)
        return None if len(self.seen) >= self.turns else "higher"

    def end(self, turn):
        self.ended = turn

    def get_reward(self):
        return float(len(self.seen))


def scripted_episode(model, tok, texts, factory, max_new_tokens=80, fast=True, **options):
    box = ToolBox(tok, [], environment_factory=factory, **options)
    session = Scripted(box, texts, max_new_tokens)
    session.environments = [factory() for _ in texts]
    for environment in session.environments:
        environment.reset()
    encoded = tok(["Q?"], return_tensors="pt")
    rollout = generate(model, encoded["input_ids"], encoded["attention_mask"], num_generations=len(texts),
                       max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       fast=fast, tools=session)
    return rollout, session


@pytest.mark.parametrize("fast", [True, False])
def test_an_environment_replies_between_turns_and_ends_the_episode(model, tok, fast):
    rollout, session = scripted_episode(model, tok, ["guess 5", "7"], lambda: Guess(delay=0.02), fast=fast)
    texts = rollout.decode(tok)
    # each turn ends with the model's EOS (kept: the policy chose to end its turn), then the reply's markup
    assert texts[0] == "guess 5\nhigher\n\nhigher\n"
    first, second = session.environments
    assert first.seen == ["guess 5", "", ""] and first.ended is None  # reply saw every turn
    assert second.seen == ["7", "", ""]
    assert not rollout.truncated.any()  # the environment ended the episodes
    eos = tok.eos_token_id
    assert rollout.completion_ids[0, rollout.lengths[0] - 1] == eos
    inserted = rollout.completion_ids[0][rollout.tool_mask[0].bool()].tolist()
    assert tok.decode(inserted) == "\nhigher\n\nhigher\n"
    assert (rollout.logp[rollout.tool_mask.bool()] == 0).all()
    assert session.metrics()["env_replies"] == 6


def test_max_turns_and_the_budget_end_episodes_and_end_sees_the_last_turn(model, tok):
    rollout, session = scripted_episode(model, tok, ["abc"], lambda: Guess(turns=9), max_turns=2)
    assert session.environments[0].seen == ["abc"] and session.environments[0].ended == ""  # turn 2: EOS only
    assert not rollout.truncated.any()
    rollout, session = scripted_episode(model, tok, ["x" * 30], lambda: Guess(turns=9), max_new_tokens=12)
    assert session.environments[0].seen == [] and session.environments[0].ended == "x" * 12
    assert rollout.truncated.all()


def test_a_reset_observation_starts_each_completions_prompt(tok):
    box = ToolBox(tok, [], environment_factory=Guess)
    session = box.session([{"prompt": "Play.", "board": "[1, 2]"}, {"prompt": "Play."}], 2, 10)
    assert session.prompts == ["Play.\n\n[1, 2]"] * 2 + ["Play."] * 2
    assert session.sample_prompts(["a", "b"], 2) == (session.prompts, 1)
    assert ToolBox(tok, [calculator]).session([{}], 2, 10).sample_prompts(["a"], 2) == (["a"], 2)
    assert with_observation([{"role": "system", "content": "s"}], "obs")[-1] == {"role": "user", "content": "obs"}


def test_environments_are_made_and_reset_concurrently(tok):
    """All 16 resets of a step wait at one barrier: it opens only if they run at the same time."""
    barrier = threading.Barrier(16, timeout=10)

    class Meeting(Guess):
        def reset(self, **row):
            barrier.wait()

    ToolBox(tok, [], environment_factory=Meeting, workers=16).session([{}] * 4, 4, 10)
    assert barrier.n_waiting == 0 and not barrier.broken


def test_a_failing_or_wrong_environment_is_named(model, tok):
    class Broken(Guess):
        def reply(self, turn):
            raise KeyError("board")

    with pytest.raises(EnvironmentFailure, match=r"Broken.reply raised KeyError: 'board' \(completion 0\)"):
        scripted_episode(model, tok, ["a"], Broken)

    class Wrong(Guess):
        def reply(self, turn):
            return 3

    with pytest.raises(EnvironmentFailure, match="Wrong.reply returned int, not a text or None"):
        scripted_episode(model, tok, ["a"], Wrong)

    class BadReset(Guess):
        def reset(self, **row):
            return {"board": 1}

    with pytest.raises(EnvironmentFailure, match="BadReset.reset returned dict"):
        ToolBox(tok, [], environment_factory=BadReset).session([{}], 1, 10)
    made = []

    def unreachable():  # the probe at start-up is made; the step's environments are not
        if made:
            raise ConnectionError("no server")
        made.append(1)
        return Guess()

    with pytest.raises(EnvironmentFailure, match=r"ToolBox.environment_factory raised ConnectionError: no server"):
        ToolBox(tok, [], environment_factory=unreachable).session([{}], 1, 10)


def test_a_slow_reply_is_refused_after_tool_timeout(model, tok):
    with pytest.raises(EnvironmentFailure, match="reply took longer than tool_timeout"):
        scripted_episode(model, tok, ["a"], lambda: Guess(delay=1.0), timeout=0.1)


def test_chatml_turn_markup_follows_the_stop_token():
    from transformers import PreTrainedTokenizerFast

    from grpokit.tasks.tiny_model import build_tokenizer as build
    tokenizer = build()
    assert turn_markup(tokenizer, None) == ("\n", "\n")  # no template: the reply on lines of its own
    chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|im_end|>")
    tokenizer.chat_template = chatml
    assert turn_markup(tokenizer, None) == ("\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
    assert turn_markup(tokenizer, False) == ("\n", "\n")
