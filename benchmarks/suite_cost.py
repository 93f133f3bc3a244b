"""The suite's cost in calibration units: the machine's busy CPU during a command, divided
by the seconds of benchmarks/calibration.py run just before it on the same machine. A unit
is machine-independent enough to compare runs across hours and machines of one kind (the
calibration moves with the machine's speed; the suite's busy CPU moves with it).

    .venv/bin/python benchmarks/suite_cost.py [-- COMMAND ...]   # default: CI=true ./course test

Prints the calibration, the command's wall time, busy and idle CPU, the result line pytest
printed, and busy CPU / calibration. Linux only (/proc/stat).

The calibration runs before the command and again after it, and the cost is taken against
their mean: a shared host can change speed within a run (it read 11.55 s, then 17.15 s an
hour later, on 2026-11-26), and a run whose two calibrations differ by more than 10% is
flagged, since its units are not comparable with another run's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_cpu import busy_cpu_seconds  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def idle_cpu_seconds() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:6]]
    return (fields[3] + fields[4]) / os.sysconf("SC_CLK_TCK")


def calibration_seconds() -> float:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "calibration.py")],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return float(out.split()[-3])


if __name__ == "__main__":
    args = sys.argv[1:]
    command = args[args.index("--") + 1:] if "--" in args else ["./course", "test"]
    calibration = calibration_seconds()
    print(f"calibration: {calibration:.2f} s", flush=True)
    busy0, idle0, t0 = busy_cpu_seconds(), idle_cpu_seconds(), time.time()
    run = subprocess.run(command, cwd=ROOT, env={**os.environ, "CI": "true"},
                         capture_output=True, text=True)
    wall = time.time() - t0
    busy, idle = busy_cpu_seconds() - busy0, idle_cpu_seconds() - idle0
    result = [line for line in run.stdout.splitlines() if " in " in line and (
        "passed" in line or "failed" in line)]
    tail = "\n".join(run.stdout.splitlines()[-40:])
    print(tail if run.returncode else (result[-1] if result else "(no pytest summary)"))
    after = calibration_seconds()
    mean = (calibration + after) / 2
    print(f"calibration after: {after:.2f} s")
    print(f"exit {run.returncode}; wall {wall:.1f} s; busy CPU {busy:.0f} s; idle {idle:.0f} s; "
          f"cost {busy / mean:.1f} calibration units (against the mean calibration, {mean:.2f} s)")
    if abs(after - calibration) > 0.1 * min(after, calibration):
        print("the machine changed speed during the run (the calibrations differ by more "
              "than 10%): these units are not comparable with another run's")
