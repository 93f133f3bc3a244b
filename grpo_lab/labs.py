"""Student notebooks from the solutions: `python -m grpo_lab labs [--check]`.

In every code cell of solutions/NN_*.ipynb (nbgrader's conventions):
- the lines between `### BEGIN SOLUTION` and `### END SOLUTION` become one
  `raise NotImplementedError(...)` at the same indentation, carrying the `# Hint:` comment
  found inside the block, if any;
- the lines between `### BEGIN HIDDEN TESTS` and `### END HIDDEN TESTS` are removed;
- outputs and execution counts are cleared.
`--check` regenerates in memory and exits 1 when labs/ differs (CI runs it as a test).
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS, LABS = ROOT / "solutions", ROOT / "labs"
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


def student_notebook(path: Path):
    import nbformat

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
    import nbformat

    return nbformat.writes(nb) + "\n"


def main(check: bool = False) -> int:
    sources = sorted(SOLUTIONS.glob("*.ipynb"))
    expected = {LABS / p.name: render(student_notebook(p)) for p in sources}
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
            print(f"labs in sync: {len(expected)} notebooks")
        return 1 if differ or stale else 0
    LABS.mkdir(exist_ok=True)
    for p in differ:
        p.write_text(expected[p])
        print(f"wrote {p.relative_to(ROOT)}")
    for p in stale:
        p.unlink()
        print(f"removed {p.relative_to(ROOT)} (no solution notebook)")
    print(f"labs: {len(expected)} notebooks, {len(differ)} written, {len(stale)} removed")
    return 0
