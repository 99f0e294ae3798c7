"""An agent's episodes served by vLLM (``generation_engine: vllm``): the server adds each request to vLLM's engine
(its continuous batching), the weights pushed after each step reach it, and the tokens it sampled are trained with
their log-probs checked against the policy's. Deselected by default (marker ``vllm``): bash scripts/test_vllm.sh."""

import pytest

from grpokit.tasks.tiny_model import TinyModelSpec, build_model, build_tokenizer

pytestmark = pytest.mark.vllm
SPEC = TinyModelSpec(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256, max_positions=128)
ROWS = [{"question": f"Count {i}:", "answer": str(i + 1)} for i in range(4)]


async def counts(client, model, question, answer):
    first = await client.completions.create(model=model, prompt=question, max_tokens=4)
    second = await client.completions.create(model=model, prompt=question + first.choices[0].text, max_tokens=4)
    return float(answer in first.choices[0].text + second.choices[0].text) + len(second.choices[0].text) / 10


def test_an_agent_trains_on_vllm_served_tokens(tmp_path):
    pytest.importorskip("vllm")
    from grpokit import GRPOConfig, GRPOTrainer

    tokenizer = build_tokenizer()
    config = GRPOConfig(output_dir=str(tmp_path / "run"), generation_engine="vllm", prompts_per_step=2,
                        num_generations=4, max_completion_length=8, max_steps=2, learning_rate=1e-2,
                        micro_batch_size=8, progress_bar=False, mixed_precision="no", seed=0)
    trainer = GRPOTrainer(config, model=build_model(tokenizer, SPEC, seed=0), tokenizer=tokenizer,
                          train_dataset=ROWS, agent=counts)
    history = trainer.train()
    assert [m["agent_episodes"] for m in history] == [8, 8] and [m["agent_turns"] for m in history] == [16, 16]
    # vLLM's log-probs of the served tokens against the policy's (float32): close, after the step-1 push too
    assert all(m["sampler_kl"] < 1e-3 for m in history), [m["sampler_kl"] for m in history]
