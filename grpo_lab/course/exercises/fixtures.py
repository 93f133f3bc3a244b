"""The fixed cases of the checks that need a model: the shipped tiny GPT-2 on the CPU,
4 prompts x 4 completions, and the *drivers* that run a learner's function on them.

A driver is a function of (the learner's function, picklable parameters) that an `Exercise`
declares: in a notebook `drive` calls it here; in the grader the learner's function lives in
the sandboxed worker and the driver runs there (`RemoteFunction.drive`), so the case it
builds never crosses the pipe.

The fixture's optimizer is plain SGD, so an update is lr x the clipped gradient: two correct
steps that round differently agree to 1e-6, where AdamW's first step (g / |g|) would blow
rounding on near-zero gradient entries up to the learning rate.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
from collections import OrderedDict
from collections.abc import Callable

import torch

from ...config import preset
from ...objective import (
    token_weights,
)
from ...policy import load_policy
from ...sampling import (
    encode_prompts,
)
from ...tasks import ProblemStream
from .. import steps
from . import registry
from .base import STEP_TOL, CheckResult, Mismatch, Mistake, gen, run_check, which_mistake

# --- a known function's result, once per case ---------------------------------------------------
VAR_KEYWORD = inspect.Parameter.VAR_KEYWORD
KNOWN_RESULTS = 64  # cached driver results per process (a whole step's is ~3 MB of weights)
_known_results: OrderedDict = OrderedDict()


@functools.cache
def _known_functions() -> frozenset:
    """Every exercise's reference and known mistakes: functions the course wrote, whose
    results on a fixed case never change."""
    return frozenset([e.reference for e in registry().values()] +
                     [m.wrong for e in registry().values() for m in e.mistakes])


def reuses_known_results(driver: Callable) -> Callable:
    """The driver, remembering its result where `fn` is a reference or a known mistake (never
    the learner's function): a check drives the reference on every case it reaches and, where
    the learner's result differs, the known mistakes one by one, and a test of every mistake
    would otherwise drive the same ones again for each. Returned as a copy, so not for a
    driver whose result holds an autograd graph (drive_logprobs' log-probs: a check
    differentiates them, and torch refuses to copy them). In-process and keyed on the function
    itself: grpo_lab/memo.py keys on plain data only, and only in a test session."""
    signature = inspect.signature(driver)
    first, *_ = signature.parameters

    def case_key(fn, args, params) -> tuple:
        bound = signature.bind(fn, *args, **params)
        bound.apply_defaults()
        items = []
        for name, value in bound.arguments.items():
            if name == first:
                continue
            kind = signature.parameters[name].kind
            items.append((name, tuple(sorted(value.items())) if kind is VAR_KEYWORD else value))
        return (driver.__module__, driver.__name__, fn, tuple(items))

    @functools.wraps(driver)
    def wrapped(fn, *args, **params):
        try:
            key = case_key(fn, args, params)
            hash(key)
            known = fn in _known_functions()
        except TypeError:  # an unhashable function or parameter, or arguments it does not take
            known = False
        if not known:
            return driver(fn, *args, **params)
        if key not in _known_results:
            _known_results[key] = driver(fn, *args, **params)
            if len(_known_results) > KNOWN_RESULTS:
                _known_results.popitem(last=False)
        _known_results.move_to_end(key)
        return copy.deepcopy(_known_results[key])
    return wrapped


# --- the fixture -----------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def tiny_model():
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
    model, tokenizer = tiny_model()
    run = steps.new_run(fixture_cfg(seed, **overrides), model=copy.deepcopy(model),
                        tokenizer=tokenizer)
    g = gen(1000 + seed)
    with torch.no_grad():
        for p in run.policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02 * p.std().clamp(min=1e-3))
            p.grad = torch.randn(p.shape, generator=g) * 0.05
    run.optimizer = torch.optim.SGD(run.policy.parameters(), lr=run.cfg.learning_rate)
    return run


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# --- drivers: run the learner's function on a fixed case ---------------------------------------
@reuses_known_results
def drive_step(fn, seed: int = 0, **overrides) -> dict:
    run = fixture_run(seed, **overrides)
    before = flat_params(run.policy)
    problems = ProblemStream(seed).sample(run.cfg.prompts_per_step)
    torch.manual_seed(seed)  # the sampler's draws
    counted = run.step_count
    metrics = fn(run, problems, loss_fn=steps.grpo_loss, update_fn=steps.apply_update)
    return {"update": flat_params(run.policy) - before, "metrics": metrics,
            "step_count": (counted, run.step_count)}


def check_step_contract(out: dict) -> None:
    """What train() needs of a whole step (steps.check_step_result: a metrics dict back,
    run.step_count one higher), as a checker's Mismatch."""
    try:
        steps.check_step_result(out["metrics"], *out["step_count"])
    except steps.StepError as e:
        raise Mismatch(str(e)) from None


@reuses_known_results
def drive_update(fn, seed: int = 0, **overrides) -> dict:
    run = fixture_run(seed, **overrides)
    before = flat_params(run.policy)
    out = fn(run)
    return {"update": flat_params(run.policy) - before, "out": out}


@reuses_known_results
def drive_guarded(fn, seed: int = 0, recent: tuple = (), nan_grad: bool = False,
                  **overrides) -> dict:
    """A guarded update on the fixture (stale gradients of norm ~45, max_grad_norm 1,
    spike factor 20, unless `overrides` say otherwise), with `recent` as the known grad norms
    and, with nan_grad, one NaN gradient entry. 'cleared': no gradient left after it."""
    run = fixture_run(seed, **overrides)
    run.recent_grad_norms.extend(recent)
    if nan_grad:
        next(iter(run.policy.parameters())).grad[0, 0] = float("nan")
    before = flat_params(run.policy)
    out = fn(run)
    cleared = all(p.grad is None or not bool(p.grad.nan_to_num(1.0).any())
                  for p in run.policy.parameters())
    return {"update": (flat_params(run.policy) - before).nan_to_num(1e9), "out": out,
            "recent": [float(x) for x in run.recent_grad_norms], "cleared": cleared,
            "window": getattr(run.recent_grad_norms, "maxlen", None)}


@reuses_known_results
def drive_sample(fn, seed: int = 0, fault: str | None = None) -> dict:
    """Sample 4 completions for each of 3 prompts of different lengths at T = 0.8 with a
    fresh tiny GPT-2; fault 'nan-params' makes its embedding NaN, 'new-pad' adds a pad token
    to the tokenizer that the model has no embedding row for (report 002), and
    'new-pad-unpadded' does so with prompts of one length whose answers differ in length:
    the pad id is in no prompt, and the sampler writes it only after a row's end of text
    (later forwards of the completions look it up);
    'new-prompt-token' adds a token '@' to the tokenizer only and puts it in one prompt."""
    model, tokenizer = (copy.deepcopy(x) for x in tiny_model())
    prompts = ["1+2=", "12+34=", "99+99="]
    if fault == "nan-params":
        with torch.no_grad():
            model.get_input_embeddings().weight.fill_(float("nan"))
    elif fault in ("new-pad", "new-pad-unpadded"):
        tokenizer.add_special_tokens({"pad_token": "<new-pad>"})
        if fault == "new-pad-unpadded":
            prompts = ["1+2=", "9+9=", "5+6="]
    elif fault == "new-prompt-token":  # a token added to the tokenizer only, in one prompt
        tokenizer.add_tokens(["@"])
        prompts = ["1+2=", "@12+34=", "99+99="]
    torch.manual_seed(seed)
    try:
        rollout = fn(model, tokenizer, prompts, 4, 5, 0.8, 0, 1.0)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - what the learner's sampler raised is the result
        return {"error": f"{type(e).__name__}: {e}"[:400]}
    ids = getattr(rollout, "completion_ids", None)
    return {"ids": ids if isinstance(ids, torch.Tensor) else None}


@reuses_known_results
def drive_sample_tokens(fn, seed: int = 0, temperature: float = 0.7) -> dict:
    """Four prompts of different lengths, each twice, through fn with the tiny GPT-2."""
    model, tokenizer = tiny_model()
    prompts = ["1+2=", "12+34=", "99+99=", "7+80="] * 2
    ids, mask = encode_prompts(tokenizer, prompts, torch.device("cpu"))
    torch.manual_seed(seed)
    out = fn(copy.deepcopy(model).eval(), ids, mask, 6, temperature, tokenizer.eos_token_id,
             tokenizer.pad_token_id)
    return {"ids": out}


def logprob_batch(seed: int, C: int = 4):
    """A left-padded batch of prompts of different lengths, each followed by C ids."""
    _, tokenizer = tiny_model()
    prompts = [p.prompt for p in ProblemStream(seed).sample(6)] + ["7+5=", "99+99="]
    ids, mask = encode_prompts(tokenizer, prompts, torch.device("cpu"))
    completion = torch.randint(0, tokenizer.eos_token_id + 1, (len(prompts), C),
                               generator=gen(seed))
    return (torch.cat([ids, completion], 1),
            torch.cat([mask, torch.ones_like(completion)], 1), C)


def drive_logprobs(fn, seed: int = 0, temperature: float = 0.7) -> dict:
    model = copy.deepcopy(tiny_model()[0])
    ids, mask, C = logprob_batch(seed)
    out = fn(model, ids, mask, C, temperature)
    return {"logp": out, "requires_grad": bool(getattr(out, "requires_grad", False))}


def loss_case(seed: int, drift: float = 0.0, old_drift: float = 0.0, **overrides):
    """A batch of 8 completions of up to 5 tokens; `drift` moves the reference's log-probs
    down by that much per token (a summed log-ratio of up to 5 x drift), `old_drift` pi_old's
    (a later pass of mu > 1, far from the sampler). Returns the config, a loss's five tensor
    arguments (the token weights of the batch's mask fifth), the mask."""
    cfg = fixture_cfg(seed, **overrides)
    g = gen(seed)
    B, C = 8, 5
    old_logp = -torch.rand(B, C, generator=g) * 3
    logp = (old_logp + torch.randn(B, C, generator=g) * 0.4).requires_grad_()
    ref_logp = old_logp + torch.randn(B, C, generator=g) * 0.3 - drift
    old_logp = old_logp - old_drift
    lengths = torch.randint(1, C + 1, (B,), generator=g)
    mask = (torch.arange(C)[None] < lengths[:, None]).long()
    advantages = torch.randn(B, generator=g)
    weights = token_weights(mask, cfg.loss_type, cfg.max_new_tokens)  # as the step computes them
    return cfg, (logp, old_logp, ref_logp, advantages, weights), mask


@reuses_known_results
def drive_loss(fn, seed: int = 0, drift: float = 0.0, old_drift: float = 0.0,
               **overrides) -> dict:
    """The loss and its gradient with respect to logp. The advantages come in as a tensor
    that carries a gradient (as if a graph had computed them): none may flow into them."""
    cfg, args, mask = loss_case(seed, drift, old_drift, **overrides)
    advantages = args[3].clone().requires_grad_()
    out = fn(*args[:3], advantages, args[4], cfg)
    if not (isinstance(out, tuple) and len(out) == 2):
        return {"bad_return": type(out).__name__}
    loss = out[0]
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad or loss.ndim != 0:
        return {"loss": loss, "grad": None}
    grad, adv_grad = torch.autograd.grad(loss, [args[0], advantages], allow_unused=True)
    stats = out[1] if isinstance(out[1], dict) else {}
    ratio = (args[0] - args[1]).detach().exp()
    return {"loss": loss.detach(), "grad": torch.zeros_like(args[0]) if grad is None else grad,
            "advantages_get_gradient": adv_grad is not None and bool(adv_grad.abs().sum() > 0),
            "tensor_stats": sorted(k for k, v in stats.items() if isinstance(k, str)
                                   and isinstance(v, torch.Tensor)),
            "stats": {k: float(v) for k, v in stats.items() if isinstance(k, str)
                      and isinstance(v, (int, float, torch.Tensor))
                      and (not isinstance(v, torch.Tensor) or v.numel() == 1)},
            "mask": mask,
            # tokens whose ratio to pi_old lies outside the clip range, whatever the advantage
            "outside_clip": (ratio < 1 - cfg.epsilon_low) | (ratio > 1 + cfg.epsilon_high),
            "clip_range": (1 - cfg.epsilon_low, 1 + cfg.epsilon_high),
            "log_ratio_clamp": cfg.log_ratio_clamp,
            "outside_clamp": None if cfg.log_ratio_clamp is None
            else ratio.log().abs() > cfg.log_ratio_clamp}


def drive(fn, driver: Callable, **params) -> dict:
    """Run `driver(fn, **params)`: here, or in the grader's worker when `fn` is the learner's
    function seen from the grader (the worker runs the same driver, found by its module
    and name among the drivers the exercises declare)."""
    remote = getattr(getattr(fn, "__wrapped_student__", fn), "drive", None)
    if remote is not None:
        return remote(driver.__module__, driver.__name__, params)
    return driver(fn, **params)


def drive_a_step(fn, driver: Callable, name: str, **params) -> dict:
    """`drive` for a whole step: a step called with arguments it does not take is told how
    the trainer calls it, `name(run, problems, loss_fn=..., update_fn=...)`."""
    student = getattr(fn, "__wrapped_student__", fn)
    try:  # the signature alone: a TypeError raised inside the step is the step's own
        inspect.signature(student).bind(None, None, loss_fn=None, update_fn=None)
    except TypeError as e:
        raise Mismatch(f"call it as {name}(run, problems, loss_fn=..., update_fn=...): "
                       f"{e}") from None
    except ValueError:  # no signature to read (a builtin): the call itself will tell
        pass
    return drive(fn, driver, **params)


# --- the check of a loss ------------------------------------------------------------------------
def no_advantage_gradient(out: dict) -> None:
    if out.get("advantages_get_gradient"):
        raise Mismatch("advantages not detached: the gradient flows into the advantages. "
                       "They are constants of the step (computed from the rewards); use "
                       "`advantages.detach()` in the loss")


def where_the_loss_differs(out: dict, want: dict) -> str:
    """In the learner's terms: does the loss's value differ, and at which (row, token) does
    its gradient differ first, and is that a padding position; a loss right in its gradient
    and wrong in its value; a gradient wrong only where the clip acts. What the positions
    are (mask, clip range) is read from the reference's run, never from the learner's."""
    parts = []
    if not torch.allclose(out["loss"].double(), want["loss"].double(), **STEP_TOL):
        parts.append(f"the loss is {float(out['loss']):.6g}, expected {float(want['loss']):.6g}")
    g, w = out["grad"].double(), want["grad"].double()
    if g.shape != w.shape:
        return f"the gradient has shape {tuple(g.shape)}, expected {tuple(w.shape)}"
    if parts and torch.allclose(out["loss"].double(), -want["loss"].double(), **STEP_TOL) \
            and torch.allclose(g, -w, **STEP_TOL):
        return (f"{parts[0]}: the loss and its gradient have the opposite sign everywhere; a "
                "loss is minimised, so it is minus the objective")
    bad = ~torch.isclose(g, w, equal_nan=True, **STEP_TOL)
    if parts and not bad.any():
        parts.append("its gradient is right everywhere: the loss is off by a term that does "
                     "not change with logp (a constant, such as k3's -1 or a clipped branch's "
                     "(1 +/- epsilon) x advantage, or a term of detached values)")
    if bad.any():
        row, tok = (int(i) for i in bad.nonzero()[0])
        mask = want["mask"]
        padding = bad & (mask == 0)
        where = "padding (mask 0)" if mask[row, tok] == 0 else "a completion token"
        parts.append(
            f"its gradient differs at {int(bad.sum())} of {bad.numel()} (row, token) "
            f"positions, first at row {row}, token {tok}, {where}: yours "
            f"{g[row, tok].item():.4g}, expected {w[row, tok].item():.4g}")
        outside, clamped = want.get("outside_clip"), want.get("outside_clamp")
        if bool(padding.any()):
            parts.append(f"{int(padding.sum())} of them are padding, where the gradient "
                         "must be 0 (aggregation over padding?)")
        elif clamped is not None and bool((bad <= clamped).all()):
            parts.append(f"every position that differs is a token whose |log-ratio| is above "
                         f"log_ratio_clamp = {want['log_ratio_clamp']:g}, and the others are "
                         "right: the clamp (applied, to the log-ratio, with both bounds?)")
        elif outside is not None and bool((bad <= outside).all()) and bool(
                (outside & (mask == 1) & ~bad).any() or (mask == 1).sum() > outside.sum()):
            low, high = want["clip_range"]
            parts.append(f"every position that differs is a token whose ratio lies outside "
                         f"the clip range [{low:g}, {high:g}], and inside it yours is right: "
                         "the clipped branch (min against max, the clamp's bounds, which "
                         "tokens count as clipped?)")
        elif bool((bad.sum(-1) == (mask == 1).sum(-1))[bad.any(-1)].all()):
            parts.append("whole rows differ: the weighting of a row (its length, the "
                         "loss_type) or its advantage?")
    return "; ".join(parts) or "the loss or its gradient differs"


def check_loss(name: str, fn: Callable, ref: Callable, cases: list[tuple[str, dict]],
               mistakes: tuple[Mistake, ...] = (), stats: tuple[str, ...] = (),
               stats_mistakes: tuple[Mistake, ...] = ()) -> CheckResult:
    """The check of a loss of the learner's trainer: on each case (drive_loss's parameters)
    the loss and its gradient with respect to logp must be the reference's, no gradient may
    reach the advantages, and where they differ the known mistake that gives the learner's
    numbers is named, else where they differ (row, token, padding or not). `stats`: the
    entries of the returned stats that must be the reference's too, and `stats_mistakes` the
    known mistakes in them (losses whose stats alone differ from the reference's)."""

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
            no_advantage_gradient(out)
            if not torch.allclose(flat(out).double(), flat(want).double(), **STEP_TOL):
                named = which_mistake(flat(out), mistakes, lambda m: flat(drive_loss(m, **params)))
                raise Mismatch(f"the loss or its gradient differs from the reference: "
                               f"{named or where_the_loss_differs(out, want)}")
            if out.get("tensor_stats"):
                raise Mismatch(f"stats[{out['tensor_stats'][0]!r}] is a tensor: return a plain "
                               "Python number (`.item()`); the step puts the stats into its "
                               "metrics, which are written as JSON")
        return run

    def stats_case(params):
        def run(f):
            out, want = drive(f, drive_loss, **params), drive_loss(ref, **params)
            for key in stats:
                check_stat(out["stats"], want["stats"], key, params, stats_mistakes)
        return run

    # every case's loss first, then the stats: a mistake in the loss is named as such even
    # where a later case shows it
    return run_check(name, fn, ref, [(what, case(params)) for what, params in cases]
                     + [(f"{what}: the stats", stats_case(params)) for what, params in cases
                        if stats])


def check_stat(got: dict, want: dict, key: str, params: dict,
               mistakes: tuple[Mistake, ...] = ()) -> None:
    """One entry of a loss's stats against the reference's; a value that one of the known
    `mistakes` gives (losses whose stats alone are wrong) is named."""
    if key not in got:
        raise Mismatch(f"the stats have no number under {key!r} (numbers under: "
                       f"{sorted(got)[:8]}): return it with the loss, the metrics show it")
    if math.isclose(got[key], want[key], rel_tol=1e-4, abs_tol=1e-6):
        return
    cfg, args, _ = loss_case(**params)
    for mistake in mistakes:
        _, other = mistake.wrong(*args, cfg)
        if key in other and math.isclose(got[key], float(other[key]), rel_tol=1e-4,
                                         abs_tol=1e-6):
            raise Mismatch(f"stats[{key!r}] is {got[key]:.6g}, expected {want[key]:.6g}: "
                           f"{mistake.message}")
    if key.endswith("max_abs"):
        meant = ("the largest |summed log-ratio| over the completions (one per "
                 "completion), before any clamp")
    else:
        meant = ("a fraction of the batch's completion tokens" if key.startswith("clip_ratio")
                 else "a mean over the completion tokens of the batch")
        mask = loss_case(**params)[2]
        padded = mask.numel() / mask.sum().item()  # mean over every position instead
        if want[key] and math.isclose(got[key] * padded, want[key], rel_tol=1e-4):
            meant += (f"; yours is {1 / padded:.3g} x that, a mean over every (row, token) "
                      "position, padding included: divide by the completion tokens only")
    raise Mismatch(f"stats[{key!r}] is {got[key]:.6g}, expected {want[key]:.6g} ({meant})")
