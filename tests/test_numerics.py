"""grpo_lab/numerics.py's derived floors, checked where they are tightest."""

import pytest
import torch

from grpo_lab.numerics import K3_FLOOR
from grpo_lab.objective import kl_k3


@pytest.mark.numerics
def test_k3_stays_above_its_rounding_floor_where_it_is_smallest():
    """k3 = e^x - x - 1 >= 0 exactly; in float32 it may land below 0 only near x = 0, and
    by at most K3_FLOOR (the derivation beside it). A grid over [-2^-9, 2^-9] (spacing about
    2^-29) and one over [-1e-6, 1e-6], through the trainer's own kl_k3 (x = ref_logp - logp);
    on this machine's kernels its minimum there was -1u (below 0: a floor of 0 would fail)."""
    x = torch.cat([torch.linspace(-2.0**-9, 2.0**-9, 2**21), torch.linspace(-1e-6, 1e-6, 2**16)])
    k3 = kl_k3(torch.zeros_like(x), x)  # logp = 0, ref_logp = x
    assert float(k3.min()) >= K3_FLOOR, (float(k3.min()), K3_FLOOR)
    wide = torch.linspace(-20.0, 20.0, 2**20)
    assert float(kl_k3(torch.zeros_like(wide), wide).min()) >= K3_FLOOR
