"""One GRPO step: the step notebook 04 has the learner write, with what the engine adds.

    grpo_step(run, problems, loss_fn, update_fn, sample_fn) -> metrics

    sample G completions per prompt with the policy (pi_old = the sampling policy)
    score them -> group-normalised advantages
    one no-grad forward of the frozen reference for the KL term
    token weights over the whole batch (all ranks' rows), so micro-batches sum to it
    for each of mu passes: gradients accumulated over micro-batches, then update_fn(run)
    the health check (roll back to the last healthy snapshot), metrics named as in TRL

`Trainer` loops over a step of this signature, whoever wrote it: this one (the engine's) or
the learner's. Every loss shares one signature,

    loss_fn(logp, old_logp, ref_logp, advantages, weights, cfg) -> (loss, stats)

logp (b, C) the rows' log-probs now, with grad; old_logp and ref_logp (b, C) pi_old's and the
reference's (ref_logp None when no reference forward ran), all three 0 on padding;
advantages (b,); weights (b, C) the whole batch's token weights on these rows (0 on padding
and on rows the loss ignores): the loss is sum(per_token * weights), so the micro-batches'
losses add up to the batch's. stats: token means over the rows' weighted tokens, except
names ending in 'max_abs' (maxima); the step combines micro-batches and ranks by name.
"""

from __future__ import annotations

import inspect
import math
import statistics
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch

from . import distributed, naive
from .config import GRPOConfig
from .fast import shared_prompt_logits
from .graphs import graphed
from .health import Snapshot, all_finite, first_nonfinite_grad, nonfinite_params
from .objective import (
    clipped_surrogate,
    completion_logits,
    entropy_from_logits,
    group_advantages,
    token_logprobs,
    token_weights,
    weighted_loss,
)
from .sampling import Rollout, sample_group
from .tasks import Problem, ProblemStream, addition_reward, checked_rewards

SPIKE_WINDOW = 20  # recent finite grad norms the spike rule takes its median over
SPIKE_MIN_HISTORY = 5  # recent grad norms needed before the spike rule has a baseline

LossFn = Callable[..., tuple[torch.Tensor, dict]]


@dataclass
class Run:
    """What a step works on: the models, the optimizer, the data and the loop's state.
    `Trainer` builds it (course.steps.new_run returns a Trainer's run). B = prompts x G."""

    cfg: GRPOConfig
    policy: torch.nn.Module  # trained; it samples, so it is pi_old at the start of a step
    reference: torch.nn.Module | None  # the starting policy, frozen: the KL term's anchor
    optimizer: torch.optim.Optimizer
    tokenizer: object
    reward_fn: Callable = addition_reward  # TRL's signature: (completions, answer=..., **kw)
    stream: ProblemStream | None = None  # training prompts, drawn by the loop
    eval_problems: list[Problem] = field(default_factory=list)  # the fixed held-out set
    step_count: int = 0  # finished steps: a step adds 1
    # what the safety rules keep between steps
    recent_grad_norms: deque = field(default_factory=lambda: deque(maxlen=SPIKE_WINDOW))
    snapshot: Snapshot | None = None  # the last healthy parameters and optimizer state
    rolled_back: int = 0  # 1 when the last update was undone by a rollback
    history: list[dict] = field(default_factory=list)
    # what the engine's step adds: where it runs and how it runs the training forward
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    world: distributed.World = field(default_factory=distributed.World)
    # (ids, attention, C, temperature, logit_clamp) -> (B, C, V) logits, with grad: the
    # shared-prompt module (fast.py), DDP-wrapped under torchrun; None: the plain forward
    forward: Callable | None = None
    fast: bool = False  # the reference forward shares each prompt's forward (fast.py)
    scaler: torch.amp.GradScaler | None = None  # fp16's loss scaler
    last_grad_norm: float = math.nan
    first_bad_grad: str | None = None  # recorded before a skip clears the gradients
    last_nonfinite_params: int = 0
    last_batch: StepBatch | None = None  # the last step's batch (tools read it)


