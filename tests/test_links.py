"""Every link and repository path the learner reads resolves inside the repository.

Sources: README.md, docs/**/*.md, labs/README.md, solutions/README.md and the markdown
cells of solutions/*.ipynb and labs/*.ipynb. In them:

- Markdown links `[text](target)` and images, HTML `href="..."` / `src="..."`: resolved
  against the file's folder (a target starting with `/` against the repository root);
  http(s)/mailto URLs and pure `#anchors` are skipped; `file.md#anchor` must name a file
  that exists.
- Backticked paths (inline code and fenced blocks, one whitespace-separated token at a
  time) that look like repository files: a token with a `/` that ends in `/` or in a file
  extension, and either starts with `./` or `../` (resolved against the file's folder) or
  starts with a top-level entry of the repository (resolved against the root), e.g.
  `benchmarks/RESULTS.md`. `path.py:123` and `path.py::test_name` are checked as `path.py`.
- `grpo_lab.module.name` in backticks: the module must import and have the name.
- `python -m grpo_lab scenario NAME`: NAME must be in `python -m grpo_lab scenario --list`.

A target that resolves outside the repository is dead even if it exists on this machine:
learners get the repository and nothing next to it. The same sources (markdown and code
cells) must not mention material learners never have: the source folder of the field
reports, its design notes or its file names.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MD_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_LINK = re.compile(r"""(?:href|src)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
FENCE = re.compile(r"^\s*(```|~~~).*?^\s*\1\s*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
EXTENSION = re.compile(r"\.[A-Za-z][A-Za-z0-9]{0,5}$")
LINE_SUFFIX = re.compile(r"(::[\w\[\]-]+|:\d+(?:-\d+)?(?:,\s*\d+(?:-\d+)?)*)$")
MODULE_REF = re.compile(r"^grpo_lab(?:\.[A-Za-z_]\w*)+")
SCENARIO_REF = re.compile(r"grpo_lab scenario ([a-z0-9][a-z0-9-]*)")
PLACEHOLDER = set("*<>{}$[]|")

# material that is not part of the repository: the field reports' source folder, its
# design notes, and the report files' names (NNN_<16 hex digits>.txt)
# (spelled in parts, so that this file does not itself mention them)
OUTSIDE, SEEDS, DESIGN = "../" + "shared", "shared" + "/seeds", "DESIGN" + ".md"
FORBIDDEN = [
    (re.compile(re.escape(OUTSIDE) + r"\b"), OUTSIDE),
    (re.compile(re.escape(SEEDS)), SEEDS),
    (re.compile(re.escape(DESIGN)), DESIGN),
    (re.compile(r"\b\d{3}_[0-9a-f]{16}(?:\.txt)?\b"), "a field report's file name"),
]


# --- extraction -------------------------------------------------------------------------
def _clean_token(token: str) -> str:
    token = token.strip().strip("'\"").lstrip("(").rstrip(".,;)")
    return LINE_SUFFIX.sub("", token)


def _looks_like_repo_path(token: str, root: Path) -> bool:
    if not token or "/" not in token or token.startswith(("/", "~", "-")):
        return False
    if any(c in PLACEHOLDER for c in token) or "..." in token.replace("../", ""):
        return False
    if "://" in token or token.startswith("#"):
        return False
    if not (token.endswith("/") or EXTENSION.search(token)):
        return False
    if token.startswith(("./", "../")):
        return True
    return (root / token.split("/", 1)[0]).exists()


def extract_targets(text: str, root: Path = ROOT) -> list[tuple[str, str]]:
    """(kind, target) for every link and repository path in a markdown text.

    kind is "link" (markdown or HTML, relative to the file's folder) or "path" (backticked:
    relative to the file's folder when it starts with ./ or ../, else to the root)."""
    found: list[tuple[str, str]] = []
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for rx in (MD_LINK, HTML_LINK):
        for m in rx.finditer(prose):
            found.append(("link", m.group(1)))
    code = [m.group(1) for m in INLINE_CODE.finditer(prose)]
    code += [m.group(0) for m in FENCE.finditer(text)]
    for chunk in code:
        for raw in chunk.split():
            token = _clean_token(raw)
            if _looks_like_repo_path(token, root):
                found.append(("path", token))
    return found


def _is_external(target: str) -> bool:
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target)) or target.startswith("//")


