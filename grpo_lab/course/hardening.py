"""The learner's trainer, hardened: reference versions of what notebooks 07 and 08 have the
learner add to the step they wrote in notebook 04 (steps.grpo_step), and nothing else.

Notebook 07, the parameter health check and rollback, as an `update_fn` of that step:

    health_check       after an update: any NaN/inf parameter -> restore run.snapshot (weights
                       and optimizer state), else keep a new snapshot every snapshot_every steps
    healthy_update     update_fn(run), then health_check(run); run.rolled_back says whether
                       this step was undone

Notebook 08, exact gradient accumulation:

    accumulated_grpo_step   grpo_step with the loss's gradient accumulated over
                            cfg.grad_accum_steps micro-batches of the batch's rows, then one
                            update: the same update as the full batch's, for every loss type

Both compute what the package's `Trainer` computes with the same switches (`health_check`,
`snapshot_every`; `grad_accum_steps`): `step.check_health` and `step.accumulate`.
"""

from __future__ import annotations

from collections.abc import Callable

from ..health import Snapshot, nonfinite_params
from ..objective import completion_logprobs, token_weights
from ..sampling import sample_group
from ..tasks import Problem
from ..trainer import micro_batch_slices
from .steps import LossFn, Run, apply_update, sample_and_score, step_metrics


# --- notebook 07: health checks and rollback --------------------------------------------------
def health_check(run: Run) -> int:
    """The parameter health check, run by the update function right after an update (so
    before the step counts itself: the step this update belongs to is run.step_count + 1).

    Any NaN or +-inf entry in run.policy's parameters: restore run.snapshot (weights *and*
    optimizer state, `Snapshot.restore`) and return 1. Otherwise, when that step is a
    multiple of cfg.snapshot_every, keep a new `Snapshot(run.policy, run.optimizer, step)`;
    return 0. run.snapshot must hold one before the first step (the snapshot of step 0, as
    `Trainer` takes it when it starts). `step.check_health` with health_check on."""
    if nonfinite_params(run.policy):
        run.snapshot.restore(run.policy, run.optimizer)
        return 1
    step = run.step_count + 1
    if step % run.cfg.snapshot_every == 0:
        run.snapshot = Snapshot(run.policy, run.optimizer, step)
    return 0


def healthy_update(run: Run, update_fn: Callable = apply_update) -> tuple[float, int]:
    """An update_fn with the health check behind it: `update_fn(run)` (apply_update,
    guarded_update, ...), then `health_check(run)`. Returns update_fn's (grad_norm, skipped)
    unchanged and sets run.rolled_back to health_check's answer (1: this step's weights were
    replaced by the last snapshot's; 0: they were healthy). A rollback is not a skipped
    update: the update did reach the weights, and the restore undoes every step since the
    snapshot, not only this one."""
    grad_norm, skipped = update_fn(run)
    run.rolled_back = health_check(run)
    return grad_norm, skipped


# --- notebook 08: exact gradient accumulation ---------------------------------------------------
def accumulated_grpo_step(run: Run, problems: list[Problem], loss_fn: LossFn,
                          update_fn: Callable = apply_update,
                          sample_fn: Callable = sample_group) -> dict:
    """steps.grpo_step with the gradient of the step's loss accumulated over
    cfg.grad_accum_steps micro-batches (micro_batch_slices of the B rows), then one update.

    The token weights are computed once, on the whole batch's mask, and each micro-batch's
    loss gets its rows of them: the micro-batch losses are then the whole batch's loss
    restricted to their rows, so they sum to the full-batch loss and their gradients, which
    backward() adds into .grad, to the full-batch gradient, for every loss type (as the
    engine's step.accumulate does it). Metrics as grpo_step's: 'loss' is that sum, each entry
    of the loss's stats the mean of the micro-batches' values weighted by their completion
    tokens (exact for token means: kl, clip_ratio/region_mean)."""
    cfg = run.cfg
    rollout, rewards, advantages, ref_logp = sample_and_score(run, problems, sample_fn)
    ids, attention, C = rollout.input_ids, rollout.attention_mask, rollout.completion_length
    mask = rollout.completion_mask  # (B, C)
    weights = token_weights(mask, cfg.loss_type, cfg.max_new_tokens)  # (B, C): the whole batch's
    n_tokens = max(int(mask.sum()), 1)
    run.optimizer.zero_grad(set_to_none=True)  # once, before the loop
    loss, stats = 0.0, {}
    for rows in micro_batch_slices(len(rewards), cfg.grad_accum_steps):
        logp = completion_logprobs(run.policy, ids[rows], attention[rows], C,
                                   cfg.temperature)  # (b, C)
        part, part_stats = loss_fn(logp, logp.detach(), ref_logp[rows], advantages[rows],
                                   weights[rows], cfg)
        part.backward()  # adds into .grad
        loss += part.item()
        share = int(mask[rows].sum()) / n_tokens
        for k, v in part_stats.items():
            stats[k] = stats.get(k, 0.0) + float(v) * share
    grad_norm, skipped = update_fn(run)  # once, after the loop
    run.step_count += 1
    return step_metrics(run, rewards, mask, loss, grad_norm, skipped, stats)
