"""Notebook 03, the grpo objective: the checks of its exercises, and each exercise as
data in `EXERCISES`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ... import naive, objective
from ...numerics import K3_FLOOR
from ...objective import clipped_surrogate, kl_k3, token_weights
from .base import (
    CheckResult,
    Exercise,
    Mismatch,
    as_float,
    close,
    expect,
    gen,
    grad_of,
    kind_of,
    requires_grad,
    run_check,
    same_value,
)


def check_kl_k3(fn: Callable) -> CheckResult:
    ref = objective.kl_k3
    logp = -torch.rand(4, 5, generator=gen(4)) * 3
    ref_logp = -torch.rand(4, 5, generator=gen(5)) * 3
    upstream = torch.rand(4, 5, generator=gen(8)) + 0.5

    def run(f):
        got = f(logp.clone(), ref_logp.clone())
        if isinstance(got, torch.Tensor) and got.shape == logp.shape and (got < K3_FLOOR).any():
            raise Mismatch("your k3 is negative somewhere; k3 = exp(rho) - rho - 1 with "
                           "rho = ref_logp - logp is never negative")
        if isinstance(got, torch.Tensor) and close(got, ref(ref_logp, logp)):
            raise Mismatch("your log-ratio has the wrong sign: rho = ref_logp - logp, "
                           "reference minus policy (k3 = exp(rho) - rho - 1)")
        if isinstance(got, torch.Tensor) and close(got, naive.report003_kl(logp, ref_logp)):
            raise Mismatch("this is report 003's 'fix' (ref_logp - logp).clamp(0, 10): it is "
                           "biased (notebook 09 measures it); k3 = exp(r) - r - 1 is not")
        expect(got, ref(logp, ref_logp), "k3")

    def gradient(f):
        lp = logp.clone().requires_grad_(True)
        got = f(lp, ref_logp.clone())
        expect(got.detach() if isinstance(got, torch.Tensor) else got, ref(logp, ref_logp),
                "k3")
        requires_grad(got, "your k3")
        lp2 = logp.clone().requires_grad_(True)
        want = grad_of(ref(lp2, ref_logp), lp2, upstream, "k3")
        expect(grad_of(got, lp, upstream, "k3"), want, "the gradient of k3 with respect to logp")

    def equal(f):
        expect(f(logp.clone(), logp.clone()), torch.zeros_like(logp), "k3 for identical policies")

    return run_check("kl_k3", fn, ref, [("random log-probs", run), ("identical policies", equal),
                                        ("the gradient with respect to logp", gradient)])


def check_clipped_surrogate(fn: Callable) -> CheckResult:
    ref = objective.clipped_surrogate
    old = -torch.rand(6, 3, generator=gen(6)) * 2
    log_r = torch.tensor([-1.0, -0.3, -0.1, 0.0, 0.1, 0.3]).unsqueeze(-1).expand(6, 3)
    logp = old + log_r
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
    upstream = torch.rand(6, 3, generator=gen(9)) + 0.5

    def pair(got):
        if not (isinstance(got, tuple) and len(got) == 2):
            raise Mismatch("return (per_token_loss, region_clipped), a pair of (B, C) tensors")
        return got

    def run(f, eps_low=0.2, eps_high=0.2, adv=adv):
        lp = logp.clone().requires_grad_(True)
        got = pair(f(lp, old.clone(), adv.clone(), eps_low, eps_high))
        want_loss, want_clipped = ref(logp, old, adv, eps_low, eps_high)
        const, _ = naive.constant_clip_surrogate(logp, old, adv, eps_low, eps_high)
        loss = got[0].detach() if isinstance(got[0], torch.Tensor) else got[0]
        if close(loss, const) and not close(loss, want_loss):
            raise Mismatch("your clipped term multiplies the advantage by the clip range "
                           "(report 001's `clip_ratio * advantage`); clip the *ratio*: "
                           "clamp(r, 1 - eps_low, 1 + eps_high) * A")
        if eps_high != eps_low and close(loss, ref(logp, old, adv, eps_low, eps_low)[0]) \
                and not close(loss, want_loss):
            raise Mismatch(f"the upper clip bound ignores eps_high: a token with A > 0 and r = "
                           f"1.35 gets clip(r) = 1 + eps_low = {1 + eps_low:g}, expected 1 + "
                           f"eps_high = {1 + eps_high:g}; clamp(r, 1 - eps_low, 1 + eps_high)")
        if eps_high != eps_low and close(loss, ref(logp, old, adv, eps_high, eps_low)[0]) \
                and not close(loss, want_loss):
            raise Mismatch(f"your clip bounds are swapped: the lower bound is 1 - eps_low = "
                           f"{1 - eps_low:g}, the upper 1 + eps_high = {1 + eps_high:g}; "
                           "clamp(r, 1 - eps_low, 1 + eps_high)")
        expect(loss, want_loss, f"the per-token loss (eps_low={eps_low}, eps_high={eps_high})")
        clipped = got[1]
        if isinstance(clipped, torch.Tensor) and clipped.shape == want_clipped.shape and \
                bool((clipped.bool() & (adv == 0)[:, None]).any()):
            raise Mismatch("region_clipped marks tokens whose advantage is 0 (what an "
                           "all-equal group gives): the clip changes nothing there, so the "
                           "signs are strict, r < 1 - eps_low with A < 0 and r > 1 + eps_high "
                           "with A > 0")
        r = (logp - old).exp()
        sign_blind = (r < 1 - eps_low) | (r > 1 + eps_high)
        if isinstance(clipped, torch.Tensor) and clipped.shape == sign_blind.shape and \
                torch.equal(clipped.bool(), sign_blind) and not torch.equal(sign_blind,
                                                                              want_clipped):
            raise Mismatch("region_clipped marks every token outside [1 - eps_low, 1 + eps_high] "
                           "whatever the sign of A: a token is clipped only where the clip "
                           "changes its loss, r < 1 - eps_low with A < 0 and r > 1 + eps_high "
                           "with A > 0")
        expect(clipped.bool() if isinstance(clipped, torch.Tensor) else clipped, want_clipped,
                "region_clipped")
        requires_grad(got[0], "your per-token loss")
        lp2 = logp.clone().requires_grad_(True)
        want = grad_of(ref(lp2, old, adv, eps_low, eps_high)[0], lp2, upstream, "the loss")
        grad = grad_of(got[0], lp, upstream, "the loss")
        inside = ((r >= 1 - eps_low) & (r <= 1 + eps_high))
        if isinstance(grad, torch.Tensor) and grad.shape == want.shape and not close(grad, want) \
                and close(grad[inside], want[inside] / 2) and close(grad[~inside], want[~inside]):
            raise Mismatch("inside the clip range your gradient is half the expected one: "
                           "there r x A and clip(r) x A are equal, torch.min splits the gradient "
                           "between them, and your clipped branch carries none (detached?); "
                           "keep both branches differentiable")
        expect(grad, want, "the gradient of the loss with respect to logp")

    def clamp(f):
        far = old + torch.tensor([-30.0, -3.0, 0.0, 3.0, 30.0, 1.0]).unsqueeze(-1)
        got = pair(f(far.clone(), old.clone(), adv.clone(), 0.2, 0.2, log_ratio_clamp=2.0))
        want = ref(far, old, adv, 0.2, 0.2, log_ratio_clamp=2.0)[0]
        loss = got[0].detach() if isinstance(got[0], torch.Tensor) else got[0]
        if close(loss, ref(far, old, adv, 0.2, 0.2)[0]) and not close(loss, want):
            raise Mismatch("log_ratio_clamp=2.0 changed nothing: clamp log r = logp - "
                           "old_logp to [-2, 2] before exp (with log r = 30, exp overflows "
                           "the loss)")
        log_r = far - old
        for wrong_log_r, words in (  # the reference, fed the log-ratio each mistake leaves
                (log_r.exp().clamp(-2.0, 2.0).log(), "you clamped the ratio r itself to "
                 "[-2, 2]; clamp the log-ratio, then exp: r = exp(clamp(logp - old_logp, -2, "
                 "2))"),
                (log_r.clamp(max=2.0), "only the upper side is clamped: a log-ratio of -30 is "
                 "left as it is; clamp both sides, [-c, c]")):
            if close(loss, ref(old + wrong_log_r, old, adv, 0.2, 0.2)[0]) and \
                    not close(loss, want):
                raise Mismatch(words)
        expect(loss, want, "the per-token loss with log_ratio_clamp=2.0 (log r of +-3, +-30)")

    def reference_ratio(f):
        # a ratio against the old policy is 1 when nothing changed: loss = -A on every token
        got = pair(f(old.clone(), old.clone(), adv.clone(), 0.2, 0.2))
        expect(got[0], -adv.unsqueeze(-1).expand(6, 3), "the loss when logp == old_logp")

    def on_the_bound(f):
        # eps = 0 puts r = 1 exactly on both bounds: the region is strict (TRL), so nothing
        # is clipped; `<=` / `>=` would mark every token
        got = pair(f(old.clone(), old.clone(), adv.clone(), 0.0, 0.0))
        clipped = got[1]
        if isinstance(clipped, torch.Tensor) and clipped.shape == (6, 3) and bool(clipped.all()):
            raise Mismatch("region_clipped marks a ratio that sits exactly on the bound: with "
                           "eps = 0 and r = 1 every token is marked. The region is strict, "
                           "r < 1 - eps_low (A < 0) or r > 1 + eps_high (A > 0), as TRL's "
                           "clip_ratio/region_mean: use < and >, not <= and >=")
        expect(clipped.bool() if isinstance(clipped, torch.Tensor) else clipped,
                torch.zeros(6, 3, dtype=torch.bool), "region_clipped with eps = 0 and r = 1")

    return run_check("clipped_surrogate", fn, ref, [
        ("ratios inside and outside [0.8, 1.2], both signs of A", run),
        # A > 0 where r = 1.35: the upper bound acts, and eps_high decides where
        ("asymmetric clip range (eps_high = 0.28)", lambda f: run(f, 0.2, 0.28, adv=-adv)),
        ("ratio 1 when the policy has not moved", reference_ratio),
        ("a ratio exactly on the clip bound (eps = 0, r = 1)", on_the_bound),
        ("advantage 0 on tokens outside the clip range (an all-equal group)",
         lambda f: run(f, adv=torch.tensor([0.0, 1.0, -1.0, 1.0, -1.0, 0.0]))),
        ("log_ratio_clamp bounds the log-ratio before exp", clamp),
    ])


def check_token_weights(fn: Callable) -> CheckResult:
    ref = objective.token_weights
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    cap = 8  # the completion cap; this batch happens to be padded only to 5

    def case(loss_type):
        def run(f):
            got = f(mask.clone(), loss_type, cap)
            want = ref(mask, loss_type, cap)
            if loss_type == "dr_grpo" and isinstance(got, torch.Tensor) and close(
                    got, mask.float() / (mask.shape[0] * mask.shape[1])):
                raise Mismatch(f"you divided by the tensor's width ({mask.shape[1]}); "
                               f"divide by max_completion_length ({cap}), the cap: the weights "
                               "must not depend on how far this batch happens to be padded")
            if isinstance(got, torch.Tensor) and got.shape == want.shape:
                rows = [i for i in range(mask.shape[0]) if not torch.isfinite(got[i]).all()]
                if rows:
                    raise Mismatch(f"{loss_type}: your weights are NaN or inf on row(s) {rows} "
                                   f"(lengths {mask.sum(-1).tolist()}): a row with no "
                                   "completion tokens divides 0 by 0; count a length of at "
                                   "least 1 there (its weights are 0 anyway)")
                if loss_type == "grpo" and close(got, mask.float() / mask.numel()):
                    raise Mismatch("grpo: you divided every token by B x C, all positions of "
                                   "the padded batch: grpo averages each completion over its "
                                   "own length, then over the B completions, mask / "
                                   "(length of its row x B)")
            if isinstance(got, torch.Tensor) and got.shape == want.shape:
                on_padding = (got != 0) & (mask == 0)
                if bool(on_padding.any()):
                    r, t = (int(i) for i in on_padding.nonzero()[0])
                    raise Mismatch(f"{loss_type}: your weights are not 0 on padding (row {r}, "
                                   f"position {t}, mask 0: {float(got[r, t]):.4g}); a padding "
                                   "position is no token: multiply by the mask")
                rows_used = int((mask.sum(-1) > 0).sum())
                if loss_type in ("grpo", "dr_grpo") and close(
                        got.sum() * rows_used, want.sum() * mask.shape[0]):
                    raise Mismatch(f"{loss_type}: you divided by the {rows_used} rows that "
                                   f"have tokens; B counts every row of the batch "
                                   f"({mask.shape[0]}), empty ones too (an empty completion is "
                                   "still one of the G samples)")
            if isinstance(got, torch.Tensor) and got.shape == want.shape and not close(
                got.sum(), want.sum()
            ):
                raise Mismatch(f"{loss_type}: your weights sum to {float(got.sum()):.4f}, "
                               f"expected {float(want.sum()):.4f} (each non-empty row's weights "
                               "sum to 1/B for grpo; every real token weighs the same for bnpo "
                               "and dapo; dr_grpo divides by B x the cap)")
            expect(got, want, f"{loss_type} weights for lengths [3, 1, 5, 0], cap {cap}")
        return run

    def unknown(f):
        try:
            got = f(mask.clone(), "sum", cap)
        except ValueError:
            return
        raise Mismatch(f"loss_type='sum' returned {kind_of(got)[:60]}; raise ValueError for a "
                       "loss_type you do not know: a typo in the config would otherwise train "
                       "with a loss nobody chose")

    def all_empty(f):
        empty = torch.zeros(3, 4, dtype=torch.long)
        for loss_type in ("grpo", "bnpo", "dapo", "dr_grpo"):
            got = f(empty.clone(), loss_type, cap)
            if isinstance(got, torch.Tensor) and not bool(torch.isfinite(got).all()):
                raise Mismatch(f"{loss_type}: a batch in which every completion is empty "
                               "gives NaN weights (0 tokens: 0 / 0), and the loss is NaN; "
                               "count at least 1 token (`clamp(min=1)`): every weight is then "
                               "0, as padding's is")
            expect(got, ref(empty, loss_type, cap), f"{loss_type} weights with no tokens")

    return run_check("token_weights", fn, ref, [(t, case(t)) for t in
                                                ("grpo", "bnpo", "dapo", "dr_grpo")] +
                     [("an unknown loss_type", unknown),
                      ("a batch with no completion tokens at all", all_empty)])


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
    g = gen(12)
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
            if same_value(value, bad["everywhere"]):
                raise Mismatch("you applied the dual clip to positive advantages too: "
                               "for A > 0, dual_clip * A is above every value of the surrogate, "
                               "so max() makes the loss the constant -dual_clip * A and the "
                               "gradient 0; bound only the tokens with A < 0")
            if same_value(value, bad["none"]):
                raise Mismatch("this is the plain clipped surrogate: for A < 0 and "
                               "r > dual_clip the loss must stop growing, at -dual_clip * A "
                               "(max(surrogate, dual_clip * A))")
            if same_value(value, bad["min"]):
                raise Mismatch("bound with max, not min: for A < 0, dual_clip * A is "
                               "the lowest value the surrogate may take")
            expect(value, want, f"{what}: the per-token loss (ratios 0.22 to 20, both signs "
                    "of A)")
            requires_grad(got, "your per-token loss")
            lp2 = logp.clone().requires_grad_(True)
            want_grad = grad_of(ref(lp2, old, adv, lo, hi, c), lp2, upstream, "the loss")
            expect(grad_of(got, lp, upstream, "the loss"), want_grad,
                    f"{what}: the gradient of the loss with respect to logp (it is 0 where the "
                    "dual clip binds)")
        return case

    def unmoved(f):
        got = f(old.clone(), old.clone(), adv.clone(), 0.2, 0.2, 3.0)
        expect(got, -adv.unsqueeze(-1).expand(8, 3), "the loss when logp == old_logp (r = 1: "
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
    g = gen(13)
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
                               f"(you returned {kind_of(got)[:60]})")
            got = tuple(as_float(x) for x in got)
            want = ref(lp, old, a, lo, hi)
            ratio, a1 = torch.exp(lp - old), a.unsqueeze(-1)
            no_sign = (frac(ratio < 1 - lo), frac(ratio > 1 + hi))
            low_eps = (want[0], frac((ratio > 1 + lo) & (a1 > 0)))
            n = ratio.numel()
            if all(isinstance(x, float) for x in got):
                if want[0] != want[1] and close(got[0], want[1]) and close(got[1], want[0]):
                    raise Mismatch("you returned (high, low); return (low, high)")
                if close(got[0], no_sign[0]) and close(got[1], no_sign[1]) and no_sign != want:
                    raise Mismatch("a token past a bound is clipped only when its "
                                   "advantage pushes it further: r < 1 - eps_low with A < 0, "
                                   "r > 1 + eps_high with A > 0 (with the other sign the min "
                                   "keeps r * A and the gradient flows)")
                if hi != lo and close(got[1], low_eps[1]) and low_eps[1] != want[1]:
                    raise Mismatch("the high bound is 1 + epsilon_high, not "
                                   "1 + epsilon_low")
                if close(got[0], want[0] * n) and close(got[1], want[1] * n) and any(want):
                    raise Mismatch("you returned counts; return fractions of all "
                                   f"B * C = {n} tokens")
            expect(got[0], want[0], f"{what}: the low-bound fraction")
            expect(got[1], want[1], f"{what}: the high-bound fraction")
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
    g = gen(14)
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
        if same_value(got, torch.exp(summed)) and not close(torch.exp(summed), want) or (
                isinstance(got, torch.Tensor) and got.shape == want.shape and
                torch.isinf(got).any() and not torch.isinf(want).any()):
            raise Mismatch("summed instead of averaged: exp of the *sum* of the log-ratios is "
                           "report 001's sequence ratio (grpo_lab.naive.sequence_log_ratio_inputs)"
                           "; it overflows float32 once the sum passes 88.7. GSPO divides the "
                           "sum by the completion's length: exp(mean log-ratio)")
        by_width = torch.exp(summed / m.shape[-1])
        if same_value(got, by_width) and not close(by_width, want):
            raise Mismatch(f"you divided by the tensor's width ({m.shape[-1]}); divide by each "
                           "row's number of real tokens, mask.sum(-1): padding must not count")
        if same_value(got, torch.exp((lp - o).mean(-1))) and not close(torch.exp((lp - o).mean(-1)),
                                                                 want):
            raise Mismatch("the padding counted: multiply the log-ratios by the mask before "
                           "summing, and divide by mask.sum(-1)")
        arith = (torch.exp(lp - o) * mf).sum(-1) / mf.sum(-1).clamp(min=1)
        if same_value(got, arith) and not close(arith, want):
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
        expect(value, ref(logp, old, mask), "the sequence ratios for lengths [3, 1, 5, 4, 0] "
                "(padding holds log-ratios of 30)")
        requires_grad(got, "your sequence ratio")
        lp2 = logp.clone().requires_grad_(True)
        want_grad = grad_of(ref(lp2, old, mask), lp2, upstream, "the ratio")
        expect(grad_of(got, lp, upstream, "the ratio"), want_grad,
                "the gradient of the ratio with respect to logp (ratio * mask / length per "
                "token; 0 on padding)")

    def long(f):
        c = 400
        o = -torch.rand(2, c, generator=gen(15)) * 2
        lp = o + torch.tensor([[0.25], [-0.05]])  # summed: 100 (exp overflows) and -20
        m = torch.ones(2, c, dtype=torch.long)
        got = f(lp.clone(), o.clone(), m.clone())
        named(got, lp, o, m)
        expect(got, ref(lp, o, m), f"two completions of {c} tokens (mean log-ratio 0.25 and "
                "-0.05)")

    def bool_mask(f):
        got = f(logp.clone(), old.clone(), mask.bool())
        named(got, logp, old, mask)
        expect(got, ref(logp, old, mask), "the ratios with a bool mask")

    def unmoved(f):
        got = f(old.clone(), old.clone(), mask.clone())
        expect(got, torch.ones(5), "the ratio when logp == old_logp")

    return run_check("sequence_level_ratio", fn, ref, [
        ("values and gradients; padding must not count", values),
        ("a long completion (400 tokens)", long),
        ("a bool mask", bool_mask),
        ("ratio 1 when the policy has not moved", unmoved),
    ])


# --- the notebook's exercises, in its order -------------------------------------------------
EXERCISES = (
    Exercise('kl_k3', kl_k3, check_kl_k3),
    Exercise('clipped_surrogate', clipped_surrogate, check_clipped_surrogate),
    Exercise('token_weights', token_weights, check_token_weights),
    Exercise('dual_clip_surrogate', reference_dual_clip_surrogate, check_dual_clip_surrogate),
    Exercise('clip_higher_fractions', reference_clip_higher_fractions, check_clip_higher_fractions),
    Exercise('sequence_level_ratio', reference_sequence_level_ratio, check_sequence_level_ratio),
)
