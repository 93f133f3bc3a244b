"""Peak memory of one training step, and what batch, G, length, accumulation and
activation checkpointing do to it (the "memory pressure" failure of reports 003/004).

    python -m grpo_lab.tools.memory            # the table (about a minute on 2 CPU cores)
    python -m grpo_lab.tools.memory --quick    # four rows

What is measured: the peak of one full `Trainer.step()` (sample, reference forward,
training forward + backward per micro-batch, optimizer update) above the idle baseline
after the policy, the reference and the optimizer are built; with CUDA graphs off
(`graphs.graphs_off`, whatever GRPO_LAB_CUDA_GRAPHS says), since a graph keeps buffers and
a memory pool of its own across steps. Measured on the CPU, where the same code runs over
static buffers without a graph: with them notebook 11's accumulation for a budget of 72 MiB
peaked at 79 (2026-11-28).

How, per device:

- CUDA: `torch.cuda.reset_peak_memory_stats()`, then `max_memory_allocated()` minus the
  `memory_allocated()` before the step. Exact for tensors; the caching allocator's
  reserve (what nvidia-smi shows) is higher. Run on an H200 (benchmarks/RESULTS.md, "GPU
  checks").
- CPU, Linux: the process's peak RSS. Writing "5" to /proc/self/clear_refs resets the
  high-water mark VmHWM to the current RSS; VmHWM after the step minus VmRSS before it is
  the step's peak. With malloc's defaults that reset is not enough: glibc keeps freed
  memory in the process, so in one process a smaller config measured after a bigger one
  read -0.1 MiB (its memory was already resident), and one config read 402 and 491 MiB
  in two fresh processes. So a measuring process first fixes malloc's mmap threshold at
  64 KiB (`mallopt(M_MMAP_THRESHOLD)`): every tensor of 64 KiB or more gets its own
  mapping and goes back to the kernel when freed, and `malloc_trim(0)` before each reset
  returns the rest. Checked: in one process 1024, 256, 256, 256 (accumulated), 1024,
  256 rows read 672.9, 168.0, 167.9, 45.5, 671.4, 167.9 MiB, and each of the nine
  table rows measured alone in a fresh process read within 2 MiB of the table
  (tests/test_memory.py checks the reset too). The figures are what the step's tensors
  need; a process with default malloc peaks higher (tens of MiB here, and noisily),
  because its RSS also holds freed-but-cached memory.
  The table runs in one fresh subprocess (this process's malloc settings stay as they
  are), with one thread and no tokenizer threads (per-thread arenas and buffers would add
  noise), after one tiny warm-up step, so lazy imports and first-call caches are not
  counted as the step's.
- CPU without /proc (macOS): the peak cannot be reset, so each config runs in its own
  fresh subprocess and reports `getrusage(RUSAGE_SELF).ru_maxrss` after the step minus
  before it (bytes on macOS, KiB on Linux), with no warm-up (it would raise the "before"
  mark). Forced on Linux, this read 13-16 MiB more than the /proc method on every row
  of the table (the one-time costs of a first step); where loading peaks above the idle
  RSS it reads less by that much. macOS malloc differs too: not measured here.

Limits: RSS counts pages touched, so the figures are the tiny model's activations and
its sampling buffers, not a prediction for GPT-2 124M; the ratios carry over better than
the MiB. The memory of a step follows the longest completion sampled (C), not
max_new_tokens: the tiny model usually stops early, so the table prints C.

`capped_step` reproduces the failure itself: one step under an address-space cap
(RLIMIT_AS on CPU, a memory fraction on CUDA) fails with the allocator's real message,
and the same batch with gradient accumulation fits (see the `memory-pressure` scenario).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch

from ..config import PROFILE_MODELS, ConfigError, GRPOConfig, resolve_profile
from ..graphs import graphs_off
from ..memo import once_per_session
from ..models import resolve_device
from ..policy import load_policy
from ..trainer import Trainer
from .parser import Parser, UsageError

MIB = 2**20
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
MMAP_THRESHOLD = 64 * 1024  # allocations this large get their own mapping while measuring
METHODS = ("proc", "rusage", "cuda")
RESULT_TAG = "@@grpo_lab.tools.memory@@ "  # marks the worker's answer among anything else it prints
# the capped step: 128 prompts x G=8 = 1024 rows, in fresh processes (1 thread, the fixed
# mmap threshold). A sweep of budgets: all 1024 rows at once failed with 20 to 160 MiB and
# ran with 180 and 220 MiB; in 8 micro-batches they ran with 40 to 220 MiB and failed with
# 20. 100 MiB leaves 60 MiB below and 80 above (`python -m grpo_lab scenario memory-pressure`)
OOM_BATCH = dict(prompts_per_step=128, group_size=8)
OOM_FIX = dict(grad_accum_steps=8)
OOM_BUDGET_MIB = 100.0


def measuring_config(**overrides) -> GRPOConfig:
    """The tiny model's plain config for one measured step: no eval (eval_every=0 and
    `steps` far beyond the one step taken) and a small held-out set to build."""
    base = dict(profile="cpu", steps=1000, eval_every=0, eval_size=8)
    return GRPOConfig(**{**base, **overrides})


# ---- the process's memory ---------------------------------------------------------------
def _libc():
    """glibc's malloc controls, or None (musl, macOS, Windows)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def _fix_mmap_threshold() -> None:
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def _release_free_memory() -> None:
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def _proc_status_mib(key: str) -> float:
    """A line of /proc/self/status ('VmRSS', 'VmHWM', 'VmSize', ...) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024  # the kernel writes kB
    raise KeyError(key)


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # 5: reset the peak RSS (VmHWM) to the current RSS


def maxrss_mib() -> float:
    """This process's peak resident memory so far, in MiB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / MIB if sys.platform == "darwin" else rss / 1024  # bytes on macOS, KiB here


