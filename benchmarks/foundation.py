"""The foundation's figures: does `stable` learn, how fast is a step, how does `naive` break.

    python benchmarks/foundation.py [--steps 200] [--seed 0]

Runs the stable preset (8 prompts x G=8 per step) and the naive preset twice through the
same CLI a learner uses, then prints the figures. A script that prints, not a timed test.
"""

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def train(preset: str, steps: int, seed: int, out: Path, *extra: str) -> tuple[int, str, float]:
    t0 = time.time()
    p = subprocess.run(
        [sys.executable, "-m", "grpo_lab", "train", "--preset", preset, "--steps", str(steps),
         "--seed", str(seed), "--out", str(out), "--no-progress", *extra],
        capture_output=True, text=True, env={**os.environ, "GRPO_LAB_PROFILE": "cpu"},
    )
    return p.returncode, p.stderr, time.time() - t0


def metrics(out: Path) -> list[dict]:
    from grpo_lab.trainer import read_metrics

    return read_metrics(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "stable"
        rc, err, wall = train("stable", args.steps, args.seed, out, "--eval-every", "25")
        assert rc == 0, err
        ms = metrics(out)
        evals = [(m["step"], m["eval/accuracy"]) for m in ms if "eval/accuracy" in m]
        steps = [m for m in ms if "step_time" in m]
        stable_median_gn = statistics.median(m["grad_norm"] for m in steps)
        print(f"\nstable, seed {args.seed}, {args.steps} steps, 8 prompts x G=8 "
              f"(wall {wall:.0f} s)")
        print("  eval/accuracy by step: " + ", ".join(f"{s}: {a:.3f}" for s, a in evals))
        print(f"  eval/accuracy gain: {100 * (evals[-1][1] - evals[0][1]):+.1f} points "
              f"(best {100 * (max(a for _, a in evals) - evals[0][1]):+.1f})")
        print(f"  median step time: {statistics.median(m['step_time'] for m in steps):.3f} s")
        print(f"  median grad_norm: {stable_median_gn:.3g}, max "
              f"{max(m['grad_norm'] for m in steps):.3g}")
        print(f"  non-finite parameters at any step: "
              f"{max(m['nonfinite_params'] for m in steps)}")

        crash_steps = []
        for run in (1, 2):
            out = Path(tmp) / f"naive{run}"
            rc, err, wall = train("naive", args.steps, args.seed, out)
            ms = metrics(out)
            norms = [m["grad_norm"] for m in ms if "grad_norm" in m]
            finite = [g for g in norms if math.isfinite(g)]
            first_bad = next((m["step"] for m in ms if m.get("nonfinite_params", 0) > 0), None)
            error = next((line for line in err.splitlines() if line.startswith("error at")), "")
            crash_steps.append(error)
            print(f"\nnaive run {run}, seed {args.seed} (exit code {rc}, wall {wall:.0f} s)")
            print(f"  max finite grad_norm: {max(finite):.3g} = "
                  f"{max(finite) / stable_median_gn:.0f}x the stable median")
            print(f"  first step with non-finite parameters: {first_bad} "
                  f"({max(m.get('nonfinite_params', 0) for m in ms)} of them)")
            print(f"  {error}")
        print(f"\nnaive crash identical across runs: {crash_steps[0] == crash_steps[1]}")


if __name__ == "__main__":
    main()
