"""Notebook 11, capstone: the checks of its exercises, and each exercise as
data in `EXERCISES`."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

from .. import steps
from .base import Case, CheckResult, Exercise, Mismatch, Mistake, run_check
from .nb05 import history_row


def _first_k_that_fits(rows: int, mib_per_row: float, budget_mib: float, fits) -> int:
    """The smallest k in 1..rows for which fits(rows, k, mib_per_row, budget_mib) holds, or
    rows; ValueError when one row is over the budget. The reference and, with another test
    of "k fits", each known mistake below."""
    if mib_per_row > budget_mib:
        raise ValueError(f"one row needs {mib_per_row} MiB, more than the budget of "
                         f"{budget_mib} MiB: no accumulation fits")
    return next((k for k in range(1, rows + 1) if fits(rows, k, mib_per_row, budget_mib)), rows)


def reference_accumulation_for_budget(rows: int, mib_per_row: float, budget_mib: float) -> int:
    return _first_k_that_fits(rows, mib_per_row, budget_mib,
                              fits=lambda n, k, m, b: math.ceil(n / k) * m <= b)


ACCUMULATION_FOR_BUDGET = Exercise(
    "accumulation_for_budget", reference_accumulation_for_budget,
    cases=(
        Case("64 rows at 1 MiB/row, budget 100 MiB: everything fits at once", (64, 1.0, 100.0),
             hint="k = 1 when the whole batch fits"),
        Case("64 rows at 1 MiB/row, budget 32 MiB: an exact fit at the boundary",
             (64, 1.0, 32.0), hint="<= budget fits: 32 rows of 1 MiB fit in 32 MiB"),
        Case("10 rows at 1 MiB/row, budget 4 MiB: the smallest k, not the first divisor",
             (10, 1.0, 4.0),
             hint="k = 3 gives micro-batches of 4, 3 and 3 rows: k need not divide the rows"),
        Case("10 rows at 1 MiB/row, budget 3 MiB: rows that do not divide evenly",
             (10, 1.0, 3.0), hint="the largest micro-batch has ceil(10 / k) rows: k = 3 gives "
             "4, 3 and 3 (too many), k = 4 gives 3, 3, 2 and 2"),
        Case("512 rows at 0.655 MiB/row, budget 100 MiB: fractional MiB per row",
             (512, 0.655, 100.0)),
        Case("7 rows at 2.5 MiB/row, budget 2.5 MiB: a single row that fits exactly",
             (7, 2.5, 2.5), hint="k = rows: one row each"),
        Case("8 rows at 5 MiB/row, budget 4 MiB: one row too big", (8, 5.0, 4.0),
             hint="no number of micro-batches makes one row smaller"),
        Case("10 rows at 1 MiB/row, budget 3.5 MiB: the largest micro-batch is what must fit",
             (10, 1.0, 3.5), hint="ceil(10 MiB / 3.5 MiB) = 3 micro-batches hold 4, 3 and 3 "
             "rows, and 4 MiB does not fit: size the largest micro-batch, ceil(rows / k) rows, "
             "not the total over the budget"),
    ),
    mistakes=(
        Mistake("floor_division", partial(_first_k_that_fits, fits=lambda n, k, m, b:
                                          (n // k) * m <= b),
                "your k leaves the largest micro-batch over the budget: it holds ceil(rows / k) "
                "rows, one more than rows // k when they do not divide evenly, so neither "
                "rows // k nor k = ceil(rows x MiB per row / budget) sizes it; take the "
                "smallest k whose ceil(rows / k) rows fit (math.ceil, or -(-rows // k))"),
        Mistake("divisors_only", partial(_first_k_that_fits, fits=lambda n, k, m, b:
                                         n % k == 0 and n // k * m <= b),
                "you only tried k that divide the rows; the trainer's micro-batches may differ "
                "by one row, so any k in 1..rows is allowed: 10 rows in k = 3 are 4, 3 and 3"),
        Mistake("strict_budget", partial(_first_k_that_fits, fits=lambda n, k, m, b:
                                         math.ceil(n / k) * m < b),
                "a micro-batch that needs exactly the budget fits: compare with <=, not <"),
    ),
    tolerance=dict(atol=0.0, rtol=0.0))
check_accumulation_for_budget = ACCUMULATION_FOR_BUDGET.check


def _matched_by_position(yours: list[dict], theirs: list[dict], keys) -> dict[str, float]:
    """compare_histories with the rows paired in order, not by their "step": the reference
    on the two runs with each row's step replaced by its position."""
    return steps.compare_histories([dict(m, step=i) for i, m in enumerate(yours)],
                                   [dict(m, step=i) for i, m in enumerate(theirs)], keys)


