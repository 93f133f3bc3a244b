"""Notebook 08, fix gradient accumulation: the checks of its exercises, and each exercise as
data in `EXERCISES`."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch

from ...objective import (
    completion_logprobs,
    token_weights,
)
from ...sampling import (
    sample_group,
)
from ...step import micro_batch_slices
from ...tasks import ProblemStream
from .. import hardening, steps
from .base import (
    CheckResult,
    Exercise,
    Mismatch,
    Mistake,
    close,
    compare_all,
    expect,
    run_check,
)
from .fixtures import (
    check_step_contract,
    drive_a_step,
    drive_step,
    fixture_cfg,
    fixture_run,
    flat_params,
    reuses_known_results,
)


def check_micro_batch_slices(fn: Callable) -> CheckResult:

    def same_split(n, k):
        def case(f):
            got = f(n, k)
            if isinstance(got, (list, tuple)) and all(isinstance(s, slice) for s in got):
                sizes = [len(range(n)[s]) for s in got]
                rows = [i for s in got for i in range(n)[s]]
                if 0 in sizes:
                    raise Mismatch(f"{n} rows, k={k}: a micro-batch is empty (sizes {sizes})")
                if sizes and max(sizes) - min(sizes) > 1:
                    raise Mismatch(f"{n} rows, k={k}: sizes {sizes} differ by more than 1")
                if rows != list(range(n)):
                    raise Mismatch(f"{n} rows, k={k}: your slices cover rows {rows}, expected "
                                   f"0..{n - 1} once each, in order")
                want = [len(range(n)[s]) for s in micro_batch_slices(n, k)]
                if sorted(sizes) == sorted(want) and sizes != want:
                    raise Mismatch(f"{n} rows, k={k}: your sizes are {sizes}, expected {want}: "
                                   f"the {n % k} extra row(s) go to the first slices, one each, "
                                   "as torch.tensor_split and the trainer split them")
                if [s.indices(n) for s in got] == [s.indices(n) for s in micro_batch_slices(n, k)]:
                    return  # slice(a, b, 1) and slice(a, b) are the same rows
            expect(list(got) if isinstance(got, tuple) else got, micro_batch_slices(n, k),
                    f"the slices for {n} rows, k={k}")
        return case

    def refuses(n, k):
        def case(f):
            try:
                got = f(n, k)
            except ValueError:
                return
            except Exception as e:  # noqa: BLE001 - any other error is the wrong one
                raise Mismatch(f"micro_batch_slices({n}, {k}) raised {type(e).__name__}; it "
                               "must raise ValueError, the error for a value a function "
                               "cannot take (an assert is skipped under python -O)") from None
            raise Mismatch(f"micro_batch_slices({n}, {k}) returned {got}; it must raise "
                           "ValueError (a micro-batch would be empty: report 004)")
        return case

    return run_check("micro_batch_slices", fn, micro_batch_slices, [
        ("16 rows into 3 (sizes 6, 5, 5)", same_split(16, 3)),
        ("64 rows into 4", same_split(64, 4)),
        ("17 rows into 5 (sizes 4, 4, 3, 3, 3)", same_split(17, 5)),
        ("k = 1: the whole batch", same_split(5, 1)),
        ("k = n_rows: one row each", same_split(4, 4)),
        ("1 row into 4 micro-batches (report 004)", refuses(1, 4)),
        ("k = 0", refuses(3, 0)),
    ])


@reuses_known_results
def drive_accumulated(fn, seed: int = 0, **overrides) -> dict:
    """drive_step for an accumulating step: one step on the fixture (the same batch as
    drive_step's), and the rows of every training forward of the policy (with gradient)."""
    run = fixture_run(seed, **overrides)
    rows: list[int] = []

    def count(module, inputs, output):
        if torch.is_grad_enabled():
            rows.append(int(output.shape[0]))

    parts: list[dict] = []  # each micro-batch's loss, kl and completion tokens

    def loss_fn(logp, old_logp, ref_logp, advantages, weights, cfg):
        loss, stats = steps.grpo_loss(logp, old_logp, ref_logp, advantages, weights, cfg)
        parts.append({"loss": loss.item(), "kl": stats["kl"],
                      "tokens": int((weights > 0).sum())})
        return loss, stats

    hook = run.policy.get_output_embeddings().register_forward_hook(count)
    before = flat_params(run.policy)
    problems = ProblemStream(seed).sample(run.cfg.prompts_per_step)
    torch.manual_seed(seed)  # the sampler's draws
    counted = run.step_count
    try:
        metrics = fn(run, problems, loss_fn=loss_fn, update_fn=steps.apply_update)
    finally:
        hook.remove()
    return {"update": flat_params(run.policy) - before, "metrics": metrics, "rows": rows,
            "step_count": (counted, run.step_count), "parts": parts}


def metric_of_the_parts(key: str, value: float, parts: list[dict]) -> str:
    """Words for an accumulated step's metric that is a wrong combination of its
    micro-batches' parts (`parts`: the reference step's, as drive_accumulated records them);
    "" where it is none of them."""
    if not parts:
        return ""
    wrong = {
        "the last micro-batch's part only: add up every micro-batch's part":
            parts[-1][key],
        "the plain mean of the micro-batches' values: weight each by its completion tokens "
        "(a micro-batch with more tokens counts for more)":
            sum(p[key] for p in parts) / len(parts),
    }
    tokens = max(1, sum(p["tokens"] for p in parts))
    right = {"loss": sum(p["loss"] for p in parts),
             "kl": sum(p["kl"] * p["tokens"] for p in parts) / tokens}
    for words, candidate in wrong.items():
        if not close(candidate, right[key]) and close(value, candidate):
            return words
    return ""


def _accumulated(run, problems, loss_fn, update_fn=steps.apply_update, sample_fn=sample_group,
                 *, clear_before=True, clear_inside=False, copy_grads=False, step_inside=False,
                 weights_per_micro_batch=False, divide_by_k=False) -> dict:
    """hardening.accumulated_grpo_step with switches in its micro-batch loop: each known
    mistake is some of them turned."""
    cfg = run.cfg
    rollout, rewards, advantages, ref_logp = steps.sample_and_score(run, problems, sample_fn)
    ids, attention, C = rollout.input_ids, rollout.attention_mask, rollout.completion_length
    mask = rollout.completion_mask
    whole = token_weights(mask, cfg.loss_type, cfg.max_new_tokens)
    params = list(run.policy.parameters())
    k = cfg.grad_accum_steps
    if clear_before:
        run.optimizer.zero_grad(set_to_none=True)
    for rows in micro_batch_slices(len(rewards), k):
        if clear_inside:
            run.optimizer.zero_grad(set_to_none=True)
        logp = completion_logprobs(run.policy, ids[rows], attention[rows], C, cfg.temperature)
        weights = whole[rows]
        if weights_per_micro_batch:
            weights = token_weights(mask[rows], cfg.loss_type, cfg.max_new_tokens)
        if divide_by_k:
            weights = weights / k
        part, _ = loss_fn(logp, logp.detach(), ref_logp[rows], advantages[rows], weights, cfg)
        if copy_grads:
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
        if step_inside:
            update_fn(run)
    if not step_inside:
        update_fn(run)
    run.step_count += 1
    return {}


def _sampler_flags_dropped(run, problems, loss_fn, update_fn=steps.apply_update,
                           sample_fn=sample_group) -> dict:
    def without_flags(model, tok, prompts, G, n, temperature=1.0, *rest, **kw):
        return sample_fn(model, tok, prompts, G, n, temperature)
    return hardening.accumulated_grpo_step(run, problems, loss_fn, update_fn, without_flags)


def _update_fn_bypassed(run, problems, loss_fn, update_fn=steps.apply_update,
                        sample_fn=sample_group) -> dict:
    def optimizer_step_only(r):  # the grad norm still logged, nothing clipped
        params = [p for p in r.policy.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, math.inf).item()
        r.optimizer.step()
        return grad_norm, 0
    return hardening.accumulated_grpo_step(run, problems, loss_fn, optimizer_step_only, sample_fn)


def _reference_is_policy(run, problems, loss_fn, update_fn=steps.apply_update,
                         sample_fn=sample_group) -> dict:
    reference, run.reference = run.reference, run.policy
    try:
        return hardening.accumulated_grpo_step(run, problems, loss_fn, update_fn, sample_fn)
    finally:
        run.reference = reference


ACCUMULATED_GRPO_STEP_MISTAKES = (
    Mistake("zero_grad_inside", partial(_accumulated, clear_inside=True),
            "only the last micro-batch's gradient reaches the update: "
            "`run.optimizer.zero_grad()` runs inside the micro-batch loop and clears what the "
            "earlier micro-batches added. Clear the gradients once, before the loop (report "
            "003)"),
    Mistake("copy_instead_of_add", partial(_accumulated, copy_grads=True),
            "each micro-batch's gradient is written over the one before (`p.grad.copy_(g)` "
            "or `p.grad = g`) instead of added to it (`p.grad.add_(g)`; `backward()` adds "
            "into .grad by itself), which also leaves only the last micro-batch's (report "
            "003)"),
    Mistake("step_inside_loop", partial(_accumulated, clear_inside=True, step_inside=True),
            "the update runs inside the micro-batch loop: one update per micro-batch, each "
            "from that micro-batch's gradient alone, instead of one update from the whole "
            "batch's. Call `update_fn(run)` once, after the loop (report 003)"),
    Mistake("step_inside_loop_accumulating", partial(_accumulated, step_inside=True),
            "the update runs inside the micro-batch loop, without clearing the gradients in "
            "between: every update steps with the gradient summed so far, so the first "
            "micro-batch's gradient is applied k times. Call `update_fn(run)` once, after the "
            "loop"),
    Mistake("per_micro_batch_normalisation",
            partial(_accumulated, weights_per_micro_batch=True, divide_by_k=True),
            "each micro-batch's token weights come from that micro-batch's mask alone "
            "(`token_weights(mask[rows], ...)`) and the loss is divided by k: a micro-batch "
            "with fewer rows (grpo, dr_grpo) or fewer tokens (bnpo, dapo) then weighs more "
            "than it does in the whole batch. Compute the weights once, on the whole batch's "
            "mask, and give each micro-batch its rows of them: `weights[rows]`"),
    Mistake("micro_batch_weights", partial(_accumulated, weights_per_micro_batch=True),
            "each micro-batch's token weights come from that micro-batch's mask alone "
            "(`token_weights(mask[rows], ...)`), so each micro-batch's loss is normalised as if "
            "it were the whole batch, and the k losses sum to about k times the batch's loss, "
            "weighted differently. Compute the weights once, on the whole batch's mask, and "
            "give each micro-batch its rows of them: `weights[rows]`"),
    Mistake("sampler_flags_dropped", _sampler_flags_dropped,
            "your step does not pass `cfg.top_k` and `cfg.top_p` to the sampler: it samples "
            "from the whole distribution even when the config asks for top-k or nucleus "
            "sampling; call sample_fn(model, tokenizer, prompts, G, cfg.max_new_tokens, "
            "cfg.temperature, cfg.top_k, cfg.top_p)"),
    Mistake("divided_by_k", partial(_accumulated, divide_by_k=True),
            "each micro-batch's loss is divided by k: its token weights are already the whole "
            "batch's (`weights[rows]`), so the parts add up to the batch's loss as they are, "
            "and dividing makes the update k times too small"),
    Mistake("update_fn_bypassed", _update_fn_bypassed,
            "your step calls `run.optimizer.step()` itself instead of `update_fn(run)`: the "
            "update function clips the gradient (cfg.max_grad_norm) and, in later notebooks, "
            "skips bad updates; call update_fn(run) once, after the loop"),
    Mistake("reference_is_policy", _reference_is_policy,
            "the reference log-probs come from `run.policy`: they must come from the frozen "
            "`run.reference` (under torch.no_grad()), or the KL penalty compares the policy "
            "with itself"),
    Mistake("no_zero_grad", partial(_accumulated, clear_before=False),
            "your step never clears the gradients before the micro-batch loop: the gradients "
            "left in .grad by the last step are added to this one's"),
)


def check_accumulated_grpo_step(fn: Callable) -> CheckResult:
    ref = steps.grpo_step  # the full batch in one backward: what accumulation must reproduce

    def case(seed, **overrides):
        def run(f):
            out = drive_a_step(f, drive_accumulated, "accumulated_grpo_step", seed=seed, **overrides)
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
            compare_all(out["update"], want["update"], "the parameters after your step",
                        ACCUMULATED_GRPO_STEP_MISTAKES,
                        lambda m: drive_accumulated(m, seed, **overrides)["update"])
            got = out["metrics"]
            missing = sorted(set(want["metrics"]) - set(got))
            if missing:
                raise Mismatch(f"the metrics have no {missing[0]!r}"
                               + (f" (nor {', '.join(map(repr, missing[1:4]))})"
                                  if missing[1:] else "")
                               + ": the step returns every metric the full-batch step does, "
                               "the loss's stats included, each combined over the micro-batches")
            tensors = sorted(k for k, v in got.items() if isinstance(v, torch.Tensor))
            if tensors:
                raise Mismatch(f"metrics[{tensors[0]!r}] is a tensor: give the metrics plain "
                               "Python numbers (`.item()` of each micro-batch's part, then add "
                               "them up); a tensor keeps its graph alive and is not JSON")
            for key, what in (("reward", ""), ("grad_norm", ""),
                              ("loss", " (the sum of the micro-batch losses: the "
                                       "whole batch's loss)"),
                              ("kl", " (the micro-batches' kl weighted by their completion "
                                     "tokens)")):
                if key not in got:
                    raise Mismatch(f"the metrics have no {key!r} (keys: {sorted(got)[:8]})")
                value, expected = float(got[key]), float(want["metrics"][key])
                # the mean of the parts: k times it is the full batch's loss up to the
                # rounding of a sum in another order; the loss is a near-cancelling sum (parts
                # of 3e-2 add up to 3e-5 here), so that rounding is relatively large: 1%
                if key == "loss" and not close(value, expected) and value and \
                        abs(value * k - expected) <= 0.01 * abs(expected):
                    raise Mismatch(f"metrics['loss'] is {value:.6g}, expected {expected:.6g}: "
                                   f"the whole batch's loss divided by k = {k}; each "
                                   "micro-batch's part already carries the whole batch's token "
                                   "weights, so the parts add up to the loss: sum them, do not "
                                   "average them")
                if key in ("loss", "kl") and not close(value, expected):
                    ref_parts = drive_accumulated(hardening.accumulated_grpo_step, seed,
                                                  **overrides)["parts"]
                    words = metric_of_the_parts(key, value, ref_parts)
                    if words:
                        raise Mismatch(f"metrics[{key!r}] is {value:.6g}, expected "
                                       f"{expected:.6g}: {words}")
                expect(value, expected, f"metrics[{key!r}]{what}", atol=1e-5, rtol=1e-4)
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
        ("grpo, 2 micro-batches, top-k 4 and top-p 0.8 sampling",
         case(3, loss_type="grpo", grad_accum_steps=2, top_k=4, top_p=0.8)),
    ])


# --- the notebook's exercises, in its order -------------------------------------------------
EXERCISES = (
    Exercise('micro_batch_slices', micro_batch_slices, check_micro_batch_slices),
    Exercise('accumulated_grpo_step', hardening.accumulated_grpo_step, check_accumulated_grpo_step,
             driver=drive_accumulated, mistakes=ACCUMULATED_GRPO_STEP_MISTAKES),
)
