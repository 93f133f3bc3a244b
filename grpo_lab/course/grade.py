"""Classroom grading: `python -m grpo_lab grade NOTEBOOK... [--json OUT] [--csv OUT]`.

Each submission runs in a fresh kernel (cwd: its own folder) with a time limit per cell.
Its checker calls (`check_<name>(fn)`) record their verdicts to a file named by
$GRPO_LAB_GRADING_LOG; the grader reads them back. Cells that raise do not stop the run
(later exercises are still graded); a hang stops it at the limit. An exercise whose
checker never ran gets 0 points with the reason. One bad submission never stops the others.

The exercises a notebook must have are the `check_<name>(` calls in the solution notebook
of the same file name, from the manifest shipped in the package (labs.py), one point each.
"""

from __future__ import annotations

import csv
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import nbformat

from .checks import LOG_ENV
from .labs import expected_exercises


@dataclass
class Record:
    notebook: str
    exercise: str
    points: int
    max_points: int
    status: str  # passed | failed | not implemented | not run
    reason: str


def run_submission(path: Path, cell_timeout: int) -> tuple[list[dict], str | None]:
    """Execute `path`; returns (checker records, why it stopped early or None)."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "checks.jsonl"
        log.touch()
        stopped = None
        try:
            nb = nbformat.read(path, as_version=4)
            os.environ[LOG_ENV] = str(log)
            client = NotebookClient(
                nb, timeout=cell_timeout, kernel_name="python3", allow_errors=True,
                resources={"metadata": {"path": str(path.parent)}},
            )
            client.execute()
            errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                      if o.get("output_type") == "error"]
            if errors:
                stopped = f"a cell raised {errors[0]['ename']}: {errors[0]['evalue'][:120]}"
        except CellTimeoutError:
            stopped = f"a cell ran longer than the {cell_timeout} s limit (hung?)"
        except DeadKernelError as e:
            stopped = f"the kernel died: {str(e)[:120]}"
        except Exception as e:  # unreadable notebook, kernel failure, ...
            stopped = f"could not run: {type(e).__name__}: {str(e)[:160]}"
        finally:
            os.environ.pop(LOG_ENV, None)
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return records, stopped


def grade_notebook(path: Path, cell_timeout: int = 300) -> list[Record]:
    expected = expected_exercises(path.name)
    if expected is None:
        return [Record(str(path), "(none)", 0, 0, "not run",
                       f"{path.name} is not a course notebook: submit it under its course "
                       "file name (e.g. 03_the_grpo_objective.ipynb)")]
    records, stopped = run_submission(path, cell_timeout)
    latest = {r["exercise"]: r for r in records}  # a re-run check counts its last verdict
    names = expected + [n for n in latest if n not in expected]
    out = []
    for name in names:
        r = latest.get(name)
        if r is None:
            reason = f"the checker never ran ({stopped})" if stopped else \
                "the checker never ran (was its cell deleted?)"
            out.append(Record(str(path), name, 0, 1, "not run", reason))
        else:
            passed = r["status"] == "passed"
            out.append(Record(str(path), name, int(passed), 1, r["status"],
                              r["reason"] or ("" if passed else r["status"])))
    if not names:
        out.append(Record(str(path), "(none)", 0, 0, "not run",
                          stopped or "no exercises found for this notebook in solutions/"))
    return out


def print_table(records: list[Record]) -> None:
    width = max([len(r.notebook) for r in records] + [8])
    print(f"{'notebook':{width}}  {'exercise':26}  points  status           reason")
    for r in records:
        print(f"{r.notebook:{width}}  {r.exercise:26}  {r.points}/{r.max_points}     "
              f"{r.status:15}  {r.reason[:90]}")
    by_nb: dict[str, list[Record]] = {}
    for r in records:
        by_nb.setdefault(r.notebook, []).append(r)
    for nb, rs in by_nb.items():
        print(f"total {nb}: {sum(r.points for r in rs)}/{sum(r.max_points for r in rs)}")


def main(paths: list[str], json_out: str | None, csv_out: str | None,
         cell_timeout: int = 300) -> int:
    records: list[Record] = []
    for p in paths:
        t0 = time.time()
        rs = grade_notebook(Path(p), cell_timeout)
        records += rs
        print(f"graded {p}: {sum(r.points for r in rs)}/{sum(r.max_points for r in rs)} "
              f"({time.time() - t0:.0f} s)")
    print()
    print_table(records)
    rows = [asdict(r) for r in records]
    if json_out:
        Path(json_out).write_text(json.dumps(rows, indent=2, ensure_ascii=False))
    if csv_out:
        with open(csv_out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["notebook"])
            writer.writeheader()
            writer.writerows(rows)
    return 0
