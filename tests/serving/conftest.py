"""The served model of tests/serving: the tiny model with a Hermes tool-call chat template."""

import pytest
import torch

from grpokit.tasks.tiny_model import build_model
from helpers import HERMES, tokenizer_with
from helpers import TEMPLATE_SPEC as SPEC


@pytest.fixture(scope="module")
def tok():
    return tokenizer_with(HERMES)


@pytest.fixture(scope="module")
def model(tok):
    torch.set_num_threads(2)
    return build_model(tok, SPEC, seed=0)
