"""Unit tests for grpo_lab.objective and grpo_lab.field.bugs: pure torch, a tiny random GPT-2
where a model is needed, every claim checked against an independent hand computation."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from grpo_lab import naive
from grpo_lab.numerics import UNIT_ROUNDOFF, as_accurate_bound
from grpo_lab.objective import (
    aggregate,
    clipped_surrogate,
    completion_logits,
    completion_logprobs,
    exact_kl,
    group_advantages,
    kl_k1,
    kl_k2,
    kl_k3,
    position_ids_from_mask,
    token_logprobs,
    token_weights,
)

pytestmark = pytest.mark.numerics  # .ci/kernels runs this file under other CPU kernels

PAD = 1
LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")


@pytest.fixture(scope="module")
def tiny_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=15,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0,
        embd_pdrop=0,
        attn_pdrop=0,
    )
    model = GPT2LMHeadModel(config).eval()
    # Random-init GPT-2 logits are tiny (std 0.02 weights); scale the (tied) embedding up
    # so that position/offset mistakes change the logits far beyond the tolerances.
    with torch.no_grad():
        model.transformer.wte.weight.mul_(50.0)
        model.transformer.wpe.weight.mul_(50.0)
    return model


def _left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


# --- 1. position ids ------------------------------------------------------------------


def test_position_ids_start_at_zero_on_first_real_token():
    mask = torch.tensor(
        [
            [0, 0, 1, 1, 1],
            [1, 1, 1, 1, 1],
            [0, 0, 0, 0, 1],
            [0, 1, 1, 1, 1],
        ]
    )
    pos = position_ids_from_mask(mask)
    for row_mask, row_pos in zip(mask.tolist(), pos.tolist(), strict=True):
        first = row_mask.index(1)
        real = row_pos[first:]
        assert real == list(range(len(real)))
        assert all(p >= 0 for p in row_pos)
    assert pos.dtype == torch.long


def test_left_padded_row_matches_unpadded_logits(tiny_model):
    prompt = [3, 4, 5, 6, 7]
    with torch.no_grad():
        ref = tiny_model(input_ids=torch.tensor([prompt])).logits[0, -1]
        ids, mask = _left_pad([prompt, [9, 8, 2, 3, 4, 5, 6, 11]])  # row 0 gets 3 pads
        assert mask[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
        padded = tiny_model(
            input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)
        ).logits[0, -1]
        # the same row without position ids is shifted by 3 positions: really different
        wrong = tiny_model(input_ids=ids, attention_mask=mask).logits[0, -1]
        # the truth: the same weights in float64; the padded row must be as accurate as the
        # unpadded one (numerics.as_accurate_bound)
        twin = copy.deepcopy(tiny_model).double()
        truth = twin(input_ids=torch.tensor([prompt])).logits[0, -1]
    allowed = as_accurate_bound((ref.double() - truth).abs().max().item(),
                                truth.abs().max().item())
    assert (padded.double() - truth).abs().max().item() <= allowed
    assert (wrong - ref).abs().max().item() > 1000 * allowed


# --- 2. token_logprobs ----------------------------------------------------------------


def test_token_logprobs_matches_python_loop():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 6, generator=g) * 3
    ids = torch.randint(0, 6, (2, 3), generator=g)
    got = token_logprobs(logits, ids)
    assert got.shape == (2, 3)
    for b in range(2):
        for t in range(3):
            row = logits[b, t].double().tolist()
            log_z = math.log(sum(math.exp(x) for x in row))
            expected = row[ids[b, t].item()] - log_z
            # float32 log-softmax of logits under 12 in size: within u (|logit| + |log Z|) of
            # float64's, under 30 u = 1.8e-6
            assert got[b, t].item() == pytest.approx(expected, abs=1e-5)


# --- 3. completion logprobs -----------------------------------------------------------


def test_completion_logprobs_temperature_and_offsets(tiny_model):
    C, temp = 3, 0.7
    rows = [[3, 4, 5, 12, 13, 14], [2, 6, 7, 8, 9, 10, 11, 0]]  # prompt + C completion
    ids, mask = _left_pad(rows)
    with torch.no_grad():
        got = completion_logprobs(tiny_model, ids, mask, C, temperature=temp)
    assert got.shape == (2, C)
    for b, row in enumerate(rows):
        with torch.no_grad():  # each row on its own, unpadded: default positions 0..n-1
            logits = tiny_model(input_ids=torch.tensor([row])).logits[0].double()
        n = len(row)
        for j in range(C):
            pos = n - C + j  # the completion token at pos is predicted from pos - 1
            logp = torch.log_softmax(logits[pos - 1] / temp, -1)[row[pos]]
            # the same float32 logits; float32's division and log-softmax against float64's:
            # within u (|logit / T| + |log Z|) + u, under 40 u = 2.4e-6 for the tiny model
            assert got[b, j].item() == pytest.approx(logp.item(), abs=1e-5)
    # temperature really enters: at T=1 the values differ
    with torch.no_grad():
        at_one = completion_logprobs(tiny_model, ids, mask, C, temperature=1.0)
    assert (at_one - got).abs().max() > 1e-3


def test_logit_clamp_clamps(tiny_model):
    C, temp, clamp = 3, 0.7, 0.5
    ids, mask = _left_pad([[3, 4, 5, 12, 13, 14], [2, 6, 7, 8, 9, 10, 11, 0]])
    with torch.no_grad():
        free = completion_logits(tiny_model, ids, mask, C, temperature=temp)
        clamped = completion_logits(tiny_model, ids, mask, C, temperature=temp, logit_clamp=clamp)
        lp = completion_logprobs(tiny_model, ids, mask, C, temperature=temp, logit_clamp=clamp)
    assert free.abs().max() > clamp  # the clamp has something to do
    assert clamped.abs().max() <= clamp
    torch.testing.assert_close(clamped, free.clamp(-clamp, clamp))
    torch.testing.assert_close(lp, token_logprobs(free.clamp(-clamp, clamp), ids[:, -C:]))


# --- 4. group advantages --------------------------------------------------------------


def test_group_advantages_match_hand_formula():
    rng = np.random.default_rng(0)
    G, eps = 4, 1e-4
    rewards = rng.normal(size=3 * G)
    got = group_advantages(torch.tensor(rewards, dtype=torch.float64), G, advantage_eps=eps)
    expected = []
    for k in range(3):
        grp = rewards[k * G : (k + 1) * G]
        mean = sum(grp) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (G - 1))
        expected += [(x - mean) / (std + eps) for x in grp]
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-12)


def test_group_advantages_pinned_values():
    rewards = torch.tensor([1, 0, 0, 0, 1, 1, 1, 1], dtype=torch.float64)
    got = group_advantages(rewards, 4, advantage_eps=1e-4)
    # group 0: mean 0.25, unbiased std sqrt(0.75 / 3) = 0.5; group 1: all equal -> 0
    s = 0.5 + 1e-4
    expected = torch.tensor(
        [0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s, 0, 0, 0, 0], dtype=torch.float64
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    assert got[0].item() == pytest.approx(1.4997000599880024, abs=1e-12)
    assert got[1].item() == pytest.approx(-0.49990001999600080, abs=1e-12)


def test_group_advantages_all_equal_group_is_exactly_zero():
    got = group_advantages(torch.tensor([0.3, 0.3, 0.3, 0.3, 1.0, 0.0, 0.0, 1.0]), 4)
    assert torch.isfinite(got).all()
    assert (got[:4] == 0).all()
    assert (got[4:] != 0).all()


def test_group_advantages_unscaled_only_centres():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 6.0, 8.0], dtype=torch.float64)
    got = group_advantages(rewards, 4, scale_rewards=False)
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25, -3.0, -1.0, 1.0, 3.0], dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("rewards", [torch.zeros(7), torch.zeros(2, 4), torch.zeros(())])
def test_group_advantages_bad_shape_raises(rewards):
    with pytest.raises(ValueError):
        group_advantages(rewards, 4)


# --- 5. KL estimators -----------------------------------------------------------------


def test_kl_estimators_match_formulas():
    g = torch.Generator().manual_seed(2)
    logp = -torch.rand(50, generator=g, dtype=torch.float64) * 5
    ref = -torch.rand(50, generator=g, dtype=torch.float64) * 5
    for a, b, k1, k2, k3 in zip(
        logp.tolist(),
        ref.tolist(),
        kl_k1(logp, ref).tolist(),
        kl_k2(logp, ref).tolist(),
        kl_k3(logp, ref).tolist(),
        strict=True,
    ):
        log_r = b - a  # log(q / p)
        assert k1 == pytest.approx(-log_r, abs=1e-12)
        assert k2 == pytest.approx(0.5 * log_r**2, abs=1e-12)
        assert k3 == pytest.approx(math.exp(log_r) - log_r - 1, abs=1e-12)


def test_k3_nonnegative_including_extremes():
    log_r = torch.cat([torch.linspace(-20, 20, 4001), torch.tensor([-20.0, 0.0, 20.0])])
    for dtype in (torch.float32, torch.float64):
        logp = torch.zeros_like(log_r, dtype=dtype)
        k3 = kl_k3(logp, log_r.to(dtype))
        assert torch.isfinite(k3).all()
        # k3 = exp(x) - x - 1 >= 0 exactly; computed, exp is within 1 ulp (2u e^x) on the
        # backends torch uses and the two subtractions round by u times their operands, so
        # near x = 0 (k3 ~ x^2/2 below u) the sign is rounding's: with AVX-512 kernels
        # k3(1e-6) is -6e-8 in float32. Below zero by at most 4u (e^x + |x| + 1).
        u = torch.finfo(dtype).eps / 2
        floor = -4 * u * (log_r.to(dtype).exp() + log_r.to(dtype).abs() + 1)
        assert (k3 >= floor).all(), (k3 - floor).min()
        assert (k3[log_r.abs() >= 1e-2] > 0).all()  # where x^2/2 is far above the rounding
    assert kl_k3(torch.tensor(0.0), torch.tensor(0.0)).item() == 0.0


@pytest.fixture(scope="module")
def kl_samples():
    """A seeded pair of categoricals over V=50 and 200k tokens drawn from p."""
    g = torch.Generator().manual_seed(0)
    logits_p = torch.randn(50, generator=g, dtype=torch.float64)
    logits_q = torch.randn(50, generator=g, dtype=torch.float64)
    idx = torch.multinomial(logits_p.softmax(-1), 200_000, replacement=True, generator=g)
    logp = logits_p.log_softmax(-1)[idx]
    ref = logits_q.log_softmax(-1)[idx]
    return logits_p, logits_q, logp, ref


def _mean_sem(x: torch.Tensor) -> tuple[float, float]:
    return x.mean().item(), (x.std() / math.sqrt(x.numel())).item()


@pytest.mark.parametrize("estimator", [kl_k1, kl_k3], ids=["k1", "k3"])
def test_unbiased_estimators_monte_carlo(kl_samples, estimator):
    logits_p, logits_q, logp, ref = kl_samples
    kl = exact_kl(logits_p, logits_q).item()
    assert kl > 0.5  # a pair that really differs
    mean, sem = _mean_sem(estimator(logp, ref))
    assert abs(mean - kl) < 4 * sem + 1e-3


def test_k2_is_biased_monte_carlo(kl_samples):
    logits_p, logits_q, logp, ref = kl_samples
    kl = exact_kl(logits_p, logits_q).item()
    mean, sem = _mean_sem(kl_k2(logp, ref))
    assert abs(mean - kl) > 5 * sem


def test_report_003_kl_is_biased(kl_samples):
    logits_p, logits_q, logp, ref = kl_samples
    kl = exact_kl(logits_p, logits_q).item()
    est = naive.report003_kl(logp, ref)
    assert (est >= 0).all()
    mean, sem = _mean_sem(est)
    assert abs(mean - kl) > 20 * sem
    # ... whereas k3 on the very same samples is not
    mean3, sem3 = _mean_sem(kl_k3(logp, ref))
    assert abs(mean3 - kl) < 4 * sem3 + 1e-3


def test_exact_kl_hand_computation_and_properties():
    g = torch.Generator().manual_seed(3)
    logits_p = torch.randn(4, 7, generator=g, dtype=torch.float64) * 2
    logits_q = torch.randn(4, 7, generator=g, dtype=torch.float64) * 2
    got = exact_kl(logits_p, logits_q)
    assert got.shape == (4,)
    for i in range(4):
        p = np.exp(logits_p[i].numpy())
        p /= p.sum()
        q = np.exp(logits_q[i].numpy())
        q /= q.sum()
        # exact_kl computes in float32: each log-softmax entry within about u (|log p| + 2)
        # (u = 6e-8), times p, over V = 7 terms whose |log p - log q| stays under 20 here:
        # 7 x 22 u = 9e-6 in the worst case
        assert got[i].item() == pytest.approx(float(np.sum(p * np.log(p / q))), abs=1e-5)
    assert (got >= 0).all()
    same = exact_kl(logits_p, logits_p)
    assert torch.equal(same, torch.zeros_like(same))  # log p - log p: 0 exactly, every term
    # invariant to a constant shift of either set of logits: the shifted log-softmax rounds
    # differently, by the same 9e-6 at most
    torch.testing.assert_close(exact_kl(logits_p + 3.0, logits_q - 2.0), got, atol=2e-5, rtol=0)
    many = exact_kl(torch.randn(200, 9, generator=g) * 3, torch.randn(200, 9, generator=g) * 3)
    # below 0 only by rounding: 9 terms of p (log p - log q) at |log p - log q| <= 30, each
    # within about u (|log p - log q| + 4) p: at most 34 u = 2e-6 where the exact KL is 0
    assert (many >= -34 * UNIT_ROUNDOFF).all()


# --- 7. clipped surrogate -------------------------------------------------------------

RATIOS = [0.05, 0.5, 0.79, 0.85, 1.0, 1.1, 1.25, 1.35, 2.0, 10.0]
ADVANTAGES = [-2.0, -0.5, 0.5, 3.0]


def _grid() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A, R) grid: row i has advantage ADVANTAGES[i] and ratios RATIOS, as log-probs."""
    r = torch.tensor(RATIOS, dtype=torch.float64).repeat(len(ADVANTAGES), 1)
    old = torch.linspace(-3, -0.1, r.numel(), dtype=torch.float64).view_as(r)
    logp = (old + r.log()).requires_grad_(True)
    return logp, old, torch.tensor(ADVANTAGES, dtype=torch.float64)


