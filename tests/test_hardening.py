"""The learner's hardened trainer (notebooks 07 and 08): the references compute what `Trainer`
computes with the same switches, accumulation is exact for every loss type on micro-batches
of unequal tokens, every known mistake is caught and named by its checker, and the grader
checks these exercises inside its sandbox."""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch

from grpo_lab import preset
from grpo_lab.course import exercises, hardening, labs, steps
from grpo_lab.course.exercises import fixtures, nb07, nb08
from grpo_lab.field.faults import FAULTS, INJECT_AT
from grpo_lab.health import Snapshot, nonfinite_params
from grpo_lab.numerics import sum_error_bound
from grpo_lab.sampling import sample_group
from grpo_lab.tasks import ProblemStream
from grpo_lab.trainer import Trainer, micro_batch_slices

ROOT = Path(__file__).resolve().parents[1]
NB07 = ROOT / "solutions" / "07_fix_health_checks_and_recovery.ipynb"
NB08 = ROOT / "solutions" / "08_fix_gradient_accumulation.ipynb"
LOSS_TYPES = ("grpo", "dr_grpo", "bnpo", "dapo")


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# --- the references against Trainer --------------------------------------------------------------
@pytest.mark.numerics
def test_reference_health_check_rolls_back_as_the_trainer_does():
    """The fault injector's NaN weight at step 7 of 8, a snapshot every 3 steps: the learner's
    reference trainer (with healthy_update around guarded_update) and Trainer(fast=False) roll
    back the same step to the same snapshot and end with the same weights."""
    cfg = preset("stable", steps=8, eval_every=0, eval_size=8, snapshot_every=3)
    trainer = Trainer(cfg, fast=False)
    FAULTS["nan-params"](trainer)
    history = trainer.train(progress=False)
    run = steps.new_run(cfg, fast=False)
    run.snapshot = Snapshot(run.policy, run.optimizer, 0)
    faulty = steps.with_fault(run, partial(steps.grpo_step, loss_fn=steps.grpo_loss,
                                           update_fn=steps.guarded_update,
                                           sample_fn=steps.safe_sample), "nan-params")
    update = partial(hardening.healthy_update, update_fn=faulty.keywords["update_fn"])
    rolled = []
    steps.train(run, partial(faulty, update_fn=update), progress=False, verbose=False,
                callback=lambda m: rolled.append(run.rolled_back))
    assert [m["rolled_back"] for m in history if "rolled_back" in m] == rolled
    assert rolled == [0] * (INJECT_AT - 1) + [1, 0]
    assert trainer.snapshot.step == run.snapshot.step == 6
    assert nonfinite_params(run.policy) == 0
    # the same code on both sides (fast=False: the same forwards, losses, reductions and
    # AdamW, in the same order): the same weights to the bit, on any CPU
    assert torch.equal(_params(trainer.policy), _params(run.policy))


@pytest.mark.numerics
def test_reference_accumulated_step_is_the_trainers_accumulation():
    cfg = preset("stable", steps=1, eval_size=8, grad_accum_steps=4, loss_type="dapo")
    trainer = Trainer(cfg, fast=False)
    trainer.step()
    run = steps.new_run(cfg, fast=False)
    hardening.accumulated_grpo_step(run, run.stream.sample(cfg.prompts_per_step),
                                    steps.grpo_loss, steps.guarded_update, steps.safe_sample)
    assert torch.equal(_params(trainer.policy), _params(run.policy))  # the same code: to the bit


def _first_gradient(step, seed: int, **overrides) -> torch.Tensor:
    return _gradient_run(step, seed, **overrides)["grad"]


