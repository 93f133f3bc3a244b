"""Notebook 04, the training loop: the checks of its exercises, and each exercise as
data in `EXERCISES`."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch

from ... import naive
from ...objective import (
    clipped_surrogate,
    completion_logprobs,
    kl_k3,
    masked_mean,
    position_ids_from_mask,
    token_logprobs,
    token_weights,
)
from ...sampling import (
    sample_group,
)
from ...tasks import addition_reward
from .. import steps
from .base import (
    CheckResult,
    Exercise,
    Mismatch,
    Mistake,
    compare,
    expect,
    norm_words,
    patched,
    run_check,
    which_mistake,
)
from .fixtures import (
    check_loss,
    check_step_contract,
    drive,
    drive_a_step,
    drive_logprobs,
    drive_loss,
    drive_step,
    drive_update,
    fixture_run,
)


def check_addition_reward(fn: Callable) -> CheckResult:

    def case(completions, answers, what, truncated=None):
        def run(f):
            columns = {"prompt": ["?"] * len(completions)}
            if truncated is not None:
                columns["truncated"] = truncated
            got = f(completions, answer=answers, **columns)
            got = list(got) if got is not None else None
            expect(got, addition_reward(completions, answers, truncated), what)
        return run

    return run_check("addition_reward", fn, addition_reward, [
        ("exact answers", case(["46", "7"], ["46", "7"], "rewards for right answers")),
        ("wrong answers", case(["45", "", "4"], ["46", "0", "46"], "rewards for wrong answers")),
        ("surrounding spaces", case([" 46", "46 "], ["46", "46"], "rewards with spaces")),
        ("the answer inside a longer completion", case(
            ["146", "467", "46 7", "4"], ["46", "46", "46", "46"],
            "rewards for completions that contain or start with the answer: only the whole "
            "completion, stripped, equal to the answer scores 1.0 ('146' is not 46)")),
        ("extra columns in **kwargs", case(["1"], ["1"], "rewards")),
        ("a completion cut off at max_new_tokens", case(
            ["46", "46", "12   "], ["46", "46", "12"],
            "rewards when truncated=[False, True, True]: a completion that hit max_new_tokens "
            "without end-of-text never finished its answer and scores 0.0",
            truncated=[False, True, True])),
    ])


# --- known mistakes: the reference with one mistake put in, and what the learner reads -------
# grpo_step's: each is a step of (run, problems, loss_fn, update_fn), what drive_step runs
def _no_zero_grad(run, problems, loss_fn, update_fn):
    run.optimizer.zero_grad = lambda *a, **k: None
    return steps.grpo_step(run, problems, loss_fn, update_fn)


def _old_logp_not_detached(run, problems, loss_fn, update_fn):
    return steps.grpo_step(run, problems, lambda lp, old, ref, *r: loss_fn(lp, lp, ref, *r),
                           update_fn)


def _step_ratio_against_reference(run, problems, loss_fn, update_fn):
    return steps.grpo_step(run, problems, lambda lp, old, ref, *r: loss_fn(lp, ref, ref, *r),
                           update_fn)


def _optimizer_step_without_update_fn(run, problems, loss_fn, update_fn):
    def plain(run):
        run.optimizer.step()
        return 0.0, 0
    return steps.grpo_step(run, problems, loss_fn, plain)


def _answers_tiled(run, problems, loss_fn, update_fn):
    reward_fn, G = run.reward_fn, run.cfg.group_size
    run.reward_fn = lambda c, answer, **k: reward_fn(
        c, answer=[p.answer for p in problems] * G, **k)
    return steps.grpo_step(run, problems, loss_fn, update_fn)


def _reward_without_truncated(run, problems, loss_fn, update_fn):
    reward_fn = run.reward_fn
    run.reward_fn = lambda c, answer, **k: reward_fn(c, answer=answer)
    return steps.grpo_step(run, problems, loss_fn, update_fn)


def _rewards_as_advantages(run, problems, loss_fn, update_fn):
    with patched(steps, group_advantages=lambda r, *a, **k: r.clone()):
        return steps.grpo_step(run, problems, loss_fn, update_fn)


def _advantage_options_ignored(run, problems, loss_fn, update_fn):
    plain = steps.group_advantages
    with patched(steps, group_advantages=lambda r, G, *a, **k: plain(r, G)):
        return steps.grpo_step(run, problems, loss_fn, update_fn)


def _step_temperature_ignored(run, problems, loss_fn, update_fn):
    def at_one(model, ids, mask, C, temperature=1.0, *a):
        return completion_logprobs(model, ids, mask, C, 1.0)
    with patched(steps, completion_logprobs=at_one):
        return steps.grpo_step(run, problems, loss_fn, update_fn)


def _sampler_flags_dropped(run, problems, loss_fn, update_fn):
    def without_flags(model, tok, prompts, G, n, temperature=1.0, *rest, **kw):
        return sample_group(model, tok, prompts, G, n, temperature)
    return steps.grpo_step(run, problems, loss_fn, update_fn, sample_fn=without_flags)


def _loss_type_ignored(run, problems, loss_fn, update_fn):
    def as_grpo(mask, loss_type, max_new_tokens, **kw):
        return token_weights(mask, "grpo", max_new_tokens, **kw)
    with patched(steps, token_weights=as_grpo):
        return steps.grpo_step(run, problems, loss_fn, update_fn)


def _weights_over_padding(run, problems, loss_fn, update_fn):
    def with_padding(mask, loss_type, max_new_tokens, **kw):
        return token_weights(torch.ones_like(mask), loss_type, max_new_tokens, **kw)
    with patched(steps, token_weights=with_padding):
        return steps.grpo_step(run, problems, loss_fn, update_fn)


def _weights_over_longest_completion(run, problems, loss_fn, update_fn):
    def over_c(mask, loss_type, max_new_tokens, **kw):
        return token_weights(mask, loss_type, mask.shape[1], **kw)
    with patched(steps, token_weights=over_c):
        return steps.grpo_step(run, problems, loss_fn, update_fn)


def _reward_metric_summed(run, problems, loss_fn, update_fn):
    metrics = steps.grpo_step(run, problems, loss_fn, update_fn)
    return {**metrics, "reward": metrics["reward"] * len(problems) * run.cfg.group_size}


def _reference_is_policy(run, problems, loss_fn, update_fn):
    policy = run.policy

    def same(model, *a):
        return completion_logprobs(policy if model is run.reference else model, *a)
    with patched(steps, completion_logprobs=same):
        return steps.grpo_step(run, problems, loss_fn, update_fn)


GRPO_STEP_MISTAKES = (
    Mistake("no_zero_grad", _no_zero_grad,
            "your step never clears the gradients: `run.optimizer.zero_grad()` must come "
            "before `loss.backward()`, or the last step's gradients are added to this one's"),
    Mistake("old_logp_not_detached", _old_logp_not_detached,
            "pi_old is `logp` itself, not `logp.detach()`: the ratio logp - old_logp is then "
            "0 with zero gradient, and only the KL term trains"),
    Mistake("ratio_against_reference", _step_ratio_against_reference,
            "the ratio is taken against the reference model (`ref_logp`) instead of pi_old "
            "(`logp.detach()`): report 001's mistake; after some drift r = exp(logp - "
            "ref_logp) leaves the trust region for good"),
    Mistake("optimizer_step_without_update_fn", _optimizer_step_without_update_fn,
            "your step calls `run.optimizer.step()` itself instead of `update_fn(run)`, so "
            "the update skips gradient clipping (and every later fix that lives in update_fn)"),
    Mistake("answers_tiled", _answers_tiled,
            "the answers are in the wrong order: rows are grouped by prompt, so each answer "
            "must be repeated G times in a row (`[p.answer for p in problems for _ in "
            "range(G)]`), not the list repeated G times"),
    Mistake("reward_without_truncated", _reward_without_truncated,
            "the reward call leaves out `truncated=`: a completion cut off at max_new_tokens "
            "(no end-of-text) whose text is the answer then scores 1, though the model never "
            "finished it; pass `truncated=rollout.truncated.tolist()` so that it scores 0"),
    Mistake("rewards_as_advantages", _rewards_as_advantages,
            "the raw rewards are used as advantages: normalise them within each group with "
            "`group_advantages(rewards, G, ...)`"),
    Mistake("advantage_options_ignored", _advantage_options_ignored,
            "group_advantages is called without the config's options: pass "
            "`cfg.advantage_eps, cfg.scale_rewards` too (with scale_rewards False, Dr. "
            "GRPO's choice, the rewards are only centred, not divided by the group's std)"),
    Mistake("temperature_ignored", _step_temperature_ignored,
            "the training forward ignores the temperature: log-probs must come from the "
            "distribution the sampler drew from, `completion_logprobs(..., cfg.temperature)`, "
            "or the ratio does not start at 1"),
    Mistake("loss_type_ignored", _loss_type_ignored,
            "the token weights ignore `cfg.loss_type` (always the grpo per-sequence mean): "
            "`token_weights(mask, cfg.loss_type, cfg.max_new_tokens)`"),
    Mistake("weights_over_padding", _weights_over_padding,
            "the token weights count padding positions: compute them from the completion "
            "mask, `token_weights(rollout.completion_mask, cfg.loss_type, "
            "cfg.max_new_tokens)`, which is 0 on padding"),
    Mistake("reference_is_policy", _reference_is_policy,
            "the reference log-probs come from the policy, not from `run.reference`: the KL "
            "term then measures nothing"),
    Mistake("weights_over_longest_completion", _weights_over_longest_completion,
            "the token weights divide by this batch's longest completion (the mask's C "
            "columns) instead of `cfg.max_new_tokens`: Dr. GRPO's constant is the most a "
            "completion may have, the same in every step, so that a batch of short completions "
            "does not weigh more: `token_weights(mask, cfg.loss_type, cfg.max_new_tokens)`"),
    Mistake("reward_metric_summed", _reward_metric_summed,
            "metrics['reward'] is the sum of the batch's rewards; it is their mean, the "
            "fraction of completions that scored (`rewards.mean().item()`), so that runs with "
            "other batch sizes compare"),
    Mistake("sampler_flags_dropped", _sampler_flags_dropped,
            "your step does not pass `cfg.top_k` and `cfg.top_p` to the sampler: it samples "
            "from the whole distribution even when the config asks for top-k or nucleus "
            "sampling; call sample_fn(model, tokenizer, prompts, G, cfg.max_new_tokens, "
            "cfg.temperature, cfg.top_k, cfg.top_p)"),
)


# grpo_loss's: each is a loss of (logp, old_logp, ref_logp, advantages, weights, cfg)
def _with(**changes) -> Callable:
    """The reference loss run with these config fields changed."""
    def loss(logp, old_logp, ref_logp, advantages, weights, cfg):
        c = copy.copy(cfg)
        for k, v in changes.items():
            setattr(c, k, v(cfg) if callable(v) else v)
        return steps.grpo_loss(logp, old_logp, ref_logp, advantages, weights, c)
    return loss


def with_kl(logp, old_logp, ref_logp, advantages, weights, cfg, kl):
    """The reference loss's value with `kl` in place of k3 (no stats)."""
    per_token, _ = clipped_surrogate(logp, old_logp, advantages.detach(), cfg.epsilon_low,
                                     cfg.epsilon_high, cfg.log_ratio_clamp)
    return ((per_token + cfg.beta * kl) * weights).sum(), {}


