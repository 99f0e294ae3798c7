"""The agents' model: the tiny model with a Hermes tool-call chat template (as tests/serving's), and the trainer."""

import pytest
import torch

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.tasks.tiny_model import build_model
from helpers import HERMES, tokenizer_with
from helpers import TEMPLATE_SPEC as SPEC


@pytest.fixture(scope="module")
def tok():
    return tokenizer_with(HERMES)


@pytest.fixture
def model(tok):
    torch.set_num_threads(2)
    return build_model(tok, SPEC, seed=0)


@pytest.fixture
def agent_trainer(tok, model, tmp_path):
    """``agent_trainer(agent, rows, **config)``: a GRPOTrainer on the tiny model driven by ``agent``."""

    runs = iter(range(100))

    def make(agent, rows, reward_funcs=None, **overrides):
        values = dict(output_dir=str(tmp_path / f"run{next(runs)}"), prompts_per_step=2, num_generations=4,
                      max_completion_length=8, learning_rate=1e-2, max_steps=1, micro_batch_size=8,
                      progress_bar=False, lr_schedule="constant", mixed_precision="no", agent_timeout=60.0)
        values.update(overrides)
        return GRPOTrainer(GRPOConfig(**values), model=model, tokenizer=tok, train_dataset=rows,
                           reward_funcs=reward_funcs, agent=agent)

    return make