def _proc_peak_resettable() -> bool:
    return Path("/proc/self/clear_refs").exists() and Path("/proc/self/status").exists()


def default_method(device: str | None, profile: str | None = None) -> str:
    """'cuda' when the run trains on CUDA (its device, else its profile's), 'proc' where
    /proc can reset the peak, else 'rusage'."""
    if resolve_device(device, profile).type == "cuda":
        return "cuda"
    return "proc" if _proc_peak_resettable() else "rusage"


# ---- one measurement, in this process ---------------------------------------------------
def _build_trainer(cfg: GRPOConfig):

    trainer = Trainer(cfg, *load_policy(cfg.profile, cfg.model_path))
    lengths: list[int] = []
    step_fn = trainer.step_fn

    def recording_step(run, problems):  # the step runs as is; we only note C on the way
        metrics = step_fn(run, problems)
        lengths.append(run.last_batch.rollout.completion_length)
        return metrics

    trainer.step_fn = recording_step
    return trainer, lengths


def _measure_here(cfg: GRPOConfig, method: str) -> dict:
    """Peak memory of one `Trainer.step()` above the idle baseline, in this process."""
    trainer, lengths = _build_trainer(cfg)
    if method == "cuda":
        dev = trainer.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        trainer.step()
        torch.cuda.synchronize(dev)
        peak, idle = (torch.cuda.max_memory_allocated(dev) - base) / MIB, base / MIB
    elif method == "proc":
        _release_free_memory()
        _reset_peak_rss()
        idle = _proc_status_mib("VmRSS")
        trainer.step()
        peak = _proc_status_mib("VmHWM") - idle
    elif method == "rusage":
        _release_free_memory()
        idle = maxrss_mib()
        trainer.step()
        peak = maxrss_mib() - idle
    else:
        raise ValueError(f"method must be 'cuda', 'proc' or 'rusage' (got {method!r})")
    del trainer
    _release_free_memory()
    return {"peak_mib": peak, "idle_mib": idle, "completion_length": lengths[0],
            "method": method}


def _warm_up(cfg: GRPOConfig) -> None:
    """One tiny step, so lazy imports and first-call caches are not counted later."""
    trainer, _ = _build_trainer(cfg.replace(prompts_per_step=1, group_size=2,
                                            grad_accum_steps=1))
    trainer.step()
    del trainer
    _release_free_memory()


@graphs_off()  # the step's own tensors, as the course teaches it
def _measure_worker(configs: list[dict], method: str, warm_up: bool) -> list[dict]:
    torch.set_num_threads(1)
    _fix_mmap_threshold()
    cfgs = [GRPOConfig.from_dict(c) for c in configs]
    if warm_up and cfgs:
        _warm_up(cfgs[0])
    return [_measure_here(cfg, method) for cfg in cfgs]


