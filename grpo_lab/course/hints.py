"""Hints in two tiers for every exercise: `hint("kl_k3")`.

The first call for an exercise gives the idea (what to compute, in words); the second, the
shape of the code; later calls say that was all. A lab's stub says what the function must do
and points here, so a learner who wants to reason it out is never handed the code first.

Both tiers live in the solution notebook, next to the code they describe: the `# Idea:` and
`# Hint:` comments inside the exercise's `### BEGIN SOLUTION` block. `python -m grpo_lab
labs` copies them into the exercise manifest (exercises.json), which ships in the package,
so `hint()` works wherever grpo_lab is installed.

Each hint leaves a line `💡 hint N of 2 for NAME` in the notebook's output; `python -m
grpo_lab grade --hints` counts them per exercise (`opened_hints`). A student who clears the
outputs clears the count too: it tells an instructor who got stuck where, it is not a control.
"""

from __future__ import annotations

import re

from .labs import load_manifest

TIERS = 2
MARK = "💡 hint {n} of {tiers} for {name}"
MARK_PATTERN = re.compile(r"💡 hint ([12]) of 2 for ([A-Za-z_][A-Za-z0-9_]*)")

_opened: dict[str, int] = {}  # this kernel's hints so far, per exercise


def hints_of(manifest: dict | None = None) -> dict[str, tuple[str, str]]:
    """{exercise: (idea, shape of the code)} for every exercise of the course."""
    manifest = manifest if manifest is not None else load_manifest()
    return {e["function"]: (e["idea"], e["hint"])
            for nb in manifest["notebooks"].values() for e in nb["exercises"]}


def hint(name: str, level: int | None = None) -> str:
    """Print the next hint for exercise `name` (the idea first, then the shape of the code)
    and return it. `level` (1 or 2) asks for one tier directly."""
    tiers = hints_of()
    if name not in tiers:
        raise ValueError(f"hint: no exercise is named {name!r}; the exercises are "
                         + ", ".join(sorted(tiers)))
    if level is not None and level not in (1, 2):
        raise ValueError(f"hint: level must be 1 (the idea) or 2 (the shape of the code), "
                         f"got {level!r}")
    n = level or min(_opened.get(name, 0) + 1, TIERS + 1)
    if n > TIERS:
        text = (f"no more hints for {name}: those two are all. Run its check: its message "
                "says which case differs and how.")
        print(f"💡 {text}")
        return text
    _opened[name] = max(_opened.get(name, 0), n)
    text = tiers[name][n - 1]
    label = "the idea" if n == 1 else "the shape of the code"
    more = f' (hint("{name}") again: the shape of the code)' if n == 1 else ""
    print(f"{MARK.format(n=n, tiers=TIERS, name=name)}, {label}: {text}{more}")
    return text


def opened_hints(outputs_text: str) -> dict[str, int]:
    """{exercise: the highest hint tier whose line appears in `outputs_text`} (a notebook's
    stored outputs, as text)."""
    seen: dict[str, int] = {}
    for tier, name in MARK_PATTERN.findall(outputs_text):
        seen[name] = max(seen.get(name, 0), int(tier))
    return seen