def _kl_swapped(logp, old_logp, ref_logp, advantages, weights, cfg):
    return with_kl(logp, old_logp, ref_logp, advantages, weights, cfg, kl_k3(ref_logp, logp))


def _loss_ratio_against_reference(logp, old_logp, ref_logp, advantages, weights, cfg):
    return steps.grpo_loss(logp, ref_logp, ref_logp, advantages, weights, cfg)


def _constant_clip(logp, old_logp, ref_logp, advantages, weights, cfg):
    with patched(steps, clipped_surrogate=naive.constant_clip_surrogate):
        return steps.grpo_loss(logp, old_logp, ref_logp, advantages, weights, cfg)


def _weights_ignored(logp, old_logp, ref_logp, advantages, weights, cfg):
    # a plain mean over every (row, token) position
    return steps.grpo_loss(logp, old_logp, ref_logp, advantages,
                           torch.full_like(weights, 1 / weights.numel()), cfg)


def _sign(logp, old_logp, ref_logp, advantages, weights, cfg):
    out, stats = steps.grpo_loss(logp, old_logp, ref_logp, advantages, weights, cfg)
    return -out, stats


def loss_with_kl_outside(over_tokens: bool, kl: Callable = kl_k3):
    """The reference's surrogate, with beta x the mean of kl(logp, ref_logp) (k3 unless
    given) added after the weighted sum: over every (row, token) position, or over the
    completion tokens."""
    def loss(logp, old_logp, ref_logp, advantages, weights, cfg):
        surrogate, _ = with_kl(logp, old_logp, ref_logp, advantages, weights, cfg,
                               torch.zeros_like(logp))
        per_token = kl(logp, ref_logp)
        return surrogate + cfg.beta * (masked_mean(per_token, weights > 0) if over_tokens
                                       else per_token.mean()), {}
    return loss


