"""The bench's step on a GPU, timed per phase with the device caught up at each phase's ends,
under CUDA graphs on and off and under each scaled-dot-product-attention backend:

    python benchmarks/phase_times.py [SECONDS]      # on a CUDA machine; stops starting
                                                    # variants after SECONDS (default 150)

benchmarks/step_profile.py counts what each phase launches, under the profiler, whose own
overhead lands on the host (171 against 101 ms a step on the H200) and so inflates exactly
the host-bound parts; this takes plain wall times instead, one variant per fresh Trainer (so
each captures its own graphs), with step_profile's phases (wrap_phases). Each line: the
median and the fastest of 20 steps after 6 warm-up steps; with phases, each phase's median
('loss and backward' holds the training forward)."""

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from contextlib import nullcontext

import step_profile  # benchmarks/step_profile.py, beside this script
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from grpo_lab import step as step_module
from grpo_lab.tools.bench import bench_config
from grpo_lab.trainer import Trainer

# the step's functions as they are, put back before each variant (wrap_phases replaces them)
ORIGINAL = {name: getattr(step_module, name)
            for name in (*step_profile.PHASES, *step_profile.FORWARDS)}


def variant(name, graphs_on, backends, phases=False, steps=20, warmup=6):
    os.environ["GRPO_LAB_CUDA_GRAPHS"] = "1" if graphs_on else "0"
    for fn_name, fn in ORIGINAL.items():
        setattr(step_module, fn_name, fn)
    cfg = bench_config(argparse.Namespace(seed=0, steps=warmup + steps + 5, profile="gpu",
                                          device="cuda", amp="bf16"))
    trainer = Trainer(cfg)
    phase_ms: dict[str, list[float]] = defaultdict(list)
    if phases:
        step_profile.wrap_phases(trainer, phase_ms, sync=torch.cuda.synchronize)
    times = []
    with sdpa_kernel(backends) if backends else nullcontext():  # None: torch's own choice
        for i in range(warmup + steps):
            if i == warmup:
                phase_ms.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            trainer.step()
            torch.cuda.synchronize()
            if i >= warmup:
                times.append(1e3 * (time.perf_counter() - t0))
    detail = "  ".join(f"{k} {statistics.median(v):.1f}" for k, v in phase_ms.items())
    print(f"{name:<28} step {statistics.median(times):6.1f} ms  (min {min(times):.1f})  {detail}",
          flush=True)


def main() -> int:
    budget = float(sys.argv[1]) if len(sys.argv) > 1 else 150.0
    if not torch.cuda.is_available():
        print("phase_times.py needs a CUDA device")
        return 2
    torch.set_num_threads(1)  # the bench's
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    deadline = time.time() + budget
    B = SDPBackend
    plan = [("graphs on, default", True, None),
            ("graphs on, efficient", True, [B.EFFICIENT_ATTENTION]),
            ("graphs on, math", True, [B.MATH]),
            ("graphs off, default", False, None),
            ("graphs off, efficient", False, [B.EFFICIENT_ATTENTION]),
            ("graphs on, efficient, phases", True, [B.EFFICIENT_ATTENTION], True),
            ("graphs on, default, phases", True, None, True),
            ("graphs on, flash+eff+math", True, [B.FLASH_ATTENTION, B.EFFICIENT_ATTENTION,
                                                 B.MATH])]
    for args in plan:
        if time.time() > deadline:
            print("out of time before:", args[0])
            break
        variant(*args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
