"""Grading: per-exercise points from the checkers; crashes, hangs and unreadable files
keep what passed and say why; one bad submission does not stop the others."""

import json

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from grpo_lab.course import grade, labs

GOOD = '''def group_advantages(rewards, group_size, advantage_eps=1e-4, scale_rewards=True):
    g = rewards.view(-1, group_size)
    c = g - g.mean(1, keepdim=True)
    return (c / (g.std(1, keepdim=True) + advantage_eps) if scale_rewards else c).reshape(-1)'''
NO_EPS = GOOD.replace(" + advantage_eps", "")
STUB = '''def group_advantages(rewards, group_size, advantage_eps=1e-4, scale_rewards=True):
    raise NotImplementedError("write this")'''
GOOD_KL = "def kl_k3(logp, ref_logp):\n    r = ref_logp - logp\n    return r.exp() - r - 1"
CHECK_ADV = "from grpo_lab.course.checks import check_group_advantages\nr1 = check_group_advantages(group_advantages)"
CHECK_KL = "from grpo_lab.course.checks import check_kl_k3\nr2 = check_kl_k3(kl_k3)"


def notebook(path, *sources):
    nb = new_notebook(cells=[new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, path)
    return path


def use_manifest(monkeypatch, tmp_path, *solutions):
    """Grade against a manifest made from these solution notebooks (labs.manifest_text),
    in place of the one shipped in the package."""
    manifest = tmp_path / "exercises.json"
    manifest.write_text(labs.manifest_text(list(solutions)))
    monkeypatch.setattr(labs, "MANIFEST", manifest)


@pytest.fixture
def solutions(tmp_path, monkeypatch):
    """A 'solution' notebook named sub.ipynb with two exercises."""
    folder = tmp_path / "solutions"
    folder.mkdir()
    use_manifest(monkeypatch, tmp_path,
                 notebook(folder / "sub.ipynb", GOOD, CHECK_ADV, GOOD_KL, CHECK_KL))
    return folder


def _by_exercise(records):
    return {r.exercise: r for r in records}


def test_full_marks_partial_and_not_implemented(tmp_path, solutions):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir(), (tmp_path / "c").mkdir()
    full = notebook(tmp_path / "a" / "sub.ipynb", GOOD, CHECK_ADV, GOOD_KL, CHECK_KL)
    buggy = notebook(tmp_path / "b" / "sub.ipynb", NO_EPS, CHECK_ADV, GOOD_KL, CHECK_KL)
    stub = notebook(tmp_path / "c" / "sub.ipynb", STUB, CHECK_ADV, "import torch", CHECK_KL)
    out = tmp_path / "grades.json"
    grade.main([str(full), str(buggy), str(stub)], str(out), str(tmp_path / "g.csv"), 120)
    rows = json.loads(out.read_text())
    assert {tuple(sorted(r)) for r in rows} == {
        ("exercise", "max_points", "notebook", "points", "reason", "status")}
    a, b, c = rows[0:2], rows[2:4], rows[4:6]
    assert [r["points"] for r in a] == [1, 1]
    assert [r["points"] for r in b] == [0, 1] and "NaN" in b[0]["reason"]
    assert c[0]["status"] == "not implemented" and "not implemented yet" in c[0]["reason"]
    assert c[1]["status"] == "not run" and "NameError" in c[1]["reason"]
    assert (tmp_path / "g.csv").read_text().count("\n") == 7


def test_a_hang_keeps_what_passed(tmp_path, solutions):
    # the limit is far above a normal cell's time: the checker cell's first import of
    # torch and transformers took over 4 s (the old limit) on a loaded machine in CI
    hang = notebook(tmp_path / "sub.ipynb", GOOD, CHECK_ADV, "import time\ntime.sleep(600)",
                    GOOD_KL, CHECK_KL)
    records = _by_exercise(grade.grade_notebook(hang, cell_timeout=30))
    assert records["group_advantages"].points == 1
    assert records["kl_k3"].status == "not run"
    assert "longer than the 30 s limit" in records["kl_k3"].reason


def test_an_unreadable_submission_does_not_stop_the_others(tmp_path, solutions, capsys):
    broken = tmp_path / "x" / "sub.ipynb"
    broken.parent.mkdir()
    broken.write_text("{not json")
    (tmp_path / "y").mkdir()
    fine = notebook(tmp_path / "y" / "sub.ipynb", GOOD, CHECK_ADV, GOOD_KL, CHECK_KL)
    out = tmp_path / "grades.json"
    grade.main([str(broken), str(fine)], str(out), None, 120)
    rows = json.loads(out.read_text())
    assert [r["points"] for r in rows] == [0, 0, 1, 1]
    assert "could not run" in rows[0]["reason"]
    assert f"total {fine}: 2/2" in capsys.readouterr().out


def test_only_exercise_checkers_count(tmp_path, monkeypatch):
    use_manifest(monkeypatch, tmp_path, notebook(
        tmp_path / "s.ipynb", GOOD, CHECK_ADV,
        "from grpo_lab.sampling import check_token_ids\ncheck_token_ids(ids, 15)"))
    assert labs.expected_exercises("s.ipynb") == ["group_advantages"]


def test_a_file_that_is_no_course_notebook_is_refused_clearly(tmp_path):
    records = grade.grade_notebook(notebook(tmp_path / "renamed.ipynb", GOOD, CHECK_ADV))
    assert [(r.points, r.max_points, r.status) for r in records] == [(0, 0, "not run")]
    assert "not a course notebook" in records[0].reason
