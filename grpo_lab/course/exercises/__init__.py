"""The course's exercises, one module per notebook: `nb04.py` holds notebook 04's.

Each module's `EXERCISES` lists its exercises in the notebook's order, as data (`Exercise`
in base.py): the reference, the check, the driver of a whole-step check, and the known
mistakes with the message each gets. `python -m grpo_lab labs`, the grader and `hint()`
find an exercise here by its name; docs/contributing.md says how to add one.
"""

from __future__ import annotations

import functools
import importlib

from .base import CheckResult, Exercise

# one module per notebook that has exercises; a new notebook's module is added here
MODULES = ("nb00", "nb01", "nb02", "nb03", "nb04", "nb05", "nb06", "nb07", "nb08", "nb09",
           "nb10", "nb11", "nb12")


@functools.cache
def registry() -> dict[str, Exercise]:
    """Every exercise of the course by name. Two with one name are refused: the name is
    what the notebook's `check_<name>(` call and the grader look it up by."""
    found: dict[str, Exercise] = {}
    for name in MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        for exercise in module.EXERCISES:
            if exercise.name in found:
                raise ValueError(f"two exercises are named {exercise.name!r}: {name} and an "
                                 "earlier module")
            found[exercise.name] = exercise
    return found


def find(name: str) -> Exercise | None:
    """The exercise the learner's function `name` is checked as; None when there is none."""
    return registry().get(name)


def driver(module: str, name: str):
    """The driver `module.name` when an exercise declares it (the grading worker runs only
    these); else None."""
    for exercise in registry().values():
        d = exercise.driver
        if d is not None and d.__module__ == module and d.__name__ == name:
            return d
    return None


__all__ = ["CheckResult", "Exercise", "MODULES", "driver", "find", "registry"]