def resolve(kind: str, target: str, folder: Path, root: Path = ROOT) -> Path | None:
    """The file a target points at, or None for what is not checked (URLs, #anchors)."""
    if _is_external(target) or target.startswith("#"):
        return None
    path = target.split("#", 1)[0].split("?", 1)[0]
    if not path:
        return None
    if path.startswith("/"):
        return (root / path.lstrip("/")).resolve()
    if kind == "path" and not path.startswith(("./", "../")):
        return (root / path).resolve()
    return (folder / path).resolve()


def dead_targets(text: str, folder: Path, root: Path = ROOT) -> list[str]:
    """The targets of `text` (a file in `folder`) that do not resolve inside `root`."""
    dead = []
    root = root.resolve()
    for kind, target in extract_targets(text, root):
        path = resolve(kind, target, folder, root)
        if path is None:
            continue
        if not path.is_relative_to(root):
            dead.append(f"{target} (outside the repository)")
        elif not path.exists():
            dead.append(f"{target} (no such file: {path.relative_to(root)})")
    return dead


def forbidden_mentions(text: str) -> list[str]:
    return [name for rx, name in FORBIDDEN if rx.search(text)]


# --- the sources ------------------------------------------------------------------------
def markdown_sources(root: Path = ROOT) -> list[tuple[str, Path, str]]:
    """(label, folder, text) for each markdown file and each notebook markdown cell."""
    out = []
    files = [root / "README.md", root / "labs" / "README.md", root / "solutions" / "README.md"]
    files += sorted((root / "docs").rglob("*.md"))
    for f in files:
        if f.exists():
            out.append((str(f.relative_to(root)), f.parent, f.read_text(encoding="utf-8")))
    for nb_path, i, cell in _notebook_cells(root):
        if cell["cell_type"] == "markdown":
            out.append((f"{nb_path.relative_to(root)} (cell {i})", nb_path.parent,
                        _source(cell)))
    return out


def _notebook_cells(root: Path):
    for folder in ("solutions", "labs"):
        for nb_path in sorted((root / folder).glob("*.ipynb")):
            cells = json.loads(nb_path.read_text(encoding="utf-8"))["cells"]
            for i, cell in enumerate(cells):
                yield nb_path, i, cell


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


# --- unit tests of the checker ----------------------------------------------------------
def _fake_repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "docs" / "reports").mkdir(parents=True)
    (root / "benchmarks").mkdir()
    (root / "solutions").mkdir()
    (root / "benchmarks" / "RESULTS.md").write_text("x")
    (root / "docs" / "reports" / "000.md").write_text("x")
    cells = [{"cell_type": "markdown", "source": ["[next](06_fix.ipynb)\n", "`docs/reports/000.md`"]},
             {"cell_type": "code", "source": f"print('see {OUTSIDE}/seeds')", "outputs": []}]
    (root / "solutions" / "05_break_it.ipynb").write_text(json.dumps({"cells": cells}))
    (tmp_path / "outside.md").write_text("exists, but not in the repository")
    return root


def test_extractor_finds_links_html_and_backticked_paths(tmp_path):
    root = _fake_repo(tmp_path)
    text = """
[ok](../../solutions/05_break_it.ipynb) ![img](pic.png "title") [web](https://x.org/a.md)
[anchor](#summary) [with anchor](000.md#fact-versus-reading) <a href="../glossary.md">g</a>
See `benchmarks/RESULTS.md`, `benchmarks/RESULTS.md:12`, `runs/stable/metrics.jsonl`,
`grpo_lab/TRL`, `exp(logp - old_logp)`, `solutions/*.ipynb` and `../x/y.md`.

```bash
bash benchmarks/gpu_checks.sh [OUT_DIR]
```
"""
    targets = extract_targets(text, root)
    assert ("link", "../../solutions/05_break_it.ipynb") in targets
    assert ("link", "pic.png") in targets
    assert ("link", "https://x.org/a.md") in targets
    assert ("link", "#summary") in targets
    assert ("link", "000.md#fact-versus-reading") in targets
    assert ("link", "../glossary.md") in targets
    assert targets.count(("path", "benchmarks/RESULTS.md")) == 2  # the :12 suffix is dropped
    assert ("path", "../x/y.md") in targets
    assert ("path", "benchmarks/gpu_checks.sh") in targets  # from the fenced block
    paths = {t for k, t in targets if k == "path"}
    # not repository paths: an unknown top-level folder, no extension, a glob, code
    assert not paths & {"runs/stable/metrics.jsonl", "grpo_lab/TRL", "solutions/*.ipynb"}


