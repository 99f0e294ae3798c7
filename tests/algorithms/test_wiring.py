"""Wiring of the GRPO step: each training option demonstrably reaches the function that uses it, checked by
spying on the call or by recomputing the result from the formula with code the trainer does not share.

A safety net for moving modules around: a test here fails when an option stops reaching its place, even where
the trainer's own metrics would still look plausible."""

import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from grpokit.algorithms import grpo as grpokit_trainer
from grpokit.algorithms.grpo import GRPOTrainer
from grpokit.config import GRPOConfig
from grpokit.core.objective import process_advantages
from grpokit.models import logprobs as grpokit_logprobs
from grpokit.models.logprobs import sequence_logprobs
from grpokit.rollout import engines as grpokit_engines
from grpokit.tasks.tiny_model import build_model, build_tokenizer
from grpokit.training import sampling as grpokit_sampling
from helpers import TINY

ROWS = [{"prompt": f"Count {i}:", "answer": "1"} for i in range(32)]


def spread(prompts, completions, **kw):
    """A reward with spread in every group (so advantages, hence gradients, are not 0)."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


def length(prompts, completions, **kw):
    return [len(c) / 8 for c in completions]


def char_steps(prompts, completions, **kw):
    """A process reward: a step after every character, rewarded by the character's code mod 3."""
    return [[(k + 1, float(ord(ch) % 3)) for k, ch in enumerate(c)] for c in completions]


def trainer_for(tokenizer, model, tmp_path, rewards=(spread,), **overrides) -> GRPOTrainer:
    """A tiny run: B = 2 prompts × G = 4 completions of at most 6 tokens, one micro-batch, float32."""
    values = dict(output_dir=str(tmp_path / "run"), prompts_per_step=2, num_generations=4, max_completion_length=6,
                  learning_rate=1e-2, max_steps=4, micro_batch_size=8, progress_bar=False, lr_schedule="constant",
                  mixed_precision="no", device="cpu")  # exact comparisons: float32 on the CPU anywhere
    values.update(overrides)
    return GRPOTrainer(GRPOConfig(**values), model=model, tokenizer=tokenizer, train_dataset=ROWS,
                       reward_funcs=list(rewards))


def spy_on_loss(monkeypatch) -> list[dict]:
    """Every ``grpo_loss`` call of the trainer: its tensors (detached copies) and its keyword options."""
    calls, real = [], grpokit_trainer.grpo_loss

    def spy(logp, old_logp, ref_logp, advantages, mask, **kw):
        copy_ = lambda t: None if t is None else t.detach().clone()  # noqa: E731
        calls.append(dict(logp=copy_(logp), old_logp=copy_(old_logp), ref_logp=copy_(ref_logp), mask=mask.clone(),
                          advantages=copy_(advantages), **kw))
        return real(logp, old_logp, ref_logp, advantages, mask, **kw)

    monkeypatch.setattr(grpokit_trainer, "grpo_loss", spy)
    return calls


def spy_on_step(monkeypatch, trainer) -> dict:
    """The step's sampled batch (``"batch"``) and what it hands the update (``"fixed"``)."""
    seen, sample, update = {}, trainer.sampler.sample, grpokit_trainer.update
    monkeypatch.setattr(trainer.sampler, "sample", lambda *a: seen.update(out=sample(*a)) or seen["out"])
    monkeypatch.setattr(grpokit_trainer, "update", lambda learners, fixed, **kw: seen.update(fixed=fixed)
                        or update(learners, fixed, **kw))
    return seen


def spy_on_optimizer(learner) -> list[dict]:
    """At each optimizer step of ``learner``: the gradient it applies (after clipping) and the learning rate."""
    steps, params = [], list(learner.module.parameters())

    def record(optimizer, args, kwargs):
        steps.append(dict(grad=torch.cat([p.grad.flatten() for p in params]).clone(),
                          lr=optimizer.param_groups[0]["lr"]))

    learner.optimizer.register_step_pre_hook(record)
    return steps


