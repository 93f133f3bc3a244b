"""Execute notebooks with every cell run, errors included, and keep what they printed.

    python benchmarks/execute_keep_outputs.py solutions/06_*.ipynb ... --out DIR [--workers N]

nbval (the notebooks step of gpu_checks.sh) says which cell failed, with its traceback, but
not what the cells printed, and it stops a notebook's story at its first failure. Setting a
claim's threshold for another profile needs the numbers: here every cell runs (nbclient's
allow_errors), and DIR gets, per notebook, the executed copy (`<edition>-<name>.ipynb`) and
a plain-text digest (`<edition>-<name>.txt`: each code cell's printed text and its error's
last line), readable where Jupyter is not. Nothing in the repository is written.
`ONLY=executed bash benchmarks/gpu_checks.sh` runs it on the GPU machine."""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def digest(nb) -> str:
    """Each code cell's printed text and error, in order: what a reader of the run needs."""
    lines = []
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        lines.append(f"--- code cell {i}")
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                lines.append(out.get("text", "").rstrip("\n"))
            elif out.get("output_type") == "error":
                lines.append(f"!!! {out.get('ename')}: {out.get('evalue', '')}"[:2000])
            elif "text/plain" in out.get("data", {}) and "text/markdown" in out.get("data", {}):
                lines.append(str(out["data"]["text/markdown"]).rstrip("\n"))
    return "\n".join(lines) + "\n"


def run_one(path: Path, out: Path, timeout: int) -> str:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    name = f"{path.parent.name}-{path.stem}"
    t0 = time.time()
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                       resources={"metadata": {"path": str(path.parent)}}).execute()
        ended = "ran"
    except Exception as e:  # a cell over the timeout, or the kernel died: keep what ran
        ended = f"stopped: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    seconds = time.time() - t0
    errors = sum(o.get("output_type") == "error" for c in nb.cells for o in c.get("outputs", []))
    nbformat.write(nb, out / f"{name}.ipynb")
    (out / f"{name}.txt").write_text(digest(nb))
    return f"{path}: {ended} in {seconds:.0f} s, {errors} cell(s) with an error"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="folder for the copies and digests")
    ap.add_argument("--workers", type=int, default=4, help="notebooks at once (default 4)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per cell (default 600)")
    args = ap.parse_args(argv)
    missing = [str(p) for p in args.notebooks if not p.is_file()]
    if missing:
        ap.error(f"no such notebook: {', '.join(missing)}")
    args.out.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=max(1, args.workers)) as pool:
        for line in pool.map(lambda p: run_one(p, args.out, args.timeout), args.notebooks):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
