"""Stretch exercises (tier stretch, in grpo_lab/course/exercises): each reference passes its
checker, a stub is 'not implemented' and falls back to the reference, each named mistake
fails with a message naming it; and the three facts notebook 09 measures about the KL estimators' gradients."""

import math

import pytest
import torch

from grpo_lab import naive, objective
from grpo_lab.course import exercises
from grpo_lab.course.exercises import nb02, nb03, nb09
from grpo_lab.numerics import UNIT_ROUNDOFF, as_accurate_bound, score_mean_bound, sum_error_bound

pytestmark = pytest.mark.numerics  # .ci/kernels runs this file under other CPU kernels

STRETCH = ("rloo_advantages", "zero_std_group_filter", "dual_clip_surrogate",
           "clip_higher_fractions", "sequence_level_ratio", "estimator_expected_gradient",
           "kl_gradients", "adaptive_beta")
REFERENCES = {e.check: e.reference for e in (exercises.find(name) for name in STRETCH)}


# --- the learner's mistakes, written out ----------------------------------------------------
def _rloo_self_included(rewards, group_size):  # GRPO's centring
    g = rewards.view(-1, group_size)
    return (g - g.mean(1, keepdim=True)).reshape(-1)


def _rloo_divided_by_g(rewards, group_size):
    g = rewards.view(-1, group_size)
    return (g - (g.sum(1, keepdim=True) - g) / group_size).reshape(-1)


def _rloo_strided_groups(rewards, group_size):
    g = rewards.view(group_size, -1).t()
    out = g - (g.sum(1, keepdim=True) - g) / (group_size - 1)
    return out.t().reshape(-1)


def _filter_by_std(rewards, group_size):
    return (rewards.view(-1, group_size).std(dim=1) > 0).repeat_interleave(group_size)


def _filter_inverted(rewards, group_size):
    return ~nb02.reference_zero_std_group_filter(rewards, group_size)


def _filter_per_group(rewards, group_size):
    g = rewards.view(-1, group_size)
    return g.amax(1) != g.amin(1)


def _filter_long(rewards, group_size):
    return nb02.reference_zero_std_group_filter(rewards, group_size).long()


def _filter_all_wrong_only(rewards, group_size):  # drops all-0 groups, keeps all-1 groups
    return (rewards.view(-1, group_size) != 0).any(1).repeat_interleave(group_size)


def _filter_keeps_singletons(rewards, group_size):
    if group_size == 1:
        return torch.ones_like(rewards, dtype=torch.bool)
    return nb02.reference_zero_std_group_filter(rewards, group_size)


def _dual_clip_everywhere(logp, old_logp, advantages, epsilon_low=0.2, epsilon_high=0.2,
                          dual_clip=3.0):
    ratio, adv = torch.exp(logp - old_logp), advantages.unsqueeze(-1)
    s = torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv)
    return -torch.max(s, dual_clip * adv)


def _dual_clip_missing(logp, old_logp, advantages, epsilon_low=0.2, epsilon_high=0.2,
                       dual_clip=3.0):
    return objective.clipped_surrogate(logp, old_logp, advantages, epsilon_low, epsilon_high)[0]


def _dual_clip_min(logp, old_logp, advantages, epsilon_low=0.2, epsilon_high=0.2, dual_clip=3.0):
    ratio, adv = torch.exp(logp - old_logp), advantages.unsqueeze(-1)
    s = torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv)
    return -torch.where(adv < 0, torch.min(s, dual_clip * adv), s)


def _dual_clip_detached(*args, **kwargs):
    return nb03.reference_dual_clip_surrogate(*args, **kwargs).detach()


def _fractions_swapped(logp, old_logp, advantages, epsilon_low, epsilon_high):
    low, high = nb03.reference_clip_higher_fractions(logp, old_logp, advantages, epsilon_low,
                                                  epsilon_high)
    return high, low


def _fractions_no_sign(logp, old_logp, advantages, epsilon_low, epsilon_high):
    r = torch.exp(logp - old_logp)
    return float((r < 1 - epsilon_low).float().mean()), float((r > 1 + epsilon_high).float().mean())


def _fractions_eps_low_only(logp, old_logp, advantages, epsilon_low, epsilon_high):
    return nb03.reference_clip_higher_fractions(logp, old_logp, advantages, epsilon_low, epsilon_low)


def _fractions_counts(logp, old_logp, advantages, epsilon_low, epsilon_high):
    low, high = nb03.reference_clip_higher_fractions(logp, old_logp, advantages, epsilon_low,
                                                  epsilon_high)
    return low * logp.numel(), high * logp.numel()


