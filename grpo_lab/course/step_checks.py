"""Checkers for the learner's trainer (notebook 04 on): functions that take a model, an
optimizer or a config, and the whole GRPO step.

Each check builds a small fixed case (the shipped tiny GPT-2 on the CPU, 4 prompts x 4
completions), runs the learner's function and the reference on it, and compares what comes
out: log-probs, a loss and its gradient, or the parameters after one update. Where they
differ it runs the reference again with each known mistake put in (a *mutant*) and names
the one that reproduces the learner's result, in the learner's terms.

The case is built by a *driver*, a function of (the learner's function, picklable
parameters) listed in its module's `DRIVERS`: in a notebook `drive` calls it here; in the
grader the learner's function lives in the sandboxed worker and the driver runs there
(`RemoteFunction.drive`).
The fixture's optimizer is plain SGD, so an update is lr x the clipped gradient: two correct
steps that round differently agree to 1e-6, where AdamW's first step (g / |g|) would blow
rounding on near-zero gradient entries up to the learning rate.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Callable

import torch

from .. import naive
from ..config import preset
from ..field.variants import SAMPLING_CRASH
from ..numerics import sum_error_bound
from ..objective import (
    clipped_surrogate,
    completion_logprobs,
    kl_k3,
    position_ids_from_mask,
    token_logprobs,
    token_weights,
)
from ..policy import load_policy
from ..sampling import encode_prompts, sample_group
from ..tasks import ProblemStream
from . import steps
from .checks import CheckResult, Mismatch, _expect, _gen, run_check

STEP_TOL = dict(atol=1e-6, rtol=1e-4)


# --- the fixture -----------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _tiny():
    model, tokenizer = load_policy("cpu")
    return model.cpu(), tokenizer


def fixture_cfg(seed: int = 0, **overrides):
    base = dict(seed=seed, prompts_per_step=4, group_size=4, max_new_tokens=5, beta=0.04,
                learning_rate=0.05, max_grad_norm=1.0, eval_size=8, device="cpu")
    return preset("stable", **{**base, **overrides})


def fixture_run(seed: int = 0, **overrides) -> steps.Run:
    """A run whose policy has drifted from its reference (so the ratio against pi_old, the
    ratio against the reference and the KL all differ), with stale gradients left in .grad
    (a step that does not zero them adds them in), and SGD as its optimizer."""
    model, tokenizer = _tiny()
    run = steps.new_run(fixture_cfg(seed, **overrides), model=copy.deepcopy(model),
                        tokenizer=tokenizer)
    g = _gen(1000 + seed)
    with torch.no_grad():
        for p in run.policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02 * p.std().clamp(min=1e-3))
            p.grad = torch.randn(p.shape, generator=g) * 0.05
    run.optimizer = torch.optim.SGD(run.policy.parameters(), lr=run.cfg.learning_rate)
    return run


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# --- drivers: run the learner's function on a fixed case ---------------------------------------
def drive_step(fn, seed: int = 0, **overrides) -> dict:
    run = fixture_run(seed, **overrides)
    before = _flat(run.policy)
    problems = ProblemStream(seed).sample(run.cfg.prompts_per_step)
    torch.manual_seed(seed)  # the sampler's draws
    counted = run.step_count
    metrics = fn(run, problems, loss_fn=steps.grpo_loss, update_fn=steps.apply_update)
    return {"update": _flat(run.policy) - before, "metrics": metrics,
            "step_count": (counted, run.step_count)}


def check_step_contract(out: dict) -> None:
    """What train() needs of a whole step (steps.check_step_result: a metrics dict back,
    run.step_count one higher), as a checker's Mismatch."""
    try:
        steps.check_step_result(out["metrics"], *out["step_count"])
    except steps.StepError as e:
        raise Mismatch(str(e)) from None


def drive_update(fn, seed: int = 0, **overrides) -> dict:
    run = fixture_run(seed, **overrides)
    before = _flat(run.policy)
    out = fn(run)
    return {"update": _flat(run.policy) - before, "out": out}


def drive_guarded(fn, seed: int = 0, recent: tuple = (), nan_grad: bool = False) -> dict:
    """A guarded update on the fixture (stale gradients of norm ~45, max_grad_norm 1,
    spike factor 20), with `recent` as the known grad norms and, with nan_grad, one NaN
    gradient entry."""
    run = fixture_run(seed)
    run.recent_grad_norms.extend(recent)
    if nan_grad:
        next(iter(run.policy.parameters())).grad[0, 0] = float("nan")
    before = _flat(run.policy)
    out = fn(run)
    return {"update": (_flat(run.policy) - before).nan_to_num(1e9), "out": out,
            "recent": [float(x) for x in run.recent_grad_norms]}


def drive_sample(fn, seed: int = 0, fault: str | None = None) -> dict:
    """Sample 4 completions for each of 3 prompts of different lengths at T = 0.8 with a
    fresh tiny GPT-2; fault 'nan-params' makes its embedding NaN, 'new-pad' adds a pad token
    to the tokenizer that the model has no embedding row for (report 002)."""
    model, tokenizer = (copy.deepcopy(x) for x in _tiny())
    prompts = ["1+2=", "12+34=", "99+99="]
    if fault == "nan-params":
        with torch.no_grad():
            model.get_input_embeddings().weight.fill_(float("nan"))
    elif fault == "new-pad":
        tokenizer.add_special_tokens({"pad_token": "<new-pad>"})
    torch.manual_seed(seed)
    try:
        rollout = fn(model, tokenizer, prompts, 4, 5, 0.8, 0, 1.0)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - what the learner's sampler raised is the result
        return {"error": f"{type(e).__name__}: {e}"[:400]}
    ids = getattr(rollout, "completion_ids", None)
    return {"ids": ids if isinstance(ids, torch.Tensor) else None}


def drive_sample_tokens(fn, seed: int = 0, temperature: float = 0.7) -> dict:
    """Four prompts of different lengths, each twice, through fn with the tiny GPT-2."""
    model, tokenizer = _tiny()
    prompts = ["1+2=", "12+34=", "99+99=", "7+80="] * 2
    ids, mask = encode_prompts(tokenizer, prompts, torch.device("cpu"))
    torch.manual_seed(seed)
    out = fn(copy.deepcopy(model).eval(), ids, mask, 6, temperature, tokenizer.eos_token_id,
             tokenizer.pad_token_id)
    return {"ids": out}


def _batch(seed: int, C: int = 4):
    """A left-padded batch of prompts of different lengths, each followed by C ids."""
    _, tokenizer = _tiny()
    prompts = [p.prompt for p in ProblemStream(seed).sample(6)] + ["7+5=", "99+99="]
    ids, mask = encode_prompts(tokenizer, prompts, torch.device("cpu"))
    completion = torch.randint(0, tokenizer.eos_token_id + 1, (len(prompts), C),
                               generator=_gen(seed))
    return (torch.cat([ids, completion], 1),
            torch.cat([mask, torch.ones_like(completion)], 1), C)


def drive_logprobs(fn, seed: int = 0, temperature: float = 0.7) -> dict:
    model = copy.deepcopy(_tiny()[0])
    ids, mask, C = _batch(seed)
    out = fn(model, ids, mask, C, temperature)
    return {"logp": out, "requires_grad": bool(getattr(out, "requires_grad", False))}


