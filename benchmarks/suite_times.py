"""Per-file times of a test run, from pytest's JUnit XML.

    .venv/bin/python -m pytest --junitxml=run.xml ...
    .venv/bin/python benchmarks/suite_times.py run.xml [--top N] [--against OTHER.xml]

Prints one line per test file (a notebook counts as one file): the summed time of its
tests (setup, call and teardown, as pytest records them), the number of tests, and the
share of the total; slowest first. Under pytest-xdist the sum is the time the file kept
one worker busy, so the total is larger than the wall time; the suite's wall time as
pytest measured it is printed at the end. With --against, a second run's times are shown
beside the first (e.g. before and after a change).
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def file_of(classname: str, root: Path = ROOT) -> str:
    """The file a JUnit classname belongs to: `tests.test_cli` -> `tests/test_cli.py`,
    `tests.test_x.TestY` -> `tests/test_x.py`, `solutions.04_loop.ipynb` ->
    `solutions/04_loop.ipynb`."""
    if classname.endswith(".ipynb"):
        head, _, name = classname[: -len(".ipynb")].partition(".")
        return f"{head}/{name}.ipynb" if name else f"{head}.ipynb"
    parts = classname.split(".")
    for n in range(len(parts), 0, -1):  # the longest prefix that is a module
        candidate = "/".join(parts[:n]) + ".py"
        if (root / candidate).exists():
            return candidate
    return "/".join(parts) + ".py"


def per_file(xml_path: str | Path) -> tuple[dict[str, tuple[float, int]], float]:
    """{file: (seconds, tests)} and pytest's wall time for the run."""
    tree = ET.parse(xml_path)
    times: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    wall = 0.0
    for suite in tree.iter("testsuite"):
        wall += float(suite.get("time", 0))
        for case in suite.iter("testcase"):
            f = file_of(case.get("classname", ""))
            times[f] += float(case.get("time", 0))
            counts[f] += 1
    return {f: (times[f], counts[f]) for f in times}, wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("xml", help="JUnit XML written by pytest --junitxml")
    parser.add_argument("--against", help="a second JUnit XML to show beside the first")
    parser.add_argument("--top", type=int, default=0, help="only the N slowest files")
    args = parser.parse_args(argv)

    rows, wall = per_file(args.xml)
    other, other_wall = per_file(args.against) if args.against else ({}, 0.0)
    total = sum(t for t, _ in rows.values())
    order = sorted(rows, key=lambda f: -rows[f][0])
    if args.top:
        order = order[: args.top]
    width = max(len(f) for f in order) if order else 10
    head = f"{'file':<{width}}  {'seconds':>8}  {'tests':>5}  {'share':>6}"
    if args.against:
        head += f"  {'other s':>8}  {'other n':>7}"
    print(head)
    for f in order:
        t, n = rows[f]
        line = f"{f:<{width}}  {t:8.1f}  {n:5d}  {100 * t / total:5.1f}%"
        if args.against:
            ot, on = other.get(f, (0.0, 0))
            line += f"  {ot:8.1f}  {on:7d}"
        print(line)
    n_all = sum(n for _, n in rows.values())
    print(f"{'all files':<{width}}  {total:8.1f}  {n_all:5d}")
    print(f"pytest wall time: {wall:.1f} s ({wall / 60:.1f} min)")
    if args.against:
        o_total = sum(t for t, _ in other.values())
        print(f"other run: {o_total:.1f} s summed, {other_wall:.1f} s wall")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