# ---- subprocesses -------------------------------------------------------------------------
@once_per_session
def _run_worker(request: dict, timeout: float = 600) -> dict:
    """Run `request` in a fresh `python -m grpo_lab.tools.memory --worker` and return its answer
    (in a test session, once per request: grpo_lab/memo.py)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)  # works from a source tree too
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env["TOKENIZERS_PARALLELISM"] = "false"  # no tokenizer threads appearing mid-step
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_lab.tools.memory", "--worker"], input=json.dumps(request),
        capture_output=True, text=True, timeout=timeout, env=env,
    )
    answers = [line[len(RESULT_TAG):] for line in proc.stdout.splitlines()
               if line.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not answers:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        raise RuntimeError(f"memory worker failed (exit {proc.returncode}):\n{tail}")
    return json.loads(answers[-1])


def measure_configs(cfgs: list[GRPOConfig], method: str | None = None,
                    isolate: bool = True) -> list[dict]:
    """`peak_step_memory` for several configs. With /proc (and on CUDA) they share one
    fresh process, measured one after another (the reset is exact there); with
    getrusage each config gets its own process."""
    if not cfgs:
        return []
    if method not in (None, *METHODS):
        raise ValueError(f"method must be None (automatic) or one of {', '.join(METHODS)} "
                         f"(got {method!r})")
    method = method or default_method(cfgs[0].device, cfgs[0].profile)
    if not isolate:
        if method == "rusage":
            raise ValueError("getrusage's peak cannot be reset: measure in a fresh process "
                             "(isolate=True)")
        threads = torch.get_num_threads()
        try:
            return _measure_worker([c.to_dict() for c in cfgs], method, warm_up=False)
        finally:
            torch.set_num_threads(threads)
    if method == "rusage":  # ru_maxrss never goes down: one process per measurement
        return [_run_worker({"task": "measure", "configs": [c.to_dict()], "method": method,
                             "warm_up": False})["rows"][0] for c in cfgs]
    return _run_worker({"task": "measure", "configs": [c.to_dict() for c in cfgs],
                        "method": method, "warm_up": True})["rows"]


def peak_step_memory(cfg: GRPOConfig, method: str | None = None, isolate: bool = True) -> dict:
    """Peak memory of one full training step (`Trainer.step()`: sample, reference forward,
    backward over the micro-batches, update) above the idle baseline after model load.

    Returns {'peak_mib': MiB above the baseline, 'idle_mib': the baseline itself (RSS, or
    CUDA memory allocated), 'completion_length': C sampled, 'method': 'proc' | 'rusage' |
    'cuda'}. `isolate` (default) measures in a fresh subprocess. `isolate=False` measures
    here, without the warm-up (a first step's one-time costs count), and leaves this
    process's malloc with the fixed mmap threshold (see the module docstring)."""
    return measure_configs([cfg], method, isolate)[0]


# ---- the table ----------------------------------------------------------------------------
def table_configs(
    quick: bool = False, base: GRPOConfig | None = None
) -> list[tuple[str, GRPOConfig]]:
    """(name, config): a baseline and one factor at a time, then a big batch with and
    without the two memory fixes together."""
    base = base or measuring_config(prompts_per_step=32, group_size=8)
    p = base.prompts_per_step
    rows = [
        ("baseline", base),
        ("prompts x2", base.replace(prompts_per_step=2 * p)),
        ("G x2", base.replace(group_size=2 * base.group_size)),
        ("max_new_tokens 26", base.replace(max_new_tokens=26)),
        ("accum 2", base.replace(grad_accum_steps=2)),
        ("accum 4", base.replace(grad_accum_steps=4)),
        ("checkpointing", base.replace(gradient_checkpointing=True)),
        ("prompts x4", base.replace(prompts_per_step=4 * p)),
        ("prompts x4 + accum 8 + ckpt", base.replace(prompts_per_step=4 * p, grad_accum_steps=8,
                                                      gradient_checkpointing=True)),
    ]
    if quick:
        keep = ("baseline", "prompts x2", "accum 4", "checkpointing")
        rows = [r for r in rows if r[0] in keep]
    return rows


COLUMNS = ("row", "prompts", "G", "rows", "max_new", "C", "accum", "ckpt", "peak MiB",
           "x baseline")


def format_table(rows: list[dict]) -> str:
    widths = (27, 7, 3, 5, 7, 3, 5, 4, 9, 10)
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                       enumerate(zip(COLUMNS, widths, strict=True)))]
    for r in rows:
        cells = (r["row"], r["prompts_per_step"], r["group_size"], r["rows"],
                 r["max_new_tokens"], r["completion_length"], r["grad_accum_steps"],
                 "on" if r["gradient_checkpointing"] else "off", f"{r['peak_mib']:.1f}",
                 f"{r['ratio']:.2f}")
        lines.append("  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in
                               enumerate(zip(cells, widths, strict=True))))
    return "\n".join(lines)


