"""The vLLM engine's weight-sync check, against a stand-in engine whose log-probs of the probe are the policy's
plus a chosen deviation: the check measures the largest deviation of either sign at any position of the probe,
allows exactly vllm_sync_check plus twice the engine's rounding, refuses NaN, reads each position's log-prob of the
probe's own next token, and runs after a push of every weight (whole, or gathered from FSDP2's shards one at a
time) only when vllm_sync_check is above 0. (The real engine's check is test_vllm_engine.py's; the engine's
construction, test_vllm_wiring.py's.)"""

from types import SimpleNamespace

import pytest
import torch

from grpokit.rollout.sampling_options import SamplingOptions
from grpokit.rollout.vllm_engine import VLLMEngine, WeightSyncError, gathered_weights, hf_weights, policy_logprobs
from grpokit.tasks.tiny_model import build_model, build_tokenizer
from helpers import TINY

PROBE = [3, 7, 7, 1, 12, 5, 9, 2]


class StandIn:
    """vLLM's LLM as the check uses it: prompt log-probs of the policy (computed by hand here) plus ``deviation``
    per position, each position also listing other tokens with other log-probs, as vLLM's top-k entries do."""

    def __init__(self, policy):
        self.policy, self.deviation, self.pushed, self.calls = policy, None, [], []

    def generate(self, requests, params, use_tqdm=True):
        (request,) = requests
        ids = request.prompt_token_ids
        with torch.no_grad():
            logp = self.policy(input_ids=torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
        deviation = self.deviation if self.deviation is not None else [0.0] * (len(ids) - 1)
        entries = [None]
        for i, token in enumerate(ids[1:]):
            other = (token + 1) % logp.shape[-1]
            entries.append({other: SimpleNamespace(logprob=-99.0), token: SimpleNamespace(
                logprob=float(logp[i, token]) + deviation[i])})
        return [SimpleNamespace(prompt_logprobs=entries)]

    def collective_rpc(self, method, kwargs):
        self.calls.append(method)
        self.pushed.append(dict(kwargs["weights_iterator"]))

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def wake_up(self):
        self.calls.append("wake_up")


def engine_for(sync_check=1e-3, floor=0.0):
    """A VLLMEngine holding the stand-in, made as its __init__ leaves it (without vLLM)."""
    tokenizer = build_tokenizer()
    policy = build_model(tokenizer, TINY, seed=0).eval()
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.options, engine.policy, engine.probe = SamplingOptions(engine="vllm", vllm_sync_check=sync_check), policy, \
        list(PROBE)
    engine.llm, engine.sleeping, engine.last_check, engine.floor = StandIn(policy), False, None, floor
    engine.sharded = False  # a whole policy (FSDP2's sharded push: tests/rollout/test_vllm_engine.py)
    engine._vllm = SimpleNamespace(SamplingParams=lambda **settings: SimpleNamespace(**settings),
                                   inputs=SimpleNamespace(TokensPrompt=lambda prompt_token_ids: SimpleNamespace(
                                       prompt_token_ids=prompt_token_ids)))
    return engine


def by_hand(policy, ids):
    with torch.no_grad():
        logp = policy(input_ids=torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    return [float(logp[i, token]) for i, token in enumerate(ids[1:])]


def test_the_engines_log_probs_are_of_each_next_token_of_the_probe():
    engine = engine_for()
    engine.llm.deviation = [0.5 * i for i in range(len(PROBE) - 1)]
    expected = [lp + 0.5 * i for i, lp in enumerate(by_hand(engine.policy, PROBE))]
    assert engine.prompt_logprobs(PROBE) == pytest.approx(expected, abs=1e-6)
    assert len(engine.prompt_logprobs(PROBE)) == len(PROBE) - 1


def test_the_policys_log_probs_by_hand_in_eval_mode_and_its_mode_kept():
    engine = engine_for()
    seen = []
    engine.policy.register_forward_pre_hook(lambda module, args: seen.append(module.training))
    engine.policy.train()
    got = policy_logprobs(engine.policy, PROBE)
    assert seen == [False] and engine.policy.training  # eval for the probe (no dropout), then back to training
    assert got.dtype == torch.float32 and got.shape == (len(PROBE) - 1,)
    engine.policy.eval()
    assert got.tolist() == pytest.approx(by_hand(engine.policy, PROBE), abs=1e-6)
    policy_logprobs(engine.policy, PROBE)
    assert not engine.policy.training


@pytest.mark.parametrize("position", [0, 3, len(PROBE) - 2])
@pytest.mark.parametrize("sign", [1, -1])
def test_the_difference_is_the_largest_deviation_of_either_sign_at_any_position(position, sign):
    engine = engine_for()
    deviation = [0.0] * (len(PROBE) - 1)
    deviation[position] = sign * 0.25
    deviation[(position + 1) % len(deviation)] = -sign * 0.125  # a smaller one of the other sign elsewhere
    engine.llm.deviation = deviation
    assert engine.difference() == pytest.approx(0.25, abs=1e-5)


def test_an_engine_computing_what_the_policy_does_differs_by_nothing():
    assert engine_for().difference() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("sync_check, floor", [(1e-2, 0.0), (0.0, 5e-3), (4e-3, 3e-3)])
def test_the_check_allows_exactly_the_tolerance_and_no_more_of_either_sign(sign, sync_check, floor):
    tolerance = sync_check + 2 * floor  # 0.01 in each case
    engine = engine_for(sync_check, floor)
    engine.llm.deviation = [0.0] * (len(PROBE) - 1)
    engine.llm.deviation[2] = sign * tolerance * 0.9
    assert engine.check(step=5) == engine.last_check == pytest.approx(tolerance * 0.9, abs=1e-5)
    engine.llm.deviation[2] = sign * tolerance * 1.1
    with pytest.raises(WeightSyncError, match="^step 6: after the weight push the vLLM engine's log-probs of the "
                                              "probe sequence differ from the policy's by up to 0.011 "):
        engine.check(step=6)
    assert engine.last_check == pytest.approx(tolerance * 1.1, abs=1e-5)


def test_the_bound_itself_passes():
    engine = engine_for(0.0, 0.0)
    engine.difference = lambda: 0.0
    assert engine.check(step=1) == 0.0
    engine = engine_for(0.25, 0.125)
    engine.difference = lambda: 0.5  # exactly 0.25 + 2 × 0.125 (all exact in binary)
    assert engine.check(step=1) == 0.5
    engine.difference = lambda: 0.5000001
    with pytest.raises(WeightSyncError, match=r"\(allowed: vllm_sync_check 0.25 \+ twice the engine's rounding, "
                                              r"0.12\): the engine holds stale or corrupt weights$"):
        engine.check(step=1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_nan_or_infinite_log_prob_fails_the_check(bad):
    engine = engine_for(sync_check=1e9)
    engine.llm.deviation = [0.0] * (len(PROBE) - 1)
    engine.llm.deviation[-1] = bad
    with pytest.raises(WeightSyncError, match="^step 2: "):
        engine.check(step=2)


def test_a_push_sends_every_weight_then_clears_the_cache_then_checks():
    engine = engine_for()
    engine.sleeping = True
    engine.update_weights(step=3)
    assert engine.llm.calls == ["wake_up", "reload_weights", "reset_prefix_cache"] and not engine.sleeping
    (pushed,) = engine.llm.pushed
    state = engine.policy.state_dict()
    assert pushed.keys() == state.keys() and all(torch.equal(pushed[k], state[k]) for k in state)
    assert engine.last_check == pytest.approx(0.0, abs=1e-6)
    engine.llm.deviation = [0.0] * (len(PROBE) - 2) + [-1.0]  # the engine did not take the push
    with pytest.raises(WeightSyncError, match="^step 4: "):
        engine.update_weights(step=4)


@pytest.mark.parametrize("sync_check, checked", [(0.0, False), (1e-9, True)])
def test_zero_turns_the_check_off_and_any_positive_tolerance_keeps_it(sync_check, checked):
    engine = engine_for(sync_check)
    engine.llm.deviation = [0.0] * (len(PROBE) - 1)
    engine.llm.deviation[0] = -1.0
    if checked:
        with pytest.raises(WeightSyncError):
            engine.update_weights(step=1)
    else:
        engine.update_weights(step=1)
        assert engine.last_check is None
    assert engine.llm.calls[:2] == ["reload_weights", "reset_prefix_cache"]


def test_the_weights_pushed_are_every_tensor_of_the_policy_detached():
    policy = build_model(build_tokenizer(), TINY, seed=0)
    weights = hf_weights(policy)
    state = policy.state_dict(keep_vars=True)
    assert weights.keys() == state.keys() and len(weights) > 4
    assert all(torch.equal(weights[k], state[k]) and not weights[k].requires_grad for k in state)


class Shard:
    """What FSDP2's state dict holds for a sharded parameter (a DTensor) as ``gathered_weights`` uses it: detached,
    then gathered whole by ``full_tensor``, which is a collective: the log says when each happens."""

    def __init__(self, name, whole, log):
        self.name, self.whole, self.log = name, whole, log

    def detach(self):
        self.log.append(f"detach {self.name}")
        return self

    def full_tensor(self):
        self.log.append(f"gather {self.name}")
        return self.whole


def sharded_policy(log):
    """A policy's state dict as FSDP2 leaves it: two sharded weights (the output one tied to the embedding: the
    same object under two names, here before the others) and a plain buffer."""
    embed, norm = Shard("embed", torch.ones(2), log), Shard("norm", torch.zeros(3), log)
    buffer = torch.arange(3.0, requires_grad=True)
    return SimpleNamespace(state_dict=lambda: {"embed.weight": embed, "lm_head.weight": embed, "norm.weight": norm,
                                               "buffer": buffer})


def test_a_sharded_policys_weights_are_gathered_one_at_a_time_as_consumed_and_a_tied_one_sent_once():
    log = []
    weights = gathered_weights(sharded_policy(log))
    assert log == []  # nothing gathered before the consumer asks
    name, tensor = next(weights)
    assert (name, log) == ("embed.weight", ["detach embed", "gather embed"]) and torch.equal(tensor, torch.ones(2))
    rest = list(weights)
    assert [name for name, _ in rest] == ["norm.weight", "buffer"]  # lm_head.weight: vLLM ties it again
    assert log == ["detach embed", "gather embed", "detach norm", "gather norm"]
    assert torch.equal(rest[1][1], torch.arange(3.0)) and not rest[1][1].requires_grad  # a plain tensor, detached


def test_a_whole_lora_policy_is_pushed_merged():
    peft = pytest.importorskip("peft")
    engine = engine_for(sync_check=0.0)
    engine.policy = peft.get_peft_model(engine.policy, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    engine.update_weights(step=1)
    (pushed,) = engine.llm.pushed
    assert pushed.keys() == hf_weights(engine.policy).keys() and not any("lora_" in name for name in pushed)


def test_a_sharded_policy_is_pushed_gathered_and_a_whole_one_from_its_own_weights():
    engine, log = engine_for(sync_check=0.0), []
    whole = engine.policy.state_dict()
    engine.update_weights(step=1)
    assert engine.llm.pushed[-1].keys() == whole.keys()
    engine.sharded, engine.policy = True, sharded_policy(log)
    engine.update_weights(step=2)
    assert list(engine.llm.pushed[-1]) == ["embed.weight", "norm.weight", "buffer"] and "gather norm" in log
    assert engine.llm.calls == ["reload_weights", "reset_prefix_cache"] * 2


def test_the_probe_is_the_documented_32_tokens():
    from grpokit.rollout.vllm_engine import PROBE_TOKENS

    assert PROBE_TOKENS == 32  # docs/sampling.md: "a fixed 32-token probe"


def test_a_push_without_a_step_is_named_step_0():
    engine = engine_for()
    engine.llm.deviation = [0.5] * (len(PROBE) - 1)
    with pytest.raises(WeightSyncError, match="^step 0: "):
        engine.update_weights()


def test_a_bfloat16_lora_policys_weights_are_pushed_in_bfloat16():
    peft = pytest.importorskip("peft")
    policy = build_model(build_tokenizer(), TINY, seed=0).to(torch.bfloat16)
    model = peft.get_peft_model(policy, peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    weights = hf_weights(model)
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    assert not any("lora_" in name or "base_layer" in name for name in weights)
