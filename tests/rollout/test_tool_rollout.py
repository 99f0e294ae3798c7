"""Tools in the rollout: a completion that closes a call gets the result inserted through the KV cache while
the others keep decoding; the inserted tokens are masked out of everything the policy is trained and measured
on; faults give the model an error text, never a crash."""

import json
import time

import pytest
import torch

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.core.ppo_objective import gae
from grpokit.models.logprobs import sequence_logprobs
from grpokit.rollout.generate import generate
from grpokit.rollout.tools import ToolBox, calculator, tool_messages
from grpokit.tasks.tiny_model import build_model, build_tokenizer
from helpers import TOOL_ROWS, TOOL_SPEC, Scripted

CALL = '<tool>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool>'


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(tool_tags=True)


@pytest.fixture(scope="module")
def model(tok):
    return build_model(tok, TOOL_SPEC, seed=0).eval()


def scripted_rollout(model, tok, texts, tools=(calculator,), max_new_tokens=240, fast=True, **options):
    box = ToolBox(tok, list(tools), **options)
    session = Scripted(box, texts, max_new_tokens)
    encoded = tok(["Q?"], return_tensors="pt")
    rollout = generate(model, encoded["input_ids"], encoded["attention_mask"], num_generations=len(texts),
                       max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       fast=fast, tools=session)
    return rollout, session


def inserted_text(tok, rollout, i):
    ids = rollout.completion_ids[i][rollout.tool_mask[i].bool()].tolist()
    return tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("fast", [True, False])
def test_the_result_is_inserted_and_the_mask_covers_exactly_its_tokens(model, tok, fast):
    """Rows that call and rows that do not, in one batch: the callers' texts have the result after the call,
    the mask holds exactly the inserted text, and the non-callers are untouched."""
    texts = [f"<think>{CALL}</think><answer>42</answer>", "<answer>41</answer>",
             f"{CALL}{CALL.replace('6*7', '2/0')}done", "no call"]
    rollout, session = scripted_rollout(model, tok, texts, fast=fast)
    decoded = rollout.decode(tok)
    assert decoded[0] == f"<think>{CALL}<result>42</result></think><answer>42</answer>"
    assert decoded[1] == "<answer>41</answer>" and decoded[3] == "no call"
    assert decoded[2] == f"{CALL}<result>42</result>{CALL.replace('6*7', '2/0')}<result>error: division by zero" \
                         "</result>done"
    assert inserted_text(tok, rollout, 0) == "<result>42</result>"
    assert inserted_text(tok, rollout, 2) == "<result>42</result><result>error: division by zero</result>"
    assert rollout.tool_mask[[1, 3]].sum() == 0
    assert [[(c.name, c.result, c.failed) for c in calls] for calls in session.calls] == [
        [("calculator", "42", False)], [],
        [("calculator", "42", False), ("calculator", "error: division by zero", True)], []]
    # the policy's own tokens: everything it wrote, EOS included
    own = rollout.model_mask.sum(dim=1).tolist()
    assert own == [len(tok(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts]
    assert not rollout.truncated.any()


def test_model_token_logprobs_equal_a_full_forward_of_the_interleaved_sequence(tok):
    """Sampling from a random model, some completions close calls (malformed ones: their error texts are
    inserted) and others do not. The log-probs recorded while decoding through the KV cache across the
    insertions, and those of the training pass, equal a plain forward over the whole interleaved sequence."""
    model = build_model(tok, TOOL_SPEC, seed=3).double().eval()
    box = ToolBox(tok, [calculator])
    encoded = tok(["What is 6*7?", "Hi"], return_tensors="pt", padding=True, padding_side="left")
    for fast in (True, False):
        session = box.session([{}, {}], 8, 60)
        rollout = generate(model, encoded["input_ids"], encoded["attention_mask"], num_generations=8,
                           max_new_tokens=60, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                           generator=torch.Generator().manual_seed(1), fast=fast, tools=session)
        called = rollout.tool_mask.sum(dim=1) > 0
        assert 0 < called.sum() < len(rollout)  # both kinds in the batch
        ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], dim=1)
        mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], dim=1)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        width = rollout.completion_ids.shape[1]
        full = torch.log_softmax(logits[:, -width - 1:-1].double(), dim=-1).gather(
            2, rollout.completion_ids.unsqueeze(2)).squeeze(2)
        own = rollout.model_mask.bool()
        torch.testing.assert_close(rollout.logp[own].double(), full[own], atol=1e-6, rtol=0)
        for train_fast in (True, False):
            logp, _ = sequence_logprobs(model, *rollout.sequences(), fast=train_fast)
            torch.testing.assert_close(logp[own].double(), full[own], atol=1e-6, rtol=0)
        assert (rollout.logp[rollout.tool_mask.bool()] == 0).all()  # inserted: not the policy's picks