def memory_table(quick: bool = False, device: str | None = None,
                 base: GRPOConfig | None = None, method: str | None = None,
                 show: bool = True, profile: str | None = None) -> list[dict]:
    """Measure every row of `table_configs` and (with `show`) print the table.

    Each row: the name, the factors (prompts_per_step, group_size, rows = prompts x G,
    max_new_tokens, completion_length C as sampled, grad_accum_steps,
    gradient_checkpointing), 'peak_mib' above the idle baseline, 'ratio' to the
    baseline row's peak, 'idle_mib' and 'method'. `profile` 'gpu' measures GPT-2 124M
    instead of the tiny model."""
    named = table_configs(quick, base)
    if device is not None:
        named = [(n, c.replace(device=device)) for n, c in named]
    if profile is not None:
        named = [(n, c.replace(profile=profile)) for n, c in named]
    measured = measure_configs([c for _, c in named], method)
    rows = []
    for (name, cfg), m in zip(named, measured, strict=True):
        rows.append({"row": name, "prompts_per_step": cfg.prompts_per_step,
                     "group_size": cfg.group_size,
                     "rows": cfg.prompts_per_step * cfg.group_size,
                     "max_new_tokens": cfg.max_new_tokens,
                     "grad_accum_steps": cfg.grad_accum_steps,
                     "gradient_checkpointing": cfg.gradient_checkpointing,
                     "profile": cfg.profile, **m})
    for r in rows:
        r["ratio"] = r["peak_mib"] / rows[0]["peak_mib"]
    if show:
        m = rows[0]
        where = {"proc": "peak RSS (VmHWM)", "rusage": "peak RSS (ru_maxrss)",
                 "cuda": "torch.cuda.max_memory_allocated, CUDA graphs off"}[m["method"]]
        model = PROFILE_MODELS.get(m["profile"], m["profile"])
        print(f"peak memory of one Trainer.step() of {model} above the idle baseline ({where}; "
              f"idle {m['idle_mib']:.0f} MiB after loading the policy, reference and "
              f"optimizer)")
        print(format_table(rows))
    return rows


# ---- the failure: one step under a memory cap ---------------------------------------------
@graphs_off()
def _capped_step_worker(cfg: GRPOConfig, budget_mib: float, check_gradient: bool) -> dict:
    """One `Trainer.step()` with only `budget_mib` MiB of memory above what is in use now.

    CPU: RLIMIT_AS (the address space) set here, after torch and the model are loaded, at
    the current VmSize + budget, so the allocator itself fails. RLIMIT_AS counts address
    space, not pages in use, and every extra thread reserves some (a stack, a malloc arena
    of up to 64 MiB): one thread and the fixed mmap threshold (freed tensors leave the
    address space at once) make the limit track the tensors; the budget was chosen with
    large margins from measured peaks (see OOM_BUDGET_MIB). Only the soft limit is set,
    so it can be lifted again for the gradient check.
    CUDA: `torch.cuda.set_per_process_memory_fraction` at what is reserved now + budget."""
    torch.set_num_threads(1)
    _fix_mmap_threshold()
    trainer, _ = _build_trainer(cfg)
    start = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    cuda = trainer.device.type == "cuda"
    _release_free_memory()
    if cuda:
        total = torch.cuda.get_device_properties(trainer.device).total_memory
        used = torch.cuda.memory_reserved(trainer.device)
        torch.cuda.set_per_process_memory_fraction((used + budget_mib * MIB) / total,
                                                   trainer.device)
        torch.cuda.reset_peak_memory_stats(trainer.device)
        base = torch.cuda.memory_allocated(trainer.device)
    else:
        base = _proc_status_mib("VmSize")
        _reset_peak_rss()
        rss0 = _proc_status_mib("VmRSS")
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (int((base + budget_mib) * MIB), hard))
    error = None
    try:
        trainer.step()
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
    if cuda:
        peak = (torch.cuda.max_memory_allocated(trainer.device) - base) / MIB
        torch.cuda.set_per_process_memory_fraction(1.0, trainer.device)
    else:
        peak = _proc_status_mib("VmHWM") - rss0
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    answer = {"error": error, "peak_mib": peak, "budget_mib": budget_mib,
              "rows": cfg.prompts_per_step * cfg.group_size,
              "grad_accum_steps": cfg.grad_accum_steps, "relative_grad_error": None}
    if error is None and check_gradient:
        # the update did not touch .grad (no clipping in this config): it holds the
        # accumulated gradient at the starting weights; redo it as one batch, uncapped
        accumulated = [p.grad.clone() for p in trainer.policy.parameters()]
        trainer.policy.load_state_dict(start)
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.backward(trainer.run.last_batch, grad_accum_steps=1)  # the step's batch
        full = [p.grad for p in trainer.policy.parameters()]
        diff = sum(((a - f) ** 2).sum() for a, f in zip(accumulated, full, strict=True))
        answer["relative_grad_error"] = float(diff**0.5 / sum((f**2).sum() for f in full)**0.5)
    return answer