def _gradient_run(step, seed: int, double: bool = False, rollout=None, **overrides) -> dict:
    """The gradient one step leaves for its update ('grad'), the batch it sampled
    ('rollout'), and the sum of the norms of what each backward() added to .grad ('parts').
    double=True: the policy and reference in float64, on `rollout` (the float32 run's
    batch: sampling in float64 could draw other tokens)."""
    run = fixtures.fixture_run(seed, **overrides)
    if double:
        run.policy.double()
        run.reference.double()
    params = list(run.policy.parameters())
    grads, seen, state = [], {}, {"prev": {}, "square": 0.0, "count": 0, "parts": 0.0}

    def added(p):  # after each backward() has added into p.grad
        before = state["prev"].get(p)
        delta = p.grad.double() - (before if before is not None else 0.0)
        state["prev"][p] = p.grad.detach().double().clone()
        state["square"] += float(delta.pow(2).sum())
        state["count"] += 1
        if state["count"] == len(params):  # every parameter: one backward() is done
            state["parts"] += state["square"] ** 0.5
            state["square"], state["count"] = 0.0, 0

    hooks = [p.register_post_accumulate_grad_hook(added) for p in params]

    def record(r):
        grads.append(torch.cat([p.grad.flatten() for p in r.policy.parameters()]))
        return 0.0, 0

    def sample(*args, **kwargs):
        seen["rollout"] = rollout if rollout is not None else sample_group(*args, **kwargs)
        return seen["rollout"]

    torch.manual_seed(seed)
    run.optimizer.zero_grad(set_to_none=True)  # the fixture's stale gradients: not parts
    step(run, ProblemStream(seed).sample(run.cfg.prompts_per_step), loss_fn=steps.grpo_loss,
         update_fn=record, sample_fn=sample)
    for h in hooks:
        h.remove()
    return {"grad": grads[0], "rollout": seen.get("rollout"), "parts": state["parts"]}


def _tokens_per_micro_batch(seed: int, k: int) -> list[int]:
    run = fixtures.fixture_run(seed)
    torch.manual_seed(seed)
    problems = ProblemStream(seed).sample(run.cfg.prompts_per_step)
    r = sample_group(run.policy, run.tokenizer, [p.prompt for p in problems],
                     run.cfg.group_size, run.cfg.max_new_tokens, run.cfg.temperature)
    return [int(r.completion_mask[s].sum()) for s in micro_batch_slices(len(r.completions), k)]


@pytest.mark.numerics
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_accumulated_gradient_is_the_full_batch_gradient(loss_type):
    """Micro-batches of unequal rows and equal tokens (k = 3: 6, 5, 5 rows, 20 tokens each),
    and of equal rows but unequal tokens (k = 4): the accumulated gradient is the full-batch
    one to float rounding; `loss / k` is exact exactly where its assumption holds, equal rows
    for the per-row loss types (grpo, dr_grpo), equal tokens for the per-token ones."""
    loss_over_k = exercises.find("accumulated_grpo_step").mistake(
        "per_micro_batch_normalisation").wrong
    run = _gradient_run(steps.grpo_step, 0, loss_type=loss_type)
    full = run["grad"]
    # against the float64 gradient of the same batch (the argument of test_trainer's
    # accumulation test): the micro-batch gradients are as accurate as the full batch's
    # (2x its error), and adding k of them into .grad costs at most gamma~_k times the sum
    # of their norms (numerics.sum_error_bound)
    truth = _gradient_run(steps.grpo_step, 0, double=True, rollout=run["rollout"],
                          loss_type=loss_type)["grad"]
    error_full = (full.double() - truth).norm().item()
    seen = set()
    for k in (3, 4):
        rows = [s.stop - s.start for s in micro_batch_slices(16, k)]
        tokens = _tokens_per_micro_batch(0, k)
        mine = _gradient_run(hardening.accumulated_grpo_step, 0, loss_type=loss_type,
                             grad_accum_steps=k)
        error = (mine["grad"].double() - truth).norm().item()
        assert error <= 2 * error_full + 2 * sum_error_bound(k) * mine["parts"], (
            loss_type, k, error, error_full)
        shortcut = _gradient_run(loss_over_k, 0, loss_type=loss_type, grad_accum_steps=k)
        equal = len(set(rows if loss_type in ("grpo", "dr_grpo") else tokens)) == 1
        seen.add(equal)
        if equal:  # loss / k is then the right scale: the same bound as above
            error = (shortcut["grad"].double() - truth).norm().item()
            assert error <= 2 * error_full + 2 * sum_error_bound(k) * shortcut["parts"], (
                loss_type, k, rows, tokens, error)
        else:  # micro-batches of 6 and 5 rows (or unequal tokens) weighted 1/k each: rows
            # off by 6/5.5 or more, far above rounding (1e-5 of the gradient's size)
            error = ((shortcut["grad"] - full).norm() / full.norm()).item()
            assert error > 1e-3, (loss_type, k, rows, tokens, error)
    assert seen == {True, False}  # both kinds of split were tested


