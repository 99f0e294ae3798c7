"""Data parallelism: 2 CPU processes (gloo, launched by torchrun) and 1 process train on the same global
batches and end with the same parameters and the same metrics; only rank 0 writes; bad launches fail
early with a clear error."""

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpokit.config import ConfigError
from grpokit.training.distributed import init_world
from helpers import approx_scores, free_port, run_group, run_groups, run_to_success, torchrun

TESTS = Path(__file__).parents[1]
STEPS = 3
VARIANTS = {"sequence": {}, "fast-path": {"fast_path": True},
            "token": {"aggregation": "token", "scale_rewards": "batch"},
            "ppo": {"algorithm": "ppo"}, "fsdp": {"parallelism": "fsdp"},
            "ppo-fsdp": {"algorithm": "ppo", "parallelism": "fsdp"},
            # "fsdp" shards the reference like the policy (reference_placement: auto); this one offloads its shards
            "fsdp-offloaded-reference": {"parallelism": "fsdp", "reference_placement": "cpu_offload"},
            # Every process loads the reward models named in the config and scores its own completions.
            "reward-model": {"reward_funcs": ["model:{reward_models}/orm"]},
            "process-reward-model": {"reward_funcs": ["process_model:{reward_models}/prm"], "supervision": "process"},
            # Iterative RL: the first process samples and retrains the reward model after steps 1 and 2, every
            # process then scores with the new weights and resets its reference.
            "iterative": {"reward_funcs": ["model:{reward_models}/orm"], "rl_iterations": STEPS,
                          "reward_model_labels": ["format"], "reward_model_prompts": 2},
            # Tool results (two inserted tokens in some completions): holes in the loss mask, and GAE across them.
            "tools": {"tools": ["calculator"]}, "ppo-tools": {"algorithm": "ppo", "tools": ["calculator"]},
            # Both processes draw the same prompts by the spread both have seen, and each trains on its share.
            "signal": {"prompt_sampling": "signal"}}
REWARD_MODEL_VARIANTS = {"reward-model": "orm", "process-reward-model": "prm"}  # → the reward model's name

