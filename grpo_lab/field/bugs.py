"""Deliberately broken code from the field reports that no config switch selects: the
notebooks, checkers and scenarios run it beside the trainer's correct version.
(The broken variants the naive preset trains with are in `grpo_lab.naive`.)
"""

from __future__ import annotations

from ..objective import token_weights
from ..trainer import micro_batch_slices


def broken_accumulation(trainer, batch, k: int, variant: str) -> None:
    """Accumulate `batch`'s gradient over k micro-batches the wrong way (report 003's
    step and copy_, and a per-micro-batch normalisation), leaving the result in .grad like `step.accumulate` does.

    'step-inside': zero_grad inside the micro-batch loop, so only the last survives.
    'copy': `p.grad.copy_(g)` in a hand-written gradient setter: the same loss, another way.
    'mean-per-micro-batch': each micro-batch normalised by its own tokens, then / k, so
    micro-batches with fewer tokens weigh more than in the full batch."""
    params = list(trainer.policy.parameters())
    for sl in micro_batch_slices(batch.rewards.shape[0], k):
        part = batch.rows(sl)
        if variant == "step-inside":
            trainer.optimizer.zero_grad(set_to_none=True)
        elif variant == "mean-per-micro-batch":
            mask = part.rollout.completion_mask
            part.weights = token_weights(mask, trainer.cfg.loss_type, trainer.cfg.max_new_tokens) / k
        elif variant != "copy":
            raise ValueError(f"unknown accumulation variant {variant!r}")
        before = [None if p.grad is None else p.grad.clone() for p in params]
        if variant == "copy":
            trainer.optimizer.zero_grad(set_to_none=True)
        trainer.backward(part, grad_accum_steps=1)
        if variant == "copy":
            for p, old in zip(params, before, strict=True):
                if old is not None and p.grad is not None:
                    p.grad = old.copy_(p.grad)  # overwrite, not add