def kl_outside_the_weights(mean: str) -> str:
    return (f"the KL term is added after the weighted sum, as beta x the mean of k3 {mean}; "
            "it belongs inside it, token by token: `(weights * (surrogate + cfg.beta * "
            "k3)).sum()`, so each token's KL is weighted as its surrogate is (and padding "
            "carries none)")


def _reinforce_plain_mean(logp, old_logp, ref_logp, advantages, weights, cfg):
    return -(advantages.detach()[:, None] * logp).mean(), {}


REINFORCE_LOSS_MISTAKES = (
    Mistake("weights_ignored", _reinforce_plain_mean,
            "a plain mean over every (row, token) position: the token weights say how much "
            "each token counts (0 on padding, the loss_type's normaliser elsewhere); use them, "
            "`-(advantages[:, None] * logp * weights).sum()`"),
)


GRPO_LOSS_MISTAKES = (
    Mistake("kl_sign", _with(beta=lambda cfg: -cfg.beta),
            "the KL term has the wrong sign: the loss *adds* beta x k3 (a penalty to "
            "minimise), so the gradient pulls the policy back toward the reference"),
    Mistake("kl_swapped", _kl_swapped,
            "k3's arguments are swapped: `kl_k3(logp, ref_logp)` takes the policy's "
            "log-probs first (log_r = ref_logp - logp)"),
    Mistake("beta_ignored", _with(beta=0.0),
            "the KL term is missing: add `cfg.beta * kl_k3(logp, ref_logp)` per token"),
    Mistake("kl_mean_outside_the_weights", loss_with_kl_outside(over_tokens=False),
            kl_outside_the_weights("over every (row, token) position")),
    Mistake("kl_token_mean_outside_the_weights", loss_with_kl_outside(over_tokens=True),
            kl_outside_the_weights("over the completion tokens")),
    Mistake("kl_unscaled", _with(beta=1.0),
            "the KL term is not scaled by the config's beta: each token's term is "
            "surrogate + `cfg.beta * kl_k3(logp, ref_logp)`, not surrogate + k3"),
    Mistake("kl_halved", _with(beta=lambda cfg: cfg.beta / 2),
            "the KL term is halved: each token's term is surrogate + `cfg.beta * "
            "kl_k3(logp, ref_logp)`; k3 carries no 1/2 (the 0.5 belongs to k2, "
            "0.5 (log r)^2, a different estimator)"),
    Mistake("ratio_against_reference", _loss_ratio_against_reference,
            "the ratio is taken against the reference (`ref_logp`) instead of pi_old "
            "(`old_logp`): report 001's mistake"),
    Mistake("constant_clip", _constant_clip,
            "the clipped term is the constant clip range (`eps * A`), report 001's "
            "`clip_ratio * advantage`, not `clip(r, 1 - eps_low, 1 + eps_high) * A`"),
    Mistake("weights_ignored", _weights_ignored,
            "the token weights are not used: the loss is a plain mean over every (row, "
            "token) position, padding included; multiply each token's term by `weights` (0 "
            "on padding, the loss type's normalisation elsewhere) and sum"),
    Mistake("no_clip", _with(epsilon_low=1e9, epsilon_high=1e9),
            "nothing is clipped: the surrogate is -r x A without the trust region"),
    Mistake("epsilon_high_ignored", _with(epsilon_high=lambda cfg: cfg.epsilon_low),
            "the upper clip bound ignores `cfg.epsilon_high`: the trust region is "
            "[1 - epsilon_low, 1 + epsilon_high], and the two differ when the config makes "
            "them differ (DAPO's clip-higher, 0.2 / 0.28)"),
    Mistake("sign", _sign,
            "the loss has the opposite sign: a loss is minimised, so it is -min(r A, clip A)"),
)


