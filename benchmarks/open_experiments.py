"""The instructor's reference measurements for the three open experiments
(docs/open-experiments-reference.md): what one careful answer finds on the CPU profile.

    .venv/bin/python benchmarks/open_experiments.py [build|break|fix ...]

Prints one line per setting: final held-out accuracy per seed (eval on 64 problems), the step
a run crashed at, if any, and the mean. 1.5 to 3 minutes per experiment on the 2-core
machine of docs/open-experiments-reference.md (2 threads).
"""

from __future__ import annotations

import statistics
import sys
import time

from grpo_lab.config import preset
from grpo_lab.trainer import Trainer

SEEDS, STEPS, EVAL = (0, 1, 2), 100, dict(eval_every=100, eval_size=64)


def one(name: str, preset_name: str, overrides: dict) -> None:
    t0, accs, crashes, first = time.time(), [], [], []
    for seed in SEEDS:
        trainer = Trainer(preset(preset_name, seed=seed, steps=STEPS, **EVAL, **overrides))
        try:
            trainer.train(progress=False)
            evals = [m["eval/accuracy"] for m in trainer.history if "eval/accuracy" in m]
            first.append(evals[0])
            accs.append(evals[-1])
        except Exception as e:  # noqa: BLE001 - a crashed run is a result here
            crashes.append(f"seed {seed}: {type(e).__name__} at step {len(trainer.history)}")
    mean = f"{statistics.mean(accs):.3f}" if accs else "-"
    print(f"{name:<34} start {first[0] if first else float('nan'):.3f}  final "
          f"{' '.join(f'{a:.3f}' for a in accs) or '-':<20} mean {mean:<6} "
          f"crashed: {'; '.join(crashes) or 'none'}  ({time.time() - t0:.0f} s)", flush=True)


EXPERIMENTS = {  # part: {setting: (preset, its overrides)}
    # build (notebook 04): the same 64 completions per step, split into groups of G
    "build": {f"G = {g}, {64 // g} prompts": ("stable", dict(group_size=g,
                                                              prompts_per_step=64 // g))
              for g in (2, 4, 8, 16)},
    # break (notebook 05): one change at a time to the naive preset, 100 steps
    "break": {name: ("naive", o) for name, o in {
        "naive": {},
        "ratio against pi_old": dict(ratio_against="old"),
        "per-token ratio": dict(ratio_level="token"),
        "clipped-ratio term": dict(clip_term="clipped_ratio"),
        "log-ratio clamp 10": dict(log_ratio_clamp=10.0),
        "grad clip 0.3": dict(max_grad_norm=0.3),
        "learning rate 1e-4": dict(learning_rate=1e-4),
    }.items()},
    # fix (notebook 11): the stable preset (the hardened trainer) at larger learning rates
    "fix": {f"stable, lr {lr:g}": ("stable", dict(learning_rate=lr))
            for lr in (1e-4, 3e-4, 1e-3, 3e-3)},
}

if __name__ == "__main__":
    for part in sys.argv[1:] or list(EXPERIMENTS):
        print(f"== {part}: {STEPS} steps, seeds {SEEDS}, eval on 64 held-out problems")
        for name, (preset_name, overrides) in EXPERIMENTS[part].items():
            one(name, preset_name, overrides)
