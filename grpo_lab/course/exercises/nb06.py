"""Notebook 06, fix clamping and clipping: the checks of its exercises, and each exercise as
data in `EXERCISES`."""

from __future__ import annotations

import contextlib
import copy
import math
from collections import deque
from collections.abc import Callable

import torch

from ... import naive
from ...numerics import sum_error_bound
from ...objective import (
    kl_k3,
)
from ...step import SPIKE_MIN_HISTORY
from .. import steps
from .base import (
    STEP_TOL,
    CheckResult,
    Exercise,
    Mismatch,
    Mistake,
    close,
    expect,
    gen,
    norm_words,
    run_check,
    shape_of,
)
from .fixtures import check_loss, drive, drive_guarded, drive_loss


def check_clip_grad_norm(fn: Callable) -> CheckResult:
    ref = steps.clip_grad_norm

    def all_close(xs, ys) -> bool:
        return all(close(x, y) for x, y in zip(xs, ys, strict=True))

    def same(grads, max_norm, what):
        def case(f):
            got = f([g.clone() for g in grads], max_norm)
            if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], (list, tuple))):
                raise Mismatch("return (clipped_grads, norm): a list of tensors and the norm "
                               "before clipping")
            clipped, norm = list(got[0]), got[1]
            norm = float(norm) if isinstance(norm, (int, float, torch.Tensor)) else norm
            want, want_norm = ref(grads, max_norm)
            if len(clipped) != len(want):
                raise Mismatch(f"{what}: {len(clipped)} gradients returned for {len(want)}")
            for i, (c, w) in enumerate(zip(clipped, want, strict=True)):
                if not isinstance(c, torch.Tensor) or c.shape != w.shape:
                    raise Mismatch(f"{what}: clipped gradient {i} has {shape_of(c)}, expected "
                                   f"{shape_of(w)}")
            if math.isnan(want_norm):
                if not (isinstance(norm, float) and math.isnan(norm)):
                    raise Mismatch(f"{what}: the norm is NaN when any gradient entry is NaN "
                                   "(NaN squared is NaN, and so is any sum with it); you "
                                   f"returned {norm!r}")
                if not all(torch.isnan(c).all() for c in clipped):
                    raise Mismatch(f"{what}: with a NaN norm, torch's clip_grad_norm_ scales "
                                   "every gradient by NaN, so every clipped entry is NaN; some "
                                   "of yours are not. In Python min(1, c / NaN) is 1 (every "
                                   "comparison with NaN is False), which passes the finite "
                                   "gradients on unchanged; torch.clamp(c / (norm + 1e-6), "
                                   "max=1.0) keeps the NaN")
                return
            per_tensor = [ref([g], max_norm)[0][0] for g in grads]
            by_value = [g.clamp(-max_norm, max_norm) for g in grads]
            if not all_close(clipped, want):
                if all_close(clipped, per_tensor):
                    raise Mismatch(f"{what}: you clipped each tensor to max_norm on its own; "
                                   "the norm is one global norm over all tensors, "
                                   "sqrt(sum of their squared norms)")
                if all_close(clipped, by_value):
                    raise Mismatch(f"{what}: you clamped each element to [-max_norm, max_norm] "
                                   "(clip_grad_value_): that changes the gradient's direction; "
                                   "scale every tensor by one factor instead")
                if want_norm < max_norm:
                    raise Mismatch(f"{what}: the norm {want_norm:.3g} is below max_norm "
                                   f"{max_norm}, so the gradients must come back unchanged (the "
                                   "scale is min(1, max_norm / (norm + 1e-6)), never above 1)")
            if isinstance(norm, float) and want_norm > max_norm and math.isclose(
                norm, max_norm, rel_tol=1e-3
            ):
                raise Mismatch(f"{what}: you returned the norm after clipping ({norm:.3g}); "
                               "return it before clipping (TRL logs that as grad_norm)")
            if words := norm_words(norm, grads):
                raise Mismatch(f"{what}: the norm before clipping: {words}")
            expect(norm, want_norm, f"{what}: the norm before clipping")
            for i, (c, w) in enumerate(zip(clipped, want, strict=True)):
                expect(c, w, f"{what}: clipped gradient {i}")
        return case

    g = gen(7)
    rnd = [torch.randn(4, 3, generator=g) * 5, torch.randn(3, generator=g),
           torch.randn(2, 2, 2, generator=g)]
    return run_check("clip_grad_norm", fn, ref, [
        ("one tensor [6, 8] (norm 10), max_norm 5",
         same([torch.tensor([6.0, 8.0])], 5.0, "[6, 8]")),
        ("norms 5, 12, 0: global norm 13, max_norm 5",
         same([torch.tensor([3.0, 4.0]), torch.tensor([[12.0]]), torch.zeros(3)], 5.0,
              "global norm 13")),
        ("a norm below max_norm is left alone",
         same([torch.tensor([0.3, 0.4]), torch.tensor([1.2])], 5.0, "norm 1.3")),
        ("random gradients of three shapes, max_norm 1", same(rnd, 1.0, "random")),
        ("a NaN entry in one gradient: the norm is NaN, and every clipped gradient too, as in "
         "torch", same([torch.tensor([3.0, float("nan")]), torch.tensor([[12.0]])], 5.0,
                       "a NaN entry")),
    ])


