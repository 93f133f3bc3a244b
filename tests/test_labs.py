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
