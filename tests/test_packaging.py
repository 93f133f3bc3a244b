"""Packaging and entry-point consistency: pyproject.toml, environment.yml, README, course, CI.

Fast checks only: nothing here installs anything or starts JupyterLab.
"""

import re
import subprocess
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parent.parent
COURSE = ROOT / "course"
CI_RUN = ROOT / ".ci" / "run"
README = ROOT / "README.md"

TORCH_PIN = "2.13.0"  # the torch every install path gets by default

# pyproject.toml name -> environment.yml name, where they differ. None today: conda-forge
# uses the PyPI names for these packages, and torch stays in the pip section under its PyPI
# name so conda users get the same torch as ./course users.
CONDA_NAME: dict[str, str] = {}
IGNORED_IN_ENV = {"python", "pip"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def runtime_requirements() -> dict[str, Requirement]:
    reqs = [Requirement(r) for r in pyproject()["project"]["dependencies"]]
    return {norm(r.name): r for r in reqs}


def environment_packages() -> dict[str, str]:
    """Package entries of environment.yml's dependencies (conda and pip), name -> spec.

    A small line parser for the shape environment.yml uses (no YAML library needed):
    list items under `dependencies:`, including the nested `pip:` list. Items that are pip
    options (`-e .[test]`, `--index-url ...`) are not packages.
    """
    packages: dict[str, str] = {}
    in_deps = False
    for raw in (ROOT / "environment.yml").read_text().splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        if not line.startswith((" ", "-")):  # a top-level key
            in_deps = line.strip() == "dependencies:"
            continue
        if not in_deps:
            continue
        item = line.strip()
        if not item.startswith("- "):
            continue
        item = item[2:].strip()
        if item.endswith(":") or item.startswith("-"):  # `pip:` header, pip options
            continue
        match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", item)
        assert match, f"cannot read environment.yml entry {item!r}"
        packages[norm(match.group(0))] = item[match.end() :].strip()
    return {n: spec for n, spec in packages.items() if n not in IGNORED_IN_ENV}


def fenced_blocks(markdown: str) -> list[list[str]]:
    """The non-empty lines of each fenced code block, in order."""
    return [
        [ln.strip() for ln in body.splitlines() if ln.strip()]
        for body in re.findall(r"^```[^\n]*\n(.*?)^```", markdown, flags=re.M | re.S)
    ]


def course_default_torch() -> str:
    match = re.search(r'GRPO_LAB_TORCH:-([^}"]+)\}', COURSE.read_text())
    assert match, "course must default GRPO_LAB_TORCH to a torch requirement"
    return match.group(1)


# (a) environment.yml <-> pyproject.toml


def test_environment_yml_lists_exactly_the_runtime_dependencies():
    expected = {CONDA_NAME.get(name, name) for name in runtime_requirements()}
    listed = set(environment_packages())
    assert listed - expected == set(), "in environment.yml but not in pyproject.toml"
    assert expected - listed == set(), "in pyproject.toml but not in environment.yml"


def test_environment_yml_pins_the_same_torch_as_course():
    assert "torch" in environment_packages()
    assert "torch" + environment_packages()["torch"] == course_default_torch()


# (b), (c) README <-> .ci/run


def test_readme_opens_with_the_lab_and_test_commands():
    blocks = fenced_blocks(README.read_text())
    assert blocks[0] == ["./course lab"]
    assert blocks[1] == ["./course test"]


def test_ci_runs_the_readme_test_command_exactly():
    test_command = fenced_blocks(README.read_text())[1][0]
    commands = [
        ln.strip()
        for ln in CI_RUN.read_text().splitlines()
        if ln.strip() and not ln.strip().startswith("#")
    ]
    invocations = [c.removeprefix("exec ").strip() for c in commands if "course" in c]
    assert invocations == [test_command]


# (d) course script


def test_scripts_are_executable_and_parse():
    for script in (COURSE, CI_RUN, CI_RUN.parent / "kernels", CI_RUN.parent / "rebuild"):
        assert script.stat().st_mode & 0o111, f"{script.name} is not executable"
        subprocess.run(["bash", "-n", str(script)], check=True)


def test_course_unknown_command_prints_usage_and_exits_2():
    result = subprocess.run(
        [str(COURSE), "bogus"], capture_output=True, text=True, timeout=30, cwd=ROOT
    )
    assert result.returncode == 2
    assert "usage:" in result.stderr
    assert "bogus" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stdout == ""


def test_course_without_command_prints_usage_and_exits_2():
    result = subprocess.run([str(COURSE)], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert result.returncode == 2
    assert "usage:" in result.stderr


# (e) torch requirement


def test_pyproject_torch_range_admits_the_pinned_torch():
    spec: SpecifierSet = runtime_requirements()["torch"].specifier
    assert spec.contains(TORCH_PIN)
    assert spec.contains(f"{TORCH_PIN}+cpu")


def test_course_pins_torch_by_default():
    assert course_default_torch() == f"torch=={TORCH_PIN}"


def test_shipped_model_is_package_data():
    package_data = pyproject()["tool"]["setuptools"]["package-data"]["grpo_lab"]
    assert "assets/**/*" in package_data
