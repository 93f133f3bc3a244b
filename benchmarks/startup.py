"""CPU seconds a fresh process spends before and while it trains, with the heavy imports
under `grpo_lab.startup.gc_paused` (as the package imports them) and without (the same
code with `gc_paused` replaced by a context that does nothing): the figures behind
grpo_lab/startup.py.

    python benchmarks/startup.py [--repeat 5]

Each case runs `--repeat` times in a fresh process; the median of the child's user + system
CPU seconds is printed, with the collector's own time (gc.callbacks) in that process.
Figures are printed, not asserted. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

# runs in the child: optionally neutralise gc_paused, time the collector, run the case
PRELUDE = """
import contextlib, gc, json, sys, time
if sys.argv[1] == "without":
    import grpo_lab.startup
    grpo_lab.startup.gc_paused = contextlib.nullcontext
spent = [0.0, 0]
def timer(phase, info, t=[0.0]):
    if phase == "start":
        t[0] = time.perf_counter()
    else:
        spent[0] += time.perf_counter() - t[0]
        spent[1] += 1
gc.callbacks.append(timer)
"""
REPORT = "\nprint('STARTUP ' + json.dumps({'gc_seconds': spent[0], 'collections': spent[1]}))\n"

CASES = {
    "import the trainer (torch, transformers' GPT-2)": "import grpo_lab.trainer",
    "import the learner's trainer (course.steps)": "import grpo_lab.course.steps",
    "CLI: train --preset stable --steps 3": (
        "from grpo_lab.cli import main\n"
        "main(['train', '--preset', 'stable', '--steps', '3', '--eval-every', '0',\n"
        "      '--out', sys.argv[2], '--no-progress'])"
    ),
}


def run_once(code: str, mode: str) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory() as tmp:
        p = subprocess.run([sys.executable, "-c", PRELUDE + code + REPORT, mode,
                            os.path.join(tmp, "run")], capture_output=True, text=True,
                           env={**os.environ, "GRPO_LAB_PROFILE": "cpu"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise SystemExit(f"the case failed:\n{p.stderr[-2000:]}")
    line = next(x for x in p.stdout.splitlines() if x.startswith("STARTUP "))
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"cpu": cpu, **json.loads(line.removeprefix("STARTUP "))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"{'case':<50} {'gc_paused':>9} {'CPU s':>6} {'GC s':>5} {'collections':>11}")
    for name, code in CASES.items():
        for mode in ("without", "with"):
            runs = [run_once(code, mode) for _ in range(args.repeat)]
            print(f"{name:<50} {mode:>9} {statistics.median(r['cpu'] for r in runs):>6.2f} "
                  f"{statistics.median(r['gc_seconds'] for r in runs):>5.2f} "
                  f"{statistics.median(r['collections'] for r in runs):>11.0f}", flush=True)


if __name__ == "__main__":
    main()