def _ratio_summed(logp, old_logp, completion_mask):  # report 001
    lp, base = naive.sequence_log_ratio_inputs(logp, old_logp, completion_mask)
    return torch.exp(lp - base)[:, 0]


def _ratio_by_width(logp, old_logp, completion_mask):
    m = completion_mask.float()
    return torch.exp(((logp - old_logp) * m).sum(-1) / m.shape[-1])


def _ratio_unmasked(logp, old_logp, completion_mask):
    return torch.exp((logp - old_logp).mean(-1))


def _ratio_arithmetic(logp, old_logp, completion_mask):
    m = completion_mask.float()
    return (torch.exp(logp - old_logp) * m).sum(-1) / m.sum(-1).clamp(min=1)


def _ratio_nan_on_empty(logp, old_logp, completion_mask):
    m = completion_mask.float()
    return torch.exp(((logp - old_logp) * m).sum(-1) / m.sum(-1))


def _grad_through_weights(estimator, logits, ref_logits):
    logp, logq = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    return torch.autograd.grad((logp.exp() * estimator(logp, logq)).sum(), logits)[0]


def _grad_uniform(estimator, logits, ref_logits):
    logp, logq = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    return torch.autograd.grad(estimator(logp, logq).mean(), logits)[0]


def _grad_raw_logits(estimator, logits, ref_logits):
    w = logits.softmax(-1).detach()
    return torch.autograd.grad((w * estimator(logits, ref_logits)).sum(), logits)[0]


def _grad_by_backward(estimator, logits, ref_logits):
    logp, logq = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    (logp.exp().detach() * estimator(logp, logq)).sum().backward()
    return logits.grad.clone()


def _kl_grads_swapped(logits, ref_logits):
    reverse, forward = nb09.reference_kl_gradients(logits, ref_logits)
    return forward, reverse


def _kl_grads_wrt_probs(logits, ref_logits):
    logp, logq = logits.detach().log_softmax(-1), ref_logits.log_softmax(-1)
    return logp - logq + 1, -(logq - logp).exp()


def _beta_unclipped(beta, kl, target_kl, horizon, n_steps=1):
    return beta * (1 + (kl / target_kl - 1) * n_steps / horizon)


def _beta_wrong_way(beta, kl, target_kl, horizon, n_steps=1):
    return beta * (1 - min(max(kl / target_kl - 1, -0.2), 0.2) * n_steps / horizon)


def _beta_no_n_steps(beta, kl, target_kl, horizon, n_steps=1):
    return nb09.reference_adaptive_beta(beta, kl, target_kl, horizon, 1)


def _beta_additive(beta, kl, target_kl, horizon, n_steps=1):
    return beta + min(max(kl / target_kl - 1, -0.2), 0.2) * n_steps / horizon


MISTAKES = [
    (nb02.check_rloo_advantages, _rloo_self_included, "included each sample in its own baseline"),
    (nb02.check_rloo_advantages, objective.group_advantages, "divided by the group's std"),
    (nb02.check_rloo_advantages, _rloo_divided_by_g, "G - 1 of them"),
    (nb02.check_rloo_advantages, _rloo_strided_groups, "do not sum to 0 within each group"),
    (nb02.check_zero_std_group_filter, _filter_by_std, "std() > 0"),
    (nb02.check_zero_std_group_filter, _filter_inverted, "kept the groups whose rewards are all equal"),
    (nb02.check_zero_std_group_filter, _filter_per_group, "one entry per group"),
    (nb02.check_zero_std_group_filter, _filter_long, "bool mask"),
    (nb02.check_zero_std_group_filter, _filter_all_wrong_only, "all 1"),
    (nb02.check_zero_std_group_filter, _filter_keeps_singletons, "G=1 keeps nothing"),
    (nb03.check_dual_clip_surrogate, _dual_clip_everywhere, "applied the dual clip to positive "
     "advantages too"),
    (nb03.check_dual_clip_surrogate, _dual_clip_missing, "plain clipped surrogate"),
    (nb03.check_dual_clip_surrogate, _dual_clip_min, "bound with max, not min"),
    (nb03.check_dual_clip_surrogate, _dual_clip_detached, "carries no gradient"),
    (nb03.check_clip_higher_fractions, _fractions_swapped, "(high, low)"),
    (nb03.check_clip_higher_fractions, _fractions_no_sign, "advantage pushes it further"),
    (nb03.check_clip_higher_fractions, _fractions_eps_low_only, "1 + epsilon_high"),
    (nb03.check_clip_higher_fractions, _fractions_counts, "counts"),
    (nb03.check_sequence_level_ratio, _ratio_summed, "summed instead of averaged"),
    (nb03.check_sequence_level_ratio, _ratio_by_width, "width"),
    (nb03.check_sequence_level_ratio, _ratio_unmasked, "padding counted"),
    (nb03.check_sequence_level_ratio, _ratio_arithmetic, "geometric mean"),
    (nb03.check_sequence_level_ratio, _ratio_nan_on_empty, "no completion tokens"),
    (nb09.check_estimator_expected_gradient, _grad_through_weights, "differentiated the weights"),
    (nb09.check_estimator_expected_gradient, _grad_uniform, "averaged over the vocabulary"),
    (nb09.check_estimator_expected_gradient, _grad_raw_logits, "raw logits"),
    (nb09.check_estimator_expected_gradient, _grad_by_backward, "logits.grad"),
    (nb09.check_kl_gradients, _kl_grads_swapped, "swapped"),
    (nb09.check_kl_gradients, _kl_grads_wrt_probs, "with respect to the probabilities"),
    (nb09.check_adaptive_beta, _beta_unclipped, "unclipped error"),
    (nb09.check_adaptive_beta, _beta_wrong_way, "wrong way"),
    (nb09.check_adaptive_beta, _beta_no_n_steps, "n_steps is ignored"),
    (nb09.check_adaptive_beta, _beta_additive, "multiplicative"),
]


