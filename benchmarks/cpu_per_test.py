"""CPU seconds per test and per file, the machine's (`/proc/stat`), so that what a test's
subprocesses, notebook kernels and torchrun ranks spend counts too. Linux only.

Run the suite in one process, so that each figure is one test's alone:

    PYTHONPATH="$PWD/benchmarks" OMP_NUM_THREADS=1 CI=true ./course test -n 0 \
        -p cpu_per_test --cpu-log /tmp/cpu.jsonl

OMP_NUM_THREADS=1 is the thread count a test gets in the parallel run. The path must be
absolute: the notebook kernels start in other folders, where a relative one is another
sys.path, and test_warm_kernels then rightly finds a plain kernel unlike a forked one.

It prints the costliest files and tests at the end and writes one JSON line per test to
--cpu-log. Wall time is about the suite's total CPU (~15-17 min on 2 cores); the sum is what
the parallel run shares out between its workers.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict

from machine_cpu import busy_cpu_seconds

_started: dict[str, tuple[float, float]] = {}
_rows: list[dict] = []


def pytest_addoption(parser):
    parser.addoption("--cpu-log", default=None, help="write one JSON line per test here")
    parser.addoption("--cpu-top", type=int, default=15, help="how many files and tests to print")


def pytest_runtest_logstart(nodeid, location):
    _started[nodeid] = (busy_cpu_seconds(), time.monotonic())


def pytest_runtest_logfinish(nodeid, location):
    if nodeid in _started:
        busy, t0 = _started.pop(nodeid)
        _rows.append({"test": nodeid, "cpu_s": round(busy_cpu_seconds() - busy, 2),
                      "wall_s": round(time.monotonic() - t0, 2)})


def pytest_terminal_summary(terminalreporter, config):
    if not _rows:
        return
    path = config.getoption("--cpu-log")
    if path:
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in _rows)
    top = config.getoption("--cpu-top")
    files: dict[str, float] = defaultdict(float)
    for r in _rows:
        files[r["test"].split("::")[0]] += r["cpu_s"]
    write = terminalreporter.write_line
    write(f"CPU of the machine per file (all {len(_rows)} tests: {sum(files.values()):.0f} s):")
    for name, cpu in sorted(files.items(), key=lambda x: -x[1])[:top]:
        write(f"  {cpu:7.1f} s  {name}")
    write("per test:")
    for r in sorted(_rows, key=lambda r: -r["cpu_s"])[:top]:
        write(f"  {r['cpu_s']:7.1f} s  {r['test']}")