def test_checker_reports_dead_links_and_only_those(tmp_path):
    root = _fake_repo(tmp_path)
    folder = root / "docs" / "reports"
    text = """
[good](../../solutions/05_break_it.ipynb) [good](000.md#anchor) [web](https://e.org/x)
[top](#top) `benchmarks/RESULTS.md`
[dead](001.md) [dead](../../labs/05_break_it.ipynb#x) `benchmarks/MISSING.md`
[escape](../../../outside.md) `../../../outside.md`
"""
    dead = dead_targets(text, folder, root)
    assert dead == [
        "001.md (no such file: docs/reports/001.md)",
        "../../labs/05_break_it.ipynb#x (no such file: labs/05_break_it.ipynb)",
        "../../../outside.md (outside the repository)",
        "benchmarks/MISSING.md (no such file: benchmarks/MISSING.md)",
        "../../../outside.md (outside the repository)",
    ]


def test_checker_on_a_real_file_with_a_dead_link(tmp_path):
    root = _fake_repo(tmp_path)
    page = root / "docs" / "page.md"
    page.write_text("[report](reports/000.md) and [missing](reports/009.md)\n")
    sources = [s for s in markdown_sources(root) if s[0] == "docs/page.md"]
    assert len(sources) == 1
    _, folder, text = sources[0]
    assert dead_targets(text, folder, root) == [
        "reports/009.md (no such file: docs/reports/009.md)"]
    # notebook markdown cells are sources too (code cells are not)
    (label, folder, text), = [s for s in markdown_sources(root) if s[0].startswith("solutions/")]
    assert label == "solutions/05_break_it.ipynb (cell 0)"
    assert dead_targets(text, folder, root) == [
        "06_fix.ipynb (no such file: solutions/06_fix.ipynb)"]


def test_forbidden_mentions_are_found():
    assert forbidden_mentions(f"see (`{OUTSIDE}/seeds/`)") == [OUTSIDE, SEEDS]
    assert forbidden_mentions(f"{DESIGN} adds a third way") == [DESIGN]
    assert forbidden_mentions("file 000_0123456789abcdef.txt") == ["a field report's file name"]
    assert forbidden_mentions("report 000 and the shared cores; design.") == []


# --- the repository ---------------------------------------------------------------------
def test_every_link_and_path_resolves_inside_the_repository():
    problems = []
    for label, folder, text in markdown_sources():
        problems += [f"{label}: {d}" for d in dead_targets(text, folder)]
    assert not problems, "dead links or paths:\n" + "\n".join(problems)


def test_no_mention_of_material_outside_the_repository():
    problems = []
    for label, _, text in markdown_sources():
        problems += [f"{label}: mentions {name}" for name in forbidden_mentions(text)]
    for nb_path, i, cell in _notebook_cells(ROOT):
        if cell["cell_type"] == "code":
            for name in forbidden_mentions(_source(cell)):
                problems.append(f"{nb_path.relative_to(ROOT)} (cell {i}, code): mentions {name}")
    assert not problems, "\n".join(problems)


def _module_ref_resolves(ref: str) -> bool:
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            if importlib.util.find_spec(name) is None:
                continue
        except (ImportError, AttributeError, ValueError):
            continue
        obj = importlib.import_module(name)
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_grpo_lab_names_in_the_text_exist():
    refs: dict[str, set[str]] = {}
    for label, _, text in markdown_sources():
        for m in INLINE_CODE.finditer(text):
            for raw in m.group(1).split():
                ref = MODULE_REF.match(_clean_token(raw))
                if ref:
                    refs.setdefault(ref.group(0), set()).add(label.split(" (cell")[0])
    missing = [f"{ref} (in {', '.join(sorted(where))})" for ref, where in sorted(refs.items())
               if not _module_ref_resolves(ref)]
    assert not missing, "names that do not import:\n" + "\n".join(missing)


@pytest.fixture(scope="module")
def scenario_names() -> set[str]:
    out = subprocess.run([sys.executable, "-m", "grpo_lab", "scenario", "--list"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line and not line[0].isspace()}


def test_scenario_commands_name_real_scenarios(scenario_names):
    assert "naive-run" in scenario_names
    problems = []
    for label, _, text in markdown_sources():
        for m in SCENARIO_REF.finditer(text):
            if m.group(1) not in scenario_names:
                problems.append(f"{label}: scenario {m.group(1)}")
    assert not problems, "unknown scenarios:\n" + "\n".join(problems)