# a mistake in the loss's stats (what the metrics show), not in the loss: the loss is the
# reference's, the stats are means over every position
def _stats_over_padding(logp, old_logp, ref_logp, advantages, weights, cfg):
    loss, _ = steps.grpo_loss(logp, old_logp, ref_logp, advantages, weights, cfg)
    _, clipped = clipped_surrogate(logp, old_logp, advantages.detach(), cfg.epsilon_low,
                                   cfg.epsilon_high, cfg.log_ratio_clamp)
    return loss, {"kl": kl_k3(logp, ref_logp).detach().mean().item(),
                  "clip_ratio/region_mean": clipped.float().mean().item()}


GRPO_LOSS_STATS_MISTAKES = (
    Mistake("stats_over_padding", _stats_over_padding,
            "the stats are averaged over padding too: 'kl' and 'clip_ratio/region_mean' are "
            "means over the completion tokens only, `masked_mean(x, weights > 0)`; a padding "
            "position is no token of any completion, and counting it shrinks both numbers by "
            "the padded share of the batch"),
)


# completion_logprobs's: each is a function of (model, ids, mask, C, temperature)
def _no_position_ids(model, ids, mask, C, temperature):
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -C - 1:-1]
    return token_logprobs(logits / temperature, ids[:, -C:])


