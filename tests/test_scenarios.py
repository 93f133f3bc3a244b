"""Every scenario reproduces its symptom when broken and shows it gone when fixed."""

import subprocess
import sys

import pytest

from grpo_lab.field.catalog import CATALOG, DEVICE_SCENARIOS
from grpo_lab.field.scenarios import run_scenario
from grpo_lab.tools import memory

EXPECTED_TEXT = {  # the real error text the course promises, where there is one
    "nan-params-sampling-crash": "probability tensor contains either `inf`, `nan` or element < 0",
    "pad-token-vocab-mismatch": "IndexError: index out of range in self",
    "temperature-ignored": "The following generation flags are not valid and may be ignored",
    "amp-skip-no-inf-checks": "No inf checks were recorded for this optimizer",
    "temperature-zero": "probability tensor contains either `inf`, `nan` or element < 0",
    "static-check": "F823",
    "naive-run": "probability tensor contains either `inf`, `nan` or element < 0",
    "no-health-monitoring": "probability tensor contains either `inf`, `nan` or element < 0",
    "log-ratio-overflow": "ratio inf",
    "memory-pressure": "DefaultCPUAllocator: can't allocate memory: you tried to allocate",
    "launch-without-launcher": "1/2 clients joined",
}


@pytest.fixture(scope="module")
def scenario():
    """run_scenario(name, fixed), each pair run once for the module: later tests read the
    broken sides the first tests ran (outcomes are read, never changed)."""
    outcomes = {}

    def run(name, fixed=False):
        if (name, fixed) not in outcomes:
            outcomes[name, fixed] = run_scenario(name, fixed=fixed)
        return outcomes[name, fixed]

    return run


def needs_proc(name: str) -> None:
    """memory-pressure caps one step's memory above what /proc says the process holds:
    Linux only on CPU (tools.memory.capped_step)."""
    if name == "memory-pressure" and not memory._proc_peak_resettable():
        pytest.skip("memory-pressure measures against Linux's /proc (clear_refs, VmHWM), "
                    "which this machine lacks")


@pytest.mark.parametrize("name", list(CATALOG))
def test_broken_side_shows_the_symptom(name, scenario):
    needs_proc(name)
    outcome = scenario(name, fixed=False)
    assert outcome.symptom, outcome.evidence
    if name in EXPECTED_TEXT:
        assert EXPECTED_TEXT[name] in outcome.evidence, outcome.evidence


@pytest.mark.parametrize("name", list(CATALOG))
def test_fixed_side_shows_it_gone(name, scenario):
    needs_proc(name)
    outcome = scenario(name, fixed=True)
    assert not outcome.symptom, outcome.evidence


def test_static_check_names_both_mistakes(scenario):
    evidence = scenario("static-check").evidence
    assert "F821" in evidence and "delta" in evidence
    assert "UnboundLocalError" in evidence and "NameError" in evidence


def test_static_check_without_ruff_says_so_instead_of_clean(monkeypatch, tmp_path):
    # a GPU image without ruff once printed "ruff: clean" for the broken source
    from grpo_lab.field import scenarios

    python_without_ruff = tmp_path / "python"
    python_without_ruff.write_text("#!/bin/sh\necho \"$0: No module named ruff\" >&2\nexit 1\n")
    python_without_ruff.chmod(0o755)
    monkeypatch.setattr(scenarios.sys, "executable", str(python_without_ruff))
    with pytest.raises(RuntimeError, match="needs ruff.*No module named ruff.*pip install ruff"):
        scenarios.static_check(fixed=False)


def test_cli_lists_and_runs_a_scenario():
    run = [sys.executable, "-m", "grpo_lab", "scenario"]
    listed = subprocess.run([*run, "--list"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and all(n in listed.stdout for n in CATALOG)
    broken = subprocess.run([*run, "zero-std-group"], capture_output=True, text=True, timeout=120)
    assert broken.returncode == 0 and "[broken] symptom reproduced" in broken.stdout
    fixed = subprocess.run([*run, "zero-std-group", "--fixed"], capture_output=True, text=True,
                           timeout=120)
    assert fixed.returncode == 0 and "[fixed] symptom gone" in fixed.stdout
    bad = subprocess.run([*run, "nope"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown scenario 'nope'" in bad.stderr


def test_every_listed_scenario_runs_and_listing_needs_no_torch():
    """The catalog (names and texts) and what each scenario runs are kept apart so that the
    listing, an unknown name and a CPU-only scenario's --device answer without torch."""
    from grpo_lab.field.scenarios import RUNS

    assert list(RUNS) == list(CATALOG)
    probe = ("import contextlib, io, sys\n"
             "from grpo_lab.cli import main\n"
             "for argv in (['--list'], ['nope'], ['naive-run', '--device', 'cuda']):\n"
             "    with contextlib.redirect_stdout(io.StringIO()), "
             "contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(SystemExit):\n"
             "        main(['scenario', *argv])\n"
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "[]", (p.stdout, p.stderr)


@pytest.mark.parametrize("name", ["nan-params-sampling-crash", "pad-token-vocab-mismatch"])
def test_device_scenarios_run_in_a_fresh_process(name, scenario):
    """`scenario NAME --device D` runs the scenario in a child process on D (on CUDA the
    broken side is a device-side assert that poisons the process) and reports what the next
    operation on the device did there. On CPU: the same evidence as in this process, and
    the device still works after the exception."""
    from grpo_lab.field.scenarios import run_on_device

    assert name in DEVICE_SCENARIOS
    broken, fixed = run_on_device(name, False, "cpu"), run_on_device(name, True, "cpu")
    assert broken["symptom"] and not fixed["symptom"], (broken, fixed)
    assert broken["evidence"] == scenario(name).evidence
    assert EXPECTED_TEXT[name] in broken["evidence"]
    assert broken["after"] == fixed["after"] == "works"
    assert broken["returncode"] == fixed["returncode"] == 0


@pytest.mark.parametrize("argv, message", [
    (["naive-run", "--device", "cpu"], "runs on CPU only"),
    (["nan-params-sampling-crash", "--device", "tpu"], "--device must be 'cpu', 'cuda'"),
])
def test_device_flag_refuses_what_it_cannot_do(argv, message):
    p = subprocess.run([sys.executable, "-m", "grpo_lab", "scenario", *argv],
                       capture_output=True, text=True, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and message in lines[0], p.stderr