# --- the checkers ---------------------------------------------------------------------------------
@pytest.mark.numerics
def test_a_whole_batch_forward_is_not_accumulation():
    """grpo_step computes the right update in one forward of all rows: exact, but not
    accumulation (it holds every row's activations at once)."""
    result = nb08.check_accumulated_grpo_step(steps.grpo_step)
    assert result.status == "failed" and "on [16] rows at once" in result.reason, result.reason


@pytest.mark.numerics
def test_metrics_of_an_accumulated_step_are_the_whole_batchs():
    def last_kl(run, problems, loss_fn, update_fn=steps.apply_update, sample_fn=None):
        def loss(*args):
            value, stats = loss_fn(*args)
            return value, {**stats, "kl": 0.5}
        return hardening.accumulated_grpo_step(run, problems, loss, update_fn)

    result = nb08.check_accumulated_grpo_step(last_kl)
    assert result.status == "failed" and "metrics['kl']" in result.reason, result.reason


def test_an_accumulated_step_that_does_not_count_itself_is_named():
    """The same contract as the plain step's (steps.check_step_result): without it train()
    would loop forever on the learner's accumulated step."""
    def forgetful(run, problems, loss_fn, update_fn=steps.apply_update, sample_fn=None):
        metrics = hardening.accumulated_grpo_step(run, problems, loss_fn, update_fn)
        run.step_count -= 1
        return metrics

    result = nb08.check_accumulated_grpo_step(forgetful)
    assert result.status == "failed" and "left run.step_count at 0" in result.reason, \
        result.reason


def test_an_update_without_update_fn_is_told_how_it_is_called():
    def healthy_update(run):
        return hardening.healthy_update(run)

    result = nb07.check_healthy_update(healthy_update)
    assert result.status == "failed" and "healthy_update(run, update_fn=...)" in result.reason


def test_a_check_that_forgets_to_say_it_rolled_back_is_told():
    def health_check(run):
        hardening.health_check(run)
        return 0

    result = nb07.check_health_check(health_check)
    assert result.status == "failed" and "return 1 for the step you rolled back" in result.reason


def test_a_rollback_flag_set_only_when_rolling_back_is_told():
    def healthy_update(run, update_fn=steps.apply_update):
        out = update_fn(run)
        if hardening.health_check(run):
            run.rolled_back = 1
        return out

    result = nb07.check_healthy_update(healthy_update)
    assert result.status == "failed" and "set it on every call" in result.reason, result.reason


