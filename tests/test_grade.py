"""Grading: per-exercise points from the checkers, run here against the student's function
in a sandboxed worker; crashes, hangs and unreadable files keep what passed and say why;
one bad submission does not stop the others; a renamed file is graded by its content; the
gradebook, feedback and a grader killed mid-run and restarted."""

import json
import os
import signal
import subprocess
import sys
import time

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook, new_output

from grpo_lab.course import grade, labs

SETUP = "import torch"
GOOD = '''def group_advantages(rewards, group_size, advantage_eps=1e-4, scale_rewards=True):
    # Idea: compare each completion with its own group
    # Hint: view(-1, group_size), then the mean and std of each row
    g = rewards.view(-1, group_size)
    c = g - g.mean(1, keepdim=True)
    return (c / (g.std(1, keepdim=True) + advantage_eps) if scale_rewards else c).reshape(-1)'''
NO_EPS = GOOD.replace(" + advantage_eps", "")
STUB = '''def group_advantages(rewards, group_size, advantage_eps=1e-4, scale_rewards=True):
    raise NotImplementedError("write this")'''
GOOD_KL = "def kl_k3(logp, ref_logp):\n    # Idea: k1 plus a zero-mean term\n    # Hint: r.exp() - r - 1\n" \
    "    r = ref_logp - logp\n    return r.exp() - r - 1"
CHECK_ADV = "from grpo_lab.course.exercises.nb02 import check_group_advantages\n" \
    "r1 = check_group_advantages(group_advantages)"
CHECK_KL = "from grpo_lab.course.exercises.nb03 import check_kl_k3\nr2 = check_kl_k3(kl_k3)"
FAST = dict(cell_timeout=20, submission_timeout=120, memory_mb=3072)