# Rollouts are a function of each prompt's text and the completion's index in its group (not of the
# process layout), so both layouts train on the same completions: the update path is what is compared.
# Both use the model's own forward (fast_path: false) unless a variant says otherwise: Adam at lr 1e-2 would
# turn the paths' float rounding into visible differences. "fast-path": DDP around PolicyLogprobs keeps the
# fast path and the chunked LM head for the training passes, as in one process.
SCRIPT = textwrap.dedent(f"""
    import json, os, sys, zlib
    sys.path.insert(0, {str(TESTS)!r})
    import torch
    torch.set_num_threads(1)
    import grpokit.rollout.engines, grpokit.training.runlog
    from helpers import TINY
    from grpokit import GRPOConfig, GRPOTrainer, OutcomeRewardModel, ProcessRewardModel
    from grpokit.tasks.tiny_model import build_model, build_tokenizer
    from grpokit.rollout.generate import Rollout
    from grpokit.rollout.tools import ToolUse
    from helpers import ROWS, ones

    def fake_generate(model, prompt_ids, prompt_mask, *, num_generations, max_new_tokens, eos_token_id,
                      pad_token_id, **kw):
        rows, lengths = [], []
        for p in range(prompt_ids.shape[0]):
            key = zlib.crc32(bytes(prompt_ids[p][prompt_mask[p].bool()].tolist()))
            for g in range(num_generations):
                gen = torch.Generator().manual_seed(key * 31 + g)
                n = int(torch.randint(1, max_new_tokens + 1, (1,), generator=gen))
                ids = torch.randint(3, 99, (max_new_tokens,), generator=gen)
                if n < max_new_tokens:
                    ids[n - 1] = eos_token_id[0]
                ids[n:] = pad_token_id
                rows.append(ids)
                lengths.append(n)
        ids, lengths = torch.stack(rows), torch.tensor(lengths)
        mask = (torch.arange(max_new_tokens) < lengths.unsqueeze(1)).long()
        repeat = lambda t: t.repeat_interleave(num_generations, 0)
        tool_mask, tools = None, kw.get("tools")
        if tools:  # a "result" of two tokens after the first in every other completion that has room (not inert)
            tool_mask = torch.zeros_like(mask)
            for i, n in enumerate(lengths.tolist()):
                if n >= 4 and int(ids[i, 0]) % 2:
                    tool_mask[i, 1:3] = 1
                    tools.calls[i].append(ToolUse("calculator", {{}}, "x", bool(int(ids[i, 1]) % 2), 1, 2, 0.0))
        return Rollout(repeat(prompt_ids), repeat(prompt_mask), ids, mask, torch.zeros(ids.shape),
                       lengths == max_new_tokens, tool_mask)

    # GRPO's and iterative RL's samples
    grpokit.rollout.engines.generate = fake_generate
    rank = int(os.environ.get("RANK", 0))

    # The prompts of every call of a reward model on this process, written to OUT/VARIANT-scored-RANK.json with
    # the texts it cut.
    scored = []
    def counted(call):
        def count(self, prompts, completions, **kwargs):
            scored.append(list(prompts))
            return call(self, prompts, completions, **kwargs)
        return count
    OutcomeRewardModel.__call__ = counted(OutcomeRewardModel.__call__)
    ProcessRewardModel.__call__ = counted(ProcessRewardModel.__call__)
    if rank != 0:  # only rank 0 may touch the run directory
        def refuse(*args, **kwargs):
            raise AssertionError(f"rank {{rank}} wrote to the run directory")
        grpokit.training.runlog.RunLog.__init__ = refuse

    variants = {VARIANTS!r}
    only = os.environ.get("VARIANTS")  # (a subset, for the two-node launch)
    for name, overrides in variants.items():
        if only and name not in only.split(","):
            continue
        tokenizer = build_tokenizer()
        specs = [spec.format(reward_models=sys.argv[2]) for spec in overrides.pop("reward_funcs", [])]
        config = GRPOConfig(output_dir=os.path.join(sys.argv[1], name), prompts_per_step=4, num_generations=4,
                            max_completion_length=6, max_steps={STEPS}, learning_rate=1e-2, progress_bar=False,
                            micro_batch_size=3, save_every=0, fast_path=overrides.pop("fast_path", False),
                            mixed_precision="no",
                            **({{"reward_funcs": specs}} if specs else {{}}),
                            **overrides)  # float32 on any CPU: bf16 would round the two runs apart
        trainer = GRPOTrainer(config, model=build_model(tokenizer, TINY, seed=0), tokenizer=tokenizer,
                                train_dataset=ROWS, reward_funcs=None if specs else [ones])
        if rank != 0:
            trainer.model.save_pretrained = trainer.tokenizer.save_pretrained = refuse
        scored.clear()
        trainer.train()
        if specs:
            with open(os.path.join(sys.argv[1], f"{{name}}-scored-{{rank}}.json"), "w") as handle:
                json.dump({{"calls": scored, "truncated": trainer.reward_funcs[0].truncated}}, handle)
""")


