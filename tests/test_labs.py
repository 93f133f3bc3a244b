"""labs/ is generated from solutions/ and kept in sync."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_lab.course.labs import MarkerError, student_source

SOLVED = '''def group_advantages(rewards, group_size):
    """(B,) rewards -> (B,) advantages within each group.

    More details."""
    ### BEGIN SOLUTION
    # Idea: compare each completion with the others of its prompt
    # Hint: reshape to (B/G, G) and normalise each row
    g = rewards.view(-1, group_size)
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).reshape(-1)
    ### END SOLUTION'''


def test_solution_block_becomes_a_stub_that_says_what_to_do_not_how():
    """The stub's message is the function's task (its docstring's first line) and where the
    hints are; neither hint tier, and no code, is in the lab."""
    out = student_source(SOLVED)
    assert "g.mean" not in out and "reshape" not in out and "compare each" not in out
    assert out.splitlines()[-1] == (
        '    raise NotImplementedError("group_advantages: (B,) rewards -> (B,) advantages '
        'within each group. Not written yet: its docstring has the details. Stuck? '
        'hint(\'group_advantages\') gives the idea; a second call, the shape of the code.")'
    )
    assert '"""(B,) rewards -> (B,) advantages within each group.' in out


def test_hidden_tests_are_removed():
    src = "r = check(f)\n### BEGIN HIDDEN TESTS\nassert r.passed, r.reason\n### END HIDDEN TESTS\nf = r.use()"
    assert student_source(src) == "r = check(f)\nf = r.use()"


@pytest.mark.parametrize("src", [
    "### BEGIN SOLUTION\nx = 1",
    "x = 1\n### END SOLUTION",
    "### BEGIN SOLUTION\n### BEGIN HIDDEN TESTS\n### END HIDDEN TESTS\n### END SOLUTION",
])
def test_unbalanced_markers_are_an_error(src):
    with pytest.raises(MarkerError):
        student_source(src, "x.ipynb cell 3")


def test_labs_are_in_sync_with_solutions(capsys):
    """`python -m grpo_lab labs --check`, in this process (test_wheel runs it as a command)."""
    from grpo_lab.cli import main

    code = main(["labs", "--check"])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    assert "labs in sync" in out.out


def test_the_manifest_describes_each_exercise_for_the_grader():
    from grpo_lab.course import labs

    ex = {e["function"]: e for nb in labs.load_manifest()["notebooks"].values()
          for e in nb["exercises"]}
    k3 = ex["kl_k3"]
    assert (k3["checker"], k3["reference"], k3["points"]) == (
        "check_kl_k3", "grpo_lab.objective.kl_k3", 1)
    assert k3["tripwires"] == [["grpo_lab/objective.py", "kl_k3"]]
    assert {"kl_k3", "check_kl_k3"} <= set(k3["forbidden"])
    assert "import torch" in [s["source"] for s in k3["setup"]]
    assert not any(n.endswith(".kl_k3") for n in k3["may_use"])
    assert k3["cell_id"] and k3["check_cell_id"] and k3["hint"]
    assert labs.expected_exercises("03_the_grpo_objective.ipynb") == [
        "kl_k3", "clipped_surrogate", "token_weights", "dual_clip_surrogate",
        "clip_higher_fractions", "sequence_level_ratio"]
    tiers = {e["function"]: e["tier"] for e in
             labs.load_manifest()["notebooks"]["03_the_grpo_objective.ipynb"]["exercises"]}
    assert tiers["kl_k3"] == "core" and tiers["dual_clip_surrogate"] == "stretch"
    assert labs.expected_exercises("nope.ipynb") is None


def test_every_exercise_has_two_hint_tiers_and_no_lab_holds_them():
    """Every exercise of the course has an idea (hint 1, words) and a hint (hint 2, the
    shape of the code), different from each other; the labs hold neither (the stub points to
    hint()), and an idea never quotes its own exercise's code hint."""
    import glob

    import nbformat

    from grpo_lab.course import labs

    lab_cells = {c.get("id"): c.source for p in glob.glob("labs/*.ipynb")
                 for c in nbformat.read(p, as_version=4).cells}
    exercises = [e for nb in labs.load_manifest()["notebooks"].values()
                 for e in nb["exercises"]]
    assert len(exercises) >= 40
    for e in exercises:
        idea, shape, stub = e["idea"], e["hint"], lab_cells[e["cell_id"]]
        assert len(idea) > 20 and len(shape) > 20 and idea != shape, e["function"]
        assert shape not in idea, e["function"]
        assert idea not in stub and shape not in stub, e["function"]
        assert f"hint('{e['function']}')" in stub, e["function"]


def test_an_exercise_without_an_idea_is_refused_by_name(tmp_path):
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    from grpo_lab.course import labs

    source = ("def kl_k3(logp, ref_logp):\n    ### BEGIN SOLUTION\n    # Hint: r.exp() - r - 1\n"
              "    r = ref_logp - logp\n    return r.exp() - r - 1\n    ### END SOLUTION")
    path = tmp_path / "x.ipynb"
    nbformat.write(new_notebook(cells=[new_code_cell(source), new_code_cell(
        "from grpo_lab.course.exercises.nb03 import check_kl_k3\ncheck_kl_k3(kl_k3)")]), path)
    with pytest.raises(ValueError, match=r"kl_k3\(\) has no `# Idea: \.\.\.` comment"):
        labs.manifest([path])


def test_hint_gives_the_idea_then_the_shape_then_says_that_was_all(capsys, monkeypatch):
    from grpo_lab.course import hints

    monkeypatch.setattr(hints, "_opened", {})
    idea, shape = hints.hints_of()["token_weights"]
    assert hints.hint("token_weights") == idea
    assert hints.hint("token_weights") == shape
    assert "no more hints for token_weights" in hints.hint("token_weights")
    assert hints.hint("token_weights", level=1) == idea
    out = capsys.readouterr().out
    assert "💡 hint 1 of 2 for token_weights, the idea:" in out
    assert "💡 hint 2 of 2 for token_weights, the shape of the code:" in out
    assert hints.opened_hints(out) == {"token_weights": 2}
    with pytest.raises(ValueError, match="no exercise is named 'token_weight'; the exercises"):
        hints.hint("token_weight")
    with pytest.raises(ValueError, match="level must be 1"):
        hints.hint("kl_k3", level=3)


@pytest.mark.parametrize("edition", ["labs", "solutions"])
def test_a_notebook_opened_without_the_package_says_what_to_install(edition):
    """Opened where grpo_lab is not installed (a notebook service, another kernel), each
    notebook's first cell stops before any other import with an error whose message, the
    traceback's last line, says how to install it."""
    root = Path(__file__).resolve().parents[1]
    for path in sorted((root / edition).glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        first = "".join(next(c for c in cells if c["cell_type"] == "code")["source"])
        # -I -S: no site-packages, so no grpo_lab (nor torch) for this Python
        p = subprocess.run([sys.executable, "-I", "-S", "-c", first], capture_output=True,
                           text=True, timeout=60, cwd=path.parent)
        assert p.stderr.strip(), (path.name, p.returncode, p.stdout[-300:])
        last = p.stderr.strip().splitlines()[-1]
        assert p.returncode == 1 and last.startswith(
            "ModuleNotFoundError: grpo_lab is not installed"), (path.name, p.stderr[-500:])
        assert "./course lab" in last and "%pip install" in last, path.name


def test_nbformat_loads_without_rfc3987_syntax_and_leaves_it_importable():
    """labs._nbformat skips jsonschema's `iri` checker (2.4 s of grammar compiling) and
    validates notebooks all the same; afterwards the module imports as usual."""
    probe = ("import sys, importlib.util\n"
             "from grpo_lab.course import labs\n"
             "nbformat = labs._nbformat()\n"
             "assert 'rfc3987_syntax' not in sys.modules\n"
             "nb = nbformat.read('solutions/04_the_training_loop.ipynb', as_version=4)\n"
             "nbformat.validate(nb)\n"
             "nb.cells[0]['cell_type'] = 'nonsense'\n"
             "try:\n"
             "    nbformat.validate(nb)\n"
             "except nbformat.ValidationError:\n"
             "    print('invalid caught')\n"
             "if importlib.util.find_spec('rfc3987_syntax'):  # installed with Jupyter\n"
             "    import rfc3987_syntax  # noqa: F401\n"
             "print('importable')\n")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert p.returncode == 0 and p.stdout.split() == ["invalid", "caught", "importable"], (
        p.stdout, p.stderr[-1000:])