def plain_logprobs(model, rollout, temperature=1.0):
    """log π(token) of each completion token by the model's own forward and a log-softmax: no grpokit code."""
    width = rollout.completion_ids.shape[1]
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], dim=1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], dim=1)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -width - 1:-1]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1).gather(2, rollout.completion_ids.unsqueeze(2))
    return logp.squeeze(2) * rollout.completion_mask


def hand_advantages(rewards, group_size):
    """(r − group mean) / (group std + 1e-4), unbiased std; 0 for a group with equal rewards (docs/math.md)."""
    out = []
    for group in rewards.view(-1, group_size).tolist():
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
        out += [0.0 if max(group) == min(group) else (r - mean) / (std + 1e-4) for r in group]
    return torch.tensor(out)


def untimed(history):
    return [{k: v for k, v in m.items() if not k.startswith("time_") and k != "tokens_per_sec"} for m in history]


# ---- π_old with several minibatches --------------------------------------------------------------


def test_minibatches_after_the_first_train_against_pi_old(tokenizer, tiny_model, tmp_path, monkeypatch):
    """num_minibatches > 1 at num_iterations = 1: every minibatch's loss gets π_old, the sampling policy's log-probs,
    so the ratio moves off 1 once the policy has stepped (planted: ``moves = num_iterations > 1``)."""
    start = copy.deepcopy(tiny_model).eval()  # the weights that sample the batch: π_old
    trainer = trainer_for(tokenizer, tiny_model, tmp_path, num_minibatches=4, beta=0.0, learning_rate=5e-2)
    calls, seen = spy_on_loss(monkeypatch), spy_on_step(monkeypatch, trainer)
    trainer.training_step()
    assert len(calls) == 4 and all(c["old_logp"] is not None for c in calls)
    with torch.no_grad():
        expected = plain_logprobs(start, seen["fixed"].rollout)
    torch.testing.assert_close(seen["fixed"].old_logp, expected, atol=1e-5, rtol=0)
    # the first minibatch trains at π_θ = π_old; every later one after the policy has moved
    ratios = [torch.exp(c["logp"] - c["old_logp"])[c["mask"].bool()] for c in calls]
    assert torch.allclose(ratios[0], torch.ones_like(ratios[0]), atol=1e-5)
    assert all((r - 1).abs().max() > 1e-3 for r in ratios[1:])


# ---- truncation masking with tool results ----------------------------------------------------------


def test_masked_truncations_keep_tool_results_out_of_the_loss(tokenizer, tiny_model, tmp_path, monkeypatch):
    """mask_truncated_completions builds the loss mask from model_mask (tool results are context), not from
    completion_mask: the loss gets exactly model_mask · ¬truncated (planted: the mask from completion_mask)."""
    trainer = trainer_for(tokenizer, tiny_model, tmp_path, mask_truncated_completions=True)
    batch, sampled, stats = trainer.sampler.sample()
    rollout = batch.rollout
    # Mark token 1 of each completion as an inserted tool result, and every third completion as truncated.
    rollout.tool_mask = torch.zeros_like(rollout.completion_mask)
    rollout.tool_mask[:, 1] = rollout.completion_mask[:, 1]
    rollout.truncated = torch.arange(len(rollout)) % 3 == 0
    kept = ~rollout.truncated
    assert rollout.tool_mask[kept].sum() > 0 and rollout.truncated.any()  # both kinds in the batch
    trainer.sampler.sample = lambda step=0: (batch, sampled, stats)
    calls = spy_on_loss(monkeypatch)
    trainer.training_step()
    expected = rollout.model_mask * kept.unsqueeze(1)
    assert torch.equal(torch.cat([c["mask"] for c in calls]), expected)


# ---- the direction of the update, judged without the trainer's code ----------------------------------


