"""Fault injection and the rest of the reliability matrix."""

import json
import subprocess
import sys

import pytest

from grpo_lab.field import reliability
from grpo_lab.field.faults import FAULTS, empty_micro_batch_fault, run_fault


@pytest.fixture(scope="module")
def fault_run():
    """run_fault(name, preset), each pair run once for the module: the recovery test reads
    the same stable runs as the survival tests (results are read, never changed)."""
    runs = {}

    def run(name, preset):
        if (name, preset) not in runs:
            runs[name, preset] = run_fault(name, preset)
        return runs[name, preset]

    return run


@pytest.mark.parametrize("name", list(FAULTS))
def test_stable_survives_and_naive_fails(name, fault_run):
    stable = fault_run(name, "stable")
    assert stable.survived, stable.summary()
    assert not stable.checkpoint_nonfinite
    naive = fault_run(name, "naive")
    assert not naive.survived, naive.summary()


def test_naive_without_a_fault_runs_clean_for_as_long():
    """Control: the naive failures above come from the faults, not from naive's own drift."""
    from grpo_lab.config import preset
    from grpo_lab.field.faults import STEPS
    from grpo_lab.trainer import Trainer

    trainer = Trainer(preset("naive", steps=STEPS, eval_every=0, eval_size=16))
    trainer.train(progress=False)
    assert all(m["nonfinite_params"] == 0 for m in trainer.history)


def test_recovery_is_visible_in_the_metrics(fault_run):
    assert fault_run("nan-params", "stable").rolled_back == 1
    assert fault_run("nan-grads", "stable").skipped == 1
    assert fault_run("loss-spike", "stable").skipped == 1


def test_empty_micro_batch_is_refused_by_the_config():
    stable, naive = empty_micro_batch_fault()
    assert stable.startswith("ConfigError: GRPOConfig.grad_accum_steps")
    assert "RuntimeError" in naive


# One Python process that runs `python -m grpo_lab ARGS` commands one after another, each as
# `cli.main(ARGS)` with the process's file descriptors 1 and 2 redirected to files: what the
# command prints, warns or logs lands there (a logging handler holding the old sys.stderr
# writes to descriptor 2 too), as it would on a terminal. Each command starts with a fresh
# process's warning state (the filters changed, so every warning shows once again). One
# interpreter start for all the cases instead of one each.
CLI_SERVER = r"""
import json, os, sys, tempfile, warnings
from grpo_lab import cli
answers = os.fdopen(os.dup(1), "w")
for line in sys.stdin:
    warnings.simplefilter("default")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush(); sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
        try:
            code = cli.main(json.loads(line))
        except SystemExit as e:  # argparse's own errors
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # a traceback is what a user would see
            import traceback
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os.dup2(saved[0], 1); os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
        err.seek(0)
        answers.write(json.dumps([code, err.read().decode(errors="replace")]) + "\n")
        answers.flush()
"""


class CliServer:
    """`run_cli(args, env) -> (exit code, stderr)` for reliability.check_bad_inputs, answered
    by one CLI_SERVER process started with the first call's environment."""

    def __init__(self):
        self.proc = None

    def __call__(self, args: list[str], env: dict) -> tuple[int, str]:
        if self.proc is None:
            self.proc = subprocess.Popen([sys.executable, "-c", CLI_SERVER], env=env, text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.proc.stdin.write(json.dumps(args) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        assert answer, f"the CLI process died running {args} (exit {self.proc.wait()})"
        code, stderr = json.loads(answer)
        return code, stderr

    def close(self):
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def test_every_bad_input_is_rejected_with_one_line():
    """Each case is a command as a user types it, exit code 2 and one line on stderr (all
    the cases in one process: see CLI_SERVER)."""
    lines = []
    server = CliServer()
    try:
        ok, total = reliability.check_bad_inputs(lines.append, server)
    finally:
        server.close()
    assert total >= 60
    assert ok == total, "\n".join(line for line in lines if "FAIL" in line)


def test_resumes_are_identical():
    lines = []
    ok, total = reliability.check_resumes(lines.append)
    assert ok == total, "\n".join(lines)


def test_a_run_stuck_in_the_hanging_reward_is_called_hung_after_the_grace(monkeypatch):
    """The runner stops waiting HANG_GRACE (+ the reward timeout) after the run entered the
    never-returning reward function, not HANG_LIMIT after the start; a run that ends by itself
    is waited for."""
    import threading
    import time

    from grpo_lab.field import faults

    monkeypatch.setattr(faults, "HANG_LIMIT", 60.0)
    monkeypatch.setattr(faults, "HANG_GRACE", 0.5)
    faults._reward_hanging.clear()
    stuck = threading.Thread(target=faults._hang, args=([], []), daemon=True)
    t0 = time.monotonic()
    stuck.start()
    faults.wait_for_run(stuck, reward_timeout=0.0)
    assert stuck.is_alive() and faults._reward_hanging.is_set()
    assert time.monotonic() - t0 < 30  # the grace (0.5 s), not HANG_LIMIT (60 s)

    faults._reward_hanging.clear()
    done = threading.Thread(target=lambda: threading.Event().wait(1.0), daemon=True)
    done.start()
    faults.wait_for_run(done, reward_timeout=0.0)
    assert not done.is_alive()
