"""Checkers for the learner's hardened trainer: the health check and rollback of notebook 07
and the exact gradient accumulation of notebook 08 (references: hardening.py).

They work as step_checks' whole-step checkers do: a *driver* (listed in `DRIVERS`) builds a
fixed case around the learner's function (the shipped tiny GPT-2 on the CPU, plain SGD, so
that two correct updates agree to float rounding), runs it, and returns the parameters
after it; the checker compares them with the reference's, and where they differ reruns the
reference with each known mistake put in (a *mutant*) and names every one that reproduces
the learner's parameters, in the learner's terms. In the grader the driver runs in the
sandboxed worker beside the learner's function (`step_checks.drive`).

- health_check: several fake steps (fresh random gradients, the update, a fault written in
  at one step) with SGD with momentum, so the optimizer has a state that a rollback must
  restore too; then one more clean update, which shows that state in the parameters.
- healthy_update: the same steps through the learner's update function, with a fault
  injected inside the update_fn it is given.
- accumulated_grpo_step: one step on the fixture's batch, several loss types and
  micro-batches of unequal rows or tokens, against the *full-batch* reference step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..health import Snapshot, nonfinite_params
from ..objective import completion_logprobs, token_weights
from ..sampling import sample_group
from ..tasks import ProblemStream
from ..trainer import micro_batch_slices
from . import hardening, steps
from .checks import CheckResult, Mismatch, _expect, _gen, run_check
from .step_checks import (
    STEP_TOL,
    _flat,
    check_step_contract,
    drive,
    drive_step,
    fixture_cfg,
    fixture_run,
)

PARAM_FAULTS = {"nan-params": float("nan"), "inf-params": float("inf")}
FAULTS = (*PARAM_FAULTS, "nan-grads")


# --- drivers -----------------------------------------------------------------------------------
def _health_run(seed: int, snapshot_every: int) -> steps.Run:
    """The fixture with SGD with momentum (a per-parameter state, like AdamW's m and v) and
    the snapshot of step 0 in run.snapshot, as Trainer takes it when it starts."""
    run = fixture_run(seed, snapshot_every=snapshot_every)
    run.optimizer = torch.optim.SGD(run.policy.parameters(), lr=run.cfg.learning_rate,
                                    momentum=0.9)
    run.snapshot = Snapshot(run.policy, run.optimizer, 0)
    return run


def _fresh_gradients(run: steps.Run, g: torch.Generator) -> None:
    for p in run.policy.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 0.05


def _poison(run: steps.Run, fault: str) -> None:
    with torch.no_grad():
        next(run.policy.parameters()).view(-1)[0] = PARAM_FAULTS[fault]


def _check_fault(fault: str) -> None:
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {', '.join(FAULTS)} (got {fault!r})")


def drive_health_check(fn, seed: int = 0, fault: str = "nan-params", at: int = 3,
                       n_steps: int = 4, snapshot_every: int = 1) -> dict:
    """n_steps fake steps: fresh random gradients (for 'nan-grads' one NaN entry at step
    `at`), steps.apply_update (clipping spreads a NaN to every gradient, SGD into every weight
    and its momentum), a NaN / inf written into a weight after the update of step `at` for
    'nan-params' / 'inf-params', then `fn(run)`, the health check; then one clean update."""
    _check_fault(fault)
    run = _health_run(seed, snapshot_every)
    g = _gen(3000 + seed)
    returns = []
    for step in range(1, n_steps + 1):
        _fresh_gradients(run, g)
        if fault == "nan-grads" and step == at:
            next(run.policy.parameters()).grad.view(-1)[0] = float("nan")
        steps.apply_update(run)
        if fault in PARAM_FAULTS and step == at:
            _poison(run, fault)
        returns.append(fn(run))
        run.step_count += 1  # what the step does after update_fn returns
    _fresh_gradients(run, g)
    steps.apply_update(run)  # the optimizer state the check left behind acts here
    return {"params": _flat(run.policy), "returns": returns}


def drive_healthy_update(fn, seed: int = 0, fault: str = "nan-params", at: int = 3,
                         n_steps: int = 4, snapshot_every: int = 1) -> dict:
    """The fake steps of drive_health_check with `fn(run, update_fn=...)` as the update:
    the update_fn it gets is steps.apply_update with the fault put in at step `at` (a NaN
    gradient entry before it, or a NaN / inf weight after it). run.rolled_back is reset
    before each call and read after it."""
    _check_fault(fault)
    run = _health_run(seed, snapshot_every)
    g = _gen(3000 + seed)

    def update(r):
        if fault == "nan-grads" and r.step_count == at - 1:
            next(r.policy.parameters()).grad.view(-1)[0] = float("nan")
        out = steps.apply_update(r)
        if fault in PARAM_FAULTS and r.step_count == at - 1:
            _poison(r, fault)
        return out

    outs, flags = [], []
    for _ in range(n_steps):
        _fresh_gradients(run, g)
        run.rolled_back = None
        outs.append(fn(run, update_fn=update))
        flags.append(getattr(run, "rolled_back", None))
        run.step_count += 1
    return {"params": _flat(run.policy), "outs": outs, "flags": flags}


def drive_accumulated(fn, seed: int = 0, **overrides) -> dict:
    """drive_step for an accumulating step: one step on the fixture (the same batch as
    drive_step's), and the rows of every training forward of the policy (with gradient)."""
    run = fixture_run(seed, **overrides)
    rows: list[int] = []

    def count(module, inputs, output):
        if torch.is_grad_enabled():
            rows.append(int(output.shape[0]))

    hook = run.policy.get_output_embeddings().register_forward_hook(count)
    before = _flat(run.policy)
    problems = ProblemStream(seed).sample(run.cfg.prompts_per_step)
    torch.manual_seed(seed)  # the sampler's draws
    counted = run.step_count
    try:
        metrics = fn(run, problems, loss_fn=steps.grpo_loss, update_fn=steps.apply_update)
    finally:
        hook.remove()
    return {"update": _flat(run.policy) - before, "metrics": metrics, "rows": rows,
            "step_count": (counted, run.step_count)}


DRIVERS: dict[str, Callable] = {f.__name__: f for f in (drive_health_check,
                                                        drive_healthy_update,
                                                        drive_accumulated)}


# --- comparing with the reference and its mutants ----------------------------------------------
def _same(got, want) -> bool:
    return isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and \
        got.shape == want.shape and torch.allclose(got.double(), want.double(), equal_nan=True,
                                                   **STEP_TOL)


def _compare_all(got, want, what: str, mutants: dict, run_mutant: Callable,
                 catalog: dict, unnamed: Callable[[], None] | None = None) -> None:
    """`got` must equal `want`; where it does not, name every known mistake whose mutant
    gives `got` (two mistakes can leave the same numbers: both are named); where none does,
    `unnamed()` may raise a more precise Mismatch before the generic one."""
    if _same(got, want):
        return
    if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and \
            got.shape == want.shape:
        named = []
        for name, mutant in mutants.items():
            try:
                result = run_mutant(mutant)
            except Exception:  # noqa: BLE001 - a mutant that cannot run here matches nothing
                continue
            if _same(got, result):
                named.append(catalog[name])
        if named:
            raise Mismatch(f"{what} differ from the reference: " + "; or ".join(named))
    if unnamed is not None:
        unnamed()
    _expect(got, want, what, **STEP_TOL)


def _number(x) -> float:
    """A returned flag or count as a float; anything else (None, a tuple) as -1."""
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        x = x.item()
    return float(x) if isinstance(x, (bool, int, float)) else -1.0


# --- notebook 07: health_check ------------------------------------------------------------------
def _health_mutant(mistake: str) -> Callable:
    if mistake not in HEALTH_MISTAKES:
        raise KeyError(mistake)

    def check(run):
        step = run.step_count + 1
        due = step % run.cfg.snapshot_every == 0
        if mistake == "snapshot_before_check":
            if due:
                run.snapshot = Snapshot(run.policy, run.optimizer, step)
            if nonfinite_params(run.policy):
                run.snapshot.restore(run.policy, run.optimizer)
                return 1
            return 0
        if mistake == "nan_only":
            bad = sum(int(torch.isnan(p).sum()) for p in run.policy.parameters())
        else:
            bad = nonfinite_params(run.policy)
        if bad:
            if mistake == "model_only":
                run.policy.load_state_dict(run.snapshot.model_state)
            else:
                run.snapshot.restore(run.policy, run.optimizer)
            return 1
        if mistake == "never_snapshot":
            return 0
        if mistake == "snapshot_every_ignored":
            due = True
        elif mistake == "snapshot_on_wrong_step":
            due = run.step_count % run.cfg.snapshot_every == 0
        if due:
            run.snapshot = Snapshot(run.policy, run.optimizer, step)
        return 0
    return check


HEALTH_MISTAKES = {
    "snapshot_before_check": "the snapshot is taken before the parameters are checked: on a "
    "step that is due for one, the bad weights become the snapshot, and the rollback restores "
    "them. Check first; keep a snapshot only of a healthy step",
    "model_only": "only the weights are restored, not the optimizer state: the optimizer's "
    "running averages (momentum here, AdamW's m and v) still hold what the bad step put in "
    "them (NaN after a NaN gradient), and the next update writes it back into the weights. "
    "`run.snapshot.restore(run.policy, run.optimizer)` restores both",
    "never_snapshot": "no new snapshot is ever taken: every rollback goes back to the snapshot "
    "of step 0 and throws away every healthy step since. Keep `Snapshot(run.policy, "
    "run.optimizer, step)` in run.snapshot every cfg.snapshot_every healthy steps",
    "nan_only": "only NaN is counted, not +-inf: `torch.isnan` misses inf, which poisons the "
    "next forward as surely as NaN. Count `~torch.isfinite(p)` (your nonfinite_params)",
    "snapshot_every_ignored": "a snapshot is kept after every healthy step, ignoring "
    "cfg.snapshot_every (each one copies every weight and the optimizer state): keep one only "
    "when the step is a multiple of cfg.snapshot_every",
    "snapshot_on_wrong_step": "the snapshot is taken one step off: the health check runs "
    "inside update_fn, before your step counts itself, so the step it finishes is "
    "run.step_count + 1; a snapshot is due when (run.step_count + 1) % cfg.snapshot_every == 0",
}


def check_health_check(fn: Callable) -> CheckResult:
    ref = hardening.health_check
    mutants = {k: _health_mutant(k) for k in HEALTH_MISTAKES}

    def vector(out: dict) -> torch.Tensor | None:
        if not isinstance(out.get("params"), torch.Tensor):
            return None
        return torch.cat([out["params"].double(),
                          torch.tensor([_number(r) for r in out["returns"]], dtype=torch.double)])

    def case(**params):
        def run(f):
            out, want = drive(f, drive_health_check, **params), drive_health_check(ref, **params)

            def returns():
                if _same(out["params"], want["params"]):
                    raise Mismatch("return 1 for the step you rolled back and 0 for every "
                                   f"other: yours returned {out['returns']}, expected "
                                   f"{want['returns']}")
            _compare_all(vector(out), vector(want), "the parameters after the steps (and what "
                         "your check returned)", mutants,
                         lambda m: vector(drive_health_check(m, **params)), HEALTH_MISTAKES,
                         returns)
        return run

    return run_check("health_check", fn, ref, [
        ("a NaN written into a weight after the update of step 3 of 4, a snapshot every step",
         case(seed=0, fault="nan-params", at=3, n_steps=4, snapshot_every=1)),
        ("an inf written into a weight at step 3 of 4",
         case(seed=1, fault="inf-params", at=3, n_steps=4, snapshot_every=1)),
        ("a NaN gradient entry at step 7 of 8, a snapshot every 4 steps: clipping spreads it "
         "to every weight and into the optimizer's momentum",
         case(seed=2, fault="nan-grads", at=7, n_steps=8, snapshot_every=4)),
    ])


# --- notebook 07: healthy_update ----------------------------------------------------------------
def _healthy_update_mutant(mistake: str) -> Callable:
    if mistake not in HEALTHY_UPDATE_MISTAKES:
        raise KeyError(mistake)
    check = hardening.health_check

    def update(run, update_fn=steps.apply_update):
        if mistake == "check_before_update":
            rolled = check(run)
            out = update_fn(run)
            run.rolled_back = rolled
            return out
        if mistake == "no_health_check":
            out = update_fn(run)
            run.rolled_back = 0
            return out
        if mistake == "rollback_not_recorded":
            out = update_fn(run)
            check(run)
            return out
        if mistake == "rollback_as_skipped":
            grad_norm, skipped = update_fn(run)
            run.rolled_back = check(run)
            return grad_norm, max(skipped, run.rolled_back)
        if mistake == "own_update":
            out = steps.apply_update(run)
            run.rolled_back = check(run)
            return out
        raise AssertionError(mistake)
    return update


HEALTHY_UPDATE_MISTAKES = {
    "check_before_update": "the health check runs before the update: it sees the weights of "
    "the step before, so a NaN this update writes is found a step late, after the next "
    "step's sampler has drawn from it (and crashed). Call `update_fn(run)` first, then "
    "`health_check(run)`",
    "no_health_check": "the health check never runs: call `health_check(run)` after "
    "`update_fn(run)`",
    "rollback_not_recorded": "the rollback is not recorded: set `run.rolled_back` to what "
    "`health_check(run)` returned (1 or 0) on every call, so the run's metrics can count it",
    "rollback_as_skipped": "a rollback is reported as a skipped update: return update_fn's "
    "(grad_norm, skipped) as it is. The update was not skipped (it reached the weights), and "
    "the rollback undoes every step since the snapshot; it goes in run.rolled_back",
    "own_update": "your healthy_update runs an update of its own instead of the `update_fn` "
    "it is given: call `update_fn(run)`, so that whatever update the step passes in (your "
    "apply_update, your guarded_update) is the one checked",
}


def check_healthy_update(fn: Callable) -> CheckResult:
    ref = hardening.healthy_update
    mutants = {k: _healthy_update_mutant(k) for k in HEALTHY_UPDATE_MISTAKES}

    def vector(out: dict) -> torch.Tensor | None:
        outs = out.get("outs") or []
        if not isinstance(out.get("params"), torch.Tensor):
            return None
        skipped = [_number(o[1]) if isinstance(o, tuple) and len(o) == 2 else -2.0 for o in outs]
        return torch.cat([out["params"].double(), torch.tensor(
            [_number(f) for f in out["flags"]] + skipped, dtype=torch.double)])

    def case(**params):
        def run(f):
            try:
                out = drive(f, drive_healthy_update, **params)
            except TypeError as e:
                if "update_fn" in str(e) or "argument" in str(e):
                    raise Mismatch("your step calls it as healthy_update(run, update_fn=...): "
                                   f"take the update to run as `update_fn` ({e})") from None
                raise
            want = drive_healthy_update(ref, **params)
            bad = [o for o in out["outs"] if not (isinstance(o, tuple) and len(o) == 2)]
            if bad:
                raise Mismatch("return (grad_norm, skipped), a tuple of two, as update_fn "
                               f"does; got {bad[0]!r}")
            def flags():
                if not _same(out["params"], want["params"]):
                    return
                got = [_number(x) for x in out["flags"]]
                if got != [_number(x) for x in want["flags"]]:
                    raise Mismatch(f"run.rolled_back after each step was {out['flags']}, "
                                   f"expected {want['flags']} (set it on every call: 1 when "
                                   "health_check rolled back, else 0)")
                raise Mismatch(f"return update_fn's skipped as it is: yours returned "
                               f"{[o[1] for o in out['outs']]}, expected "
                               f"{[o[1] for o in want['outs']]}")
            _compare_all(vector(out), vector(want), "the parameters after the steps (with "
                         "run.rolled_back and the skipped flags)", mutants,
                         lambda m: vector(drive_healthy_update(m, **params)),
                         HEALTHY_UPDATE_MISTAKES, flags)
            got = [_number(o[0]) for o in out["outs"]]
            expected = [_number(o[0]) for o in want["outs"]]
            if not torch.allclose(torch.tensor(got), torch.tensor(expected), rtol=1e-5,
                                  equal_nan=True):
                raise Mismatch(f"return update_fn's grad_norm as it is: yours returned {got}, "
                               f"expected {expected}")
        return run

    return run_check("healthy_update", fn, ref, [
        ("a NaN written into a weight by the update of step 3 of 4, a snapshot every step",
         case(seed=0, fault="nan-params", at=3, n_steps=4, snapshot_every=1)),
        ("a NaN gradient entry at step 2 of 3, a snapshot every 2 steps",
         case(seed=1, fault="nan-grads", at=2, n_steps=3, snapshot_every=2)),
    ])


# --- notebook 08: accumulated_grpo_step ---------------------------------------------------------
def _accumulated_variant(run, problems, loss_fn, update_fn, mistake: str) -> dict:
    """hardening.accumulated_grpo_step with one known mistake in its micro-batch loop."""
    cfg = run.cfg
    rollout, rewards, advantages, ref_logp = steps.sample_and_score(run, problems)
    ids, attention, C = rollout.input_ids, rollout.attention_mask, rollout.completion_length
    mask = rollout.completion_mask
    whole = token_weights(mask, cfg.loss_type, cfg.max_new_tokens)
    params = list(run.policy.parameters())
    k = cfg.grad_accum_steps
    stepping = mistake in ("step_inside_loop", "step_inside_loop_accumulating")
    if mistake != "no_zero_grad":
        run.optimizer.zero_grad(set_to_none=True)
    for rows in micro_batch_slices(len(rewards), k):
        if mistake in ("zero_grad_inside", "step_inside_loop"):
            run.optimizer.zero_grad(set_to_none=True)
        logp = completion_logprobs(run.policy, ids[rows], attention[rows], C, cfg.temperature)
        weights = whole[rows]
        if mistake in ("per_micro_batch_normalisation", "micro_batch_weights"):
            weights = token_weights(mask[rows], cfg.loss_type, cfg.max_new_tokens)
            if mistake == "per_micro_batch_normalisation":
                weights = weights / k
        part, _ = loss_fn(logp, logp.detach(), ref_logp[rows], advantages[rows], weights, cfg)
        if mistake == "copy_instead_of_add":
            grads = torch.autograd.grad(part, params, allow_unused=True)
            for p, g in zip(params, grads, strict=True):
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
        else:
            part.backward()
        if stepping:
            update_fn(run)
    if not stepping:
        update_fn(run)
    run.step_count += 1
    return {}


def _accumulated_mutant(mistake: str) -> Callable:
    if mistake not in ACCUMULATION_MISTAKES:
        raise KeyError(mistake)

    def step(run, problems, loss_fn, update_fn=steps.apply_update, sample_fn=sample_group):
        return _accumulated_variant(run, problems, loss_fn, update_fn, mistake)
    return step


ACCUMULATION_MISTAKES = {
    "zero_grad_inside": "only the last micro-batch's gradient reaches the update: "
    "`run.optimizer.zero_grad()` runs inside the micro-batch loop and clears what the earlier "
    "micro-batches added. Clear the gradients once, before the loop (report 003)",
    "copy_instead_of_add": "each micro-batch's gradient is written over the one before "
    "(`p.grad.copy_(g)` or `p.grad = g`) instead of added to it (`p.grad.add_(g)`; "
    "`backward()` adds into .grad by itself), which also leaves only the last micro-batch's "
    "(report 003)",
    "step_inside_loop": "the update runs inside the micro-batch loop: one update per "
    "micro-batch, each from that micro-batch's gradient alone, instead of one update from the "
    "whole batch's. Call `update_fn(run)` once, after the loop (report 003)",
    "step_inside_loop_accumulating": "the update runs inside the micro-batch loop, without "
    "clearing the gradients in between: every update steps with the gradient summed so far, "
    "so the first micro-batch's gradient is applied k times. Call `update_fn(run)` once, "
    "after the loop",
    "per_micro_batch_normalisation": "each micro-batch's token weights come from that "
    "micro-batch's mask alone (`token_weights(mask[rows], ...)`) and the loss is divided by "
    "k: a micro-batch with fewer rows (grpo, dr_grpo) or fewer tokens (bnpo, dapo) then "
    "weighs more than it does in the whole batch. Compute the weights once, on the whole "
    "batch's mask, and give each micro-batch its rows of them: `weights[rows]`",
    "micro_batch_weights": "each micro-batch's token weights come from that micro-batch's "
    "mask alone (`token_weights(mask[rows], ...)`), so each micro-batch's loss is normalised "
    "as if it were the whole batch, and the k losses sum to about k times the batch's loss, "
    "weighted differently. Compute the weights once, on the whole batch's mask, and give "
    "each micro-batch its rows of them: `weights[rows]`",
    "no_zero_grad": "your step never clears the gradients before the micro-batch loop: the "
    "gradients left in .grad by the last step are added to this one's",
}


def check_accumulated_grpo_step(fn: Callable) -> CheckResult:
    ref = steps.grpo_step  # the full batch in one backward: what accumulation must reproduce
    mutants = {k: _accumulated_mutant(k) for k in ACCUMULATION_MISTAKES}

    def case(seed, **overrides):
        def run(f):
            try:
                out = drive(f, drive_accumulated, seed=seed, **overrides)
            except TypeError as e:
                if "loss_fn" in str(e) or "update_fn" in str(e) or "argument" in str(e):
                    raise Mismatch("call it as accumulated_grpo_step(run, problems, loss_fn=..., "
                                   f"update_fn=...): {e}") from None
                raise
            check_step_contract(out)
            want = drive_step(ref, seed, **overrides)
            k = overrides["grad_accum_steps"]
            cfg = fixture_cfg(seed, **overrides)
            B = cfg.prompts_per_step * cfg.group_size
            rows = out["rows"]
            if len(rows) != k or sum(rows) != B:
                whole = " at once" if rows == [B] else ""
                raise Mismatch(f"with cfg.grad_accum_steps = {k} the policy's training forward "
                               f"must run once per micro-batch, on {k} parts of the {B} rows "
                               f"(micro_batch_slices); yours ran it on {rows} rows{whole}")
            _compare_all(out["update"], want["update"], "the parameters after your step",
                         mutants, lambda m: drive_accumulated(m, seed, **overrides)["update"],
                         ACCUMULATION_MISTAKES)
            got = out["metrics"]
            for key, what in (("reward", ""), ("grad_norm", ""),
                              ("loss", " (the sum of the micro-batch losses: the "
                                       "whole batch's loss)"),
                              ("kl", " (the micro-batches' kl weighted by their completion "
                                     "tokens)")):
                if key not in got:
                    raise Mismatch(f"the metrics have no {key!r} (keys: {sorted(got)[:8]})")
                _expect(float(got[key]), float(want["metrics"][key]), f"metrics[{key!r}]{what}",
                        atol=1e-5, rtol=1e-4)
        return run

    return run_check("accumulated_grpo_step", fn, hardening.accumulated_grpo_step, [
        ("grpo, 3 micro-batches of 6, 5 and 5 rows, no clipping",
         case(0, loss_type="grpo", grad_accum_steps=3, max_grad_norm=None)),
        ("bnpo, 4 micro-batches of 4 rows each but unequal completion tokens, no clipping",
         case(0, loss_type="bnpo", grad_accum_steps=4, max_grad_norm=None)),
        ("dr_grpo, 3 micro-batches, temperature 0.7, gradient clipped to 1.0",
         case(1, loss_type="dr_grpo", grad_accum_steps=3, temperature=0.7)),
        ("dapo, 5 micro-batches of 4, 3, 3, 3 and 3 rows, no clipping",
         case(2, loss_type="dapo", grad_accum_steps=5, max_grad_norm=None)),
    ])


CHECKERS = {"health_check": check_health_check, "healthy_update": check_healthy_update,
            "accumulated_grpo_step": check_accumulated_grpo_step}
MISTAKES = {"health_check": (HEALTH_MISTAKES, _health_mutant),
            "healthy_update": (HEALTHY_UPDATE_MISTAKES, _healthy_update_mutant),
            "accumulated_grpo_step": (ACCUMULATION_MISTAKES, _accumulated_mutant)}
