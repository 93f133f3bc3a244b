"""Student notebooks from the solutions: `python -m grpo_lab labs [--check]`.

In every code cell of solutions/NN_*.ipynb (nbgrader's conventions):
- the lines between `### BEGIN SOLUTION` and `### END SOLUTION` become one
  `raise NotImplementedError(...)` at the same indentation, carrying the `# Hint:` comment
  found inside the block, if any;
- the lines between `### BEGIN HIDDEN TESTS` and `### END HIDDEN TESTS` are removed;
- outputs and execution counts are cleared.
It also writes the exercise manifest, `grpo_lab/course/exercises.json`: the exercises
each notebook must have (the `check_<name>(` calls of its solution, in order). It ships
inside the package, so `grade` knows them wherever grpo_lab is installed from.
`--check` regenerates in memory and exits 1 when labs/ or the manifest differs (CI runs
it as a test).

The course's files are found from `--root`, else from the current directory or one of its
parents that holds solutions/ and labs/, else from a source checkout the package runs from.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat

from . import checks

MANIFEST = Path(__file__).with_name("exercises.json")
CHECK_CALL = re.compile(r"\bcheck_(\w+)\(")
DEFAULT_HINT = "write this function: its docstring says what it takes and returns"


class MarkerError(ValueError):
    """Unbalanced or nested solution / hidden-test markers in a solution cell."""


def student_source(source: str, where: str = "") -> str:
    out: list[str] = []
    mode, indent, hint = None, "", None
    for n, line in enumerate(source.splitlines(), 1):
        tag = line.strip()
        if tag in ("### BEGIN SOLUTION", "### BEGIN HIDDEN TESTS"):
            if mode is not None:
                raise MarkerError(f"{where} line {n}: {tag!r} inside an open {mode} block")
            mode, indent, hint = tag.split()[-1], line[: len(line) - len(line.lstrip())], None
            continue
        if tag in ("### END SOLUTION", "### END HIDDEN TESTS"):
            if mode != tag.split()[-1]:
                raise MarkerError(f"{where} line {n}: {tag!r} without its BEGIN")
            if mode == "SOLUTION":
                out.append(f"{indent}raise NotImplementedError({json.dumps(hint or DEFAULT_HINT)})")
            mode = None
            continue
        if mode == "SOLUTION":
            if tag.lower().startswith("# hint:") and hint is None:
                hint = tag[len("# hint:"):].strip()
            continue
        if mode == "TESTS":
            continue
        out.append(line)
    if mode is not None:
        raise MarkerError(f"{where}: a {mode} block is never closed")
    return "\n".join(out)


def find_root(root: str | Path | None = None) -> Path:
    """The course repository: `root`, else the current directory or a parent holding
    solutions/ and labs/, else the source checkout this package runs from."""
    def is_course(d: Path) -> bool:
        return (d / "solutions").is_dir() and (d / "labs").is_dir()

    if root is not None:
        root = Path(root).resolve()
        if not is_course(root):
            raise FileNotFoundError(f"--root {root}: no solutions/ and labs/ there")
        return root
    here = Path.cwd().resolve()
    for d in (here, *here.parents, Path(__file__).resolve().parents[2]):
        if is_course(d):
            return d
    raise FileNotFoundError(
        "the course's solutions/ and labs/ were not found from the current directory; run "
        "this inside the course repository or pass --root DIR"
    )


def exercises_of(nb) -> list[str]:
    """The exercises a notebook checks, in order: its `check_<name>(` calls that are
    exercise checkers (`sampling.check_token_ids` is not one)."""
    names: list[str] = []
    for cell in nb.cells:
        if cell.cell_type == "code":
            for name in CHECK_CALL.findall(cell.source):
                if hasattr(checks, f"check_{name}") and name not in names:
                    names.append(name)
    return names


def manifest_text(solutions: list[Path]) -> str:
    exercises = {p.name: exercises_of(nbformat.read(p, as_version=4)) for p in solutions}
    return json.dumps(exercises, indent=1) + "\n"


def expected_exercises(notebook_name: str) -> list[str] | None:
    """The exercises of the course notebook of this file name, from the shipped manifest;
    None when the course has no notebook of that name."""
    return json.loads(MANIFEST.read_text()).get(notebook_name)


def student_notebook(path: Path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            cell.source = student_source(cell.source, f"{path.name} cell {i}")
            cell.outputs = []
            cell.execution_count = None
            cell.metadata.pop("execution", None)
    nb.metadata.pop("widgets", None)
    return nb


def render(nb) -> str:
    return nbformat.writes(nb) + "\n"


def main(check: bool = False, root: str | Path | None = None) -> int:
    ROOT = find_root(root)
    SOLUTIONS, LABS = ROOT / "solutions", ROOT / "labs"
    sources = sorted(SOLUTIONS.glob("*.ipynb"))
    expected = {LABS / p.name: render(student_notebook(p)) for p in sources}
    # the manifest in the checkout's package (the one the next install ships)
    expected[ROOT / "grpo_lab" / "course" / MANIFEST.name] = manifest_text(sources)
    existing = set(LABS.glob("*.ipynb"))
    stale = sorted(existing - set(expected))
    differ = sorted(p for p, text in expected.items()
                    if not p.exists() or p.read_text() != text)
    if check:
        for p in differ:
            print(f"labs out of sync: {p.relative_to(ROOT)} (run `python -m grpo_lab labs`)")
        for p in stale:
            print(f"labs out of sync: {p.relative_to(ROOT)} has no solution notebook")
        if not differ and not stale:
            print(f"labs in sync: {len(sources)} notebooks and the exercise manifest")
        return 1 if differ or stale else 0
    LABS.mkdir(exist_ok=True)
    for p in differ:
        p.write_text(expected[p])
        print(f"wrote {p.relative_to(ROOT)}")
    for p in stale:
        p.unlink()
        print(f"removed {p.relative_to(ROOT)} (no solution notebook)")
    print(f"labs: {len(sources)} notebooks, {len(differ)} files written, {len(stale)} removed")
    return 0