@pytest.mark.parametrize("eps_low,eps_high", [(0.2, 0.2), (0.2, 0.28), (0.1, 0.3)])
def test_clipped_surrogate_matches_hand_formula_and_gradient(eps_low, eps_high):
    logp, old, adv = _grid()
    loss, region = clipped_surrogate(logp, old, adv, epsilon_low=eps_low, epsilon_high=eps_high)
    loss.sum().backward()
    for i, a in enumerate(ADVANTAGES):
        for j, r in enumerate(RATIOS):
            clipped_r = min(max(r, 1 - eps_low), 1 + eps_high)
            assert loss[i, j].item() == pytest.approx(-min(r * a, clipped_r * a), abs=1e-9)
            in_clip = (a > 0 and r > 1 + eps_high) or (a < 0 and r < 1 - eps_low)
            assert bool(region[i, j]) == in_clip, (a, r)
            expected_grad = 0.0 if in_clip else -r * a  # d(-r A)/d logp = -r A
            assert logp.grad[i, j].item() == pytest.approx(expected_grad, abs=1e-9), (a, r)


def test_asymmetric_epsilon_is_honoured():
    # r = 1.25 is inside [0.8, 1.28] but outside [0.8, 1.2]; r = 0.85 inside [0.8, ...] but
    # outside [0.9, ...]
    logp = torch.log(torch.tensor([[1.25, 0.85]], dtype=torch.float64))
    old = torch.zeros_like(logp)
    pos, neg = torch.tensor([1.0], dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64)
    _, reg_sym = clipped_surrogate(logp, old, pos, 0.2, 0.2)
    _, reg_high = clipped_surrogate(logp, old, pos, 0.2, 0.28)
    assert reg_sym.tolist() == [[True, False]]
    assert reg_high.tolist() == [[False, False]]
    loss_high, _ = clipped_surrogate(logp, old, pos, 0.2, 0.28)
    assert loss_high[0, 0].item() == pytest.approx(-1.25)
    _, reg_neg_wide = clipped_surrogate(logp, old, neg, 0.2, 0.2)
    _, reg_neg_narrow = clipped_surrogate(logp, old, neg, 0.1, 0.2)
    assert reg_neg_wide.tolist() == [[False, False]]
    assert reg_neg_narrow.tolist() == [[False, True]]
    loss_narrow, _ = clipped_surrogate(logp, old, neg, 0.1, 0.2)
    assert loss_narrow[0, 1].item() == pytest.approx(0.9)


