"""How the suite spreads over workers (the root conftest.py), and that the browser test's
notebooks run once."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def root_conftest():
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_worker_more_than_the_cpus_within_memory_and_the_cap(monkeypatch):
    conf = root_conftest()
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    workers = {}
    for cpus, gib in [(1, 24.0), (2, 24.0), (3, 7.0), (8, 64.0), (2, 1.0), (2, float("inf"))]:
        monkeypatch.setattr(conf, "available_cpus", lambda cpus=cpus: cpus)
        monkeypatch.setattr(conf, "memory_gib", lambda gib=gib: gib)
        workers[cpus, gib] = conf.pytest_xdist_auto_num_workers(None)
    assert workers == {(1, 24.0): 2, (2, 24.0): 3, (3, 7.0): 3, (8, 64.0): conf.MAX_WORKERS,
                       (2, 1.0): 1, (2, float("inf")): 3}
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "5")
    assert conf.pytest_xdist_auto_num_workers(None) == 5


def collected(browser: str) -> list[str]:
    # a plain `-n 0` run: not an xdist worker (whose variables would make the root conftest
    # set torch's threads, importing torch to collect)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    env["GRPO_LAB_BROWSER"] = browser
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0",
         "tests/browser/test_browser.py", "labs/00_setup_and_diagnostics.ipynb",
         "labs/04_the_training_loop.ipynb", "solutions/04_the_training_loop.ipynb",
         "solutions/00_setup_and_diagnostics.ipynb"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_the_browser_tests_notebooks_run_once():
    on, off = collected("1"), collected("0")
    in_browser = [n for n in on if n.startswith("tests/browser/test_browser.py::")]
    assert len(in_browser) == 2, in_browser
    for notebook in ("labs/00_setup_and_diagnostics.ipynb", "labs/04_the_training_loop.ipynb"):
        assert any(notebook in n for n in in_browser)
        assert not [n for n in on if n.startswith(notebook + "::")]  # not again under nbval
        assert [n for n in off if n.startswith(notebook + "::")]  # browser off: nbval runs it
    # a notebook the browser test does not run stays under nbval either way
    for notebook in ("solutions/00_setup_and_diagnostics.ipynb",
                     "solutions/04_the_training_loop.ipynb"):
        under_nbval = [n for n in on if n.startswith(notebook + "::")]
        assert under_nbval and under_nbval == [n for n in off if n.startswith(notebook + "::")]
