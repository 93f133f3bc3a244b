"""grpo_lab/numerics.py's derived floors, checked where they are tightest."""

import pytest
import torch

from grpo_lab.numerics import K3_FLOOR, UNIT_ROUNDOFF, score_mean_bound, sum_error_bound
from grpo_lab.objective import kl_k3, token_logprobs


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


@pytest.mark.numerics
def test_k1s_expected_gradient_stays_within_its_derived_rounding():
    """E_{x~p}[grad log p(x)] = p - p * sum(p) is 0 exactly; its float32 value stays within
    score_mean_bound (the derivation in its docstring) over vocabularies 8 to 50,257 and
    logits from flat to peaked. The bound is not vacuous: the same computation with the
    probabilities' sum off by 100 units of rounding lands outside it."""
    gen = torch.Generator().manual_seed(0)
    for vocab in (8, 50, 1000, 50_257):
        for scale in (0.1, 1.0, 5.0):
            theta = (torch.randn(vocab, generator=gen) * scale).requires_grad_(True)
            logp = theta.log_softmax(-1)
            (grad,) = torch.autograd.grad((logp.exp().detach() * logp).sum(), theta)
            p = theta.detach().softmax(-1)
            bound = score_mean_bound(float(p.max()), vocab)
            assert float(grad.abs().max()) <= bound, (vocab, scale, float(grad.abs().max()), bound)
            off = p - p * (1 + 100 * UNIT_ROUNDOFF + 2 * sum_error_bound(vocab))
            assert float(off.abs().max()) > bound, (vocab, scale)


def test_log_probs_are_float32_at_least_and_float64_kept():
    """token_logprobs computes in float32 from narrower logits (bf16, fp16), and keeps a
    float64 model's float64 (notebook 08's truth runs the trainer's own step in float64)."""
    ids = torch.tensor([[1, 2]])
    for dtype, expected in ((torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                            (torch.float32, torch.float32), (torch.float64, torch.float64)):
        assert token_logprobs(torch.randn(1, 2, 5).to(dtype), ids).dtype == expected, dtype
