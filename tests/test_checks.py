"""Exercise checkers: the reference passes, field bugs fail with a reason a learner can act
on, an unwritten exercise reports 'not implemented yet' and hands back the reference."""

import copy
import math
import statistics

import pytest
import torch

from grpo_lab import naive, objective
from grpo_lab.course import steps
from grpo_lab.course.exercises import (
    nb00,
    nb01,
    nb02,
    nb03,
    nb04,
    nb05,
    nb06,
    nb07,
    nb08,
    nb09,
    nb10,
    nb11,
    nb12,
)
from grpo_lab.course.exercises.base import difference
from grpo_lab.models import count_parameters
from grpo_lab.sampling import completion_mask_from_ids
from grpo_lab.tasks import addition_reward
from grpo_lab.trainer import micro_batch_slices

pytestmark = pytest.mark.numerics  # .ci/kernels runs this file under other CPU kernels

REFERENCES = {
    nb00.check_count_parameters: count_parameters,
    nb01.check_position_ids_from_mask: objective.position_ids_from_mask,
    nb01.check_token_logprobs: objective.token_logprobs,
    nb01.check_sample_tokens: steps.sample_tokens,
    nb02.check_group_advantages: objective.group_advantages,
    nb03.check_kl_k3: objective.kl_k3,
    nb03.check_clipped_surrogate: objective.clipped_surrogate,
    nb03.check_token_weights: objective.token_weights,
    nb04.check_addition_reward: addition_reward,
    nb05.check_first_nonfinite_step: nb05.reference_first_nonfinite_step,
    nb07.check_nonfinite_params: __import__("grpo_lab.health").health.nonfinite_params,
    nb08.check_micro_batch_slices: micro_batch_slices,
    nb09.check_exact_kl: objective.exact_kl,
    nb09.check_kl_k2: objective.kl_k2,
    nb10.check_sanitize_logits: steps.sanitize_logits,
    nb10.check_completion_mask_from_ids: completion_mask_from_ids,
}


def _no_eps(rewards, group_size, advantage_eps=1e-4, scale_rewards=True):
    g = rewards.view(-1, group_size)
    c = g - g.mean(1, keepdim=True)
    return (c / g.std(1, keepdim=True) if scale_rewards else c).reshape(-1)


def _batch_mean(rewards, group_size, advantage_eps=1e-4, scale_rewards=True):
    g = rewards.view(-1, group_size)
    c = g - rewards.mean()
    return (c / (g.std(1, keepdim=True) + advantage_eps) if scale_rewards else c).reshape(-1)


def _kl_wrong_sign(logp, ref_logp):
    return objective.kl_k3(ref_logp, logp)


def _raw_logits(logits, ids):
    return logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def _cumsum_positions(mask):
    return mask.long().cumsum(-1)


def _per_micro_batch_bnpo(mask, loss_type, max_completion_length):
    return mask.float() / mask.sum(-1, keepdim=True).clamp(min=1)


def _no_strip(completions, answer, **kwargs):
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def _first_spike(history):
    return next((m["step"] for m in history if m.get("grad_norm", 0) > 1e3
                 or m.get("grad_norm", 0) != m.get("grad_norm", 0)), None)


def _nan_only(model):
    return sum(int(p.isnan().sum()) for p in model.parameters())


def _floor_chunks(n_rows, k):  # report 004: n // k rows per chunk
    size = n_rows // k
    return [slice(i * size, (i + 1) * size) for i in range(k)]


def _reverse_kl(logits, ref_logits):
    return objective.exact_kl(ref_logits, logits)


def _k2_no_half(logp, ref_logp):
    return (ref_logp - logp) ** 2


def _nan_to_zero(logits):
    return torch.nan_to_num(logits, nan=0.0)


def _mask_without_eos(ids, eos):
    return ((ids == eos).long().cumsum(-1) == 0).long()


