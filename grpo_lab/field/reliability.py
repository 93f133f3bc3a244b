"""`python -m grpo_lab reliability`: the whole matrix, one line per item, four totals.

    scenarios reproduced   every field failure shows its symptom broken and not fixed
    faults survived        stable recovers or stops cleanly; naive, given the same, fails
    bad inputs rejected    every bad flag / config value: exit 2, one line naming it
    resumes identical      crash + resume gives the uninterrupted run's metrics
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import typing
from pathlib import Path

from ..config import GRPOConfig, preset
from ..trainer import Trainer, read_metrics, without_timing
from .catalog import CATALOG
from .faults import FAULTS, empty_micro_batch_fault, run_fault
from .scenarios import run_scenario


def check_scenarios(log) -> tuple[int, int]:

    ok = 0
    for name in CATALOG:
        broken, fixed = run_scenario(name, fixed=False), run_scenario(name, fixed=True)
        good = broken.symptom and not fixed.symptom
        ok += good
        log(f"  {'ok  ' if good else 'FAIL'} scenario {name}: {broken.evidence[:110]}")
    return ok, len(CATALOG)


def check_faults(log) -> tuple[int, int]:

    ok = 0
    for name in FAULTS:
        stable, naive = run_fault(name, "stable"), run_fault(name, "naive")
        good = stable.survived and not naive.survived
        ok += good
        log(f"  {'ok  ' if good else 'FAIL'} fault {name}: {stable.summary()[:110]} | "
            f"{naive.summary()[:70]}")
    stable_answer, naive_answer = empty_micro_batch_fault()
    good = stable_answer.startswith("ConfigError") and "RuntimeError" in naive_answer
    ok += good
    log(f"  {'ok  ' if good else 'FAIL'} fault empty-micro-batch: stable {stable_answer[:80]} | "
        f"naive {naive_answer[:60]}")
    return ok, len(FAULTS) + 1


def bad_inputs() -> list[tuple[list[str], str]]:
    """(CLI arguments after `train --preset stable --out DIR`, text the error must name)."""
    hints = typing.get_type_hints(GRPOConfig)
    cases: list[tuple[list[str], str]] = []
    for f in dataclasses.fields(GRPOConfig):
        if f.name == "extra":
            continue
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        if hint is bool:
            cases.append(([f"{flag}=maybe"], flag))
        elif hint is int:
            cases += [([flag, "-1"], f.name), ([flag, "1.5"], flag)]
        elif hint is float:
            cases += [([flag, "-1"], f.name), ([flag, "nan"], f.name)]
        elif hint == float | None:
            cases += [([flag, "-1"], f.name), ([flag, "abc"], flag)]
        elif f.name in ("model_path",):
            cases.append(([flag, "/nonexistent/model"], "model_path"))
        elif f.name == "device":
            cases.append(([flag, "tpu:0"], "device"))
        else:  # a choice
            cases.append(([flag, "bogus"], f.name))
    cases += [
        (["--group-size", "1"], "group_size"),  # G < 2: no group to normalise within
        (["--epsilon-low", "1.5"], "epsilon_low"),  # inverted clip range: 1 - eps < 0
        (["--top-p", "0"], "top_p"),
        (["--grad-accum-steps", "1000"], "grad_accum_steps"),
        (["--max-new-tokens", "100"], "max_new_tokens"),  # longer than the model
        (["--preset", "risky"], "--preset"),
        (["--bogus-flag", "1"], "--bogus-flag"),
        (["--config", "CONFIG:{\"learning_rat\": 0.001}"], "learning_rat"),
        (["--config", "CONFIG:{\"group_size\": \"eight\"}"], "group_size"),
        (["--config", "CONFIG:[1, 2]"], "JSON object"),
        (["--config", "CONFIG:not json"], "--config"),
    ]
    return cases


def cli_in_a_process(args: list[str], env: dict) -> tuple[int, str]:
    """`python -m grpo_lab ARGS` as a user runs it: (exit code, stderr)."""
    p = subprocess.run([sys.executable, "-m", "grpo_lab", *args], capture_output=True,
                       text=True, timeout=120, env=env)
    return p.returncode, p.stderr


def check_bad_inputs(log, run_cli=cli_in_a_process) -> tuple[int, int]:
    """Every bad input through `run_cli(args, env) -> (exit code, stderr)`: exit 2 and one
    line on stderr naming the field."""
    cases = bad_inputs()
    ok = 0
    env = {**os.environ, "GRPO_LAB_PROFILE": "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (args, needle) in enumerate(cases):
            if args[0] == "--config":
                path = Path(tmp) / f"config{i}.json"
                path.write_text(args[1].removeprefix("CONFIG:"))
                args = ["--config", str(path)]
            code, stderr = run_cli(["train", "--preset", "stable", "--out",
                                    str(Path(tmp) / f"run{i}"), "--steps", "1", *args], env)
            lines = stderr.strip().splitlines()
            good = code == 2 and len(lines) == 1 and needle in lines[0]
            ok += good
            log(f"  {'ok  ' if good else 'FAIL'} bad input {' '.join(args)[:50]}: "
                f"exit {code}, {lines[-1][:90] if lines else '(nothing on stderr)'}")
    return ok, len(cases)


RESUME_CONFIGS = [
    {},
    {"grad_accum_steps": 3, "loss_type": "dapo"},
    {"num_iterations": 2, "loss_type": "dr_grpo"},
    {"amp": "bf16", "beta": 0.0},
]


def check_resumes(log) -> tuple[int, int]:

    ok = 0
    for overrides in RESUME_CONFIGS:
        cfg = preset("stable", steps=6, checkpoint_every=3, eval_every=3, eval_size=32,
                     **overrides)
        with tempfile.TemporaryDirectory() as tmp:
            whole, part = Path(tmp, "whole"), Path(tmp, "part")
            Trainer(cfg, out_dir=whole).train(progress=False)

            def crash(m):
                if m["step"] == 5:
                    raise KeyboardInterrupt

            try:
                Trainer(cfg, out_dir=part).train(progress=False, callback=crash)
            except KeyboardInterrupt:
                pass
            resumed = Trainer(cfg, out_dir=part)
            resumed.load_checkpoint()
            resumed.train(progress=False)
            good = without_timing(read_metrics(whole)) == without_timing(read_metrics(part))
        ok += good
        log(f"  {'ok  ' if good else 'FAIL'} resume {json.dumps(overrides)}: crash after step 5, "
            f"resume from step 3, metrics {'identical' if good else 'DIFFER'}")
    return ok, len(RESUME_CONFIGS)


def main(log=print) -> int:
    t0 = time.time()
    totals = {}
    for label, check in [
        ("scenarios reproduced", check_scenarios), ("faults survived", check_faults),
        ("bad inputs rejected", check_bad_inputs), ("resumes identical", check_resumes),
    ]:
        log(f"{label}:")
        totals[label] = check(log)
    log(f"\nreliability matrix ran in {time.time() - t0:.0f} s")
    for label, (a, b) in totals.items():
        log(f"{label}: {a}/{b}")
    return 0 if all(a == b for a, b in totals.values()) else 1
