"""Can notebook 13's mystery runs be told apart? Train each hidden failure on several seeds
and diagnose every run with the fixed rules of tests/mystery_rules.py (against the shipped
baseline); print each miss and the count.

    .venv/bin/python benchmarks/mystery_rules.py [--seeds 200 201 ...] [--out DIR]

About 7 s a run on 2 CPU cores (60 steps of the tiny GPT-2).
"""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from mystery_rules import rule_diagnosis  # noqa: E402

from grpo_lab.course import diagnose as d  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[200, 201, 202])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="mystery-rules-"))
    baseline = d.load_runs()[d.BASELINE]
    right, total = 0, 0
    for seed in args.seeds:
        for cause in d.CAUSES:
            folder = d.make_run(cause, seed, out / str(seed) / cause)
            got = rule_diagnosis(d.load_runs(folder.parent)[cause], baseline)
            right, total = right + (got == cause), total + 1
            print(f"seed {seed} {cause:20s} -> {got}{'' if got == cause else '   MISS'}",
                  flush=True)
    print(f"{right} of {total} runs diagnosed right by the rules (runs in {out})")


if __name__ == "__main__":
    main()