def _region_with_bounds(logp, old_logp, advantages, eps_low=0.2, eps_high=0.2,
                       log_ratio_clamp=None):
    """clipped_surrogate with <= and >= in the clip region: a ratio on the bound counts."""
    per_token, _ = objective.clipped_surrogate(logp, old_logp, advantages, eps_low, eps_high,
                                               log_ratio_clamp)
    r = objective.ratio_from_logprobs(logp, old_logp, log_ratio_clamp)
    a = advantages.unsqueeze(-1)
    return per_token, ((r <= 1 - eps_low) & (a < 0)) | ((r >= 1 + eps_high) & (a > 0))


def _eps_low_only(logp, old_logp, advantages, eps_low=0.2, eps_high=0.2, log_ratio_clamp=None):
    """clipped_surrogate with the upper bound at 1 + eps_low: eps_high ignored."""
    return objective.clipped_surrogate(logp, old_logp, advantages, eps_low, eps_low,
                                       log_ratio_clamp)


def _region_sign_blind(logp, old_logp, advantages, eps_low=0.2, eps_high=0.2,
                       log_ratio_clamp=None):
    """region_clipped marking every ratio outside the range, whatever A's sign."""
    per_token, _ = objective.clipped_surrogate(logp, old_logp, advantages, eps_low, eps_high,
                                               log_ratio_clamp)
    r = objective.ratio_from_logprobs(logp, old_logp, log_ratio_clamp)
    return per_token, (r < 1 - eps_low) | (r > 1 + eps_high)


def _population_std(rewards, group_size, advantage_eps=1e-4, scale_rewards=True):
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_rewards:
        centred = centred / (grouped.std(dim=1, correction=0, keepdim=True) + advantage_eps)
    return centred.reshape(-1)


def _grpo_weights_over_all_positions(mask, loss_type, cap):
    if loss_type == "grpo":
        return mask.float() / mask.numel()
    return objective.token_weights(mask, loss_type, cap)


def _grpo_weights_nan_on_empty_rows(mask, loss_type, cap):
    if loss_type == "grpo":
        return mask.float() / mask.sum(-1, keepdim=True) / mask.shape[0]
    return objective.token_weights(mask, loss_type, cap)


def _sampler_without_early_stop(model, ids, mask, n, temperature, eos, pad):
    out = steps.sample_tokens(model, ids, mask, n, temperature, eos, pad)
    return torch.cat([out, torch.full((out.shape[0], n - out.shape[1]), pad)], 1)


BUGS = [
    (nb02.check_group_advantages, _no_eps, "NaN when every reward in a group is equal"),
    (nb02.check_group_advantages, _batch_mean, "group's own mean"),
    (nb03.check_clipped_surrogate, naive.constant_clip_surrogate, "clip_ratio * advantage"),
    (nb03.check_clipped_surrogate, _region_with_bounds, "use < and >, not <= and >="),
    (nb03.check_clipped_surrogate, _eps_low_only, "the upper clip bound ignores eps_high"),
    (nb03.check_clipped_surrogate, _region_sign_blind, "whatever the sign of A"),
    (nb02.check_group_advantages, _population_std, "population std"),
    (nb03.check_token_weights, _grpo_weights_over_all_positions, "B x C"),
    (nb03.check_token_weights, _grpo_weights_nan_on_empty_rows, "NaN or inf on row(s) [3]"),
    (nb01.check_sample_tokens, _sampler_without_early_stop, "every row had ended after"),
    (nb03.check_kl_k3, _kl_wrong_sign, "wrong sign"),
    (nb03.check_kl_k3, naive.report003_kl, "report 003"),
    (nb01.check_token_logprobs, _raw_logits, "log_softmax"),
    (nb01.check_position_ids_from_mask, _cumsum_positions, "position 0"),
    (nb03.check_token_weights, _per_micro_batch_bnpo, "weights"),
    (nb04.check_addition_reward, _no_strip, "spaces"),
    (nb05.check_first_nonfinite_step, _first_spike, "spike"),
    (nb07.check_nonfinite_params, _nan_only, "inf"),
    (nb08.check_micro_batch_slices, _floor_chunks, "once each"),
    (nb09.check_exact_kl, _reverse_kl, "KL(q || p)"),
    (nb09.check_kl_k2, _k2_no_half, "twice k2"),
    (nb09.check_kl_k2, objective.kl_k3, "yours is k3"),
    (nb10.check_completion_mask_from_ids,
     lambda ids, eos: ((ids == eos).long().cumsum(-1) - (ids == eos).long() <= 1).long(),
     "comes after the row's first end token (position 2) and yours keeps it"),
    (nb10.check_completion_mask_from_ids,
     lambda ids, eos: (ids == eos).long().cumsum(-1).eq(0).long(), "your mask drops the first EOS"),
    (nb10.check_completion_mask_from_ids, lambda ids, eos: (ids >= 0).bool(),
     "dtype torch.bool"),
    (nb09.check_exact_kl, lambda a, b: (a.log_softmax(-1) - b.log_softmax(-1)).sum(-1),
     "without the weights p_v"),
    (nb09.check_exact_kl, lambda a, b: (a.softmax(-1) * (a.log_softmax(-1)
                                                         - b.log_softmax(-1))).mean(-1),
     "averaged over the vocabulary"),
    (nb09.check_exact_kl, lambda a, b: (a.softmax(-1) * (a - b)).sum(-1),
     "raw logits are used as log-probabilities"),
    (nb09.check_kl_k2, lambda logp, ref_logp: 0.5 * (ref_logp - logp).abs(),
     "so log r = ref_logp - logp ="),
    (nb10.check_sanitize_logits, _nan_to_zero, "NaN"),
    (nb10.check_completion_mask_from_ids, _mask_without_eos, "drops the first EOS"),
]


