"""Stretch exercises: checked like the others, not needed later in the course.

Each has a reference `reference_<name>` and a checker `check_<name>(your_fn)` built on the
helpers of `checks` (a checker never raises; it prints one verdict and returns a
`CheckResult` whose `.use()` is yours if it passed, else the reference).

02: `rloo_advantages`, `zero_std_group_filter`
03: `dual_clip_surrogate`, `clip_higher_fractions`, `sequence_level_ratio`
09: `estimator_expected_gradient`, `kl_gradients`, `adaptive_beta`

The grader and `labs` find these checkers through `labs.CHECKER_MODULES`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .. import naive, objective
from .checks import (
    CheckResult,
    Mismatch,
    _close,
    _expect,
    _fmt,
    _gen,
    _grad,
    _kind,
    _requires_grad,
    run_check,
)


def _as_float(x):
    """A one-element tensor or a numpy scalar as a Python float; anything else unchanged."""
    if isinstance(x, bool):
        return x
    if isinstance(x, torch.Tensor) and x.numel() == 1 and not x.is_complex():
        return float(x.detach())
    if not isinstance(x, (int, float)) and hasattr(x, "item") and getattr(x, "size", 0) == 1:
        try:
            return float(x.item())
        except (TypeError, ValueError):
            return x
    return float(x) if isinstance(x, int) else x


def _is(got, want) -> bool:
    """`got` is a tensor equal to `want` (a wrong answer the checker knows)."""
    return isinstance(got, torch.Tensor) and got.shape == want.shape and _close(got, want)


# --- 02 · rewards and advantages -------------------------------------------------------------
def reference_rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) rewards, consecutive groups of `group_size` >= 2 -> (B,) advantages.

    REINFORCE leave-one-out (RLOO; Ahmadian et al. 2024, TRL's RLOOTrainer): each reward
    minus the mean of the *other* G - 1 rewards of its group,
    A_i = r_i - (sum_j r_j - r_i) / (G - 1) = G / (G - 1) * (r_i - mean(group)).
    The advantages of a group sum to 0; an all-equal group gets 0.
    """
    if group_size < 2 or rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} >= 2 "
                         f"entries (got shape {tuple(rewards.shape)})")
    grouped = rewards.view(-1, group_size)  # (n_groups, G)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others).reshape(-1)


def check_rloo_advantages(fn: Callable) -> CheckResult:
    ref = reference_rloo_advantages

    def case(rewards, g):
        def run(f):
            got = f(rewards.clone(), g)
            want = ref(rewards, g)
            grouped = rewards.view(-1, g)
            centred = (grouped - grouped.mean(1, keepdim=True)).reshape(-1)
            if _is(got, centred) and not _close(centred, want):
                raise Mismatch(
                    "you included each sample in its own baseline: r - mean(group) is "
                    f"GRPO's centring, (G-1)/G = {(g - 1) / g:.3g} times RLOO's advantage. "
                    "Subtract the mean of the *other* G - 1 rewards: (group sum - r) / (G - 1)")
            scaled = objective.group_advantages(rewards, g)
            if _is(got, scaled) and not _close(scaled, want):
                raise Mismatch("this is GRPO's advantage, divided by the group's std; "
                               "RLOO only subtracts the leave-one-out mean")
            by_g = (grouped - (grouped.sum(1, keepdim=True) - grouped) / g).reshape(-1)
            if _is(got, by_g) and not _close(by_g, want):
                raise Mismatch("you divided the other rewards' sum by G; there are "
                               "G - 1 of them")
            if isinstance(got, torch.Tensor) and got.shape == want.shape and \
                    got.is_floating_point():
                sums = got.detach().double().view(-1, g).sum(-1)
                if sums.abs().max() > 1e-4:
                    raise Mismatch("your advantages do not sum to 0 within each group "
                                   f"(sums {_fmt(sums)}); the groups are consecutive, "
                                   "rewards.view(-1, group_size), and each reward's baseline "
                                   "is the mean of the others in its own group")
            _expect(got, want, f"RLOO advantages for rewards {_fmt(rewards)}, G={g}")
        return run

    rnd = torch.rand(12, generator=_gen(11))
    return run_check("rloo_advantages", fn, ref, [
        ("binary rewards, G=4", case(torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0]), 4)),
        ("G=2: each advantage is the difference of the pair",
         case(torch.tensor([1.0, 0.0, 0.3, 0.9, 0.5, 0.5]), 2)),
        ("random rewards, G=4 (sum to 0 per group)", case(rnd, 4)),
        ("random rewards, G=3", case(rnd, 3)),
        ("an all-equal group gives 0, not NaN (no std is involved), G=4",
         case(torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 0]), 4)),
        ("one right answer in G=8", case(torch.tensor([1.0] + [0.0] * 7), 8)),
    ])