def _off_by_one(model, ids, mask, C, temperature):
    logits = model(input_ids=ids, attention_mask=mask,
                   position_ids=position_ids_from_mask(mask)).logits[:, -C:]
    return token_logprobs(logits / temperature, ids[:, -C:])


def _logprobs_at_one(model, ids, mask, C, temperature):
    return completion_logprobs(model, ids, mask, C, 1.0)


def _temperature_multiplied(model, ids, mask, C, temperature):
    return completion_logprobs(model, ids, mask, C, 1.0 / temperature)


def _temperature_after_log_softmax(model, ids, mask, C, temperature):
    return completion_logprobs(model, ids, mask, C, 1.0) / temperature


def _no_attention_mask(model, ids, mask, C, temperature):
    logits = model(input_ids=ids, position_ids=position_ids_from_mask(mask)).logits
    return token_logprobs(logits[:, -C - 1:-1] / temperature, ids[:, -C:])


def _positions_from_one(model, ids, mask, C, temperature):
    logits = model(input_ids=ids, attention_mask=mask,
                   position_ids=position_ids_from_mask(mask) + mask.long()).logits
    return token_logprobs(logits[:, -C - 1:-1] / temperature, ids[:, -C:])


COMPLETION_LOGPROBS_MISTAKES = (
    Mistake("no_position_ids", _no_position_ids,
            "no position ids: with left padding a row's first real token sits at position "
            "> 0; pass `position_ids=position_ids_from_mask(attention_mask)`"),
    Mistake("off_by_one", _off_by_one,
            "off by one: the logits at position t predict token t + 1, so the C completion "
            "tokens are predicted by `logits[:, -C - 1:-1]`, not `logits[:, -C:]`"),
    Mistake("temperature_ignored", _logprobs_at_one,
            "the temperature is missing: divide the logits by it before the log-softmax, as "
            "the sampler does"),
    Mistake("temperature_multiplied", _temperature_multiplied,
            "the logits are multiplied by the temperature: the sampler draws from "
            "softmax(logits / temperature), so divide"),
    Mistake("temperature_after_log_softmax", _temperature_after_log_softmax,
            "the temperature divides the log-probs after the log-softmax: divide the logits "
            "before it, log_softmax(logits / T); the other way is not a distribution"),
    Mistake("no_attention_mask", _no_attention_mask,
            "no attention mask: the left padding is attended to as if it were text; pass "
            "`attention_mask` to the model"),
    Mistake("positions_from_one", _positions_from_one,
            "the position ids start at 1: a row's first real token is position 0, "
            "cumsum(mask) - 1 (position_ids_from_mask)"),
)


# apply_update's: each is an update of (run) -> (grad_norm, skipped)
def _grad_norm(params) -> float:
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item()


def _update_no_clip(run):
    params = [p for p in run.policy.parameters() if p.grad is not None]
    norm = _grad_norm(params)
    run.optimizer.step()
    return norm, 0


def _norm_after_clipping(run):
    params = [p for p in run.policy.parameters() if p.grad is not None]
    torch.nn.utils.clip_grad_norm_(params, run.cfg.max_grad_norm)
    norm = _grad_norm(params)
    run.optimizer.step()
    return norm, 0


def _zero_grad_before_step(run):
    params = [p for p in run.policy.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, run.cfg.max_grad_norm)
    run.optimizer.zero_grad()
    run.optimizer.step()
    return norm.item(), 0


