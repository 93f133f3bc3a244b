"""The GRPO trainer, readable top to bottom: `Trainer.step()` is one GRPO step.

    sample G completions per prompt (old policy = the sampling policy)
    score them -> group-normalised advantages
    one no-grad forward of the frozen reference for the KL term
    for each of mu iterations: accumulate gradients over micro-batches, then one update
    safety rules (each a config switch): skip non-finite / spiking updates, clip,
    check parameter health and roll back to the last healthy snapshot

Every step returns (and the CLI writes) one dict of metrics named as in TRL.
Under `torchrun` / `accelerate launch` the same code runs data-parallel (see distributed.py).
"""

from __future__ import annotations

import gc
import json
import math
import os
import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from . import distributed, naive
from .config import CHECKPOINT, METRICS, ConfigError, GRPOConfig
from .fast import CompletionLogits, fuse_gelu, fused_adamw, keep_fused, shared_prompt_logits
from .health import (
    Snapshot,
    all_finite,
    first_nonfinite_grad,
    first_nonfinite_param,
    nonfinite_params,
)
from .models import disable_dropout, frozen_copy, requested_device, resolve_device
from .objective import (
    clipped_surrogate,
    completion_logits,
    entropy_from_logits,
    group_advantages,
    kl_k3,
    token_logprobs,
    token_weights,
)
from .policy import load_policy
from .sampling import Rollout, greedy_accuracy, sample_group
from .tasks import (
    MAX_OPERAND,
    ProblemStream,
    addition_reward,
    checked_rewards,
    eval_problems,
    make_problem,
)

SPIKE_WINDOW = 20  # recent finite grad norms the spike rule takes its median over
SPIKE_MIN_HISTORY = 5  # recent grad norms needed before the spike rule has a baseline