def test_log_ratio_clamp_bounds_the_ratio():
    # float32, log-ratio 200: exp overflows to inf without the clamp
    logp = torch.tensor([[200.0, -200.0, 0.0]])
    old = torch.zeros_like(logp)
    neg = torch.tensor([-1.0])
    loss_free, _ = clipped_surrogate(logp, old, neg)
    assert torch.isinf(loss_free[0, 0])  # -min(inf * -1, 1.2 * -1) = +inf
    loss_cl, _ = clipped_surrogate(logp, old, neg, log_ratio_clamp=20.0)
    assert torch.isfinite(loss_cl).all()
    assert loss_cl[0, 0].item() == pytest.approx(math.exp(20.0), rel=1e-5)
    assert loss_cl[0, 1].item() == pytest.approx(0.8)  # clipped at 1 - eps_low
    assert loss_cl[0, 2].item() == pytest.approx(1.0)
    # positive advantage: the loss itself is finite either way (the clipped branch wins),
    # but the backward pass through exp(200) = inf gives NaN without the clamp
    pos = torch.tensor([1.0])
    x = logp.clone().requires_grad_(True)
    clipped_surrogate(x, old, pos)[0].sum().backward()
    assert not torch.isfinite(x.grad).all()
    y = logp.clone().requires_grad_(True)
    loss, _ = clipped_surrogate(y, old, pos, log_ratio_clamp=20.0)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(y.grad).all()