def reference_zero_std_group_filter(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) rewards, consecutive groups -> (B,) bool mask, True on every row of a group whose
    rewards are not all equal (DAPO's dynamic sampling keeps only those groups; the others
    have advantage 0 and carry no signal).

    Equality is exact (max == min). `std() > 0` can call an all-equal group mixed: the
    float32 mean of eight 0.7s need not be exactly 0.7, and torch on CPU gives
    `torch.full((1, 8), 0.7).std(dim=1)` = 6e-8. A group of one (G = 1) has nothing to
    compare with, so it is all-equal by definition and G = 1 keeps nothing.
    """
    grouped = rewards.view(-1, group_size)  # (n_groups, G)
    mixed = grouped.amax(dim=1) != grouped.amin(dim=1)  # (n_groups,)
    return mixed.repeat_interleave(group_size)


def check_zero_std_group_filter(fn: Callable) -> CheckResult:
    ref = reference_zero_std_group_filter

    def case(rewards, g):
        def run(f):
            got = f(rewards.clone(), g)
            want = ref(rewards, g)
            n_groups = rewards.numel() // g
            what = f"rewards {_fmt(rewards)}, G={g}"
            if isinstance(got, torch.Tensor) and got.shape == (n_groups,) and n_groups != len(want):
                raise Mismatch(f"{what}: you returned one entry per group, shape ({n_groups},); "
                               f"return one per row, ({rewards.numel()},): each group's verdict "
                               "repeated for its G rows (repeat_interleave)")
            if isinstance(got, torch.Tensor) and got.shape == want.shape and \
                    got.dtype != torch.bool:
                raise Mismatch(f"{what}: return a bool mask (dtype {got.dtype} given): "
                               "rewards[mask] with a 0/1 integer tensor picks rows 0 and 1 "
                               "instead of masking")
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                _expect(got, want, f"{what}: the mask")
            if torch.equal(got, want):
                return
            grouped = rewards.view(-1, g)
            if torch.equal(got, ~want) and want.any():
                raise Mismatch(f"{what}: you kept the groups whose rewards are all equal; keep "
                               "the others (True = the group has signal)")
            if g == 1:
                raise Mismatch(f"{what}: with G=1 you kept rows; a group of one has nothing to "
                               "compare with (its advantage is 0), so G=1 keeps nothing")
            if torch.equal(got, (grouped.std(dim=1) > 0).repeat_interleave(g)):
                raise Mismatch(f"{what}: std() > 0 called a group of equal float rewards "
                               "mixed: rounding in the float32 mean left its std slightly "
                               "above 0; compare the values themselves (max == min)")
            right = (grouped == 1).all(dim=1).repeat_interleave(g)
            if torch.equal(got, want | right):
                raise Mismatch(f"{what}: you kept a group whose rewards are all 1; an "
                               "all-right group has zero spread too, like an all-wrong one, "
                               "and carries no signal")
            if torch.equal(got, (grouped != grouped[:, :1]).any(1).repeat(g)):
                raise Mismatch(f"{what}: rows in the wrong order; the groups are consecutive, "
                               "so repeat each verdict with repeat_interleave, not repeat")
            _expect(got, want, f"{what}: the mask")
        return run

    return run_check("zero_std_group_filter", fn, ref, [
        ("mixed, all-right and all-wrong groups, G=4",
         case(torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0]), 4)),
        ("every group all-equal: nothing kept",
         case(torch.tensor([0.0, 0, 0, 1, 1, 1]), 3)),
        ("every group mixed: everything kept", case(torch.tensor([0.0, 1, 1, 0, 0.5, 0.5]), 2)),
        ("partial-credit rewards: one group of eight equal 0.7s",
         case(torch.tensor([0.7] * 8), 8)),
        ("partial-credit rewards, two groups", case(torch.tensor([0.7] * 7 + [0.2] + [0.3] * 8),
                                                    8)),
        ("G=1 keeps nothing", case(torch.tensor([1.0, 0.0, 1.0]), 1)),
        ("one group of 5", case(torch.tensor([0.0, 0, 0, 0, 1]), 5)),
    ])


# --- 03 · the objective ----------------------------------------------------------------------
def reference_dual_clip_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    dual_clip: float = 3.0,
) -> torch.Tensor:
    """(B, C), (B, C), (B,) -> (B, C) per-token loss of dual-clip PPO (Ye et al. 2020).

    s = min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A), r = exp(logp - old_logp);
    loss = -max(s, dual_clip * A) where A < 0, and -s where A >= 0 (dual_clip > 1).
    """
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(-1)  # (B, 1)
    surrogate = torch.min(ratio * adv,
                          torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv)
    bounded = torch.max(surrogate, dual_clip * adv)
    return -torch.where(adv < 0, bounded, surrogate)


def check_dual_clip_surrogate(fn: Callable) -> CheckResult:
    ref = reference_dual_clip_surrogate
    g = _gen(12)
    old = -torch.rand(8, 3, generator=g) * 2
    # log-ratios from -1.5 to 3 (r from 0.22 to 20), none on a kink (log 0.8, log 1.2, log 3)
    log_r = torch.linspace(-1.5, 3.0, 24)[torch.randperm(24, generator=g)].view(8, 3)
    logp = old + log_r
    adv = torch.tensor([-1.0, -0.5, 1.0, -2.0, 0.7, -1.0, 1.5, 0.0])
    upstream = torch.rand(8, 3, generator=g) + 0.5

    def wrong(lp, a, lo, hi, c):
        ratio, a = torch.exp(lp - old), a.unsqueeze(-1)
        s = torch.min(ratio * a, torch.clamp(ratio, 1 - lo, 1 + hi) * a)
        return {"everywhere": -torch.max(s, c * a), "none": -s,
                "min": -torch.where(a < 0, torch.min(s, c * a), s)}

    def run(lo, hi, c):
        def case(f):
            what = f"eps_low={lo}, eps_high={hi}, dual_clip={c}"
            lp = logp.clone().requires_grad_(True)
            got = f(lp, old.clone(), adv.clone(), lo, hi, c)
            if isinstance(got, tuple):
                raise Mismatch("return the (B, C) per-token loss alone, not a tuple")
            want = ref(logp, old, adv, lo, hi, c)
            value = got.detach() if isinstance(got, torch.Tensor) else got
            bad = wrong(logp, adv, lo, hi, c)
            if _is(value, bad["everywhere"]):
                raise Mismatch("you applied the dual clip to positive advantages too: "
                               "for A > 0, dual_clip * A is above every value of the surrogate, "
                               "so max() makes the loss the constant -dual_clip * A and the "
                               "gradient 0; bound only the tokens with A < 0")
            if _is(value, bad["none"]):
                raise Mismatch("this is the plain clipped surrogate: for A < 0 and "
                               "r > dual_clip the loss must stop growing, at -dual_clip * A "
                               "(max(surrogate, dual_clip * A))")
            if _is(value, bad["min"]):
                raise Mismatch("bound with max, not min: for A < 0, dual_clip * A is "
                               "the lowest value the surrogate may take")
            _expect(value, want, f"{what}: the per-token loss (ratios 0.22 to 20, both signs "
                    "of A)")
            _requires_grad(got, "your per-token loss")
            lp2 = logp.clone().requires_grad_(True)
            want_grad = _grad(ref(lp2, old, adv, lo, hi, c), lp2, upstream, "the loss")
            _expect(_grad(got, lp, upstream, "the loss"), want_grad,
                    f"{what}: the gradient of the loss with respect to logp (it is 0 where the "
                    "dual clip binds)")
        return case

    def unmoved(f):
        got = f(old.clone(), old.clone(), adv.clone(), 0.2, 0.2, 3.0)
        _expect(got, -adv.unsqueeze(-1).expand(8, 3), "the loss when logp == old_logp (r = 1: "
                "-A on every token)")

    return run_check("dual_clip_surrogate", fn, ref, [
        ("eps 0.2 / 0.2, dual_clip=3: ratios far above 1 + eps with negative advantages",
         run(0.2, 0.2, 3.0)),
        ("eps 0.2 / 0.28 and dual_clip=2", run(0.2, 0.28, 2.0)),
        ("eps 0.1 / 0.3 and a loose dual_clip of 10", run(0.1, 0.3, 10.0)),
        ("ratio 1 when the policy has not moved", unmoved),
    ])


def reference_clip_higher_fractions(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.28,
) -> tuple[float, float]:
    """(B, C), (B, C), (B,) -> (low, high): the fractions of all B * C tokens clipped at the
    low bound (r < 1 - eps_low with A < 0) and at the high bound (r > 1 + eps_high with
    A > 0), r = exp(logp - old_logp). TRL logs them as clip_ratio/low_mean, high_mean."""
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(-1)
    low = (ratio < 1 - epsilon_low) & (adv < 0)
    high = (ratio > 1 + epsilon_high) & (adv > 0)
    return float(low.float().mean()), float(high.float().mean())


def check_clip_higher_fractions(fn: Callable) -> CheckResult:
    ref = reference_clip_higher_fractions
    g = _gen(13)
    old = -torch.rand(16, 10, generator=g) * 3
    logp = old + torch.randn(16, 10, generator=g) * 0.3
    adv = torch.randn(16, generator=g).sign()
    adv[3] = 0.0

    def frac(mask):
        return float(mask.float().mean())

    def run(lo, hi, lp=logp, a=adv):
        def case(f):
            what = f"eps_low={lo}, eps_high={hi}"
            got = f(lp.clone(), old.clone(), a.clone(), lo, hi)
            if not (isinstance(got, (tuple, list)) and len(got) == 2):
                raise Mismatch(f"{what}: return (low_fraction, high_fraction), a pair of floats "
                               f"(you returned {_kind(got)[:60]})")
            got = tuple(_as_float(x) for x in got)
            want = ref(lp, old, a, lo, hi)
            ratio, a1 = torch.exp(lp - old), a.unsqueeze(-1)
            no_sign = (frac(ratio < 1 - lo), frac(ratio > 1 + hi))
            low_eps = (want[0], frac((ratio > 1 + lo) & (a1 > 0)))
            n = ratio.numel()
            if all(isinstance(x, float) for x in got):
                if want[0] != want[1] and _close(got[0], want[1]) and _close(got[1], want[0]):
                    raise Mismatch("you returned (high, low); return (low, high)")
                if _close(got[0], no_sign[0]) and _close(got[1], no_sign[1]) and no_sign != want:
                    raise Mismatch("a token past a bound is clipped only when its "
                                   "advantage pushes it further: r < 1 - eps_low with A < 0, "
                                   "r > 1 + eps_high with A > 0 (with the other sign the min "
                                   "keeps r * A and the gradient flows)")
                if hi != lo and _close(got[1], low_eps[1]) and low_eps[1] != want[1]:
                    raise Mismatch("the high bound is 1 + epsilon_high, not "
                                   "1 + epsilon_low")
                if _close(got[0], want[0] * n) and _close(got[1], want[1] * n) and any(want):
                    raise Mismatch("you returned counts; return fractions of all "
                                   f"B * C = {n} tokens")
            _expect(got[0], want[0], f"{what}: the low-bound fraction")
            _expect(got[1], want[1], f"{what}: the high-bound fraction")
        return case

    return run_check("clip_higher_fractions", fn, ref, [
        ("a symmetric clip range, 0.2 and 0.2", run(0.2, 0.2)),
        ("DAPO's clip-higher, 0.2 and 0.28", run(0.2, 0.28)),
        ("ratio 1 everywhere: nothing is clipped", run(0.2, 0.28, lp=old)),
        ("every advantage positive: nothing at the low bound",
         run(0.2, 0.28, a=torch.ones(16))),
    ])


def reference_sequence_level_ratio(logp: torch.Tensor, old_logp: torch.Tensor,
                                   completion_mask: torch.Tensor) -> torch.Tensor:
    """(B, C), (B, C), (B, C) mask -> (B,) GSPO's sequence ratio (Zheng et al. 2025):
    exp of the mean of (logp - old_logp) over each completion's real tokens, i.e. the
    geometric mean of the token ratios. Padding does not count; a row with no completion
    tokens gets ratio 1."""
    m = completion_mask.to(logp.dtype)
    n_tokens = m.sum(-1).clamp(min=1.0)
    return torch.exp(((logp - old_logp) * m).sum(-1) / n_tokens)


def check_sequence_level_ratio(fn: Callable) -> CheckResult:
    ref = reference_sequence_level_ratio
    g = _gen(14)
    lengths = [3, 1, 5, 4, 0]
    mask = torch.tensor([[1] * n + [0] * (5 - n) for n in lengths])  # (5, 5), a last empty row
    old = -torch.rand(5, 5, generator=g) * 3
    log_r = torch.randn(5, 5, generator=g) * 0.3
    log_r = torch.where(mask.bool(), log_r, torch.full_like(log_r, 30.0))  # padding: garbage
    logp = old + log_r
    upstream = torch.rand(5, generator=g) + 0.5

    def named(got, lp, o, m):
        mf = m.float()
        summed = ((lp - o) * mf).sum(-1)
        want = ref(lp, o, m)
        if _is(got, torch.exp(summed)) and not _close(torch.exp(summed), want) or (
                isinstance(got, torch.Tensor) and got.shape == want.shape and
                torch.isinf(got).any() and not torch.isinf(want).any()):
            raise Mismatch("summed instead of averaged: exp of the *sum* of the log-ratios is "
                           "report 001's sequence ratio (grpo_lab.naive.sequence_log_ratio_inputs)"
                           "; it overflows float32 once the sum passes 88.7. GSPO divides the "
                           "sum by the completion's length: exp(mean log-ratio)")
        by_width = torch.exp(summed / m.shape[-1])
        if _is(got, by_width) and not _close(by_width, want):
            raise Mismatch(f"you divided by the tensor's width ({m.shape[-1]}); divide by each "
                           "row's number of real tokens, mask.sum(-1): padding must not count")
        if _is(got, torch.exp((lp - o).mean(-1))) and not _close(torch.exp((lp - o).mean(-1)),
                                                                 want):
            raise Mismatch("the padding counted: multiply the log-ratios by the mask before "
                           "summing, and divide by mask.sum(-1)")
        arith = (torch.exp(lp - o) * mf).sum(-1) / mf.sum(-1).clamp(min=1)
        if _is(got, arith) and not _close(arith, want):
            raise Mismatch("you averaged the ratios; GSPO's ratio is their geometric mean, "
                           "exp of the mean *log*-ratio")
        if isinstance(got, torch.Tensor) and got.shape == want.shape and \
                torch.isnan(got[m.sum(-1) == 0]).any():
            raise Mismatch("a row with no completion tokens (all padding) gives NaN: 0 / 0; "
                           "clamp the token count to at least 1 (the row's ratio is then 1)")

    def values(f):
        lp = logp.clone().requires_grad_(True)
        got = f(lp, old.clone(), mask.clone())
        value = got.detach() if isinstance(got, torch.Tensor) else got
        named(value, logp, old, mask)
        _expect(value, ref(logp, old, mask), "the sequence ratios for lengths [3, 1, 5, 4, 0] "
                "(padding holds log-ratios of 30)")
        _requires_grad(got, "your sequence ratio")
        lp2 = logp.clone().requires_grad_(True)
        want_grad = _grad(ref(lp2, old, mask), lp2, upstream, "the ratio")
        _expect(_grad(got, lp, upstream, "the ratio"), want_grad,
                "the gradient of the ratio with respect to logp (ratio * mask / length per "
                "token; 0 on padding)")

    def long(f):
        c = 400
        o = -torch.rand(2, c, generator=_gen(15)) * 2
        lp = o + torch.tensor([[0.25], [-0.05]])  # summed: 100 (exp overflows) and -20
        m = torch.ones(2, c, dtype=torch.long)
        got = f(lp.clone(), o.clone(), m.clone())
        named(got, lp, o, m)
        _expect(got, ref(lp, o, m), f"two completions of {c} tokens (mean log-ratio 0.25 and "
                "-0.05)")

    def bool_mask(f):
        got = f(logp.clone(), old.clone(), mask.bool())
        named(got, logp, old, mask)
        _expect(got, ref(logp, old, mask), "the ratios with a bool mask")

    def unmoved(f):
        got = f(old.clone(), old.clone(), mask.clone())
        _expect(got, torch.ones(5), "the ratio when logp == old_logp")

    return run_check("sequence_level_ratio", fn, ref, [
        ("values and gradients; padding must not count", values),
        ("a long completion (400 tokens)", long),
        ("a bool mask", bool_mask),
        ("ratio 1 when the policy has not moved", unmoved),
    ])


# --- 09 · the KL formula ---------------------------------------------------------------------
def reference_estimator_expected_gradient(estimator: Callable, logits: torch.Tensor,
                                          ref_logits: torch.Tensor) -> torch.Tensor:
    """(V,) logits (a leaf with requires_grad=True), (V,) fixed ref_logits -> (V,)
    E_{x ~ p}[d estimator(log p(x), log q(x)) / d logits], exactly, by enumeration:
    sum_x p(x).detach() * gradient of the estimator at x. The sample is not differentiated
    (no score-function term): that is what a per-token loss on sampled tokens does."""
    theta = logits if logits.requires_grad else logits.detach().requires_grad_(True)
    logp = theta.log_softmax(-1)
    ref_logp = ref_logits.detach().log_softmax(-1)
    loss = (logp.exp().detach() * estimator(logp, ref_logp)).sum()
    (grad,) = torch.autograd.grad(loss, theta)
    return grad


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


def _grad_left(leaf: torch.Tensor, what: str) -> None:
    if leaf.grad is not None:
        raise Mismatch(f"{what}: your function left a gradient in logits.grad (a .backward() on "
                       "the caller's tensor): the caller's next backward() would add to it. "
                       "Use torch.autograd.grad(loss, logits), or work on a detached copy")


def check_estimator_expected_gradient(fn: Callable) -> CheckResult:
    ref = reference_estimator_expected_gradient
    g = _gen(16)
    pairs = [(torch.randn(8, generator=g), torch.randn(8, generator=g)) for _ in range(2)]
    peaked = (torch.randn(5, generator=g) * 3, torch.randn(5, generator=g))

    def wrong(est, logits, ref_logits):
        theta = _leaf(logits)
        logp, logq = theta.log_softmax(-1), ref_logits.log_softmax(-1)
        (full,) = torch.autograd.grad((logp.exp() * est(logp, logq)).sum(), theta)
        theta = _leaf(logits)
        logp = theta.log_softmax(-1)
        (uniform,) = torch.autograd.grad(est(logp, logq).mean(), theta)
        theta = _leaf(logits)
        (raw,) = torch.autograd.grad((theta.softmax(-1).detach() * est(theta, ref_logits)).sum(),
                                     theta)
        return full, uniform, raw

    def case(est, name, logits, ref_logits):
        def run(f):
            what = f"{name}, V={logits.numel()}"
            leaf = _leaf(logits)
            got = f(est, leaf, ref_logits.clone())
            _grad_left(leaf, what)
            value = got.detach() if isinstance(got, torch.Tensor) else got
            want = ref(est, logits, ref_logits)
            full, uniform, raw = wrong(est, logits, ref_logits)
            if _is(value, full) and not _close(full, want):
                raise Mismatch(f"{what}: you differentiated the weights p(x) too (the full "
                               "gradient of sum_x p(x) k(x)); the sample comes from p and a "
                               "loss on it does not move p: weight by p.detach()")
            if _is(value, uniform) and not _close(uniform, want):
                raise Mismatch(f"{what}: you averaged over the vocabulary; weight each token's "
                               "gradient by p(x), its probability under the policy")
            if _is(value, raw) and not _close(raw, want):
                raise Mismatch(f"{what}: pass the estimator log-probabilities, log_softmax of "
                               "the logits, not the raw logits")
            _expect(value, want, f"{what}: the expected gradient")
        return run

    a = pairs[0][0]
    cases = [(f"{n} on random logits, V=8", case(e, n, *pairs[0]))
             for n, e in (("k1", objective.kl_k1), ("k2", objective.kl_k2),
                          ("k3", objective.kl_k3))]
    return run_check("estimator_expected_gradient", fn, ref, cases + [
        ("k3 on another pair", case(objective.kl_k3, "k3", *pairs[1])),
        ("k2 on a peaked policy, V=5", case(objective.kl_k2, "k2", *peaked)),
        ("report 003's clamp as the estimator", case(naive.report003_kl, "report 003's clamp",
                                                     *pairs[1])),
        ("identical distributions: k3's expected gradient is 0",
         case(objective.kl_k3, "k3 with p = q", a, a.clone())),
    ])


def reference_kl_gradients(logits: torch.Tensor,
                           ref_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(V,) logits (a leaf with requires_grad=True), (V,) fixed ref_logits -> the (V,)
    gradients with respect to the logits of KL(p || q) and of KL(q || p), exactly;
    p = softmax(logits), q = softmax(ref_logits). With p the policy, KL(p || q) is the
    reverse KL and KL(q || p) the forward KL, as the RL literature names them. In closed
    form: p * (log p - log q - KL(p || q)) and p - q."""
    theta = logits if logits.requires_grad else logits.detach().requires_grad_(True)
    logp = theta.log_softmax(-1)
    logq = ref_logits.detach().log_softmax(-1)
    reverse = (logp.exp() * (logp - logq)).sum()  # KL(p || q)
    forward = (logq.exp() * (logq - logp)).sum()  # KL(q || p)
    (g_reverse,) = torch.autograd.grad(reverse, theta, retain_graph=True)
    (g_forward,) = torch.autograd.grad(forward, theta)
    return g_reverse, g_forward


