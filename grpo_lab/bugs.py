"""Deliberately broken variants, copied in spirit from the field reports.

The notebooks and checkers use these to show what each bug does; the trainer uses them
only when a config switch asks for the broken behaviour (the `naive` preset).
"""

from __future__ import annotations

import torch


def constant_clip_surrogate(
    logp: torch.Tensor,
    baseline_logp: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    log_ratio_clamp: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Report 000: `-torch.min(ratio * advantage, clip_ratio * advantage)`.

    `clip_ratio` is the constant clip range, not the clipped ratio. For A > 0 the min is
    eps * A (a constant, no gradient) as soon as r > eps; for A < 0 it is r * A, so the
    gradient grows with the ratio without bound: nothing is clipped where it matters.
    Same signature and return as `objective.clipped_surrogate`.
    """
    from .objective import ratio_from_logprobs

    ratio = ratio_from_logprobs(logp, baseline_logp, log_ratio_clamp)
    adv = advantages.unsqueeze(-1)  # (B, 1)
    per_token_loss = -torch.min(ratio * adv, epsilon_low * adv)
    region_clipped = (ratio > epsilon_low) & (adv > 0)
    return per_token_loss, region_clipped


def sequence_log_ratio_inputs(
    logp: torch.Tensor, baseline_logp: torch.Tensor, completion_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Report 001: the log-ratio summed over a completion, broadcast back to its tokens.

    Returns (logp', baseline') with logp' - baseline' = sum_t (logp - baseline) on every
    token of the row, so a surrogate computes exp(sum of log-ratios): after some drift
    that sum reaches tens, and exp() overflows float32 near 88.7."""
    m = completion_mask.to(logp.dtype)
    summed = ((logp - baseline_logp) * m).sum(-1, keepdim=True)  # (B, 1)
    return summed.expand_as(logp), torch.zeros_like(baseline_logp)


def broken_accumulation(trainer, batch, k: int, variant: str) -> None:
    """Accumulate `batch`'s gradient over k micro-batches the wrong way (report 003 and
    DESIGN.md), leaving the result in .grad like `Trainer.backward` does.

    'step-inside': zero_grad inside the micro-batch loop, so only the last survives.
    'copy': `p.grad.copy_(g)` in a hand-written gradient setter: the same loss, another way.
    'mean-per-micro-batch': each micro-batch normalised by its own tokens, then / k, so
    micro-batches with fewer tokens weigh more than in the full batch."""
    from .objective import token_weights
    from .trainer import micro_batches

    params = list(trainer.policy.parameters())
    for sl in micro_batches(batch.rewards.shape[0], k):
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
