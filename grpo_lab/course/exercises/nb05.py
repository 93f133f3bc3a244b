"""Notebook 05, break it: the checks of its exercises, and each exercise as
data in `EXERCISES`."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ... import naive
from ...objective import (
    clipped_surrogate,
    kl_k3,
)
from .. import steps
from .base import CheckResult, Exercise, Mismatch, Mistake, expect, run_check
from .fixtures import check_loss, drive_loss


def reference_first_nonfinite_step(history: list[dict]) -> int | None:
    """The first step whose metrics show non-finite parameters, else None."""
    return next((m["step"] for m in history if m.get("nonfinite_params", 0) > 0), None)


def _first_bad_words(got, history: list[dict]) -> str:
    """What a wrong answer of first_nonfinite_step is, in the history's terms ('' if
    nothing fits)."""
    bad = [i for i, m in enumerate(history) if m.get("nonfinite_params", 0) > 0]
    if bad and got == bad[0] and got != history[bad[0]]["step"]:
        return ("that is the row's position in the list, not its 'step': return "
                "the row's m['step'] (a history may start at step 0 or 1)")
    if len(bad) > 1 and got == history[bad[-1]]["step"]:
        return "that is the last step with non-finite parameters; the first one is asked"
    if got is None and bad:
        return "a step has m['nonfinite_params'] > 0, and that one is the answer"
    return ""


def check_first_nonfinite_step(fn: Callable) -> CheckResult:
    ref = reference_first_nonfinite_step
    nan = float("nan")
    healthy = [{"step": s, "grad_norm": 1.0, "nonfinite_params": 0} for s in range(1, 6)]
    broken = healthy + [{"step": 6, "grad_norm": nan, "nonfinite_params": 12},
                        {"step": 7, "grad_norm": nan, "nonfinite_params": 99}]
    spike_then_nan = healthy[:3] + [{"step": 4, "grad_norm": 1e6, "nonfinite_params": 0},
                                    {"step": 5, "grad_norm": nan, "nonfinite_params": 7}]
    with_eval = [{"step": 0, "eval/accuracy": 0.4}] + broken
    # a guard skipped step 3's NaN update: its grad norm is NaN, its parameters stayed finite
    skipped_nan = healthy[:2] + [{"step": 3, "grad_norm": nan, "nonfinite_params": 0,
                                  "skipped": 1}] + healthy[3:]

    def case(history, what):
        def run(f):
            got, want = f([dict(m) for m in history]), ref(history)
            if got != want and (why := _first_bad_words(got, history)):
                raise Mismatch(f"{what} is wrong: yours is {got}, expected {want}: {why}")
            expect(got, want, what)
        return run

    return run_check("first_nonfinite_step", fn, ref, [
        ("a healthy run", case(healthy, "the answer for a healthy run")),
        ("a run that breaks at step 6", case(broken, "the first bad step")),
        ("a spike before the NaN", case(spike_then_nan,
                                        "the first bad step (a spike is not yet corruption)")),
        ("an eval-only row at step 0", case(with_eval, "the first bad step")),
        ("a NaN gradient that was skipped", case(skipped_nan,
                                                 "the first step with non-finite parameters "
                                                 "(a skipped NaN update left them finite: "
                                                 "read nonfinite_params, not grad_norm)")),
    ])


def _report_variant(logp, base, ref_logp, advantages, weights, cfg, summed=True,
                    constant=True):
    """Report 001's loss with its three choices as switches: the ratio against `base`,
    summed over the completion or per token, and the constant or the clipped-ratio term."""
    ratio_logp, ratio_base = (naive.sequence_log_ratio_inputs(logp, base, weights > 0)
                              if summed else (logp, base))
    surrogate = naive.constant_clip_surrogate if constant else clipped_surrogate
    per_token, _ = surrogate(ratio_logp, ratio_base, advantages.detach(), cfg.epsilon_low,
                             cfg.epsilon_high, None)
    return ((per_token + cfg.beta * kl_k3(logp, ref_logp)) * weights).sum(), {}


def _ratio_against_old(logp, old_logp, ref_logp, advantages, weights, cfg):
    return _report_variant(logp, old_logp, ref_logp, advantages, weights, cfg)


def _per_token_ratio(logp, old_logp, ref_logp, advantages, weights, cfg):
    return _report_variant(logp, ref_logp, ref_logp, advantages, weights, cfg, summed=False)


def _clipped_ratio(logp, old_logp, ref_logp, advantages, weights, cfg):
    return _report_variant(logp, ref_logp, ref_logp, advantages, weights, cfg, constant=False)


def _mean_log_ratio(logp, old_logp, ref_logp, advantages, weights, cfg):
    m = (weights > 0).to(logp.dtype)
    mean = ((logp - ref_logp) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
    per_token, _ = naive.constant_clip_surrogate(mean.expand_as(logp), torch.zeros_like(logp),
                                                 advantages.detach(), cfg.epsilon_low,
                                                 cfg.epsilon_high, None)
    return ((per_token + cfg.beta * kl_k3(logp, ref_logp)) * weights).sum(), {}


REPORTED_LOSS_MISTAKES = (
    Mistake("mean_log_ratio", _mean_log_ratio,
            "the log-ratio is averaged over each completion's tokens: the course's reading of "
            "report 001 sums it (a sequence-level ratio, exp of the summed log-ratio), which "
            "is what grows past exp's range as the policy drifts"),
    Mistake("ratio_against_old", _ratio_against_old,
            "the ratio is taken against pi_old (`old_logp`): that is the fix, not the report; "
            "report 001 computes `exp(log_prob_current - log_prob_ref)`, against the "
            "reference (`ref_logp`)"),
    Mistake("per_token_ratio", _per_token_ratio,
            "the log-ratio is per token: the course's reading of report 001 sums it over each "
            "completion's tokens (mask them) before `exp`, broadcast to the row"),
    Mistake("clipped_ratio", _clipped_ratio,
            "the clipped term clips the ratio: report 001's `clip_ratio * advantage` is the "
            "constant clip range times A, -min(r A, eps_low A)"),
)


def check_reported_loss(fn: Callable) -> CheckResult:
    return check_loss("reported_loss", fn, steps.reported_loss, [
        ("the reports' config (beta 0.05)", dict(seed=0, beta=0.05)),
        ("another batch, beta 0", dict(seed=1, beta=0.0)),
        ("an asymmetric clip 0.2 / 0.28 (the constant is eps_low's)",
         dict(seed=2, epsilon_high=0.28)),
    ], REPORTED_LOSS_MISTAKES, stats=("kl", "log_ratio/max_abs"))


def history_row(step, **kw):
    return {"step": step, **kw}


def check_diagnose(fn: Callable) -> CheckResult:
    ref = steps.diagnose
    nan = float("nan")
    crashed = [history_row(0, nonfinite_params=0), history_row(1, grad_norm=2.0, nonfinite_params=0,
               **{"log_ratio/max_abs": 0.0}),
               history_row(2, grad_norm=8e4, nonfinite_params=0, **{"log_ratio/max_abs": 30.0}),
               history_row(3, grad_norm=0.5, nonfinite_params=0, **{"log_ratio/max_abs": 52.0}),
               history_row(4, grad_norm=nan, nonfinite_params=800, **{"log_ratio/max_abs": 207.0}),
               history_row(5, grad_norm=1e9, nonfinite_params=800, **{"log_ratio/max_abs": nan})]
    healthy = [history_row(0), history_row(1, grad_norm=3.0, nonfinite_params=0),
               history_row(2, grad_norm=1.0, nonfinite_params=0)]
    # resumed from a checkpoint whose weights were already non-finite: no healthy row at all
    broken_from_start = [history_row(7, grad_norm=nan, nonfinite_params=800),
                         history_row(8, grad_norm=nan, nonfinite_params=800)]
    # a guard skipped step 1's NaN update; the weights stayed finite, the run went on
    skipped_nan = [history_row(0), history_row(1, grad_norm=nan, nonfinite_params=0, skipped=1),
                   history_row(2, grad_norm=3.0, nonfinite_params=0),
                   history_row(3, grad_norm=1.0, nonfinite_params=0)]

    def case(history, what):
        def run(f):
            got, want = f([dict(m) for m in history]), ref(history)
            if not isinstance(got, dict):
                raise Mismatch(f"return a dict with {sorted(want)}; got {type(got).__name__}")
            for k, v in want.items():
                if k not in got:
                    raise Mismatch(f"{what}: no {k!r} in your dict")
                g = got[k]
                same = g == v if v is None or isinstance(v, int) else (
                    isinstance(g, (int, float)) and math.isclose(g, v, rel_tol=1e-9))
                if not same:
                    hint = {"max_grad_norm": " (only finite norms, and only up to the last "
                            "healthy step: the broken step's norm is NaN)",
                            "max_log_ratio": " (up to the last healthy step: the step that "
                            "broke is where exp overflowed, not the drift before it)",
                            "last_healthy_step": " (the step before the first broken one; None "
                            "when no row before it was healthy)"}
                    if g is None and v == 0.0:
                        hint = {k: " (no row has it: the largest of nothing is 0.0 here, "
                                "max(..., default=0.0))"}
                    raise Mismatch(f"{what}: {k} is {g!r}, expected {v!r}{hint.get(k, '')}")
        return run

    return run_check("diagnose", fn, ref, [
        ("a run that broke at step 4", case(crashed, "a run that broke at step 4")),
        ("a run that never broke", case(healthy, "a run that never broke")),
        ("a run broken from its first row (resumed from bad weights)",
         case(broken_from_start, "a run broken from its first row")),
        ("a NaN update that was skipped, the weights still finite",
         case(skipped_nan, "a run whose NaN update was skipped")),
    ])


# --- the notebook's exercises, in its order -------------------------------------------------
EXERCISES = (
    Exercise('reported_loss', steps.reported_loss, check_reported_loss,
             driver=drive_loss, mistakes=REPORTED_LOSS_MISTAKES),
    Exercise('first_nonfinite_step', reference_first_nonfinite_step, check_first_nonfinite_step),
    Exercise('diagnose', steps.diagnose, check_diagnose),
)
