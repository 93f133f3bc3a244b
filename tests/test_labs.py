"""labs/ is generated from solutions/ and kept in sync."""

import subprocess
import sys

import pytest

from grpo_lab.course.labs import MarkerError, student_source

SOLVED = '''def group_advantages(rewards, group_size):
    """(B,) -> (B,)"""
    ### BEGIN SOLUTION
    # Hint: reshape to (B/G, G) and normalise each row
    g = rewards.view(-1, group_size)
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).reshape(-1)
    ### END SOLUTION'''


def test_solution_block_becomes_a_stub_with_the_hint():
    out = student_source(SOLVED)
    assert "g.mean" not in out
    assert out.splitlines()[-1] == (
        '    raise NotImplementedError("reshape to (B/G, G) and normalise each row")'
    )
    assert '"""(B,) -> (B,)"""' in out


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


def test_labs_are_in_sync_with_solutions():
    p = subprocess.run([sys.executable, "-m", "grpo_lab", "labs", "--check"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


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