def notebook(path, *sources):
    nb = new_notebook(cells=[new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    path.parent.mkdir(parents=True, exist_ok=True)
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
    use_manifest(monkeypatch, tmp_path, notebook(folder / "sub.ipynb", SETUP, GOOD, CHECK_ADV,
                                                 GOOD_KL, CHECK_KL))
    return folder


def run(tmp_path, paths, **kw):
    out = tmp_path / "grades.json"
    code = grade.main([str(p) for p in paths], str(out), kw.pop("csv", None),
                      journal=str(tmp_path / "journal.jsonl"), **{**FAST, **kw})
    assert code == 0
    return json.loads(out.read_text())


def test_full_marks_partial_not_implemented_and_missing(tmp_path, solutions):
    full = notebook(tmp_path / "a" / "sub.ipynb", SETUP, GOOD, CHECK_ADV, GOOD_KL, CHECK_KL)
    buggy = notebook(tmp_path / "b" / "sub.ipynb", SETUP, NO_EPS, CHECK_ADV, GOOD_KL, CHECK_KL)
    stub = notebook(tmp_path / "c" / "sub.ipynb", SETUP, STUB, CHECK_ADV, "x = 1", CHECK_KL)
    rows = run(tmp_path, [full, buggy, stub], csv=str(tmp_path / "g.csv"),
               feedback=str(tmp_path / "fb"))
    assert {tuple(sorted(r)) for r in rows} == {
        ("exercise", "max_points", "notebook", "points", "reason", "status", "student")}
    a, b, c = rows[0:2], rows[2:4], rows[4:6]
    assert [r["points"] for r in a] == [1, 1] and {r["student"] for r in a} == {"a"}
    assert [r["points"] for r in b] == [0, 1] and "NaN" in b[0]["reason"]
    assert c[0]["status"] == "not implemented" and "not implemented yet" in c[0]["reason"]
    assert c[1]["status"] == "missing" and "no cell defines kl_k3()" in c[1]["reason"]
    # the gradebook: one row per student, one column per exercise, total and max
    assert (tmp_path / "g.csv").read_text().splitlines() == [
        "student,group_advantages,kl_k3,total,max", "a,1,1,2,2", "b,0,1,1,2", "c,0,0,0,2"]
    feedback = (tmp_path / "fb" / "b.md").read_text()
    assert "Total: **1/2**" in feedback and "NaN" in feedback and "## kl_k3: 1/1" in feedback


def test_check_cells_are_ignored_only_the_exercise_cell_counts(tmp_path, solutions):
    """Deleting, editing or faking the check cell changes nothing; a stub stays 0."""
    faked = notebook(tmp_path / "f" / "sub.ipynb", SETUP, STUB,
                     "print('✅ check_group_advantages: passed 6 cases')", GOOD_KL)
    rows = run(tmp_path, [faked])
    assert [(r["exercise"], r["points"], r["status"]) for r in rows] == [
        ("group_advantages", 0, "not implemented"), ("kl_k3", 1, "passed")]


def test_a_hang_keeps_what_passed(tmp_path, solutions):
    hang = notebook(tmp_path / "h" / "sub.ipynb", SETUP, GOOD,
                    "def kl_k3(logp, ref_logp):\n    while True:\n        pass")
    rows = run(tmp_path, [hang], cell_timeout=5)
    assert [r["points"] for r in rows] == [1, 0]
    assert "did not finish within its 5 s limit" in rows[1]["reason"]


def test_an_unreadable_submission_does_not_stop_the_others(tmp_path, solutions, capsys):
    broken = tmp_path / "x" / "sub.ipynb"
    broken.parent.mkdir()
    broken.write_text("{not json")
    fine = notebook(tmp_path / "y" / "sub.ipynb", SETUP, GOOD, GOOD_KL)
    rows = run(tmp_path, [broken, fine])
    assert [r["points"] for r in rows] == [0, 0, 1, 1]
    assert rows[0]["status"] == "not graded" and "could not read" in rows[0]["reason"]
    assert "total y: 2/2" in capsys.readouterr().out


def test_only_exercise_checkers_count(tmp_path, monkeypatch):
    use_manifest(monkeypatch, tmp_path, notebook(
        tmp_path / "s.ipynb", SETUP, GOOD, CHECK_ADV,
        "from grpo_lab.sampling import check_token_ids\ncheck_token_ids(ids, 15)"))
    assert labs.expected_exercises("s.ipynb") == ["group_advantages"]


def test_a_renamed_file_is_graded_by_its_content(tmp_path, solutions):
    renamed = notebook(tmp_path / "r" / "my_homework (1).ipynb", SETUP, GOOD, GOOD_KL)
    rows = run(tmp_path, [renamed])
    assert [r["points"] for r in rows] == [1, 1]
    assert "graded as sub.ipynb by its content" in rows[0]["reason"]


def test_a_file_that_is_no_course_notebook_is_refused_clearly(tmp_path, solutions):
    other = notebook(tmp_path / "o" / "notes.ipynb", "def something_else():\n    return 1")
    rows = run(tmp_path, [other])
    assert [(r["points"], r["max_points"], r["status"]) for r in rows] == [(0, 0, "not graded")]
    assert "matches no course notebook" in rows[0]["reason"]


def test_the_reasons_table_wraps_instead_of_cutting(capsys):
    reason = "word " * 60 + "THE-END"
    grade.print_table([grade.Record("n", "s", "kl_k3", 0, 1, "failed", reason)], width=80)
    out = capsys.readouterr().out
    assert "THE-END" in out and max(len(line) for line in out.splitlines()) <= 80


def test_a_restarted_grader_skips_what_its_journal_holds(tmp_path, solutions, capsys):
    sub = notebook(tmp_path / "a" / "sub.ipynb", SETUP, GOOD, GOOD_KL)
    first = run(tmp_path, [sub])
    capsys.readouterr()
    assert run(tmp_path, [sub]) == first
    assert "1 submissions already graded, skipped" in capsys.readouterr().out


def test_a_corrupt_journal_is_refused_with_its_line(tmp_path, solutions, capsys):
    journal = tmp_path / "journal.jsonl"
    journal.write_text('{"v": 1, "kind": "done"}\n{"v": 1}\n')
    sub = notebook(tmp_path / "a" / "sub.ipynb", SETUP, GOOD, GOOD_KL)
    assert grade.main([str(sub)], None, None, journal=str(journal), **FAST) == 2
    assert "line 1 is corrupt" in capsys.readouterr().err


def test_a_grader_killed_mid_run_and_restarted_writes_byte_identical_results(tmp_path):
    """SIGKILL after the first graded submission; the restart finishes from the journal, and
    its JSON and CSV equal those of a run that was never interrupted, byte for byte."""
    subs = [notebook(tmp_path / "subs" / name / "02_rewards_and_advantages.ipynb", SETUP, adv)
            for name, adv in [("s1", GOOD), ("s2", NO_EPS), ("s3", STUB), ("s4", GOOD)]]

    def command(out):
        return [sys.executable, "-m", "grpo_lab", "grade", *map(str, subs), "--json",
                str(out / "g.json"), "--csv", str(out / "g.csv"), "--cell-timeout", "30"]

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    whole.mkdir(), killed.mkdir()
    p = subprocess.run(command(whole), capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr

    leftovers = tmp_path / "tmp"  # what SIGKILL leaves (a worker's folder, the package copy)
    leftovers.mkdir()
    proc = subprocess.Popen(command(killed), stdout=subprocess.PIPE, text=True, cwd=tmp_path,
                            env={**os.environ, "TMPDIR": str(leftovers)})
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("graded "):
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, lines
    assert not (killed / "g.json").exists()
    journal = (killed / "g.journal.jsonl").read_text()
    assert journal.count('"kind": "done"') >= 1

    time.sleep(0.5)
    p = subprocess.run(command(killed), capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "already graded, skipped" in p.stdout
    assert (killed / "g.json").read_bytes() == (whole / "g.json").read_bytes()
    assert (killed / "g.csv").read_bytes() == (whole / "g.csv").read_bytes()
    assert (whole / "g.csv").read_text().splitlines() == [  # 02's two stretch exercises last
        "student,group_advantages,rloo_advantages,zero_std_group_filter,total,max,stretch,"
        "stretch_max", "s1,1,0,0,1,3,0,2", "s2,0,0,0,0,3,0,2", "s3,0,0,0,0,3,0,2",
        "s4,1,0,0,1,3,0,2"]


def test_the_gradebook_counts_the_hints_a_student_opened(tmp_path, solutions):
    """--hints: the hint lines a submission's outputs hold, per exercise (the highest tier
    opened), as a gradebook column and a line per exercise in the feedback; the grades do
    not change. The feedback of an exercise that did not pass gives its idea (hint 1)."""
    stuck = notebook(tmp_path / "s" / "sub.ipynb", SETUP, NO_EPS, CHECK_ADV, GOOD_KL, CHECK_KL)
    nb = nbformat.read(stuck, as_version=4)
    nb.cells[1].outputs = [new_output("stream", name="stdout", text=(
        "💡 hint 1 of 2 for group_advantages, the idea: ...\n"
        "💡 hint 2 of 2 for group_advantages, the shape of the code: ...\n"))]
    nb.cells[3].outputs = [new_output("display_data", data={
        "text/plain": "💡 hint 1 of 2 for kl_k3, the idea: ..."})]
    nbformat.write(nb, stuck)
    plain = notebook(tmp_path / "p" / "sub.ipynb", SETUP, GOOD, CHECK_ADV, GOOD_KL, CHECK_KL)
    rows = run(tmp_path, [stuck, plain], csv=str(tmp_path / "g.csv"),
               feedback=str(tmp_path / "fb"), hints=True)
    assert [r["points"] for r in rows] == [0, 1, 1, 1]
    assert (tmp_path / "g.csv").read_text().splitlines() == [
        "student,group_advantages,kl_k3,total,max,hints_opened", "s,0,1,1,2,3", "p,1,1,2,2,0"]
    feedback = (tmp_path / "fb" / "s.md").read_text()
    assert "The idea: compare each completion with its own group" in feedback
    assert "view(-1, group_size)" not in feedback  # the shape of the code is hint 2's
    assert feedback.count("Hints opened: 2 of 2") == 1 and "Hints opened: 1 of 2" in feedback
    assert grade.submission_hints(b"not a notebook") == {}


PREDICTION = ('### BEGIN PREDICTION\nguess = predict("07-rollbacks", low=1, high=5)\n'
              "### END PREDICTION")


def test_a_prediction_scores_its_form_and_nothing_of_it_runs(tmp_path, monkeypatch):
    """A prediction cell scores its point when it commits a well-formed prediction, right or
    wrong; left blank it is 'not implemented', malformed 'failed', deleted 'missing'. Its
    arguments are read as literals: a call in them is not run."""
    use_manifest(monkeypatch, tmp_path, notebook(tmp_path / "solutions" / "sub.ipynb", SETUP,
                                                 GOOD, CHECK_ADV, PREDICTION))
    canary = tmp_path / "canary"
    sources = {
        "right": 'guess = predict("07-rollbacks", low=2, high=4)',
        "blank": "guess = predict('07-rollbacks', low=None, high=None)",
        "reversed": 'guess = predict("07-rollbacks", low=9, high=2)',
        "hostile": f'guess = predict("07-rollbacks", low=open({str(canary)!r}, "w").write("x"), '
                   "high=3)",
        "deleted": "x = 1",
    }
    paths = [notebook(tmp_path / who / "sub.ipynb", SETUP, GOOD, CHECK_ADV, source)
             for who, source in sources.items()]
    rows = [r for r in run(tmp_path, paths) if r["exercise"] == "predict 07-rollbacks"]
    got = {r["student"]: (r["points"], r["status"]) for r in rows}
    assert got == {"right": (1, "passed"), "blank": (0, "not implemented"),
                   "reversed": (0, "failed"), "hostile": (0, "failed"),
                   "deleted": (0, "missing")}
    reasons = {r["student"]: r["reason"] for r in rows}
    assert "low must be <= high" in reasons["reversed"]
    assert "low must be a number (got '<not a literal>')" in reasons["hostile"]
    assert not canary.exists()


# --- hostile text and files (a probe of the grader, 2026-11-28) ---------------------------------
def test_a_reason_is_kept_short_printable_and_writable_whatever_the_submission_raises(
        tmp_path, solutions, capsys):
    """An exception whose message holds a lone surrogate (UTF-8 cannot write it) crashed the
    journal, and every restart crashed again; a 3 MB type name and terminal escape codes
    went into the JSON and the printed table. Now the reason is cut, escaped, and written."""
    hostile = GOOD.replace("    g = rewards.view", "    raise type('E' * 100000, (ValueError,), "
                           "{})('oops \\ud800 \\x1b[2K\\rtotal zzz: 9/9')\n    g = rewards.view")
    bad = notebook(tmp_path / "a" / "sub.ipynb", SETUP, hostile, GOOD_KL)
    fine = notebook(tmp_path / "z" / "sub.ipynb", SETUP, GOOD, GOOD_KL)
    rows = run(tmp_path, [bad, fine], csv=str(tmp_path / "g.csv"))
    assert [r["points"] for r in rows] == [0, 1, 1, 1]
    reason = rows[0]["reason"]
    assert len(reason) <= grade.MAX_REASON_CHARS and reason.endswith("... (cut)")
    assert "\x1b" not in reason
    printed = capsys.readouterr().out
    assert "\x1b" not in printed and "total z: 2/2" in printed


def test_a_reason_shows_control_characters_as_escapes_and_writes_as_utf8():
    reason = grade.clean_reason("oops \ud800 \x1b[2K\rtotal zzz: 9/9\nnext line")
    assert "\x1b" not in reason and "\r" not in reason and "\\x1b[2K\\r" in reason
    assert "\\ud800" in reason and "\nnext line" in reason
    reason.encode("utf-8")  # a lone surrogate could not be written


def test_a_cell_too_deep_to_parse_is_no_grader_crash(tmp_path, solutions):
    """ast.parse raises MemoryError or RecursionError, not SyntaxError, on an expression
    nested 100,000 deep; the grader stopped at it and wrote nothing."""
    deep = notebook(tmp_path / "a" / "sub.ipynb", SETUP, GOOD, "x = " + "-" * 100_000 + "1",
                    "y = a" + ".b" * 100_000, GOOD_KL)
    fine = notebook(tmp_path / "z" / "sub.ipynb", SETUP, GOOD, GOOD_KL)
    rows = run(tmp_path, [deep, fine])
    assert [r["student"] for r in rows] == ["a", "a", "z", "z"]
    assert [r["points"] for r in rows[2:]] == [1, 1]


def test_hints_of_a_file_nested_too_deep_for_json_are_none():
    assert grade.submission_hints(b"[" * 200_000 + b"]" * 200_000) == {}


def test_a_file_named_as_one_lab_holding_another_is_graded_as_named(tmp_path, monkeypatch):
    """A finished easier lab submitted under the assignment's name scored its own 100%:
    now it is graded against the named lab's exercises, and the reason says what it holds."""
    folder = tmp_path / "solutions"
    use_manifest(monkeypatch, tmp_path,
                 notebook(folder / "02_easy.ipynb", SETUP, GOOD, CHECK_ADV),
                 notebook(folder / "03_hard.ipynb", SETUP, GOOD_KL, CHECK_KL))
    sneaky = notebook(tmp_path / "s" / "03_hard.ipynb", SETUP, GOOD)
    honest = notebook(tmp_path / "h" / "03_hard.ipynb", SETUP, GOOD_KL)
    rows = run(tmp_path, [sneaky, honest], csv=str(tmp_path / "g.csv"))
    assert [(r["student"], r["exercise"], r["points"], r["max_points"]) for r in rows] == [
        ("s", "kl_k3", 0, 1), ("h", "kl_k3", 1, 1)]
    assert "holds the lab of 02_easy.ipynb" in rows[0]["reason"]


def test_feedback_files_and_gradebook_cells_of_odd_student_names(tmp_path, solutions):
    """'jo smith' and 'jo_smith' made one feedback file, the second overwriting the first;
    a student name that starts like a spreadsheet formula is written as text."""
    paths = [notebook(tmp_path / name / "sub.ipynb", SETUP, GOOD, GOOD_KL)
             for name in ("jo smith", "jo_smith", "=HYPERLINK(1)")]
    run(tmp_path, paths, csv=str(tmp_path / "g.csv"), feedback=str(tmp_path / "fb"))
    files = sorted(p.name for p in (tmp_path / "fb").iterdir())
    assert len(files) == 3, files
    texts = {(tmp_path / "fb" / f).read_text().splitlines()[0] for f in files}
    assert texts == {"# Feedback for jo smith", "# Feedback for jo_smith",
                     "# Feedback for =HYPERLINK(1)"}
    rows = (tmp_path / "g.csv").read_text().splitlines()
    assert any(r.startswith("'=HYPERLINK(1)") or r.startswith('"\'=HYPERLINK(1)') for r in rows), rows


def test_whatever_breaks_one_submission_the_others_are_graded(tmp_path, solutions, monkeypatch,
                                                               capsys):
    """A worker reply forged into a shape the grader does not read once crashed the whole
    run (an AttributeError in the grader), leaving the next students ungraded and the
    journal empty; now that submission is 'not graded' with the reason."""
    real = grade._grade_submission

    def breaks_on_a(path, *args, **kwargs):
        if path.parent.name == "a":
            raise AttributeError("'int' object has no attribute 'get'")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(grade, "_grade_submission", breaks_on_a)
    bad = notebook(tmp_path / "a" / "sub.ipynb", SETUP, GOOD, GOOD_KL)
    fine = notebook(tmp_path / "z" / "sub.ipynb", SETUP, GOOD, GOOD_KL)
    rows = run(tmp_path, [bad, fine])
    assert [(r["student"], r["status"], r["points"]) for r in rows] == [
        ("a", "not graded", 0), ("a", "not graded", 0), ("z", "passed", 1), ("z", "passed", 1)]
    assert "could not grade this submission (AttributeError" in rows[0]["reason"]
    assert "[grade]" in capsys.readouterr().err