@dataclass
class StepBatch:
    """What one step's loss needs. B = prompts x G rows, C completion columns."""

    rollout: Rollout
    rewards: torch.Tensor  # (B,)
    advantages: torch.Tensor  # (B,)
    ref_logp: torch.Tensor | None  # (B, C) frozen reference, 0 on padding; None: not needed
    # (B, C) pi_old, the policy that sampled, on the training path: None until the first
    # pass of the update computes it (see accumulate)
    old_logp: torch.Tensor | None
    weights: torch.Tensor  # (B, C) token weights of the whole batch (see token_weights)

    def rows(self, sl: slice) -> StepBatch:
        """The rows `sl` of this batch, keeping the whole batch's token weights."""
        r = self.rollout
        return StepBatch(
            rollout=Rollout(r.input_ids[sl], r.attention_mask[sl], r.completion_mask[sl],
                            r.sampling_logprobs[sl], r.completions[sl], r.prompt_index[sl],
                            None if r.truncated is None else r.truncated[sl]),
            rewards=self.rewards[sl], advantages=self.advantages[sl],
            ref_logp=None if self.ref_logp is None else self.ref_logp[sl],
            old_logp=None if self.old_logp is None else self.old_logp[sl],
            weights=self.weights[sl],
        )


def micro_batch_slices(n: int, k: int) -> list[slice]:
    """Split range(n) into k contiguous, non-empty slices (sizes differ by at most 1).

    Report 004's chunking computed `n // k` rows per chunk, which is 0 when n < k and
    gives an empty micro-batch ('batch size must be positive'); this refuses that case."""
    if not 1 <= k <= n:
        raise ValueError(f"cannot split {n} rows into {k} non-empty micro-batches")
    sizes = [n // k + (1 if i < n % k else 0) for i in range(k)]
    starts = [sum(sizes[:i]) for i in range(k)]
    return [slice(s, s + z) for s, z in zip(starts, sizes, strict=True)]


# ---- the losses (the reports' broken ones: naive.py, chosen by the config) ------------------
def grpo_loss(logp, old_logp, ref_logp, advantages, weights, cfg):
    """The GRPO loss (DeepSeekMath; TRL):

        r_t = pi_theta(o_t) / pi_old(o_t)
        L   = sum_t w_t * (-min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) + beta * k3_t)

    stats: 'kl' (k3), 'clip_ratio/region_mean', 'log_ratio/max_abs' (|log r| over tokens)."""
    per_token, region_clipped = clipped_surrogate(
        logp, old_logp, advantages, cfg.epsilon_low, cfg.epsilon_high, cfg.log_ratio_clamp)
    return weighted_loss(per_token, region_clipped, logp.detach() - old_logp, logp, ref_logp,
                         weights, cfg.beta)


def loss_for(cfg: GRPOConfig) -> LossFn:
    """The loss the config asks for: grpo_loss, or the field reports' (naive.py)."""
    if naive.uses_reported_loss(cfg):
        return naive.configured_loss
    return grpo_loss


def step_argument(step_fn: Callable, name: str) -> Callable | None:
    """The function a step is given as `name` (loss_fn, update_fn, sample_fn): bound with
    functools.partial, else the step's own default for it; None when it has neither."""
    if isinstance(step_fn, partial) and name in step_fn.keywords:
        return step_fn.keywords[name]
    fn = step_fn.func if isinstance(step_fn, partial) else step_fn
    try:
        parameter = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):
        return None
    if parameter is None or parameter.default is inspect.Parameter.empty:
        return None
    return parameter.default


def needs_reference(cfg: GRPOConfig, step_fn: Callable | None) -> bool:
    """Whether a run of `step_fn` (None: the engine's step and loss) uses the frozen
    reference: for the KL term or the naive ratio, or because the step or the loss is not
    the engine's (the learner's compute the reference's log-probs whatever beta is)."""
    if cfg.beta > 0 or cfg.ratio_against == "reference":
        return True
    if step_fn is None:
        return False
    if (step_fn.func if isinstance(step_fn, partial) else step_fn) is not grpo_step:
        return True
    return step_argument(step_fn, "loss_fn") not in (grpo_loss, naive.configured_loss)


# ---- the parts of a step ---------------------------------------------------------------------
def autocast(run: Run):
    """Mixed precision for the forwards, as cfg.amp says (fp32 master weights)."""
    if run.cfg.amp == "none":
        return nullcontext()
    dtype = torch.bfloat16 if run.cfg.amp == "bf16" else torch.float16
    return torch.autocast(run.device.type, dtype=dtype)


def sampling_autocast(run: Run):
    """The sampler's forwards under bf16 autocast when cfg.amp is 'bf16' (the sampled
    logits are cast back to float32 before any processor); under 'fp16' sampling stays in
    float32: float16's range ends at 65504, and a logit past it would be inf (report 001's
    float16/float32 mix), where bfloat16 has float32's range."""
    return autocast(run) if run.cfg.amp == "bf16" else nullcontext()


