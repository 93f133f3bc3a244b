"""grpo_lab.course.claims: the per-profile bounds the notebooks assert, and their messages."""

import json
import math
import re
from pathlib import Path

import pytest

from grpo_lab.course.claims import CLAIMS, Claim, expect

ROOT = Path(__file__).resolve().parents[1]


def test_a_claim_holds_and_says_what_held():
    line = expect("06.guarded_spikes", 1000.0, profile="cpu")
    assert "1e+03 (asserted on the cpu profile: > 10)" in line


def test_a_claim_that_fails_names_itself_the_profile_the_value_and_the_measurement():
    with pytest.raises(AssertionError) as failed:
        expect("06.guarded_spikes", 1000.0, profile="gpu")
    message = str(failed.value)
    assert "'06.guarded_spikes'" in message and "gpu profile" in message and "1e+03" in message
    assert "< 10" in message and "H200" in message  # the bound and the runs that set it


def test_the_profile_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("GRPO_LAB_PROFILE", "gpu")
    assert "gpu profile" in expect("07.warmup_spike_delay", 0.33)
    with pytest.raises(AssertionError):
        expect("07.warmup_spike_delay", 3.67)


@pytest.mark.parametrize("value, holds_for", [
    (math.nan, ()),  # NaN fails every bound
    (math.inf, (">", ">=")),
    (-math.inf, ("<", "<=")),
])
def test_a_non_finite_value_holds_only_where_its_direction_does(value, holds_for):
    for name, claim in CLAIMS.items():
        for profile in ("cpu", "gpu"):
            if getattr(claim, profile)[0] in holds_for:
                expect(name, value, profile=profile)
            else:
                with pytest.raises(AssertionError):
                    expect(name, value, profile=profile)


def test_unknown_names_and_bad_bounds_are_refused():
    with pytest.raises(KeyError, match="06.reference_spikes"):
        expect("06.no_such_claim", 1.0)
    with pytest.raises(ValueError, match="bound"):
        Claim("x", cpu=("=", 1.0), gpu=("<", 1.0), measured="-")
    with pytest.raises(ValueError, match="bound"):
        Claim("x", cpu=(">", math.nan), gpu=("<", 1.0), measured="-")


def test_every_claim_is_asserted_by_both_editions_and_every_name_asserted_exists():
    used: dict[str, set[str]] = {}
    for edition in ("labs", "solutions"):
        for path in sorted((ROOT / edition).glob("*.ipynb")):
            cells = json.loads(path.read_text())["cells"]
            code = "".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
            for name in re.findall(r'expect\("([^"]+)"', code):
                used.setdefault(name, set()).add(f"{edition}/{path.stem[:2]}")
    assert set(used) == set(CLAIMS), set(used) ^ set(CLAIMS)
    for name, where in used.items():  # the notebook the name says, in both editions
        assert where == {f"labs/{name[:2]}", f"solutions/{name[:2]}"}, (name, where)