def test_a_crashing_exercise_fails_with_the_exception_named():
    def crashes(rewards, group_size, **kw):
        return rewards.view(group_size, -1, 3)

    result = nb02.check_group_advantages(crashes)
    assert result.status == "failed" and "raised RuntimeError" in result.reason


@pytest.mark.parametrize("change, words", [
    (lambda w: torch.cat([w[:, :1] * 0 - 3, w[:, :-1]], 1), "shifted right by one position"),
    (lambda w: w + torch.arange(4.0)[:, None] + 1, "off by a constant of its own"),
    (lambda w: w * torch.tensor([[2.0], [1.0], [3.0], [1.0]]), "off by a factor of its own"),
    (lambda w: torch.where(torch.arange(4)[:, None] == 2, w.flip(1), w), "only row 2 of 4"),
    (lambda w: w + (torch.arange(6) == 0).float(), "only column 0 of 6"),
])
def test_a_result_that_matches_no_known_mistake_is_located_in_words(change, words):
    """Issue 31: never only "n of m entries differ": which rows or columns, or the pattern."""
    want = torch.linspace(-2.0, 1.7, 24).view(4, 6)
    message = difference(change(want), want)
    assert words in message, message


def test_a_whole_update_that_differs_is_described_by_its_direction_and_size():
    want = torch.randn(20_000, generator=torch.Generator().manual_seed(0))
    other = torch.randn(20_000, generator=torch.Generator().manual_seed(1))
    for got, words in [(torch.zeros_like(want), "did not change the parameters"),
                       (want * 1.5, "points the same way but is 1.5000 x the size"),
                       (-want, "opposite"),
                       (want + 0.3 * other, "points another way (cosine 0.96"),
                       (want + 0.002 * other, "close to the expected update (cosine 1.00000")]:
        message = difference(got, want)
        assert words in message, message


def test_wrong_shape_is_named():
    result = nb03.check_kl_k3(lambda logp, ref_logp: (logp - ref_logp).sum())
    assert result.status == "failed" and "shape" in result.reason


# --- notebook 06: gradient clipping and the skip rule ----------------------------------------
def _torch_clip(grads, max_norm):
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return [p.grad for p in params], norm


def _global_norm(grads):
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))


def _clip_each_tensor(grads, max_norm):
    return [g * min(1.0, max_norm / (float(g.norm()) + 1e-6)) for g in grads], _global_norm(grads)


def _clip_values(grads, max_norm):  # clip_grad_value_
    return [g.clamp(-max_norm, max_norm) for g in grads], _global_norm(grads)


