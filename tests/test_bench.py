"""The grpo_lab-vs-TRL benchmark's smoke mode: both sides train, the figures come out in
the promised format. No timing is asserted (the figures are printed, not tested)."""

import json
import math
import re

import pytest

from grpo_lab import bench

NUMBER = r"[-+]?\d+\.\d+"


def test_quick_mode_trains_both_sides(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--steps", "2", "--seeds", "1", "--json", str(out)]) == 0
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


@pytest.mark.parametrize("argv, field", [
    (["--steps", "0"], "--steps"),
    (["--seeds", "-1"], "--seeds"),
    (["--device", "tpu"], "--device"),
])
def test_bad_arguments_are_refused_with_one_line(argv, field, capsys):
    assert bench.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err, err