def _loss_case(seed: int, drift: float = 0.0, **overrides):
    """A batch of 8 completions of up to 5 tokens; `drift` moves the reference's log-probs
    down by that much per token (a summed log-ratio of up to 5 x drift). Returns the config,
    a loss's five tensor arguments (the token weights of the batch's mask fifth), the mask."""
    cfg = fixture_cfg(seed, **overrides)
    g = _gen(seed)
    B, C = 8, 5
    old_logp = -torch.rand(B, C, generator=g) * 3
    logp = (old_logp + torch.randn(B, C, generator=g) * 0.4).requires_grad_()
    ref_logp = old_logp + torch.randn(B, C, generator=g) * 0.3 - drift
    lengths = torch.randint(1, C + 1, (B,), generator=g)
    mask = (torch.arange(C)[None] < lengths[:, None]).long()
    advantages = torch.randn(B, generator=g)
    weights = token_weights(mask, cfg.loss_type, cfg.max_new_tokens)  # as the step computes them
    return cfg, (logp, old_logp, ref_logp, advantages, weights), mask


def drive_loss(fn, seed: int = 0, drift: float = 0.0, **overrides) -> dict:
    """The loss and its gradient with respect to logp. The advantages come in as a tensor
    that carries a gradient (as if a graph had computed them): none may flow into them."""
    cfg, args, mask = _loss_case(seed, drift, **overrides)
    advantages = args[3].clone().requires_grad_()
    out = fn(*args[:3], advantages, args[4], cfg)
    if not (isinstance(out, tuple) and len(out) == 2):
        return {"bad_return": type(out).__name__}
    loss = out[0]
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad or loss.ndim != 0:
        return {"loss": loss, "grad": None}
    grad, adv_grad = torch.autograd.grad(loss, [args[0], advantages], allow_unused=True)
    stats = out[1] if isinstance(out[1], dict) else {}
    return {"loss": loss.detach(), "grad": torch.zeros_like(args[0]) if grad is None else grad,
            "advantages_get_gradient": adv_grad is not None and bool(adv_grad.abs().sum() > 0),
            "stats": {k: float(v) for k, v in stats.items() if isinstance(k, str)
                      and isinstance(v, (int, float, torch.Tensor))
                      and (not isinstance(v, torch.Tensor) or v.numel() == 1)},
            "mask": mask}


# the drivers a grading worker may run, by name (each checker module keeps its own)
DRIVERS: dict[str, Callable] = {f.__name__: f for f in (drive_step, drive_update,
                                                        drive_logprobs, drive_loss,
                                                        drive_guarded, drive_sample,
                                                        drive_sample_tokens)}


def drive(fn, driver: Callable, **params) -> dict:
    """Run `driver(fn, **params)`: here, or in the grader's worker when `fn` is the learner's
    function seen from the grader (the worker runs the same driver, found by its module
    and name in that module's DRIVERS)."""
    remote = getattr(getattr(fn, "__wrapped_student__", fn), "drive", None)
    if remote is not None:
        return remote(driver.__module__, driver.__name__, params)
    return driver(fn, **params)


# --- mutants: the reference with one known mistake put in --------------------------------------
@contextlib.contextmanager
def _patched(module, **names):
    old = {k: getattr(module, k) for k in names}
    for k, v in names.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


def _step_mutant(mistake: str) -> Callable:
    """The reference step with `mistake` in it, as a function of (run, problems, ...)."""
    def step(run, problems, loss_fn, update_fn):
        if mistake == "no_zero_grad":
            run.optimizer.zero_grad = lambda *a, **k: None
            return steps.grpo_step(run, problems, loss_fn, update_fn)
        if mistake == "old_logp_not_detached":
            return steps.grpo_step(run, problems, lambda lp, old, ref, *r: loss_fn(lp, lp, ref, *r),
                                   update_fn)
        if mistake == "ratio_against_reference":
            return steps.grpo_step(run, problems, lambda lp, old, ref, *r: loss_fn(lp, ref, ref, *r),
                                   update_fn)
        if mistake == "optimizer_step_without_update_fn":
            def plain(run):
                run.optimizer.step()
                return 0.0, 0
            return steps.grpo_step(run, problems, loss_fn, plain)
        if mistake == "answers_tiled":
            reward_fn = run.reward_fn
            G = run.cfg.group_size
            run.reward_fn = lambda c, answer, **k: reward_fn(
                c, answer=[p.answer for p in problems] * G, **k)
            return steps.grpo_step(run, problems, loss_fn, update_fn)
        if mistake == "reward_without_truncated":
            reward_fn = run.reward_fn
            run.reward_fn = lambda c, answer, **k: reward_fn(c, answer=answer)
            return steps.grpo_step(run, problems, loss_fn, update_fn)
        if mistake == "rewards_as_advantages":
            with _patched(steps, group_advantages=lambda r, *a, **k: r.clone()):
                return steps.grpo_step(run, problems, loss_fn, update_fn)
        if mistake == "temperature_ignored":
            def at_one(model, ids, mask, C, temperature=1.0, *a):
                return completion_logprobs(model, ids, mask, C, 1.0)
            with _patched(steps, completion_logprobs=at_one):
                return steps.grpo_step(run, problems, loss_fn, update_fn)
        if mistake == "sampler_flags_dropped":
            def without_flags(model, tok, prompts, G, n, temperature=1.0, *rest, **kw):
                return sample_group(model, tok, prompts, G, n, temperature)
            return steps.grpo_step(run, problems, loss_fn, update_fn, sample_fn=without_flags)
        if mistake == "loss_type_ignored":
            def as_grpo(mask, loss_type, max_new_tokens, **kw):
                return token_weights(mask, "grpo", max_new_tokens, **kw)
            with _patched(steps, token_weights=as_grpo):
                return steps.grpo_step(run, problems, loss_fn, update_fn)
        if mistake == "weights_over_padding":
            def with_padding(mask, loss_type, max_new_tokens, **kw):
                return token_weights(torch.ones_like(mask), loss_type, max_new_tokens, **kw)
            with _patched(steps, token_weights=with_padding):
                return steps.grpo_step(run, problems, loss_fn, update_fn)
        if mistake == "reference_is_policy":
            policy = run.policy

            def same(model, *a):
                return completion_logprobs(policy if model is run.reference else model, *a)
            with _patched(steps, completion_logprobs=same):
                return steps.grpo_step(run, problems, loss_fn, update_fn)
        raise KeyError(mistake)
    return step


