"""Your functions from earlier notebooks, in a later one: `load_yours("group_advantages", ...)`.

The trainer you build in notebook 04 calls functions you wrote in 01 to 03; notebooks 05 to
11 harden the step you wrote in 04. Each notebook runs in its own kernel, so a later one
reads your earlier notebook files (in the folder the kernel runs in, where Jupyter and nbval
start it: the notebook's own), finds each function's exercise cell (by its cell id, else the
last cell that defines it), runs it with the imports before it, checks it with its checker,
and hands you your version if it passes, the package's reference if it does not (saying why).
A cell that calls `load_yours` itself is reconstructed the same way, so notebook 05 gets the
04 step together with the 04 pieces it calls.

Reading your own notebook file runs your own code in your own kernel: nothing here is
sandboxed (the grader, which runs other people's code, is: grade.py).
"""

from __future__ import annotations

import contextlib
import importlib
import io
from pathlib import Path

from .grade import Cell, defines, prelude, read_cells
from .labs import find_checker, load_manifest, loaded_names, python_source


def exercise_index() -> dict[str, tuple[str, dict]]:
    """function name -> (notebook file name, its manifest entry)."""
    return {e["function"]: (nb, e) for nb, spec in load_manifest()["notebooks"].items()
            for e in spec["exercises"]}


def _reference(entry: dict):
    module, name = entry["reference"].rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


class _Loader:
    """One pass of loading: each notebook is read and reconstructed at most once."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.index = exercise_index()
        self.namespaces: dict[str, dict] = {}
        self.verdicts: dict[str, tuple[str, str]] = {}  # function -> (status, why)
        self.missing: list[str] = []  # notebook files not in `folder`

    def function(self, name: str):
        if name not in self.index:
            raise KeyError(f"{name!r} is not an exercise of the course "
                           f"(exercises: {', '.join(sorted(self.index))})")
        notebook, _ = self.index[name]
        return self.notebook(notebook)[name]

    def notebook(self, notebook: str) -> dict:
        """Your exercise functions of one notebook: yours where they pass their checks,
        else the references."""
        if notebook in self.namespaces:
            return self.namespaces[notebook]
        exercises = load_manifest()["notebooks"][notebook]["exercises"]
        path = self.folder / notebook
        cells: list[Cell] = []
        problem = ""
        try:
            cells = read_cells(path.read_bytes())
        except FileNotFoundError:
            problem = f"{notebook} is not in {self.folder}"
            self.missing.append(notebook)
        except Exception as e:  # noqa: BLE001 - any unreadable file: the reference runs
            problem = f"{notebook} could not be read ({type(e).__name__}: {e})"
        found: dict = {}
        self.namespaces[notebook] = found
        namespace: dict = {"__name__": f"yours_{Path(notebook).stem}"}
        loads = [pair for c in cells for pair in loaded_names(c.source)]
        for bound, fn_name in loads:
            namespace[bound] = self.function(fn_name)
        for entry in exercises:
            name = entry["function"]
            fn, status, why = None, "reference", problem
            cell = _cell(cells, entry) if cells else None
            if cell is None and not problem:
                why = f"no cell of {notebook} defines {name}()"
            if cell is not None:
                fn, status, why = _run_cell(cell, entry, namespace)
            if fn is None:
                fn = _reference(entry)
            namespace[name] = fn
            found[name] = fn
            self.verdicts[name] = (status, why)
        return found


def _cell(cells: list[Cell], entry: dict) -> Cell | None:
    fn = entry["function"]
    for c in cells:
        if c.id == entry["cell_id"] and fn in defines(c.source):
            return c
    candidates = [c for c in cells if fn in defines(c.source)]
    return candidates[-1] if candidates else None


def _run_cell(cell: Cell, entry: dict, namespace: dict):
    """(function or None, status, why): the cell run after its imports, then checked."""
    name = entry["function"]
    source = python_source(cell.source)
    scope = dict(namespace)
    try:
        exec(compile(prelude(entry, source, set(), provided=False), f"<{name} imports>", "exec"), scope)
        exec(compile(source, f"<your {name} cell>", "exec"), scope)
    except NotImplementedError:
        return None, "reference", "not implemented yet"
    except Exception as e:  # noqa: BLE001 - your cell raised: the reference runs, and why
        return None, "reference", f"your cell raised {type(e).__name__}: {e}"
    fn = scope.get(name)
    if not callable(fn):
        return None, "reference", f"the cell does not define {name}()"
    namespace.update({k: v for k, v in scope.items() if k not in namespace})
    with contextlib.redirect_stdout(io.StringIO()):
        result = find_checker(entry["checker"])(fn)
    if result.passed:
        return fn, "yours", ""
    if result.status == "not implemented":
        return None, "reference", "not implemented yet"
    return None, "reference", f"your version fails its check ({result.reason[:160]})"


def load_yours(*names: str, folder: str | Path | None = None, quiet: bool = False,
               elsewhere: str = "pass folder='path/to/them'"):
    """Your versions of these exercise functions, from the notebooks that define them
    (in `folder`, default the current directory), each checked again; the reference where
    yours is missing or fails. Prints one line per function, and one more naming the folder
    where a notebook was not found (`elsewhere`: how to point it at another folder). One
    name: the function; several: a tuple in the same order."""
    loader = _Loader(Path(folder) if folder is not None else Path.cwd())
    out = [loader.function(n) for n in names]
    if not quiet:
        width = max(len(n) for n in names)
        for n in names:
            status, why = loader.verdicts[n]
            nb = loader.index[n][0][:2]
            icon = "✅" if status == "yours" else "⏳" if "not implemented" in why else "❌"
            print(f"{icon} {n:<{width}}  (notebook {nb}): "
                  + ("yours" if status == "yours" else f"the reference runs: {why}"))
        if loader.missing:
            where = ("the current folder: where Jupyter runs this notebook" if folder is None
                     else "the folder you passed")
            print(f"load_yours reads your earlier notebooks from {loader.folder.resolve()} "
                  f"({where}); not there: {', '.join(loader.missing)}. Keep your notebooks in "
                  f"one folder with their course names, or {elsewhere}.")
    return out[0] if len(out) == 1 else tuple(out)

