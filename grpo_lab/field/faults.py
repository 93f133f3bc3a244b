"""Fault injection: break a run on purpose at one step and see what the trainer does.

The stable trainer must either recover (the update skipped, or the model rolled back to
its last healthy snapshot, both visible in the metrics) or stop with a clear error before
anything corrupt reaches a checkpoint. The naive trainer, given the same fault, must fail
(crash with a raw error, end with non-finite weights, apply the bad update, or hang):
that proves the fault is real.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from ..config import CHECKPOINT, ConfigError, preset
from ..health import nonfinite_params
from ..memo import once_per_session
from ..sampling import SamplingError
from ..step import Run, step_argument
from ..tasks import RewardError, addition_reward
from ..trainer import Trainer
from .scenarios import run_scenario

INJECT_AT = 7  # the step whose work the fault breaks (after the spike rule's warm-up)
STEPS = 8
HANG_LIMIT = 20.0  # seconds past the reward timeout before the runner calls a run hung
# once the reward-hangs fault's function has been entered (it never returns): seconds past the
# reward timeout before the runner calls the run hung, instead of waiting out HANG_LIMIT
HANG_GRACE = 5.0
_reward_hanging = threading.Event()  # set by _hang when a run enters it
CLEAR_ERRORS = (RewardError, SamplingError, ConfigError)


@dataclass
class FaultResult:
    fault: str
    preset: str
    completed: bool  # all steps ran
    error: str | None  # the exception that stopped the run, "hung", or None
    clear_error: bool  # the stop was one of the trainer's own clear errors
    skipped: int  # updates skipped by a safety rule
    rolled_back: int  # steps rolled back to a healthy snapshot
    final_nonfinite: int  # non-finite parameters in the model at the end
    checkpoint_nonfinite: int | None  # ... in the last checkpoint on disk (None: none)

    @property
    def survived(self) -> bool:
        """Recovered, or stopped cleanly, with nothing corrupt saved."""
        clean_disk = not self.checkpoint_nonfinite
        recovered = self.completed and self.final_nonfinite == 0 and (
            self.skipped or self.rolled_back
        )
        return bool(clean_disk and (recovered or (not self.completed and self.clear_error)))

    def summary(self) -> str:
        how = "completed" if self.completed else f"stopped: {self.error}"
        return (f"{self.preset:6s} {how}; skipped {self.skipped}, rolled back "
                f"{self.rolled_back}, non-finite params {self.final_nonfinite}, in checkpoint "
                f"{self.checkpoint_nonfinite}")


# --- the fault injector: one fault wrapped around the functions a step is given -----------
LEARNER_FAULTS = ("nan-grads", "loss-spike", "nan-logits", "nan-rewards", "nan-params",
                  "inf-params")


def with_fault(run: Run, step_fn: Callable, fault: str, at: int = INJECT_AT) -> Callable:
    """`step_fn` (a partial of a step with loss_fn and update_fn: the learner's, or the
    engine's `Trainer.step_fn`) with one fault at step `at` of `run`: a NaN gradient entry
    before the update, the loss x 1e4, NaN logits in the training forward, a NaN reward, or
    a NaN / inf parameter written after the update (before the step's health check)."""
    if fault not in LEARNER_FAULTS:
        raise ValueError(f"fault must be one of {', '.join(LEARNER_FAULTS)} (got {fault!r})")
    if not isinstance(step_fn, partial) or not {"loss_fn"} <= set(step_fn.keywords):
        raise ValueError("pass the step as partial(step, loss_fn=..., update_fn=...)")
    due = lambda: run.step_count == at - 1  # noqa: E731 - step_count counts finished steps
    loss_fn = step_fn.keywords["loss_fn"]
    # the update the step runs: the one it is given, else its own default (the learner's
    # grpo_step: apply_update; the engine's: guarded_update)
    update_fn = step_argument(step_fn, "update_fn")
    if update_fn is None:
        raise ValueError("pass the step as partial(step, loss_fn=..., update_fn=...)")
    kw = dict(step_fn.keywords)
    first = lambda: next(run.policy.parameters())  # noqa: E731
    if fault == "nan-grads":
        def update(r):
            if due():
                first().grad.view(-1)[0] = float("nan")
            return update_fn(r)
        kw["update_fn"] = update
    elif fault in ("nan-params", "inf-params"):
        value = float("nan") if fault == "nan-params" else float("inf")

        def poisoned(inner: Callable) -> Callable:
            def update(r):
                out = inner(r)
                if due():
                    with torch.no_grad():
                        first().view(-1)[0] = value
                return out
            return update
        if isinstance(update_fn, partial) and "update_fn" in update_fn.keywords:
            # a health check around an update (notebook 07): the weight goes bad after the
            # update and before the check, as the fault injector does it to Trainer
            inner = update_fn.keywords["update_fn"]
            kw["update_fn"] = partial(update_fn.func, *update_fn.args,
                                      **{**update_fn.keywords, "update_fn": poisoned(inner)})
        else:
            kw["update_fn"] = poisoned(update_fn)
    elif fault == "loss-spike":
        def loss(*args):
            value, stats = loss_fn(*args)
            return (value * 1e4 if due() else value), stats
        kw["loss_fn"] = loss
    elif fault == "nan-logits":
        def hook(module, inputs, output):
            if torch.is_grad_enabled() and due():
                poison = torch.ones_like(output)
                poison[0] = float("nan")  # the first row's logits, inside the graph
                return output * poison
            return output
        run.policy.lm_head.register_forward_hook(hook)
    elif fault == "nan-rewards":
        reward_fn = run.reward_fn

        def rewards(completions, **columns):
            out = list(reward_fn(completions, **columns))
            return [float("nan"), *out[1:]] if due() else out
        run.reward_fn = rewards
    return partial(step_fn.func, *step_fn.args, **kw)


def _at_fault_step(trainer) -> bool:
    return trainer.step_count == INJECT_AT - 1  # step_count counts finished steps


def _step_fault(name: str) -> Callable:
    def inject(trainer):
        trainer.step_fn = with_fault(trainer.run, trainer.step_fn, name)
    return inject


def _reward(bad: Callable[[list[str], list[float]], object]):
    def inject(trainer):
        def reward_fn(completions, **columns):
            rewards = addition_reward(completions, **columns)
            return bad(completions, rewards) if _at_fault_step(trainer) else rewards

        reward_fn.__name__ = "addition_reward_with_fault"
        trainer.reward_fn = reward_fn

    return inject


def _raise(completions, rewards):
    raise ValueError("the grader crashed")


def _hang(completions, rewards):
    _reward_hanging.set()
    time.sleep(3600)


def _short(completions, rewards):
    return rewards[:-8]  # one group's rewards missing


def _oov_pad(trainer):
    # report 002: a new pad token in the tokenizer, none in the model's embedding
    trainer.tokenizer.add_special_tokens({"pad_token": "<new-pad>"})


FAULTS: dict[str, Callable] = {
    **{name: _step_fault(name) for name in LEARNER_FAULTS},
    "reward-raises": _reward(_raise),
    "reward-hangs": _reward(_hang),
    "reward-wrong-length": _reward(_short),
    "oov-token-id": _oov_pad,
}


def wait_for_run(thread: threading.Thread, reward_timeout: float) -> None:
    """Wait until the run's thread ends, HANG_LIMIT + reward_timeout seconds at most; once the
    run is inside the never-returning reward function, HANG_GRACE + reward_timeout at most
    from then (a trainer with a reward timeout raises by then)."""
    now = time.monotonic()
    deadline = now + HANG_LIMIT + reward_timeout
    hang_seen = None
    while thread.is_alive() and now < deadline:
        if hang_seen is None and _reward_hanging.is_set():
            hang_seen = now
            deadline = min(deadline, hang_seen + HANG_GRACE + reward_timeout)
        thread.join(min(0.05, deadline - now))
        now = time.monotonic()


@once_per_session
def run_fault(name: str, preset_name: str, **overrides) -> FaultResult:
    """Train STEPS steps with the fault injected at step INJECT_AT; report what happened."""
    if preset_name == "stable":
        overrides.setdefault("reward_timeout", 2.0)
    cfg = preset(preset_name, steps=STEPS, checkpoint_every=2, eval_every=0, eval_size=16,
                 **overrides)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(cfg, out_dir=tmp)
        FAULTS[name](trainer)
        outcome: dict = {}

        def target():
            try:
                trainer.train(progress=False)
            except Exception as e:
                outcome["error"] = e

        thread = threading.Thread(target=target, daemon=True)
        _reward_hanging.clear()
        thread.start()
        wait_for_run(thread, cfg.reward_timeout or 0.0)
        hung = thread.is_alive()
        err = outcome.get("error")
        ckpt = Path(tmp) / CHECKPOINT
        ckpt_bad = None
        if ckpt.exists():
            state = torch.load(ckpt, map_location="cpu", weights_only=False)["policy"]
            ckpt_bad = sum(int((~torch.isfinite(t)).sum()) for t in state.values()
                           if t.is_floating_point())
        history = [m for m in trainer.history if "skipped" in m]
        return FaultResult(
            fault=name, preset=preset_name,
            completed=not hung and err is None and trainer.step_count == STEPS,
            error="hung" if hung else (f"{type(err).__name__}: {err}" if err else None),
            clear_error=isinstance(err, CLEAR_ERRORS),
            skipped=sum(m["skipped"] for m in history),
            rolled_back=sum(m["rolled_back"] for m in history),
            final_nonfinite=0 if hung else nonfinite_params(trainer.policy),
            checkpoint_nonfinite=ckpt_bad,
        )


def empty_micro_batch_fault() -> tuple[str, str]:
    """The one fault a config catches before a trainer exists: more micro-batches than
    rows. Returns (stable's answer, naive report-004 chunking's answer)."""

    try:
        preset("stable", prompts_per_step=1, group_size=2, grad_accum_steps=4)
        stable = "accepted"
    except ConfigError as e:
        stable = f"ConfigError: {e}"
    return stable, run_scenario("empty-micro-batch").evidence