def _none_clips_to_zero(run):
    params = [p for p in run.policy.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, run.cfg.max_grad_norm or 0.0)
    run.optimizer.step()
    return norm.item(), 0


APPLY_UPDATE_MISTAKES = (
    Mistake("no_clip", _update_no_clip,
            "the gradient is not clipped: `torch.nn.utils.clip_grad_norm_(params, "
            "cfg.max_grad_norm)` before `optimizer.step()`"),
    Mistake("norm_after_clipping", _norm_after_clipping,
            "the grad norm is measured after clipping: report the norm `clip_grad_norm_` "
            "returns (the one before clipping, what TRL logs)"),
    Mistake("zero_grad_before_step", _zero_grad_before_step,
            "the gradients are cleared before `optimizer.step()`: nothing moves"),
    Mistake("none_clips_to_zero", _none_clips_to_zero,
            "with max_grad_norm None your step clipped the gradient to norm 0 (`max_grad_norm "
            "or 0.0`?), so nothing moved; None means no clipping: skip the clip, or clip to "
            "math.inf, which still returns the norm"),
)


def check_completion_logprobs(fn: Callable) -> CheckResult:
    ref = completion_logprobs

    def case(seed, temperature):
        def run(f):
            out = drive(f, drive_logprobs, seed=seed, temperature=temperature)
            want = drive_logprobs(ref, seed, temperature)["logp"].detach()
            got = out["logp"]
            if isinstance(got, torch.Tensor):
                got = got.detach()
            compare(got, want, "the (B, C) log-probs", COMPLETION_LOGPROBS_MISTAKES,
                    lambda m: drive_logprobs(m, seed, temperature)["logp"].detach())
            if not out["requires_grad"]:
                raise Mismatch("the log-probs carry no gradient: the training forward must "
                               "not run under torch.no_grad() or .detach() its output")
        return run

    return run_check("completion_logprobs", fn, ref, [
        ("left-padded prompts of different lengths, temperature 0.7", case(0, 0.7)),
        ("another batch, temperature 1.3", case(1, 1.3)),
    ])


def check_reinforce_loss(fn: Callable) -> CheckResult:
    return check_loss("reinforce_loss", fn, steps.reinforce_loss, [
        ("completions of different lengths", dict(seed=0)), ("another batch", dict(seed=1))],
        REINFORCE_LOSS_MISTAKES)


def check_grpo_loss(fn: Callable) -> CheckResult:
    return check_loss("grpo_loss", fn, steps.grpo_loss, [
        ("loss_type grpo", dict(seed=0)), ("loss_type dr_grpo", dict(seed=1, loss_type="dr_grpo")),
        ("loss_type dapo, beta 0.2", dict(seed=2, loss_type="dapo", beta=0.2)),
        ("asymmetric clip 0.2 / 0.28", dict(seed=3, epsilon_high=0.28)),
        # a later pass of mu > 1 with pi_old 5 nats per token away: the clamp at 2 binds
        ("log_ratio_clamp 2, pi_old far away",
         dict(seed=4, log_ratio_clamp=2.0, old_drift=5.0)),
    ], GRPO_LOSS_MISTAKES, stats=("kl", "clip_ratio/region_mean"),
        stats_mistakes=GRPO_LOSS_STATS_MISTAKES)


def check_apply_update(fn: Callable) -> CheckResult:
    ref = steps.apply_update

    def case(seed, **overrides):
        def run(f):
            out, want = drive(f, drive_update, seed=seed, **overrides), drive_update(ref, seed, **overrides)
            compare(out["update"], want["update"], "the parameter update", APPLY_UPDATE_MISTAKES,
                    lambda m: drive_update(m, seed, **overrides)["update"])
            got = out["out"]
            if not (isinstance(got, tuple) and len(got) == 2):
                raise Mismatch(f"return (grad_norm, skipped); got {type(got).__name__}")
            if isinstance(got[0], torch.Tensor):
                raise Mismatch("the grad norm is a tensor: return a Python float (`.item()`); "
                               "the step puts it into its metrics, which are written as JSON")
            named = None
            if isinstance(got[0], (int, float)) and abs(got[0] - want["out"][0]) > 1e-4 * abs(want["out"][0]):
                named = which_mistake(torch.tensor([float(got[0])]), APPLY_UPDATE_MISTAKES,
                                      lambda m: torch.tensor(
                                          [float(drive_update(m, seed, **overrides)["out"][0])]))
            if named:
                raise Mismatch(f"the grad norm differs: {named}")
            grads = [p.grad for p in fixture_run(seed, **overrides).policy.parameters()
                     if p.grad is not None]
            if words := norm_words(got[0], grads):
                raise Mismatch(f"the grad norm: {words}")
            expect(float(got[0]) if isinstance(got[0], (int, float)) else got[0],
                    float(want["out"][0]), "the grad norm")
            if got[1] != 0:
                raise Mismatch(f"skipped must be 0 here (no update is skipped); got {got[1]!r}")
        return run

    return run_check("apply_update", fn, ref, [
        ("stale gradients of norm ~ 40, clipped to 1", case(0)),
        ("no clipping configured (max_grad_norm None)", case(1, max_grad_norm=None)),
        ("a norm of ~ 40 under max_grad_norm 100: left as it is, not scaled up",
         case(0, max_grad_norm=100.0)),
    ])


