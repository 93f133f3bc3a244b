"""Every known mistake of the exercises, put into the reference and checked: the
table of exercise x mistake, whether the checker caught it, and the message it gave.

    python benchmarks/mistakes.py            # Markdown table on stdout; exit 1 if one slipped

Every exercise of `grpo_lab.course.exercises.registry()` lists its known mistakes, each a
`Mistake(name, wrong, message)`: `wrong` goes to the exercise's check as the learner's
function. (tests/test_exercises.py asserts the same for every row.)
"""

from __future__ import annotations

import contextlib
import io
import sys
import time

from grpo_lab.course import exercises


def rows():
    for exercise in exercises.registry().values():
        for mistake in exercise.mistakes:
            with contextlib.redirect_stdout(io.StringIO()):
                result = exercise.check(mistake.wrong)
            named = result.status == "failed" and mistake.message in result.reason
            yield exercise.name, mistake.name, named, result.reason


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