def check_should_skip(fn: Callable) -> CheckResult:
    ref = steps.should_skip
    steady = [1.1, 0.9, 1.0, 1.2, 0.8, 1.0]

    def same(grad_norm, recent, factor, what, hint=""):
        def case(f):
            got = f(grad_norm, type(recent)(recent), factor)
            as_bool = got
            if hasattr(got, "item"):  # a one-element torch or numpy bool is fine
                with contextlib.suppress(ValueError, RuntimeError):
                    as_bool = got.item()
            if not isinstance(as_bool, bool):
                raise Mismatch(f"{what}: return True or False (got {got!r})")
            want = ref(grad_norm, recent, factor)
            if as_bool != want:
                raise Mismatch(f"{what}: you returned {as_bool}, expected {want}" +
                               (f"; {hint}" if hint else ""))
        return case

    return run_check("should_skip", fn, ref, [
        ("a NaN grad norm", same(float("nan"), steady, 20.0, "grad_norm NaN",
                                 "NaN > x is False for every x, so a comparison never flags it: "
                                 "check math.isfinite(grad_norm) first (report 000's "
                                 "`if grad_norm > 10` let the NaN update through)")),
        ("an inf grad norm", same(float("inf"), steady, 20.0, "grad_norm inf",
                                  "skip any non-finite norm")),
        ("an inf grad norm with 2 recent norms", same(float("inf"), [1.0, 1.0], 20.0,
                                                      "grad_norm inf, 2 recent norms",
                                                      "a non-finite norm is skipped however "
                                                      "short the history: math.isfinite, "
                                                      "before the spike rule")),
        ("a spike once exactly 5 norms are known", same(100.0, [1.0] * 5, 20.0,
                                                        "grad_norm 100, 5 recent norms of 1",
                                                        "the spike rule applies from 5 recent "
                                                        "norms on: len(recent) >= 5")),
        ("a spike 100x the median", same(100.0, steady, 20.0, "grad_norm 100, median 1")),
        ("3x the median with factor 20 is kept", same(3.0, steady, 20.0, "grad_norm 3, median 1")),
        ("a larger model: recent norms near 40, a norm of 50 is kept",
         same(50.0, [38.0, 41.0, 40.0, 45.0, 39.0], 20.0, "grad_norm 50, median 40",
              "the threshold is factor x the median of the recent norms, not a fixed number: "
              "a fixed one depends on the model's scale")),
        ("one earlier spike among the recent norms (a deque)",
         same(500.0, deque([1.0, 1.0, 1.0, 1.0, 1.0, 1e4]), 20.0, "grad_norm 500, median 1",
              "use the median: one earlier spike inflates the mean of the recent norms and "
              "hides the next one")),
        ("fewer than 5 recent norms: no baseline yet",
         same(100.0, [1.0, 1.0], 20.0, "grad_norm 100 with 2 recent norms",
              f"with fewer than {SPIKE_MIN_HISTORY} recent norms there is no baseline: keep "
              "any finite norm")),
        ("an even number of recent norms: the median is the mean of the middle two",
         same(65.0, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 20.0, "grad_norm 65, recent 1..6",
              "the median of 1..6 is 3.5 (statistics.median, the mean of the two middle "
              "values), so the threshold is 70 and 65 is kept; torch.median, or "
              "sorted(recent)[len // 2], takes one of the middle values instead")),
        ("an even number of recent norms, from above: 75 against 20 x 3.5",
         same(75.0, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 20.0, "grad_norm 75, recent 1..6",
              "the median of 1..6 is 3.5, so 75 is above the threshold of 70 and skipped; "
              "the upper middle value (4, a threshold of 80) keeps it")),
        ("the median of every recent norm, not of the last few",
         same(25.0, [10.0] * 5 + [1.0] * 5, 20.0, "grad_norm 25, recent five 10s then five 1s",
              "the median of all ten recent norms is 5.5 (threshold 110): take the median of "
              "the whole window `recent` holds, not of its last values")),
        ("a norm exactly factor x the median is kept",
         same(20.0, [1.0] * 6, 20.0, "grad_norm 20, median 1, factor 20",
              "a spike is a norm *above* factor x the median: use >, not >=")),
    ])


