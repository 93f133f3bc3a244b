"""Notebook 11, capstone: the checks of its exercises, and each exercise as
data in `EXERCISES`."""

from __future__ import annotations

import math
from collections.abc import Callable

from .. import steps
from .base import CheckResult, Exercise, Mismatch, run_check
from .nb05 import history_row


def reference_accumulation_for_budget(rows: int, mib_per_row: float, budget_mib: float) -> int:
    if mib_per_row > budget_mib:
        raise ValueError(f"one row needs {mib_per_row} MiB, more than the budget of "
                         f"{budget_mib} MiB: no accumulation fits")
    return next(k for k in range(1, rows + 1) if math.ceil(rows / k) * mib_per_row <= budget_mib)


def check_accumulation_for_budget(fn: Callable) -> CheckResult:
    ref = reference_accumulation_for_budget

    def same(rows, per_row, budget, hint=""):
        def case(f):
            got, want = f(rows, per_row, budget), ref(rows, per_row, budget)
            if got != want:
                raise Mismatch(f"{rows} rows at {per_row} MiB/row, budget {budget} MiB: you "
                               f"returned {got!r}, expected {want}" + (f"; {hint}" if hint else ""))
        return case

    def refuses(f):
        try:
            got = f(8, 5.0, 4.0)
        except ValueError:
            return
        raise Mismatch(f"one row needs 5 MiB and the budget is 4 MiB: raise ValueError (you "
                       f"returned {got!r}; no number of micro-batches makes one row smaller)")

    return run_check("accumulation_for_budget", fn, ref, [
        ("everything fits at once", same(64, 1.0, 100.0, "k = 1 when the whole batch fits")),
        ("an exact fit at the boundary", same(64, 1.0, 32.0,
                                              "<= budget fits: 32 rows of 1 MiB fit in 32 MiB")),
        ("the smallest k, not the first divisor", same(10, 1.0, 4.0,
                                                      "k = 3 gives micro-batches of 4, 3 and 3 "
                                                      "rows: k need not divide the rows")),
        ("rows that do not divide evenly", same(10, 1.0, 3.0,
                                                "the largest micro-batch has ceil(10 / k) rows: "
                                                "k = 3 gives 4, 3 and 3 (too many), k = 4 gives "
                                                "3, 3, 2 and 2")),
        ("fractional MiB per row", same(512, 0.655, 100.0)),
        ("a single row that fits exactly", same(7, 2.5, 2.5, "k = rows: one row each")),
        ("one row too big", refuses),
    ])


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
    ])


# --- the notebook's exercises, in its order -------------------------------------------------
EXERCISES = (
    Exercise('compare_histories', steps.compare_histories, check_compare_histories),
    Exercise('accumulation_for_budget', reference_accumulation_for_budget, check_accumulation_for_budget),
)