# --- the notebooks' exercises, through the grader -------------------------------------------------
def test_the_manifest_describes_the_new_exercises():
    data = labs.manifest([NB07, NB08])["notebooks"]
    ex = {e["function"]: e for nb in data.values() for e in nb["exercises"]}
    assert [e["function"] for e in data[NB07.name]["exercises"]] == [
        "nonfinite_params", "health_check", "healthy_update"]
    assert [e["function"] for e in data[NB08.name]["exercises"]] == [
        "micro_batch_slices", "accumulated_grpo_step"]
    for name in ("health_check", "healthy_update", "accumulated_grpo_step"):
        assert ex[name]["reference"] == f"grpo_lab.course.hardening.{name}"
        assert (ex[name]["points"], ex[name]["tier"]) == (1, "core")
        assert ex[name]["check_cell_id"] and ex[name]["idea"] and ex[name]["hint"]
    # graded alone: what each calls of the earlier exercises is bound to its reference
    provided = ex["healthy_update"]["provided"]
    assert provided["health_check"] == "grpo_lab.course.hardening.health_check"
    assert provided["apply_update"] == "grpo_lab.course.steps.apply_update"
    provided = ex["accumulated_grpo_step"]["provided"]
    assert {"micro_batch_slices", "completion_logprobs", "token_weights",
            "apply_update"} <= set(provided)
    for path in (NB07, NB08):  # the student versions: each exercise a stub with its hint
        student = labs.student_notebook(path)
        for cell in student.cells:
            if any(f"def {name}(" in cell.source for name in ex if name in (
                    "health_check", "healthy_update", "accumulated_grpo_step")):
                assert "raise NotImplementedError(" in cell.source
                assert "### BEGIN SOLUTION" not in cell.source


def test_the_grader_checks_health_and_accumulation_in_its_sandbox(tmp_path):
    from grpo_lab.course import grade

    manifest = labs.manifest([NB07, NB08])
    student = tmp_path / "student"
    student.mkdir()
    broken = {
        NB07: ("        run.snapshot.restore(run.policy, run.optimizer)",
               "        run.policy.load_state_dict(run.snapshot.model_state)"),
        NB08: ("                                   weights[rows], cfg)",
               "                                   token_weights(mask[rows], cfg.loss_type, "
               "cfg.max_new_tokens) / cfg.grad_accum_steps, cfg)"),
    }
    paths = []
    for path, (old, new) in broken.items():
        nb = json.loads(path.read_text())
        done = 0
        for cell in nb["cells"]:
            src = "".join(cell["source"])
            if old in src:
                cell["source"] = src.replace(old, new)
                done += 1
        assert done == 1, path
        paths.append(student / path.name)
        paths[-1].write_text(json.dumps(nb))
    out = tmp_path / "grades.json"
    grade.main([str(p) for p in paths], json_out=str(out), csv_out=None,
               journal=str(tmp_path / "j.jsonl"), manifest=manifest)
    by = {r["exercise"]: r for r in json.loads(out.read_text())}
    for ok in ("nonfinite_params", "healthy_update", "micro_batch_slices"):
        assert by[ok]["points"] == by[ok]["max_points"] == 1, by[ok]
    assert by["health_check"]["points"] == 0
    assert exercises.find("health_check").mistake("model_only").message in \
        by["health_check"]["reason"]
    assert by["accumulated_grpo_step"]["points"] == 0
    assert exercises.find("accumulated_grpo_step").mistake(
        "per_micro_batch_normalisation").message in by["accumulated_grpo_step"]["reason"]


def test_the_solutions_pass_the_grader(tmp_path):
    """The solution cells of 07 and 08, as a student would hand them in, score full points
    (the cells run alone in the sandbox, with the earlier exercises bound to references)."""
    from grpo_lab.course import grade

    manifest = labs.manifest([NB07, NB08])
    paths = []
    for path in (NB07, NB08):
        paths.append(tmp_path / path.name)
        shutil.copy(path, paths[-1])
    out = tmp_path / "grades.json"
    grade.main([str(p) for p in paths], json_out=str(out), csv_out=None,
               journal=str(tmp_path / "j.jsonl"), manifest=manifest)
    records = json.loads(out.read_text())
    assert [r["exercise"] for r in records] == [
        "nonfinite_params", "health_check", "healthy_update", "predict 07-rollbacks",
        "micro_batch_slices", "accumulated_grpo_step", "predict 08-step-inside-error"]
    assert all(r["points"] == r["max_points"] for r in records), records