# clamped_reported_loss's known mistakes: each is a loss of (logp, old_logp, ref_logp,
# advantages, weights, cfg)
def _no_clamp(logp, old_logp, ref_logp, advantages, weights, cfg):
    return steps.reported_loss(logp, old_logp, ref_logp, advantages, weights, cfg)


def _ratio_clamped(bounds: Callable[[float], tuple[float, float]]) -> Callable:
    """clamp(exp(log r), *bounds(c)) instead of exp(clamp(log r, -c, c))."""
    def loss(logp, old_logp, ref_logp, advantages, weights, cfg):
        m = (weights > 0).float()
        log_ratio = ((logp - ref_logp) * m).sum(-1, keepdim=True)
        ratio = torch.exp(log_ratio).clamp(*bounds(cfg.log_ratio_clamp))
        adv = advantages.detach().unsqueeze(-1)
        per_token = -torch.min(ratio * adv, cfg.epsilon_low * adv)
        return ((per_token + cfg.beta * kl_k3(logp, ref_logp)) * weights).sum(), {}
    return loss


def _clamped_per_token(logp, old_logp, ref_logp, advantages, weights, cfg):
    # each token's log-ratio clamped, then summed (the report's surrogate, unclamped, fed
    # the clamped log-probs): the sum can still reach T x c
    c = cfg.log_ratio_clamp
    per_token, _ = naive.reported_surrogate(ref_logp + (logp - ref_logp).clamp(-c, c),
                                            ref_logp, advantages.detach(), weights > 0,
                                            cfg.epsilon_low)
    return ((per_token + cfg.beta * kl_k3(logp, ref_logp)) * weights).sum(), {}


CLAMPED_REPORTED_LOSS_MISTAKES = (
    Mistake("no_clamp", _no_clamp,
            "nothing is clamped, or only a side this batch does not reach: clamp the summed "
            "log-ratio to [-cfg.log_ratio_clamp, cfg.log_ratio_clamp], both sides, before "
            "`exp`"),
    Mistake("clamped_per_token", _clamped_per_token,
            "each token's log-ratio is clamped before the sum, so a completion's sum can "
            "still reach its length x the clamp: clamp the summed log-ratio, one per "
            "completion, the number `exp` takes"),
    Mistake("ratio_clamped_to_c", _ratio_clamped(lambda c: (-c, c)),  # the log-ratio's bounds
            "the ratio is clamped to [-c, c] after `exp`: c bounds the log-ratio, not the "
            "ratio (a ratio is never negative, and exp() has already overflowed to inf by "
            "then); clamp the summed log-ratio to [-c, c], then exp"),
    Mistake("ratio_clamped", _ratio_clamped(lambda c: (math.exp(-c), math.exp(c))),
            "the ratio is clamped after `exp`: exp() has already overflowed to inf by then "
            "(and inf x 0 is NaN); clamp the log-ratio, then exp"),
)


