"""grpokit.trl.GRPOConfig against TRL 1.16's: the same keys and defaults, the same meaning once translated to
grpokit's config (batch arithmetic, loss, sampling), refusals that name the key, and the same loss from the same
inputs (TRL's own ``_compute_loss`` run on a stand-in trainer)."""

import collections
import dataclasses
import types

import pytest
import torch

from grpokit import GRPOConfig as GrpokitConfig
from grpokit.config import ConfigError
from grpokit.core.objective import grpo_loss
from grpokit.trl import GRPOConfig
from grpokit.trl.keys import INSTEAD, MAPPED, NO_EFFECT, key_kind
from grpokit.trl.settings import LOSS_TYPES

try:  # (tests/, on sys.path, holds a folder named trl: an installed TRL is the module with a GRPOConfig)
    import trl

    trl.GRPOConfig, trl.GRPOTrainer  # noqa: B018
except (ImportError, AttributeError):
    pytest.skip("TRL is not installed (pip install 'trl>=1.16,<1.17'): nothing to compare", allow_module_level=True)

CPU = dict(use_cpu=True)  # TRL's bf16 default needs use_cpu on a machine without a bf16 GPU; so does ours


def fields(cls) -> dict:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def default(f):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def test_trl_version_is_the_one_mirrored():
    assert trl.__version__.startswith("1.16.")


def test_every_trl_key_is_accepted_with_trl_default():
    ours, theirs = fields(GRPOConfig), fields(trl.GRPOConfig)
    assert set(ours) == set(theirs)
    differing = {name: (default(ours[name]), default(f)) for name, f in theirs.items()
                 if default(ours[name]) != default(f)}
    assert not differing


def test_every_key_has_a_kind_and_the_tables_name_real_keys():
    names = set(fields(trl.GRPOConfig))
    assert MAPPED <= names and set(NO_EFFECT) <= names and set(INSTEAD) <= names
    assert not MAPPED & set(NO_EFFECT)
    kinds = collections.Counter(key_kind(name) for name in names)
    assert kinds["mapped"] == len(MAPPED) and kinds["refused"] > 0


def _other_value(value):
    if isinstance(value, bool):
        return not value
    if value is None:
        return 1
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    return {"x": 1}


@pytest.mark.parametrize("name", sorted(n for n in fields(trl.GRPOConfig) if key_kind(n) == "refused"))
def test_a_refused_key_at_another_value_names_itself(name, tmp_path):
    value = _other_value(default(fields(GRPOConfig)[name]))
    with pytest.raises(ConfigError, match=name):
        GRPOConfig(output_dir=str(tmp_path), **CPU, **{name: value})
    GRPOConfig(output_dir=str(tmp_path), **CPU, **{name: default(fields(GRPOConfig)[name])})  # its default: fine


def test_an_unknown_keyword_names_the_closest_trl_key(tmp_path):
    with pytest.raises(ConfigError, match="'num_generation'.*did you mean 'num_generations'"):
        GRPOConfig(output_dir=str(tmp_path), num_generation=4)


SETTINGS = [
    dict(per_device_train_batch_size=8, num_generations=4),
    dict(per_device_train_batch_size=4, gradient_accumulation_steps=4, num_generations=8, loss_type="grpo",
         scale_rewards="batch", epsilon_high=0.28, temperature=0.7, top_p=0.9, max_completion_length=128),
    dict(per_device_train_batch_size=6, generation_batch_size=24, num_generations=6, loss_type="dr_grpo",
         scale_rewards=False, num_iterations=2, importance_sampling_level="sequence", mask_truncated_completions=True,
         max_steps=40),
    dict(per_device_train_batch_size=4, steps_per_generation=2, gradient_accumulation_steps=2, num_generations=4,
         beta=0.04, use_bias_correction_kl=False, scale_rewards=True, learning_rate=3e-6, lr_scheduler_type="cosine",
         warmup_steps=5, weight_decay=0.1, adam_beta2=0.99, max_grad_norm=0.5, seed=7, bf16=False,
         gradient_checkpointing=False, logging_steps=1, save_steps=10, report_to="none", max_steps=20),
]


