"""The grpo_lab-vs-TRL benchmark's smoke mode: both sides train, the figures come out in
the promised format. No timing is asserted (the figures are printed, not tested)."""

import itertools
import json
import math
import os
import re
import statistics
import sys

import pytest

from grpo_lab.tools import bench, turns

NUMBER = r"[-+]?\d+\.\d+"


def test_quick_mode_trains_both_sides(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--steps", "2", "--seeds", "1", "--json", str(out),
                       "--peak-tflops", "0.5"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(rf"step time ratio \(grpo_lab/TRL\): {NUMBER}", lines[-2]), lines[-2]
    assert re.fullmatch(rf"accuracy delta \(grpo_lab - TRL\): {NUMBER}", lines[-1]), lines[-1]
    rows = {line.split()[0]: line for line in lines if line.split()[:1] in (["grpo_lab"], ["TRL"])}
    assert set(rows) == {"grpo_lab", "TRL"}
    for value in (float(lines[-2].split(":")[1]), float(lines[-1].split(":")[1])):
        assert math.isfinite(value)

    figures = json.loads(out.read_text())
    for side in ("grpo_lab", "TRL"):
        r = figures[side]
        assert len(r["times"]) == len(r["cpu_times"]) == 2, side  # two steps, each timed
        assert all(math.isfinite(t) and t > 0 for t in r["times"] + r["cpu_times"]), side
        assert r["moved"][0] > 0, f"{side}: the parameters did not change"
        assert 0 <= r["acc"][0] <= 1 and r["peak_rss_mib"] > 0, side
        assert r["acc0"][0] == figures["grpo_lab"]["acc0"][0]  # the same start, the same eval
        assert len(r["tokens"]) == 2 and all(0 < n <= 64 * 5 for n in r["tokens"]), side
        # the printed MFU is the model FLOPs of the recorded steps over the given peak
        flops = [bench.model_flops_per_step(r["matmul_params"], 64, r["prompt_tokens"] + n / 64,
                                            0.01, 1) for n in r["tokens"]]
        want = 100 * statistics.median(f / t for f, t in zip(flops, r["times"], strict=True)) / 0.5e12
        mfu = rows[side].split()[5]
        assert mfu.endswith("%") and abs(float(mfu[:-1]) - want) < 0.006, (mfu, want)
    assert figures["grpo_lab"]["matmul_params"] == figures["TRL"]["matmul_params"]
    assert figures["grpo_lab"]["prompt_tokens"] == figures["TRL"]["prompt_tokens"] > 3
    assert figures["figures"]["cuda_graphs"] is False  # graphs.py replays on CUDA only


@pytest.mark.parametrize("argv, field", [
    (["--steps", "0"], "--steps"),
    (["--seeds", "-1"], "--seeds"),
    (["--device", "tpu"], "--device"),
    (["--profile", "big"], "--profile"),
    (["--profile", "gpu"], "--device cuda"),
    (["--peak-tflops", "0"], "--peak-tflops"),
])
def test_bad_arguments_are_refused_with_one_line(argv, field, capsys):
    assert bench.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err, err


def test_model_flops_count_the_step_s_passes(tiny):
    """2 FLOPs per parameter per token and forward, 6 with the backward: sampling, the
    reference (only with beta > 0), and mu training passes; position embeddings are looked
    up, not multiplied."""
    model, _ = tiny
    n = bench.matmul_params(model)
    assert n == sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
    assert bench.model_flops_per_step(n, 64, 10.0, 0.04, 1) == 10 * n * 640
    assert bench.model_flops_per_step(n, 64, 10.0, 0.0, 2) == 14 * n * 640


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 67.0), ("NVIDIA H100 PCIe", 51.0), ("NVIDIA H100 NVL", 60.0),
    ("NVIDIA H200", 67.0), ("NVIDIA L40S", 91.6), ("NVIDIA L4", 30.3),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_the_gpu_peak_is_the_longest_name_that_matches(name, peak):
    assert bench.known_peak(name)[0] == peak


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.5), ("NVIDIA H100 PCIe", 756.5), ("NVIDIA H200", 989.5),
    ("NVIDIA H100 NVL", None),  # its figure is not certain here: --peak-tflops
])
def test_with_bf16_the_peak_is_the_bf16_one(name, peak):
    value, source = bench.known_peak(name, "bf16")
    assert value == peak and (peak is None or source.endswith("bfloat16"))


def test_bf16_reaches_both_sides():
    args = bench.parse_args(["--amp", "bf16", "--steps", "2"])
    assert bench.bench_config(args).amp == "bf16"
    command = bench.side_command("TRL", 0, args)
    assert command[command.index("--amp") + 1] == "bf16"


FAKE_SIDE = """
import json, sys, time
from grpo_lab.tools.turns import RESULT, Progress
side, steps, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
progress = Progress(side, steps)
for step in range(steps):
    progress.begin()
    start = time.monotonic()
    time.sleep(0.2)
    with open(log, "a") as f:
        f.write(json.dumps([side, step, start, time.monotonic()]) + "\\n")
    if side == "c" and step == 2:
        sys.exit(3)
    progress.step_done(0.0, 1.0)
print(RESULT + json.dumps(progress.figures()))
"""


def test_sides_take_turns_one_step_each_and_a_failed_side_is_named(tmp_path):
    """The benchmark's sides run one step at a time, in turn, each timing only its own
    steps; a side that dies is the one the error names, and the others end with it."""
    log = tmp_path / "steps.jsonl"
    commands = {side: [sys.executable, "-c", FAKE_SIDE, side, "4", str(log)]
                for side in ("a", "b")}
    results = turns.run_in_turns(commands, 4, dict(os.environ))
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(side, step) for side, step, *_ in steps] == \
        [(side, step) for step in range(4) for side in ("a", "b")]
    for before, after in itertools.pairwise(steps):
        assert before[3] <= after[2], (before, after)  # never two steps at once
    for side in ("a", "b"):
        # each step sleeps 0.2 s and waits 0.2 s for the other side's turn: a clock that
        # counted the wait would read about 0.4 s; the bound leaves 0.2 s for scheduling
        assert len(results[side]["times"]) == 4
        assert all(0.2 <= t < 0.4 for t in results[side]["times"]), results[side]["times"]

    log.unlink()
    commands = {side: [sys.executable, "-c", FAKE_SIDE, side, "5", str(log)]
                for side in ("a", "b", "c")}
    with pytest.raises(RuntimeError, match=r"the c side failed with exit code 3"):
        turns.run_in_turns(commands, 5, dict(os.environ))
    assert len(log.read_text().splitlines()) == 3 * 3  # a, b, c took three turns each