STEP_MISTAKES = {
    "no_zero_grad": "your step never clears the gradients: `run.optimizer.zero_grad()` must "
    "come before `loss.backward()`, or the last step's gradients are added to this one's",
    "old_logp_not_detached": "pi_old is `logp` itself, not `logp.detach()`: the ratio "
    "logp - old_logp is then 0 with zero gradient, and only the KL term trains",
    "ratio_against_reference": "the ratio is taken against the reference model (`ref_logp`) "
    "instead of pi_old (`logp.detach()`): report 001's mistake; after some drift r = "
    "exp(logp - ref_logp) leaves the trust region for good",
    "optimizer_step_without_update_fn": "your step calls `run.optimizer.step()` itself "
    "instead of `update_fn(run)`, so the update skips gradient clipping (and every later "
    "fix that lives in update_fn)",
    "answers_tiled": "the answers are in the wrong order: rows are grouped by prompt, so "
    "each answer must be repeated G times in a row (`[p.answer for p in problems for _ in "
    "range(G)]`), not the list repeated G times",
    "reward_without_truncated": "the reward call leaves out `truncated=`: a completion cut "
    "off at max_new_tokens (no end-of-text) whose text is the answer then scores 1, though the "
    "model never finished it; pass `truncated=rollout.truncated.tolist()` so that it scores 0",
    "rewards_as_advantages": "the raw rewards are used as advantages: normalise them within "
    "each group with `group_advantages(rewards, G, ...)`",
    "temperature_ignored": "the training forward ignores the temperature: log-probs must "
    "come from the distribution the sampler drew from, `completion_logprobs(..., "
    "cfg.temperature)`, or the ratio does not start at 1",
    "loss_type_ignored": "the token weights ignore `cfg.loss_type` (always the grpo "
    "per-sequence mean): `token_weights(mask, cfg.loss_type, cfg.max_new_tokens)`",
    "weights_over_padding": "the token weights count padding positions: compute them from the "
    "completion mask, `token_weights(rollout.completion_mask, cfg.loss_type, "
    "cfg.max_new_tokens)`, which is 0 on padding",
    "reference_is_policy": "the reference log-probs come from the policy, not from "
    "`run.reference`: the KL term then measures nothing",
    "sampler_flags_dropped": "your step does not pass `cfg.top_k` and `cfg.top_p` to the "
    "sampler: it samples from the whole distribution even when the config asks for top-k or "
    "nucleus sampling; call sample_fn(model, tokenizer, prompts, G, cfg.max_new_tokens, "
    "cfg.temperature, cfg.top_k, cfg.top_p)",
}


def _loss_mutant(mistake: str) -> Callable:
    def loss(logp, old_logp, ref_logp, advantages, weights, cfg):
        c = copy.copy(cfg)
        if mistake == "kl_sign":
            c.beta = -cfg.beta
        elif mistake == "kl_swapped":
            return _with_kl(logp, old_logp, ref_logp, advantages, weights, cfg,
                            kl_k3(ref_logp, logp))
        elif mistake == "beta_ignored":
            c.beta = 0.0
        elif mistake == "ratio_against_reference":
            return steps.grpo_loss(logp, ref_logp, ref_logp, advantages, weights, cfg)
        elif mistake == "constant_clip":
            with _patched(steps, clipped_surrogate=naive.constant_clip_surrogate):
                return steps.grpo_loss(logp, old_logp, ref_logp, advantages, weights, cfg)
        elif mistake == "weights_ignored":  # a plain mean over every (row, token) position
            return steps.grpo_loss(logp, old_logp, ref_logp, advantages,
                                   torch.full_like(weights, 1 / weights.numel()), cfg)
        elif mistake == "no_clip":
            c.epsilon_low = c.epsilon_high = 1e9
        elif mistake == "sign":
            out, stats = steps.grpo_loss(logp, old_logp, ref_logp, advantages, weights, cfg)
            return -out, stats
        elif mistake == "stats_over_padding":  # the stats alone, as means over every position
            _, clipped = clipped_surrogate(logp, old_logp, advantages.detach(), cfg.epsilon_low,
                                           cfg.epsilon_high, cfg.log_ratio_clamp)
            return {"kl": kl_k3(logp, ref_logp).detach().mean().item(),
                    "clip_ratio/region_mean": clipped.float().mean().item()}
        else:
            raise KeyError(mistake)
        return steps.grpo_loss(logp, old_logp, ref_logp, advantages, weights, c)
    return loss


def _with_kl(logp, old_logp, ref_logp, advantages, weights, cfg, kl):
    per_token, _ = clipped_surrogate(logp, old_logp, advantages.detach(), cfg.epsilon_low,
                                     cfg.epsilon_high, cfg.log_ratio_clamp)
    return ((per_token + cfg.beta * kl) * weights).sum(), {}


LOSS_MISTAKES = {
    "kl_sign": "the KL term has the wrong sign: the loss *adds* beta x k3 (a penalty to "
    "minimise), so the gradient pulls the policy back toward the reference",
    "kl_swapped": "k3's arguments are swapped: `kl_k3(logp, ref_logp)` takes the policy's "
    "log-probs first (log_r = ref_logp - logp)",
    "beta_ignored": "the KL term is missing: add `cfg.beta * kl_k3(logp, ref_logp)` per token",
    "ratio_against_reference": "the ratio is taken against the reference (`ref_logp`) "
    "instead of pi_old (`old_logp`): report 001's mistake",
    "constant_clip": "the clipped term is the constant clip range (`eps * A`), report "
    "001's `clip_ratio * advantage`, not `clip(r, 1 - eps_low, 1 + eps_high) * A`",
    "weights_ignored": "the token weights are not used: the loss is a plain mean over every "
    "(row, token) position, padding included; multiply each token's term by `weights` (0 on "
    "padding, the loss type's normalisation elsewhere) and sum",
    "no_clip": "nothing is clipped: the surrogate is -r x A without the trust region",
    "sign": "the loss has the opposite sign: a loss is minimised, so it is -min(r A, clip A)",
}
# a mistake in the loss's stats (what the metrics show), not in the loss: its mutant returns
# the stats alone
STATS_MISTAKES = {
    "stats_over_padding": "the stats are averaged over padding too: 'kl' and "
    "'clip_ratio/region_mean' are means over the completion tokens only, "
    "`masked_mean(x, weights > 0)`; a padding position is no token of any completion, "
    "and counting it shrinks both numbers by the padded share of the batch",
}


def _logprobs_mutant(mistake: str) -> Callable:
    def fn(model, ids, mask, C, temperature):
        if mistake == "no_position_ids":
            logits = model(input_ids=ids, attention_mask=mask).logits[:, -C - 1:-1]
            return token_logprobs(logits / temperature, ids[:, -C:])
        if mistake == "off_by_one":
            logits = model(input_ids=ids, attention_mask=mask,
                           position_ids=position_ids_from_mask(mask)).logits[:, -C:]
            return token_logprobs(logits / temperature, ids[:, -C:])
        if mistake == "temperature_ignored":
            return completion_logprobs(model, ids, mask, C, 1.0)
        raise KeyError(mistake)
    return fn


LOGPROB_MISTAKES = {
    "no_position_ids": "no position ids: with left padding a row's first real token sits at "
    "position > 0; pass `position_ids=position_ids_from_mask(attention_mask)`",
    "off_by_one": "off by one: the logits at position t predict token t + 1, so the C "
    "completion tokens are predicted by `logits[:, -C - 1:-1]`, not `logits[:, -C:]`",
    "temperature_ignored": "the temperature is missing: divide the logits by it before the "
    "log-softmax, as the sampler does",
}


def _update_mutant(mistake: str) -> Callable:
    def fn(run):
        params = [p for p in run.policy.parameters() if p.grad is not None]
        if mistake == "no_clip":
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
            run.optimizer.step()
            return norm.item(), 0
        if mistake == "norm_after_clipping":
            torch.nn.utils.clip_grad_norm_(params, run.cfg.max_grad_norm)
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
            run.optimizer.step()
            return norm.item(), 0
        if mistake == "zero_grad_before_step":
            norm = torch.nn.utils.clip_grad_norm_(params, run.cfg.max_grad_norm)
            run.optimizer.zero_grad()
            run.optimizer.step()
            return norm.item(), 0
        raise KeyError(mistake)
    return fn