@pytest.mark.parametrize("settings", SETTINGS)
def test_the_same_settings_mean_the_same_run(settings, tmp_path):
    theirs = trl.GRPOConfig(output_dir=str(tmp_path), **CPU, **settings)
    ours = GRPOConfig(output_dir=str(tmp_path), **CPU, **settings)
    for key in ("generation_batch_size", "steps_per_generation", "scale_rewards", "bf16", "gradient_checkpointing",
                "logging_steps", "report_to"):
        assert getattr(ours, key) == getattr(theirs, key), key
    config = ours.to_grpokit(num_rows=1000)
    assert isinstance(config, GrpokitConfig)
    # a step is one generation batch: its prompts, G completions each, in micro-batches of the per-device batch
    assert config.prompts_per_step * config.num_generations == theirs.generation_batch_size
    assert config.num_generations == theirs.num_generations
    assert config.micro_batch_size == theirs.per_device_train_batch_size
    # each generation batch makes num_iterations × steps_per_generation / gradient_accumulation_steps optimizer steps
    updates = config.num_iterations * config.num_minibatches
    assert updates == theirs.num_iterations * theirs.steps_per_generation // theirs.gradient_accumulation_steps
    if theirs.max_steps > 0:
        assert config.max_steps * updates == theirs.max_steps
    assert config.aggregation == LOSS_TYPES[theirs.loss_type]
    assert config.scale_rewards == theirs.scale_rewards
    assert config.ratio_level == theirs.importance_sampling_level
    for key in ("beta", "epsilon", "epsilon_high", "temperature", "top_p", "max_completion_length",
                "mask_truncated_completions", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2",
                "max_grad_norm", "seed", "num_iterations", "reward_weights"):
        assert getattr(config, key) == getattr(theirs, key), key
    assert config.lr_schedule == theirs.lr_scheduler_type.value
    assert config.warmup_steps == theirs.warmup_steps
    assert config.mixed_precision == ("bf16" if theirs.bf16 else "no")
    assert config.device == "cpu" and config.kl_kind == "k3"


def test_trl_defaults_become_grpokit_settings(tmp_path):
    config = GRPOConfig(output_dir=str(tmp_path), **CPU).to_grpokit(num_rows=100)
    assert (config.learning_rate, config.beta, config.aggregation, config.max_completion_length) == (1e-6, 0.0,
                                                                                                    "token", 512)
    assert (config.prompts_per_step, config.num_generations, config.mixed_precision) == (1, 8, "bf16")
    assert config.gradient_checkpointing and config.adam_beta2 == 0.999 and config.seed == 42
    # max_steps=-1: num_train_epochs (3) passes over 100 prompts, one prompt per generation batch
    assert config.max_steps == 300


def test_the_real_model_defaults_are_written_once_and_shared_by_both_front_doors(tmp_path):
    """grpokit's own GRPOConfig and grpokit.trl's start from REAL_MODEL, which is TRL's; the keys where the two
    front doors differ by design (the paper's beta and aggregation against TRL's) are not in it."""
    from grpokit.config.grpo import REAL_MODEL

    ours, translated = GrpokitConfig(), GRPOConfig(output_dir=str(tmp_path), **CPU).to_grpokit(num_rows=8)
    theirs = trl.GRPOConfig(output_dir=str(tmp_path), **CPU)
    for name, value in REAL_MODEL.items():
        assert getattr(ours, name) == getattr(translated, name) == getattr(theirs, name) == value, name
    assert {"beta", "aggregation", "loss_type", "adam_beta2"}.isdisjoint(REAL_MODEL)
    assert (ours.beta, ours.aggregation) == (0.04, "sequence") and (translated.beta, translated.aggregation) == (
        0.0, "token")
    assert ours.model is None and ours.dataset is None  # a real run names its own; no toy is trained by default


def test_epochs_count_whole_generation_batches_as_trl(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), **CPU, per_device_train_batch_size=8, num_generations=4,
                      num_train_epochs=1.5)
    assert args.grpokit_steps(num_rows=21) == 15  # 10 whole batches of 2 prompts per epoch
    with pytest.raises(ConfigError, match="do not fill one generation batch"):
        args.grpokit_steps(num_rows=1)


@pytest.mark.parametrize(("settings", "named"), [
    (dict(loss_type="cispo"), "loss_type='cispo'"),
    (dict(loss_type="bnpo", gradient_accumulation_steps=2), "bnpo"),
    (dict(use_vllm=True, top_k=50), "top_k, min_p, repetition_penalty or top_p < 1 with use_vllm"),
    (dict(optim="sgd"), "optim='sgd'"),
    (dict(fp16=True, bf16=False), "fp16"),
    (dict(report_to="mlflow"), "report_to 'mlflow'"),
    (dict(use_vllm=True, vllm_mode="server"), "vllm_mode='server'"),
    (dict(eval_strategy="steps", eval_steps=0.5), "eval_steps below 1"),
    (dict(max_steps=3, num_iterations=2), "max_steps=3"),
    (dict(model_init_kwargs={"quantization_config": {}}), "model_init_kwargs {'quantization_config'"),
    (dict(model_init_kwargs={"revision": "v2", "attn_implementation": "sdpa"}), "model_init_kwargs {'revision': 'v2'}"),
    (dict(multi_objective_aggregation="normalize_then_sum"), "multi_objective_aggregation"),
    (dict(lr_scheduler_type="polynomial"), "lr_scheduler_type='polynomial'"),
])
def test_values_grpokit_cannot_honour_are_refused_by_name(settings, named, tmp_path):
    with pytest.raises(ConfigError) as error:
        GRPOConfig(output_dir=str(tmp_path), **{"use_cpu": True, **settings})
    assert named in str(error.value)


