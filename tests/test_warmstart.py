"""`python -m grpo_lab build-model` regenerates the shipped tiny model exactly."""

import torch
from safetensors.torch import load_file

from grpo_lab.models import TINY_MODEL_DIR
from grpo_lab.tools.warmstart import build_tiny_model


def test_build_model_reproduces_the_shipped_weights(tmp_path):
    summary = build_tiny_model(tmp_path, log=lambda *_: None)
    assert 0.30 <= summary["dev_accuracy"] <= 0.60
    shipped = load_file(TINY_MODEL_DIR / "model.safetensors")
    rebuilt = load_file(tmp_path / "model.safetensors")
    assert shipped.keys() == rebuilt.keys()
    for name, tensor in shipped.items():
        assert torch.equal(tensor, rebuilt[name]), name
    assert (tmp_path / "tokenizer.json").read_text() == (
        TINY_MODEL_DIR / "tokenizer.json"
    ).read_text()