def launch(tmp_path: Path, out: Path, processes: int) -> None:
    script = tmp_path / "dp.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, str(script), str(out), str(tmp_path / "reward_models")]
    if processes > 1:
        command = [*torchrun(processes), *command[1:]]
    run_to_success(command, env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from grpokit.tasks.tiny_model import build_tokenizer
    from helpers import save_classifier

    tmp = tmp_path_factory.mktemp("dp")
    # Tiny random classifiers over the policy's characters, reading 12 tokens: prompts of 8 or 9 characters with
    # completions of up to 6 are cut now and then, which each process counts for reward_truncated/<name>.
    save_classifier(tmp / "reward_models" / "orm", build_tokenizer(), max_positions=12, seed=5)
    save_classifier(tmp / "reward_models" / "prm", build_tokenizer(), head="token", max_positions=12, seed=6)
    launch(tmp, tmp / "one", 1)
    launch(tmp, tmp / "two", 2)
    return tmp / "one", tmp / "two"


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_and_two_processes_end_with_the_same_parameters(runs, variant):
    assert_same_parameters(*runs, variant)


def assert_same_parameters(one: Path, two: Path, variant: str) -> None:
    from grpokit.tasks.tiny_model import build_model, build_tokenizer
    from helpers import TINY

    runs = one, two
    one, two = (load_file(str(run / variant / "model" / "model.safetensors")) for run in runs)
    start = build_model(build_tokenizer(), TINY, seed=0).state_dict()
    assert one.keys() == two.keys()
    assert all(not torch.equal(one[k], start[k]) for k in one if k.endswith("proj.weight"))  # training moved them
    for key in one:
        assert torch.allclose(one[key], two[key], atol=1e-5, rtol=1e-4), key
    if variant == "ppo":
        values = [load_file(str(run / variant / "checkpoints" / f"step-{STEPS:06d}" / "value_model.safetensors"))
                  for run in runs]
        for key in values[0]:
            assert torch.allclose(values[0][key], values[1][key], atol=1e-5, rtol=1e-4), key


@pytest.mark.parametrize("variant", VARIANTS)
def test_metrics_equal_the_single_process_ones(runs, variant):
    assert_same_metrics(*runs, variant=variant)


def assert_same_metrics(*runs: Path, variant: str) -> None:
    one, two = ([json.loads(line) for line in (run / variant / "metrics.jsonl").read_text().splitlines()]
                for run in runs)
    assert [m["step"] for m in one] == [m["step"] for m in two] == list(range(1, STEPS + 1))
    for a, b in zip(one, two):
        assert a.keys() == b.keys()
        for key in a:
            if key.startswith("time_") or key == "tokens_per_sec":
                continue
            assert a[key] == approx_scores(b[key], rel=1e-4, abs=1e-6), (variant, a["step"], key)


@pytest.mark.parametrize("variant", REWARD_MODEL_VARIANTS)
def test_each_process_scores_its_share_with_its_own_reward_model(runs, variant):
    """Each process loads the reward model and scores only its own completions, once per step: together the
    completions of the one process's calls; the rewards logged are the one process's."""
    one, two = runs
    name = REWARD_MODEL_VARIANTS[variant]
    counts = [json.loads(path.read_text()) for path in (one / f"{variant}-scored-0.json",
                                                         *(two / f"{variant}-scored-{rank}.json" for rank in (0, 1)))]
    whole, first, second = (count["calls"] for count in counts)
    assert [len(call) for call in whole] == [16] * STEPS  # B·G completions per step
    assert [len(call) for call in first] == [len(call) for call in second] == [8] * STEPS  # half each
    for step in range(STEPS):
        assert not set(first[step]) & set(second[step])  # other prompts: each process its own groups
        assert sorted(first[step] + second[step]) == sorted(whole[step])
    records = [[json.loads(line) for line in (run / variant / "completions.jsonl").read_text().splitlines()]
               for run in runs]
    assert len(records[0]) == len(records[1]) == 4 * STEPS  # rank 0's first group, the same in both layouts
    for a, b in zip(*records):
        assert (a["prompt"], a["completion"]) == (b["prompt"], b["completion"])
        # None where the reward model had nothing to score (a completion that ends no step), in both layouts
        assert (a["reward"], a[name]) == approx_scores((b["reward"], b[name]), rel=1e-4, abs=1e-6)
    # The stand-in sampler draws the same texts on every CPU: numbers in both variants, and in the process reward
    # model's records None too (an empty completion, or one whose one step the reward model's context cut)
    scores = [a[name] for a in records[0]]
    assert any(isinstance(score, float) for score in scores) and (None in scores) == (name == "prm")
    metrics = [[json.loads(line) for line in (run / variant / "metrics.jsonl").read_text().splitlines()]
               for run in runs]
    assert all(m[f"rewards/{name}"] is not None for m in metrics[1])
    # Texts cut to the reward model's context: each process counts its own, the metric is their sum.
    cut = [m[f"reward_truncated/{name}"] for m in metrics[1]]
    assert cut == [m[f"reward_truncated/{name}"] for m in metrics[0]] and 0 < sum(cut) < 16 * STEPS
    assert counts[1]["truncated"] > 0 and counts[2]["truncated"] > 0
    assert counts[1]["truncated"] + counts[2]["truncated"] == counts[0]["truncated"] == sum(cut)


def test_iterative_rl_retrains_once_and_every_process_follows(runs):
    """The first process alone sampled and retrained (rank 1 writing nothing, checked in the script); the two
    layouts retrained the same reward model, and each iteration's first step has KL exactly 0 on every process."""
    one, two = runs
    for run in runs:
        metrics = [json.loads(line) for line in (run / "iterative" / "metrics.jsonl").read_text().splitlines()]
        assert [m["rl_iteration"] for m in metrics] == [1, 2, 3] and [m["kl"] for m in metrics[1:]] == [0.0, 0.0]
    for k in (1, 2):
        a, b = (load_file(str(run / "iterative" / "reward_model" / f"iteration-{k}" / "model" / "model.safetensors"))
                for run in runs)
        for key in a:
            assert torch.allclose(a[key], b[key], atol=1e-5, rtol=1e-4), (k, key)
    assert len((two / "iterative" / "reward_model" / "iterations.jsonl").read_text().splitlines()) == 2


def test_tool_calls_of_every_process_reach_the_metrics(runs):
    """The tools variants had inserted tokens and calls in both layouts (equal metrics: the test above)."""
    for run in runs:
        for variant in ("tools", "ppo-tools"):
            metrics = [json.loads(line) for line in (run / variant / "metrics.jsonl").read_text().splitlines()]
            assert all(m["tool_call_rate"] > 0 and m["tool_result_tokens_mean"] > 0 for m in metrics)
            assert all(0 < m["tool_errors"] < m["tool_calls"] for m in metrics)


def test_rank_zero_alone_writes(runs):
    two = runs[1]
    state = json.loads((two / "sequence" / "checkpoints" / f"step-{STEPS:06d}" / "state.json").read_text())
    assert state["world_size"] == 2 and len(state["python_rng"]) == 2  # every process's streams, one writer
    assert len((two / "sequence" / "metrics.jsonl").read_text().splitlines()) == STEPS


def test_two_nodes_end_where_one_process_ends(runs, tmp_path):
    """Two torchrun launches, each a "node" of one process (--nnodes 2, c10d rendezvous on localhost, gloo), as on
    two machines (docs/distributed.md): DDP and FSDP2 end with the one process's parameters and metrics."""
    script = tmp_path / "dp.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VARIANTS": "sequence,fsdp"}
    env.pop("WORLD_SIZE", None)
    port, out = free_port(), tmp_path / "nodes"
    nodes = [[sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", f"--node_rank={rank}",
              "--rdzv_backend=c10d", f"--rdzv_endpoint=localhost:{port}", str(script), str(out), str(tmp_path)]
             for rank in (0, 1)]
    codes = run_groups(nodes, env, tmp_path, timeout=400)
    assert codes == [0, 0], [(tmp_path / f"{i}.log").read_text()[-3000:] for i in (0, 1)]
    for variant in ("sequence", "fsdp"):
        assert_same_parameters(runs[0], out, variant)
        assert_same_metrics(runs[0], out, variant=variant)
    state = json.loads((out / "fsdp" / "checkpoints" / f"step-{STEPS:06d}" / "state.json").read_text())
    assert (state["world_size"], state["layout"]) == (2, "sharded")