def test_accepted_values_map_through(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), **CPU, beta=0.1, use_bias_correction_kl=False, optim="adamw_torch",
                      lr_scheduler_type="constant_with_warmup", warmup_steps=0.1, max_steps=50,
                      model_init_kwargs={"dtype": "bfloat16", "attn_implementation": "sdpa", "revision": "main"},
                      gradient_checkpointing_kwargs={"use_reentrant": False},
                      save_total_limit=3, save_steps=5, disable_tqdm=True, log_completions=True,
                      num_completions_to_print=2, dataloader_num_workers=4, shuffle_dataset=False, top_k=50,
                      min_p=0.05, repetition_penalty=1.1)
    config = args.to_grpokit()
    assert config.prompt_sampling == "in_order"
    assert (config.top_k, config.min_p, config.repetition_penalty) == (50, 0.05, 1.1)
    assert (config.beta, config.optimizer, config.lr_schedule, config.warmup_steps) == (0.1, "adamw", "constant", 5)
    assert (config.dtype, config.keep_checkpoints, config.save_every, config.progress_bar) == ("bfloat16", 3, 5, False)
    assert config.log_completions == 2


# ---- the loss: TRL's _compute_loss vs grpokit's grpo_loss on the same inputs --------------------------------


def trl_loss(args, logp, old_logp, ref_logp, advantages, mask):
    """TRL 1.16's ``GRPOTrainer._compute_loss`` on a stand-in trainer whose policy pass returns ``logp``
    (one process, no accumulation)."""
    metrics = collections.defaultdict(lambda: collections.defaultdict(list))
    ident = types.SimpleNamespace(num_processes=1, reduce=lambda x, reduction: x, gather=lambda x: x,
                                  gather_for_metrics=lambda x: x, sync_gradients=True)
    fake = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=args.importance_sampling_level, beta=args.beta, args=args,
        loss_type=args.loss_type, epsilon_low=args.epsilon, epsilon_high=args.epsilon_high or args.epsilon,
        use_vllm=False, model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        accelerator=ident, _metrics=metrics, _entropy_bonus_enabled=False,
        max_completion_length=args.max_completion_length)
    n, t = logp.shape
    inputs = {"prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1),
              "completion_ids": torch.zeros(n, t, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "old_per_token_logps": old_logp, "ref_per_token_logps": ref_logp,
              "num_items_in_batch": mask.sum()}
    return trl.GRPOTrainer._compute_loss(fake, None, inputs)


@pytest.mark.parametrize("settings", [
    dict(), dict(loss_type="grpo"), dict(loss_type="dr_grpo", max_completion_length=8),
    dict(beta=0.05, use_bias_correction_kl=False, epsilon_high=0.28),
    dict(beta=0.05),  # TRL's default use_bias_correction_kl=True: the KL term weighted by the ratio
    dict(importance_sampling_level="sequence", beta=0.02, loss_type="grpo"),
    dict(importance_sampling_level="sequence", epsilon=0.1, beta=0.02, use_bias_correction_kl=False),
])
def test_the_same_loss_and_gradient_as_trl(settings, tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), **CPU, per_device_train_batch_size=6, num_generations=3, **settings)
    theirs_args = trl.GRPOConfig(output_dir=str(tmp_path), **CPU, per_device_train_batch_size=6, num_generations=3,
                                 **settings)
    config = args.to_grpokit(num_rows=10)
    g = torch.Generator().manual_seed(0)
    shape = (6, 8)
    base = -torch.rand(shape, generator=g) * 3
    old, ref = base + 0.3 * torch.randn(shape, generator=g), base + 0.3 * torch.randn(shape, generator=g)
    mask = (torch.rand(shape, generator=g) > 0.2).float()
    mask[:, 0] = 1
    advantages = torch.randn(6, generator=g)
    losses, grads = [], []
    for compute in ("trl", "grpokit"):
        logp = base.clone().requires_grad_(True)
        if compute == "trl":
            loss = trl_loss(theirs_args, logp, old, ref, advantages, mask)
        else:
            loss, _ = grpo_loss(logp, old, ref, advantages, mask, epsilon=config.epsilon,
                                epsilon_high=config.epsilon_high, beta=config.beta, aggregation=config.aggregation,
                                ratio_level=config.ratio_level, max_completion_length=config.max_completion_length,
                                kl_kind=config.kl_kind, kl_weighted=config.kl_ratio_weighted)
        loss.backward()
        losses.append(loss.item())
        grads.append(logp.grad * mask)
    assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def test_the_docs_table_lists_every_key_as_the_code_treats_it():
    from pathlib import Path

    from grpokit.trl.key_table import MEANING, markdown
    from grpokit.trl.keys import MAPPED

    assert set(MEANING) == set(MAPPED)  # every mapped key says what it becomes, and nothing else is listed as mapped
    table = Path(__file__).resolve().parents[2] / "docs" / "trl_keys.md"
    assert table.read_text() == markdown(), "regenerate: python -m grpokit.trl.key_table > docs/trl_keys.md"
    assert all(f"| `{name}` |" in markdown() for name in fields(trl.GRPOConfig))
