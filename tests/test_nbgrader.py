"""nbgrader interop: `python -m grpo_lab labs --nbgrader DIR` writes a source folder that
nbgrader's own `generate_assignment` and `autograde` accept. Two small notebooks (00, 02):
a student who solves 02, leaves 00 a stub and deletes 02's test cell scores 1 of 2 (nbgrader
restores the locked test cell, hidden asserts included, before grading)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat

from grpo_lab.course import labs

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ["00_setup_and_diagnostics.ipynb", "02_rewards_and_advantages.ipynb"]

def nbgrader_cli(args: list[str], course: Path,
                 jupyter_path: str | None = None) -> subprocess.CompletedProcess:
    # nbgrader runs `alembic` (its database migrations) from PATH: this environment's bin
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    if jupyter_path:  # the notebooks' `python3` kernel, forked warm (conftest.py)
        env["JUPYTER_PATH"] = os.pathsep.join(
            p for p in (jupyter_path, os.environ.get("JUPYTER_PATH")) if p)
    return subprocess.run([sys.executable, "-m", "nbgrader", *args,
                           f"--CourseDirectory.root={course}"], cwd=course, env=env,
                          capture_output=True, text=True, timeout=600)


def test_source_cells_carry_nbgrader_metadata():
    nb = labs.nbgrader_notebook(ROOT / "solutions" / "03_the_grpo_objective.ipynb")
    meta = [c.metadata["nbgrader"] for c in nb.cells]
    solutions = [m["grade_id"] for m in meta if m["solution"]]
    tests = [(m["grade_id"], m["points"]) for m in meta if m["grade"]]
    core = ["kl_k3", "clipped_surrogate", "token_weights"]
    stretch = ["dual_clip_surrogate", "clip_higher_fractions", "sequence_level_ratio"]
    assert solutions == core + stretch
    assert tests == [(f"test_{name}", 1) for name in core + stretch]
    assert all(m["locked"] for m in meta if not m["solution"])
    assert len({m["grade_id"] for m in meta}) == len(meta)


def test_nbgrader_generates_and_autogrades_the_course(tmp_path, warm_jupyter_path):
    # the test extra has nbgrader: a missing one fails here, not skips. Imported here, not at
    # the top, so that the test workers that collect this file but do not run it skip the
    # import (1.8 s of CPU each)
    import nbgrader  # noqa: F401

    course = tmp_path / "course"
    p = subprocess.run([sys.executable, "-m", "grpo_lab", "labs", "--nbgrader", str(course),
                        "--assignment", "ps1", "--root", str(ROOT)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    # the example course uses two of the notebooks
    for extra in (course / "source" / "ps1").glob("*.ipynb"):
        if extra.name not in NOTEBOOKS:
            extra.unlink()

    p = nbgrader_cli(["generate_assignment", "ps1", "--force"], course)
    assert p.returncode == 0, p.stderr[-3000:]
    released = course / "release" / "ps1"
    assert sorted(x.name for x in released.glob("*.ipynb")) == NOTEBOOKS
    lab = nbformat.read(released / NOTEBOOKS[1], as_version=4)
    stub = [c.source for c in lab.cells if c.metadata["nbgrader"].get("solution")]
    assert len(stub) == 3 and all("raise NotImplementedError()" in s for s in stub)  # + stretch
    # nbgrader's stub, with our task line above it: what to write and where the hints are
    assert "keepdim" not in stub[0] and "hint('group_advantages')" in stub[0]
    assert not any("### BEGIN" in c.source for c in lab.cells)

    student = course / "submitted" / "bob" / "ps1"
    student.mkdir(parents=True)
    for name in NOTEBOOKS:
        nb = nbformat.read(released / name, as_version=4)
        if name == NOTEBOOKS[1]:  # bob solves 02 and deletes its test
            solution = {c.get("id"): c.source for c in nbformat.read(
                ROOT / "solutions" / name, as_version=4).cells}
            for c in nb.cells:
                if c.metadata.get("nbgrader", {}).get("solution"):
                    c.source = solution[c.get("id")]
                elif c.metadata.get("nbgrader", {}).get("grade"):
                    c.source = "pass"
        nbformat.write(nb, student / name)

    p = nbgrader_cli(["autograde", "ps1", "--create"], course, warm_jupyter_path)
    assert p.returncode == 0, p.stderr[-3000:]
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        got = {nb.name: (nb.score, nb.max_score)
               for nb in gb.find_submission("ps1", "bob").notebooks}
    assert got == {"00_setup_and_diagnostics": (0.0, 2.0),
                   "02_rewards_and_advantages": (3.0, 3.0)}