UPDATE_MISTAKES = {
    "no_clip": "the gradient is not clipped: `torch.nn.utils.clip_grad_norm_(params, "
    "cfg.max_grad_norm)` before `optimizer.step()`",
    "norm_after_clipping": "the grad norm is measured after clipping: report the norm "
    "`clip_grad_norm_` returns (the one before clipping, what TRL logs)",
    "zero_grad_before_step": "the gradients are cleared before `optimizer.step()`: nothing "
    "moves",
}


def _which(got: torch.Tensor, mutants: dict[str, Callable], run_mutant: Callable,
           catalog: dict[str, str]) -> str | None:
    """The known mistake whose result matches `got`, if one does."""
    for name, mutant in mutants.items():
        try:
            want = run_mutant(mutant)
        except Exception:  # noqa: BLE001 - a mutant that cannot run on this case matches nothing
            continue
        if isinstance(want, torch.Tensor) and want.shape == got.shape and torch.allclose(
                got.double(), want.double(), equal_nan=True, **STEP_TOL):
            return catalog[name]
    return None


def _compare(got, want, what: str, mutants: dict, run_mutant: Callable, catalog: dict) -> None:
    """`got` must equal `want`; where it does not, name the mistake that gives `got`."""
    if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and \
            got.shape == want.shape and torch.allclose(got.double(), want.double(), **STEP_TOL):
        return
    if isinstance(got, torch.Tensor) and got.shape == want.shape:
        named = _which(got, mutants, run_mutant, catalog)
        if named:
            raise Mismatch(f"{what} differs from the reference: {named}")
    _expect(got, want, what, **STEP_TOL)


# --- the checkers ------------------------------------------------------------------------------
def _no_advantage_gradient(out: dict) -> None:
    if out.get("advantages_get_gradient"):
        raise Mismatch("advantages not detached: the gradient flows into the advantages. "
                       "They are constants of the step (computed from the rewards); use "
                       "`advantages.detach()` in the loss")


def _where_the_loss_differs(out: dict, want: dict) -> str:
    """In the learner's terms: does the loss's value differ, and at which (row, token) does
    its gradient differ first, and is that a padding position."""
    parts = []
    if not torch.allclose(out["loss"].double(), want["loss"].double(), **STEP_TOL):
        parts.append(f"the loss is {float(out['loss']):.6g}, expected {float(want['loss']):.6g}")
    g, w = out["grad"].double(), want["grad"].double()
    if g.shape != w.shape:
        return f"the gradient has shape {tuple(g.shape)}, expected {tuple(w.shape)}"
    bad = ~torch.isclose(g, w, equal_nan=True, **STEP_TOL)
    if bad.any():
        row, tok = (int(i) for i in bad.nonzero()[0])
        mask = out["mask"]
        padding = bad & (mask == 0)
        where = "padding (mask 0)" if mask[row, tok] == 0 else "a completion token"
        parts.append(
            f"its gradient differs at {int(bad.sum())} of {bad.numel()} (row, token) "
            f"positions, first at row {row}, token {tok}, {where}: yours "
            f"{g[row, tok].item():.4g}, expected {w[row, tok].item():.4g}")
        if bool(padding.any()):
            parts.append(f"{int(padding.sum())} of them are padding, where the gradient "
                         "must be 0 (aggregation over padding?)")
        elif bool((bad.sum(-1) == (mask == 1).sum(-1))[bad.any(-1)].all()):
            parts.append("whole rows differ: the weighting of a row (its length, the "
                         "loss_type) or its advantage?")
    return "; ".join(parts) or "the loss or its gradient differs"


def check_loss(name: str, fn: Callable, ref: Callable, cases: list[tuple[str, dict]],
               catalog: dict[str, str] | None = None, make_mutant: Callable | None = None,
               stats: tuple[str, ...] = ()) -> CheckResult:
    """The check of a loss of the learner's trainer: on each case (drive_loss's parameters)
    the loss and its gradient with respect to logp must be the reference's, no gradient may
    reach the advantages, and where they differ the known mistake that gives the learner's
    numbers is named, else where they differ (row, token, padding or not). `stats`: the
    entries of the returned stats that must be the reference's too."""
    mutants = {k: make_mutant(k) for k in catalog or {}}

    def flat(r: dict) -> torch.Tensor:
        return torch.cat([r["loss"].reshape(1), r["grad"].flatten()])

    def case(params):
        def run(f):
            out, want = drive(f, drive_loss, **params), drive_loss(ref, **params)
            if "bad_return" in out:
                raise Mismatch(f"return (loss, stats), a tuple of two; got {out['bad_return']}")
            if out["grad"] is None:
                raise Mismatch("the loss must be a 0-dim tensor carrying a gradient "
                               "with respect to logp")
            _no_advantage_gradient(out)
            if not torch.allclose(flat(out).double(), flat(want).double(), **STEP_TOL):
                named = _which(flat(out), mutants, lambda m: flat(drive_loss(m, **params)),
                               catalog or {})
                raise Mismatch(f"the loss or its gradient differs from the reference: "
                               f"{named or _where_the_loss_differs(out, want)}")
            for key in stats:
                _check_stat(out["stats"], want["stats"], key, params)
        return run

    return run_check(name, fn, ref, [(what, case(params)) for what, params in cases])


def check_completion_logprobs(fn: Callable) -> CheckResult:
    ref = completion_logprobs
    mutants = {k: _logprobs_mutant(k) for k in LOGPROB_MISTAKES}

    def case(seed, temperature):
        def run(f):
            out = drive(f, drive_logprobs, seed=seed, temperature=temperature)
            want = drive_logprobs(ref, seed, temperature)["logp"].detach()
            got = out["logp"]
            if isinstance(got, torch.Tensor):
                got = got.detach()
            _compare(got, want, "the (B, C) log-probs", mutants,
                     lambda m: drive_logprobs(m, seed, temperature)["logp"].detach(),
                     LOGPROB_MISTAKES)
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
        ("completions of different lengths", dict(seed=0)), ("another batch", dict(seed=1))])


def _check_stat(got: dict, want: dict, key: str, params: dict) -> None:
    """One entry of a loss's stats against the reference's; a value that the stats-over-
    padding mutant gives is named."""
    if key not in got:
        raise Mismatch(f"the stats have no number under {key!r} (numbers under: "
                       f"{sorted(got)[:8]}): return it with the loss, the metrics show it")
    if math.isclose(got[key], want[key], rel_tol=1e-4, abs_tol=1e-6):
        return
    cfg, args, _ = _loss_case(**params)
    for name, message in STATS_MISTAKES.items():
        other = _loss_mutant(name)(*args, cfg)  # the mutant returns the stats alone
        if math.isclose(got[key], float(other[key]), rel_tol=1e-4, abs_tol=1e-6):
            raise Mismatch(f"stats[{key!r}] is {got[key]:.6g}, expected {want[key]:.6g}: "
                           f"{message}")
    raise Mismatch(f"stats[{key!r}] is {got[key]:.6g}, expected {want[key]:.6g} (a mean over "
                   "the completion tokens of the batch)")