def check_kl_gradients(fn: Callable) -> CheckResult:
    ref = reference_kl_gradients
    g = _gen(17)
    a, b = torch.randn(8, generator=g), torch.randn(8, generator=g)
    c, d = torch.randn(3, generator=g) * 4, torch.randn(3, generator=g)

    def case(logits, ref_logits, what):
        def run(f):
            leaf = _leaf(logits)
            got = f(leaf, ref_logits.clone())
            _grad_left(leaf, what)
            if not (isinstance(got, (tuple, list)) and len(got) == 2):
                raise Mismatch(f"{what}: return (grad of KL(p || q), grad of KL(q || p)), a pair "
                               f"of (V,) tensors (you returned {_kind(got)[:60]})")
            got = [x.detach() if isinstance(x, torch.Tensor) else x for x in got]
            want = ref(logits, ref_logits)
            if _is(got[0], want[1]) and _is(got[1], want[0]) and not _close(*want):
                raise Mismatch(f"{what}: you returned them swapped: first the gradient of "
                               "KL(p || q) (the policy's own expectation), then KL(q || p)")
            logp, logq = logits.log_softmax(-1), ref_logits.log_softmax(-1)
            if _is(got[0], logp - logq + 1) or _is(got[1], -(logq - logp).exp()):
                raise Mismatch(f"{what}: that is the gradient with respect to the probabilities "
                               "p; the logits go through softmax first (autograd through "
                               "log_softmax, or the chain rule)")
            _expect(got[0], want[0], f"{what}: the gradient of KL(p || q)")
            _expect(got[1], want[1], f"{what}: the gradient of KL(q || p)")
        return run

    return run_check("kl_gradients", fn, ref, [
        ("random logits, V=8", case(a, b, "random logits, V=8")),
        ("the pair the other way round", case(b, a, "swapped pair, V=8")),
        ("a peaked policy, V=3", case(c, d, "peaked, V=3")),
        ("identical distributions: both gradients are 0", case(a, a + 2.0, "p = q")),
    ])


