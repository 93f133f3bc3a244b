"""What the naive preset switches on: the field reports' versions of the ratio and the
clipped term, each selected by a config field (`clip_term='constant'`,
`ratio_level='sequence'`; `ratio_against='reference'` needs no code of its own); and report
003's KL "fix", which no config selects (notebook 09, the scenarios, the mystery runs).

The correct versions are in objective.py; these have the same signatures. The step's loss
is chosen at one place (`step.loss_for`): `configured_loss` below when the config switches
any of them on.
"""

from __future__ import annotations

import torch

from .objective import clipped_surrogate, ratio_from_logprobs, weighted_loss


def uses_reported_loss(cfg) -> bool:
    """Whether the config switches on any of the reports' versions of the policy loss."""
    return (cfg.ratio_against, cfg.ratio_level, cfg.clip_term) != ("old", "token",
                                                                    "clipped_ratio")


def configured_loss(logp, old_logp, ref_logp, advantages, weights, cfg):
    """The step's loss (step.grpo_loss's signature) with the reports' versions the config
    asks for: the ratio against the frozen reference (`ratio_against`), summed over each
    completion (`ratio_level`), the constant clip term (`clip_term`); plus beta * k3.
    stats: 'kl', 'clip_ratio/region_mean', 'log_ratio/max_abs' (of the ratio it uses)."""
    m = weights != 0
    base = old_logp if cfg.ratio_against == "old" else ref_logp
    ratio_logp = logp
    if cfg.ratio_level == "sequence":
        ratio_logp, base = sequence_log_ratio_inputs(logp, base, m)
    surrogate = clipped_surrogate if cfg.clip_term == "clipped_ratio" else constant_clip_surrogate
    per_token, region_clipped = surrogate(ratio_logp, base, advantages, cfg.epsilon_low,
                                          cfg.epsilon_high, cfg.log_ratio_clamp)
    return weighted_loss(per_token, region_clipped, ratio_logp.detach() - base, logp, ref_logp,
                         weights, cfg.beta)


def constant_clip_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    log_ratio_clamp: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Report 001's line 57: `-torch.min(ratio * advantage, clip_ratio * advantage)`, read
    as the course reads it: `clip_ratio` is never defined in the report (its config key is
    `clip_range`), and the course takes it to be the constant clip range.

    `clip_ratio` is the constant clip range, not the clipped ratio. For A > 0 the min is
    eps * A (a constant, no gradient) as soon as r > eps; for A < 0 it is r * A, so the
    gradient grows with the ratio without bound: nothing is clipped where it matters.
    Same signature and return as `objective.clipped_surrogate`.
    """
    ratio = ratio_from_logprobs(logp, old_logp, log_ratio_clamp)
    adv = advantages.unsqueeze(-1)  # (B, 1)
    per_token_loss = -torch.min(ratio * adv, epsilon_low * adv)
    region_clipped = (ratio > epsilon_low) & (adv > 0)
    return per_token_loss, region_clipped


def sequence_log_ratio_inputs(
    logp: torch.Tensor, old_logp: torch.Tensor, completion_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Report 001: the log-ratio summed over a completion, broadcast back to its tokens.

    Returns (logp', baseline') with logp' - baseline' = sum_t (logp - baseline) on every
    token of the row, so a surrogate computes exp(sum of log-ratios): after some drift
    that sum reaches tens, and exp() overflows float32 near 88.7."""
    m = completion_mask.to(logp.dtype)
    summed = ((logp - old_logp) * m).sum(-1, keepdim=True)  # (B, 1)
    return summed.expand_as(logp), torch.zeros_like(old_logp)


def reported_surrogate(logp: torch.Tensor, ref_logp: torch.Tensor, advantages: torch.Tensor,
                       completion_mask: torch.Tensor, epsilon_low: float = 0.2,
                       log_ratio_clamp: float | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Report 001's policy loss per token, as the course reads it (notebook 05): the
    log-ratio against the *reference*, summed over each completion (optionally clamped, the
    reports' first fix), `exp`, and the constant clip term -min(r A, eps_low A). The naive
    preset's Trainer computes the same number token by token (sequence_log_ratio_inputs,
    then constant_clip_surrogate); here it is one number per row, as the learner writes it,
    so a gradient sums over the row in the learner's order.
    Returns ((B, 1) per-row loss, broadcast over the row's tokens; (B, 1) summed log-ratio)."""
    m = completion_mask.to(logp.dtype)
    log_ratio = ((logp - ref_logp) * m).sum(-1, keepdim=True)  # (B, 1), against the reference
    clamped = log_ratio if log_ratio_clamp is None else log_ratio.clamp(-log_ratio_clamp,
                                                                         log_ratio_clamp)
    adv = advantages.unsqueeze(-1)  # (B, 1)
    return -torch.min(torch.exp(clamped) * adv, epsilon_low * adv), log_ratio


def report003_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Report 003's replacement for k3, per token: `delta = (ref - cur).clamp(-10, 10);
    kl = delta.clamp(0, 10)`. Biased (its mean is not the KL; notebook 09 measures it), and
    it drops every token the policy made more likely than the reference did."""
    return (ref_logp - logp).clamp(-10, 10).clamp(0, 10)
