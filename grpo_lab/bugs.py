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
    log_ratio = logp - baseline_logp
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
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
