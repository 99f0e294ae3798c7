"""What the vLLM engine hands vLLM, and how it reads vLLM's answers back, against a stand-in for the part of vLLM's
API it uses (the default suite has no vLLM): the checkpoint it writes (loaded by transformers, as vLLM's loader
would, it computes what the policy does), the engine's settings, the requests and their seeds, and the Rollout it
assembles. That the real vLLM does what these hand it is test_vllm_engine.py's (marker ``vllm``)."""

import sys
import types
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, BloomConfig, BloomForCausalLM

import grpokit.rollout.vllm_engine as vllm_engine
from grpokit.rollout.engines import SamplingOptions
from grpokit.rollout.vllm_engine import PROBE_TOKENS, VLLMEngine, WeightSyncError, free_memory
from grpokit.tasks.tiny_model import build_model, build_tokenizer
from helpers import TINY


class FakeLLM:
    """vLLM's ``LLM`` as the engine uses it: the checkpoint loaded from ``model`` (by transformers), prompt log-probs
    computed from it, weights reloaded into it; sampling answers the completions queued in ``answers``."""

    def __init__(self, **settings):
        self.settings = settings
        self.files = load_file(f"{settings['model']}/model.safetensors")
        self.model = AutoModelForCausalLM.from_pretrained(settings["model"], torch_dtype=torch.float32).eval()
        self.answers: list[list[tuple[list[int], list[float]]]] = []  # per sampling call: each completion
        self.calls: list[tuple[list, list]] = []

    def generate(self, requests, params, use_tqdm=True):
        assert use_tqdm is False  # vLLM's own bar would break the run's
        if not isinstance(params, list):  # prompt log-probs of one prompt (the weight check)
            (request,) = requests
            self.probe_params = params
            ids = request.prompt_token_ids
            with torch.no_grad():
                logp = self.model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
            entries = [None] + [{token: SimpleNamespace(logprob=float(logp[i, token]))} for i, token in
                                enumerate(ids[1:])]
            return [SimpleNamespace(prompt_logprobs=entries)]
        self.calls.append((requests, params))
        answer, outputs = self.answers.pop(0), []
        for param in params:
            completions = []
            for _ in range(param.n):
                ids, logps = answer.pop(0)
                completions.append(SimpleNamespace(
                    token_ids=ids, logprobs=[{token: SimpleNamespace(logprob=lp)} for token, lp in zip(ids, logps)]))
            outputs.append(SimpleNamespace(outputs=completions))
        return outputs

    def collective_rpc(self, method, kwargs):
        assert method == "reload_weights" and kwargs["is_checkpoint_format"]
        self.model.load_state_dict(dict(kwargs["weights_iterator"]), strict=False)

    def reset_prefix_cache(self):
        pass


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM
    module.SamplingParams = lambda **settings: SimpleNamespace(**{"n": 1, **settings})
    module.inputs = SimpleNamespace(TokensPrompt=lambda prompt_token_ids: SimpleNamespace(
        prompt_token_ids=prompt_token_ids))
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.setattr(vllm_engine, "free_memory", lambda: 8_000_000_000)
    return module


@pytest.fixture
def policy():
    tokenizer = build_tokenizer()
    return build_model(tokenizer, TINY, seed=0), tokenizer


