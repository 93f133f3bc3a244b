"""pi_old is the policy that sampled: at the first pass of an update the ratio is exactly 1,
under every config switch, and the sampler draws from the distribution being optimised."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo_lab.config import GRPOConfig
from grpo_lab.numerics import float64_logprobs, logprob_allowance
from grpo_lab.step import autocast
from grpo_lab.trainer import Trainer

pytestmark = pytest.mark.numerics  # .ci/kernels runs this file under other CPU kernels

SMALL = dict(prompts_per_step=2, group_size=4, max_new_tokens=5, eval_every=0, eval_size=1,
             steps=1)

# one non-default value for every config field (the test below fails when a field is added
# without one), each run alone on top of the defaults
SWITCHES = {
    "seed": 3, "steps": 2, "profile": "cpu", "model_path": None, "device": "cpu",
    "prompts_per_step": 3, "group_size": 3, "max_new_tokens": 7, "temperature": 0.7,
    "top_k": 5, "top_p": 0.8, "learning_rate": 1e-3, "weight_decay": 0.1, "beta": 0.0,
    "epsilon_low": 0.1, "epsilon_high": 0.28, "loss_type": "dr_grpo", "scale_rewards": False,
    "advantage_eps": 1e-2, "num_iterations": 2, "grad_accum_steps": 3, "amp": "bf16",
    "mask_truncated_completions": True, "gradient_checkpointing": True,
    "ratio_against": "old", "ratio_level": "sequence", "clip_term": "constant",
    "logit_clamp": 5.0, "log_ratio_clamp": 0.5, "advantage_clamp": 0.5, "max_grad_norm": 0.1,
    "skip_nonfinite_grad": True, "spike_skip_factor": 2.0, "health_check": True,
    "snapshot_every": 1, "check_rewards": True, "reward_timeout": 30.0, "safe_sampling": True,
    "eval_every": 0, "eval_size": 1, "checkpoint_every": 1, "extra": {"note": "x"},
}
CASES = [(name, {name: value}) for name, value in SWITCHES.items()] + [
    ("fp16", {"amp": "fp16"}),
    ("T=0.7 and logit_clamp=10", {"temperature": 0.7, "logit_clamp": 10.0}),
    ("logit_clamp=5, top-k and top-p", {"logit_clamp": 5.0, "top_k": 4, "top_p": 0.9}),
    ("bnpo", {"loss_type": "bnpo"}), ("dapo", {"loss_type": "dapo"}),
    ("stable preset", {"log_ratio_clamp": 10.0, "max_grad_norm": 1.0, "beta": 0.01,
                       "skip_nonfinite_grad": True, "spike_skip_factor": 20.0,
                       "health_check": True, "safe_sampling": True, "check_rewards": True}),
]


def test_every_config_field_has_a_switch():
    assert set(SWITCHES) == {f.name for f in dataclasses.fields(GRPOConfig)}


@pytest.mark.parametrize("name,change", CASES, ids=[c[0] for c in CASES])
def test_first_pass_ratio_is_exactly_one(tiny, name, change):
    model, tok = tiny
    cfg = GRPOConfig(**{**SMALL, **change})
    trainer = Trainer(cfg, model, tok)
    batch = trainer.make_batch()
    trainer.optimizer.zero_grad(set_to_none=True)
    stats = trainer.backward(batch)  # the first pass: pi_old is taken here
    assert stats["log_ratio/max_abs"].item() == 0.0, name
    if cfg.clip_term == "clipped_ratio":  # report 001's constant term "clips" at r = 1
        assert stats["clip_ratio/region_mean"].item() == 0, name
    m = batch.rollout.completion_mask.bool()
    # pi_old on the training path against the sampler's own log-probs: the same
    # distribution, up to float rounding. In float32 two computations of one log-prob
    # (|logp| < 20; float32 keeps 7 digits, a 2-layer forward loses a few) differ by far
    # less than 1e-4. Under autocast the training forward's logits are rounded to bf16/fp16:
    # log_softmax moves each log-prob by at most twice the largest change of a logit
    # (|d log softmax_i| <= |dz_i| + max_j |dz_j|), so the bound is twice the largest
    # difference between this forward's logits with and without autocast, measured here on
    # the batch's own completion tokens, plus the float32 1e-4
    tol = 1e-4
    if cfg.amp != "none":
        r = batch.rollout
        args = (r.input_ids, r.attention_mask, r.completion_length, cfg.temperature,
                cfg.logit_clamp)
        with torch.no_grad():
            z32 = trainer.model(*args).float()
            with autocast(trainer.run):
                z_amp = trainer.model(*args).float()
        tol += 2 * (z_amp - z32)[m].abs().max().item()
    diff = (batch.old_logp - batch.rollout.sampling_logprobs)[m].abs().max().item()
    assert diff < tol, (name, diff, tol)
    if cfg.num_iterations > 1:  # the second pass compares with the first pass's pi_old
        trainer._update()
        trainer.optimizer.zero_grad(set_to_none=True)
        assert trainer.backward(batch)["log_ratio/max_abs"].item() > 0, name


def test_the_sampler_draws_from_the_clamped_distribution(tiny):
    """With logit_clamp the trainer optimises softmax(clamp(logits / T)); the sampler must
    draw from that same distribution, or pi_old is not the sampling policy. Before it did,
    logit_clamp=5 put the sampler's log-probs up to 1.37 away from the training path's."""
    model, tok = tiny
    trainer = Trainer(GRPOConfig(**SMALL, logit_clamp=5.0, temperature=0.7), model, tok)
    batch = trainer.make_batch()
    trainer.backward(batch)
    r = batch.rollout
    # pi_old as training computes it is the sampler's, to float32 rounding: as close to the
    # float64 log-probs of the clamped distribution as the sampler's own
    truth = float64_logprobs(trainer.policy, r.input_ids, r.attention_mask, r.completion_length,
                             0.7, 5.0)
    allowed = logprob_allowance(r.sampling_logprobs, truth, r.completion_mask)
    m = r.completion_mask.bool()
    assert (batch.old_logp.double() - truth)[m].abs().max() <= allowed
    # the clamp binds here: the unclamped distribution is measurably another one
    unclamped = torch.log_softmax(
        model(batch.rollout.input_ids).logits[:, -6:-1].float() / 0.7, -1)
    ids = batch.rollout.completion_ids
    plain = unclamped.gather(-1, ids[..., None]).squeeze(-1)
    assert (plain - batch.old_logp)[m].abs().max() > 0.1