def batch_weights(run: Run, loss_mask: torch.Tensor) -> torch.Tensor:
    """(B, C) -> (B, C) token weights normalised over the global batch: this rank's rows
    times the world size, and the loss tokens summed over ranks."""
    n_tokens = distributed.all_reduce(loss_mask.sum().float(), run.world)
    return token_weights(loss_mask, run.cfg.loss_type, run.cfg.max_new_tokens,
                         n_sequences=loss_mask.shape[0] * run.world.world_size,
                         n_tokens=n_tokens)


def make_batch(run: Run, problems: list[Problem], sample_fn: Callable | None = None) -> StepBatch:
    """Sample, score, and compute everything the loss needs that does not change during
    the update: advantages, the reference's log-probs, the token weights. `sample_fn`
    (called as sample_group is) replaces the engine's sampler."""
    cfg = run.cfg
    prompts = [p.prompt for p in problems]
    with sampling_autocast(run):
        if sample_fn is None:
            rollout = sample_group(run.policy, run.tokenizer, prompts, cfg.group_size,
                                   cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p,
                                   safe=cfg.safe_sampling, logit_clamp=cfg.logit_clamp)
        else:
            rollout = sample_fn(run.policy, run.tokenizer, prompts, cfg.group_size,
                                cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p)
    # the columns a reward function gets besides the completions (TRL's **kwargs)
    columns = {"answer": [p.answer for p in problems for _ in range(cfg.group_size)],
               "truncated": rollout.truncated.tolist()}
    if cfg.check_rewards:
        scores = checked_rewards(run.reward_fn, rollout.completions, cfg.reward_timeout,
                                 **columns)
    else:  # the reports' code: whatever comes back is trained on
        scores = run.reward_fn(rollout.completions, **columns)
    rewards = torch.tensor(scores, dtype=torch.float32, device=run.device)  # (B,)
    advantages = group_advantages(rewards, cfg.group_size, cfg.advantage_eps,
                                  cfg.scale_rewards)  # (B,)
    if cfg.advantage_clamp is not None:
        advantages = advantages.clamp(-cfg.advantage_clamp, cfg.advantage_clamp)
    m = rollout.completion_mask.bool()
    ref_logp = None  # the run has a reference when something uses it (needs_reference)
    if run.reference is not None:
        # inference mode: no autograd bookkeeping at all (~1% of a step on the tiny model);
        # the log-probs are taken outside it, so the loss gets an ordinary tensor
        with torch.inference_mode(), autocast(run):
            # graphed: a CUDA graph on a GPU with GRPO_LAB_CUDA_GRAPHS=1 (graphs.py)
            forward = (partial(shared_prompt_logits, run_forward=graphed) if run.fast
                       else completion_logits)
            logits = forward(run.reference, rollout.input_ids, rollout.attention_mask,
                             rollout.completion_length, cfg.temperature,
                             cfg.logit_clamp)  # (B, C, V)
        with torch.no_grad():
            ref_logp = token_logprobs(logits, rollout.completion_ids).masked_fill(~m, 0.0)
    loss_mask = rollout.completion_mask  # (B, C)
    if cfg.mask_truncated_completions:  # cut-off rows carry no loss (TRL's switch)
        loss_mask = loss_mask * ~rollout.truncated[:, None]
    return StepBatch(rollout=rollout, rewards=rewards, advantages=advantages,
                     ref_logp=ref_logp, old_logp=None, weights=batch_weights(run, loss_mask))


def _training_logits(run: Run, r: Rollout) -> torch.Tensor:
    cfg = run.cfg
    with autocast(run):
        if run.forward is None:
            return completion_logits(run.policy, r.input_ids, r.attention_mask,
                                     r.completion_length, cfg.temperature, cfg.logit_clamp)
        return run.forward(r.input_ids, r.attention_mask, r.completion_length,
                           cfg.temperature, cfg.logit_clamp)  # (b, C, V)


def _gradient_sync(run: Run, last: bool):
    """DDP all-reduces the gradients on the last micro-batch only; the others accumulate
    locally (no_sync). One process: nothing to do."""
    if last or not run.world.distributed:
        return nullcontext()
    return run.forward.no_sync()


def backward_pass(run: Run, loss: torch.Tensor) -> None:
    """loss.backward(), scaled: DDP averages gradients over ranks and the token weights are
    global, so the sum is wanted (x world size); fp16's GradScaler scales the loss."""
    loss = loss * run.world.world_size
    (run.scaler.scale(loss) if run.scaler else loss).backward()