@pytest.mark.parametrize("check", ["gradient", "direction"])
def test_the_step_climbs_the_advantage_weighted_log_likelihood(tokenizer, tiny_model, tmp_path, monkeypatch, check):
    """At μ = 1, β = 0 the gradient applied is −∇J with J = 1/N Σ_i A_i · mean_t log π(o_it), A from the rewards
    by hand and log π by a plain forward; one AdamW step then raises J. Catches a sign error that the trainer's
    loss and its metrics would share (planted: the loss's sign, the advantages' sign)."""
    trainer = trainer_for(tokenizer, tiny_model, tmp_path, beta=0.0, max_grad_norm=0.0, learning_rate=1e-3)
    seen, steps = spy_on_step(monkeypatch, trainer), spy_on_optimizer(trainer.policy)
    before = copy.deepcopy(tiny_model)
    trainer.training_step()
    batch = seen["out"][0]
    rollout, advantages = batch.rollout, hand_advantages(batch.rewards, 4)
    assert advantages.abs().sum() > 0

    def objective(model):
        logp = plain_logprobs(model, rollout)
        return (advantages * logp.sum(dim=1) / rollout.completion_mask.sum(dim=1)).sum() / len(rollout)

    if check == "gradient":
        before.zero_grad()
        objective(before).backward()
        expected = -torch.cat([p.grad.flatten() for p in before.parameters()])
        torch.testing.assert_close(steps[0]["grad"], expected, atol=1e-6, rtol=1e-4)
    else:
        with torch.no_grad():
            assert objective(trainer.model.eval()) > objective(before.eval()) + 1e-5


# ---- options that reach the passes, the sampler and the optimizer -------------------------------------


def test_sampling_settings_reach_generate(tokenizer, tiny_model, tmp_path, monkeypatch):
    """The sampler generates from the policy with the run's temperature, top_p, G, max_completion_length, fast_path,
    its own seeded generator and the prompts after system_prompt (planted: a setting dropped from the call)."""
    calls, real = [], grpokit_engines.generate
    monkeypatch.setattr(grpokit_engines, "generate", lambda *a, **kw: calls.append((a, kw)) or real(*a, **kw))
    trainer = trainer_for(tokenizer, tiny_model, tmp_path, temperature=0.7, top_p=0.9, num_generations=3,
                          max_completion_length=5, fast_path=False, system_prompt="Be brief.")
    trainer.training_step()
    ((model, prompt_ids, prompt_mask), kw), = calls
    settings = ("temperature", "top_p", "num_generations", "max_new_tokens", "fast")
    assert tuple(kw.get(key) for key in settings) == (0.7, 0.9, 3, 5, False)
    assert kw["generator"] is trainer.sampler.generator and model is trainer.model
    assert tokenizer.decode(prompt_ids[0][prompt_mask[0].bool()]).startswith("Be brief.\nCount ")


def test_every_logprob_pass_gets_the_runs_settings(tokenizer, tiny_model, tmp_path, monkeypatch):
    """π_ref, π_old and the policy's training passes all compute log π at the sampling temperature with the
    run's logprob_chunk_mb and fast_path (planted: the policy pass built without chunk_mb; a frozen pass
    without the temperature)."""
    calls = []

    def recorded(model, *args, **kwargs):
        calls.append((torch.is_grad_enabled(), model, kwargs.get("temperature", 1.0), kwargs.get("chunk_mb"),
                      kwargs.get("fast", True)))
        return sequence_logprobs(model, *args, **kwargs)

    monkeypatch.setattr(grpokit_trainer, "sequence_logprobs", recorded)  # the frozen passes
    monkeypatch.setattr(grpokit_logprobs, "sequence_logprobs", recorded)  # the policy's (PolicyLogprobs)
    trainer = trainer_for(tokenizer, tiny_model, tmp_path, temperature=0.7, logprob_chunk_mb=0.5, fast_path=False,
                          num_iterations=2, beta=0.1)
    trainer.training_step()
    kinds = {(grad, "ref" if model is trainer.reference.model else "policy") for grad, model, *_ in calls}
    assert kinds == {(False, "ref"), (False, "policy"), (True, "policy")}  # π_ref, π_old, the training passes
    assert {tuple(c[2:]) for c in calls} == {(0.7, 0.5, False)}


