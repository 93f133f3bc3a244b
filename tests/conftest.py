import os

import pytest

os.environ.setdefault("GRPO_LAB_PROFILE", "cpu")


@pytest.fixture(autouse=True)
def _seed():
    # imported here: the xdist controller loads this file at start and never needs torch
    # (1.4 s before the workers start); the workers have it loaded already
    import torch

    torch.manual_seed(0)


@pytest.fixture
def tiny():
    """The shipped tiny policy and its tokenizer, freshly loaded."""
    from grpo_lab.policy import load_policy

    return load_policy("cpu")
