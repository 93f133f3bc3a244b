"""How much of GRPO the learner writes: exercises (core and stretch) and the non-comment lines
of solution code between `### BEGIN SOLUTION` and `### END SOLUTION`, per notebook.

    python benchmarks/exercises.py
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def solution_lines(notebook: Path) -> int:
    n, inside = 0, False
    for cell in json.loads(notebook.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        for line in "".join(cell["source"]).splitlines():
            tag = line.strip()
            if tag in ("### BEGIN SOLUTION", "### END SOLUTION"):
                inside = tag == "### BEGIN SOLUTION"
            elif inside and tag and not tag.startswith("#"):
                n += 1
    return n


def main() -> None:
    manifest = json.loads((ROOT / "grpo_lab" / "course" / "exercises.json").read_text())
    totals = [0, 0, 0]
    print(f"{'notebook':<40} {'core':>4} {'stretch':>7} {'solution lines':>14}")
    for name, spec in manifest["notebooks"].items():
        tiers = [e["tier"] for e in spec["exercises"]]
        row = [tiers.count("core"), tiers.count("stretch"),
               solution_lines(ROOT / "solutions" / name)]
        totals = [a + b for a, b in zip(totals, row, strict=True)]
        print(f"{name:<40} {row[0]:>4} {row[1]:>7} {row[2]:>14}")
    print(f"{'total':<40} {totals[0]:>4} {totals[1]:>7} {totals[2]:>14}  "
          f"({totals[0] + totals[1]} exercises)")


if __name__ == "__main__":
    main()