def test_missing_rendezvous_variables_are_named():
    with pytest.raises(ConfigError, match=r"WORLD_SIZE=2 but RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set"):
        init_world("cpu", 16, {"WORLD_SIZE": "2"})


def test_prompt_batch_not_divisible_by_the_world_is_refused_before_any_work():
    env = {"WORLD_SIZE": "3", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": "1"}
    with pytest.raises(ConfigError, match=r"prompts_per_step=16 is not divisible by the world size 3"):
        init_world("cpu", 16, env)


def test_a_world_of_one_needs_no_launcher():
    assert init_world("cpu", 16, {}).size == 1 and init_world("cpu", 16, {"WORLD_SIZE": "1"}).main


RESUME_SCRIPT = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {str(TESTS)!r})
    import torch
    torch.set_num_threads(1)
    from helpers import TINY
    from grpokit import GRPOConfig, GRPOTrainer
    from grpokit.tasks.tiny_model import build_model, build_tokenizer
    from helpers import ROWS, ones

    out, steps, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3] or None
    tokenizer = build_tokenizer()
    config = GRPOConfig(output_dir=out, prompts_per_step=4, num_generations=4, max_completion_length=6,
                        max_steps=steps, learning_rate=1e-2, progress_bar=False, save_every=1, resume=resume,
                        lr_schedule="constant")  # the first leg stops at step 2: same schedule as the straight run
    GRPOTrainer(config, model=build_model(tokenizer, TINY, seed=0), tokenizer=tokenizer, train_dataset=ROWS,
                  reward_funcs=[ones]).train()
