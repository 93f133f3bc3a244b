"""Every exercise as data (grpo_lab/course/exercises): the registry holds the notebooks'
exercises and nothing else, each reference passes its check, a stub is 'not implemented',
each known mistake is caught and named by its message; and a toy exercise added by following
docs/contributing.md, word for word, on a copy of the course works end to end."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from grpo_lab.course import exercises, labs

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = exercises.registry()


def test_each_notebook_module_holds_its_notebooks_exercises_in_order():
    manifest = labs.load_manifest()["notebooks"]
    for notebook, spec in manifest.items():
        if not spec["exercises"]:
            continue
        module = importlib.import_module(f"grpo_lab.course.exercises.nb{notebook[:2]}")
        assert [e.name for e in module.EXERCISES] == [e["function"] for e in spec["exercises"]]
    assert sorted(REGISTRY) == sorted(e["function"] for spec in manifest.values()
                                      for e in spec["exercises"])


def _stub(*args, **kwargs):
    raise NotImplementedError


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_a_stub_is_not_implemented_and_falls_back_to_the_exercises_reference(name, capsys):
    exercise = REGISTRY[name]
    result = exercise.check(_stub)
    assert result.status == "not implemented"
    assert result.use() is exercise.reference  # the reference the manifest records
    assert f"check_{name}: not implemented yet" in capsys.readouterr().out


def test_each_mistake_has_a_name_a_function_and_a_message_of_its_own():
    for exercise in REGISTRY.values():
        names = [m.name for m in exercise.mistakes]
        assert len(set(names)) == len(names), exercise.name
        messages = [m.message for m in exercise.mistakes]
        assert len(set(messages)) == len(messages), exercise.name
        for m in exercise.mistakes:
            assert re.fullmatch(r"[a-z0-9_]+", m.name) and len(m.message) > 30, m
            assert callable(m.wrong) and m.wrong is not exercise.reference, m


def stored_case_counts() -> dict[str, tuple[str, int]]:
    """What the solutions' stored outputs say each check passed: {name: (notebook, cases)}."""
    counts = {}
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            for out in cell.get("outputs", []):
                text = "".join(out.get("text", ""))
                for name, n in re.findall(r"✅ check_(\w+): passed (\d+) cases", text):
                    counts[name] = (path.name, int(n))
    return counts


STORED_CASES = stored_case_counts()


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_the_reference_passes_its_check(name, capsys):
    exercise = REGISTRY[name]
    result = exercise.check(exercise.reference)
    assert result.passed, result.reason
    # and the stored outputs, read without running, show the checker as it is now
    ran = re.search(r"passed (\d+) cases", capsys.readouterr().out)
    assert ran and name in STORED_CASES, f"no stored '✅ check_{name}: passed N cases' output"
    notebook, stored = STORED_CASES[name]
    assert stored == int(ran.group(1)), (
            f"solutions/{notebook} shows check_{name} passing {stored} cases; it has "
            f"{ran.group(1)} now: refresh it (python -m grpo_lab notebooks solutions/{notebook})")


MISTAKES = [(e.name, m.name) for e in REGISTRY.values() for m in e.mistakes]


@pytest.mark.parametrize(("name", "mistake"), MISTAKES)
def test_each_known_mistake_is_caught_and_named(name, mistake):
    exercise = REGISTRY[name]
    known = exercise.mistake(mistake)
    result = exercise.check(known.wrong)
    assert result.status == "failed"
    assert known.message in result.reason, result.reason


def test_a_driver_no_exercise_declares_is_not_run_by_the_grader():
    assert exercises.driver("grpo_lab.course.exercises.fixtures", "drive_step") is not None
    assert exercises.driver("grpo_lab.course.exercises.fixtures", "tiny_model") is None
    assert exercises.driver("os", "system") is None