def check_grpo_step(fn: Callable) -> CheckResult:
    ref = steps.grpo_step

    def case(seed, **overrides):
        def run(f):
            out = drive_a_step(f, drive_step, "grpo_step", seed=seed, **overrides)
            check_step_contract(out)
            want = drive_step(ref, seed, **overrides)
            compare(out["update"], want["update"], "the update your step made",
                    GRPO_STEP_MISTAKES, lambda m: drive_step(m, seed, **overrides)["update"])
            got = out["metrics"]
            for key in ("reward", "loss", "kl", "grad_norm", "clip_ratio/region_mean"):
                if key not in got:
                    from_loss = " (put every entry of the loss's stats in the metrics)" \
                        if key in ("kl", "clip_ratio/region_mean") else ""
                    raise Mismatch(f"the metrics have no {key!r}{from_loss} (keys: "
                                   f"{sorted(got)[:8]})")
                value, expected = float(got[key]), float(want["metrics"][key])
                if not math.isclose(value, expected, rel_tol=1e-4, abs_tol=1e-5):
                    # an update AdamW's first step makes alike (it is scale-free per
                    # coordinate) can still show a known mistake in a metric
                    for mistake in GRPO_STEP_MISTAKES:
                        theirs = drive_step(mistake.wrong, seed, **overrides)["metrics"].get(key)
                        if theirs is not None and math.isclose(float(theirs), value,
                                                               rel_tol=1e-4, abs_tol=1e-5):
                            raise Mismatch(f"metrics[{key!r}] is {value:.6g}, expected "
                                           f"{expected:.6g}: {mistake.message}")
                expect(value, expected, f"metrics[{key!r}]", atol=1e-5, rtol=1e-4)
        return run

    return run_check("grpo_step", fn, ref, [
        ("4 prompts x 4 completions, drifted policy, stale .grad", case(0)),
        ("temperature 0.7, Dr. GRPO (loss_type dr_grpo, scale_rewards False)",
         case(1, temperature=0.7, loss_type="dr_grpo", scale_rewards=False)),
        ("completions cut at 2 tokens (truncated ones score 0)", case(2, max_new_tokens=2)),
        ("top_k 2 and top_p 0.8 in the config", case(3, top_k=2, top_p=0.8)),
        ("2 prompts x 4 completions: groups of G = 4, not of prompts_per_step",
         case(4, prompts_per_step=2)),
    ])


# --- the notebook's exercises, in its order -------------------------------------------------
EXERCISES = (
    Exercise('addition_reward', addition_reward, check_addition_reward),
    Exercise('completion_logprobs', completion_logprobs, check_completion_logprobs,
             driver=drive_logprobs, mistakes=COMPLETION_LOGPROBS_MISTAKES),
    Exercise('reinforce_loss', steps.reinforce_loss, check_reinforce_loss,
             driver=drive_loss, mistakes=REINFORCE_LOSS_MISTAKES),
    Exercise('apply_update', steps.apply_update, check_apply_update,
             driver=drive_update, mistakes=APPLY_UPDATE_MISTAKES),
    Exercise('grpo_step', steps.grpo_step, check_grpo_step,
             driver=drive_step, mistakes=GRPO_STEP_MISTAKES),
    Exercise('grpo_loss', steps.grpo_loss, check_grpo_loss,
             driver=drive_loss, mistakes=GRPO_LOSS_MISTAKES + GRPO_LOSS_STATS_MISTAKES),
)
