"""What a sandboxed worker's start costs the grader: grade the same submissions with the
workers forked from the zygote (the default where the machine gives it namespaces) and
exec'd as fresh `python -I` processes, and print wall time and CPU time (the whole
machine's, from /proc/stat: run it on an otherwise idle machine) for each.

    python benchmarks/grading.py                  # the 13 labs: stubs, so mostly start-up
    python benchmarks/grading.py solutions/0[0-3]*.ipynb --repeat 2

Linux only.
"""

from __future__ import annotations

import argparse
import glob
import sys
import tempfile
import time
from pathlib import Path

from machine_cpu import busy_cpu_seconds  # the workers are killed, not reaped: no rusage

from grpo_lab.course import grade, sandbox

ROOT = Path(__file__).resolve().parents[1]


def stop_zygote() -> None:
    if sandbox._ZYGOTE is not None:
        sandbox._ZYGOTE.close()
        sandbox._ZYGOTE = None


def grade_once(paths: list[Path], fork: bool) -> tuple[float, float, int]:
    """(wall s, CPU s, points) of grading `paths` once, as `python -m grpo_lab grade` does."""
    no_zygote = sandbox._NO_ZYGOTE
    sandbox._NO_ZYGOTE = no_zygote or not fork  # exec'd: as on a machine without the zygote
    try:
        manifest = grade.load_manifest()
        t0, c0 = time.perf_counter(), busy_cpu_seconds()
        points = 0
        with tempfile.TemporaryDirectory() as pkg:
            pkg_root = sandbox.package_copy(Path(pkg))
            for path in paths:
                records = grade.grade_submission(path, path.stem, manifest, pkg_root,
                                                 sandbox.Limits())
                points += sum(r.points for r in records)
        stop_zygote()  # reaped, so that its workers' CPU is counted
        return time.perf_counter() - t0, busy_cpu_seconds() - c0, points
    finally:
        sandbox._NO_ZYGOTE = no_zygote


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", help="submissions (default: labs/*.ipynb)")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    paths = [Path(p) for p in (args.paths or sorted(glob.glob(str(ROOT / "labs/*.ipynb"))))]
    layers = sandbox.describe()
    stop_zygote()  # each forked run below starts its own, and pays for it
    print(f"sandbox: {layers}")
    print(f"{len(paths)} submissions, {args.repeat} time(s) each way")
    for _ in range(args.repeat):
        for fork in (True, False):
            wall, cpu, points = grade_once(paths, fork)
            print(f"  {'forked from the zygote' if fork else 'exec per worker':<24} "
                  f"wall {wall:6.1f} s   CPU {cpu:6.1f} s   ({cpu / len(paths):.2f} s per "
                  f"submission; {points} points)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
