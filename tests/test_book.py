"""book/build.py's staging, without Jupyter Book: with the repository's public URL set in one
place (GRPO_LAB_REPO_URL), every notebook page gets a launch line for its lab on a hosted
notebook service, and the site a repository button; unset, neither. (The whole site is built
and opened in a browser by tests/browser/test_site.py.)"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def build():
    spec = importlib.util.spec_from_file_location("book_build", ROOT / "book" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def staged(build, tmp_path, name: str) -> list[dict]:
    source = ROOT / "solutions" / f"{name}.ipynb"
    pages = {p.resolve() for p in (ROOT / "solutions").glob("*.ipynb")}
    build.Stager(tmp_path, pages).stage(source, f"solutions/{name}.ipynb")
    return json.loads((tmp_path / "solutions" / f"{name}.ipynb").read_text())["cells"]


def test_a_github_repository_gives_each_notebook_page_its_labs_launch_line(build, tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv("GRPO_LAB_REPO_URL", "https://github.com/someone/grpo-lab/")
    monkeypatch.setenv("GRPO_LAB_REPO_BRANCH", "spring")
    name = "04_the_training_loop"
    cells = staged(build, tmp_path, name)
    original = json.loads((ROOT / "solutions" / f"{name}.ipynb").read_text())["cells"]
    assert len(cells) == len(original)
    title, launch, rest = "".join(cells[0]["source"]).split("\n\n", 2)
    old_title, _, old_rest = "".join(original[0]["source"]).partition("\n")
    assert title == old_title and rest == old_rest.lstrip("\n")  # the title, then the line
    assert ("https://colab.research.google.com/github/someone/grpo-lab/blob/spring/labs/"
            f"{name}.ipynb") in launch
    assert "%pip install git+https://github.com/someone/grpo-lab@spring" in launch
    config = build.config_text()
    assert "use_repository_button: true" in config
    assert 'url: "https://github.com/someone/grpo-lab"' in config
    assert 'branch: "spring"' in config


def test_without_a_repository_or_off_github_no_launch_line(build, tmp_path, monkeypatch):
    name = "02_rewards_and_advantages"
    original = json.loads((ROOT / "solutions" / f"{name}.ipynb").read_text())["cells"]
    monkeypatch.delenv("GRPO_LAB_REPO_URL", raising=False)
    first = "".join(original[0]["source"])
    assert "".join(staged(build, tmp_path / "none", name)[0]["source"]) == first
    assert "use_repository_button: false" in build.config_text()
    monkeypatch.setenv("GRPO_LAB_REPO_URL", "https://gitlab.example.org/course/grpo-lab")
    gitlab = staged(build, tmp_path / "gitlab", name)
    assert "".join(gitlab[0]["source"]) == first  # Colab opens notebooks from GitHub
    assert "use_repository_button: true" in build.config_text()
