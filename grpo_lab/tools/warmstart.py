"""`python -m grpo_lab build-model`: regenerate the shipped tiny GPT-2 deterministically
(same torch version -> same weights): one CPU thread, fixed seeds, fixed data order, and
the warm start of `grpo_lab.policy`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models import (
    TINY_MODEL_DIR,
    GPT2LMHeadModel,
    build_char_tokenizer,
    count_parameters,
    tiny_gpt2_config,
)
from ..policy import warm_start


def build_tiny_model(out_dir: Path = TINY_MODEL_DIR, log=print) -> dict:
    """Regenerate the shipped tiny GPT-2 (deterministic on one CPU thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokenizer = build_char_tokenizer()
        torch.manual_seed(0)
        model = GPT2LMHeadModel(tiny_gpt2_config(len(tokenizer)))
        summary = warm_start(model, tokenizer, log=log)
    finally:
        torch.set_num_threads(threads)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    summary["parameters"] = count_parameters(model)
    log(f"[warm start] saved {summary['parameters']:,} parameters to {out_dir}: {summary}")
    return summary