def check_grpo_loss(fn: Callable) -> CheckResult:
    return check_loss("grpo_loss", fn, steps.grpo_loss, [
        ("loss_type grpo", dict(seed=0)), ("loss_type dr_grpo", dict(seed=1, loss_type="dr_grpo")),
        ("loss_type dapo, beta 0.2", dict(seed=2, loss_type="dapo", beta=0.2)),
        ("asymmetric clip 0.2 / 0.28", dict(seed=3, epsilon_high=0.28)),
    ], LOSS_MISTAKES, _loss_mutant, stats=("kl", "clip_ratio/region_mean"))


def check_apply_update(fn: Callable) -> CheckResult:
    ref = steps.apply_update
    mutants = {k: _update_mutant(k) for k in UPDATE_MISTAKES}

    def case(seed, **overrides):
        def run(f):
            out, want = drive(f, drive_update, seed=seed, **overrides), drive_update(ref, seed, **overrides)
            _compare(out["update"], want["update"], "the parameter update", mutants,
                     lambda m: drive_update(m, seed, **overrides)["update"], UPDATE_MISTAKES)
            got = out["out"]
            if not (isinstance(got, tuple) and len(got) == 2):
                raise Mismatch(f"return (grad_norm, skipped); got {type(got).__name__}")
            named = None
            if isinstance(got[0], (int, float)) and abs(got[0] - want["out"][0]) > 1e-4 * abs(want["out"][0]):
                named = _which(torch.tensor([float(got[0])]), mutants, lambda m: torch.tensor(
                    [float(drive_update(m, seed, **overrides)["out"][0])]), UPDATE_MISTAKES)
            if named:
                raise Mismatch(f"the grad norm differs: {named}")
            _expect(float(got[0]) if isinstance(got[0], (int, float)) else got[0],
                    float(want["out"][0]), "the grad norm")
            if got[1] != 0:
                raise Mismatch(f"skipped must be 0 here (no update is skipped); got {got[1]!r}")
        return run

    return run_check("apply_update", fn, ref, [
        ("stale gradients of norm ~ 40, clipped to 1", case(0)),
        ("no clipping configured (max_grad_norm None)", case(1, max_grad_norm=None)),
    ])


def check_grpo_step(fn: Callable) -> CheckResult:
    ref = steps.grpo_step
    mutants = {k: _step_mutant(k) for k in STEP_MISTAKES}

    def case(seed, **overrides):
        def run(f):
            try:
                out = drive(f, drive_step, seed=seed, **overrides)
            except TypeError as e:
                if "loss_fn" in str(e) or "update_fn" in str(e) or "argument" in str(e):
                    raise Mismatch("call it as grpo_step(run, problems, loss_fn=..., "
                                   f"update_fn=...): {e}") from None
                raise
            check_step_contract(out)
            want = drive_step(ref, seed, **overrides)
            _compare(out["update"], want["update"], "the update your step made", mutants,
                     lambda m: drive_step(m, seed, **overrides)["update"], STEP_MISTAKES)
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
                    for name, mutant in mutants.items():
                        theirs = drive_step(mutant, seed, **overrides)["metrics"].get(key)
                        if theirs is not None and math.isclose(float(theirs), value,
                                                               rel_tol=1e-4, abs_tol=1e-5):
                            raise Mismatch(f"metrics[{key!r}] is {value:.6g}, expected "
                                           f"{expected:.6g}: {STEP_MISTAKES[name]}")
                _expect(value, expected, f"metrics[{key!r}]", atol=1e-5, rtol=1e-4)
        return run

    return run_check("grpo_step", fn, ref, [
        ("4 prompts x 4 completions, drifted policy, stale .grad", case(0)),
        ("temperature 0.7, loss_type dr_grpo", case(1, temperature=0.7, loss_type="dr_grpo")),
        ("completions cut at 2 tokens (truncated ones score 0)", case(2, max_new_tokens=2)),
        ("top_k 2 and top_p 0.8 in the config", case(3, top_k=2, top_p=0.8)),
    ])


def _report_variant(logp, base, ref_logp, advantages, weights, cfg, summed=True,
                    constant=True):
    """Report 001's loss with its three choices as switches: the ratio against `base`,
    summed over the completion or per token, and the constant or the clipped-ratio term."""
    ratio_logp, ratio_base = (naive.sequence_log_ratio_inputs(logp, base, weights > 0)
                              if summed else (logp, base))
    surrogate = naive.constant_clip_surrogate if constant else clipped_surrogate
    per_token, _ = surrogate(ratio_logp, ratio_base, advantages.detach(), cfg.epsilon_low,
                             cfg.epsilon_high, None)
    return ((per_token + cfg.beta * kl_k3(logp, ref_logp)) * weights).sum(), {}


def _reported_mutant(mistake: str) -> Callable:
    def loss(logp, old_logp, ref_logp, advantages, weights, cfg):
        if mistake == "ratio_against_old":
            return _report_variant(logp, old_logp, ref_logp, advantages, weights, cfg)
        if mistake == "per_token_ratio":
            return _report_variant(logp, ref_logp, ref_logp, advantages, weights, cfg,
                                   summed=False)
        if mistake == "clipped_ratio":
            return _report_variant(logp, ref_logp, ref_logp, advantages, weights, cfg,
                                   constant=False)
        raise KeyError(mistake)
    return loss


REPORTED_MISTAKES = {
    "ratio_against_old": "the ratio is taken against pi_old (`old_logp`): that is the fix, "
    "not the report; report 001 computes `exp(log_prob_current - log_prob_ref)`, against "
    "the reference (`ref_logp`)",
    "per_token_ratio": "the log-ratio is per token: the course's reading of report 001 sums "
    "it over each completion's tokens (mask them) before `exp`, broadcast to the row",
    "clipped_ratio": "the clipped term clips the ratio: report 001's `clip_ratio * "
    "advantage` is the constant clip range times A, -min(r A, eps_low A)",
}


def check_reported_loss(fn: Callable) -> CheckResult:
    return check_loss("reported_loss", fn, steps.reported_loss, [
        ("the reports' config (beta 0.05)", dict(seed=0, beta=0.05)),
        ("another batch, beta 0", dict(seed=1, beta=0.0)),
    ], REPORTED_MISTAKES, _reported_mutant)


def _clamp_mutant(mistake: str) -> Callable:
    def loss(logp, old_logp, ref_logp, advantages, weights, cfg):
        if mistake == "no_clamp":
            return steps.reported_loss(logp, old_logp, ref_logp, advantages, weights, cfg)
        if mistake == "ratio_clamped":  # clamp(exp(log r)) instead of exp(clamp(log r))
            c = copy.copy(cfg)
            c.log_ratio_clamp = None
            m = (weights > 0).float()
            log_ratio = ((logp - ref_logp) * m).sum(-1, keepdim=True)
            ratio = torch.exp(log_ratio).clamp(math.exp(-cfg.log_ratio_clamp),
                                               math.exp(cfg.log_ratio_clamp))
            adv = advantages.detach().unsqueeze(-1)
            per_token = -torch.min(ratio * adv, cfg.epsilon_low * adv)
            return ((per_token + cfg.beta * kl_k3(logp, ref_logp)) * weights).sum(), {}
        raise KeyError(mistake)
    return loss