def _norm_after_clipping(grads, max_norm):
    clipped, _ = steps.clip_grad_norm(grads, max_norm)
    return clipped, _global_norm(clipped)


def _always_rescale(grads, max_norm):
    norm = _global_norm(grads)
    return [g * max_norm / norm for g in grads], norm


def _report_000_rule(grad_norm, recent, factor):  # `if grad_norm > 10: skip`
    return grad_norm > 10


def _absolute_rule_with_nan_check(grad_norm, recent, factor):
    return not math.isfinite(grad_norm) or grad_norm > 10


def _spike_rule_without_nan_check(grad_norm, recent, factor):
    return len(recent) >= 5 and grad_norm > factor * statistics.median(recent)


def _mean_not_median(grad_norm, recent, factor):
    return not math.isfinite(grad_norm) or (
        len(recent) >= 5 and grad_norm > factor * statistics.mean(recent))


def _no_minimum_history(grad_norm, recent, factor):
    return not math.isfinite(grad_norm) or grad_norm > factor * statistics.median(recent)


REFERENCES.update({
    nb06.check_clip_grad_norm: steps.clip_grad_norm,
    nb06.check_should_skip: steps.should_skip,
})
BUGS += [
    (nb06.check_clip_grad_norm, _clip_each_tensor, "each tensor to max_norm on its own"),
    (nb06.check_clip_grad_norm, _clip_values, "clip_grad_value_"),
    (nb06.check_clip_grad_norm, _norm_after_clipping, "norm after clipping"),
    (nb06.check_clip_grad_norm, _always_rescale, "must come back unchanged"),
    (nb06.check_should_skip, _report_000_rule, "math.isfinite"),
    (nb06.check_should_skip, _spike_rule_without_nan_check, "NaN > x is False"),
    (nb06.check_should_skip, _absolute_rule_with_nan_check, "model's scale"),
    (nb06.check_should_skip, _mean_not_median, "use the median"),
    (nb06.check_should_skip, _no_minimum_history, "no baseline"),
]


def test_clip_reference_is_torchs_clip_grad_norm():
    """The checker's reference scales like torch.nn.utils.clip_grad_norm_ (which the trainer
    calls), a NaN gradient included: clipping spreads the NaN to every tensor."""
    assert nb06.check_clip_grad_norm(_torch_clip).passed
    grads = [torch.tensor([3.0, float("nan")]), torch.tensor([1.0, 2.0])]
    ours, our_norm = steps.clip_grad_norm(grads, 1.0)
    theirs, their_norm = _torch_clip(grads, 1.0)
    assert math.isnan(our_norm) and math.isnan(float(their_norm))
    assert all(torch.isnan(g).all() for g in ours + theirs)


def test_skip_reference_agrees_with_the_trainer():
    """steps.should_skip is the rule step.guarded_update applies with skip_nonfinite_grad
    and spike_skip_factor: a 1e4x loss spike after 6 steps is skipped, ordinary steps not."""
    from grpo_lab.config import preset
    from grpo_lab.trainer import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(preset("stable", steps=8, prompts_per_step=2, group_size=4, eval_size=4,
                             spike_skip_factor=20.0))
    decisions = []
    for step in range(1, 9):
        recent = list(trainer.recent_grad_norms)
        batch = trainer.make_batch()
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.backward(batch)
        if step == 7:
            for p in trainer.policy.parameters():
                if p.grad is not None:
                    p.grad.mul_(1e4)
        skipped = trainer._update()
        decisions.append((bool(skipped), steps.should_skip(
            trainer.last_grad_norm, recent, trainer.cfg.spike_skip_factor)))
        trainer.step_count += 1
    assert [ours for ours, _ in decisions] == [s == 7 for s in range(1, 9)], decisions
    assert all(ours == ref for ours, ref in decisions), decisions