""")


def test_two_processes_resume_bit_exact(tmp_path):
    """Each process's random streams are in the checkpoint: a resumed 2-process run ends where an
    uninterrupted one does, bit for bit (real sampling, no fed rollouts). Between the legs, a new run into the used
    folder is refused by both processes (rank 0 decides before any writes) and changes nothing."""
    script = tmp_path / "resume.py"
    script.write_text(RESUME_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)

    def run(out: Path, steps: int, resume: str = "") -> None:
        run_to_success([*torchrun(2), str(script), str(out), str(steps), resume], env)

    run(tmp_path / "straight", 4)
    run(tmp_path / "resumed", 2)
    files = lambda: {p: p.read_bytes() for p in sorted((tmp_path / "resumed").rglob("*")) if p.is_file()}  # noqa: E731
    before = files()
    refused = run_group([*torchrun(2), str(script), str(tmp_path / "resumed"), "4", ""], env)
    assert refused.returncode != 0 and "already holds a run" in refused.stderr, refused.stderr[-4000:]
    assert files() == before
    run(tmp_path / "resumed", 4, "latest")
    a, b = (load_file(str(tmp_path / run / "model" / "model.safetensors")) for run in ("straight", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps = [json.loads(line)["step"] for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


CHUNKED_HEAD_SCRIPT = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {str(TESTS)!r})
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    torch.set_num_threads(1)
    from grpokit.models import logprobs
    from helpers import TINY
    from grpokit.tasks.tiny_model import build_model, build_tokenizer

    mode = sys.argv[1]
    fast = mode == "fast"
    torch.manual_seed(0)
    model = build_model(build_tokenizer(), TINY, seed=0)
    prompt_ids = torch.randint(3, 60, (3, 5))
    completion_ids = torch.randint(3, 60, (3, 4))
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    sequences = (prompt_ids, torch.ones_like(prompt_ids), completion_ids, completion_mask)
    plain = torch.nn.utils.parameters_to_vector(
        torch.autograd.grad(logprobs.sequence_logprobs(model, *sequences, fast=fast)[0].sum(),
                            list(model.parameters())))

    def refuse(*args, **kwargs):
        raise AssertionError("the full logits were computed")

    logprobs._full_logprobs = refuse
    dist.init_process_group("gloo")
    if mode == "fsdp":  # sharded in place: the pass runs the model's own forward (which gathers), head aside
        from torch.distributed.fsdp import fully_shard
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        logp, entropy = logprobs.PolicyLogprobs(model, fast=False)(*sequences, with_entropy=True)
    else:
        ddp = DistributedDataParallel(logprobs.PolicyLogprobs(model, fast=fast))
        logp, entropy = ddp(*sequences, with_entropy=True)
    logp.sum().backward()
    assert entropy is not None and entropy.shape == completion_mask.shape
    grads = [p.grad.full_tensor() if mode == "fsdp" else p.grad for p in model.parameters()]
    torch.testing.assert_close(torch.nn.utils.parameters_to_vector(grads), plain, rtol=1e-5, atol=1e-6)
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("fast", ["fast", "base", "fsdp"])
def test_the_ddp_training_pass_takes_the_chunked_head(tmp_path, fast):
    """DDP wraps PolicyLogprobs: its forward runs the fast path (or the base model) and the LM head in chunks,
    never the (tokens × vocabulary) logits, with the gradients of the plain pass; so does an FSDP-sharded model
    (its own forward, which gathers the parameters, returning the hidden states). In a process of its own, as
    every process group in this suite: one left in pytest's process can outlive its test and hang a later one."""
    script = tmp_path / "chunked_head.py"
    script.write_text(CHUNKED_HEAD_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    run_to_success([*torchrun(1), str(script), fast], env, timeout=300)


TOOLS_SCRIPT = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {str(TESTS)!r})
    import torch
    torch.set_num_threads(1)
    from grpokit import GRPOConfig, GRPOTrainer
    from grpokit.tasks.tiny_model import TinyModelSpec, build_model, build_tokenizer
    from helpers import TOOL_ROWS as ROWS, TOOL_SPEC as SPEC

    tokenizer = build_tokenizer(tool_tags=True)
    config = GRPOConfig(output_dir=sys.argv[1], prompts_per_step=4, num_generations=4, max_completion_length=40,
                        max_steps=2, learning_rate=1e-3, progress_bar=False, tools=["calculator"])
    GRPOTrainer(config, model=build_model(tokenizer, SPEC, seed=0), tokenizer=tokenizer, train_dataset=ROWS).train()
""")


def test_two_processes_train_with_real_tool_calls(tmp_path):
    """Real sampling and real tool sessions on each process (the runs above fake the rollouts): the calls of
    both processes reach the metrics."""
    script = tmp_path / "tools.py"
    script.write_text(TOOLS_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    run_to_success([*torchrun(2), str(script), str(tmp_path / "run")], env)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and sum(m["tool_calls"] for m in metrics) > 0
    assert all(m["tool_errors"] <= m["tool_calls"] for m in metrics)


def test_none_scores_compare_equal_only_to_none():
    """The comparison above: None (not applicable) equals only None, numbers within the tolerance."""
    assert (0.0, None) == approx_scores((0.0, None), rel=1e-4, abs=1e-6)
    assert [0.50004, None] == approx_scores([0.5, None], rel=1e-4)
    assert (0.0, None) != approx_scores((0.0, 0.0)) and (0.0, 0.0) != approx_scores((0.0, None))
    assert {"prm": 0.6} != approx_scores({"prm": 0.5}) and {"prm": None} == approx_scores({"prm": None})
