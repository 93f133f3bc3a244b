"""Where does GRPO on GPT-2 124M (the gpu profile) improve? Data for calibrating the profile.

Under GRPO_LAB_PROFILE=gpu notebook 04's stable run lost reward (0.048 -> 0.011 over 150 steps
on an H200, benchmarks/RESULTS.md "GPU checks"). This script warm-starts the 124M
architecture offline (`policy.offline_gpt2_124m`, as the profile does without a hub) to
each target greedy accuracy, then runs notebook 04's stable run (150 steps, eval every 25 on
128 problems) at each learning rate: the mean reward of its first and last ten steps, the
share of groups with no reward variance, the greedy accuracies, the KL. One JSON line per
run. (Pretrained `gpt2`, which the profile loads where the hub is reachable, is not measured.)

    python benchmarks/gpu_calibration.py --targets 0.4 0.7 --lrs 1e-4 3e-5 1e-5
    python benchmarks/gpu_calibration.py --smoke      # the tiny model on CPU, 3 steps: the code runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from grpo_lab.config import preset
from grpo_lab.models import TINY_MODEL_DIR, load_local
from grpo_lab.policy import GPU_WARM_START_LR, offline_gpt2_124m, warm_start
from grpo_lab.trainer import Trainer


def warm_model(target: float, folder: Path, smoke: bool, max_steps: int) -> dict:
    """A warm-started model saved in `folder`; its warm-start summary."""
    if smoke:
        model, tokenizer = load_local(TINY_MODEL_DIR)
        summary = {"steps": 0, "dev_accuracy": None, "seconds": 0.0}
    else:
        model, tokenizer = offline_gpt2_124m()
        model.cuda()
        summary = warm_start(model, tokenizer, target_accuracy=target, lr=GPU_WARM_START_LR,
                             max_steps=max_steps, log=lambda *_: None)
    model.cpu().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return summary


def mean(values) -> float:
    return statistics.mean(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", type=float, nargs="+", default=[0.4, 0.7])
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-4, 3e-5, 1e-5])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--max-warm-steps", type=int, default=2000,
                        help="the warm start stops here if the target is not reached")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    steps, device = (3, "cpu") if args.smoke else (args.steps, "cuda")
    with tempfile.TemporaryDirectory() as tmp:
        for target in args.targets:
            folder = Path(tmp) / f"warm-{target}"
            t0 = time.perf_counter()
            warm = warm_model(target, folder, args.smoke, args.max_warm_steps)
            print(json.dumps({"target": target, "warm_start": warm,
                              "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
            for lr in args.lrs:
                cfg = preset("stable", steps=steps, eval_every=25, eval_size=128,
                             learning_rate=lr, model_path=str(folder), device=device)
                t0 = time.perf_counter()
                history = Trainer(cfg).train(progress=False)
                rows = [m for m in history if "reward" in m]
                evals = [m["eval/accuracy"] for m in history if "eval/accuracy" in m]
                print(json.dumps({
                    "target": target, "learning_rate": lr, "steps": len(rows),
                    "reward_first10": round(mean([m["reward"] for m in rows[:10]]), 4),
                    "reward_last10": round(mean([m["reward"] for m in rows[-10:]]), 4),
                    "zero_std_groups": round(mean([m.get("frac_reward_zero_std", float("nan"))
                                                   for m in rows]), 3),
                    "eval_accuracy": [round(a, 4) for a in evals],
                    "kl_last10": round(mean([m["kl"] for m in rows[-10:]]), 4),
                    "seconds": round(time.perf_counter() - t0, 1),
                }), flush=True)


if __name__ == "__main__":
    main()
