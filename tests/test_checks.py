"""Exercise checkers: the reference passes, field bugs fail with a reason a learner can act
on, an unwritten exercise reports 'not implemented yet' and hands back the reference."""

import pytest
import torch

from grpo_lab import bugs, checks, objective
from grpo_lab.models import count_parameters
from grpo_lab.sampling import completion_mask_from_ids
from grpo_lab.tasks import addition_reward
from grpo_lab.trainer import micro_batches

REFERENCES = {
    checks.check_count_parameters: count_parameters,
    checks.check_position_ids_from_mask: objective.position_ids_from_mask,
    checks.check_token_logprobs: objective.token_logprobs,
    checks.check_group_advantages: objective.group_advantages,
    checks.check_kl_k3: objective.kl_k3,
    checks.check_clipped_surrogate: objective.clipped_surrogate,
    checks.check_token_weights: objective.token_weights,
    checks.check_addition_reward: addition_reward,
    checks.check_first_nonfinite_step: checks.reference_first_nonfinite_step,
    checks.check_nonfinite_params: __import__("grpo_lab.health").health.nonfinite_params,
    checks.check_micro_batch_slices: micro_batches,
    checks.check_exact_kl: objective.exact_kl,
    checks.check_kl_k2: objective.kl_k2,
    checks.check_sanitize_logits: checks.reference_sanitize_logits,
    checks.check_completion_mask_from_ids: completion_mask_from_ids,
}


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


def _kl_report_003(logp, ref_logp):
    return (ref_logp - logp).clamp(-10, 10).clamp(0, 10)


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


BUGS = [
    (checks.check_group_advantages, _no_eps, "NaN when every reward in a group is equal"),
    (checks.check_group_advantages, _batch_mean, "group's own mean"),
    (checks.check_clipped_surrogate, bugs.constant_clip_surrogate, "clip_ratio * advantage"),
    (checks.check_kl_k3, _kl_wrong_sign, "wrong sign"),
    (checks.check_kl_k3, _kl_report_003, "report 003"),
    (checks.check_token_logprobs, _raw_logits, "log_softmax"),
    (checks.check_position_ids_from_mask, _cumsum_positions, "position 0"),
    (checks.check_token_weights, _per_micro_batch_bnpo, "weights"),
    (checks.check_addition_reward, _no_strip, "spaces"),
    (checks.check_first_nonfinite_step, _first_spike, "spike"),
    (checks.check_nonfinite_params, _nan_only, "inf"),
    (checks.check_micro_batch_slices, _floor_chunks, "once each"),
    (checks.check_exact_kl, _reverse_kl, "KL(q || p)"),
    (checks.check_kl_k2, _k2_no_half, "twice k2"),
    (checks.check_sanitize_logits, _nan_to_zero, "NaN"),
    (checks.check_completion_mask_from_ids, _mask_without_eos, "drops the first EOS"),
]


@pytest.mark.parametrize("check,buggy,needle", BUGS, ids=lambda x: getattr(x, "__name__", "x"))
def test_field_bugs_fail_with_a_reason(check, buggy, needle):
    result = check(buggy)
    assert result.status == "failed"
    assert needle in result.reason, result.reason
    assert result.use() is REFERENCES[check]


def test_a_crashing_exercise_fails_with_the_exception_named():
    def crashes(rewards, group_size, **kw):
        return rewards.view(group_size, -1, 3)

    result = checks.check_group_advantages(crashes)
    assert result.status == "failed" and "raised RuntimeError" in result.reason


def test_wrong_shape_is_named():
    result = checks.check_kl_k3(lambda logp, ref_logp: (logp - ref_logp).sum())
    assert result.status == "failed" and "shape" in result.reason