# --- 11: accumulation_for_budget -----------------------------------------------------------
def _floor_division(rows, per_row, budget):  # rows // k rows per micro-batch: ignores the rest
    if per_row > budget:
        raise ValueError("one row does not fit")
    return next(k for k in range(1, rows + 1) if rows // k * per_row <= budget)


def _strict(rows, per_row, budget):  # < instead of <=: an exact fit is refused
    if per_row >= budget:
        raise ValueError("one row does not fit")
    return next(k for k in range(1, rows + 1) if math.ceil(rows / k) * per_row < budget)


def _never_refuses(rows, per_row, budget):  # returns rows even when one row cannot fit
    return next((k for k in range(1, rows + 1) if math.ceil(rows / k) * per_row <= budget), rows)


def _first_divisor(rows, per_row, budget):  # only splits into equal micro-batches
    if per_row > budget:
        raise ValueError("one row does not fit")
    return next(k for k in range(1, rows + 1) if rows % k == 0 and rows // k * per_row <= budget)


REFERENCES[nb11.check_accumulation_for_budget] = nb11.reference_accumulation_for_budget
BUGS += [
    (nb11.check_accumulation_for_budget, _floor_division, "rows that do not divide evenly"),
    (nb11.check_accumulation_for_budget, _strict, "an exact fit at the boundary"),
    (nb11.check_accumulation_for_budget, _never_refuses, "one row too big"),
    (nb11.check_accumulation_for_budget, _first_divisor, "the smallest k, not the first divisor"),
]


def test_accumulation_for_budget_reference_matches_the_trainers_micro_batches():
    """The largest of the trainer's k micro-batches has ceil(rows / k) rows, which is what the
    reference assumes."""
    from grpo_lab.trainer import micro_batch_slices

    assert nb11.check_accumulation_for_budget(nb11.reference_accumulation_for_budget).passed
    for rows in (7, 10, 64, 100):
        for k in range(1, rows + 1):
            biggest = max(s.stop - s.start for s in micro_batch_slices(rows, k))
            assert biggest == math.ceil(rows / k)


# --- 12: shard_rows ------------------------------------------------------------------------
def _strided(prompts, group_size, rank, world_size):  # every world_size-th row: splits groups
    if prompts % world_size:
        raise ValueError("uneven")
    return range(rank, prompts * group_size, world_size)


def _rows_split(prompts, group_size, rank, world_size):  # splits rows, not prompts
    per_rank = prompts * group_size // world_size
    return range(rank * per_rank, (rank + 1) * per_rank)


def _prompts_not_rows(prompts, group_size, rank, world_size):  # prompt indices, not rows
    if prompts % world_size:
        raise ValueError("uneven")
    per_rank = prompts // world_size
    return range(rank * per_rank, (rank + 1) * per_rank)


REFERENCES[nb12.check_shard_rows] = nb12.reference_shard_rows
BUGS += [
    (nb12.check_shard_rows, _strided, "two ranks, contiguous groups"),
    (nb12.check_shard_rows, _rows_split, "prompts that do not divide evenly"),
    (nb12.check_shard_rows, _prompts_not_rows, "one process gets every row"),
]


def test_shard_rows_reference_is_the_trainers_sharding():
    """The trainer shards prompts with distributed.shard and samples G rows per prompt, so its
    rank's rows are exactly the reference's."""
    from grpo_lab.distributed import World, shard

    assert nb12.check_shard_rows(nb12.reference_shard_rows).passed
    for prompts, group, world in ((8, 8, 2), (12, 4, 3), (4, 2, 4)):
        covered = []
        for rank in range(world):
            mine = shard(prompts, World(rank=rank, world_size=world))
            rows = nb12.reference_shard_rows(prompts, group, rank, world)
            assert list(rows) == [p * group + g for p in range(mine.start, mine.stop)
                                  for g in range(group)]
            covered += list(rows)
        assert covered == list(range(prompts * group))  # every row once, in order


# --- every checker: its reference passes, a stub is "not implemented", each bug is named ----
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


@pytest.mark.parametrize("check,buggy,needle", BUGS, ids=lambda x: getattr(x, "__name__", "x"))
def test_field_bugs_fail_with_a_reason(check, buggy, needle):
    result = check(buggy)
    assert result.status == "failed"
    assert needle in result.reason, result.reason
    assert result.use() is REFERENCES[check]


def _first_bad_row_index(history):
    return next((i for i, m in enumerate(history) if m.get("nonfinite_params", 0) > 0), None)


def _last_bad_step(history):
    return max((m["step"] for m in history if m.get("nonfinite_params", 0) > 0), default=None)


def test_accumulated_step_whose_loss_metric_is_the_mean_of_the_parts_is_named():
    from grpo_lab.course import hardening

    def averaged(run, problems, loss_fn, update_fn, *args, **kwargs):
        metrics = hardening.accumulated_grpo_step(run, problems, loss_fn, update_fn, *args,
                                                  **kwargs)
        return {**metrics, "loss": metrics["loss"] / run.cfg.grad_accum_steps}

    result = nb08.check_accumulated_grpo_step(averaged)
    assert not result.passed and "divided by k = 3" in result.reason, result.reason
    assert "sum them, do not average them" in result.reason


def _expected_gradient_summed_without_p(estimator, logits, ref_logits):
    theta = logits.detach().clone().requires_grad_(True)
    logp, logq = theta.log_softmax(-1), ref_logits.log_softmax(-1)
    return torch.autograd.grad(estimator(logp, logq).sum(), theta)[0]


def _expected_gradient_arguments_swapped(estimator, logits, ref_logits):
    theta = logits.detach().clone().requires_grad_(True)
    logp, logq = theta.log_softmax(-1), ref_logits.log_softmax(-1)
    return torch.autograd.grad((logp.exp().detach() * estimator(logq, logp)).sum(), theta)[0]


def _k3_without_the_minus_one(logp, old_logp, ref_logp, advantages, weights, cfg):
    loss, stats = steps.grpo_loss(logp, old_logp, ref_logp, advantages, weights, cfg)
    return loss + cfg.beta * weights.sum(), stats  # exp(x) - x per token, not exp(x) - x - 1


def _max_for_min(logp, old_logp, ref_logp, advantages, weights, cfg):
    _, stats = steps.grpo_loss(logp, old_logp, ref_logp, advantages, weights, cfg)
    ratio, adv = (logp - old_logp).exp(), advantages.detach()[:, None]
    clipped = ratio.clamp(1 - cfg.epsilon_low, 1 + cfg.epsilon_high) * adv
    per_token = -torch.max(ratio * adv, clipped) + cfg.beta * objective.kl_k3(logp, ref_logp)
    return (per_token * weights).sum(), stats


def _clamp_ignored(logp, old_logp, ref_logp, advantages, weights, cfg):
    unclamped = copy.copy(cfg)
    unclamped.log_ratio_clamp = None
    return steps.grpo_loss(logp, old_logp, ref_logp, advantages, weights, unclamped)


def _kl_gradients_p_detached(logits, ref_logits):
    lp, lq = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    (reverse,) = torch.autograd.grad((lp.exp().detach() * (lp - lq)).sum(), logits,
                                     retain_graph=True)
    (forward,) = torch.autograd.grad((lq.exp() * (lq - lp)).sum(), logits)
    return reverse, forward


def _neg_inf_made_finite(logits):
    out = torch.nan_to_num(logits, nan=-math.inf, posinf=torch.finfo(logits.dtype).max)
    if (~torch.isfinite(out)).all(-1).any():
        raise ValueError("a row with nothing finite")
    return out


def _safe_sample_at_one(model, tokenizer, prompts, group_size, max_new_tokens,
                        temperature=1.0, top_k=0, top_p=1.0):
    return steps.safe_sample(model, tokenizer, prompts, group_size, max_new_tokens)


def _beta_by_difference(beta, kl, target_kl, horizon, n_steps=1):
    return beta * (1 + min(max(kl - target_kl, -0.2), 0.2) * n_steps / horizon)


def _beta_horizon_inverted(beta, kl, target_kl, horizon, n_steps=1):
    return beta * (1 + min(max(kl / target_kl - 1, -0.2), 0.2) * horizon / n_steps)


def _slices_extra_rows_last(n_rows, k):
    if not 1 <= k <= n_rows:
        raise ValueError("a micro-batch would be empty")
    size = n_rows // k
    return [slice(i * size, (i + 1) * size if i < k - 1 else n_rows) for i in range(k)]


def _safe_sample_prompt_ids_only(model, tokenizer, prompts, group_size, max_new_tokens,
                                 temperature=1.0, top_k=0, top_p=1.0):
    from grpo_lab.sampling import encode_prompts, sample_group

    ids, _ = encode_prompts(tokenizer, prompts, torch.device("cpu"))
    rows = model.get_input_embeddings().num_embeddings
    if int(ids.max()) >= rows:
        raise ValueError(f"prompt token id {int(ids.max())} has no row ({rows} rows)")
    return sample_group(model, tokenizer, prompts, group_size, max_new_tokens, temperature,
                        top_k, top_p, sanitize=steps.sanitize_logits)


def _sanitize_refusing_nan_rows_only(logits):
    if torch.isnan(logits).all(-1).any():
        raise ValueError("a row of NaN")
    return torch.nan_to_num(logits, nan=-math.inf, posinf=torch.finfo(logits.dtype).max,
                            neginf=-math.inf)


def _filter_with_a_std_tolerance(rewards, group_size):
    import warnings

    with warnings.catch_warnings():  # torch warns of the std of a group of one (G = 1)
        warnings.simplefilter("ignore", UserWarning)
        return (rewards.view(-1, group_size).std(1) > 1e-6).repeat_interleave(group_size)


def _logprobs_cast_after(logits, token_ids):
    return logits.log_softmax(-1).gather(-1, token_ids.unsqueeze(-1)).squeeze(-1).float()


def _advantages_down_the_columns(rewards, group_size, advantage_eps=1e-4, scale_rewards=True):
    grouped = rewards.view(group_size, -1)
    centred = grouped - grouped.mean(0, keepdim=True)
    if scale_rewards:
        centred = centred / (grouped.std(0, keepdim=True) + advantage_eps)
    return centred.reshape(-1)


def _sampler_stopping_at_the_first_eos(model, ids, mask, n, temperature, eos, pad):
    out = steps.sample_tokens(model, ids, mask, n, temperature, eos, pad)
    first = int((out == eos).any(0).long().argmax()) if bool((out == eos).any()) else n - 1
    return out[:, :first + 1]


def _region_with_zero_advantages(logp, old_logp, advantages, epsilon_low=0.2,
                                 epsilon_high=0.2, log_ratio_clamp=None):
    loss, _ = objective.clipped_surrogate(logp, old_logp, advantages, epsilon_low,
                                          epsilon_high, log_ratio_clamp)
    r, a = (logp - old_logp).exp(), advantages[:, None]
    return loss, ((r < 1 - epsilon_low) & (a <= 0)) | ((r > 1 + epsilon_high) & (a >= 0))


def _skip_with_a_median_of(median):
    """should_skip with `median` (a function of the recent norms) for statistics.median."""
    def should_skip(grad_norm, recent, factor):
        if not math.isfinite(grad_norm):
            return True
        if factor is None or len(recent) < 5:
            return False
        return grad_norm > factor * median(list(recent))
    return should_skip


_skip_with_torch_median = _skip_with_a_median_of(lambda xs: torch.tensor(xs).median().item())
_skip_with_the_upper_middle = _skip_with_a_median_of(lambda xs: sorted(xs)[len(xs) // 2])


def _count_in_state_dict(model):
    return int(sum((~torch.isfinite(v)).sum() for v in model.state_dict().values()
                   if v.is_floating_point()))


def _guarded_with_a_new_window(run):
    from collections import deque

    saved = run.recent_grad_norms
    run.recent_grad_norms = deque(saved)  # the same norms, no maxlen
    return steps.guarded_update(run)


def _healthy_unless_skipped(run, update_fn=steps.apply_update):
    from grpo_lab.course import hardening

    grad_norm, skipped = update_fn(run)
    run.rolled_back = 0 if skipped else hardening.health_check(run)
    return grad_norm, skipped


def _accumulated_with(metric):
    """hardening.accumulated_grpo_step whose metrics[key] is `metric` of its parts' (loss,
    kl) pairs."""
    from grpo_lab.course import hardening

    key, combine = metric

    def step(run, problems, loss_fn, update_fn, *args, **kwargs):
        parts = []

        def recording(*loss_args):
            loss, stats = loss_fn(*loss_args)
            parts.append({"loss": loss.item(), "kl": stats["kl"]})
            return loss, stats

        metrics = hardening.accumulated_grpo_step(run, problems, recording, update_fn, *args,
                                                  **kwargs)
        return {**metrics, key: combine([p[key] for p in parts])}
    return step


@pytest.mark.parametrize("check, wrong, words", [
    (nb04.check_grpo_loss, _k3_without_the_minus_one, "its gradient is right everywhere"),
    (nb04.check_grpo_loss, _max_for_min, "ratio lies outside the clip range [0.8, 1.2]"),
    (nb04.check_grpo_loss, _clamp_ignored, "|log-ratio| is above log_ratio_clamp = 2"),
    (nb09.check_kl_gradients, _kl_gradients_p_detached, "yours is about 0 everywhere"),
    (nb10.check_sanitize_logits, _neg_inf_made_finite,
     "where the expected value is -inf (1 of them, the first at [0, 1]), yours is -3.40282e+38"),
    (nb08.check_micro_batch_slices, _slices_extra_rows_last,
     "your sizes are [5, 5, 6], expected [6, 5, 5]: the 1 extra row(s) go to the first"),
    (nb10.check_safe_sample, _safe_sample_prompt_ids_only,
     "check tokenizer.pad_token_id itself"),
    (nb10.check_sanitize_logits, _sanitize_refusing_nan_rows_only,
     "refuse every row where no entry is finite, not only rows of NaN"),
    (nb02.check_zero_std_group_filter, _filter_with_a_std_tolerance,
     "compare the values themselves (max == min)"),
    (nb01.check_token_logprobs, _logprobs_cast_after, "cast the logits to float32 first"),
    (nb02.check_group_advantages, _advantages_down_the_columns,
     "your groups are groups of every B/G-th reward"),
    (nb01.check_sample_tokens, _sampler_stopping_at_the_first_eos,
     "not until one is (`done.any()`)"),
    (nb03.check_clipped_surrogate, _region_with_zero_advantages,
     "region_clipped marks tokens whose advantage is 0"),
    (nb06.check_should_skip, _skip_with_torch_median, "the median of 1..6 is 3.5"),
    (nb06.check_should_skip, _skip_with_the_upper_middle, "the upper middle value"),
    (nb07.check_nonfinite_params, _count_in_state_dict, "counted twice"),
    (nb06.check_guarded_update, _guarded_with_a_new_window,
     "is no longer a window of the last 20 norms"),
    (nb07.check_healthy_update, _healthy_unless_skipped,
     "step 2's update skipped, then a NaN weight at step 3"),
    (nb09.check_adaptive_beta, _beta_by_difference, "the error is a proportion"),
    (nb09.check_adaptive_beta, _beta_horizon_inverted, "yours multiplies by horizon / n_steps"),
    (nb10.check_safe_sample, _safe_sample_at_one, "your draws are sample_group's at "
     "temperature 1.0"),
    (nb08.check_accumulated_grpo_step, _accumulated_with(("loss", lambda xs: xs[-1])),
     "the last micro-batch's part only"),
    (nb08.check_accumulated_grpo_step,
     _accumulated_with(("kl", lambda xs: sum(xs) / len(xs))),
     "the plain mean of the micro-batches' values"),
    (nb05.check_first_nonfinite_step, _first_bad_row_index,
     "the row's position in the list, not its 'step'"),
    (nb05.check_first_nonfinite_step, _last_bad_step,
     "the last step with non-finite parameters; the first one is asked"),
    (nb09.check_estimator_expected_gradient, _expected_gradient_summed_without_p,
     "every token counted alike"),
    (nb09.check_estimator_expected_gradient, _expected_gradient_arguments_swapped,
     "its arguments the other way round"),
])
def test_a_wrong_answer_is_said_in_words(check, wrong, words):
    result = check(wrong)
    assert not result.passed and words in result.reason, result.reason
