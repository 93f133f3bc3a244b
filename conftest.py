"""How the test run is spread over processes (pytest-xdist); loaded for every path pytest
collects: tests/ and the notebooks in solutions/ and labs/.

pyproject.toml runs the suite on `-n auto` workers with `--dist loadfile`: each test file
and each notebook runs whole on one worker (a notebook's cells share one kernel, in order).

- Workers: `-n auto` is one more than the number of CPUs this process may use, at most
  MAX_WORKERS (each worker holds torch, TRL and a notebook kernel). The extra worker fills
  the time the others spend waiting (the fault runner's hang limit, a rendezvous timing
  out, Chromium settling a page). On 2 cores it gains most with the browser tests on; with 3
  workers vmstat showed the CPUs 0% idle from the end of collection to the last files
  (benchmarks/RESULTS.md, "Suite time").
  Also at most one worker per WORKER_MEMORY_GIB of memory (a 7 GB macOS runner gets 3).
  PYTEST_XDIST_AUTO_NUM_WORKERS overrides it; `-n 0` runs everything in this one process.
- Threads: a worker gets its share of the CPUs as its torch intra-op thread count
  (OMP_NUM_THREADS, MKL_NUM_THREADS; at least 1; on 2 cores with 3 workers: 1), set here
  before torch is imported, so the notebook kernels and the subprocesses the tests start (CLI runs,
  torchrun) inherit it. The tiny model's forwards are ~100x slower when two spinning
  OpenMP threads share a core with another busy process (see tests/test_trl_parity.py).
  A thread count already in the environment is kept.
- Order: the files run longest first (FILE_SECONDS), so the workers finish together.
- Each deterministic computation once: the run gets a private folder in
  GRPO_LAB_SESSION_CACHE (grpo_lab/memo.py), inherited by the workers, their notebook
  kernels and the processes they start. A lab and its solution run the same field scenarios,
  fault runs, variant runs, memory measurements and course commands (notebooks 11 and 12,
  `course.notebooks.run_command`) on the same seeds wherever the learner's code is not
  involved, and the tests of those functions run them too; the first caller computes, the
  others read its result. The folder is removed when the run ends.
- Kernels forked warm: a worker's first notebook starts tests/warm_kernels.py's server,
  which imports torch, transformers, matplotlib and grpo_lab once; every notebook kernel of
  that worker is then forked from it instead of importing them again (about 3.5 s of CPU
  each). WARM_KERNELS=0 turns it off (every kernel a fresh `ipykernel_launcher`).
- Commands forked warm: likewise each process that runs tests starts tests/warm_cli.py's
  server, which imports torch and transformers once, and puts tests/warm_cli_hook/ on
  PYTHONPATH: a `python -m grpo_lab train|yours|scenario` started from there (by a test, a
  notebook, torchrun) is forked from the server where its environment allows, instead of
  importing them again. WARM_CLI=0 turns it off.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

MAX_WORKERS = 4
# a worker's budget: itself (0.35 GB peak RSS with torch, transformers and TRL imported) and
# what it starts (a notebook kernel or a CLI run: 0.4 GB for a short Trainer run; torchrun: two)
WORKER_MEMORY_GIB = 2.0

# Seconds each file kept one worker busy: per-file sums from benchmarks/suite_times.py of
# a clean-clone `.ci/run` (2026-11-28, d1c1f8c) with 3 workers, one torch thread each, on an
# idle 2-core machine (inflated by the workers sharing 2 cores; only their order is used: longest
# first). The two browser files: from a `./course test --browser` run. A file not listed
# counts as DEFAULT_SECONDS. Refresh when a file's time moves a lot:
#   ./course test --junitxml=/tmp/run.xml && .venv/bin/python benchmarks/suite_times.py /tmp/run.xml
# With the session cache, a file's figure includes what it computed for the files that read
# it later (grpo_lab/memo.py); whichever comes first computes, so the order only balances
# the workers.
FILE_SECONDS: dict[str, float] = {
    "solutions/06_fix_clamping_and_clipping.ipynb": 112,
    "tests/test_scenarios.py": 85,
    "tests/test_distributed.py": 83,
    "tests/browser/test_browser.py": 72,
    "tests/test_exercises.py": 61,
    "tests/browser/test_site.py": 50,  # one tab for the whole site: 37 CPU-s alone (was 85)
    "tests/test_faults.py": 49,
    "tests/test_grade.py": 47,
    "solutions/11_capstone.ipynb": 44,
    "labs/04_the_training_loop.ipynb": 42,  # when the browser test is off (it runs it then)
    "tests/test_nbgrader.py": 39,
    "solutions/09_fix_the_kl_formula.ipynb": 35,
    "labs/12_scale_out_and_trl.ipynb": 34,
    "tests/test_sandbox.py": 32,
    "solutions/04_the_training_loop.ipynb": 32,
    "tests/test_trainer.py": 32,
    "solutions/08_fix_gradient_accumulation.ipynb": 32,
    "labs/09_fix_the_kl_formula.ipynb": 31,
    "tests/test_steps.py": 31,
    "tests/test_wheel.py": 30,
    "labs/08_fix_gradient_accumulation.ipynb": 30,
    "tests/test_cli.py": 30,
    "solutions/07_fix_health_checks_and_recovery.ipynb": 29,
    "tests/test_hardening.py": 26,
    "labs/11_capstone.ipynb": 26,
    "labs/06_fix_clamping_and_clipping.ipynb": 24,
    "labs/07_fix_health_checks_and_recovery.ipynb": 23,
    "tests/test_warm_kernels.py": 22,
    "solutions/05_break_it.ipynb": 20,
    "tests/test_memory.py": 17,
    "tests/test_warm_cli.py": 16,
    "labs/05_break_it.ipynb": 15,
    "tests/test_hostile_submissions.py": 15,
    "tests/test_bench.py": 13,
    "tests/test_course_setup.py": 13,
    "tests/test_layers.py": 11,
    "tests/test_labs.py": 9,
    "tests/test_suite_setup.py": 8,
    "tests/test_diagnose.py": 8,
    "tests/test_course_lab.py": 8,
    "tests/test_memo.py": 8,
    "solutions/10_fix_safe_sampling.ipynb": 6,
    "solutions/13_diagnose_the_run.ipynb": 6,
    "tests/test_first_pass.py": 6,
    "tests/test_warmstart.py": 6,  # without the rebuild (marker `rebuild`): 107 with it
    "labs/00_setup_and_diagnostics.ipynb": 6,
}
DEFAULT_SECONDS = 5.0
_WARM = pytest.StashKey[dict]()  # this process's warm-kernel server: its client argv


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (AttributeError, ValueError, OSError):
        return float("inf")


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
    from grpo_lab.memo import SESSION_CACHE

    if not os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get(SESSION_CACHE):
        folder = tempfile.mkdtemp(prefix="grpo_lab_session_")  # private: mode 0700
        os.environ[SESSION_CACHE] = folder
        config.add_cleanup(lambda: (os.environ.pop(SESSION_CACHE, None),
                                    shutil.rmtree(folder, ignore_errors=True)))
    if _THREADS is not None:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if config.pluginmanager.hasplugin("nbval"):
        _use_warm_kernels(config)
    _start_warm_cli(config)


def _tests_module(name: str):
    """tests/NAME.py, loaded by path (tests/ is not a package)."""
    import importlib.util

    path = Path(__file__).parent / "tests" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _warm_kernels():
    return _tests_module("warm_kernels")


def _start_warm_cli(config) -> None:
    """This process's server for `python -m grpo_lab train|yours|scenario` commands
    (tests/warm_cli.py), where it runs tests: an xdist worker, or the one process of `-n 0`.
    Its hook reaches every process started from here through PYTHONPATH."""
    runs_tests = os.environ.get("PYTEST_XDIST_WORKER") or not getattr(
        config.option, "numprocesses", None)
    if not runs_tests or os.environ.get("WARM_CLI") == "0" or \
            not sys.platform.startswith("linux") or not os.environ.get("GRPO_LAB_SESSION_CACHE"):
        return
    warm = _tests_module("warm_cli")
    path = os.path.join(os.environ["GRPO_LAB_SESSION_CACHE"],
                        f"cli-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.sock")
    os.environ[warm.SOCKET_ENV] = path
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(warm.HOOK), os.environ.get("PYTHONPATH")) if p)
    server = warm.start_server(path)
    config.add_cleanup(lambda: (server.kill(), server.wait()))


def _warm_kernel_argv(config) -> list[str] | None:
    """The client's argv for nbval's kernel, starting this process's server the first time;
    None where there is none (off, not Linux, or the server did not come up)."""
    state = config.stash.setdefault(_WARM, {})
    if "argv" in state:
        return state["argv"]
    state["argv"] = None
    # Linux only: on macOS a process that forks without exec can crash in system frameworks
    # a library has initialised (why multiprocessing spawns there)
    if os.environ.get("WARM_KERNELS") == "0" or not sys.platform.startswith("linux") or \
            not os.environ.get("GRPO_LAB_SESSION_CACHE"):
        return None
    warm = _warm_kernels()
    path = os.path.join(os.environ["GRPO_LAB_SESSION_CACHE"],
                        f"kernels-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.sock")
    server, ready = warm.start_server(path)
    config.add_cleanup(lambda: (server.kill(), server.wait()))
    if not ready:
        sys.stderr.write(f"[conftest] the warm kernel server did not start (exit code "
                         f"{server.poll()}): notebooks run in plain kernels\n")
        return None
    # the clients read the socket from the kernels' environment (not a GRPO_LAB_* variable:
    # those are the package's switches, part of every memo key, and the path differs
    # between workers)
    os.environ[warm.SOCKET_ENV] = path
    state["argv"] = list(warm.CLIENT_ARGV)
    return state["argv"]


def _use_warm_kernels(config) -> None:
    """nbval's --nbval-current-env kernel, started through the warm server."""
    from nbval import kernel

    plain = kernel.NbvalKernelspecManager.get_kernel_spec

    def get_kernel_spec(self, kernel_name):
        spec = plain(self, kernel_name)
        if kernel_name == kernel.CURRENT_ENV_KERNEL_NAME:
            argv = _warm_kernel_argv(config)
            if argv is not None:
                spec.argv = list(argv)
        return spec

    kernel.NbvalKernelspecManager.get_kernel_spec = get_kernel_spec


