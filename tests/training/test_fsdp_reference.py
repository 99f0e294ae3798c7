"""The reference model under FSDP2 (``reference_placement``): sharded like the policy, or its shards in CPU memory,
it computes the very log-probs of a whole copy while each process holds only its shards; iterative RL's reset copies
the policy into it shard by shard. In 2 CPU processes (gloo) under torchrun, as every process group in this suite."""

import json
import textwrap
from pathlib import Path

import pytest

from grpokit.config import ConfigError, GRPOConfig
from grpokit.models.reference import build_reference, resolve_placement
from helpers import torchrun_processes

TESTS = Path(__file__).parents[1]

SCRIPT = textwrap.dedent(f"""
    import json, sys
    sys.path.insert(0, {str(TESTS)!r})
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    from helpers import TINY
    from grpokit.models.logprobs import sequence_logprobs
    from grpokit.models.reference import build_reference
    from grpokit.models.sharding import local, shard
    from grpokit.runtime.device import autocast
    from grpokit.tasks.tiny_model import build_model, build_tokenizer

    dist.init_process_group("gloo")
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    prompt_ids = torch.randint(3, 60, (3, 5))
    completion_ids = torch.randint(3, 60, (3, 4))
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    sequences = (prompt_ids, torch.ones_like(prompt_ids), completion_ids, completion_mask)

    def logprobs(reference, precision):
        with torch.no_grad(), reference.active(), autocast(precision, torch.device("cpu")):
            return sequence_logprobs(reference.model, *sequences, fast=False)[0]

    results = {{}}
    for precision in ("no", "bf16"):
        whole = build_reference(build_model(tokenizer, TINY, seed=0), 0.04, precision, "replicate")
        expected = logprobs(whole, precision)
        for placement in ("shard", "cpu_offload"):
            policy = build_model(tokenizer, TINY, seed=0)
            reference = build_reference(policy, 0.04, precision, placement)
            shard(policy)
            reference.shard_like(policy)
            got = logprobs(reference, precision)
            params = list(reference.model.parameters())
            results[f"{{placement}}-{{precision}}"] = {{
                "max_difference": float((got - expected).abs().max()),
                "all_sharded": all(type(p).__name__ == "DTensor" for p in params),  # after the pass too
                "held": sum(local(p).numel() * local(p).element_size() for p in params),
                "whole": sum(p.numel() * p.element_size() for p in whole.model.parameters()),
                "devices": sorted({{str(local(p).device) for p in params}}),
            }}
            if precision == "no":  # iterative RL's reset: π_ref := the policy as it is now
                with torch.no_grad():
                    for p in policy.parameters():
                        local(p).mul_(1.5)
                reference.reset(policy)
                with torch.no_grad():
                    own = sequence_logprobs(policy, *sequences, fast=False)[0]
                reset = float((logprobs(reference, "no") - own).abs().max())
                results[f"{{placement}}-{{precision}}"]["after_reset"] = reset
    if dist.get_rank() == 1:
        print(json.dumps(results))
    dist.destroy_process_group()
""")


def test_a_sharded_reference_computes_the_whole_copys_logprobs_holding_half(tmp_path):
    script = tmp_path / "reference.py"
    script.write_text(SCRIPT)
    results = json.loads(torchrun_processes(script, []).strip().splitlines()[-1])
    assert sorted(results) == ["cpu_offload-bf16", "cpu_offload-no", "shard-bf16", "shard-no"]
    for name, result in results.items():
        assert result["max_difference"] == 0.0, name  # the same layers on the same (gathered) weights
        assert result["all_sharded"], name
        # each process holds its half of every parameter (dim 0 split in two: at most a row more)
        assert result["whole"] / 2 - 2000 <= result["held"] <= result["whole"] / 2 + 2000, (name, result)
        assert result["devices"] == ["cpu"], name
        if name.endswith("-no"):
            assert result["after_reset"] == 0.0, name


def test_the_placement_applies_where_the_policy_is_sharded():
    assert resolve_placement("auto", policy_sharded=True) == "shard"
    assert resolve_placement("cpu_offload", policy_sharded=True) == "cpu_offload"
    assert resolve_placement("replicate", policy_sharded=True) == "replicate"
    # one process (nothing to shard over) and DDP: a whole copy beside the whole policy
    assert resolve_placement("auto", policy_sharded=False) == "replicate"
    assert resolve_placement("shard", policy_sharded=False) == "replicate"
    with pytest.raises(ValueError, match="reference_placement must be one of"):
        resolve_placement("gpu", policy_sharded=True)


def test_no_reference_with_beta_zero_whatever_the_placement(tiny_model):
    assert build_reference(tiny_model, 0.0, placement="shard") is None


def test_a_frame_holds_no_weights_until_filled(tiny_model):
    reference = build_reference(tiny_model, 0.04, placement="shard")
    assert all(p.device.type == "meta" for p in reference.model.parameters())
    assert all(b.device.type == "cpu" for b in reference.model.buffers())  # the rotary frequencies, real
    assert next(tiny_model.parameters()).device.type == "cpu"  # the policy untouched
    assert reference.model.lm_head.weight is reference.model.model.embed_tokens.weight or \
        not tiny_model.config.tie_word_embeddings


@pytest.mark.parametrize("overrides, message", [
    ({"reference_placement": "shard"}, "reference_placement: shard shards the reference like the policy, which "
                                       "only parallelism: fsdp shards"),
    ({"reference_placement": "cpu_offload", "parallelism": "ddp"}, "reference_placement: cpu_offload"),
    ({"reference_placement": "gpu", "parallelism": "fsdp"}, "reference_placement"),
])
def test_a_placement_without_fsdp_is_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        GRPOConfig(**overrides)


@pytest.mark.parametrize("placement", ["auto", "replicate", "shard", "cpu_offload"])
def test_every_placement_is_taken_with_fsdp(placement):
    assert GRPOConfig(parallelism="fsdp", reference_placement=placement).reference_placement == placement