def slow_tool(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(float(seconds))
    return "woke"


def broken_tool(x: str) -> str:
    """Raise.

    Args:
        x: anything
    """
    raise RuntimeError("the tool broke")


@pytest.mark.parametrize("call, result", [
    ('<tool>{"name": "broken_tool", "arguments": {"x": "1"}}</tool>',
     "error: broken_tool raised RuntimeError: the tool broke"),
    ('<tool>{"name": "slow_tool", "arguments": {"seconds": 5}}</tool>', "error: slow_tool took longer than 0.2 s"),
    ('<tool>{"name": "calculator", "arguments": {"expr": "1"}}</tool>',
     "error: calculator: calculator() got an unexpected keyword argument 'expr'"),
    ('<tool>{"name": "rm", "arguments": {}}</tool>', "error: unknown tool 'rm'; the tools are broken_tool, "
                                                      "calculator, slow_tool"),
    ('<tool>{"name": "calculator", "arguments": </tool>', "error: the call is not valid JSON (Expecting value)"),
    ('<tool><tool>{"name": "calculator"}</tool>', "error: nested <tool> tags: a call is one JSON object between "
                                                  "one <tool> and </tool>"),
    ("</tool>", "error: </tool> without a <tool> before it"),
    ('<tool>{"name": "calculator", "arguments": {"expression": "' + "9" * 5000 + '"}}</tool>',
     "error: the call is longer than 4096 characters"),
    ('<tool>{"name": "calculator", "arguments": {"expression": "9**9**9"}}</tool>',
     "error: powers are not supported (only + - * /)"),
])
def test_every_fault_gives_the_model_an_error_text(model, tok, call, result):
    rollout, session = scripted_rollout(model, tok, [call + "ok"], tools=(calculator, slow_tool, broken_tool),
                                        max_new_tokens=len(call) + 200, timeout=0.2)
    (use,) = session.calls[0]
    assert use.failed and use.result == result
    assert inserted_text(tok, rollout, 0) == f"<result>{result}</result>"
    assert rollout.decode(tok)[0].endswith("</result>ok")


def test_an_unclosed_call_is_text_and_never_runs(model, tok):
    rollout, session = scripted_rollout(model, tok, ['<tool>{"name": "calculator", "arguments": {"expression": "1"}}'])
    assert session.calls == [[]] and rollout.tool_mask.sum() == 0


def test_calls_past_max_tool_calls_get_an_error_and_the_budget_cuts_a_result(model, tok):
    rollout, session = scripted_rollout(model, tok, [CALL * 3], max_calls=2)
    assert [c.result for c in session.calls[0]] == ["42", "42", "error: at most 2 tool calls per completion"]
    # a result that does not fit is cut where the completion's budget ends; the completion is then truncated
    budget = len(tok(CALL, add_special_tokens=False)["input_ids"]) + 3
    rollout, session = scripted_rollout(model, tok, [CALL + "more"], max_new_tokens=budget)
    assert inserted_text(tok, rollout, 0) == "<result>42" and rollout.truncated.all()
    assert session.calls[0][0].tokens == 3


def test_tool_messages_split_the_completion_at_its_calls(model, tok):
    rollout, session = scripted_rollout(model, tok, [f"a{CALL}b"])
    ids = rollout.completion_ids[0, : int(rollout.lengths[0])].tolist()
    assert tool_messages(tok, ids, session.calls[0]) == [
        {"role": "assistant", "content": f"a{CALL}",
         "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "6*7"}}}]},
        {"role": "tool", "name": "calculator", "content": "42"},
        {"role": "assistant", "content": "b"},
    ]


def test_gae_carries_the_value_across_inserted_tokens():
    """GAE over a row with a hole equals GAE over the same row with the hole removed."""
    rewards = torch.tensor([[0.1, 9.0, 9.0, 0.2, 1.0, 0.0]])
    values = torch.tensor([[0.5, 7.0, 7.0, 0.3, 0.4, 0.0]])
    mask = torch.tensor([[1, 0, 0, 1, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    keep = [0, 3, 4]
    ref_adv, ref_ret = gae(rewards[:, keep], values[:, keep], torch.ones(1, 3), gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv[:, keep], ref_adv)
    torch.testing.assert_close(ret[:, keep], ref_ret)
    assert adv[0, [1, 2, 5]].eq(0).all() and ret[0, [1, 2, 5]].eq(0).all()


def trainer_for(tok, tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path), prompts_per_step=4, num_generations=4, max_completion_length=40,
                    max_steps=2, progress_bar=False, learning_rate=1e-3, tools=["calculator"])
    config = GRPOConfig(**{**settings, **overrides})
    return GRPOTrainer(config, model=build_model(tok, TOOL_SPEC, seed=0), tokenizer=tok, train_dataset=TOOL_ROWS)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_training_with_tools_leaves_results_out_of_the_loss_and_the_lengths(tok, tmp_path, algorithm):
    trainer = trainer_for(tok, tmp_path, algorithm=algorithm)
    history = trainer.train()
    batch, _, _ = trainer.sampler.sample()
    rollout = batch.rollout
    assert rollout.tool_mask.sum() > 0  # the random model closes calls now and then
    assert torch.equal(rollout.model_mask, rollout.completion_mask * (1 - rollout.tool_mask))
    last = history[-1]
    assert last["tool_calls"] >= 1 and last["tool_errors"] == last["tool_calls"]  # none of them well formed
    assert 0 < last["tool_call_rate"] <= 1 and last["tool_result_tokens_mean"] > 0
    records = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert all("tool_calls" in r for r in records)


def test_the_loss_mask_drops_exactly_the_inserted_tokens(tok, tmp_path, monkeypatch):
    """What reaches the objective: the model's own tokens only."""
    from grpokit.algorithms import grpo as trainer_module

    seen = []
    real = trainer_module.grpo_loss

    def spy(logp, old_logp, ref_logp, advantages, mask, **kwargs):
        seen.append(mask.clone())
        return real(logp, old_logp, ref_logp, advantages, mask, **kwargs)

    monkeypatch.setattr(trainer_module, "grpo_loss", spy)
    trainer = trainer_for(tok, tmp_path)
    batch, _, _ = trainer.sampler.sample()
    assert batch.rollout.tool_mask.sum() > 0  # else the model mask is the completion mask and this shows nothing
    trainer.sampler.sample = lambda step=0: (batch, batch, {})
    trainer.training_step()
    assert torch.equal(torch.cat(seen), batch.rollout.model_mask)


class Guess:
    """An environment per completion: it knows the row's answer and grades each guess."""

    made = 0

    def __init__(self):
        type(self).made += 1

    def reset(self, answer, **row):
        self.answer, self.guesses = answer, []

    def check(self, guess: str) -> str:
        """Whether the guess is right.

        Args:
            guess: the number guessed
        """
        self.guesses.append(guess)
        return "right" if guess == self.answer else "wrong"

    def get_reward(self) -> float:
        return float(bool(self.guesses) and self.guesses[-1] == self.answer)


def test_an_environment_per_completion_offers_tools_and_its_reward(tok, tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(Guess, "made", 0)

    def sees_environments(completions, environments, **kwargs):
        seen["environments"] = environments
        return [0.0] * len(completions)

    config = GRPOConfig(output_dir=str(tmp_path), prompts_per_step=2, num_generations=2, max_completion_length=8,
                        max_steps=1, progress_bar=False)
    trainer = GRPOTrainer(config, model=build_model(tok, TOOL_SPEC, seed=0), tokenizer=tok, train_dataset=TOOL_ROWS,
                          reward_funcs=[sees_environments], environment_factory=Guess)
    assert Guess.made == 1  # start-up made one probe (the ToolBox's); its reward was read off the class
    box = trainer.sampler.toolbox
    session = box.session(TOOL_ROWS[:2], 2, 60)
    assert [e.answer for e in session.environments] == ["70", "70", "77", "77"]
    assert sorted(session.tools_of(0)) == ["check"]
    history = trainer.train()
    assert "rewards/Guess" in history[-1] and len(seen["environments"]) == 4
    assert all(isinstance(e, Guess) for e in seen["environments"])


def test_tools_from_the_config_and_clear_errors(tok, tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(
        'def shout(text: str) -> str:\n    """Upper case."""\n    return text.upper()\n')
    monkeypatch.chdir(tmp_path)
    trainer = trainer_for(tok, tmp_path / "run", tools=["calculator", "my_tools.py:shout"])
    assert sorted(trainer.sampler.toolbox.tools) == ["calculator", "shout"]
    (tmp_path / "my_env.py").write_text("class Counter:\n    def reset(self, **row):\n        self.n = 0\n"
                                        "    def bump(self) -> str:\n        self.n += 1\n        return str(self.n)\n")
    trainer = trainer_for(tok, tmp_path / "run", environment_factory="my_env.py:Counter")
    assert sorted(trainer.sampler.toolbox.schema_tools()[i].__name__ for i in range(2)) == ["bump", "calculator"]
    with pytest.raises(ValueError, match=r"environment_factory: 'my_env.py:Count': 'my_env.py' has no attribute"):
        trainer_for(tok, tmp_path / "run", environment_factory="my_env.py:Count")
    with pytest.raises(ValueError, match=r"tools: unknown tool 'calculater'"):
        trainer_for(tok, tmp_path / "run", tools=["calculater"])
    with pytest.raises(ValueError, match=r"tools: 'my_tools.py:whisper': 'my_tools.py' has no attribute 'whisper'"):
        trainer_for(tok, tmp_path / "run", tools=["my_tools.py:whisper"])
    with pytest.raises(ValueError, match=r"tools: 'gone.py:f': file 'gone.py' does not exist"):
        trainer_for(tok, tmp_path / "run", tools=["gone.py:f"])


def test_a_result_is_never_read_as_a_call(model, tok):
    """A tool whose text holds a call (or an error quoting "</tool>") gets no second call: the next call is
    searched for after the result."""

    def echo() -> str:
        """Return a call's text."""
        return CALL

    rollout, session = scripted_rollout(model, tok, ['<tool>{"name": "echo"}</tool>a>b</answer>', "</tool>x>y"],
                                        tools=(calculator, echo))
    assert [[c.name for c in calls] for calls in session.calls] == [["echo"], [None]]
    assert rollout.decode(tok)[0] == f'<tool>{{"name": "echo"}}</tool><result>{CALL}</result>a>b</answer>'


def test_a_resumed_run_with_tools_ends_where_a_straight_one_does(tok, tmp_path):
    from safetensors.torch import load_file

    def run(out, steps, resume=None):
        trainer_for(tok, out, max_steps=steps, save_every=1, resume=resume, lr_schedule="constant").train()

    run(tmp_path / "straight", 4)
    run(tmp_path / "resumed", 2)
    run(tmp_path / "resumed", 4, "latest")
    a, b = (load_file(str(tmp_path / name / "model" / "model.safetensors")) for name in ("straight", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    metrics = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and sum(m["tool_calls"] for m in metrics) > 0


def test_lora_trains_with_tools(tok, tmp_path):
    pytest.importorskip("peft")
    history = trainer_for(tok, tmp_path, lora_rank=4, lora_target_modules=["q_proj", "v_proj"]).train()
    assert history[-1]["tool_calls"] > 0 and (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "model" / "config.json").is_file()  # merged: plain transformers loads it


def test_conversational_rewards_get_the_messages_with_the_tool_turns(model, tok):
    """For a prompt that is a list of messages, completions reach reward functions as TRL passes them: the
    assistant's turns and the tool's messages between them; a text prompt's completion stays the text."""
    from grpokit.rewards.calling import score_completions

    rollout, session = scripted_rollout(model, tok, [f"x{CALL}y", "plain"])
    texts, chat = rollout.decode(tok), [{"role": "user", "content": "Q?"}]
    assert session.reward_inputs(rollout, ["Q?", "Q?"], {}) is None  # text prompts: the text is the trajectory
    messages = session.reward_inputs(rollout, [chat, "Q?"], {})
    seen = []

    def sees(completions, **kwargs):
        seen.extend(completions)
        return [0.0] * len(completions)

    score_completions([sees], [1.0], [chat, "Q?"], texts, {}, messages=messages)
    assert [m["role"] for m in seen[0]] == ["assistant", "tool", "assistant"]
    assert seen[0][1] == {"role": "tool", "name": "calculator", "content": "42"} and seen[1] == "plain"


def test_ids_past_the_tokenizer_are_no_call(tok):
    """A model whose vocabulary is padded past the tokenizer's may sample an id the tokenizer does not have."""
    box = ToolBox(tok, [calculator])
    session = box.session([{}], 1, 4)
    chosen, stopped, logp = torch.tensor([len(tok) + 5]), torch.tensor([False]), torch.zeros(1)
    assert session.intervene(torch.tensor([0]), torch.tensor([0]), chosen, stopped, logp)[0].tolist() == [len(tok) + 5]


def test_sampled_rows_call_the_tools_as_training_does(model, tok):
    """``grpokit sample`` with tools (and iterative RL's sampling, which runs it with the run's toolbox): each
    completion is its whole trajectory, tool results included, as the labelling rewards read it."""
    from grpokit.training.labelling import sample_rows

    seen = []

    def sees(completions, **kwargs):
        seen.extend(completions)
        return [0.0] * len(completions)

    rows, _ = sample_rows(model, tok, TOOL_ROWS[:8], [sees], [1.0], num_generations=4, max_new_tokens=40, seed=0,
                          batch_size=4, progress=False, toolbox=ToolBox(tok, [calculator]))
    assert len(rows) == 32 and [r["completion"] for r in rows] == seen
    # Each call (the random model's are malformed) got an error text back, inside the completion's text.
    assert any(r["tool_calls"] for r in rows)
    assert all(r["completion"].count("<result>") >= r["tool_calls"] for r in rows)
    plain, _ = sample_rows(model, tok, TOOL_ROWS[:8], [sees], [1.0], num_generations=4, max_new_tokens=40, seed=0,
                           batch_size=4, progress=False)
    assert all("tool_calls" not in r for r in plain) and plain != rows