def reference_adaptive_beta(beta: float, kl: float, target_kl: float, horizon: float,
                            n_steps: int = 1) -> float:
    """The adaptive KL controller of Ziegler et al. 2019 (TRL's old PPOTrainer,
    AdaptiveKLController.update): error = clip(kl / target - 1, -0.2, 0.2);
    beta * (1 + error * n_steps / horizon), the new coefficient."""
    error = min(max(kl / target_kl - 1.0, -0.2), 0.2)
    return beta * (1.0 + error * n_steps / horizon)


def check_adaptive_beta(fn: Callable) -> CheckResult:
    ref = reference_adaptive_beta

    def case(beta, kl, target, horizon, n_steps=None):
        def run(f):
            args = (beta, kl, target, horizon) + (() if n_steps is None else (n_steps,))
            n = 1 if n_steps is None else n_steps
            what = (f"beta={beta}, kl={kl}, target_kl={target}, horizon={horizon}, "
                    f"n_steps={n_steps if n_steps is not None else '1 (the default)'}")
            got = _as_float(f(*args))
            want = ref(*args)
            raw = kl / target - 1.0
            if isinstance(got, float) and not math.isclose(got, want, rel_tol=1e-6):
                if raw != max(min(raw, 0.2), -0.2) and math.isclose(
                        got, beta * (1 + raw * n / horizon), rel_tol=1e-6):
                    raise Mismatch(f"{what}: unclipped error: kl / target - 1 = {raw:.3g} must "
                                   "be clipped to [-0.2, 0.2] first, so one odd KL reading "
                                   "cannot swing beta")
                if math.isclose(got, ref(beta, target - (kl - target), target, horizon, n),
                                rel_tol=1e-6):
                    raise Mismatch(f"{what}: beta moves the wrong way; it must rise while the KL "
                                   "is above target (a stronger pull back) and fall below it")
                if math.isclose(got, ref(beta, kl, target, horizon, 1), rel_tol=1e-6):
                    raise Mismatch(f"{what}: n_steps is ignored; the step is error * n_steps / "
                                   "horizon")
                if math.isclose(got, beta + min(max(raw, -0.2), 0.2) * n / horizon,
                                rel_tol=1e-6):
                    raise Mismatch(f"{what}: the update is multiplicative: beta * (1 + error * "
                                   "n_steps / horizon), not beta + ...")
            if not isinstance(got, float):
                raise Mismatch(f"{what}: return the new beta as a number (you returned "
                               f"{_kind(got)[:60]})")
            if not math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-12):
                raise Mismatch(f"{what}: yours is {got:.8g}, expected {want:.8g}")
        return run

    return run_check("adaptive_beta", fn, ref, [
        ("KL 10% above target", case(0.1, 0.11, 0.1, 10_000, 1)),
        ("KL below target", case(0.1, 0.09, 0.1, 100, 4)),
        ("KL five times the target: the error is clipped to 0.2", case(0.1, 0.5, 0.1, 10_000, 256)),
        ("KL = 0: the error is clipped to -0.2", case(0.05, 0.0, 0.1, 1_000, 64)),
        ("KL on target: beta unchanged", case(0.2, 6.0, 6.0, 10_000, 256)),
        ("n_steps defaults to 1", case(0.2, 7.0, 6.0, 50)),
        ("TRL's old defaults (beta 0.2, target 6, horizon 10000, 256 rows), KL 12",
         case(0.2, 12.0, 6.0, 10_000, 256)),
    ])


STRETCH_CHECKS = {
    "rloo_advantages": (check_rloo_advantages, reference_rloo_advantages),
    "zero_std_group_filter": (check_zero_std_group_filter, reference_zero_std_group_filter),
    "dual_clip_surrogate": (check_dual_clip_surrogate, reference_dual_clip_surrogate),
    "clip_higher_fractions": (check_clip_higher_fractions, reference_clip_higher_fractions),
    "sequence_level_ratio": (check_sequence_level_ratio, reference_sequence_level_ratio),
    "estimator_expected_gradient": (check_estimator_expected_gradient,
                                    reference_estimator_expected_gradient),
    "kl_gradients": (check_kl_gradients, reference_kl_gradients),
    "adaptive_beta": (check_adaptive_beta, reference_adaptive_beta),
}

