"""grpo_lab installed from a wheel, not from the checkout: `grade` and `labs --check` work
from another directory (the exercise manifest ships in the package)."""

from __future__ import annotations

import json
import site
import subprocess
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_notebook

REPO = Path(__file__).resolve().parents[1]


def run(args, cwd, timeout=300):
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_wheel_install_grades_and_checks_labs_from_another_directory(tmp_path):
    dist = tmp_path / "dist"
    p = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
             "--quiet", "-w", str(dist), str(REPO)], cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    wheel = next(dist.glob("grpo_lab-*.whl"))

    # a fresh venv with only the wheel; its dependencies (torch, transformers, nbclient...)
    # come from this environment's site-packages through a .pth path, which does not run
    # this environment's editable-install hook, so the checkout cannot leak in
    venv = tmp_path / "venv"
    assert run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path).returncode == 0
    py = venv / "bin" / "python"
    fresh_site = Path(run([str(py), "-c", "import site; print(site.getsitepackages()[0])"],
                          tmp_path).stdout.strip())
    (fresh_site / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    p = run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps",
             "--quiet", str(wheel)], cwd=tmp_path)
    assert p.returncode == 0, p.stderr

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    p = run([str(py), "-c", "import grpo_lab.course.labs as m; print(m.__file__)"], elsewhere)
    assert p.stdout.strip().startswith(str(venv)), p.stdout + p.stderr

    # a submission of notebook 02 whose check cell was deleted: the grader still knows the
    # exercise it must have, runs its checker against the function in a sandboxed worker
    # (which imports grpo_lab from the installed wheel) and scores it 0 with the reason
    nb = new_notebook(cells=[new_code_cell("def group_advantages(r, g):\n    return r")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, elsewhere / "02_rewards_and_advantages.ipynb")
    p = run([str(py), "-m", "grpo_lab", "grade", "02_rewards_and_advantages.ipynb",
             "--json", "g.json", "--cell-timeout", "120"], elsewhere)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads((elsewhere / "g.json").read_text())
    assert [(r["exercise"], r["points"], r["max_points"], r["status"]) for r in rows] == [
        ("group_advantages", 0, 1, "failed"), ("rloo_advantages", 0, 1, "missing"),
        ("zero_std_group_filter", 0, 1, "missing")], rows  # (02's two stretch exercises)
    assert "subtract each group's own mean" in rows[0]["reason"], rows

    p = run([str(py), "-m", "grpo_lab", "labs", "--check", "--root", str(REPO)], elsewhere)
    assert p.returncode == 0 and "labs in sync" in p.stdout, p.stdout + p.stderr
    p = run([str(py), "-m", "grpo_lab", "labs", "--check"], elsewhere)
    assert p.returncode == 2 and "--root" in p.stderr, p.stdout + p.stderr
