"""A diagnosis of a mystery run by fixed rules on its metrics and log: the tests' check that
each shipped run shows its cause, and that the key in solutions/13 is the one the runs
support. It lives in tests/, not in the package: a learner solves the runs themselves."""

from __future__ import annotations

import math
import statistics


def _values(run, metric, first=1, last=None):
    return [float(m[metric]) for m in run.metrics
            if metric in m and first <= m["step"] <= (last or 10**9)]


def rule_diagnosis(run, baseline) -> str:
    """The cause a fixed rule reads from `run`, against the labelled healthy `baseline`."""
    if "IndexError" in run.log:  # the pad id has no embedding row: the first forward fails
        return "pad-token-oov"
    if any(math.isnan(v) for v in _values(run, "reward")):
        return "nan-rewards"
    grad = _values(run, "grad_norm")
    if all(v == 0 for v in _values(run, "frac_reward_zero_std", 0) if v != 1) and \
            all(v == 0 for v in grad):  # every group identical: no advantage, no gradient
        return "greedy-sampling"
    if _values(run, "kl", 1, 1)[0] > 0:  # no update before step 1's loss, unless inside it
        return "step-inside"
    if max(_values(run, "kl")) > 1.0 or _values(run, "eval/accuracy")[-1] < 0.1:
        return "lr-100x"
    if statistics.median(_values(run, "log_ratio/max_abs")) > 0.1:  # mu = 1: r is 1 exactly
        return "ratio-vs-reference"
    if statistics.median(_values(run, "clip_ratio/region_mean")) > 0.1:
        return "constant-clip"
    if statistics.median(grad) < 0.6 * statistics.median(_values(baseline, "grad_norm")):
        return "zero-grad-inside"  # one micro-batch of four: about half the norm
    # k3 ~ d^2 / 2 grows with the drift d squared and spikes where d is large; the clamped
    # difference max(ref - cur, 0) grows as |d| on the tokens the policy made less likely,
    # and levels off: no spike, and a lower level late in the run
    kl = _values(run, "kl")
    if max(kl) < 0.15 and statistics.mean(kl[-20:]) < 0.075:
        return "clamped-kl"
    return "healthy"
