"""benchmarks/step_profile.py finds every phase of the engine's step by name: a renamed step
function would leave its phase empty, and the GPU run's profile would say nothing."""

import importlib.util
import json
from pathlib import Path

import pytest

from grpo_lab import step as step_module

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "step_profile.py"


@pytest.fixture
def step_profile(monkeypatch):
    spec = importlib.util.spec_from_file_location("step_profile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in (*module.PHASES, *module.FORWARDS):  # main() wraps them: undone after
        monkeypatch.setattr(step_module, name, getattr(step_module, name))
    return module


def test_every_phase_of_a_step_is_found_once(step_profile, tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert step_profile.main(["--steps", "1", "--warmup", "0", "--json", str(out)]) == 0
    phases = json.loads(out.read_text())["phases"]
    for phase in ("sample", "rewards", "reference forward", "loss and backward",
                  "training forward", "update", "health check", "metrics"):
        assert phases[phase]["calls"] == 1, (phase, phases[phase])
        assert phases[phase]["host_ms"] > 0, phase
    for phase in ("sample", "reference forward", "training forward"):  # each runs the model
        assert phases[phase]["operators"] > 50, (phase, phases[phase])
    assert "phase" in capsys.readouterr().out
