"""Execute course notebooks and store their outputs: `python -m grpo_lab notebooks`.

Outputs policy: notebooks in solutions/ are committed *with* the outputs of one clean run
(so a reader on the web sees the plots and numbers), refreshed only by this command;
nbval re-executes them in CI without writing back, so test runs never churn the
repository. labs/ notebooks are committed without outputs.
"""

from __future__ import annotations

import time
from pathlib import Path

from .labs import find_root


def execute(path: Path, timeout: int = 300) -> float:
    """Run every cell of `path` in a fresh kernel (cwd: the notebook's folder), save the
    outputs in place with volatile metadata removed; returns the wall time in seconds."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    t0 = time.time()
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    seconds = time.time() - t0
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, path)
    return seconds


def main(paths: list[str]) -> int:
    targets = [Path(p) for p in paths] or sorted((find_root() / "solutions").glob("*.ipynb"))
    total = 0.0
    for path in targets:
        seconds = execute(path)
        total += seconds
        print(f"{path}: {seconds:.0f} s")
    print(f"{len(targets)} notebooks, {total:.0f} s")
    return 0
