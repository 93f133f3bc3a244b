"""Where one engine step's time goes, phase by phase: host time, device time, operators,
kernel launches and the synchronisations that make the host wait for the device.

    python benchmarks/step_profile.py                                   # tiny GPT-2, CPU
    python benchmarks/step_profile.py --device cuda --profile gpu --amp bf16 --json F

The bench (`python -m grpo_lab bench`) says how long a step takes against TRL's; this says
where it goes, on the bench's work (its config: the stable preset, eval off). On a GPU a step
of GPT-2 124M at the bench's size waits on the host (H200, 2026-11-28: MFU 0.46% of the bf16
peak, CPU time = wall time), so what decides its speed there is each phase's host time, the
kernels it launches and each synchronisation (`.item()`, `.tolist()`, a copy to the CPU),
which stalls the host until the device catches up. The phases are the step's functions in
grpo_lab/step.py, each wrapped in a `torch.profiler.record_function` of its name; the
training and reference forwards are told apart by whether autograd is on. `benchmarks/
gpu_checks.sh` runs it on the GPU machine after the bench."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from functools import wraps

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from grpo_lab import step as step_module
from grpo_lab.tools.bench import bench_config
from grpo_lab.trainer import Trainer

# the step's functions, by the phase each one is: looked up in grpo_lab.step at call time
PHASES = {"sample_group": "sample", "checked_rewards": "rewards",
          "accumulate": "loss and backward", "_training_logits": "training forward",
          "check_health": "health check", "step_metrics": "metrics"}
FORWARDS = ("shared_prompt_logits", "completion_logits")  # the reference's, outside autograd
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
            "cudaGraphLaunch")  # a CUDA graph's replay: one launch for all its kernels
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
COPIES = ("cudaMemcpy", "cudaMemcpyAsync")


def wrap_phases(trainer: Trainer, host_ms: dict, sync=None) -> None:
    """Label each phase for the profiler and time it on the host (perf_counter). With
    `sync` (torch.cuda.synchronize: benchmarks/phase_times.py), the device is caught up at
    each phase's ends, so that each time is the phase's own wall time."""
    def labelled(fn, label):
        @wraps(fn)
        def run(*args, **kwargs):
            if label == "reference forward" and torch.is_grad_enabled():
                return fn(*args, **kwargs)  # a training forward: _training_logits has it
            with record_function(f"phase: {label}"):
                if sync:
                    sync()
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    if sync:
                        sync()
                    host_ms[label].append(1e3 * (time.perf_counter() - t0))
        return run

    for fn_name, label in PHASES.items():
        setattr(step_module, fn_name, labelled(getattr(step_module, fn_name), label))
    for fn_name in FORWARDS:
        setattr(step_module, fn_name, labelled(getattr(step_module, fn_name), "reference forward"))
    trainer.use(update_fn=labelled(trainer.update_fn, "update"))  # bound into the step


def phase_of(event) -> str:
    """The innermost phase an event ran under ('other' outside every phase)."""
    node = event
    while node is not None:
        if node.name.startswith("phase: "):
            return node.name[len("phase: "):]
        node = node.cpu_parent
    return "other"


def counts_by_phase(prof) -> dict:
    """Per phase: aten operators, kernel launches, synchronisations, memcpy calls, and the
    device time of the kernels launched there (microseconds)."""
    out = defaultdict(lambda: defaultdict(float))
    for ev in prof.events():
        phase = phase_of(ev)
        if ev.name.startswith("aten::") and (ev.cpu_parent is None
                                             or not ev.cpu_parent.name.startswith("aten::")):
            out[phase]["operators"] += 1  # top-level operators only: what Python dispatched
        if ev.name in LAUNCHES:
            out[phase]["launches"] += 1
        if ev.name in SYNCS:
            out[phase]["syncs"] += 1
        if ev.name in COPIES:
            out[phase]["copies"] += 1
        if ev.name == "aten::_local_scalar_dense":  # .item(), float(tensor), .tolist()
            out[phase]["item calls"] += 1
        out[phase]["device us"] += sum(k.duration for k in ev.kernels) if ev.kernels else 0
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--profile", default="cpu", choices=("cpu", "gpu"))
    ap.add_argument("--amp", default="none", choices=("none", "bf16"))
    ap.add_argument("--steps", type=int, default=10, help="profiled steps, after --warmup")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the bench's 1)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    torch.set_num_threads(args.threads)
    cfg = bench_config(argparse.Namespace(seed=0, steps=args.warmup + 2 * args.steps,
                                          profile=args.profile, device=args.device, amp=args.amp))
    trainer = Trainer(cfg)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(args.warmup):
        trainer.step()
    host_ms: dict[str, list[float]] = defaultdict(list)
    wrap_phases(trainer, host_ms)
    def step_times() -> list[float]:  # ms per step, the device caught up at both ends
        times = []
        for _ in range(args.steps):
            sync()
            t0 = time.perf_counter()
            trainer.step()
            sync()
            times.append(1e3 * (time.perf_counter() - t0))
        return times

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        walls = step_times()
    host_ms = {phase: list(times) for phase, times in host_ms.items()}  # the profiled steps'
    # the same steps again without the profiler: its own overhead is in the table's host times
    plain = step_times()

    n = args.steps
    counts = counts_by_phase(prof)
    order = ["sample", "rewards", "reference forward", "loss and backward", "training forward",
             "update", "health check", "metrics", "other"]
    rows = {}
    for phase in order:
        c = counts.get(phase, {})
        rows[phase] = {"calls": len(host_ms.get(phase, [])) / n,
                       "host_ms": sum(host_ms.get(phase, [])) / n,
                       "device_ms": c.get("device us", 0.0) / 1e3 / n,
                       **{k: c.get(k, 0.0) / n for k in ("operators", "launches", "syncs",
                                                         "copies", "item calls")}}
    print(f"one engine step, {cfg.prompts_per_step} prompts x G={cfg.group_size}, max "
          f"{cfg.max_new_tokens} new tokens, profile {args.profile}, {args.device}, amp "
          f"{args.amp}, {torch.get_num_threads()} thread(s), torch {torch.__version__}"
          + (f", {torch.cuda.get_device_name()}" if cuda else ""))
    print(f"step wall time, median of {n}: {statistics.median(walls):.2f} ms under the profiler, "
          f"{statistics.median(plain):.2f} ms without it")
    print("per step; host ms is inclusive ('loss and backward' holds the training forward), "
          "the counts go to the innermost phase; 'other': the rest of the step")
    head = (f"{'phase':<20} {'calls':>5} {'host ms':>8} {'device ms':>9} {'operators':>9} "
            f"{'launches':>8} {'syncs':>6} {'memcpy':>6} {'.item()':>7}")
    print(head)
    for phase, r in rows.items():
        print(f"{phase:<20} {r['calls']:>5.1f} {r['host_ms']:>8.2f} {r['device_ms']:>9.2f} "
              f"{r['operators']:>9.0f} {r['launches']:>8.0f} {r['syncs']:>6.1f} "
              f"{r['copies']:>6.1f} {r['item calls']:>7.1f}")
    top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    print("\nthe 12 operators with the most host time of their own, per step")
    for e in top:
        print(f"  {e.key:<44} {e.count / n:>7.1f} calls {e.self_cpu_time_total / 1e3 / n:>8.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "profile": args.profile, "amp": args.amp,
                       "steps": n, "wall_ms_profiled": statistics.median(walls),
                       "wall_ms": statistics.median(plain),
                       "phases": rows,
                       "top_host_ops": [{"op": e.key, "calls": e.count / n,
                                         "self_host_ms": e.self_cpu_time_total / 1e3 / n}
                                        for e in top]}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