@pytest.mark.parametrize("check", list(REFERENCES), ids=lambda c: c.__name__)
def test_reference_passes(check, capsys):
    result = check(REFERENCES[check])
    assert result.passed, result.reason
    assert "✅" in capsys.readouterr().out


@pytest.mark.parametrize("check", list(REFERENCES), ids=lambda c: c.__name__)
def test_unwritten_exercise_is_not_implemented_and_falls_back(check, capsys):
    def stub(*args, **kwargs):
        raise NotImplementedError("write this function")

    result = check(stub)
    assert result.status == "not implemented"
    assert result.use() is REFERENCES[check]
    assert "not implemented yet" in capsys.readouterr().out


# std() > 0 misreads a group of eight float32 0.7s only where rounding leaves its std above 0
if float(torch.full((1, 8), 0.7).std(dim=1)) == 0:
    MISTAKES = [m for m in MISTAKES if m[1] is not _filter_by_std]


@pytest.mark.parametrize("check,buggy,needle", MISTAKES,
                         ids=lambda x: getattr(x, "__name__", "x"))
def test_named_mistakes_fail_with_their_name(check, buggy, needle):
    result = check(buggy)
    assert result.status == "failed"
    assert needle in result.reason, result.reason
    assert result.use() is REFERENCES[check]


def test_a_checker_never_raises_on_odd_return_values():
    odd = [lambda *a, **k: None, lambda *a, **k: "x", lambda *a, **k: (1, 2, 3),
           lambda *a, **k: torch.zeros(2, 2, 2)]
    for check in REFERENCES:
        for f in odd:
            assert check(f).status == "failed"


def test_checkers_are_reachable_as_module_level_references():
    """labs.py records each exercise's reference as module.qualname for the grader."""
    for check, ref in REFERENCES.items():
        assert ref.__module__.startswith("grpo_lab.course.exercises.nb")
        assert "<locals>" not in ref.__qualname__
        assert check.__name__ == "check_" + ref.__name__.removeprefix("reference_")


def test_labs_and_the_grader_find_the_stretch_checkers():
    from grpo_lab.course import labs

    for check in REFERENCES:
        assert labs.find_checker(check.__name__) is check


# --- the references, against independent formulas -------------------------------------------
def test_rloo_is_grpo_centring_scaled_by_g_over_g_minus_1():
    r = torch.rand(24, generator=torch.Generator().manual_seed(0))
    for g in (2, 3, 4, 8):
        centred = objective.group_advantages(r, g, scale_rewards=False)
        # rewards in [0, 1), so a group's sum S < g, off by at most (g - 1) u S: the centred
        # value r - S / g is then within (g + 1) u, times g / (g - 1) (two roundings) within
        # (2 g + 6) u; RLOO's r - (S - r) / (g - 1) within (g + 4) u: (3 g + 10) u apart at most
        atol = (3 * g + 10) * UNIT_ROUNDOFF
        assert torch.allclose(nb02.reference_rloo_advantages(r, g), centred * g / (g - 1), atol=atol)
    with pytest.raises(ValueError):
        nb02.reference_rloo_advantages(r, 1)