def test_the_engine_hands_vllm_the_policys_weights_and_its_settings(fake_vllm, policy):
    model, tokenizer = policy
    options = SamplingOptions(engine="vllm", rollout_precision="bf16", vllm_gpu_memory_utilization=0.25,
                              vllm_tensor_parallel_size=2)
    engine = VLLMEngine(model, tokenizer, options, rank=1, world_size=2, seed=5)
    settings = dict(engine.llm.settings)
    assert settings.pop("model") == engine._dir.name
    assert settings == {
        "dtype": "bfloat16", "seed": 6, "skip_tokenizer_init": True, "max_model_len": TINY.max_positions,
        "gpu_memory_utilization": 0.25, "kv_cache_memory_bytes": 2_000_000_000,  # on the CPU: a share of what's free
        "enable_sleep_mode": False, "tensor_parallel_size": 2, "logprobs_mode": "processed_logprobs",
        "distributed_executor_backend": "external_launcher", "load_format": "auto"}  # "dummy" under FSDP2
    # float32 weights as the checkpoint names them, the tied output layer left for vLLM to tie again
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert engine.llm.files.keys() == expected.keys()
    assert all(torch.equal(engine.llm.files[k], v) for k, v in expected.items())
    assert engine.floor == 0.0  # the checkpoint, loaded, computes the policy's log-probs exactly
    assert engine.device == torch.device("cpu")  # where the trainer's sampling generator for it lives
    probe = engine.llm.probe_params  # the probe's log-probs as the model gives them: at temperature 1
    assert (probe.max_tokens, probe.prompt_logprobs, probe.temperature, probe.detokenize) == (1, 0, 1.0, False)
    # vLLM's logging quieted and its engine kept in this process, unless the user said otherwise
    assert (vllm_engine.os.environ["VLLM_LOGGING_LEVEL"], vllm_engine.os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]) \
        == ("ERROR", "0")
    alone = VLLMEngine(model, tokenizer, SamplingOptions(engine="vllm"), seed=5)
    assert "distributed_executor_backend" not in alone.llm.settings
    assert (alone.llm.settings["seed"], alone.llm.settings["dtype"]) == (5, "float32")
    # the probe: fixed ids across the vocabulary, the same for every engine
    assert alone.probe == engine.probe and len(engine.probe) == PROBE_TOKENS and len(set(engine.probe)) > 8
    assert 0 <= min(engine.probe) and max(engine.probe) < len(tokenizer)


def test_a_users_vllm_logging_level_is_kept(fake_vllm, policy, monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    VLLMEngine(*policy, SamplingOptions(engine="vllm"))
    assert vllm_engine.os.environ["VLLM_LOGGING_LEVEL"] == "INFO"


def test_a_weight_push_reaches_the_engine_and_is_checked(fake_vllm, policy):
    model, tokenizer = policy
    engine = VLLMEngine(model, tokenizer, SamplingOptions(engine="vllm"))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01)
    assert engine.difference() > 1e-3  # the policy moved, the engine not yet
    engine.update_weights(step=1)
    assert engine.last_check == 0.0


def test_the_check_allows_twice_the_engines_rounding_and_zero_turns_it_off(fake_vllm, policy):
    model, tokenizer = policy
    engine = VLLMEngine(model, tokenizer, SamplingOptions(engine="vllm", vllm_sync_check=1e-6))
    off = VLLMEngine(model, tokenizer, SamplingOptions(engine="vllm", vllm_sync_check=0.0))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1e-3)
    moved = engine.difference()  # not pushed: the engine is that far from the policy
    engine.floor = moved / 1.5  # as if a bfloat16 engine rounded that much: 2 × floor covers the difference
    assert engine.check(step=3) == moved == engine.last_check
    engine.floor = moved / 2.5
    with pytest.raises(WeightSyncError, match="^step 4: after the weight push"):
        engine.check(step=4)
    off.update_weights(step=1)
    assert off.last_check is None and off.difference() == 0.0  # pushed, and no probe pass to check it


def test_a_model_that_states_no_length_leaves_it_to_vllm(fake_vllm, policy):
    _, tokenizer = policy
    config = BloomConfig(vocab_size=len(tokenizer), hidden_size=32, n_layer=1, n_head=2)  # ALiBi: no positions
    engine = VLLMEngine(BloomForCausalLM(config), tokenizer, SamplingOptions(engine="vllm"))
    assert engine.llm.settings["max_model_len"] is None and engine.floor == 0.0


