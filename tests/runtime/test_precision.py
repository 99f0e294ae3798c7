"""``mixed_precision: auto``: bfloat16 only where the hardware computes it natively, decided once by
``models.resolve_precision`` and used by every pass; explicit values win; the saved config keeps 'auto'."""

import pytest
import torch
import yaml

import grpokit.algorithms.grpo
import grpokit.rollout.engines
import grpokit.runtime.device
from grpokit.config import ConfigError, GRPOConfig
from grpokit.runtime.device import cpu_flags, cpu_model, describe_precision, native_bf16, resolve_precision
from helpers import make_trainer

CPU, CUDA = torch.device("cpu"), torch.device("cuda")

# This project's reference machine (AMD EPYC Zen 3): AVX2, no AVX-512, no native bfloat16. Abridged.
ZEN3 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse sse2 avx f16c fma avx2 bmi2 sha_ni vaes\n"
SAPPHIRE_RAPIDS = "flags\t\t: fpu avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8\n"
COOPER_LAKE = "flags\t\t: fpu avx2 avx512f avx512_bf16\n"
AMX_ONLY = "flags\t\t: fpu avx2 amx_tile amx_bf16\n"
GRAVITON3 = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd sve sve2 i8mm bf16 svebf16\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics\n"


@pytest.fixture
def cpuinfo(tmp_path):
    def write(text: str):
        path = tmp_path / "cpuinfo"
        path.write_text(text)
        return path
    return write


def test_cpu_flags_read_x86_and_arm_lines(cpuinfo, tmp_path):
    assert cpu_flags(cpuinfo(ZEN3)) == {"fpu", "sse", "sse2", "avx", "f16c", "fma", "avx2", "bmi2", "sha_ni", "vaes"}
    assert "bf16" in cpu_flags(cpuinfo(GRAVITON3))
    assert cpu_flags(cpuinfo("processor\t: 0\n")) == set()  # no flags line
    assert cpu_flags(tmp_path / "missing") == set()  # macOS, Windows: no /proc/cpuinfo


def test_cpu_model_names_the_cpu_and_its_bfloat16_flags(cpuinfo, tmp_path):
    sapphire = "model name\t: Intel Xeon\ncpu family\t: 6\nmodel\t\t: 143\n" + SAPPHIRE_RAPIDS
    assert cpu_model(cpuinfo(sapphire)) == {"model": "Intel Xeon", "family": "6", "model_number": "143",
                                            "bf16_flags": ["amx_bf16", "avx512_bf16"]}
    assert cpu_model(cpuinfo(ZEN3))["bf16_flags"] == []
    assert cpu_model(tmp_path / "missing")["bf16_flags"] is None  # no /proc/cpuinfo: the flags are unknown


@pytest.mark.parametrize("text, native", [
    (ZEN3, None), (GRAVITON2, None),
    (SAPPHIRE_RAPIDS, "avx512_bf16"), (COOPER_LAKE, "avx512_bf16"), (AMX_ONLY, "amx_bf16"), (GRAVITON3, "bf16"),
])
def test_auto_is_bf16_exactly_on_cpus_with_native_bfloat16(cpuinfo, text, native):
    path = cpuinfo(text)
    assert native_bf16(CPU, path) == native
    assert resolve_precision("auto", CPU, path) == ("bf16" if native else "no")


def test_auto_on_this_projects_cpu_is_float32(cpuinfo):
    # AVX2 without avx512_bf16/amx_bf16: bfloat16 would be emulated, slower than float32 (docs/benchmarks.md)
    assert resolve_precision("auto", CPU, cpuinfo(ZEN3)) == "no"
    assert "no native bfloat16 on this cpu" in describe_precision("auto", CPU, cpuinfo(ZEN3))


@pytest.mark.parametrize("capability, expected", [((7, 5), "no"), ((8, 0), "bf16"), ((9, 0), "bf16")])
def test_auto_on_cuda_follows_compute_capability(monkeypatch, capability, expected):
    seen = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: seen.append(device) or capability)
    assert resolve_precision("auto", CUDA) == expected
    assert seen == [CUDA]
    assert ("CUDA compute capability" in describe_precision("auto", CUDA)) == (expected == "bf16")


def test_other_devices_are_float32():
    assert resolve_precision("auto", torch.device("mps")) == "no"


@pytest.mark.parametrize("text", [ZEN3, SAPPHIRE_RAPIDS])
def test_explicit_values_win(cpuinfo, text):
    path = cpuinfo(text)
    assert resolve_precision("no", CPU, path) == "no"
    assert resolve_precision("bf16", CPU, path) == "bf16"


def test_explicit_bf16_without_native_support_says_it_is_emulated(cpuinfo):
    assert "emulated" in describe_precision("bf16", CPU, cpuinfo(ZEN3))
    assert "emulated" not in describe_precision("bf16", CPU, cpuinfo(SAPPHIRE_RAPIDS))


