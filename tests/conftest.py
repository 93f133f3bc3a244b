import os

import pytest
import torch

os.environ.setdefault("GRPO_LAB_PROFILE", "cpu")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def tiny():
    """The shipped tiny policy and its tokenizer, freshly loaded."""
    from grpo_lab.policy import load_policy

    return load_policy("cpu")