def check_clamped_reported_loss(fn: Callable) -> CheckResult:
    # a clamp of 0.5 binds on the fixed batch's summed log-ratios (they reach ~2)
    return check_loss("clamped_reported_loss", fn, steps.clamped_reported_loss, [
        ("clamp 0.5, beta 0.05", dict(seed=0, beta=0.05, log_ratio_clamp=0.5)),
        ("clamp 1.0, another batch", dict(seed=1, log_ratio_clamp=1.0)),
        ("a reference 30 nats per token away: summed log-ratios past exp's overflow (88.7)",
         dict(seed=2, log_ratio_clamp=10.0, drift=30.0)),
        ("log_ratio_clamp None: no clamp (report 001's loss as it was)",
         dict(seed=1, log_ratio_clamp=None)),
    ], CLAMPED_REPORTED_LOSS_MISTAKES, stats=("kl", "log_ratio/max_abs"))


# guarded_update's known mistakes: each is an update of (run) -> (grad_norm, skipped)
def _report_rule(run):
    # report 000: `if grad_norm > 10`
    params = [p for p in run.policy.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, run.cfg.max_grad_norm).item()
    if norm > 10:
        run.optimizer.zero_grad(set_to_none=True)
        return norm, 1
    run.optimizer.step()
    return norm, 0


def _history_not_kept(run):
    saved = copy.copy(run.recent_grad_norms)
    out = steps.guarded_update(run)
    run.recent_grad_norms.clear()
    run.recent_grad_norms.extend(saved)
    return out


def _skipped_norm_not_kept(run):
    before = len(run.recent_grad_norms)
    norm, skipped = steps.guarded_update(run)
    if skipped and len(run.recent_grad_norms) > before:
        run.recent_grad_norms.pop()
    return norm, skipped


def _nonfinite_norm_kept(run):
    norm, skipped = steps.guarded_update(run)
    if not math.isfinite(norm):
        run.recent_grad_norms.append(norm)
    return norm, skipped


def _guard_no_clip(run):
    c = copy.copy(run.cfg)
    c.max_grad_norm = None
    saved, run.cfg = run.cfg, c
    try:
        return steps.guarded_update(run)
    finally:
        run.cfg = saved


GUARDED_UPDATE_MISTAKES = (
    Mistake("skipped_norm_not_kept", _skipped_norm_not_kept,
            "a skipped norm is not recorded: record every finite norm, skipped ones too, or a "
            "lasting change of scale freezes training behind a stale median"),
    Mistake("nonfinite_norm_kept", _nonfinite_norm_kept,
            "a non-finite norm went into run.recent_grad_norms: keep finite norms only; one "
            "NaN in the window makes its median NaN, and every spike test against it False"),
    Mistake("history_not_kept", _history_not_kept,
            "the grad norms are not recorded: append each finite norm to "
            "run.recent_grad_norms, or the spike rule never gets its 5 norms to compare with"),
    Mistake("report_rule", _report_rule,
            "this is report 000's rule, `if grad_norm > 10`: a NaN norm is not > 10, so the "
            "NaN update goes through (test math.isfinite first), and a fixed threshold ignores "
            "the run's own scale (compare with factor x the median of recent norms)"),
    Mistake("no_clip", _guard_no_clip,
            "the update is not clipped: scale the gradients to cfg.max_grad_norm before "
            "`optimizer.step()` (clip_grad_norm)"),
)


# A gradient norm is sqrt(sum g^2) over the driver's ~0.8M entries, and a learner may reduce
# them in another order (torch.cat(...).norm(), a per-tensor loop): both are within
# gamma~_n of the exact sum of squares, and the root halves that. n = 1e6 above 0.8M leaves
# room for the probabilistic bound's weak spot, sums of same-sign terms (numerics module);
# a wrong norm (one tensor's, the clipped one, the max) is off by far more.
NORM_REL_TOL = sum_error_bound(10**6)