def test_bad_values_are_refused():
    with pytest.raises(ConfigError, match="mixed_precision='fp16'"):
        GRPOConfig(mixed_precision="fp16")
    with pytest.raises(ValueError, match="mixed_precision"):
        resolve_precision("fp16", CPU)
    with pytest.raises(ValueError, match="resolve_precision"):
        grpokit.runtime.device.autocast("auto", CPU)  # an unresolved 'auto' never reaches a pass


def test_auto_is_the_default():
    assert GRPOConfig().mixed_precision == "auto"


@pytest.mark.parametrize("flags, expected", [(set(), "no"), ({"amx_bf16"}, "bf16")])
def test_the_trainer_runs_every_pass_at_the_resolved_precision(monkeypatch, tokenizer, tiny_model, tmp_path,
                                                               flags, expected, capsys):
    """'auto' resolves once, from the CPU's flags; sampling, the frozen passes and the update all receive
    the resolved value; config.yaml and the checkpoint keep 'auto', with the decision noted atop config.yaml."""
    monkeypatch.setattr(grpokit.runtime.device, "cpu_flags", lambda cpuinfo="/proc/cpuinfo": flags)
    used = []
    real = grpokit.runtime.device.autocast

    def spy(mixed_precision, device, **kwargs):
        used.append(mixed_precision)
        return real(mixed_precision, device, **kwargs)

    monkeypatch.setattr(grpokit.algorithms.grpo, "autocast", spy)
    monkeypatch.setattr(grpokit.rollout.engines, "autocast", spy)
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, mixed_precision="auto", max_steps=1,
                           num_iterations=2, device="cpu")  # μ = 2: the π_old pass runs too
    assert trainer.mixed_precision == expected
    assert f"mixed_precision: auto -> {expected}" in capsys.readouterr().err
    trainer.train()
    assert len(used) >= 4 and set(used) == {expected}  # sampling, π_ref, π_old, the update's passes
    written = (tmp_path / "run" / "config.yaml").read_text()
    assert written.startswith(f"# mixed_precision: auto -> {expected}")
    assert yaml.safe_load(written)["mixed_precision"] == "auto"
    assert trainer.state_dict()["config"]["mixed_precision"] == "auto"


def test_only_sampling_keeps_autocasts_weight_copies(tokenizer, tiny_model, tmp_path):
    """Decoding reads every weight once per token, so sampling keeps autocast's bfloat16 copies for its
    whole context; the training and frozen passes read each once, and keeping them would hold a second
    (bfloat16) model until the pass ends, with activation checkpointing too."""
    seen = set()
    tiny_model.model.embed_tokens.register_forward_pre_hook(
        lambda *_: seen.add((torch.is_grad_enabled(), torch.is_autocast_cache_enabled())))
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, mixed_precision="bf16", max_steps=1,
                           num_iterations=2, gradient_checkpointing=True)  # μ = 2: the π_old pass runs too
    trainer.train()
    # the update (with gradient, cache off), π_ref and π_old (cache off), sampling (cache on)
    assert seen == {(True, False), (False, False), (False, True)}


def test_an_explicit_setting_reaches_the_passes_whatever_the_cpu(monkeypatch, tokenizer, tiny_model, tmp_path):
    monkeypatch.setattr(grpokit.runtime.device, "cpu_flags", lambda cpuinfo="/proc/cpuinfo": {"amx_bf16"})
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, mixed_precision="no", max_steps=1,
                           device="cpu")
    assert trainer.mixed_precision == "no" and trainer.engine.options.mixed_precision == "no"


@pytest.mark.parametrize("name", ["llama", "qwen2-gqa-bias"])
def test_a_bf16_run_stores_the_references_linear_layers_in_bf16_and_computes_the_same(name):
    """Under bf16 autocast a linear layer computes with its weight cast to bfloat16: stored so, the reference
    gives the very same log-probs, on the fast path and through the model's own forward."""
    from grpokit.models.logprobs import sequence_logprobs
    from grpokit.models.reference import build_reference
    from grpokit.tasks.tiny_model import build_tokenizer
    from helpers import models

    policy = models(build_tokenizer())[name].eval()
    stored = build_reference(policy, 0.04, "bf16").model
    linear = [m for m in stored.modules() if type(m) is torch.nn.Linear and m is not stored.get_output_embeddings()]
    assert linear and all(m.weight.dtype == torch.bfloat16 for m in linear)
    assert stored.get_output_embeddings().weight.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in build_reference(policy, 0.04, "no").model.parameters())
    prompts, completions = torch.randint(3, 60, (3, 5)), torch.randint(3, 60, (3, 7))
    batch = (prompts, torch.ones_like(prompts), completions, torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] + [0] * 6]))
    for fast in (True, False):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(sequence_logprobs(policy, *batch, fast=fast)[0],
                               sequence_logprobs(stored, *batch, fast=fast)[0]), fast


def test_a_bf16_runs_kl_is_zero_at_its_first_step(tokenizer, tiny_model, tmp_path):
    """The reference stored in bfloat16 computes what the (float32) policy computes under autocast: no KL
    before the policy has moved."""
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, max_steps=1, mixed_precision="bf16", beta=0.04)
    assert any(p.dtype == torch.bfloat16 for p in trainer.reference.model.parameters())
    assert trainer.train()[0]["kl"] == 0.0