def micro_batch_slices(n: int, k: int) -> list[slice]:
    """Split range(n) into k contiguous, non-empty slices (sizes differ by at most 1).

    Report 004's chunking computed `n // k` rows per chunk, which is 0 when n < k and
    gives an empty micro-batch ('batch size must be positive'); this refuses that case."""
    if not 1 <= k <= n:
        raise ValueError(f"cannot split {n} rows into {k} non-empty micro-batches")
    sizes = [n // k + (1 if i < n % k else 0) for i in range(k)]
    starts = [sum(sizes[:i]) for i in range(k)]
    return [slice(s, s + z) for s, z in zip(starts, sizes, strict=True)]


@dataclass
class StepBatch:
    """What one step's loss needs. B = prompts x G rows, C completion columns."""

    rollout: Rollout
    rewards: torch.Tensor  # (B,)
    advantages: torch.Tensor  # (B,)
    ref_logp: torch.Tensor | None  # (B, C) frozen reference, None when beta = 0 (and not naive)
    # (B, C) pi_old, the policy that sampled, on the training path: None until the first
    # pass of the update computes it (see Trainer.micro_batch_loss)
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


class Trainer:
    def __init__(
        self,
        cfg: GRPOConfig,
        model=None,
        tokenizer=None,
        reward_fn: Callable = addition_reward,
        out_dir: str | Path | None = None,
        fast: bool = True,
    ):
        """`fast=False` turns off the two speedups of fast.py that change float rounding
        (the fused GELU and each prompt's forward run once per group): the forwards are
        then the plain ones of objective.py, which a hand-written step computes bit for bit
        (notebook 11 compares the two)."""
        self.cfg, self.fast = cfg, fast
        self._join_processes()
        if model is None:
            model, tokenizer = load_policy(cfg.profile, cfg.model_path)
        elif tokenizer is None:
            raise ValueError("pass the tokenizer together with the model")
        self._check_fits(model)
        self._build_models(model, tokenizer)
        self.optimizer = fused_adamw(
            self.policy.parameters(), self.device, lr=cfg.learning_rate,
            weight_decay=cfg.weight_decay,
        )
        self.scaler = torch.amp.GradScaler(self.device.type) if cfg.amp == "fp16" else None
        self.reward_fn = reward_fn
        self.stream = ProblemStream(cfg.seed)
        self.eval_set = eval_problems(cfg.eval_size)
        # the loop's state
        self.step_count = 0
        self.recent_grad_norms: deque[float] = deque(maxlen=SPIKE_WINDOW)
        self.first_bad_grad: str | None = None  # recorded before a skip clears the grads
        self.last_nonfinite_params = 0
        self.end_step = cfg.steps
        self.history: list[dict] = []
        self.snapshot = Snapshot(self.policy, self.optimizer, 0) if cfg.health_check else None
        self.out_dir = Path(out_dir) if out_dir is not None else None

    def _join_processes(self) -> None:
        """The process group (one process: none), this rank's device, and the seeds."""
        cfg = self.cfg
        world_size = distributed.world_from_env().world_size
        if cfg.prompts_per_step % world_size:
            raise ConfigError(
                f"GRPOConfig.prompts_per_step must be divisible by the number of processes "
                f"({world_size}) so each rank gets whole groups (got {cfg.prompts_per_step})"
            )
        device = requested_device(cfg.device, cfg.profile)
        self.world, rank_device = distributed.setup(device)
        self.device = rank_device or resolve_device(device)
        # ranks sample different completions; prompts come from the shared stream
        torch.manual_seed(cfg.seed + self.world.rank)
        random.seed(cfg.seed)

    def _check_fits(self, model) -> None:
        """A prompt and its completion must fit the model's positions."""
        # every task prompt has at most 6 characters, and no tokenizer makes more tokens than that
        longest = len(make_problem(MAX_OPERAND, MAX_OPERAND).prompt)
        n_positions = getattr(model.config, "n_positions", None)
        if n_positions is not None and longest + self.cfg.max_new_tokens > n_positions:
            raise ConfigError(
                f"GRPOConfig.max_new_tokens must be <= {n_positions - longest} for this model "
                f"(prompts up to {longest} tokens, {n_positions} positions; got "
                f"{self.cfg.max_new_tokens})"
            )

    def _build_models(self, model, tokenizer) -> None:
        """The policy on this rank's device, the frozen reference, the module the training
        forward runs through, and the surrogate the config chooses."""
        cfg = self.cfg
        self.policy = disable_dropout(model.to(self.device)).train()
        if self.fast:
            fuse_gelu(self.policy)  # fast.py
        if cfg.gradient_checkpointing:
            # only active in train mode: sampling runs in eval mode, with its KV cache
            self.policy.activation_checkpointing_enable({"use_reentrant": False})
        self.tokenizer = tokenizer
        # the reference is the starting policy, frozen: KL and (naive) the ratio use it
        needs_ref = cfg.beta > 0 or cfg.ratio_against == "reference"
        self.reference = frozen_copy(self.policy) if needs_ref else None
        # the module the training forward runs through: DDP all-reduces gradients in
        # backward(); generation and no-grad forwards use the bare policy. The G rows of a
        # group share their prompt's forward (fast.py) except under activation
        # checkpointing, which drops the KV cache that needs
        self.model = CompletionLogits(self.policy,
                                      share_prompts=self.fast and not cfg.gradient_checkpointing)
        # the field reports' variants, when the config asks for them (naive.py)
        self.surrogate = (
            clipped_surrogate if cfg.clip_term == "clipped_ratio" else naive.constant_clip_surrogate
        )
        if self.world.distributed:
            self.model = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )

    # ---- one step ------------------------------------------------------------------------
    def _autocast(self):
        if self.cfg.amp == "none":
            return nullcontext()
        dtype = torch.bfloat16 if self.cfg.amp == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def make_batch(self) -> StepBatch:
        """Sample, score, and compute everything the loss needs that does not change
        during the update: advantages, sampling-time and reference log-probs, weights."""
        cfg = self.cfg
        # every rank draws the same global prompts and keeps its share
        problems = self.stream.sample(cfg.prompts_per_step)[
            distributed.shard(cfg.prompts_per_step, self.world)
        ]
        rollout = sample_group(
            self.policy, self.tokenizer, [p.prompt for p in problems], cfg.group_size,
            cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, safe=cfg.safe_sampling,
            logit_clamp=cfg.logit_clamp,
        )
        # the columns a reward function gets besides the completions (TRL's **kwargs)
        columns = {"answer": [p.answer for p in problems for _ in range(cfg.group_size)],
                   "truncated": rollout.truncated.tolist()}
        if cfg.check_rewards:
            scores = checked_rewards(self.reward_fn, rollout.completions, cfg.reward_timeout,
                                     **columns)
        else:  # the reports' code: whatever comes back is trained on
            scores = self.reward_fn(rollout.completions, **columns)
        rewards = torch.tensor(scores, dtype=torch.float32, device=self.device)  # (B,)
        advantages = group_advantages(
            rewards, cfg.group_size, cfg.advantage_eps, cfg.scale_rewards
        )  # (B,)
        if cfg.advantage_clamp is not None:
            advantages = advantages.clamp(-cfg.advantage_clamp, cfg.advantage_clamp)
        ref_logp = None
        if self.reference is not None:
            with torch.no_grad(), self._autocast():
                forward = shared_prompt_logits if self.fast else completion_logits
                logits = forward(
                    self.reference, rollout.input_ids, rollout.attention_mask,
                    rollout.completion_length, cfg.temperature, cfg.logit_clamp,
                )  # (B, C, V)
                ref_logp = token_logprobs(logits, rollout.completion_ids)  # (B, C)
        loss_mask = rollout.completion_mask  # (B, C)
        if cfg.mask_truncated_completions:  # cut-off rows carry no loss (TRL's switch)
            loss_mask = loss_mask * ~rollout.truncated[:, None]
        return StepBatch(
            rollout=rollout, rewards=rewards, advantages=advantages, ref_logp=ref_logp,
            old_logp=None, weights=self.batch_weights(loss_mask),
        )

    def batch_weights(self, completion_mask: torch.Tensor) -> torch.Tensor:
        """(B, C) -> (B, C) token weights normalised over the global batch: this rank's
        rows times the world size, and the completion tokens summed over ranks."""
        n_tokens = distributed.all_reduce(completion_mask.sum().float(), self.world)
        return token_weights(
            completion_mask, self.cfg.loss_type, self.cfg.max_new_tokens,
            n_sequences=completion_mask.shape[0] * self.world.world_size, n_tokens=n_tokens,
        )

    def micro_batch_loss(self, part: StepBatch) -> tuple[torch.Tensor, dict]:
        """The GRPO loss of some rows of the batch, and what the metrics need of it.

            r_t = pi_theta(o_t) / pi_old(o_t)
            L   = sum_t w_t * (-min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) + beta * k3_t)

        pi_old is the policy that sampled. The first pass of an update computes it here,
        from this forward (detached), so the ratio is exactly 1 there under every config
        (fp16, a logit clamp, a temperature) and the later passes of mu compare against it
        (as TRL does)."""
        cfg, r = self.cfg, part.rollout
        C, m = r.completion_length, r.completion_mask.bool()
        with self._autocast():
            logits = self.model(r.input_ids, r.attention_mask, C, cfg.temperature,
                                cfg.logit_clamp)  # (b, C, V)
        # padding positions get equal, finite inputs: nothing there can overflow into the
        # loss as 0 * inf = NaN
        logp = token_logprobs(logits, r.completion_ids).masked_fill(~m, 0.0)  # (b, C)
        if part.old_logp is None:
            part.old_logp = logp.detach()
        ratio_logp, ratio_base = self.ratio_inputs(logp, part)  # (b, C) each
        per_token, region_clipped = self.surrogate(
            ratio_logp, ratio_base, part.advantages, cfg.epsilon_low, cfg.epsilon_high,
            cfg.log_ratio_clamp,
        )  # (b, C)
        kl = torch.zeros_like(logp)
        if cfg.beta > 0:
            kl = kl_k3(logp, part.ref_logp.masked_fill(~m, 0.0))  # (b, C)
            per_token = per_token + cfg.beta * kl
        loss = (per_token * part.weights).sum()
        return loss, {
            "loss": loss.detach(), "kl": (kl.detach() * m).sum(),
            "clipped": (region_clipped & m).sum(),
            "entropy": (entropy_from_logits(logits.detach()) * m).sum(),
            "max_log_ratio": (ratio_logp.detach() - ratio_base).abs().masked_fill(~m, 0).max(),
        }

    def ratio_inputs(self, logp: torch.Tensor, part: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(b, C) log-probs now and of the policy the ratio compares with: pi_old, or for
        the naive preset the frozen reference, summed per sequence (report 001)."""
        m = part.rollout.completion_mask
        base = part.old_logp if self.cfg.ratio_against == "old" else part.ref_logp
        if self.cfg.ratio_level == "sequence":
            return naive.sequence_log_ratio_inputs(logp, base, m)
        return logp, base.masked_fill(~m.bool(), 0.0)

    def backward(self, batch: StepBatch, grad_accum_steps: int | None = None) -> dict:
        """Accumulate the gradient of the step's loss over micro-batches into .grad.

        The token weights were computed on the whole batch, so the micro-batch losses sum
        to the full-batch loss and the accumulated gradient equals the full-batch one, for
        every loss type and any split. Returns detached sums for the metrics."""
        slices = micro_batch_slices(len(batch.rewards), grad_accum_steps or self.cfg.grad_accum_steps)
        parts, totals = [], {}
        for i, sl in enumerate(slices):
            part = batch.rows(sl)
            with self._gradient_sync(last=i == len(slices) - 1):
                loss, stats = self.micro_batch_loss(part)
                self._backward_pass(loss)
            parts.append(part)
            for k, v in stats.items():  # sums, and the largest |log-ratio|
                totals[k] = v if k not in totals else (
                    torch.maximum(totals[k], v) if k == "max_log_ratio" else totals[k] + v)
        if batch.old_logp is None:  # pi_old as the first pass saw it, for the next passes
            batch.old_logp = torch.cat([p.old_logp for p in parts])
        return totals

    def _gradient_sync(self, last: bool):
        """DDP all-reduces the gradients on the last micro-batch only; the others
        accumulate locally (no_sync). One process: nothing to do."""
        if last or not self.world.distributed:
            return nullcontext()
        return self.model.no_sync()

    def _backward_pass(self, loss: torch.Tensor) -> None:
        # DDP averages gradients over ranks; the token weights are global, so the sum is
        # wanted: scale by the world size. fp16: GradScaler scales the loss
        loss = loss * self.world.world_size
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def update(self, batch: StepBatch) -> tuple[dict, int]:
        """mu optimizer updates on one sampled batch. Returns the last pass's loss stats
        and how many updates a safety rule skipped."""
        skipped = 0
        for _ in range(self.cfg.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            stats = self.backward(batch)
            skipped += self._update()
        return stats, skipped

    def step(self) -> dict:
        """One GRPO step: sample and score, then mu optimizer updates on that batch."""
        cfg = self.cfg
        t0 = time.perf_counter()
        batch = self.make_batch()
        stats, skipped = self.update(batch)
        self.step_count += 1
        rolled_back = self._check_health()

        mask = batch.rollout.completion_mask
        group_std = batch.rewards.view(-1, cfg.group_size).std(dim=1)
        # sums over this rank's rows, then over ranks (one all_reduce, read back by name):
        # the global batch's metrics
        local = {
            "reward_sum": batch.rewards.sum(), "reward_sq_sum": (batch.rewards ** 2).sum(),
            "n_rows": torch.tensor(float(len(batch.rewards)), device=self.device),
            "std_sum": group_std.sum(), "n_zero_std": (group_std == 0).sum().float(),
            "n_groups": torch.tensor(float(len(group_std)), device=self.device),
            "n_truncated": batch.rollout.truncated.sum().float(),
            "loss": stats["loss"].float(), "kl_sum": stats["kl"].float(),
            "clipped": stats["clipped"].float(), "entropy_sum": stats["entropy"].float(),
            "tokens": mask.sum().float(),
        }
        s = dict(zip(local, distributed.all_reduce(torch.stack(list(local.values())),
                                                   self.world).tolist(), strict=True))
        reward_sum, n_rows, n_groups, tokens = s["reward_sum"], s["n_rows"], s["n_groups"], s["tokens"]
        n_tokens = max(tokens, 1.0)
        max_log_ratio = distributed.all_reduce(
            stats["max_log_ratio"].detach().float().clone(), self.world, distributed.dist.ReduceOp.MAX
        ).item()
        reward_mean = reward_sum / n_rows
        # TRL's reward_std: the std of all the batch's rewards (Bessel-corrected)
        reward_var = max(s["reward_sq_sum"] - n_rows * reward_mean**2, 0.0) / max(n_rows - 1, 1.0)
        metrics = {
            "step": self.step_count,
            "reward": reward_mean,
            "reward_std": math.sqrt(reward_var),
            "reward_std/group_mean": s["std_sum"] / n_groups,
            "frac_reward_zero_std": s["n_zero_std"] / n_groups,
            "loss": s["loss"],
            "kl": s["kl_sum"] / n_tokens,
            "clip_ratio/region_mean": s["clipped"] / n_tokens,
            "grad_norm": self.last_grad_norm,
            "entropy": s["entropy_sum"] / n_tokens,
            "completions/mean_length": tokens / n_rows,
            "completions/clipped_ratio": s["n_truncated"] / n_rows,
            "log_ratio/max_abs": max_log_ratio,
            "skipped": skipped,
            "rolled_back": rolled_back,
            "nonfinite_params": self.last_nonfinite_params,
        }
        if self._eval_due() and self.world.is_main:
            metrics["eval/accuracy"] = self.evaluate()
        metrics["step_time"] = time.perf_counter() - t0
        self.history.append(metrics)
        return metrics

    def _update(self) -> int:
        """Grad norm, safety rules, then the optimizer step. Returns 1 if skipped."""
        cfg, params = self.cfg, list(self.policy.parameters())
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in params if p.grad is not None]
        # the norm before clipping: what TRL logs as grad_norm
        grad_norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
        ).item()
        self.last_grad_norm = grad_norm
        finite = math.isfinite(grad_norm)
        if not finite and self.first_bad_grad is None:
            self.first_bad_grad = f"step {self.step_count + 1}: {first_nonfinite_grad(self.policy)}"
        skip = False
        if cfg.skip_nonfinite_grad and not finite:
            skip = True
        if cfg.spike_skip_factor is not None and finite and len(self.recent_grad_norms) >= SPIKE_MIN_HISTORY:
            if grad_norm > cfg.spike_skip_factor * statistics.median(self.recent_grad_norms):
                skip = True
        if finite:
            # skipped norms count too, so a lasting shift in scale is absorbed within a
            # window instead of freezing training behind a stale median
            self.recent_grad_norms.append(grad_norm)
        if skip:
            self.optimizer.zero_grad(set_to_none=True)
            if self.scaler:
                # the scaler saw this step's unscale_; update() must still run, or the next
                # scaler.step raises "No inf checks were recorded" (report 004)
                self.scaler.update()
            return 1
        if cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        if self.scaler:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if self.scaler.get_scale() < scale:  # the scaler found inf and skipped the step
                return 1
        else:
            self.optimizer.step()
        return 0

    def _check_health(self) -> int:
        """Count non-finite parameters; with health_check on, roll back when any are found.
        Returns 1 if this step was rolled back."""
        # one cheap foreach check; the exact (slower) count only when it fails
        self.last_nonfinite_params = (
            0 if all_finite(self.policy) else nonfinite_params(self.policy)
        )
        if not self.cfg.health_check:
            return 0
        if self.last_nonfinite_params:
            self.snapshot.restore(self.policy, self.optimizer)
            return 1
        if self.step_count % self.cfg.snapshot_every == 0:
            self.snapshot = Snapshot(self.policy, self.optimizer, self.step_count)
        return 0

    def _eval_due(self) -> bool:
        every = self.cfg.eval_every
        return self.step_count == self.end_step or (every > 0 and self.step_count % every == 0)

    def evaluate(self) -> float:
        """Greedy accuracy on the fixed held-out set."""
        return greedy_accuracy(self.policy, self.tokenizer, self.eval_set, self.cfg.max_new_tokens,
                               safe=self.cfg.safe_sampling)

    # ---- the loop ------------------------------------------------------------------------
    def train(self, steps: int | None = None, progress: bool = True, callback=None) -> list[dict]:
        """Run until `steps` (default cfg.steps) steps are done. With out_dir set, writes
        metrics.jsonl (eval/accuracy at step 0 too), checkpoints and resumes from them."""
        from tqdm.auto import tqdm

        total = self.cfg.steps if steps is None else steps
        self.end_step = total
        if self.step_count == 0 and not self.history and self.world.is_main:
            start = {"step": 0, "eval/accuracy": self.evaluate(), "nonfinite_params": 0}
            self.history.append(start)
            self._write_metrics(start)
        bar = tqdm(total=total, initial=self.step_count,
                   disable=not progress or not self.world.is_main, desc="GRPO",
                   unit="step", dynamic_ncols=True)
        try:
            while self.step_count < total:
                m = self.step()
                self._write_metrics(m)
                if self._checkpoint_due():
                    self.save_checkpoint()
                bar.update(1)
                bar.set_postfix(progress_postfix(m))
                if callback is not None:
                    callback(m)
        finally:
            bar.close()
        return self.history

    def _checkpoint_due(self) -> bool:
        if self.out_dir is None:
            return False
        every = self.cfg.checkpoint_every
        return self.step_count == self.end_step or (every > 0 and self.step_count % every == 0)

    def _write_metrics(self, m: dict) -> None:
        if self.out_dir is None or not self.world.is_main:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with open(self.out_dir / METRICS, "a") as f:
            f.write(to_json_line(m))

    # ---- checkpoints ---------------------------------------------------------------------
    def state(self) -> dict:
        return {
            "format": 1,
            "config": self.cfg.to_dict(),
            "step": self.step_count,
            "policy": self.policy.state_dict(),
            "reference": self.reference.state_dict() if self.reference is not None else None,
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "recent_grad_norms": list(self.recent_grad_norms),
            "torch_rng": torch.get_rng_state(),
            "world_size": self.world.world_size,
            # each rank samples with its own generator; all of them for an exact resume
            "rng_per_rank": distributed.gather_objects(self._rank_rng_state(), self.world),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "python_rng": random.getstate(),
            "stream_rng": self.stream.state(),
        }

    def _rank_rng_state(self) -> dict:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return {"cpu": torch.get_rng_state(), "cuda": cuda}

    def save_checkpoint(self, path: str | Path | None = None) -> Path:
        """Write the checkpoint atomically: a temporary file, fsync, then rename over the
        old one, so a crash mid-write leaves the previous checkpoint intact. Under DDP
        every rank calls this (the RNG states are gathered) and rank 0 writes."""
        bad = nonfinite_params(self.policy)  # now, after any rollback
        if bad:
            raise RuntimeError(
                f"refusing to checkpoint step {self.step_count}: {bad} non-finite parameters"
            )
        path = Path(path) if path is not None else self.out_dir / CHECKPOINT
        state = self.state()
        if not self.world.is_main:
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

    def load_checkpoint(self, path: str | Path | None = None) -> None:
        path = Path(path) if path is not None else self.out_dir / CHECKPOINT
        state = torch.load(path, map_location=self.device, weights_only=False)
        self.policy.load_state_dict(state["policy"])
        if self.reference is not None and state["reference"] is not None:
            self.reference.load_state_dict(state["reference"])
        self.optimizer.load_state_dict(state["optimizer"])
        keep_fused(self.optimizer)
        if self.scaler and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        saved_world = state.get("world_size", 1)
        if saved_world != self.world.world_size:
            raise ConfigError(
                f"the checkpoint in {path} was written by {saved_world} process(es) and this "
                f"run has {self.world.world_size}; resume with the same number of processes "
                f"(--nproc_per_node {saved_world}) to continue it exactly"
            )
        self.step_count = state["step"]
        self.recent_grad_norms = deque(state["recent_grad_norms"], maxlen=SPIKE_WINDOW)
        if "rng_per_rank" in state:
            mine = state["rng_per_rank"][self.world.rank]
            torch.set_rng_state(mine["cpu"].cpu())
            if mine["cuda"] is not None and self.device.type == "cuda":
                torch.cuda.set_rng_state(mine["cuda"].cpu(), self.device)
        else:  # a checkpoint from before DDP support
            torch.set_rng_state(state["torch_rng"].cpu())
        if state["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda_rng"]])
        random.setstate(state["python_rng"])
        self.stream.set_state(state["stream_rng"])
        self.last_nonfinite_params = 0
        if self.cfg.health_check:
            self.snapshot = Snapshot(self.policy, self.optimizer, self.step_count)
        self.history = [m for m in read_metrics(self.out_dir) if m["step"] <= self.step_count] \
            if self.out_dir is not None and (self.out_dir / METRICS).exists() else []
        if self.out_dir is not None and self.world.is_main:
            # drop metrics of steps after the checkpoint: they rerun
            tmp = self.out_dir / (METRICS + ".tmp")
            with open(tmp, "w") as f:
                f.writelines(to_json_line(m) for m in self.history)
            os.replace(tmp, self.out_dir / METRICS)

    def close(self, failed: bool = False) -> None:
        """Leave the process group of a data-parallel run (a no-op in one process); after
        a failure, without waiting for the other ranks."""
        if self.world.distributed:
            if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
                self.model = self.model.module  # the wrapper must go before its process group
            gc.collect()
            distributed.shutdown(wait_for_others=not failed)  # a no-op once left

    # ---- diagnosis -----------------------------------------------------------------------
    def diagnosis(self) -> str:
        """What a person needs after a crash: where health was last fine, what broke first,
        and the grad-norm history leading up to it."""
        steps = [m for m in self.history if "grad_norm" in m]
        healthy = [m["step"] for m in self.history if m.get("nonfinite_params", 0) == 0]
        last_healthy = max(healthy) if healthy else None
        bad_param = first_nonfinite_param(self.policy)
        bad_grad = self.first_bad_grad or first_nonfinite_grad(self.policy)
        norms = ", ".join(f"{m['step']}: {m['grad_norm']:.3g}" for m in steps[-8:])
        median = statistics.median([m["grad_norm"] for m in steps]) if steps else float("nan")
        lines = [
            f"last healthy step: {last_healthy} (steps completed: {self.step_count})",
            f"first non-finite parameter: {bad_param or 'none'}",
            f"first non-finite gradient: {bad_grad or 'none'}",
            f"grad norm (step: value), last {min(8, len(steps))}: {norms or 'none'}",
            f"grad norm median over the run: {median:.3g}",
        ]
        return "\n".join(lines)


def progress_postfix(m: dict) -> dict:
    """What a step's progress bar shows after the count: reward, grad norm, eval accuracy."""
    postfix = {"reward": f"{m['reward']:.2f}", "grad_norm": f"{m['grad_norm']:.3g}"}
    if "eval/accuracy" in m:
        postfix["acc"] = f"{m['eval/accuracy']:.2f}"
    return postfix


def to_json_line(m: dict) -> str:
    """Strict JSON: a non-finite number (a NaN grad norm) is written as null."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
             for k, v in m.items()}
    return json.dumps(clean, allow_nan=False) + "\n"


def without_timing(metrics: list[dict]) -> list[dict]:
    """The metrics minus step_time: what must be identical between a resumed run and an
    uninterrupted one (wall time never is)."""
    return [{k: v for k, v in m.items() if k != "step_time"} for m in metrics]


def read_metrics(out_dir: str | Path) -> list[dict]:
    """The metrics of a run; null (a non-finite value) reads back as NaN. A last line cut
    short by a kill mid-write is dropped: that step is redone on resume."""
    with open(Path(out_dir) / METRICS) as f:
        lines = [line for line in f if line.strip()]
    out = []
    for i, line in enumerate(lines):
        try:
            m = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise
        out.append({k: (math.nan if v is None else v) for k, v in m.items()})
    return out
