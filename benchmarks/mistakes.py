"""Every known mistake of the whole-step checkers, put into the reference and checked: the
table of exercise x mistake, whether the checker caught it, and the message it gave.

    python benchmarks/mistakes.py            # Markdown table on stdout; exit 1 if one slipped

Each checker module that keeps a catalog has `CHECKERS` (exercise -> checker) and `MISTAKES`
(exercise -> (mistake -> message, make_mutant)); `grpo_lab.course.labs.CHECKER_MODULES`
lists the modules. (tests/test_steps.py asserts the same for every row.)
"""

from __future__ import annotations

import contextlib
import io
import sys
import time

from grpo_lab.course.labs import CHECKER_MODULES


def rows():
    for module in CHECKER_MODULES:
        for exercise, (catalog, make) in getattr(module, "MISTAKES", {}).items():
            checker = module.CHECKERS[exercise]
            for mistake, message in catalog.items():
                with contextlib.redirect_stdout(io.StringIO()):
                    result = checker(make(mistake))
                named = result.status == "failed" and message in result.reason
                yield exercise, mistake, named, result.reason


def main() -> int:
    t0 = time.perf_counter()
    print("| exercise | mistake put in | caught and named | the checker's message |")
    print("|---|---|---|---|")
    missed = 0
    for exercise, mistake, named, reason in rows():
        missed += not named
        print(f"| `{exercise}` | `{mistake}` | {'yes' if named else '**no**'} | "
              f"{reason.replace('|', '/')} |")
    print(f"\n{missed} not caught and named ({time.perf_counter() - t0:.0f} s)")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