# --- 8. report 001: constant clip -----------------------------------------------------


def _grad(fn, r: float, a: float) -> float:
    logp = torch.tensor([[math.log(r)]], dtype=torch.float64, requires_grad=True)
    loss, _ = fn(logp, torch.zeros_like(logp), torch.tensor([a], dtype=torch.float64))
    loss.sum().backward()
    return logp.grad.item()


def test_constant_clip_negative_advantage_unbounded():
    a = -0.5
    # the constant version's gradient is r|A| for every r > eps, e.g. r = 1e6 ...
    assert _grad(naive.constant_clip_surrogate, 1e6, a) == pytest.approx(1e6 * abs(a), rel=1e-9)
    # ... and at r = 0.5, where the real trust region (r < 1 - eps_low, A < 0) is clipped
    # and gives no gradient, the constant version still pushes with r|A|
    assert _grad(clipped_surrogate, 0.5, a) == 0.0
    assert _grad(naive.constant_clip_surrogate, 0.5, a) == pytest.approx(0.5 * abs(a))
    # NB: standard PPO clipping does not bound A < 0 at large r either (r*A is the min)
    assert _grad(clipped_surrogate, 1e6, a) == pytest.approx(1e6 * abs(a), rel=1e-9)


def test_constant_clip_positive_advantage_has_no_gradient_inside_trust_region():
    a = 2.0
    for r in (0.85, 1.0, 1.15):
        assert _grad(naive.constant_clip_surrogate, r, a) == 0.0
        assert _grad(clipped_surrogate, r, a) == pytest.approx(-r * a)
    logp = torch.log(torch.tensor([[0.1, 0.85, 1.0, 5.0]]))
    loss, region = naive.constant_clip_surrogate(logp, torch.zeros_like(logp), torch.tensor([a]))
    torch.testing.assert_close(loss, torch.tensor([[-0.1 * a, -0.2 * a, -0.2 * a, -0.2 * a]]))
    assert region.tolist() == [[False, True, True, True]]