def test_sampling_requests_and_the_rollout_read_back(fake_vllm, policy):
    model, tokenizer = policy
    engine = VLLMEngine(model, tokenizer, SamplingOptions(engine="vllm"))
    eos = tokenizer.eos_token_id
    prompt_ids = torch.tensor([[tokenizer.pad_token_id, 7, 8], [9, 10, 11]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    # two prompts × two completions: one stops at EOS, one fills its budget of 3, one is empty, one stops at once
    engine.llm.answers = [[([20, eos], [-0.5, -0.25]), ([21, 22, 23], [-1.0, -2.0, -3.0]), ([], []), ([eos], [-0.1])]]
    generator = torch.Generator().manual_seed(3)
    rollout = engine.generate(prompt_ids, prompt_mask, num_generations=2, max_new_tokens=3, temperature=0.7,
                              top_p=0.9, generator=generator)
    requests, params = engine.llm.calls[0]
    assert [r.prompt_token_ids for r in requests] == [[7, 8], [9, 10, 11]]  # the prompts without their padding
    seeds = torch.randint(0, 2**31 - 1, (4,), generator=torch.Generator().manual_seed(3)).tolist()
    assert [p.seed for p in params] == [seeds[0], seeds[2]]  # each request's n completions from its first seed
    assert all((p.n, p.max_tokens, p.temperature, p.top_p, p.logprobs, p.detokenize, p.stop_token_ids)
               == (2, 3, 0.7, 0.9, 0, False, engine.stop_ids) for p in params)
    pad = engine.pad_id
    assert pad == tokenizer.pad_token_id != eos
    assert torch.equal(rollout.completion_ids, torch.tensor([[20, eos, pad], [21, 22, 23], [pad] * 3,
                                                             [eos, pad, pad]]))
    assert torch.equal(rollout.completion_mask, torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0], [1, 0, 0]]))
    assert torch.equal(rollout.logp, torch.tensor([[-0.5, -0.25, 0], [-1, -2, -3], [0, 0, 0], [-0.1, 0, 0]]))
    assert rollout.truncated.tolist() == [False, True, True, False]
    assert torch.equal(rollout.prompt_ids, prompt_ids.repeat_interleave(2, 0)) and rollout.tool_mask is None
    assert torch.equal(rollout.prompt_mask, prompt_mask.repeat_interleave(2, 0))
    with pytest.raises(ValueError, match="^temperature must be > 0, got 0$"):
        engine.generate(prompt_ids, prompt_mask, num_generations=2, max_new_tokens=3, temperature=0)
    engine.llm.answers = [[([5], [-0.2])]]
    engine.generate(prompt_ids[:1], prompt_mask[:1], num_generations=1, max_new_tokens=3, greedy=True)
    assert engine.llm.calls[1][1][0].temperature == 0.0  # greedy: vLLM's temperature 0


def test_the_rollout_lies_on_the_prompts_device(fake_vllm, policy):
    engine = VLLMEngine(*policy, SamplingOptions(engine="vllm"))
    prompts = torch.ones(1, 2, dtype=torch.long, device="meta")  # meta: a device other than the CPU, as a GPU is
    rollout = engine._rollout(prompts, prompts, 2, [[5], [6, 7]], [[-1.0], [-1.0, -2.0]], [False, True], None)
    assert {t.device.type for t in vars(rollout).values() if t is not None} == {"meta"}


def test_without_a_pad_token_completions_are_padded_with_the_first_stop_id(fake_vllm, policy):
    model, tokenizer = policy
    tokenizer.pad_token = None
    engine = VLLMEngine(model, tokenizer, SamplingOptions(engine="vllm"))
    assert engine.pad_id == engine.stop_ids[0] == tokenizer.eos_token_id


def test_free_memory_is_what_linux_says_is_available(monkeypatch):
    meminfo = "MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    600 kB\nBuffers: 1 kB\n"

    def fake_open(path, *args, **kwargs):
        if path != "/proc/meminfo":
            raise FileNotFoundError(path)
        import io
        return io.StringIO(meminfo)

    monkeypatch.setattr(vllm_engine, "open", fake_open, raising=False)
    assert free_memory() == 600 * 1024  # available, not merely free: the page cache can be reclaimed
    meminfo = "MemTotal: 1000 kB\n"  # an old kernel's: no MemAvailable line
    pages = vllm_engine.os.sysconf("SC_AVPHYS_PAGES") * vllm_engine.os.sysconf("SC_PAGE_SIZE")
    assert abs(free_memory() - pages) < 0.05 * pages
