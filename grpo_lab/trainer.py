"""The GRPO trainer: the loop around one GRPO step (step.py), readable top to bottom.

    Trainer(cfg) builds the run: the policy, its frozen reference, AdamW, the prompt stream
    train(): for each step, the step function on this rank's prompts, then what a loop owns:
    held-out evaluation, metrics.jsonl, atomic checkpoints and exact resume, a progress bar

The step is any function `step_fn(run, problems) -> metrics` that adds 1 to
run.step_count: by default the engine's `step.grpo_step` with the loss the config chooses;
the course passes the learner's own step (course/steps.py). Every step's metrics are named
as in TRL. Under `torchrun` / `accelerate launch` the engine's step runs data-parallel (see
distributed.py).
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
from functools import partial
from pathlib import Path

import torch

from . import distributed
from .config import CHECKPOINT, METRICS, ConfigError, GRPOConfig
from .fast import CompletionLogits, fuse_gelu, fused_adamw, keep_fused
from .graphs import graphed
from .health import (
    Snapshot,
    all_finite,
    first_nonfinite_grad,
    first_nonfinite_param,
    nonfinite_params,
)
from .models import disable_dropout, frozen_copy, requested_device, resolve_device
from .policy import load_policy
from .sampling import greedy_accuracy
from .step import (
    SPIKE_WINDOW,
    Run,
    StepBatch,
    accumulate,
    check_health,
    grpo_step,
    guarded_update,
    loss_for,
    make_batch,
    micro_batch_slices,
    needs_reference,
    step_argument,
)
from .tasks import MAX_OPERAND, ProblemStream, addition_reward, eval_problems, make_problem

__all__ = ["Trainer", "Run", "StepBatch", "StepError", "micro_batch_slices", "read_metrics",
           "to_json_line", "without_timing", "progress_postfix", "diagnosis"]

# what a Trainer reads and writes of its run under the same names (one copy of the state)
_RUN_FIELDS = ("cfg", "policy", "reference", "optimizer", "tokenizer", "reward_fn", "stream",
               "step_count", "history", "recent_grad_norms", "snapshot", "device", "world",
               "scaler", "fast", "first_bad_grad", "last_nonfinite_params", "last_grad_norm")


class StepError(RuntimeError):
    """A step function that breaks the loop's contract (message in the learner's terms)."""


def check_step_result(metrics, steps_before: int, steps_after: int) -> None:
    """What the loop needs of each step: a dict of metrics back, and run.step_count one
    higher than before it. A step that never counts would keep the loop running forever,
    silently; one that returns no dict would fail later, far from the cause."""
    if not isinstance(metrics, dict):
        raise StepError(f"your step returned {type(metrics).__name__}, not the step's metrics: "
                        "return a dict (notebook 04, section 6: `return step_metrics(...)`)")
    if steps_after != steps_before + 1:
        raise StepError(
            f"your step left run.step_count at {steps_after} (it was {steps_before} before the "
            "step): a step must add 1 to it (`run.step_count += 1`, notebook 04, section 6); "
            "train() counts the steps with it, and would otherwise never stop")


class Trainer:
    def __init__(
        self,
        cfg: GRPOConfig,
        model=None,
        tokenizer=None,
        reward_fn: Callable = addition_reward,
        out_dir: str | Path | None = None,
        fast: bool = True,
        step_fn: Callable | None = None,
    ):
        """`fast=False` turns off the two speedups of fast.py that change float rounding
        (the fused GELU and each prompt's forward run once per group): the forwards are
        then the plain ones of objective.py, which a hand-written step computes bit for bit
        (notebook 11 compares the two). `step_fn`: the step to loop over (default: the
        engine's grpo_step with the loss the config chooses)."""
        world, device = self._join_processes(cfg)
        if model is None:
            model, tokenizer = load_policy(cfg.profile, cfg.model_path)
        elif tokenizer is None:
            raise ValueError("pass the tokenizer together with the model")
        self._check_fits(cfg, model)
        policy, forward = self._build_models(cfg, model, device, world, fast)
        optimizer = fused_adamw(policy.parameters(), device, lr=cfg.learning_rate,
                                weight_decay=cfg.weight_decay)
        self.run = Run(
            cfg=cfg, policy=policy, optimizer=optimizer,
            # the starting policy, frozen, where something uses it
            reference=frozen_copy(policy) if needs_reference(cfg, step_fn) else None,
            tokenizer=tokenizer, reward_fn=reward_fn, stream=ProblemStream(cfg.seed),
            eval_problems=eval_problems(cfg.eval_size), device=device, world=world,
            forward=forward, fast=fast,
            scaler=torch.amp.GradScaler(device.type) if cfg.amp == "fp16" else None,
            # the step-0 snapshot a health check rolls back to
            snapshot=Snapshot(policy, optimizer, 0) if cfg.health_check else None,
        )
        self._start_loop(step_fn, out_dir)

    @classmethod
    def around(cls, run: Run, step_fn: Callable, metrics_path: str | Path | None = None
               ) -> Trainer:
        """The loop around a run built elsewhere (course.steps.new_run) and any step."""
        self = cls.__new__(cls)
        self.run = run
        self._start_loop(step_fn, None)
        self.metrics_path = Path(metrics_path) if metrics_path is not None else None
        return self

    def _start_loop(self, step_fn: Callable | None, out_dir) -> None:
        cfg = self.run.cfg
        if step_fn is None:
            step_fn = partial(grpo_step, loss_fn=loss_for(cfg), update_fn=guarded_update)
        elif self.run.world.distributed and not _is_engine_step(step_fn):
            raise ConfigError("a step function of your own runs in one process: launch it "
                              "without torchrun (the engine's grpo_step runs data-parallel)")
        self.step_fn = step_fn
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.metrics_path = self.out_dir / METRICS if self.out_dir is not None else None
        self.end_step = cfg.steps
        self.eval_every = cfg.eval_every

    def use(self, **functions: Callable) -> None:
        """Replace functions the step is given (loss_fn, update_fn, sample_fn), e.g. a
        fault injected into the update, keeping the others. The loss is chosen once, here
        or when the Trainer is built: a config changed later does not choose another."""
        fn = self.step_fn
        if not isinstance(fn, partial):
            raise TypeError("Trainer.use needs the step as functools.partial(step, loss_fn=..., "
                            f"update_fn=...); this Trainer's step is {fn!r}")
        self.step_fn = partial(fn.func, *fn.args, **{**fn.keywords, **functions})
        if self.run.reference is None and needs_reference(self.cfg, self.step_fn):
            if self.step_count:
                raise ValueError("this loss needs the frozen reference, which is the starting "
                                 "policy: give it to the Trainer before training, not after")
            self.run.reference = frozen_copy(self.policy)

    @property
    def model(self):
        """The module the training forward runs through (DDP-wrapped under torchrun)."""
        return self.run.forward

    @property
    def eval_set(self):
        return self.run.eval_problems

    @staticmethod
    def _join_processes(cfg: GRPOConfig):
        """The process group (one process: none), this rank's device, and the seeds."""
        world_size = distributed.world_from_env().world_size
        if cfg.prompts_per_step % world_size:
            raise ConfigError(
                f"GRPOConfig.prompts_per_step must be divisible by the number of processes "
                f"({world_size}) so each rank gets whole groups (got {cfg.prompts_per_step})"
            )
        device = requested_device(cfg.device, cfg.profile)
        world, rank_device = distributed.setup(device)
        # ranks sample different completions; prompts come from the shared stream
        torch.manual_seed(cfg.seed + world.rank)
        random.seed(cfg.seed)
        return world, rank_device or resolve_device(device)

    @staticmethod
    def _check_fits(cfg: GRPOConfig, model) -> None:
        """A prompt and its completion must fit the model's positions."""
        # every task prompt has at most 6 characters, and no tokenizer makes more tokens than that
        longest = len(make_problem(MAX_OPERAND, MAX_OPERAND).prompt)
        n_positions = getattr(model.config, "n_positions", None)
        if n_positions is not None and longest + cfg.max_new_tokens > n_positions:
            raise ConfigError(
                f"GRPOConfig.max_new_tokens must be <= {n_positions - longest} for this model "
                f"(prompts up to {longest} tokens, {n_positions} positions; got "
                f"{cfg.max_new_tokens})"
            )

    @staticmethod
    def _build_models(cfg: GRPOConfig, model, device, world, fast: bool):
        """The policy on this rank's device, and the module the training forward runs
        through."""
        policy = disable_dropout(model.to(device)).train()
        if fast:
            fuse_gelu(policy)  # fast.py
        if cfg.gradient_checkpointing:
            # only active in train mode: sampling runs in eval mode, with its KV cache
            policy.activation_checkpointing_enable({"use_reentrant": False})
        # the module the training forward runs through: DDP all-reduces gradients in
        # backward(); generation and no-grad forwards use the bare policy. The G rows of a
        # group share their prompt's forward (fast.py) except under activation
        # checkpointing, which drops the KV cache that needs
        # graphed: the forward and backward as CUDA graphs on a GPU with GRPO_LAB_CUDA_GRAPHS=1
        # (graphs.py; eager under DDP, whose gradient bookkeeping follows the eager forward)
        forward = CompletionLogits(policy, share_prompts=fast and not cfg.gradient_checkpointing,
                                   run_forward=graphed)
        if world.distributed:
            forward = torch.nn.parallel.DistributedDataParallel(
                forward, device_ids=[device.index] if device.type == "cuda" else None
            )
        return policy, forward

    # ---- the step's parts, for tools and tests that run one on its own ---------------------
    def problems(self) -> list:
        """This step's prompts: every rank draws the same global ones and keeps its share."""
        n = self.cfg.prompts_per_step
        return self.stream.sample(n)[distributed.shard(n, self.world)]

    def make_batch(self) -> StepBatch:
        """Sample and score this step's prompts (step.make_batch)."""
        return make_batch(self.run, self.problems(), self.step_fn.keywords.get("sample_fn")
                          if isinstance(self.step_fn, partial) else None)

    def backward(self, batch: StepBatch, grad_accum_steps: int | None = None) -> dict:
        """Accumulate the gradient of the batch's loss into .grad (step.accumulate)."""
        return accumulate(self.run, batch, self.loss_fn, grad_accum_steps)

    def update(self, batch: StepBatch) -> tuple[dict, int]:
        """mu optimizer updates on one sampled batch, as the step makes them. Returns the
        last pass's totals and how many updates a safety rule skipped."""
        skipped = 0
        for _ in range(self.cfg.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            totals = self.backward(batch)
            skipped += self._update()
        return totals, skipped

    def _update(self) -> int:
        """The step's update (grad norm, safety rules, optimizer step); 1 if skipped."""
        return self.update_fn(self.run)[1]

    def _check_health(self) -> int:
        return check_health(self.run)

    @property
    def loss_fn(self) -> Callable:
        """The loss the step is given (or its default; the config's for the engine's)."""
        return step_argument(self.step_fn, "loss_fn") or loss_for(self.cfg)

    @property
    def update_fn(self) -> Callable:
        return step_argument(self.step_fn, "update_fn") or guarded_update

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> dict:
        """One step of the step function on this rank's prompts, then what the loop adds:
        the parameters' health, the evaluation when due, the step's time."""
        run = self.run
        t0 = time.perf_counter()
        run.rolled_back = 0
        before = run.step_count
        m = self.step_fn(run, self.problems())
        check_step_result(m, before, run.step_count)
        m.setdefault("rolled_back", run.rolled_back)
        if "nonfinite_params" in m:  # the step counted them (a rollback restored health)
            finite = m["nonfinite_params"] == 0 or bool(m["rolled_back"])
        else:  # a step without the health check: the loop watches, it does not act
            finite = all_finite(run.policy)
            m["nonfinite_params"] = 0 if finite else nonfinite_params(run.policy)
            run.last_nonfinite_params = m["nonfinite_params"]
        # a model with non-finite weights has no accuracy to measure
        if self._eval_due() and self.world.is_main and finite:
            m["eval/accuracy"] = self.evaluate()
        m["step_time"] = time.perf_counter() - t0
        self.history.append(m)
        return m

    def _eval_due(self) -> bool:
        every = self.eval_every
        return self.step_count == self.end_step or (every > 0 and self.step_count % every == 0)

    def evaluate(self) -> float:
        """Greedy accuracy on the fixed held-out set."""
        return greedy_accuracy(self.policy, self.tokenizer, self.eval_set, self.cfg.max_new_tokens,
                               safe=self.cfg.safe_sampling)

    # ---- the loop ------------------------------------------------------------------------
    def train(self, steps: int | None = None, progress: bool = True, callback=None,
              eval_every: int | None = None, desc: str = "GRPO") -> list[dict]:
        """Run until `steps` (default cfg.steps) steps are done; greedy accuracy at step 0,
        every `eval_every` (default cfg.eval_every) steps and at the end. Returns the
        history. With out_dir set, writes metrics.jsonl, checkpoints and resumes from them;
        `callback(metrics)` after each step; `desc`: the progress bar's label."""
        from tqdm.auto import tqdm

        total = self.cfg.steps if steps is None else steps
        self.end_step = total
        if eval_every is not None:
            self.eval_every = eval_every
        if self.step_count == 0 and not self.history and self.world.is_main:
            start = {"step": 0, "eval/accuracy": self.evaluate(), "nonfinite_params": 0}
            self.history.append(start)
            self._write_metrics(start)
        bar = tqdm(total=total, initial=self.step_count,
                   disable=not progress or not self.world.is_main, desc=desc,
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
        if self.metrics_path is None or not self.world.is_main:
            return
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.metrics_path, "a") as f:
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
        self.history = [m for m in read_metrics(self.metrics_path.parent)
                        if m["step"] <= self.step_count] \
            if self.metrics_path is not None and self.metrics_path.exists() else []
        if self.metrics_path is not None and self.world.is_main:
            # drop metrics of steps after the checkpoint: they rerun
            tmp = self.metrics_path.with_name(METRICS + ".tmp")
            with open(tmp, "w") as f:
                f.writelines(to_json_line(m) for m in self.history)
            os.replace(tmp, self.metrics_path)

    def close(self, failed: bool = False) -> None:
        """Leave the process group of a data-parallel run (a no-op in one process); after
        a failure, without waiting for the other ranks."""
        if self.world.distributed:
            if isinstance(self.run.forward, torch.nn.parallel.DistributedDataParallel):
                # the wrapper must go before its process group
                self.run.forward = self.run.forward.module
            gc.collect()
            distributed.shutdown(wait_for_others=not failed)  # a no-op once left

    def diagnosis(self) -> str:
        return diagnosis(self.run)


for _name in _RUN_FIELDS:  # trainer.policy, trainer.step_count, ...: the run's own
    setattr(Trainer, _name, property(
        lambda self, n=_name: getattr(self.run, n),
        lambda self, value, n=_name: setattr(self.run, n, value)))


def _is_engine_step(step_fn: Callable) -> bool:
    return (step_fn.func if isinstance(step_fn, partial) else step_fn) is grpo_step


def _ask_the_model(query: Callable):
    """query(), or what stopped it: after a device-side assert (CUDA) every call on the
    device fails, and the diagnosis still reports what the history holds."""
    try:
        return query()
    except torch.AcceleratorError as e:  # a RuntimeError of the device's; any other raises
        return f"unknown (the device failed: {str(e).strip().splitlines()[0]})"


def diagnosis(run: Run) -> str:
    """What a person needs after a crash: where health was last fine, what broke first,
    and the grad-norm history leading up to it."""
    steps = [m for m in run.history if "grad_norm" in m]
    healthy = [m["step"] for m in run.history if m.get("nonfinite_params", 0) == 0]
    last_healthy = max(healthy) if healthy else None
    bad_param = _ask_the_model(lambda: first_nonfinite_param(run.policy))
    bad_grad = run.first_bad_grad or _ask_the_model(lambda: first_nonfinite_grad(run.policy))
    norms = ", ".join(f"{m['step']}: {m['grad_norm']:.3g}" for m in steps[-8:])
    median = statistics.median([m["grad_norm"] for m in steps]) if steps else float("nan")
    return "\n".join([
        f"last healthy step: {last_healthy} (steps completed: {run.step_count})",
        f"first non-finite parameter: {bad_param or 'none'}",
        f"first non-finite gradient: {bad_grad or 'none'}",
        f"grad norm (step: value), last {min(8, len(steps))}: {norms or 'none'}",
        f"grad norm median over the run: {median:.3g}",
    ])


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
