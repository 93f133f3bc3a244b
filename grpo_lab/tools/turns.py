"""Timing sides that take turns: the benchmark's sides (grpo_lab, TRL) run in processes of
their own and step one at a time, in turn.

A shared machine's speed drifts by tens of percent over seconds to minutes: 150-step runs
of one side after the other gave step-time ratios from 0.36 to 0.61 for code whose speed
did not change (benchmarks/RESULTS.md). Taking turns every step puts every side under the
same spells, and no two sides compete for the CPU. `run_in_turns` starts the sides'
commands and passes the turn between them through two pipes per side (named in TURNS_ENV);
a side's `Progress` waits for its turn before a step and hands it back after, and its clock
stops meanwhile.

Standard library only, so that a side can be a small script (tests/test_bench.py).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

RESULT = "BENCH_RESULT "  # prefix of the one JSON line a side prints on stdout
PROGRESS_EVERY = 10  # steps between progress lines
TURNS_ENV = "GRPO_LAB_BENCH_TURNS"  # "GO_FD,DONE_FD": the pipes a side takes turns through


class Turns:
    """A side's end of the turns: wait for its turn before a step, hand it back after.
    Without TURNS_ENV (a side run alone, notebook 12's in-process run) there is nothing to
    wait for."""

    def __init__(self):
        fds = os.environ.get(TURNS_ENV)
        self.go, self.done = (int(fd) for fd in fds.split(",")) if fds else (None, None)

    def wait(self) -> None:
        if self.go is not None and os.read(self.go, 1) != b"g":
            sys.exit("grpo_lab bench: the benchmark's main process went away")

    def hand_back(self) -> None:
        if self.done is not None:
            os.write(self.done, b"d")


class Progress:
    """Per-step wall and CPU seconds, rewards, and a progress line on stderr every
    PROGRESS_EVERY steps. CPU time (this process, all threads) is the steadier figure on a
    machine shared with other jobs: it does not count the time others hold the core. The
    clock stops while the side waits for its turn (`Turns`)."""

    def __init__(self, side: str, total: int):
        self.side, self.total = side, total
        self.times, self.cpu_times, self.rewards, self.tokens = [], [], [], []
        self.start = time.perf_counter()
        self.last_wall, self.last_cpu = None, None
        self.turns = Turns()

    def begin(self) -> None:
        if self.last_wall is None:  # the first step; later turns are taken in step_done
            self.turns.wait()
        self.last_wall, self.last_cpu = time.perf_counter(), time.process_time()

    def step_done(self, reward: float, completion_tokens: float) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        self.tokens.append(completion_tokens)
        self.times.append(wall - self.last_wall)
        self.cpu_times.append(cpu - self.last_cpu)
        self.rewards.append(reward)
        n = len(self.times)
        if n % PROGRESS_EVERY == 0 or n == self.total:
            elapsed = time.perf_counter() - self.start
            print(f"[{self.side}] step {n}/{self.total}  {statistics.median(self.times):.3f} s/step "
                  f"(median)  reward {reward:.2f}  elapsed {elapsed:.0f} s",
                  file=sys.stderr, flush=True)
        self.turns.hand_back()
        if n < self.total:
            self.turns.wait()
        self.last_wall, self.last_cpu = time.perf_counter(), time.process_time()

    def figures(self) -> dict:
        return {"times": self.times, "cpu_times": self.cpu_times, "rewards": self.rewards,
                "tokens": self.tokens, "reward_last10": statistics.mean(self.rewards[-10:])}


def run_in_turns(commands: dict[str, list[str]], steps: int, env: dict[str, str]) -> dict[str, dict]:
    """Start every side's command at once and let them take turns, one step each in the
    order given, for `steps` rounds (each side's Progress waits for its turn; `Turns`); then
    each side's result dict, from the RESULT line it printed. A side that fails raises
    RuntimeError naming it, and the others are ended, not left waiting."""
    procs, outs, ours = {}, {}, []  # ours: this process's pipe ends, closed when done
    with tempfile.TemporaryDirectory(prefix="grpo_lab_bench_") as tmp:
        try:
            for side, cmd in commands.items():
                go_r, go_w = os.pipe()
                done_r, done_w = os.pipe()
                ours += [go_w, done_r]
                outs[side] = open(os.path.join(tmp, f"{side}.out"), "w+")  # stderr: progress
                try:
                    procs[side] = (subprocess.Popen(
                        cmd, stdout=outs[side], pass_fds=(go_r, done_w),
                        env={**env, TURNS_ENV: f"{go_r},{done_w}"}), go_w, done_r)
                finally:
                    # the child's ends: a child that dies closes the last copy, so a read of
                    # its pipe returns EOF instead of waiting for ever
                    os.close(go_r)
                    os.close(done_w)
            failed = None
            for _ in range(steps):
                for side, (_, go, done) in procs.items():
                    try:
                        os.write(go, b"g")
                        ok = os.read(done, 1) == b"d"
                    except BrokenPipeError:
                        ok = False
                    if not ok:
                        failed = side
                        break
                if failed:
                    break
            while ours:  # a side still waiting for its turn reads EOF and exits
                os.close(ours.pop())
            results = {}
            # a side that failed is reported, not another one it stopped
            for side in sorted(procs, key=lambda side: side != failed):
                p = procs[side][0]
                p.wait()
                outs[side].seek(0)
                stdout = outs[side].read()
                lines = [line for line in stdout.splitlines() if line.startswith(RESULT)]
                if p.returncode != 0 or not lines:
                    raise RuntimeError(f"the {side} side failed with exit code {p.returncode}; "
                                       f"the end of its output:\n{stdout[-4000:]}")
                results[side] = json.loads(lines[-1][len(RESULT):])
            return {side: results[side] for side in commands}
        finally:
            while ours:
                os.close(ours.pop())
            for p, _, _ in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for f in outs.values():
                f.close()