def test_max_grad_norm_clips_the_applied_gradient(tokenizer, tiny_model, tmp_path, monkeypatch):
    """The gradient the optimizer applies has norm max_grad_norm when the raw one is larger; the logged grad_norm
    is the raw one (planted: max_grad_norm not passed to the update)."""
    trainer = trainer_for(tokenizer, tiny_model, tmp_path, max_grad_norm=0.01)
    steps = spy_on_optimizer(trainer.policy)
    metrics = trainer.training_step()
    assert metrics["grad_norm"] > 0.02
    assert steps[0]["grad"].norm().item() == pytest.approx(0.01, rel=1e-4)


def test_the_schedule_counts_every_optimizer_update(tokenizer, tiny_model, tmp_path, monkeypatch):
    """Warmup and decay run over max_steps × num_iterations × num_minibatches optimizer updates: linear, warmup 2,
    4 updates → lr × [1/2, 1, 1, 1/2] (planted: a schedule over max_steps; warmup_steps not passed)."""
    trainer = trainer_for(tokenizer, tiny_model, tmp_path, max_steps=2, num_minibatches=2, lr_schedule="linear",
                          warmup_steps=2, learning_rate=1e-2)
    steps = spy_on_optimizer(trainer.policy)
    for _ in range(2):
        trainer.training_step()
    assert [s["lr"] for s in steps] == pytest.approx([5e-3, 1e-2, 1e-2, 5e-3])


def test_optimizer_settings_reach_adamw(tokenizer, tiny_model, tmp_path):
    """learning_rate, adam_beta1/2 and weight_decay reach the policy's AdamW (planted: one of them dropped)."""
    trainer = trainer_for(tokenizer, tiny_model, tmp_path, learning_rate=3e-3, adam_beta1=0.8, adam_beta2=0.95,
                          weight_decay=0.05)
    (group,) = trainer.policy.optimizer.param_groups
    assert (group["initial_lr"], group["betas"], group["weight_decay"]) == (3e-3, (0.8, 0.95), 0.05)
    assert len(group["params"]) == len(list(tiny_model.parameters()))


def test_reward_weights_weigh_the_training_reward(tokenizer, tiny_model, tmp_path):
    """The batch's reward, from which advantages come, is Σ_k w_k · r_k with the configured reward_weights
    (planted: the weights not passed on, so each weighs 1)."""
    trainer = trainer_for(tokenizer, tiny_model, tmp_path, rewards=(spread, length), reward_weights=[2.0, -0.5])
    batch = trainer.sampler.generate_and_score([0, 1])
    scores = batch.per_function
    torch.testing.assert_close(batch.rewards, 2.0 * scores["spread"] - 0.5 * scores["length"])


def test_process_supervision_reaches_the_per_token_advantages(tokenizer, tiny_model, tmp_path, monkeypatch):
    """With supervision: process the update's advantages are process_advantages of each completion's steps, with
    the run's scale_rewards, varying along a completion (planted: the outcome path's one advantage per completion;
    scale_rewards not passed on)."""
    trainer = trainer_for(tokenizer, tiny_model, tmp_path, rewards=(char_steps,), supervision="process",
                          scale_rewards="batch")
    seen = spy_on_step(monkeypatch, trainer)
    trainer.training_step()
    batch, fixed = seen["out"][0], seen["fixed"]
    assert all(len(steps) > 1 for steps in batch.steps)  # a step per character, not one per completion
    expected = process_advantages([[r for _, r in steps] for steps in batch.steps],
                                  [[end for end, _ in steps] for steps in batch.steps],
                                  batch.rollout.completion_mask, 4, scale="batch")
    torch.testing.assert_close(fixed.advantages, expected)
    assert (expected.diff(dim=1).abs() > 1e-3).any()


