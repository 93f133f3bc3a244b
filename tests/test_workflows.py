"""The GitHub Actions workflows: actionlint accepts every one of them, and the CI workflow
runs the README's test command on Linux and macOS, on push and pull request, with .venv
cached.

actionlint comes from the test extra (pyproject.toml) as the `actionlint` command next to
this interpreter; a PATH one is used where the extra's is missing.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.y*ml"))
CI = ROOT / ".github" / "workflows" / "ci.yml"

BROKEN = """\
name: broken
on: push
jobs:
  test:
    runs-on: ${{ matrix.os }}
    steps:
      - uses: actions/checkout@v5
        with:
          no-such-input: true
"""


def actionlint() -> str:
    here = shutil.which("actionlint", path=str(Path(sys.executable).parent))
    found = here or shutil.which("actionlint")
    assert found, "actionlint is not installed: it comes with the test extra (.[test])"
    return found


def lint(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run([actionlint(), "-no-color", "-verbose", *map(str, paths)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def readme_test_command() -> str:
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", (ROOT / "README.md").read_text(),
                        flags=re.M | re.S)
    commands = [b.strip() for b in blocks if b.strip().startswith("./course test")]
    assert commands, "README.md has no fenced `./course test` block"
    return commands[0]


def test_there_are_workflows():
    assert CI in WORKFLOWS


def test_actionlint_accepts_every_workflow():
    relative = [w.relative_to(ROOT) for w in WORKFLOWS]
    p = lint(*relative)
    assert p.returncode == 0, p.stdout + p.stderr
    for rel in relative:  # each one was read and parsed, not skipped
        assert f"Linting {rel}" in p.stderr, p.stderr
        assert re.search(rf"Found 0 parse errors in \d+ ms for {re.escape(str(rel))}$",
                         p.stderr, flags=re.M), p.stderr


def test_actionlint_rejects_a_broken_workflow(tmp_path):
    # a missing matrix and an unknown input: actionlint must fail on these, or the test
    # above proves nothing
    broken = tmp_path / "broken.yml"
    broken.write_text(BROKEN)
    p = lint(broken)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "matrix" in p.stdout and "no-such-input" in p.stdout, p.stdout


def ci_workflow() -> dict:
    doc = yaml.safe_load(CI.read_text())
    doc["on"] = doc.pop(True, doc.get("on"))  # YAML 1.1 reads a bare `on` as true
    return doc


def test_ci_runs_on_push_and_pull_request_on_linux_x86_and_arm_and_macos():
    doc = ci_workflow()
    assert {"push", "pull_request"} <= set(doc["on"])
    (job,) = doc["jobs"].values()
    assert job["runs-on"] == "${{ matrix.os }}"
    assert set(job["strategy"]["matrix"]["os"]) == {"ubuntu-latest", "ubuntu-24.04-arm",
                                                   "macos-latest"}
    python = [s for s in job["steps"] if s.get("uses", "").startswith("actions/setup-python@")]
    assert [s["with"]["python-version"] for s in python] == ["3.11"]


def test_ci_runs_the_readme_test_command_exactly():
    (job,) = ci_workflow()["jobs"].values()
    runs = [s["run"].strip() for s in job["steps"] if "run" in s]
    assert readme_test_command() in runs
    # CI=true, which GitHub sets, is what makes ./course pick the cpu profile
    assert "CI" not in job.get("env", {}) or job["env"]["CI"] == "true"


def test_ci_runs_the_numerics_tests_under_other_kernels_on_linux():
    (job,) = ci_workflow()["jobs"].values()
    (step,) = [s for s in job["steps"] if s.get("run", "").strip() == ".ci/kernels"]
    assert step["if"] == "runner.os == 'Linux'"
    # before the suite, as .ci/run does
    runs = [s.get("run", "").strip() for s in job["steps"]]
    assert runs.index(".ci/kernels") < runs.index(readme_test_command())
    assert ".ci/kernels" in (ROOT / ".ci" / "run").read_text()


def test_ci_caches_venv_keyed_on_pyproject_torch_and_os(tmp_path):
    (job,) = ci_workflow()["jobs"].values()
    caches = [s for s in job["steps"] if s.get("uses", "").startswith("actions/cache@")]
    assert len(caches) == 1
    assert caches[0]["with"]["path"] == ".venv"
    key = caches[0]["with"]["key"]
    for part in ("runner.os", "hashFiles('pyproject.toml')", "steps.torch.outputs.spec",
                 "steps.python.outputs.python-version"):
        assert part in key, (part, key)
    # the step that reads the torch requirement reads the one ./course installs
    (torch_step,) = [s for s in job["steps"] if s.get("id") == "torch"]
    output = tmp_path / "github_output"
    env = {k: v for k, v in os.environ.items() if k != "GRPO_LAB_TORCH"}
    subprocess.run(["bash", "-e", "-c", torch_step["run"]], cwd=ROOT, check=True, timeout=30,
                   env={**env, "GITHUB_OUTPUT": str(output)})
    course = re.search(r'GRPO_LAB_TORCH:-([^}"]+)\}', (ROOT / "course").read_text())
    assert course and output.read_text() == f"spec={course.group(1)}\n"


@pytest.mark.parametrize("os_name, index", [
    ("ubuntu-latest", "https://download.pytorch.org/whl/cpu"),
    ("ubuntu-24.04-arm", "https://download.pytorch.org/whl/cpu"),
    ("macos-latest", ""),
])
def test_ci_takes_the_cpu_torch_build_on_linux(os_name, index):
    (job,) = ci_workflow()["jobs"].values()
    include = {row["os"]: row for row in job["strategy"]["matrix"]["include"]}
    assert include[os_name]["torch-index-url"] == index
    assert job["env"]["TORCH_INDEX_URL"] == "${{ matrix.torch-index-url }}"
