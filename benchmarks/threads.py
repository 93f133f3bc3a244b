"""Step time of the stable preset on the CPU profile against torch's thread count, with
the machine idle and with one core held by a busy process: the figures behind the CPU
thread policy (grpo_lab.models.apply_thread_policy).

    python benchmarks/threads.py [--steps 30] [--threads 1 2]

Each configuration runs in a fresh process (GRPO_LAB_THREADS sets its thread count) and
reports the median, 10th and 90th percentile of `step_time` after 3 warm-up steps.
Figures are printed, not asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = """
import json, sys
from grpo_lab.config import preset
from grpo_lab.trainer import Trainer
import torch
t = Trainer(preset("stable", eval_every=0, eval_size=1, seed=0))
times = [t.step()["step_time"] for _ in range(int(sys.argv[1]) + 3)][3:]
print(json.dumps({"threads": torch.get_num_threads(), "times": times}))
"""


def run(threads: int, steps: int, busy: bool) -> dict:
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        env = {**os.environ, "GRPO_LAB_THREADS": str(threads), "GRPO_LAB_PROFILE": "cpu"}
        out = subprocess.run([sys.executable, "-c", WORKER, str(steps)], env=env, check=True,
                             capture_output=True, text=True).stdout
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    print(f"{os.cpu_count()} cores; {args.steps} steps per row, stable preset, cpu profile")
    print(f"{'threads':>7}  {'machine':<14}  {'median s':>8}  {'p10':>6}  {'p90':>6}")
    for busy in (False, True):
        for threads in args.threads:
            times = sorted(run(threads, args.steps, busy)["times"])
            q = statistics.quantiles(times, n=10)
            print(f"{threads:>7}  {'one core busy' if busy else 'idle':<14}  "
                  f"{statistics.median(times):8.3f}  {q[0]:6.3f}  {q[-1]:6.3f}", flush=True)


if __name__ == "__main__":
    main()