def capped_step(cfg: GRPOConfig, budget_mib: float = OOM_BUDGET_MIB,
                check_gradient: bool = True) -> dict:
    """Run one training step of `cfg` in a fresh process allowed `budget_mib` MiB above
    its footprint after loading. Returns {'error': the allocator's message or None,
    'peak_mib', 'budget_mib', 'rows', 'grad_accum_steps', 'relative_grad_error': the
    step's gradient against the same batch as one micro-batch (None unless it ran and
    `check_gradient`)}. Needs /proc on CPU (Linux)."""
    if cfg.max_grad_norm is not None:
        raise ValueError("capped_step compares raw gradients: use max_grad_norm=None")
    if default_method(cfg.device, cfg.profile) == "rusage":
        raise RuntimeError("capped_step needs Linux's /proc on CPU (or a CUDA device)")
    return _run_worker({"task": "capped", "config": cfg.to_dict(), "budget_mib": budget_mib,
                        "check_gradient": check_gradient})


def oom_configs(device: str | None = None) -> tuple[GRPOConfig, GRPOConfig]:
    """(broken, fixed): one step of 1024 rows at once, and the same batch in 8 micro-batches."""
    broken = measuring_config(device=device, **OOM_BATCH)
    return broken, broken.replace(**OOM_FIX)


# ---- command line -------------------------------------------------------------------------
def _worker_main() -> int:
    request = json.loads(sys.stdin.read())
    if request["task"] == "measure":
        answer = {"rows": _measure_worker(request["configs"], request["method"],
                                          request["warm_up"])}
    else:
        answer = _capped_step_worker(GRPOConfig.from_dict(request["config"]),
                                     request["budget_mib"], request["check_gradient"])
    print(RESULT_TAG + json.dumps(answer), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:

    parser = Parser(
        prog="python -m grpo_lab memory",
        description="peak memory of one GRPO step: batch, G, max_new_tokens, gradient "
                    "accumulation, activation checkpointing",
    )
    parser.add_argument("--quick", action="store_true", help="four rows instead of nine")
    parser.add_argument("--device", default=None, help="'cpu', 'cuda', 'cuda:1'; default: "
                        "the profile's (cpu: the CPU, gpu: CUDA)")
    parser.add_argument("--profile", default=None, help="'cpu' (the tiny GPT-2) or 'gpu' "
                        "(GPT-2 124M); default: gpu with a CUDA --device, else "
                        "$GRPO_LAB_PROFILE, else cpu")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the rows here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    try:
        args = parser.parse_args(argv)
        if args.worker:
            return _worker_main()
        if args.profile:
            profile = args.profile
        elif args.device:
            profile = "gpu" if args.device.startswith("cuda") else "cpu"
        else:
            profile = resolve_profile()
        if profile not in PROFILE_MODELS:
            raise UsageError(f"--profile must be 'cpu' or 'gpu' (got {profile!r})")
        device = args.device or str(resolve_device(None, profile))
        if profile == "gpu" and not device.startswith("cuda"):
            raise UsageError("--profile gpu (GPT-2 124M) needs a CUDA device (--device cuda)")
        rows = memory_table(quick=args.quick, device=device, profile=profile)
    except (UsageError, ConfigError) as e:
        print(f"grpo_lab memory: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
