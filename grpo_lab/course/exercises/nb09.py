"""Notebook 09, fix the kl formula: the checks of its exercises, and each exercise as
data in `EXERCISES`."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch

from ... import naive, objective
from ...objective import exact_kl, kl_k2
from .. import steps
from .base import (
    CheckResult,
    Exercise,
    Mismatch,
    Mistake,
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
from .fixtures import check_loss, drive_loss
from .nb04 import loss_with_kl_outside, with_kl


def same_gradient(ref: Callable, x: torch.Tensor, other: torch.Tensor, what: str, wrt: str,
                  why: str) -> Callable:
    """The case: f(x, other) has ref's value and ref's gradient with respect to x (taken
    against unequal weights per entry, so that no entry's error can hide in a sum)."""
    def case(f):
        leaf = _leaf(x)
        got = f(leaf, other.clone())
        expect(got.detach() if isinstance(got, torch.Tensor) else got, ref(x, other), what)
        requires_grad(got, f"your {what}", wrt=wrt)
        upstream = torch.linspace(0.5, 1.5, got.numel()).reshape(got.shape)
        theta = _leaf(x)
        want = grad_of(ref(theta, other), theta, upstream, what)
        expect(grad_of(got, leaf, upstream, f"your {what}"), want,
               f"the gradient of {what} with respect to {wrt} ({why}: is a term detached?)")
    return case


def check_exact_kl(fn: Callable) -> CheckResult:
    ref = objective.exact_kl

    def same_kl(logits, ref_logits, what):
        def case(f):
            got = f(logits.clone(), ref_logits.clone())
            want, swapped = ref(logits, ref_logits), ref(ref_logits, logits)
            if isinstance(got, torch.Tensor) and got.shape == want.shape:
                if got.dtype != want.dtype:
                    raise Mismatch(f"{what}: your KL is {got.dtype}, the logits are "
                                   f"{logits.dtype}: keep their dtype (a .double() or a "
                                   "float64 constant mixes it into the loss)")
                if not torch.isfinite(got).all() and torch.isfinite(want).all():
                    raise Mismatch(f"{what}: your KL is not finite where the exact one is (at "
                                   f"most {want.max().item():.4g}): compute it from log_softmax "
                                   "of both logits; log(softmax), exp() of the raw logits and "
                                   "torch.distributions.kl_divergence (inf wherever q underflows "
                                   "to 0) overflow here")
                if close(got, swapped) and not close(got, want):
                    raise Mismatch(f"{what}: you computed KL(q || p); the expectation is over "
                                   "the policy p = softmax(logits)")
                for wrong, words in _exact_kl_mistakes(logits, ref_logits):
                    if close(got, wrong) and not close(got, want):
                        raise Mismatch(f"{what}: {words}")
            expect(got, want, f"{what}: the KL")
        return case

    g = gen(0)
    a, b = torch.randn(3, 4, 7, generator=g), torch.randn(3, 4, 7, generator=g)
    return run_check("exact_kl", fn, ref, [
        ("random (3, 4, 7) logits", same_kl(a, b, "random logits")),
        ("a single distribution of shape (V,)", same_kl(a[0, 0], b[0, 0], "shape (7,)")),
        ("identical logits give 0", same_kl(a, a, "identical logits")),
        ("logits shifted by a constant are the same distribution",
         same_kl(a, a + 5.0, "shifted")),
        ("logits of size 1000", same_kl(a * 1000, b * 1000, "huge logits")),
        ("the gradient with respect to the logits",
         same_gradient(ref, a, b, "KL", "the logits", "cells 25 and 45 differentiate it")),
    ])


def _exact_kl_mistakes(logits: torch.Tensor, ref_logits: torch.Tensor):
    """(what a known wrong exact_kl returns, its message), for these logits."""
    logp, logq = logits.float().log_softmax(-1), ref_logits.float().log_softmax(-1)
    return [
        ((logp - logq).sum(-1), "the log-ratio is summed without the weights p_v: KL is an "
         "expectation under p, sum_v p_v (log p_v - log q_v)"),
        ((logp.exp() * (logp - logq)).mean(-1), "you averaged over the vocabulary: the "
         "expectation's weights are p_v, so sum over v (a mean divides once more by V)"),
        ((logq.exp() * (logp - logq)).sum(-1), "the weights are the reference's q_v: "
         "KL(p || q) weights the log-ratio by the policy's p_v = softmax(logits)"),
        ((logits.float().softmax(-1) * (logits.float() - ref_logits.float())).sum(-1),
         "the raw logits are used as log-probabilities: normalise both with log_softmax "
         "first (logits are log-probs only up to a constant per row)"),
    ]


def check_kl_k2(fn: Callable) -> CheckResult:
    ref = objective.kl_k2

    def same_k2(logp, ref_logp, what):
        def case(f):
            got = f(logp.clone(), ref_logp.clone())
            want = ref(logp, ref_logp)
            if isinstance(got, torch.Tensor) and got.shape == want.shape and close(
                got, 2 * want
            ) and not close(want, torch.zeros_like(want)):
                raise Mismatch(f"{what}: yours is twice k2; k2 = (log r)^2 / 2")
            if isinstance(got, torch.Tensor) and got.shape == want.shape and close(
                    got, objective.kl_k3(logp, ref_logp)) and not close(got, want):
                raise Mismatch(f"{what}: yours is k3, r - 1 - log r (notebook 03's); k2 is "
                               "(log r)^2 / 2")
            try:
                expect(got, want, f"{what}: k2")
            except Mismatch as e:
                if not (isinstance(got, torch.Tensor) and got.shape == want.shape):
                    raise
                # the first entry that differs, in the exercise's terms
                bad = ~torch.isclose(got.detach().double(), want.double(), rtol=1e-4,
                                     atol=1e-5, equal_nan=True)
                at = tuple(int(i) for i in bad.nonzero()[0])
                log_r = (ref_logp[at] - logp[at]).item()
                raise Mismatch(
                    f"{e}; there logp = {logp[at].item():.4g} and ref_logp = "
                    f"{ref_logp[at].item():.4g}, so log r = ref_logp - logp = {log_r:.4g} and "
                    f"k2 = (log r)^2 / 2 = {log_r ** 2 / 2:.4g}; yours gave "
                    f"{got[at].item():.4g}") from None
        return case

    g = gen(1)
    logp, ref_logp = -torch.rand(4, 5, generator=g) * 3, -torch.rand(4, 5, generator=g) * 3
    far = ref_logp - 2.0 - torch.rand(4, 5, generator=g) * 10  # |log r| from 2 to 15
    return run_check("kl_k2", fn, ref, [
        ("random log-probs", same_k2(logp, ref_logp, "random log-probs")),
        ("identical policies give 0", same_k2(logp, logp, "identical policies")),
        ("a policy far from the reference (|log r| up to 15)",
         same_k2(logp, far, "far policies")),
        ("the gradient with respect to logp",
         same_gradient(ref, logp, ref_logp, "k2", "logp", "it is logp - ref_logp per token")),
    ])


# report003_loss's known mistakes: each is a loss of (logp, old_logp, ref_logp, advantages,
# weights, cfg)
def _k3_kept(logp, old_logp, ref_logp, advantages, weights, cfg):
    return steps.grpo_loss(logp, old_logp, ref_logp, advantages, weights, cfg)


def _report003_kl_unscaled(logp, old_logp, ref_logp, advantages, weights, cfg):
    c = copy.copy(cfg)
    c.beta = 1.0
    return with_kl(logp, old_logp, ref_logp, advantages, weights, c,
                   naive.report003_kl(logp, ref_logp))


def _report003_with(kl_of: Callable) -> Callable:
    """The report's loss with kl_of(logp, old_logp, ref_logp) as its per-token KL."""
    def loss(logp, old_logp, ref_logp, advantages, weights, cfg):
        return with_kl(logp, old_logp, ref_logp, advantages, weights, cfg,
                       kl_of(logp, old_logp, ref_logp))
    return loss


def _report003_token_mean(logp, old_logp, ref_logp, advantages, weights, cfg):
    tokens = (weights > 0).float()
    return steps.report003_loss(logp, old_logp, ref_logp, advantages, tokens / tokens.sum(), cfg)


REPORT003_LOSS_MISTAKES = (
    Mistake("k3_kept", _k3_kept,
            "this is k3, the formula report 003 removed: write the report's replacement, "
            "`delta = (ref_logp - logp).clamp(-10, 10); kl = delta.clamp(0, 10)`"),
    Mistake("one_sided_clamp_missing",
            _report003_with(lambda lp, old, ref: (ref - lp).clamp(-10, 10)),
            "the second clamp is missing: the report's kl is `delta.clamp(0, 10)`, which "
            "drops every token where the policy gives more probability than the reference"),
    Mistake("upper_clamp_missing", _report003_with(lambda lp, old, ref: (ref - lp).clamp(min=0)),
            "delta is not clamped at 10: the report's kl is `delta.clamp(-10, 10).clamp(0, "
            "10)`, at most 10 per token, where yours grows with delta"),
    Mistake("delta_reversed",
            _report003_with(lambda lp, old, ref: (lp - ref).clamp(-10, 10).clamp(0, 10)),
            "delta is reversed: the report's delta is `ref - cur`, ref_logp - logp"),
    Mistake("kl_against_old", _report003_with(lambda lp, old, ref: naive.report003_kl(lp, old)),
            "the KL is taken against old_logp, the policy that sampled: the penalty holds the "
            "policy near the frozen reference, `delta = (ref_logp - logp)...`"),
    Mistake("kl_detached", _report003_with(
        lambda lp, old, ref: naive.report003_kl(lp, ref).detach()),
            "your KL term carries no gradient (detached, or computed under no_grad): its "
            "value is in the loss but it cannot pull the policy back"),
    Mistake("token_mean", _report003_token_mean,
            "the loss is a plain mean over the completion tokens: weight each token's term by "
            "`weights` (the loss type's normalisation, computed by the step) and sum, as "
            "grpo_loss does"),
    Mistake("kl_outside_the_weights",
            loss_with_kl_outside(over_tokens=True, kl=naive.report003_kl),
            "the KL is averaged over the tokens on its own and added to the loss: it belongs "
            "inside each token's term, (surrogate + cfg.beta * kl) * weights, summed"),
    Mistake("kl_unscaled", _report003_kl_unscaled,
            "the KL term is not scaled by the config's beta: each token's term is "
            "surrogate + `cfg.beta * kl`, not surrogate + kl"),
    Mistake("kl_subtracted", _report003_with(lambda lp, old, ref: -naive.report003_kl(lp, ref)),
            "the KL term is subtracted: a penalty is added, surrogate + cfg.beta * kl, so the "
            "loss grows as the policy drifts; subtracted, it rewards the drift"),
)


def _report003_stats_over_padding(logp, old_logp, ref_logp, advantages, weights, cfg):
    loss, _ = steps.report003_loss(logp, old_logp, ref_logp, advantages, weights, cfg)
    return loss, {"kl": naive.report003_kl(logp, ref_logp).detach().mean().item(),
                  "kl_k3": objective.kl_k3(logp, ref_logp).detach().mean().item()}


def _report003_stat_k3_swapped(logp, old_logp, ref_logp, advantages, weights, cfg):
    loss, stats = steps.report003_loss(logp, old_logp, ref_logp, advantages, weights, cfg)
    return loss, {**stats, "kl_k3": objective.masked_mean(
        objective.kl_k3(ref_logp, logp).detach(), weights > 0).item()}


def _report003_stat_logs_k3(logp, old_logp, ref_logp, advantages, weights, cfg):
    loss, stats = steps.report003_loss(logp, old_logp, ref_logp, advantages, weights, cfg)
    return loss, {**stats, "kl": stats["kl_k3"]}


REPORT003_STATS_MISTAKES = (
    Mistake("kl_logs_k3", _report003_stat_logs_k3,
            "stats['kl'] is k3: 'kl' is the number the report logged, its clamped delta, "
            "`masked_mean(kl.detach(), weights > 0)` of the kl your loss uses; k3 goes in "
            "stats['kl_k3'] beside it"),
    Mistake("kl_k3_swapped", _report003_stat_k3_swapped,
            "stats['kl_k3'] is k3 with its arguments swapped, kl_k3(ref_logp, logp): the "
            "policy's log-probs come first, `kl_k3(logp, ref_logp)` (log r = ref_logp - logp)"),
    Mistake("stats_over_padding", _report003_stats_over_padding,
            "this stat is averaged over padding too: 'kl' and 'kl_k3' are means over the "
            "completion tokens only, `masked_mean(x, weights > 0)`; a padding position is no "
            "token of any completion"),
)


def check_report003_loss(fn: Callable) -> CheckResult:
    return check_loss("report003_loss", fn, steps.report003_loss, [
        ("beta 0.3", dict(seed=0, beta=0.3)),
        ("beta 1.0, loss_type dapo", dict(seed=1, beta=1.0, loss_type="dapo")),
        ("asymmetric clip 0.1 / 0.3", dict(seed=3, beta=0.3, epsilon_low=0.1,
                                           epsilon_high=0.3)),
        # a later pass of mu > 1 with pi_old 5 nats per token away: the clamp at 2 binds
        ("log_ratio_clamp 2, pi_old far away",
         dict(seed=4, beta=0.3, log_ratio_clamp=2.0, old_drift=5.0)),
        # ref_logp - logp from about 8 to 11: the report's clamps at 0 and 10 both matter
        ("the reference 9.5 nats above the policy", dict(seed=5, beta=0.3, drift=-9.5)),
    ], REPORT003_LOSS_MISTAKES, stats=("kl", "kl_k3", "clip_ratio/region_mean"),
        stats_mistakes=REPORT003_STATS_MISTAKES)


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


CALLERS_GRAD = 0.125  # what the checks put in logits.grad before the call: it must stay


def _grad_left(leaf: torch.Tensor, what: str) -> None:
    if leaf.grad is None:
        raise Mismatch(f"{what}: your function cleared logits.grad, which held the caller's "
                       "gradient (`.grad = None` or zero_grad after a .backward()): the caller "
                       "loses what it had accumulated. Use torch.autograd.grad(loss, logits), "
                       "which leaves .grad alone")
    if not torch.equal(leaf.grad, torch.full_like(leaf.grad, CALLERS_GRAD)):
        raise Mismatch(f"{what}: your function changed logits.grad (a .backward() on the "
                       "caller's tensor adds into it): the caller's gradient now holds yours "
                       "too. Use torch.autograd.grad(loss, logits), or work on a detached copy")


def check_estimator_expected_gradient(fn: Callable) -> CheckResult:
    ref = reference_estimator_expected_gradient
    g = gen(16)
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
        theta = _leaf(logits)
        logp = theta.log_softmax(-1)
        (swapped,) = torch.autograd.grad((logp.exp().detach() * est(logq, logp)).sum(), theta)
        theta = _leaf(logits)
        logp = theta.log_softmax(-1)
        (by_q,) = torch.autograd.grad((logq.exp() * est(logp, logq)).sum(), theta)
        return full, uniform, raw, uniform * logits.numel(), swapped, by_q

    def case(est, name, logits, ref_logits):
        def run(f):
            what = f"{name}, V={logits.numel()}"
            leaf = _leaf(logits)
            leaf.grad = torch.full_like(leaf, CALLERS_GRAD)  # the caller's: it must stay
            got = f(est, leaf, ref_logits.clone())
            _grad_left(leaf, what)
            value = got.detach() if isinstance(got, torch.Tensor) else got
            want = ref(est, logits, ref_logits)
            full, uniform, raw, summed, swapped, by_q = wrong(est, logits, ref_logits)
            if same_value(value, by_q) and not close(by_q, want):
                raise Mismatch(f"{what}: you weighted each token by q(x), the reference's "
                               "probability; the tokens are sampled from the policy, so the "
                               "weights are p(x) = softmax(logits), detached")
            if same_value(value, full) and not close(full, want):
                raise Mismatch(f"{what}: you differentiated the weights p(x) too (the full "
                               "gradient of sum_x p(x) k(x)); the sample comes from p and a "
                               "loss on it does not move p: weight by p.detach()")
            if same_value(value, uniform) and not close(uniform, want):
                raise Mismatch(f"{what}: you averaged over the vocabulary; weight each token's "
                               "gradient by p(x), its probability under the policy")
            if same_value(value, summed) and not close(summed, want):
                raise Mismatch(f"{what}: you summed the estimator's gradient over the "
                               "vocabulary with every token counted alike; the expectation "
                               "under the policy weighs token x by p(x): sum_x p(x).detach() "
                               "* estimator(...)")
            if same_value(value, swapped) and not close(swapped, want):
                raise Mismatch(f"{what}: the estimator got its arguments the other way round, "
                               "estimator(ref_logp, logp); it takes (logp, ref_logp), the "
                               "policy's log-probabilities first")
            if same_value(value, raw) and not close(raw, want):
                raise Mismatch(f"{what}: pass the estimator log-probabilities, log_softmax of "
                               "the logits, not the raw logits")
            expect(value, want, f"{what}: the expected gradient")
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
    g = gen(17)
    a, b = torch.randn(8, generator=g), torch.randn(8, generator=g)
    c, d = torch.randn(3, generator=g) * 4, torch.randn(3, generator=g)

    def case(logits, ref_logits, what):
        def run(f):
            leaf = _leaf(logits)
            leaf.grad = torch.full_like(leaf, CALLERS_GRAD)  # the caller's: it must stay
            got = f(leaf, ref_logits.clone())
            _grad_left(leaf, what)
            if not (isinstance(got, (tuple, list)) and len(got) == 2):
                raise Mismatch(f"{what}: return (grad of KL(p || q), grad of KL(q || p)), a pair "
                               f"of (V,) tensors (you returned {kind_of(got)[:60]})")
            got = [x.detach() if isinstance(x, torch.Tensor) else x for x in got]
            want = ref(logits, ref_logits)
            if same_value(got[0], want[1]) and same_value(got[1], want[0]) and not close(*want):
                raise Mismatch(f"{what}: you returned them swapped: first the gradient of "
                               "KL(p || q) (the policy's own expectation), then KL(q || p)")
            logp, logq = logits.log_softmax(-1), ref_logits.log_softmax(-1)
            if same_value(got[0], logp - logq + 1) or same_value(got[1], -(logq - logp).exp()):
                raise Mismatch(f"{what}: that is the gradient with respect to the probabilities "
                               "p; the logits go through softmax first (autograd through "
                               "log_softmax, or the chain rule)")
            expect(got[0], want[0], f"{what}: the gradient of KL(p || q)")
            expect(got[1], want[1], f"{what}: the gradient of KL(q || p)")
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
            out = f(*args)
            if isinstance(out, torch.Tensor):
                raise Mismatch(f"{what}: you returned a tensor ({kind_of(out)[:60]}); return "
                               "the new beta as a Python float (`.item()`): it goes into the "
                               "config, where a tensor would carry a graph and a device")
            got = as_float(out)
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
                clip = min(max(raw, -0.2), 0.2)
                difference = min(max(kl - target, -0.2), 0.2)
                if difference != clip and math.isclose(
                        got, beta * (1 + difference * n / horizon), rel_tol=1e-6):
                    raise Mismatch(f"{what}: the error is a proportion, kl / target_kl - 1 = "
                                   f"{raw:.3g}, not the difference kl - target_kl = "
                                   f"{kl - target:.3g}: how far the KL is from its target, "
                                   "relative to the target")
                if math.isclose(got, beta * (1 + clip * horizon / n), rel_tol=1e-6):
                    raise Mismatch(f"{what}: the step is error * n_steps / horizon (horizon: "
                                   "the steps over which beta may change by the error); yours "
                                   "multiplies by horizon / n_steps")
            if not isinstance(got, float):
                raise Mismatch(f"{what}: return the new beta as a number (you returned "
                               f"{kind_of(got)[:60]})")
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


# --- the notebook's exercises, in its order -------------------------------------------------
EXERCISES = (
    Exercise('exact_kl', exact_kl, check_exact_kl),
    Exercise('kl_k2', kl_k2, check_kl_k2),
    Exercise('report003_loss', steps.report003_loss, check_report003_loss,
             driver=drive_loss, mistakes=REPORT003_LOSS_MISTAKES + REPORT003_STATS_MISTAKES),
    Exercise('estimator_expected_gradient', reference_estimator_expected_gradient, check_estimator_expected_gradient),
    Exercise('kl_gradients', reference_kl_gradients, check_kl_gradients),
    Exercise('adaptive_beta', reference_adaptive_beta, check_adaptive_beta),
)