@pytest.mark.parametrize("supervision, scorer", [("outcome", "score_completions"), ("process", "score_steps")])
def test_reward_error_settings_reach_the_scoring(tokenizer, tiny_model, tmp_path, monkeypatch, supervision, scorer):
    """reward_timeout and on_reward_error reach the function that calls the rewards, under either supervision
    (planted: either setting dropped from the call)."""
    calls, real = [], getattr(grpokit_sampling, scorer)
    monkeypatch.setattr(grpokit_sampling, scorer, lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    reward = char_steps if supervision == "process" else spread
    trainer = trainer_for(tokenizer, tiny_model, tmp_path, rewards=(reward,), supervision=supervision,
                          reward_timeout=2.5, on_reward_error="skip")
    trainer.sampler.generate_and_score([0, 1])
    assert [(kw.get("timeout"), kw.get("on_error")) for kw in calls] == [(2.5, "skip")]


def test_tool_settings_reach_the_toolbox(tmp_path):
    """tools, max_tool_calls and tool_timeout reach the ToolBox the sampler calls tools through (planted: a
    setting dropped from build_toolbox's call)."""
    tok = build_tokenizer(tool_tags=True)
    trainer = trainer_for(tok, build_model(tok, TINY, seed=0), tmp_path, tools=["calculator"], max_tool_calls=2,
                          tool_timeout=0.5)
    box = trainer.sampler.toolbox
    assert (sorted(box.tools), box.max_calls, box.timeout) == (["calculator"], 2, 0.5)


# ---- resume --------------------------------------------------------------------------------------


def test_a_resumed_run_with_minibatches_is_bit_exact(tokenizer, tmp_path):
    """The minibatch-shuffle generator is restored on resume: with num_minibatches = 2 and num_iterations = 2, a
    run saved after step 1 and resumed ends bit-identical to a straight one (planted: ``shuffle.set_state``
    dropped from load_state_dict)."""
    options = dict(num_minibatches=2, num_iterations=2, max_steps=3)

    def fresh(name):
        return trainer_for(tokenizer, build_model(tokenizer, TINY, seed=0), tmp_path / name, **options)

    straight = fresh("straight")
    for _ in range(3):
        straight.training_step()
    first = fresh("resumed")
    first.training_step()
    first.save_checkpoint()
    resumed = fresh("resumed")
    resumed.resume()
    for _ in range(2):
        resumed.training_step()
    assert untimed(resumed.history) == untimed(straight.history)
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


# ---- iterative RL ----------------------------------------------------------------------------------


class Sampled(Exception):
    """Raised by the spy once the reward model's data are being sampled: nothing after matters here."""


def test_iterative_rl_samples_the_reward_models_data_as_the_run_samples(tokenizer, tmp_path, monkeypatch):
    """At an iteration's end the reward model's new rows are sampled from the policy as training samples: at the
    run's temperature and top_p, G completions of max_completion_length, fast_path, after system_prompt
    (planted: ``temperature=1.0`` in IterativeRL's sampling)."""
    # A randomly initialised outcome reward model (a sequence classifier with one label) over the same tokenizer.
    classifier = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, num_labels=1,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForSequenceClassification(classifier).save_pretrained(tmp_path / "orm")
    tokenizer.save_pretrained(tmp_path / "orm")

    calls, real = [], grpokit_engines.generate

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        if len(calls) == 2:  # the first is the step's own sampling; the second, the reward model's new rows
            raise Sampled
        return real(*args, **kwargs)

    monkeypatch.setattr(grpokit_engines, "generate", spy)
    trainer = trainer_for(tokenizer, build_model(tokenizer, TINY, seed=0), tmp_path, rewards=[f"model:{tmp_path}/orm"],
                          rl_iterations=2, max_steps=2, reward_model_labels=["accuracy"], reward_model_prompts=2,
                          temperature=0.7, top_p=0.9, num_generations=3, max_completion_length=5, fast_path=False,
                          system_prompt="Be brief.")
    with pytest.raises(Sampled):
        trainer.training_step()  # step 1 ends iteration 1 of 2
    _, ((model, prompt_ids, prompt_mask), kw) = calls
    settings = ("temperature", "top_p", "num_generations", "max_new_tokens", "fast")
    assert tuple(kw.get(key) for key in settings) == (0.7, 0.9, 3, 5, False)
    assert model is trainer.model and len(prompt_ids) == 2
    assert tokenizer.decode(prompt_ids[0][prompt_mask[0].bool()]).startswith("Be brief.\nCount ")