# --- 9. report 001: sequence-level log-ratio ------------------------------------------


def test_sequence_log_ratio_inputs():
    g = torch.Generator().manual_seed(4)
    logp = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 4
    base = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 4
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    new_logp, new_base = naive.sequence_log_ratio_inputs(logp, base, mask)
    assert new_logp.shape == logp.shape and new_base.shape == base.shape
    diff = new_logp - new_base
    for b in range(3):
        row_sum = sum((logp[b, t] - base[b, t]).item() for t in range(5) if mask[b, t].item() == 1)
        for t in range(5):  # every token of the row, masked ones included
            assert diff[b, t].item() == pytest.approx(row_sum, abs=1e-12)
    assert (diff[2] == 0).all()
    # a drift of 0.5 nats/token over 200 tokens sums to 100: exp overflows float32
    drift = torch.full((1, 200), 0.5)
    lp, bl = naive.sequence_log_ratio_inputs(drift, torch.zeros_like(drift), torch.ones(1, 200))
    assert torch.isinf(torch.exp(lp - bl)).all()


# --- 10. token weights and aggregation ------------------------------------------------

LENGTHS = [3, 1, 5, 0]
C = 5


def _ragged() -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.tensor([[1.0] * n + [0.0] * (C - n) for n in LENGTHS], dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    loss = torch.randn(len(LENGTHS), C, generator=g, dtype=torch.float64)
    return loss, mask


def _reference(loss: torch.Tensor, mask: torch.Tensor, loss_type: str, max_len: int) -> float:
    L, m = loss.numpy(), mask.numpy()
    if loss_type == "grpo":  # TRL: ((L*m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
        return float(((L * m).sum(-1) / np.maximum(m.sum(-1), 1.0)).mean())
    if loss_type in ("bnpo", "dapo"):
        return float((L * m).sum() / m.sum())
    assert loss_type == "dr_grpo"
    return float((L * m).sum() / (L.shape[0] * max_len))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_aggregate_matches_reference(loss_type):
    loss, mask = _ragged()  # float64 throughout: 1e-6 is ten orders above its rounding
    got = aggregate(loss, mask, loss_type)
    assert got.item() == pytest.approx(_reference(loss, mask, loss_type, C), abs=1e-6)
    got8 = aggregate(loss, mask, loss_type, max_completion_length=8)
    assert got8.item() == pytest.approx(_reference(loss, mask, loss_type, 8), abs=1e-6)


def test_grpo_zero_length_row_counts_as_a_sequence():
    loss, mask = _ragged()
    per_seq = [
        sum(loss[b, t].item() for t in range(n)) / n if n else 0.0 for b, n in enumerate(LENGTHS)
    ]
    expected = sum(per_seq) / len(LENGTHS)  # divides by 4, not by the 3 non-empty rows
    assert aggregate(loss, mask, "grpo").item() == pytest.approx(expected, abs=1e-6)
    w = token_weights(mask, "grpo", C)
    assert torch.isfinite(w).all() and (w[3] == 0).all()
    assert w.sum().item() == pytest.approx(3 / 4)


def test_token_weights_values():
    _, mask = _ragged()
    w = token_weights(mask, "grpo", C)
    assert w[0, 0].item() == pytest.approx(1 / 3 / 4)
    assert w[1, 0].item() == pytest.approx(1 / 4)
    assert w[2, 4].item() == pytest.approx(1 / 5 / 4)
    assert (w[mask == 0] == 0).all()
    for lt in ("bnpo", "dapo"):
        w = token_weights(mask, lt, C)
        assert torch.allclose(w[mask == 1], torch.full((9,), 1 / 9))
        assert (w[mask == 0] == 0).all()
    w = token_weights(mask, "dr_grpo", 8)
    assert torch.allclose(w[mask == 1], torch.full((9,), 1 / 32))
    assert (w[mask == 0] == 0).all()


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("splits", [[1, 1, 1, 1], [2, 2], [1, 3], [3, 1]])
def test_micro_batches_with_full_batch_weights_sum_to_full_aggregate(loss_type, splits):
    loss, mask = _ragged()
    full = aggregate(loss, mask, loss_type)
    w = token_weights(mask, loss_type, C)
    total, start = torch.zeros((), dtype=torch.float64), 0
    for n in splits:
        sl = slice(start, start + n)
        total = total + (loss[sl] * w[sl]).sum()
        start += n
    assert start == len(LENGTHS)
    assert total.item() == pytest.approx(full.item(), abs=1e-9)


def test_unknown_loss_type_raises():
    _, mask = _ragged()
    with pytest.raises(ValueError):
        token_weights(mask, "sequence_mean", C)
    with pytest.raises(ValueError):
        aggregate(torch.zeros_like(mask), mask, "GRPO")