def _signed_difference(yours: list[dict], theirs: list[dict], keys) -> dict[str, float]:
    """compare_histories with yours - theirs in place of |yours - theirs|."""
    return {k: max((0.0 if a != a and b != b else math.inf if (a != a) != (b != b) else a - b
                    for a, b in steps.matched_pairs(yours, theirs, k)), default=0.0)
            for k in keys}


COMPARE_HISTORIES_MISTAKES = (
    Mistake("signed_difference", _signed_difference,
            "yours is the largest yours - theirs, signed: a step where your run is below "
            "the other counts as no gap; the largest |yours - theirs| is asked (abs)"),
    Mistake("matched_by_position", _matched_by_position,
            "the rows are paired by their position in the lists, not by their 'step': a run "
            "that logged fewer rows (a crash, eval rows, steps 1 and 3 only) then compares "
            "one step with another; look each row's 'step' up in the other run"),
)


def check_compare_histories(fn: Callable) -> CheckResult:
    ref = steps.compare_histories
    nan = float("nan")
    a = [history_row(0, **{"eval/accuracy": 0.4}), history_row(1, reward=0.5, loss=0.1),
         history_row(2, reward=0.25, loss=nan), history_row(3, reward=0.75, loss=0.2)]
    b = [history_row(0, **{"eval/accuracy": 0.375}), history_row(1, reward=0.5, loss=0.1),
         history_row(2, reward=0.5, loss=nan), history_row(3, reward=0.75, loss=0.3),
         history_row(4, reward=1.0, loss=0.0)]
    c = [history_row(1, reward=0.5, loss=nan), history_row(3, reward=0.7)]

    def case(x, y, keys, what):
        def run(f):
            got, want = f([dict(m) for m in x], [dict(m) for m in y], list(keys)), ref(x, y, keys)
            if not isinstance(got, dict) or set(got) != set(want):
                raise Mismatch(f"{what}: return a dict with one entry per key, {sorted(want)}")
            if got != want:
                for mistake in COMPARE_HISTORIES_MISTAKES:
                    if mistake.wrong(x, y, keys) == got:
                        raise Mismatch(f"{what}: {mistake.message}")
            for k, v in want.items():
                g = got[k]
                if not (isinstance(g, (int, float)) and (g == v or math.isclose(g, v, abs_tol=1e-12))):
                    why = {math.inf: " (one run NaN where the other is not: inf)",
                           0.0: " (compare only the steps both runs logged the key at; two "
                                "NaNs agree)"}.get(v, "")
                    raise Mismatch(f"{what}: {k} is {g!r}, expected {v!r}{why}")
        return run

    return run_check("compare_histories", fn, ref, [
        ("steps matched by 'step', a NaN in both", case(a, b, ("reward", "loss", "eval/accuracy"),
                                                        "two runs")),
        ("NaN in one run only, a key one row lacks", case(a, c, ("reward", "loss"), "other runs")),
        ("no step where both runs have the key", case(a[:1], c, ("eval/accuracy",),
                                                       "runs that share no step for the key: "
                                                       "the difference is 0.0 (nothing to compare)")),
    ])


# --- the notebook's exercises, in its order -------------------------------------------------
EXERCISES = (
    Exercise('compare_histories', steps.compare_histories, check_compare_histories,
             mistakes=COMPARE_HISTORIES_MISTAKES),
    ACCUMULATION_FOR_BUDGET,
)