def test_dual_clip_is_the_clipped_surrogate_unless_a_negative_advantage_is_past_the_bound():
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(6, 50, generator=g)
    logp = old + torch.randn(6, 50, generator=g)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, -2.0])
    dual = nb03.reference_dual_clip_surrogate(logp, old, adv, 0.2, 0.28, 3.0)
    plain = objective.clipped_surrogate(logp, old, adv, 0.2, 0.28)[0]
    bound = (adv.unsqueeze(-1) < 0) & (torch.exp(logp - old) > 3.0)
    assert bound.any()
    assert torch.equal(dual[~bound], plain[~bound])
    assert torch.allclose(dual[bound], (-3.0 * adv.unsqueeze(-1)).expand_as(dual)[bound])


def test_clip_fractions_match_the_surrogates_region_clipped():
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(8, 20, generator=g)
    logp = old + torch.randn(8, 20, generator=g) * 0.3
    adv = torch.randn(8, generator=g)
    low, high = nb03.reference_clip_higher_fractions(logp, old, adv, 0.2, 0.28)
    clipped = objective.clipped_surrogate(logp, old, adv, 0.2, 0.28)[1]
    # two counts (exact) over 160 and their sum, against one count over 160: a few roundings
    # of fractions below 1, under 3 u = 1.8e-7 apart
    assert math.isclose(low + high, float(clipped.float().mean()), abs_tol=3 * UNIT_ROUNDOFF)


def test_sequence_ratio_is_finite_where_report_001s_sum_overflows():
    old = torch.zeros(1, 1000)
    logp = old + 0.1  # a mean log-ratio of 0.1 over 1000 tokens: the sum is 100
    mask = torch.ones(1, 1000, dtype=torch.long)
    # a float32 mean of 1000 terms (sum_error_bound), exp (2 ulp) and 0.1's own rounding
    assert math.isclose(float(nb03.reference_sequence_level_ratio(logp, old, mask)), math.exp(0.1),
                        rel_tol=sum_error_bound(1000) + 6 * UNIT_ROUNDOFF)
    lp, base = naive.sequence_log_ratio_inputs(logp, old, mask)
    assert torch.isinf(torch.exp(lp - base)).all()


def test_kl_gradients_match_their_closed_forms():
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        z, w = torch.randn(8, generator=g, dtype=torch.float64), torch.randn(8, generator=g,
                                                                             dtype=torch.float64)
        reverse, forward = nb09.reference_kl_gradients(z.clone().requires_grad_(True), w)
        logp, logq = z.log_softmax(-1), w.log_softmax(-1)
        kl = (logp.exp() * (logp - logq)).sum()
        assert torch.allclose(reverse, logp.exp() * (logp - logq - kl), atol=1e-12)
        assert torch.allclose(forward, logp.exp() - logq.exp(), atol=1e-12)


# --- the three measured facts of notebook 09, on random logits ------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_k1_k2_k3_expected_gradients(seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(8, generator=g) * (1 + seed)
    w = torch.randn(8, generator=g)
    leaf = z.clone().requires_grad_(True)
    reverse, forward = nb09.reference_kl_gradients(leaf, w)
    grads = {name: nb09.reference_estimator_expected_gradient(k, leaf, w)
             for name, k in (("k1", objective.kl_k1), ("k2", objective.kl_k2),
                             ("k3", objective.kl_k3))}
    assert leaf.grad is None  # no .backward() on the caller's tensor
    # against the float64 closed forms, as notebook 09 holds them: k1's to the rounding of
    # p - p sum(p) (numerics.score_mean_bound), k2's and k3's as accurate as autograd's
    # gradients of the two KLs themselves (numerics.as_accurate_bound)
    logp64, logq64 = z.double().log_softmax(-1), w.double().log_softmax(-1)
    p64 = logp64.exp()
    true_reverse = p64 * (logp64 - logq64 - (p64 * (logp64 - logq64)).sum())
    true_forward = p64 - logq64.exp()

    def off(x, truth):
        return (x.double() - truth).abs().max().item()

    assert off(grads["k1"], torch.zeros_like(p64)) <= score_mean_bound(p64.max().item(), 8)
    # k2: grad KL(p || q), the reverse KL's; k3: grad KL(q || p), the forward KL's
    assert off(grads["k2"], true_reverse) <= as_accurate_bound(
        off(reverse, true_reverse), true_reverse.abs().max().item())
    assert off(grads["k3"], true_forward) <= as_accurate_bound(
        off(forward, true_forward), true_forward.abs().max().item())
    # and the two targets differ (the facts are not vacuous)
    assert (reverse - forward).abs().max() > 1e-3


def test_adaptive_beta_follows_trls_controller():
    beta = 0.2
    for kl in (0.0, 3.0, 6.0, 6.6, 12.0):
        error = float(torch.tensor(kl / 6.0 - 1).clamp(-0.2, 0.2))
        assert math.isclose(nb09.reference_adaptive_beta(beta, kl, 6.0, 10_000, 256),
                            beta * (1 + error * 256 / 10_000))
