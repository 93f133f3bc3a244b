"""How far two float32 computations of the same quantity may differ: the bounds the tests
and the checkers compare with where the two sides do not run the same kernels in the same
order (another batch split, process count, thread count or CPU instruction set).

Where both sides do run the same kernels in the same order, nothing here is needed: they
agree bit for bit, and the comparison is `torch.equal`.

A sum of n float32 terms computed in any order is off from the exact sum by at most
gamma_n * sum|x_i| (Higham, "Accuracy and Stability of Numerical Algorithms", 2002, eq. 4.4,
gamma_n = n u / (1 - n u)). That worst case assumes every rounding error has the same sign;
the errors of real sums are independent enough that Higham & Mary (2019, "A New Approach to
Probabilistic Rounding Error Analysis", Theorem 3.1) bound it by

    gamma~_n(lambda) = exp(lambda sqrt(n) u + n u^2 / (1 - u)) - 1 ~= lambda sqrt(n) u

times sum|x_i|, with probability at least 1 - 2 n exp(-lambda^2 (1 - u)^2 / 2) for each
computed sum (their Theorem 3.1, inner products; a sum is one with y = 1). At LAMBDA = 9
that failure probability is 5e-18 n per sum: for a million sums of a million terms each,
about one false alarm in two hundred thousand checks. Two computations of one sum, each
within gamma~_n of the exact value, are within 2 gamma~_n sum|x_i| of each other. The
model assumes independent, mean-zero rounding errors; sums of same-sign terms of similar
size (a sum of squares) are where it is weakest, so use it there with room to spare.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch

from .fast import fused_adamw
from .objective import completion_logprobs

UNIT_ROUNDOFF = 2.0**-24  # float32: half the distance from 1 to the next float
LAMBDA = 9.0


def sum_error_bound(n: int, unit_roundoff: float = UNIT_ROUNDOFF, lam: float = LAMBDA) -> float:
    """gamma~_n(lambda): relative to sum|x_i|, how far a computed sum of n terms may be from
    the exact one (Higham & Mary 2019, probabilistic; see the module docstring)."""
    u = unit_roundoff
    return math.expm1(lam * math.sqrt(n) * u + n * u * u / (1 - u))


# k3 = e^x - x - 1 (x = ref_logp - logp) is >= 0 for every real x; how far below 0 its float32
# value may land. With u = UNIT_ROUNDOFF: exp returns e^x (1 + d1), |d1| <= 2 ulp = 4u
# (CUDA's expf is within 2 ulp, the CPU's vectorised exp within 1); subtracting x rounds
# once more, |d2| <= u; subtracting 1 is exact (Sterbenz: the operand lies in [1/2, 2]).
# So |computed - exact| <= 4u e^x + u (e^x - x). k3 is that small only near x = 0 (k3 < 6u
# needs |x| < sqrt(12u) ~ 1e-3, where e^x < 1.001): the error there is at most ~5u.
K3_FLOOR = -6 * UNIT_ROUNDOFF


def score_mean_bound(p_max: float, vocab: int) -> float:
    """How far from 0 an entry of a float32 E_{x~p}[grad log p(x)] may land, with respect to
    the logits (k1's expected gradient, notebook 09): autograd computes it as p - p * sum(p),
    0 exactly since sum(p) = 1.

    Computed, p_x = exp(log_softmax(z)_x) carries the log-sum-exp's error (common to every x:
    the V-term sum, sum_error_bound(V), and the log, u), |log p_x| u from rounding log p_x,
    and exp's 2 ulp (4u); weighted by p_x these add up to at most sum_error_bound(V) +
    (5 + ln V) u (sum p |log p| <= ln V), and summing the V computed values adds
    sum_error_bound(V) more. So |1 - computed sum(p)| <= 2 sum_error_bound(V) + (5 + ln V) u;
    times p_x, plus 2u p_x for the product and the subtraction."""
    u = UNIT_ROUNDOFF
    return p_max * (2 * sum_error_bound(vocab) + (7 + math.log(vocab)) * u)


AS_ACCURATE = 4.0  # see as_accurate_bound


def as_accurate_bound(plain_error: float, scale: float) -> float:
    """How far from the float64 truth a float32 computation may be that claims to be as
    accurate as a plain float32 computation of the same function whose error is
    `plain_error`: AS_ACCURATE times that error, plus AS_ACCURATE u of `scale` (the largest
    true value, or the true vector's norm) for where the plain one happens to be exact.

    A modelling choice, not a worst case: the two run the same number of roundings per
    output in another order or blocking, so their errors are of one size; the factor leaves
    room for the spread of a maximum over many entries. A computation that is wrong (a
    misaligned position, a missing temperature, another prompt's cache) is off by the
    values' own size, far beyond it."""
    return AS_ACCURATE * plain_error + AS_ACCURATE * UNIT_ROUNDOFF * scale


TRAJECTORY = 100.0  # see trajectory_bound


def trajectory_bound(pair_gap: float, scale: float) -> float:
    """How far a correct training run may be from a reference run, in a parameter or a
    metric after some steps, given `pair_gap`: how far apart a pair of correct runs is that
    differ only in the order they round in (notebook 11: `Trainer(cfg)` against
    `Trainer(cfg, fast=False)`; notebook 08: the package's step whole against in
    micro-batches). TRAJECTORY times that gap, plus AS_ACCURATE u of `scale` (the value's
    size) for where the pair happens to agree exactly.

    Why a wider factor than as_accurate_bound's: a rounding difference changes the next
    step's log-probabilities, and AdamW grows it step by step by an amount that depends on
    which weights it lands on, so two rounding differences of one size end up far apart.
    Measured on the course's runs, under five CPU kernel settings (.ci/kernels): a grpo_loss
    written in another float order against notebook 11's pair (tests/test_steps.py's 6
    steps and the notebook's 20) came out 0.17 to 4.3 times the pair's gap on loss, kl and
    grad_norm; notebook 08's micro-batch loop run in reverse order, up to 10 times the
    package pair's (grad_norm, ATEN_CPU_CAPABILITY=avx2). The factor is 10 times the largest
    ratio seen. The known mistakes of grpo_loss that change the run were 1e4 to 1e5 times
    the pair's gap or more (where a sampled token changed, the reward moved by 1/64), so
    they stay 100 times beyond it."""
    return TRAJECTORY * pair_gap + AS_ACCURATE * UNIT_ROUNDOFF * scale


def adamw_first_step(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor],
                     **adamw_args) -> dict[str, torch.Tensor]:
    """The parameters after one AdamW step from `params` with gradients `grads`, run by
    the trainer's own optimizer construction: what an update must equal bit for bit when
    it consumed those gradients (elementwise kernels, no reduction: the same bits on any
    thread count)."""
    leaves = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
    for name, leaf in leaves.items():
        leaf.grad = grads[name].clone()
    fused_adamw(list(leaves.values()), torch.device("cpu"), **adamw_args).step()
    return {n: p.detach() for n, p in leaves.items()}


def float64_logprobs(model, input_ids, attention_mask, completion_length: int,
                     temperature: float = 1.0, logit_clamp: float | None = None) -> torch.Tensor:
    """(B, C) log-probs of the completion tokens from a float64 copy of `model` (the same
    weights, widened): the truth that two float32 computations of the same log-probs (the
    sampler's and a training forward's) are each held to, with as_accurate_bound."""
    twin = copy.deepcopy(model).double()
    with torch.no_grad():
        return completion_logprobs(twin, input_ids, attention_mask, completion_length,
                                   temperature, logit_clamp)


def logprob_allowance(plain: torch.Tensor, truth: torch.Tensor, mask: torch.Tensor) -> float:
    """How far from `truth` (float64_logprobs) on the `mask`ed tokens a float32 computation of
    those log-probs may be that is as accurate as `plain`, another float32 computation of them
    (the sampler's, say): as_accurate_bound of plain's error, at the log-probs' scale."""
    m = mask.bool()
    return as_accurate_bound((plain.double() - truth)[m].abs().max().item(),
                             truth[m].abs().max().item())


def float64_gradients(trainer, batch) -> list[torch.Tensor]:
    """The gradient of `batch`'s loss for each of `trainer`'s parameters, from a float64 copy
    of the trainer (the same weights, config and batch; pi_old from its own forward, as on a
    first pass): the truth float32 gradients (whole batch or accumulated, fast or plain
    forward) are held to with as_accurate_bound. Neither `trainer` nor `batch` changes."""
    twin = copy.deepcopy(trainer)
    twin.policy.double()
    twin.optimizer.zero_grad(set_to_none=True)
    twin.backward(dataclasses.replace(batch, old_logp=None))
    return [torch.zeros_like(p) if p.grad is None else p.grad for p in twin.policy.parameters()]