def accumulate(run: Run, batch: StepBatch, loss_fn: LossFn,
               grad_accum_steps: int | None = None) -> dict:
    """Accumulate the gradient of the batch's loss over micro-batches into .grad.

    The token weights were computed on the whole batch, so the micro-batch losses sum to
    the full-batch loss and the accumulated gradient equals the full-batch one, for every
    loss type and any split. pi_old is the policy that sampled: the first pass takes it
    from its own forward (detached), so the ratio is exactly 1 there under every config
    (fp16, a logit clamp, a temperature), and later passes of mu compare against it.

    Returns this rank's detached totals: 'loss' (the sum), 'tokens', 'entropy_sum', and
    each stat of the loss as its token-weighted sum (a maximum for '...max_abs')."""
    k = grad_accum_steps or run.cfg.grad_accum_steps
    slices = micro_batch_slices(len(batch.rewards), k)
    olds, totals = [], {}
    for i, sl in enumerate(slices):
        part = batch.rows(sl)
        r, m = part.rollout, part.rollout.completion_mask.bool()
        with _gradient_sync(run, last=i == len(slices) - 1):
            logits = _training_logits(run, r)
            # padding positions get equal, finite inputs: nothing there can overflow into
            # the loss as 0 * inf = NaN
            logp = token_logprobs(logits, r.completion_ids).masked_fill(~m, 0.0)  # (b, C)
            old = logp.detach() if part.old_logp is None else part.old_logp
            loss, stats = loss_fn(logp, old, part.ref_logp, part.advantages, part.weights,
                                  run.cfg)
            backward_pass(run, loss)
        olds.append(old)
        n = (part.weights != 0).sum()
        sums = {"loss": loss.detach(), "tokens": n,
                "entropy_sum": (entropy_from_logits(logits.detach()) * m).sum()}
        for name, v in stats.items():
            v = torch.as_tensor(v, dtype=torch.float32, device=run.device).detach()
            sums[name] = v if name.endswith("max_abs") else v * n
        for name, v in sums.items():
            totals[name] = v if name not in totals else (
                torch.maximum(totals[name], v) if name.endswith("max_abs") else totals[name] + v)
    if batch.old_logp is None:  # pi_old as the first pass saw it, for the next passes
        batch.old_logp = torch.cat(olds)
    return totals