def _same_norms(a, b) -> bool:
    return (isinstance(a, list) and isinstance(b, list) and len(a) == len(b)
            and all(math.isclose(x, y, rel_tol=NORM_REL_TOL) or (math.isnan(x) and math.isnan(y))
                    for x, y in zip(a, b, strict=True)))


def check_guarded_update(fn: Callable) -> CheckResult:
    ref = steps.guarded_update

    def same(a: dict, b: dict) -> bool:
        return (isinstance(a["out"], tuple) and len(a["out"]) == 2
                and a["out"][1] == b["out"][1] and _same_norms(a["recent"], b["recent"])
                and torch.allclose(a["update"].double(), b["update"].double(), **STEP_TOL))

    def case(what: str, **params):
        def run(f):
            out, want = drive(f, drive_guarded, **params), drive_guarded(ref, **params)
            if isinstance(out.get("update"), torch.Tensor) and same(out, want):
                if out.get("window") != want["window"]:
                    raise Mismatch(f"{what}: run.recent_grad_norms is no longer a window of "
                                   f"the last {want['window']} norms (maxlen "
                                   f"{out.get('window')}): append to the deque the run holds, "
                                   "run.recent_grad_norms.append(norm); a new deque or list "
                                   "keeps every norm, and the median then covers the whole run")
                if want["out"][1] == 1 and not out["cleared"]:
                    raise Mismatch(f"{what}: the skipped update left its gradients in .grad: "
                                   "clear them (run.optimizer.zero_grad()) when you skip, or "
                                   "the next step adds this bad gradient to its own")
                return None
            if not isinstance(out.get("update"), torch.Tensor):
                return expect(out.get("update"), want["update"], "the parameter update")
            for mistake in GUARDED_UPDATE_MISTAKES:
                if same(out, drive_guarded(mistake.wrong, **params)):
                    raise Mismatch(f"{what}: {mistake.message}")
            got = out["out"]
            if not (isinstance(got, tuple) and len(got) == 2):
                raise Mismatch(f"return (grad_norm, skipped); got {type(got).__name__}")
            if got[1] != want["out"][1]:
                raise Mismatch(f"{what}: skipped should be {want['out'][1]}, got {got[1]!r}")
            if not _same_norms(out["recent"], want["recent"]):
                raise Mismatch(f"{what}: run.recent_grad_norms is {out['recent']}, expected "
                               f"{want['recent']}")
            expect(out["update"], want["update"], f"the parameter update ({what})", **STEP_TOL)
        return run

    return run_check("guarded_update", fn, ref, [
        ("a finite gradient, no history yet: clip and step", case("no history", seed=0)),
        ("six recent norms near this one: clip and step",
         case("no spike", seed=0, recent=(40.0,) * 6)),
        ("a spike, 45 against a median of 1: skip", case("spike", seed=0, recent=(1.0,) * 6)),
        ("a NaN gradient entry: skip", case("NaN", seed=1, recent=(40.0,) * 6, nan_grad=True)),
        ("a spike with only 3 known norms: not yet a spike",
         case("short history", seed=1, recent=(1.0,) * 3)),
        ("4 known norms of 1 and a norm of 45: the median is of the earlier norms only",
         case("4 known norms", seed=0, recent=(1.0,) * 4)),
        ("no clipping and no spike rule configured (both None)",
         case("guards off", seed=0, recent=(1.0,) * 6, max_grad_norm=None,
              spike_skip_factor=None)),
    ])


# --- the notebook's exercises, in its order -------------------------------------------------
EXERCISES = (
    Exercise('clip_grad_norm', steps.clip_grad_norm, check_clip_grad_norm),
    Exercise('should_skip', steps.should_skip, check_should_skip),
    Exercise('clamped_reported_loss', steps.clamped_reported_loss, check_clamped_reported_loss,
             driver=drive_loss, mistakes=CLAMPED_REPORTED_LOSS_MISTAKES),
    Exercise('guarded_update', steps.guarded_update, check_guarded_update,
             driver=drive_guarded, mistakes=GUARDED_UPDATE_MISTAKES),
)