def test_no_exercise_cell_may_reach_the_exercises_modules():
    """The exercises' modules hold every reference and every known mistake's function (one
    of them, with its switches off, is the correct accumulation loop): the grader neither
    lists them as allowed imports nor puts them in an exercise cell's prelude, and a cell
    that imports them is flagged."""
    from grpo_lab.course import grade, integrity

    specs = {e["function"]: e for nb in labs.load_manifest()["notebooks"].values()
             for e in nb["exercises"]}
    for name, spec in specs.items():
        assert not [f for f in spec["may_use"] if f.startswith(exercises.__name__)], name
        assert not [f for s in spec["setup"] for f in s["full"]
                    if f.startswith(exercises.__name__)], name
    spec = specs["accumulated_grpo_step"]
    body = ("def accumulated_grpo_step(run, problems, loss_fn, update_fn, sample_fn=None):\n"
            "    step = exercises.find('accumulated_grpo_step').mistakes[0].wrong.func\n"
            "    return step(run, problems, loss_fn, update_fn)\n")
    assert "exercises" not in grade.prelude(spec, body, set(spec["forbidden"]))
    problems = integrity.violations("from grpo_lab.course import exercises\n" + body,
                                    "accumulated_grpo_step", set(spec["forbidden"]),
                                    set(spec["may_use"]))
    assert any("grpo_lab.course" in p.reason for p in problems), problems


# --- a toy exercise, added as docs/contributing.md says ------------------------------------------
def _doc_blocks() -> dict[str, str]:
    """The code blocks of docs/contributing.md's "Add an exercise", by their marker."""
    text = (ROOT / "docs" / "contributing.md").read_text()
    blocks = dict(re.findall(r"<!-- toy-exercise: ([a-z ]+) -->\n```python\n(.*?)```", text,
                             re.S))
    assert set(blocks) == {"module", "solution cell", "check cell"}, sorted(blocks)
    return blocks


def _code_cell(source: str, cell_id: str) -> dict:
    lines = source.rstrip("\n").split("\n")
    return {"cell_type": "code", "execution_count": None, "id": cell_id, "metadata": {},
            "outputs": [], "source": [line + "\n" for line in lines[:-1]] + [lines[-1]]}


