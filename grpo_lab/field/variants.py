"""Runs of one config of the Trainer, for comparing the field reports' fixes (notebook 06).

Both are functions of the config alone (the Trainer seeds itself from cfg.seed), so a test
session computes each once (grpo_lab/memo.py).
"""

from __future__ import annotations

import math

from ..config import GRPOConfig
from ..memo import once_per_session
from ..sampling import MULTINOMIAL_ERROR
from ..trainer import Trainer


@once_per_session
def short_run(cfg: GRPOConfig) -> dict:
    """cfg.steps steps of a fresh Trainer(cfg), one `step()` at a time; the sampling crash
    ends the run early (any other error is raised). The last step ends with the trainer's
    greedy evaluation on cfg.eval_size held-out problems.

    Returns 'history' (the metrics rows), 'crash' (the step that crashed, or None), and
    from the history: 'max_log_ratio' (the largest |log-ratio| before any clamp),
    'max_grad_norm' (the largest finite one), 'first_nan' (the first step with non-finite
    parameters, or None), 'skipped' (updates skipped) and 'accuracy' (the final greedy
    accuracy, None after a crash)."""
    trainer = Trainer(cfg)
    crash = None
    try:
        while trainer.step_count < cfg.steps:
            trainer.step()
    except RuntimeError as e:
        if MULTINOMIAL_ERROR not in str(e):
            raise
        crash = trainer.step_count + 1
    h = trainer.history
    return {
        "history": h,
        "crash": crash,
        "max_log_ratio": max(m["log_ratio/max_abs"] for m in h),
        "max_grad_norm": max(m["grad_norm"] for m in h if math.isfinite(m["grad_norm"])),
        "first_nan": next((m["step"] for m in h if m["nonfinite_params"] > 0), None),
        "skipped": sum(m["skipped"] for m in h),
        "accuracy": None if crash else h[-1]["eval/accuracy"],
    }


@once_per_session
def trained_history(cfg: GRPOConfig) -> list[dict]:
    """`Trainer(cfg).train(progress=False)`: the metrics rows of a whole run."""
    return Trainer(cfg).train(progress=False)
