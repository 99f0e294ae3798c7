"""The same paths on a CUDA device: skipped where there is none (CI), run on a GPU machine with
``pytest tests/algorithms/test_cuda.py``."""

import pytest
import torch

from grpokit.models.logprobs import sequence_logprobs
from grpokit.rollout.generate import generate
from helpers import each_one, make_trainer, ones

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


def test_generation_logprobs_match_a_full_forward_pass_on_cuda(tiny_model, tokenizer):
    model = tiny_model.cuda().eval()
    encoded = tokenizer(["Count 1:", "Count 100:"], padding=True, padding_side="left", return_tensors="pt").to("cuda")
    rollout = generate(model, encoded["input_ids"], encoded["attention_mask"], num_generations=4, max_new_tokens=12,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       generator=torch.Generator(device="cuda").manual_seed(0))
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                    rollout.completion_mask)
    mask = rollout.completion_mask.bool()
    assert rollout.completion_ids.is_cuda
    assert torch.allclose(logp[mask], rollout.logp[mask], atol=1e-4)


def test_decode_step_replayed_as_a_cuda_graph_samples_what_the_loop_samples(tiny_model, tokenizer, monkeypatch):
    model = tiny_model.cuda().eval()
    encoded = tokenizer(["Count 1:", "Count 100:"], padding=True, padding_side="left", return_tensors="pt").to("cuda")
    replays = []
    replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: replays.append(1) or replay(graph))
    loop, graphed = (generate(model, encoded["input_ids"], encoded["attention_mask"], num_generations=4,
                              max_new_tokens=12, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id, graph=graph,
                              generator=torch.Generator(device="cuda").manual_seed(0)) for graph in (False, True))
    assert len(replays) >= 5  # the steps after the first two (run, then captured and replayed)
    assert torch.equal(graphed.completion_ids, loop.completion_ids)
    assert torch.allclose(graphed.logp, loop.logp, atol=1e-4)


def test_bf16_sampler_reads_the_prompts_in_float32_under_a_cuda_graph(tiny_model, tokenizer, monkeypatch):
    """``exact_prefill`` under autocast with the decode step as a graph: the products switch to bfloat16 at the
    prefill, before the capture, so the first token is float32's and the replayed steps are bfloat16's."""
    model = tiny_model.cuda().eval()
    encoded = tokenizer(["Count 1:", "Count 100:"], padding=True, padding_side="left", return_tensors="pt").to("cuda")
    replays = []
    replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: replays.append(1) or replay(graph))

    def sample(bf16: bool):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            return generate(model, encoded["input_ids"], encoded["attention_mask"], num_generations=4,
                            max_new_tokens=12, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                            graph=True, exact_prefill=bf16, generator=torch.Generator(device="cuda").manual_seed(0))

    exact, graphed = sample(False), sample(True)
    assert len(replays) >= 10  # both calls replayed their steps
    assert torch.equal(graphed.completion_ids[:, 0], exact.completion_ids[:, 0])
    assert (graphed.logp[:, 0] - exact.logp[:, 0]).abs().max() < 1e-4
    with torch.no_grad():
        policy, _ = sequence_logprobs(model, graphed.prompt_ids, graphed.prompt_mask, graphed.completion_ids,
                                      graphed.completion_mask)
    assert (policy - graphed.logp)[:, 1:][graphed.completion_mask[:, 1:].bool()].abs().max() > 1e-4  # bfloat16 later


@pytest.mark.parametrize(
    "options",
    [dict(), dict(supervision="process", reward_funcs=(each_one, ones)), dict(dynamic_sampling=True),
     dict(algorithm="ppo", num_minibatches=2), dict(num_iterations=2, mask_truncated_completions=True),
     dict(cuda_graphs=True, mixed_precision="bf16"), dict(cuda_graphs=True, rollout_precision="bf16_autocast")],
    ids=["grpo", "process", "dynamic", "ppo", "mu2-mask", "graphs-bf16", "graphs-bf16-sampler"],
)
def test_training_steps_on_cuda(tokenizer, tiny_model, tmp_path, options, monkeypatch):
    options = dict(options)
    funcs = options.pop("reward_funcs", (ones,))
    replays = []
    replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: replays.append(1) or replay(graph))
    trainer = make_trainer(tokenizer, tiny_model, tmp_path, reward_funcs=funcs, device="cuda", max_steps=3, **options)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    history = trainer.train()
    assert next(trainer.model.parameters()).is_cuda
    assert all(torch.isfinite(torch.tensor([m["loss"], m["grad_norm"]])).all() for m in history)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert bool(replays) == options.get("cuda_graphs", False)  # the trainer's sampler takes the graph, and only then


def test_eval_and_sample_on_cuda_take_the_runs_engine(tmp_path, tiny_model_dir, data_file, monkeypatch):
    """`grpokit eval` / `sample` with a training config's cuda_graphs and precision sample through the same native
    engine on CUDA: the decode step replayed as a graph, under the run's autocast."""
    from grpokit.cli.main import main
    from helpers import write_config

    replays = []
    replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: replays.append(1) or replay(graph))
    config = write_config(tmp_path, tiny_model_dir, data_file, device="cuda", cuda_graphs=True, mixed_precision="bf16")
    assert main(["eval", str(config), "--num_prompts", "4", "--progress_bar", "false",
                 "--output", str(tmp_path / "eval.json")]) == 0
    assert replays
    replays.clear()
    assert main(["sample", str(config), "--num_prompts", "2", "--progress_bar", "false",
                 "--output", str(tmp_path / "rows.jsonl")]) == 0
    assert replays and (tmp_path / "rows.jsonl").read_text().strip()