CLAMP_MISTAKES = {
    "no_clamp": "nothing is clamped: clamp the summed log-ratio to [-cfg.log_ratio_clamp, "
    "cfg.log_ratio_clamp] before `exp`",
    "ratio_clamped": "the ratio is clamped after `exp`: exp() has already overflowed to inf "
    "by then (and inf x 0 is NaN); clamp the log-ratio, then exp",
}


def check_clamped_reported_loss(fn: Callable) -> CheckResult:
    # a clamp of 0.5 binds on the fixed batch's summed log-ratios (they reach ~2)
    return check_loss("clamped_reported_loss", fn, steps.clamped_reported_loss, [
        ("clamp 0.5, beta 0.05", dict(seed=0, beta=0.05, log_ratio_clamp=0.5)),
        ("clamp 1.0, another batch", dict(seed=1, log_ratio_clamp=1.0)),
        ("a reference 30 nats per token away: summed log-ratios past exp's overflow (88.7)",
         dict(seed=2, log_ratio_clamp=10.0, drift=30.0)),
    ], CLAMP_MISTAKES, _clamp_mutant)


def _guard_mutant(mistake: str) -> Callable:
    def update(run):
        if mistake == "report_rule":  # report 000: `if grad_norm > 10`
            params = [p for p in run.policy.parameters() if p.grad is not None]
            norm = torch.nn.utils.clip_grad_norm_(params, run.cfg.max_grad_norm).item()
            if norm > 10:
                run.optimizer.zero_grad(set_to_none=True)
                return norm, 1
            run.optimizer.step()
            return norm, 0
        if mistake == "history_not_kept":
            saved = copy.copy(run.recent_grad_norms)
            out = steps.guarded_update(run)
            run.recent_grad_norms.clear()
            run.recent_grad_norms.extend(saved)
            return out
        if mistake == "skipped_norm_not_kept":
            before = len(run.recent_grad_norms)
            norm, skipped = steps.guarded_update(run)
            if skipped and len(run.recent_grad_norms) > before:
                run.recent_grad_norms.pop()
            return norm, skipped
        if mistake == "no_clip":
            c = copy.copy(run.cfg)
            c.max_grad_norm = None
            saved, run.cfg = run.cfg, c
            try:
                return steps.guarded_update(run)
            finally:
                run.cfg = saved
        raise KeyError(mistake)
    return update


GUARD_MISTAKES = {
    "skipped_norm_not_kept": "a skipped norm is not recorded: record every finite norm, "
    "skipped ones too, or a lasting change of scale freezes training behind a stale median",
    "history_not_kept": "the grad norms are not recorded: append each finite norm to "
    "run.recent_grad_norms, or the spike rule never gets its 5 norms to compare with",
    "report_rule": "this is report 000's rule, `if grad_norm > 10`: a NaN norm is not > 10, "
    "so the NaN update goes through (test math.isfinite first), and a fixed threshold "
    "ignores the run's own scale (compare with factor x the median of recent norms)",
    "no_clip": "the update is not clipped: scale the gradients to cfg.max_grad_norm before "
    "`optimizer.step()` (clip_grad_norm)",
}


# A gradient norm is sqrt(sum g^2) over the driver's ~0.8M entries, and a learner may reduce
# them in another order (torch.cat(...).norm(), a per-tensor loop): both are within
# gamma~_n of the exact sum of squares, and the root halves that. n = 1e6 above 0.8M leaves
# room for the probabilistic bound's weak spot, sums of same-sign terms (numerics module);
# a wrong norm (one tensor's, the clipped one, the max) is off by far more.
NORM_REL_TOL = sum_error_bound(10**6)


def _same_norms(a, b) -> bool:
    return (isinstance(a, list) and isinstance(b, list) and len(a) == len(b)
            and all(math.isclose(x, y, rel_tol=NORM_REL_TOL) for x, y in zip(a, b, strict=True)))


def check_guarded_update(fn: Callable) -> CheckResult:
    ref = steps.guarded_update
    mutants = {k: _guard_mutant(k) for k in GUARD_MISTAKES}

    def same(a: dict, b: dict) -> bool:
        return (isinstance(a["out"], tuple) and len(a["out"]) == 2
                and a["out"][1] == b["out"][1] and _same_norms(a["recent"], b["recent"])
                and torch.allclose(a["update"].double(), b["update"].double(), **STEP_TOL))

    def case(what: str, **params):
        def run(f):
            out, want = drive(f, drive_guarded, **params), drive_guarded(ref, **params)
            if not isinstance(out.get("update"), torch.Tensor) or same(out, want):
                return _expect(out.get("update"), want["update"], "the parameter update")
            for name, m in mutants.items():
                if same(out, drive_guarded(m, **params)):
                    raise Mismatch(f"{what}: {GUARD_MISTAKES[name]}")
            got = out["out"]
            if not (isinstance(got, tuple) and len(got) == 2):
                raise Mismatch(f"return (grad_norm, skipped); got {type(got).__name__}")
            if got[1] != want["out"][1]:
                raise Mismatch(f"{what}: skipped should be {want['out'][1]}, got {got[1]!r}")
            if not _same_norms(out["recent"], want["recent"]):
                raise Mismatch(f"{what}: run.recent_grad_norms is {out['recent']}, expected "
                               f"{want['recent']}")
            _expect(out["update"], want["update"], f"the parameter update ({what})", **STEP_TOL)
        return run

    return run_check("guarded_update", fn, ref, [
        ("a finite gradient, no history yet: clip and step", case("no history", seed=0)),
        ("six recent norms near this one: clip and step",
         case("no spike", seed=0, recent=(40.0,) * 6)),
        ("a spike, 45 against a median of 1: skip", case("spike", seed=0, recent=(1.0,) * 6)),
        ("a NaN gradient entry: skip", case("NaN", seed=1, recent=(40.0,) * 6, nan_grad=True)),
        ("a spike with only 3 known norms: not yet a spike",
         case("short history", seed=1, recent=(1.0,) * 3)),
    ])


def _report003_mutant(mistake: str) -> Callable:
    def loss(logp, old_logp, ref_logp, advantages, weights, cfg):
        if mistake == "k3_kept":
            return steps.grpo_loss(logp, old_logp, ref_logp, advantages, weights, cfg)
        if mistake == "one_sided_clamp_missing":
            kl = (ref_logp - logp).clamp(-10, 10)
        elif mistake == "delta_reversed":
            kl = (logp - ref_logp).clamp(-10, 10).clamp(0, 10)
        else:
            raise KeyError(mistake)
        return _with_kl(logp, old_logp, ref_logp, advantages, weights, cfg, kl)
    return loss


REPORT003_MISTAKES = {
    "k3_kept": "this is k3, the formula report 003 removed: write the report's replacement, "
    "`delta = (ref_logp - logp).clamp(-10, 10); kl = delta.clamp(0, 10)`",
    "one_sided_clamp_missing": "the second clamp is missing: the report's kl is "
    "`delta.clamp(0, 10)`, which drops every token where the policy gives more probability "
    "than the reference",
    "delta_reversed": "delta is reversed: the report's delta is `ref - cur`, ref_logp - logp",
}