def global_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The norm of all the gradients together, in float32 (clip_grad_norm_'s, what TRL logs)."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm([g.float() for g in grads])))


def is_spike(grad_norm: float, recent, factor: float | None) -> bool:
    """The spike rule: a finite grad norm above factor x the median of the recent norms, once
    there are SPIKE_MIN_HISTORY of them (None: no rule)."""
    return (factor is not None and math.isfinite(grad_norm)
            and len(recent) >= SPIKE_MIN_HISTORY and grad_norm > factor * statistics.median(recent))


def guarded_update(run: Run) -> tuple[float, int]:
    """The update after backward: the grad norm (before clipping: what TRL logs), the
    safety rules the config switches on (skip a non-finite or spiking update), clipping,
    the optimizer step. Returns (grad_norm, skipped: 0 or 1)."""
    cfg, params = run.cfg, list(run.policy.parameters())
    if run.scaler:
        run.scaler.unscale_(run.optimizer)
    total_norm = global_grad_norm([p.grad for p in params if p.grad is not None])
    grad_norm = total_norm.item()
    run.last_grad_norm = grad_norm
    finite = math.isfinite(grad_norm)
    if not finite and run.first_bad_grad is None:
        where = first_nonfinite_grad(run.policy)
        if where is None:  # every entry finite: their sum of squares overflowed float32
            largest = max(float(p.grad.abs().max()) for p in params if p.grad is not None)
            where = f"every entry finite, the norm overflowed float32 (largest |entry| {largest:.3g})"
        run.first_bad_grad = f"step {run.step_count + 1}: {where}"
    skip = (cfg.skip_nonfinite_grad and not finite) or is_spike(
        grad_norm, run.recent_grad_norms, cfg.spike_skip_factor)
    if finite:
        # skipped norms count too, so a lasting shift in scale is absorbed within a window
        # instead of freezing training behind a stale median
        run.recent_grad_norms.append(grad_norm)
    if skip:
        run.optimizer.zero_grad(set_to_none=True)
        if run.scaler:
            # the scaler saw this step's unscale_; update() must still run, or the next
            # scaler.step raises "No inf checks were recorded" (report 004)
            run.scaler.update()
        return grad_norm, 1
    if cfg.max_grad_norm is not None:
        # clip_grad_norm_ would compute the same norm again
        torch.nn.utils.clip_grads_with_norm_(params, cfg.max_grad_norm, total_norm)
    if run.scaler:
        scale = run.scaler.get_scale()
        run.scaler.step(run.optimizer)
        run.scaler.update()
        if run.scaler.get_scale() < scale:  # the scaler found inf and skipped the step
            return grad_norm, 1
    else:
        run.optimizer.step()
    return grad_norm, 0


def check_health(run: Run) -> int:
    """Count non-finite parameters; with health_check on, roll back to the last healthy
    snapshot when any are found, else take one every snapshot_every steps. Returns 1 if
    this step was rolled back."""
    # one cheap foreach check; the exact (slower) count only when it fails
    run.last_nonfinite_params = 0 if all_finite(run.policy) else nonfinite_params(run.policy)
    if not run.cfg.health_check:
        return 0
    if run.last_nonfinite_params:
        run.snapshot.restore(run.policy, run.optimizer)
        return 1
    if run.step_count % run.cfg.snapshot_every == 0:
        run.snapshot = Snapshot(run.policy, run.optimizer, run.step_count)
    return 0


# ---- the step ----------------------------------------------------------------------------
def grpo_step(run: Run, problems: list[Problem], loss_fn: LossFn = grpo_loss,
              update_fn: Callable = guarded_update, sample_fn: Callable | None = None) -> dict:
    """One GRPO step: sample and score, then mu updates on that batch, the health check,
    the metrics. `problems`: this rank's share of the step's prompts."""
    cfg = run.cfg
    run.last_batch = None  # the last step's batch goes before this one is sampled
    batch = make_batch(run, problems, sample_fn)
    run.last_batch = batch
    skipped = 0
    for _ in range(cfg.num_iterations):
        run.optimizer.zero_grad(set_to_none=True)
        totals = accumulate(run, batch, loss_fn)
        grad_norm, was_skipped = update_fn(run)
        skipped += was_skipped
    run.step_count += 1
    run.rolled_back = check_health(run)
    return step_metrics(run, batch, totals, grad_norm, skipped)


def step_metrics(run: Run, batch: StepBatch, totals: dict, grad_norm: float,
                 skipped: int) -> dict:
    """The step's metrics, TRL's names, over the global batch: sums over this rank's rows,
    then over ranks (one all_reduce, read back by name)."""
    totals = dict(totals)
    maxima = {k: totals.pop(k) for k in list(totals) if k.endswith("max_abs")}
    group_std = batch.rewards.view(-1, run.cfg.group_size).std(dim=1)
    one = torch.ones((), device=run.device)
    local = {
        "reward_sum": batch.rewards.sum(), "reward_sq_sum": (batch.rewards ** 2).sum(),
        "n_rows": one * len(batch.rewards), "std_sum": group_std.sum(),
        "n_zero_std": (group_std == 0).sum().float(), "n_groups": one * len(group_std),
        "n_truncated": batch.rollout.truncated.sum().float(),
        "length_sum": batch.rollout.completion_mask.sum().float(),
        **{k: v.float() for k, v in totals.items()},
    }
    s = dict(zip(local, distributed.all_reduce(torch.stack(list(local.values())),
                                               run.world).tolist(), strict=True))
    if maxima:
        top = distributed.all_reduce(torch.stack(list(maxima.values())).float(), run.world,
                                     distributed.dist.ReduceOp.MAX).tolist()
        maxima = dict(zip(maxima, top, strict=True))
    n_rows, n_groups = s["n_rows"], s["n_groups"]
    n_tokens, n_completion = max(s["tokens"], 1.0), max(s["length_sum"], 1.0)
    reward_mean = s["reward_sum"] / n_rows
    # TRL's reward_std: the std of all the batch's rewards (Bessel-corrected)
    reward_var = max(s["reward_sq_sum"] - n_rows * reward_mean**2, 0.0) / max(n_rows - 1, 1.0)
    stats = {k: v / n_tokens for k, v in s.items() if k in totals
             and k not in ("loss", "tokens", "entropy_sum")}
    return {
        "step": run.step_count,
        "reward": reward_mean,
        "reward_std": math.sqrt(reward_var),
        "reward_std/group_mean": s["std_sum"] / n_groups,
        "frac_reward_zero_std": s["n_zero_std"] / n_groups,
        "loss": s["loss"],
        "kl": 0.0,
        "clip_ratio/region_mean": 0.0,
        **stats,
        "grad_norm": grad_norm,
        "entropy": s["entropy_sum"] / n_completion,
        "completions/mean_length": s["length_sum"] / n_rows,
        "completions/clipped_ratio": s["n_truncated"] / n_rows,
        **maxima,
        "skipped": skipped,
        "rolled_back": run.rolled_back,
        "nonfinite_params": run.last_nonfinite_params,
    }
