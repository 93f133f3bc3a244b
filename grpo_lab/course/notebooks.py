"""Execute course notebooks and store their outputs: `python -m grpo_lab notebooks`; and
`run_command`, how a notebook runs a course command in a process of its own, and
`train_command`, the training runs notebook 11 shows.

Outputs policy: notebooks in solutions/ are committed *with* the outputs of one clean run
(so a reader on the web sees the plots and numbers), refreshed only by this command;
nbval re-executes them in CI without writing back, so test runs never churn the
repository. labs/ notebooks are committed without outputs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..memo import once_per_session
from .labs import find_root

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def final_progress_text(output: dict, state: dict) -> None:
    """A tqdm bar is a widget; its stored text/plain is the text at creation ("0%| | 0/150"),
    which is what a reader sees where widgets do not render (a code host, the website).
    Replace it with the bar's final text, rebuilt from the widget's final state."""
    view = output.get("data", {}).get(WIDGET_VIEW)
    box = state.get(view["model_id"], {}).get("state", {}) if view else {}
    children = [state.get(c.removeprefix("IPY_MODEL_"), {}).get("state", {})
                for c in box.get("children", [])]
    if len(children) != 3 or "max" not in children[1]:  # not a tqdm bar: HTML, progress, HTML
        return
    left, bar, right = children
    done = bar.get("value", 0) / bar["max"] if bar["max"] else 1.0
    filled = round(10 * min(max(done, 0.0), 1.0))
    output["data"]["text/plain"] = (
        f"{_text(left.get('value', ''))}|{'█' * filled}{' ' * (10 - filled)}|"
        f" {_text(right.get('value', '')).strip()}"
    )


def _text(html: str) -> str:
    return html.replace("&nbsp;", " ").replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


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
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        for output in cell.get("outputs", []):
            final_progress_text(output, state)
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


OUT = "{out}"  # the command's output folder, in run_command's argv and in what it returns


@dataclass
class CommandRun:
    """What a command did: its exit code, what it printed, how long it ran."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float


def train_command(preset: str, steps: int, *extra: str) -> list[str]:
    """Notebook 11's `python -m grpo_lab train` run of `preset` for `steps` steps: seed 0,
    greedy eval every 20 steps on 128 problems, no progress bar, into OUT; `extra`: more
    options. tests/test_cli.py checks the CLI on these same runs, so through `run_command` a
    test session runs each once."""
    return [sys.executable, "-m", "grpo_lab", "train", "--preset", preset, "--steps",
            str(steps), "--seed", "0", "--eval-every", "20", "--eval-size", "128", "--out", OUT,
            "--no-progress", *extra]


def run_command(argv: list[str], out: Path, env: dict[str, str] | None = None,
                timeout: int = 600) -> CommandRun:
    """Run a course command (`python -m grpo_lab train ...`, torchrun) in a process of its own,
    writing into the folder `out`, which `argv` names as "{out}"; `env`: variables to set
    on top of this process's. Returns its exit code and output, with `out` where it printed
    the folder.

    Only for a command whose result depends on its arguments and the package alone, not on
    files it reads (a learner's notebooks): under a test run a lab and its solution (and, for
    notebook 11's `train_command` runs, tests/test_cli.py) run the same command, so the first
    runs it and the others get its exit code, its output, the seconds it ran and a copy of
    its files (grpo_lab/memo.py)."""
    files, run = _run_in_fresh_folder(list(argv), dict(env or {}), timeout)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    return CommandRun(run.returncode, run.stdout.replace(OUT, str(out)),
                      run.stderr.replace(OUT, str(out)), run.seconds)


@once_per_session
def _run_in_fresh_folder(argv: list[str], env: dict[str, str], timeout: int
                         ) -> tuple[dict[str, bytes], CommandRun]:
    """({file name under the output folder: its bytes}, the run, "{out}" for the folder)."""
    with tempfile.TemporaryDirectory(prefix="grpo_lab_command_") as tmp:
        folder = Path(tmp) / "out"
        t0 = time.perf_counter()
        p = subprocess.run([a.replace(OUT, str(folder)) for a in argv], capture_output=True,
                           text=True, timeout=timeout, env={**os.environ, **env})
        seconds = time.perf_counter() - t0
        files = {str(f.relative_to(folder)): f.read_bytes()
                 for f in sorted(folder.rglob("*")) if f.is_file()}
    return files, CommandRun(p.returncode, p.stdout.replace(str(folder), OUT),
                             p.stderr.replace(str(folder), OUT), seconds)
