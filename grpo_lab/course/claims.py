"""The notebooks' claims that GPT-2 124M shows differently from the tiny GPT-2, in one place.

Most claims hold as written on both profiles. A few were measured on the tiny GPT-2 (the cpu
profile) and came out otherwise on GPT-2 124M (the gpu profile): the naive preset's blow-up,
for one, is a run of finite spikes on the tiny model and a single update to NaN on 124M. For
those, each entry below gives the bound on each profile and the runs that set it, and the
notebook asserts

    print(expect("06.reference_spikes", value))

which returns the line that says what held, and raises an AssertionError naming the claim,
the profile, the value, the bound and the measurement when it does not. The gpu values come
from the prepared device run (`bash benchmarks/gpu_checks.sh`; `ONLY=executed` keeps every
cell's printed numbers, committed as benchmarks/gpu/executed-*.txt)."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

from ..config import resolve_profile

_TESTS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}


@dataclass(frozen=True)
class Claim:
    """One measured quantity and the bound it keeps on each profile."""

    what: str
    """The quantity, in the notebook's words."""
    cpu: tuple[str, float]
    """(">", bound) or ("<", bound), and so on: what the tiny GPT-2 shows."""
    gpu: tuple[str, float]
    """The same for GPT-2 124M."""
    measured: str
    """The runs each bound was set from: model, machine, date, the values seen."""

    def __post_init__(self) -> None:
        for side in (self.cpu, self.gpu):
            if side[0] not in _TESTS or not math.isfinite(side[1]):
                raise ValueError(f"a claim's bound is (one of {sorted(_TESTS)}, a finite number), "
                                 f"got {side!r}")


CLAIMS: dict[str, Claim] = {
    "06.reference_spikes": Claim(
        "share of the runs with the ratio against the reference whose largest grad_norm is "
        "above 10 x the stable preset's largest",
        cpu=(">", 0.5), gpu=("<", 0.25),
        measured="tiny GPT-2, 2 CPU cores (2026-11-28): 18 of 24; GPT-2 124M, H200 "
                 "(2026-11-28): 1 of 24 (the per-token ratio's 6.4e5), the naive runs' largest "
                 "finite norms 11.6, 7.6 and 30.3 against the stable preset's 15.6, then NaN"),
    "06.guarded_spikes": Claim(
        "largest grad_norm of the runs guarded by the log-ratio clamp or the skip rule, in "
        "units of the stable preset's largest (a spike: above 10, section 3's rule)",
        cpu=(">", 10.0), gpu=("<", 10.0),
        measured="tiny GPT-2, 2 CPU cores (2026-11-28): 2.21e4 / 22.1 = 1000 x (the package's "
                 "switches), 2.16e4 / 22.1 = 977 x (your step); GPT-2 124M, H200 (2026-11-28): "
                 "30.3 / 15.6 = 1.9 x for both"),
    "06.reports_final_vs_naive": Claim(
        "largest grad_norm of the reports' final settings, in units of the naive run's "
        "largest finite one (seed 0)",
        cpu=("<", 1.0), gpu=(">", 1.0),
        measured="tiny GPT-2: 258 / 1.9e6 with AVX-512 kernels (2026-11-28), the naive spike "
                 "5.6e3 with AVX2 ones; GPT-2 124M, H200 (2026-11-28): 22.4 / 11.6 = 1.9 x, "
                 "the naive run having gone NaN after its first update"),
    "06.reports_tenth_at_step_10": Claim(
        "accuracy at step 10 of the reports' settings at a tenth of the naive learning rate "
        "(1e-4: the tiny model's stable rate, 10 x GPT-2 124M's)",
        cpu=(">", 0.1), gpu=("<", 0.1),
        measured="tiny GPT-2, 2 CPU cores (2026-11-28): 0.44 from 0.39; GPT-2 124M, H200 "
                 "(2026-11-28): 0.00 from 0.35, as at half the naive rate"),
    "07.warmup_spike_delay": Claim(
        "mean number of steps by which a 10-step warmup delays the naive preset's first "
        "gradient norm of 100 or more (or NaN), over seeds 0, 1, 2",
        cpu=(">=", 2.0), gpu=("<", 2.0),
        measured="tiny GPT-2, 2 CPU cores (2026-11-28): 4, 2, 5; GPT-2 124M, H200 "
                 "(2026-11-28): 0, 1, 0, while the sampling crash moved from step 3 to step 7 "
                 "on every seed"),
}


def expect(name: str, value: float, profile: str | None = None) -> str:
    """Assert CLAIMS[name] for the profile in use; return the line that says what held."""
    if name not in CLAIMS:
        raise KeyError(f"no claim named {name!r}; the claims are {sorted(CLAIMS)}")
    claim, profile = CLAIMS[name], resolve_profile(profile)
    op, bound = getattr(claim, profile)
    value = float(value)
    line = f"{claim.what}: {value:.3g} (asserted on the {profile} profile: {op} {bound:g})"
    if not _TESTS[op](value, bound):  # a NaN value fails every bound
        raise AssertionError(f"claim {name!r} does not hold: {line}. Its bounds were set from: "
                             f"{claim.measured}")
    return line