def test_a_toy_exercise_added_from_the_docs(tmp_path):
    blocks = _doc_blocks()
    course = tmp_path / "course"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in ("grpo_lab", "solutions", "labs", "docs"):
        shutil.copytree(ROOT / part, course / part, ignore=ignore)
    # step 1: the notebook's module: the imports at its top, the code, the name in EXERCISES
    module = course / "grpo_lab" / "course" / "exercises" / "nb02.py"
    src = module.read_text()
    src = src.replace("from __future__ import annotations\n",
                      "from __future__ import annotations\n\nimport torch\n\n"
                      "from .base import Case, Exercise, Mistake\n", 1)
    head, tuple_start, rest = src.partition("\nEXERCISES = (\n")
    body, close, tail = rest.partition("\n)\n")
    src = head + "\n\n" + blocks["module"] + "\n" + tuple_start + body + \
        "\n    CLIPPED_REWARD," + close + tail
    module.write_text(src)
    # step 2: the solution notebook's two cells, at its end
    solution = next((course / "solutions").glob("02_*.ipynb"))
    nb = json.loads(solution.read_text())
    nb["cells"] += [_code_cell(blocks["solution cell"], "toy-exercise"),
                    _code_cell(blocks["check cell"], "toy-check")]
    solution.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    # step 3: python -m grpo_lab labs, with the copied package
    env = {**os.environ, "PYTHONPATH": str(course)}
    done = subprocess.run([sys.executable, "-m", "grpo_lab", "labs", "--root", str(course)],
                          env=env, cwd=course, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr

    # what a learner, an instructor and the grader then get
    lab = json.loads(next((course / "labs").glob("02_*.ipynb")).read_text())
    stub = next("".join(c["source"]) for c in lab["cells"] if c.get("id") == "toy-exercise")
    assert "raise NotImplementedError(" in stub and "hint('clipped_reward')" in stub
    assert "clamp(low, high)" not in stub and "BEGIN SOLUTION" not in stub
    table = (course / "docs" / "exercises.md").read_text()
    assert "| 02 | `clipped_reward` | core | 1 | `check_clipped_reward` | " \
           "`upper_bound_missing` |" in table
    probe = textwrap.dedent("""
        import json, sys, torch
        import grpo_lab
        from grpo_lab.course.exercises import nb02
        from grpo_lab.course.hints import hint
        from grpo_lab.course.labs import load_manifest
        assert grpo_lab.__file__.startswith(sys.argv[1]), grpo_lab.__file__
        def stub(rewards, low, high):
            raise NotImplementedError
        def no_clamp(rewards, low, high):
            return rewards
        results = {name: nb02.check_clipped_reward(f).reason or "passed" for name, f in (
            ("reference", nb02.reference_clipped_reward), ("stub", stub),
            ("upper_bound_missing", lambda r, lo, hi: r.clamp(min=lo)),
            ("no_clamp", no_clamp))}
        spec = [e for nb in load_manifest()["notebooks"].values()
                for e in nb["exercises"] if e["function"] == "clipped_reward"]
        results["manifest"] = spec[0]["reference"] if spec else None
        results["hint"] = hint("clipped_reward")
        print("RESULTS" + json.dumps(results))
    """)
    done = subprocess.run([sys.executable, "-c", probe, str(course)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(done.stdout.split("RESULTS", 1)[1])
    assert results["reference"] == "passed"
    assert results["stub"].startswith("not implemented yet")
    assert results["upper_bound_missing"] == "rewards past both ends: only the lower bound " \
        "is applied: clamp to [low, high]"
    assert results["no_clamp"].startswith("rewards past both ends: your result is wrong"), \
        results["no_clamp"]
    assert results["manifest"] == "grpo_lab.course.exercises.nb02.reference_clipped_reward"
    assert "a reward below low becomes low" in results["hint"]


def test_a_built_checker_holds_the_learner_to_the_references_refusals_and_hints():
    """Where the reference raises on a case, the learner's function must raise the same kind
    of error (returning a value or raising another kind fails, naming both); a case's hint
    closes the message of a result no known mistake explains."""
    from grpo_lab.course.exercises.base import Case, Exercise

    def halve(n: int) -> int:
        if n % 2:
            raise ValueError(f"{n} is odd")
        return n // 2

    check = Exercise("halve", halve, cases=(
        Case("an even number", (4,), hint="half of 4 is 2"),
        Case("an odd number", (3,), hint="odd numbers have no half here"),
    ), tolerance=dict(atol=0.0, rtol=0.0)).check

    assert check(halve).passed
    returned = check(lambda n: n // 2)
    assert returned.status == "failed" and returned.reason == (
        "an odd number: raise ValueError here, as the reference does (3 is odd); you returned "
        "1; odd numbers have no half here")
    other = check(lambda n: n // 2 if n % 2 == 0 else 1 / 0)
    assert "yours raised ZeroDivisionError: division by zero" in other.reason
    assert check(_stub).status == "not implemented"
    wrong = check(lambda n: n)
    assert wrong.reason == ("an even number: your result is wrong: yours is 4, expected 2; "
                            "half of 4 is 2")


def test_a_clip_that_lets_a_nan_norm_through_is_told_why():
    """min(1, c / NaN) is 1 in Python: the finite gradients pass unchanged, where torch's
    clip_grad_norm_ (and the course's) makes every one NaN (notebook 06, section 4)."""
    import math

    def python_min(grads, max_norm):
        norm = math.sqrt(sum(float((g ** 2).sum()) for g in grads))
        scale = min(1.0, max_norm / (norm + 1e-6))
        return [g * scale for g in grads], norm

    result = REGISTRY["clip_grad_norm"].check(python_min)
    assert result.status == "failed"
    assert "a NaN entry" in result.reason and "min(1, c / NaN) is 1" in result.reason


def test_a_loss_whose_stats_are_tensors_is_told_to_return_numbers():
    """Tensor stats have the reference's values, but the learner's step puts them into its
    metrics, and writing those as JSON then fails far from the loss: the check says so."""
    import torch

    from grpo_lab.course.steps import grpo_loss

    def tensor_stats(*args):
        loss, stats = grpo_loss(*args)
        return loss, {k: torch.tensor(v) for k, v in stats.items()}

    result = REGISTRY["grpo_loss"].check(tensor_stats)
    assert result.status == "failed"
    assert "is a tensor: return a plain Python number (`.item()`)" in result.reason
