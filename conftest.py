"""How the test run is spread over processes (pytest-xdist); loaded for every path pytest
collects: tests/ and the notebooks in solutions/ and labs/.

pyproject.toml runs the suite on `-n auto` workers with `--dist loadfile`: each test file
and each notebook runs whole on one worker (a notebook's cells share one kernel, in order).

- Workers: `-n auto` is the number of CPUs this process may use, at most MAX_WORKERS
  (each worker holds torch, TRL and a notebook kernel). PYTEST_XDIST_AUTO_NUM_WORKERS
  overrides it; `-n 0` runs everything in this one process.
- Threads: a worker gets its share of the CPUs as its torch intra-op thread count
  (OMP_NUM_THREADS, MKL_NUM_THREADS; on 2 cores with 2 workers: 1), set here before torch is
  imported, so the notebook kernels and the subprocesses the tests start (CLI runs,
  torchrun) inherit it. The tiny model's forwards are ~100x slower when two spinning
  OpenMP threads share a core with another busy process (see tests/test_trl_parity.py).
  A thread count already in the environment is kept.
- Order: the files run longest first (FILE_SECONDS), so the workers finish together.
"""

from __future__ import annotations

import os

MAX_WORKERS = 4

# Seconds each file kept one worker busy: per-file sums from benchmarks/suite_times.py of a
# `./course test` run with 2 workers, one torch thread each, on a 2-core machine that other
# jobs were loading (so the figures are inflated; only their order is used: longest first).
# A file not listed counts as DEFAULT_SECONDS. Refresh when a file's time moves a lot:
#   ./course test --junitxml=/tmp/run.xml && .venv/bin/python benchmarks/suite_times.py /tmp/run.xml
FILE_SECONDS: dict[str, float] = {
    "tests/test_scenarios.py": 334,
    "tests/test_faults.py": 283,
    "tests/test_distributed.py": 216,
    "tests/test_cli.py": 188,
    "solutions/12_scale_out_and_trl.ipynb": 184,
    "tests/test_warmstart.py": 177,
    "labs/12_scale_out_and_trl.ipynb": 152,
    "solutions/05_break_it.ipynb": 107,
    "solutions/11_capstone.ipynb": 102,
    "solutions/06_fix_clamping_and_clipping.ipynb": 94,
    "labs/06_fix_clamping_and_clipping.ipynb": 89,
    "tests/test_grade.py": 81,
    "labs/11_capstone.ipynb": 80,
    "solutions/04_the_training_loop.ipynb": 78,
    "tests/test_trainer.py": 72,
    "labs/08_fix_gradient_accumulation.ipynb": 71,
    "solutions/08_fix_gradient_accumulation.ipynb": 65,
    "solutions/07_fix_health_checks_and_recovery.ipynb": 63,
    "labs/07_fix_health_checks_and_recovery.ipynb": 61,
    "tests/test_wheel.py": 59,
    "tests/test_memory.py": 58,
    "labs/05_break_it.ipynb": 57,
    "tests/test_bench.py": 51,
    "tests/test_course_setup.py": 49,
    "solutions/09_fix_the_kl_formula.ipynb": 43,
    "labs/09_fix_the_kl_formula.ipynb": 39,
    "tests/test_layers.py": 31,
    "solutions/10_fix_safe_sampling.ipynb": 29,
    "labs/10_fix_safe_sampling.ipynb": 29,
    "labs/04_the_training_loop.ipynb": 27,
    "labs/01_gpt2_and_sampling.ipynb": 26,
    "tests/test_first_pass.py": 25,
    "labs/02_rewards_and_advantages.ipynb": 23,
    "solutions/01_gpt2_and_sampling.ipynb": 23,
    "tests/test_links.py": 22,
    "solutions/02_rewards_and_advantages.ipynb": 21,
    "labs/03_the_grpo_objective.ipynb": 20,
    "tests/test_labs.py": 20,
    "tests/test_course_lab.py": 19,
    "labs/00_setup_and_diagnostics.ipynb": 19,
    "solutions/03_the_grpo_objective.ipynb": 16,
    "solutions/00_setup_and_diagnostics.ipynb": 14,
}
DEFAULT_SECONDS = 5.0


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def _worker_threads() -> int | None:
    """This xdist worker's share of the CPUs, or None outside a worker."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return None
    return max(1, available_cpus() // max(1, int(workers)))


_THREADS = _worker_threads()
if _THREADS is not None:
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_name, str(_THREADS))


def pytest_configure(config):
    if _THREADS is not None:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_xdist_auto_num_workers(config):
    wanted = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if wanted:
        return int(wanted)
    return max(1, min(MAX_WORKERS, available_cpus()))


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(session, config, items):
    """Under xdist, longest files first (each file's items stay together, in order).

    Every worker sorts its collection the same way, and `--no-loadscope-reorder` makes the
    scheduler hand the files out in this order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        first.setdefault(file_of(item.nodeid), index)
    items.sort(key=lambda item: (-FILE_SECONDS.get(file_of(item.nodeid), DEFAULT_SECONDS),
                                 first[file_of(item.nodeid)]))
