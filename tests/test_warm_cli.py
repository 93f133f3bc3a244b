"""tests/warm_cli.py: a `python -m grpo_lab ...` command forked from the worker's warm server
exits, prints and dies as the same command started fresh; one whose environment the server's
imports could tell apart starts fresh. Linux only, as the server."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.environ.get("WARM_CLI") == "0"
    or not os.environ.get("WARM_CLI_SOCKET"),
    reason="the warm command server runs on Linux, under ./course test, unless WARM_CLI=0")

# A forked command's client only imports the standard library and waits; a fresh one
# imports torch and transformers first: >= 1 s of CPU on any machine this runs on
# (3.3 s on the 2-core CI machine), against ~0.05 s
FORKED_CPU_S = 0.5


def server_ready(timeout: float = 120) -> None:
    """The worker's server listens once its imports are done (started with the worker)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.environ["WARM_CLI_SOCKET"]):
        assert time.monotonic() < deadline, "the warm command server did not come up"
        time.sleep(0.2)


def command(*args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """Run `python -m grpo_lab ARGS`: its result and the CPU seconds its process used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-m", "grpo_lab", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return done, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


@pytest.mark.parametrize("args", [
    ("train", "--preset", "stable", "--learning-rate", "-1"),  # refused: exit 2, one line
    ("scenario", "nope"),
])
def test_a_refused_command_exits_and_prints_as_a_fresh_one(args):
    server_ready()
    forked, _ = command(*args)
    fresh, _ = command(*args, env={"WARM_CLI": "0"})
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        fresh.returncode, fresh.stdout, fresh.stderr)
    assert forked.returncode == 2 and forked.stderr.count("\n") == 1, forked.stderr


def one_step(out, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float, list]:
    done, cpu = command("train", "--preset", "stable", "--steps", "1", "--eval-every", "0",
                        "--eval-size", "8", "--no-progress", "--out", str(out), env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [{k: v for k, v in json.loads(line).items() if k != "step_time"}
            for line in (out / "metrics.jsonl").read_text().splitlines()]
    return done, cpu, rows


def test_a_forked_run_trains_as_a_fresh_one_without_importing_torch_again(tmp_path):
    server_ready()
    forked, forked_cpu, forked_rows = one_step(tmp_path / "forked")
    fresh, fresh_cpu, fresh_rows = one_step(tmp_path / "fresh", env={"WARM_CLI": "0"})
    assert forked_rows == fresh_rows
    assert forked.stdout.replace(str(tmp_path / "forked"), str(tmp_path / "fresh")) == fresh.stdout
    assert forked_cpu < FORKED_CPU_S <= fresh_cpu, (forked_cpu, fresh_cpu)


def test_a_forked_run_trains_in_its_own_environment_and_dies_of_the_signal_it_is_sent(tmp_path):
    server_ready()
    # GRPO_LAB_* is read by grpo_lab, which the command imports itself: a bad value is refused
    bad, cpu = command("train", "--preset", "stable", "--steps", "1", "--out", str(tmp_path / "a"),
                       env={"GRPO_LAB_PROFILE": "nope"})
    assert cpu < FORKED_CPU_S and bad.returncode != 0 and "GRPO_LAB_PROFILE" in bad.stderr, \
        bad.stderr[-2000:]
    run = subprocess.Popen([sys.executable, "-m", "grpo_lab", "train", "--preset", "stable",
                            "--steps", "1000", "--eval-every", "0", "--out", str(tmp_path / "b")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "b" / "metrics.jsonl").exists():  # it trains
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.1)
    run.send_signal(signal.SIGTERM)
    run.communicate(timeout=60)
    assert run.returncode == -signal.SIGTERM
    time.sleep(0.5)  # the forked process died with it: the metrics stop growing
    size = (tmp_path / "b" / "metrics.jsonl").stat().st_size
    time.sleep(1.0)
    assert (tmp_path / "b" / "metrics.jsonl").stat().st_size == size


def test_an_environment_the_imports_would_see_starts_fresh(tmp_path):
    server_ready()
    # huggingface_hub reads HF_HOME when transformers imports it: the server's copy cannot
    # stand for a command that sets another
    _, cpu, _ = one_step(tmp_path / "out", env={"HF_HOME": str(tmp_path / "hf")})
    assert cpu >= FORKED_CPU_S, cpu
