"""Notebook 07, fix health checks and recovery: the checks of its exercises, and each exercise as
data in `EXERCISES`."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from functools import partial

import torch

from ...health import Snapshot, nonfinite_params
from .. import hardening, steps
from .base import (
    CheckResult,
    Exercise,
    Mismatch,
    Mistake,
    compare_all,
    expect,
    gen,
    number,
    run_check,
    same,
)
from .fixtures import drive, fixture_run, flat_params, reuses_known_results, tiny_model


def check_nonfinite_params(fn: Callable) -> CheckResult:

    def model_with(values: dict[str, float]) -> torch.nn.Module:
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        with torch.no_grad():
            for i, (where, value) in enumerate(values.items()):
                p = dict(model.named_parameters())[where]
                p.view(-1)[i] = value
        return model

    def case(values, what):
        def run(f):
            model = model_with(values)
            got = f(model)
            want = nonfinite_params(model)
            if isinstance(got, bool):
                raise Mismatch(f"{what}: return the number of NaN/inf entries, not a bool")
            if not isinstance(got, int):
                raise Mismatch(f"{what}: return a Python int (you returned "
                               f"{type(got).__name__}; `.item()` or int()): the trainer writes "
                               "the count into its metrics, which are JSON")
            n_nan = sum(1 for v in values.values() if v != v)
            if got == 1 < want and n_nan == want:
                raise Mismatch(f"{what}: you returned 1 for {want} non-finite entries: return "
                               "how many there are, not whether there are any")
            if got == n_nan != want:
                raise Mismatch(f"{what}: you counted NaN but not inf (use torch.isfinite)")
            expect(got, want, f"{what}: the count")
        return run

    def two_in_one_tensor(f):
        model = model_with({})
        with torch.no_grad():
            model[0].weight.view(-1)[:2] = float("nan")
        got = f(model)
        if got == 1:
            raise Mismatch("two NaN entries in one weight counted as 1: count the non-finite "
                           "entries, not the tensors that hold one")
        expect(got, nonfinite_params(model), "two NaN entries in one weight: the count")

    def tied(f):
        # GPT-2 ties its output layer to its token embedding: one tensor under two names in
        # state_dict(), once in parameters()
        model = copy.deepcopy(tiny_model()[0])
        with torch.no_grad():
            model.get_input_embeddings().weight.view(-1)[0] = float("nan")
        got, want = f(model), nonfinite_params(model)
        if got == 2 * want:
            raise Mismatch("one NaN in GPT-2's token embedding counted twice: the output layer "
                           "is the same tensor (tied weights), listed twice by state_dict(); "
                           "count model.parameters(), which lists each tensor once")
        expect(got, want, "one NaN in a tied weight: the count")

    inf, nan = float("inf"), float("nan")
    return run_check("nonfinite_params", fn, nonfinite_params, [
        ("one NaN in GPT-2's tied embedding (one tensor, two names)", tied),
        ("a healthy model", case({}, "a healthy model")),
        ("one NaN weight", case({"0.weight": nan}, "one NaN")),
        ("NaN in two layers", case({"0.weight": nan, "1.weight": nan}, "two NaN")),
        ("NaN and inf in different layers",
         case({"0.weight": nan, "1.bias": inf, "1.weight": -inf}, "NaN and +-inf")),
        ("two NaN entries in one weight", two_in_one_tensor),
    ])


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


@reuses_known_results
def drive_health_check(fn, seed: int = 0, fault: str = "nan-params", at: int = 3,
                       n_steps: int = 4, snapshot_every: int = 1, again: int | None = None) -> dict:
    """n_steps fake steps: fresh random gradients (for 'nan-grads' one NaN entry at step
    `at`), steps.apply_update (clipping spreads a NaN to every gradient, SGD into every weight
    and its momentum), a NaN / inf written into a weight after the update of step `at` (and of
    step `again`, a second rollback to the same snapshot) for 'nan-params' / 'inf-params',
    then `fn(run)`, the health check; then one clean update. 'step_count': the run's at the
    end (a rollback restores weights and optimizer, not the count of finished steps)."""
    _check_fault(fault)
    run = _health_run(seed, snapshot_every)
    g = gen(3000 + seed)
    returns = []
    for step in range(1, n_steps + 1):
        _fresh_gradients(run, g)
        if fault == "nan-grads" and step == at:
            next(run.policy.parameters()).grad.view(-1)[0] = float("nan")
        steps.apply_update(run)
        if fault in PARAM_FAULTS and step in (at, again):
            _poison(run, fault)
        returns.append(fn(run))
        run.step_count += 1  # what the step does after update_fn returns
    _fresh_gradients(run, g)
    steps.apply_update(run)  # the optimizer state the check left behind acts here
    return {"params": flat_params(run.policy), "returns": returns, "step_count": run.step_count,
            "snapshot_step": getattr(getattr(run, "snapshot", None), "step", None),
            "return_types": sorted({type(r).__name__ for r in returns})}


@reuses_known_results
def drive_healthy_update(fn, seed: int = 0, fault: str = "nan-params", at: int = 3,
                         n_steps: int = 4, snapshot_every: int = 1) -> dict:
    """The fake steps of drive_health_check with `fn(run, update_fn=...)` as the update:
    the update_fn it gets is steps.apply_update with the fault put in at step `at` (a NaN
    gradient entry before it, or a NaN / inf weight after it; 'skip-then-nan': the update
    of step `at` is skipped, as guarded_update skips one, and the next writes a NaN weight).
    run.rolled_back is reset before each call and read after it."""
    if fault != "skip-then-nan":
        _check_fault(fault)
    run = _health_run(seed, snapshot_every)
    g = gen(3000 + seed)

    def update(r):
        if fault == "skip-then-nan" and r.step_count == at - 1:
            norm = torch.nn.utils.clip_grad_norm_(list(r.policy.parameters()), math.inf).item()
            r.optimizer.zero_grad(set_to_none=True)
            return norm, 1
        if fault == "nan-grads" and r.step_count == at - 1:
            next(r.policy.parameters()).grad.view(-1)[0] = float("nan")
        out = steps.apply_update(r)
        if fault in PARAM_FAULTS and r.step_count == at - 1:
            _poison(r, fault)
        if fault == "skip-then-nan" and r.step_count == at:
            _poison(r, "nan-params")
        return out

    outs, flags = [], []
    for _ in range(n_steps):
        _fresh_gradients(run, g)
        run.rolled_back = None
        outs.append(fn(run, update_fn=update))
        flags.append(getattr(run, "rolled_back", None))
        run.step_count += 1
    return {"params": flat_params(run.policy), "outs": outs, "flags": flags,
            "flag_types": sorted({type(f).__name__ for f in flags})}


def _health_check(run, *, snapshot_first=False, count=nonfinite_params, weights_only=False,
                  snapshot=True, due_every_step=False, due_one_step_off=False,
                  restore=True) -> int:
    """The reference health check with switches: each known mistake is one switch turned."""
    step = run.step_count + 1
    due = step % run.cfg.snapshot_every == 0
    if snapshot_first:
        if due:
            run.snapshot = Snapshot(run.policy, run.optimizer, step)
        if count(run.policy):
            run.snapshot.restore(run.policy, run.optimizer)
            return 1
        return 0
    if count(run.policy):
        if weights_only:
            run.policy.load_state_dict(run.snapshot.model_state)
        elif restore:
            run.snapshot.restore(run.policy, run.optimizer)
        return 1
    if not snapshot:
        return 0
    if due_every_step:
        due = True
    elif due_one_step_off:
        due = run.step_count % run.cfg.snapshot_every == 0
    if due:
        run.snapshot = Snapshot(run.policy, run.optimizer, step)
    return 0


def _nan_count(model) -> int:
    return sum(int(torch.isnan(p).sum()) for p in model.parameters())


def _plain_ints(type_names) -> bool:
    """Whether a driver's values were plain Python numbers (None: unset, another check's)."""
    return not set(type_names or ()) - {"int", "bool", "NoneType"}


HEALTH_CHECK_MISTAKES = (
    Mistake("snapshot_before_check", partial(_health_check, snapshot_first=True),
            "the snapshot is taken before the parameters are checked: on a step that is due "
            "for one, the bad weights become the snapshot, and the rollback restores them. "
            "Check first; keep a snapshot only of a healthy step"),
    Mistake("not_restored", partial(_health_check, restore=False),
            "a rollback is reported (1) but nothing is restored: the bad weights stay and the "
            "next step trains on them. `run.snapshot.restore(run.policy, run.optimizer)`, "
            "then return 1"),
    Mistake("model_only", partial(_health_check, weights_only=True),
            "only the weights are restored, not the optimizer state: the optimizer's running "
            "averages (momentum here, AdamW's m and v) still hold what the bad step put in "
            "them (NaN after a NaN gradient), and the next update writes it back into the "
            "weights. `run.snapshot.restore(run.policy, run.optimizer)` restores both"),
    Mistake("never_snapshot", partial(_health_check, snapshot=False),
            "no new snapshot is ever taken: every rollback goes back to the snapshot of step "
            "0 and throws away every healthy step since. Keep `Snapshot(run.policy, "
            "run.optimizer, step)` in run.snapshot every cfg.snapshot_every healthy steps"),
    Mistake("nan_only", partial(_health_check, count=_nan_count),
            "only NaN is counted, not +-inf: `torch.isnan` misses inf, which poisons the next "
            "forward as surely as NaN. Count `~torch.isfinite(p)` (your nonfinite_params)"),
    Mistake("snapshot_every_ignored", partial(_health_check, due_every_step=True),
            "a snapshot is kept after every healthy step, ignoring cfg.snapshot_every (each "
            "one copies every weight and the optimizer state): keep one only when the step is "
            "a multiple of cfg.snapshot_every"),
    Mistake("snapshot_on_wrong_step", partial(_health_check, due_one_step_off=True),
            "the snapshot is taken one step off: the health check runs inside update_fn, "
            "before your step counts itself, so the step it finishes is run.step_count + 1; a "
            "snapshot is due when (run.step_count + 1) % cfg.snapshot_every == 0"),
)


def check_health_check(fn: Callable) -> CheckResult:
    ref = hardening.health_check

    def vector(out: dict) -> torch.Tensor | None:
        if not isinstance(out.get("params"), torch.Tensor):
            return None
        return torch.cat([out["params"].double(),
                          torch.tensor([number(r) for r in out["returns"]], dtype=torch.double)])

    def case(**params):
        def run(f):
            out, want = drive(f, drive_health_check, **params), drive_health_check(ref, **params)
            if not _plain_ints(out.get("return_types")):
                raise Mismatch(f"return a Python int, 1 after a rollback and 0 otherwise (yours "
                               f"returned {', '.join(out['return_types'])}): the step adds it to "
                               "its metrics, which are JSON; `int(...)` or `.item()`")

            def returns():
                if same(out["params"], want["params"]):
                    raise Mismatch("return 1 for the step you rolled back and 0 for every "
                                   f"other: yours returned {out['returns']}, expected "
                                   f"{want['returns']}")
            compare_all(vector(out), vector(want), "the parameters after the steps (and what "
                         "your check returned)", HEALTH_CHECK_MISTAKES,
                        lambda m: vector(drive_health_check(m, **params)), returns)
            if out.get("snapshot_step") != want["snapshot_step"]:
                raise Mismatch(f"run.snapshot.step is {out.get('snapshot_step')}, expected "
                               f"{want['snapshot_step']}: label a snapshot with the step it "
                               "keeps, the one this check finishes, run.step_count + 1 (the "
                               "step counts itself after update_fn returns)")
            if out.get("step_count") != want["step_count"]:
                raise Mismatch(f"run.step_count is {out.get('step_count')}, expected "
                               f"{want['step_count']}: a rollback restores the weights and the "
                               "optimizer's state, not the count of finished steps; leave it")
        return run

    return run_check("health_check", fn, ref, [
        ("a NaN written into a weight after the update of step 3 of 4, a snapshot every step",
         case(seed=0, fault="nan-params", at=3, n_steps=4, snapshot_every=1)),
        ("an inf written into a weight at step 3 of 4",
         case(seed=1, fault="inf-params", at=3, n_steps=4, snapshot_every=1)),
        ("NaN weights at steps 6 and 7 of 8, a snapshot every 4 steps: two rollbacks to the "
         "same snapshot, so it must not change between them (copy the optimizer's state)",
         case(seed=3, fault="nan-params", at=6, again=7, n_steps=8, snapshot_every=4)),
        ("a NaN gradient entry at step 7 of 8, a snapshot every 4 steps: clipping spreads it "
         "to every weight and into the optimizer's momentum",
         case(seed=2, fault="nan-grads", at=7, n_steps=8, snapshot_every=4)),
    ])


# healthy_update's known mistakes: each is an update of (run, update_fn)
def _check_before_update(run, update_fn=steps.apply_update):
    rolled = hardening.health_check(run)
    out = update_fn(run)
    run.rolled_back = rolled
    return out


def _no_health_check(run, update_fn=steps.apply_update):
    out = update_fn(run)
    run.rolled_back = 0
    return out


def _rollback_not_recorded(run, update_fn=steps.apply_update):
    out = update_fn(run)
    hardening.health_check(run)
    return out


def _rollback_as_skipped(run, update_fn=steps.apply_update):
    grad_norm, skipped = update_fn(run)
    run.rolled_back = hardening.health_check(run)
    return grad_norm, max(skipped, run.rolled_back)


def _own_update(run, update_fn=steps.apply_update):
    out = steps.apply_update(run)
    run.rolled_back = hardening.health_check(run)
    return out


HEALTHY_UPDATE_MISTAKES = (
    Mistake("check_before_update", _check_before_update,
            "the health check runs before the update: it sees the weights of the step before, "
            "so a NaN this update writes is found a step late, after the next step's sampler "
            "has drawn from it (and crashed). Call `update_fn(run)` first, then "
            "`health_check(run)`"),
    Mistake("no_health_check", _no_health_check,
            "the health check never runs: call `health_check(run)` after `update_fn(run)`"),
    Mistake("rollback_not_recorded", _rollback_not_recorded,
            "the rollback is not recorded: set `run.rolled_back` to what `health_check(run)` "
            "returned (1 or 0) on every call, so the run's metrics can count it"),
    Mistake("rollback_as_skipped", _rollback_as_skipped,
            "a rollback is reported as a skipped update: return update_fn's (grad_norm, "
            "skipped) as it is. The update was not skipped (it reached the weights), and the "
            "rollback undoes every step since the snapshot; it goes in run.rolled_back"),
    Mistake("own_update", _own_update,
            "your healthy_update runs an update of its own instead of the `update_fn` it is "
            "given: call `update_fn(run)`, so that whatever update the step passes in (your "
            "apply_update, your guarded_update) is the one checked"),
)


def check_healthy_update(fn: Callable) -> CheckResult:
    ref = hardening.healthy_update

    def vector(out: dict) -> torch.Tensor | None:
        outs = out.get("outs") or []
        if not isinstance(out.get("params"), torch.Tensor):
            return None
        skipped = [number(o[1]) if isinstance(o, tuple) and len(o) == 2 else -2.0 for o in outs]
        return torch.cat([out["params"].double(), torch.tensor(
            [number(f) for f in out["flags"]] + skipped, dtype=torch.double)])

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
            if not _plain_ints(out.get("flag_types")):
                raise Mismatch("set run.rolled_back to a Python int, 1 or 0 (yours held "
                               f"{', '.join(out['flag_types'])}): the step writes it into its "
                               "metrics, which are JSON; `int(...)` or `.item()`")
            bad = [o for o in out["outs"] if not (isinstance(o, tuple) and len(o) == 2)]
            if bad:
                raise Mismatch("return (grad_norm, skipped), a tuple of two, as update_fn "
                               f"does; got {bad[0]!r}")
            def flags():
                if not same(out["params"], want["params"]):
                    return
                got = [number(x) for x in out["flags"]]
                if got != [number(x) for x in want["flags"]]:
                    raise Mismatch(f"run.rolled_back after each step was {out['flags']}, "
                                   f"expected {want['flags']} (set it on every call: 1 when "
                                   "health_check rolled back, else 0)")
                raise Mismatch(f"return update_fn's skipped as it is: yours returned "
                               f"{[o[1] for o in out['outs']]}, expected "
                               f"{[o[1] for o in want['outs']]}")
            compare_all(vector(out), vector(want), "the parameters after the steps (with "
                         "run.rolled_back and the skipped flags)", HEALTHY_UPDATE_MISTAKES,
                        lambda m: vector(drive_healthy_update(m, **params)), flags)
            got = [number(o[0]) for o in out["outs"]]
            expected = [number(o[0]) for o in want["outs"]]
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
        ("step 2's update skipped, then a NaN weight at step 3, a snapshot every 2 steps: the "
         "health check runs on every call, skipped or not, so step 2's snapshot is taken",
         case(seed=2, fault="skip-then-nan", at=2, n_steps=4, snapshot_every=2)),
    ])


# --- the notebook's exercises, in its order -------------------------------------------------
EXERCISES = (
    Exercise('nonfinite_params', nonfinite_params, check_nonfinite_params),
    Exercise('health_check', hardening.health_check, check_health_check,
             driver=drive_health_check, mistakes=HEALTH_CHECK_MISTAKES),
    Exercise('healthy_update', hardening.healthy_update, check_healthy_update,
             driver=drive_healthy_update, mistakes=HEALTHY_UPDATE_MISTAKES),
)