def check_report003_loss(fn: Callable) -> CheckResult:
    return check_loss("report003_loss", fn, steps.report003_loss, [
        ("beta 0.3", dict(seed=0, beta=0.3)),
        ("beta 1.0, loss_type dapo", dict(seed=1, beta=1.0, loss_type="dapo")),
    ], REPORT003_MISTAKES, _report003_mutant)


def _sampler_mutant(mistake: str) -> Callable:
    def fn(model, ids, mask, n, temperature, eos, pad):
        if mistake == "no_position_ids":
            seq, out = ids, []
            m = mask
            for _ in range(n):
                logits = model(input_ids=seq, attention_mask=m).logits[:, -1].float()
                token = torch.multinomial(torch.softmax(logits / temperature, -1), 1)
                seq, m = torch.cat([seq, token], 1), torch.cat([m, torch.ones_like(token)], 1)
            out = seq[:, ids.shape[1]:]
            ended = (out == eos).long().cumsum(-1) - (out == eos).long() > 0
            return out.masked_fill(ended, pad)
        if mistake == "temperature_ignored":
            return steps.sample_tokens(model, ids, mask, n, 1.0, eos, pad)
        if mistake == "no_padding_after_eos":
            return steps.sample_tokens(model, ids, mask, n, temperature, -1, pad)
        if mistake == "greedy":
            return steps.sample_tokens(model, ids, mask, n, 1e-4, eos, pad)
        raise KeyError(mistake)
    return fn


SAMPLER_MISTAKES = {
    "no_position_ids": "no position ids: a left-padded row then sees its tokens at shifted "
    "positions; pass position_ids from the mask (and the next position, one more, at each step)",
    "temperature_ignored": "the temperature is missing: sample from softmax(logits / "
    "temperature)",
    "no_padding_after_eos": "a row goes on after its EOS: from the step after a row's first "
    "EOS, write pad_token_id, and stop when every row is done",
    "greedy": "this is greedy decoding (argmax): GRPO needs G different samples per prompt; "
    "draw with torch.multinomial",
}


def check_sample_tokens(fn: Callable) -> CheckResult:
    ref = steps.sample_tokens
    mutants = {k: _sampler_mutant(k) for k in SAMPLER_MISTAKES}

    def case(seed, temperature):
        def run(f):
            out = drive(f, drive_sample_tokens, seed=seed, temperature=temperature)["ids"]
            want = drive_sample_tokens(ref, seed, temperature)["ids"]
            if isinstance(out, torch.Tensor) and out.shape == want.shape and torch.equal(out, want):
                return
            for name, m in mutants.items():
                other = drive_sample_tokens(m, seed, temperature)["ids"]
                if isinstance(out, torch.Tensor) and out.shape == other.shape and \
                        torch.equal(out, other):
                    raise Mismatch(f"the sampled ids differ from the reference's (same seed): "
                                   f"{SAMPLER_MISTAKES[name]}")
            _expect(out, want, "the sampled completion ids (same seed, same draws)")
        return run

    return run_check("sample_tokens", fn, ref, [
        ("left-padded prompts, T = 0.7, seed 0", case(0, 0.7)),
        ("T = 1.3, seed 1", case(1, 1.3)),
    ])


def _row(step, **kw):
    return {"step": step, **kw}


def check_diagnose(fn: Callable) -> CheckResult:
    ref = steps.diagnose
    nan = float("nan")
    crashed = [_row(0, nonfinite_params=0), _row(1, grad_norm=2.0, nonfinite_params=0,
               **{"log_ratio/max_abs": 0.0}),
               _row(2, grad_norm=8e4, nonfinite_params=0, **{"log_ratio/max_abs": 30.0}),
               _row(3, grad_norm=0.5, nonfinite_params=0, **{"log_ratio/max_abs": 52.0}),
               _row(4, grad_norm=nan, nonfinite_params=800, **{"log_ratio/max_abs": 207.0}),
               _row(5, grad_norm=1e9, nonfinite_params=800, **{"log_ratio/max_abs": nan})]
    healthy = [_row(0), _row(1, grad_norm=3.0, nonfinite_params=0),
               _row(2, grad_norm=1.0, nonfinite_params=0)]

    def case(history, what):
        def run(f):
            got, want = f([dict(m) for m in history]), ref(history)
            if not isinstance(got, dict):
                raise Mismatch(f"return a dict with {sorted(want)}; got {type(got).__name__}")
            for k, v in want.items():
                if k not in got:
                    raise Mismatch(f"{what}: no {k!r} in your dict")
                g = got[k]
                same = g == v if v is None or isinstance(v, int) else (
                    isinstance(g, (int, float)) and math.isclose(g, v, rel_tol=1e-9))
                if not same:
                    hint = {"max_grad_norm": " (only finite norms, and only up to the last "
                            "healthy step: the broken step's norm is NaN)",
                            "max_log_ratio": " (up to the last healthy step: the step that "
                            "broke is where exp overflowed, not the drift before it)",
                            "last_healthy_step": " (the step before the first broken one)"}
                    raise Mismatch(f"{what}: {k} is {g!r}, expected {v!r}{hint.get(k, '')}")
        return run

    return run_check("diagnose", fn, ref, [
        ("a run that broke at step 4", case(crashed, "a run that broke at step 4")),
        ("a run that never broke", case(healthy, "a run that never broke")),
    ])


def check_compare_histories(fn: Callable) -> CheckResult:
    ref = steps.compare_histories
    nan = float("nan")
    a = [_row(0, **{"eval/accuracy": 0.4}), _row(1, reward=0.5, loss=0.1),
         _row(2, reward=0.25, loss=nan), _row(3, reward=0.75, loss=0.2)]
    b = [_row(0, **{"eval/accuracy": 0.375}), _row(1, reward=0.5, loss=0.1),
         _row(2, reward=0.5, loss=nan), _row(3, reward=0.75, loss=0.3),
         _row(4, reward=1.0, loss=0.0)]
    c = [_row(1, reward=0.5, loss=nan), _row(3, reward=0.7)]

    def case(x, y, keys, what):
        def run(f):
            got, want = f([dict(m) for m in x], [dict(m) for m in y], list(keys)), ref(x, y, keys)
            if not isinstance(got, dict) or set(got) != set(want):
                raise Mismatch(f"{what}: return a dict with one entry per key, {sorted(want)}")
            for k, v in want.items():
                g = got[k]
                if not (isinstance(g, (int, float)) and (g == v or math.isclose(g, v, abs_tol=1e-12))):
                    why = {math.inf: " (one run NaN where the other is not: inf)",
                           0.0: " (compare only the steps both runs logged the key at; two "
                                "NaNs agree)"}.get(v, "")
                    raise Mismatch(f"{what}: {k} is {g!r}, expected {v!r}{why}")
        return run

    return run_check("compare_histories", fn, ref, [
        ("steps matched by 'step', a NaN in both", case(a, b, ("reward", "loss", "eval/accuracy"),
                                                        "two runs")),
        ("NaN in one run only, a key one row lacks", case(a, c, ("reward", "loss"), "other runs")),
    ])


def reference_rank_token_weights(completion_mask, loss_type: str, max_completion_length: int,
                                 global_rows: int, global_tokens: float):
    """objective.token_weights of one rank's rows, normalised over the global batch."""
    return token_weights(completion_mask, loss_type, max_completion_length,
                                   n_sequences=global_rows, n_tokens=global_tokens)