@pytest.fixture
def warm_jupyter_path(request, tmp_path) -> str | None:
    """A JUPYTER_PATH folder whose `python3` kernelspec starts this worker's warm kernels,
    for a test whose notebooks run through another tool (nbgrader's autograde); None where
    there are none (see _warm_kernel_argv)."""
    argv = _warm_kernel_argv(request.config)
    if argv is None:
        return None
    folder = tmp_path / "warm-jupyter"
    _warm_kernels().write_kernelspec(folder, "python3", argv)
    return str(folder)


def pytest_xdist_auto_num_workers(config):
    wanted = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if wanted:
        return int(wanted)
    by_memory = int(min(MAX_WORKERS, memory_gib() / WORKER_MEMORY_GIB))
    return max(1, min(MAX_WORKERS, available_cpus() + 1, by_memory))


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


REBUILD_NOTE = ("the full rebuild of the shipped model (marker `rebuild`, a minute of CPU) is "
                "left out of this run: .ci/run runs it in a stage of its own; here: "
                "./course test -m rebuild")


def pytest_collection_modifyitems(session, config, items):
    """The rebuild tests only where `-m` names them; then, under xdist, longest files first
    (each file's items stay together, in order).

    Every worker sorts its collection the same way, and `--no-loadscope-reorder` makes the
    scheduler hand the files out in this order."""
    if "rebuild" not in (config.option.markexpr or ""):
        rebuild = [item for item in items if item.get_closest_marker("rebuild")]
        if rebuild:
            items[:] = [item for item in items if item not in rebuild]
            config.hook.pytest_deselected(items=rebuild)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        first.setdefault(file_of(item.nodeid), index)
    items.sort(key=lambda item: (-FILE_SECONDS.get(file_of(item.nodeid), DEFAULT_SECONDS),
                                 first[file_of(item.nodeid)]))


def pytest_report_header(config):
    if "rebuild" not in (config.option.markexpr or ""):
        return f"[conftest] {REBUILD_NOTE}"
    return None