def check_rank_token_weights(fn: Callable) -> CheckResult:
    ref = reference_rank_token_weights
    g = _gen(12)

    def case(loss_type, rows, world):
        def run(f):
            lengths = torch.randint(0, 6, (rows * world,), generator=g)
            mask = (torch.arange(5)[None] < lengths[:, None]).long()  # (rows * world, 5)
            total = float(mask.sum())
            whole = token_weights(mask, loss_type, 5)
            parts = []
            for r in range(world):
                local = mask[r * rows:(r + 1) * rows]
                got = f(local, loss_type, 5, rows * world, total)
                _expect(got, ref(local, loss_type, 5, rows * world, total),
                        f"rank {r}'s weights ({loss_type}, {world} ranks)")
                parts.append(got)
            _expect(torch.cat(parts), whole, "the ranks' weights put together (they must be "
                    "the one-process weights)")
        return run

    return run_check("rank_token_weights", fn, ref, [
        (f"{t}, {w} ranks of {r} rows (some rows empty)", case(t, r, w))
        for t, r, w in (("grpo", 3, 2), ("dr_grpo", 2, 3), ("bnpo", 4, 2), ("dapo", 3, 2))])


def reference_completion_mask_any_eos(completion_ids: torch.Tensor,
                                      eos_token_ids: list[int]) -> torch.Tensor:
    """(B, C) ids -> (B, C) long: 1 up to and including the first token that is any of
    eos_token_ids, 0 after it (sampling.completion_mask_from_ids for several end ids)."""
    ends = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))
    return (ends.long().cumsum(-1) - ends.long() == 0).long()


def check_completion_mask_any_eos(fn: Callable) -> CheckResult:
    ref = reference_completion_mask_any_eos
    ids = torch.tensor([[3, 4, 0, 1, 1], [5, 9, 6, 1, 1], [0, 1, 1, 1, 1], [2, 3, 4, 5, 6],
                        [9, 0, 9, 0, 1]])

    def case(stop, what):
        def run(f):
            got = f(ids.clone(), list(stop))
            if isinstance(got, torch.Tensor) and got.dtype == torch.bool:
                got = got.long()
            _expect(got, ref(ids, list(stop)), what)
        return run

    return run_check("completion_mask_any_eos", fn, ref, [
        ("one end id", case([0], "the mask with end id 0")),
        ("two end ids, a row ending at each, one at neither",
         case([0, 9], "the mask with end ids 0 and 9 (a row ends at the FIRST of any)")),
    ])


def reference_training_state_bytes(model: torch.nn.Module) -> int:
    """Bytes AdamW training keeps per parameter tensor: the weights, and for a trainable one
    its gradient and AdamW's two moment estimates too, each the weights' size (notebook 00)."""
    return sum(p.numel() * p.element_size() * (4 if p.requires_grad else 1)
               for p in model.parameters())


def check_training_state_bytes(fn: Callable) -> CheckResult:
    ref = reference_training_state_bytes

    def case(model, what):
        def run(f):
            got = f(model)
            want = ref(model)
            if got == 4 * sum(p.numel() * p.element_size() for p in model.parameters()) != want:
                raise Mismatch(f"{what}: a frozen parameter (requires_grad False) has no "
                               "gradient and no AdamW moments: count its weights only")
            if got == ref_float32(model) != want:
                raise Mismatch(f"{what}: not every tensor is float32: use p.element_size(), "
                               "the bytes of one entry")
            _expect(got, want, f"{what}: the bytes")
        return run

    def ref_float32(model):
        return sum(p.numel() * 4 * (4 if p.requires_grad else 1) for p in model.parameters())

    frozen = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    frozen[0].requires_grad_(False)
    half = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2).half())
    return run_check("training_state_bytes", fn, ref, [
        ("a 3 -> 4 linear layer", case(torch.nn.Linear(3, 4), "a linear layer")),
        ("a frozen first layer", case(frozen, "a frozen first layer")),
        ("a float16 layer", case(half, "a float16 layer")),
    ])


MULTINOMIAL = SAMPLING_CRASH  # the start of torch.multinomial's message on NaN weights


def check_safe_sample(fn: Callable) -> CheckResult:
    ref = steps.safe_sample

    def healthy(seed):
        def run(f):
            out, want = drive(f, drive_sample, seed=seed), drive_sample(ref, seed)
            if "error" in out:
                raise Mismatch(f"a healthy model: your sampler raised {out['error']}")
            if out["ids"] is None:
                raise Mismatch("return sample_group's Rollout (it has .completion_ids)")
            _expect(out["ids"], want["ids"], "the sampled completion ids (same seed: the "
                    "same draws as sample_group)")
        return run

    def nan_params(f):
        out = drive(f, drive_sample, fault="nan-params")
        if "error" not in out:
            raise Mismatch("a model whose parameters are NaN sampled without an error: it "
                           "cannot have produced anything but garbage")
        if MULTINOMIAL in out["error"]:
            raise Mismatch("the NaN logits reached torch.multinomial (on CUDA: a device-side "
                           "assert that kills the process): sanitise them first, "
                           "sample_group(..., sanitize=sanitize_logits)")

    def new_pad(f):
        out = drive(f, drive_sample, fault="new-pad")
        if "error" not in out:
            raise Mismatch("a pad token with no embedding row was sampled with: check the "
                           "prompt ids against model.get_input_embeddings().num_embeddings")
        if "index out of range" in out["error"] or "IndexError" in out["error"]:
            raise Mismatch("the bad pad id reached the embedding (IndexError on CPU, a "
                           "device-side assert on CUDA): check the ids before the forward, "
                           "and name the id and the table's size in the error")

    return run_check("safe_sample", fn, ref, [
        ("a healthy model, seed 0", healthy(0)), ("a healthy model, seed 1", healthy(1)),
        ("NaN parameters (report 000)", nan_params),
        ("a new pad token the embedding lacks (report 002)", new_pad),
    ])


CHECKERS = {"completion_logprobs": check_completion_logprobs,
            "reinforce_loss": check_reinforce_loss, "grpo_loss": check_grpo_loss,
            "apply_update": check_apply_update, "grpo_step": check_grpo_step,
            "reported_loss": check_reported_loss,
            "clamped_reported_loss": check_clamped_reported_loss,
            "guarded_update": check_guarded_update, "safe_sample": check_safe_sample,
            "report003_loss": check_report003_loss, "sample_tokens": check_sample_tokens}
MISTAKES = {"completion_logprobs": (LOGPROB_MISTAKES, _logprobs_mutant),
            "grpo_loss": (LOSS_MISTAKES, _loss_mutant),
            "apply_update": (UPDATE_MISTAKES, _update_mutant),
            "grpo_step": (STEP_MISTAKES, _step_mutant),
            "reported_loss": (REPORTED_MISTAKES, _reported_mutant),
            "clamped_reported_loss": (CLAMP_MISTAKES, _clamp_mutant),
            "guarded_update": (GUARD_MISTAKES, _guard_mutant),
            "report003_loss": (REPORT003_MISTAKES, _report003_mutant),
            "sample_tokens": (SAMPLER_MISTAKES, _sampler_mutant)}
