"""Exercise checkers: `check_<name>(your_fn)` compares your function with the reference
on random and edge-case inputs and says, in the learner's terms, what is wrong.

A checker never raises. It prints one verdict and returns a `CheckResult`:

    result = check_group_advantages(group_advantages)
    group_advantages = result.use()  # yours if it passed, else the reference: the rest runs

An exercise still raising NotImplementedError reports "not implemented yet".
"""

from __future__ import annotations

import contextlib
import inspect
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import naive, objective
from ..distributed import World, shard
from ..health import nonfinite_params
from ..models import count_parameters
from ..sampling import SamplingError, SanitizeLogits, completion_mask_from_ids
from ..step import SPIKE_MIN_HISTORY, micro_batch_slices
from ..tasks import addition_reward


@dataclass
class CheckResult:
    exercise: str
    status: str  # "passed" | "failed" | "not implemented"
    reason: str
    yours: Callable | None
    reference: Callable

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def use(self) -> Callable:
        return self.yours if self.passed else self.reference


class Mismatch(Exception):
    """A case where the learner's function disagrees with the reference (message: why)."""


def _close(a, b, atol=1e-5, rtol=1e-4) -> bool:
    if isinstance(b, torch.Tensor):
        if not isinstance(a, torch.Tensor) or a.shape != b.shape:
            return False
        return bool(torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol, equal_nan=True))
    if isinstance(b, float):
        return isinstance(a, (int, float)) and math.isclose(a, b, rel_tol=rtol, abs_tol=atol)
    return a == b


def _shape(x) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)[:60]


def run_check(name: str, yours: Callable, reference: Callable,
              cases: list[tuple[str, Callable[[Callable], None]]]) -> CheckResult:
    """Run each (description, test) case; the first failing one gives the reason. Every call
    of `yours` is watched: changing an input tensor in place fails the case."""
    label = f"check_{name}"
    status, reason = "passed", ""
    guarded = _no_mutation(yours, reference)
    for description, case in cases:
        try:
            case(guarded)
        except NotImplementedError:
            status, reason = "not implemented", "not implemented yet: the notebook carries on " \
                "with the reference"
        except Mismatch as e:
            status, reason = "failed", f"{description}: {e}"
        except Exception as e:
            kind = getattr(e, "type_name", type(e).__name__)
            status, reason = "failed", f"{description}: your function raised {kind}: {e}" \
                if not hasattr(e, "type_name") else f"{description}: your function raised {e}"
        if status != "passed":
            break
    icon = {"passed": "✅", "failed": "❌", "not implemented": "⏳"}[status]
    print(f"{icon} {label}: " + (reason or f"passed {len(cases)} cases"))
    return CheckResult(name, status, reason, yours, reference)


def _tensor_args(args, kwargs, names: list[str]) -> list[tuple[str, torch.Tensor]]:
    out = []
    for i, a in enumerate(args):
        label = f"`{names[i]}`" if i < len(names) else f"argument {i + 1}"
        out += [(label, t) for t in _flat_tensors(a)]
    for k, v in kwargs.items():
        out += [(f"`{k}`", t) for t in _flat_tensors(v)]
    return out


def _flat_tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _flat_tensors(v)]
    return []


def _no_mutation(fn: Callable, reference: Callable) -> Callable:
    try:
        names = list(inspect.signature(reference).parameters)
    except (TypeError, ValueError):
        names = []

    def call(*args, **kwargs):
        watched = _tensor_args(args, kwargs, names)
        before = [t.detach().clone() for _, t in watched]
        out = fn(*args, **kwargs)
        for (label, t), b in zip(watched, before, strict=True):
            if t.shape != b.shape or not torch.equal(t.detach().nan_to_num(0.5),
                                                     b.nan_to_num(0.5)):
                raise Mismatch(f"your function changed its input {label} in place (an in-place "
                               "op such as `x -= ...`, `x[...] = ...` or `.clamp_()`): the "
                               "caller still needs it; work on a copy or use out-of-place ops")
        return out

    call.__wrapped_student__ = fn
    return call


def _expect(got, want, what: str, **tol) -> None:
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise Mismatch(f"{what}: you returned {_kind(got)}, expected a tensor of "
                           f"{_shape(want)}")
        if got.shape != want.shape:
            raise Mismatch(f"{what} has {_shape(got)}, expected {_shape(want)}")
        if got.is_complex() or (got.dtype == torch.bool) != (want.dtype == torch.bool) and \
                want.dtype != torch.bool:
            raise Mismatch(f"{what} has dtype {got.dtype}, expected {want.dtype}")
        if torch.isnan(got).any() and not torch.isnan(want).any():
            raise Mismatch(f"{what} contains NaN where the reference has none")
    if not _close(got, want, **tol):
        raise Mismatch(f"{what} is wrong: {_difference(got, want, **tol)}")


def _kind(x) -> str:
    return f"{type(x).__name__} {_fmt(x)}" if x is not None else "None"


def _difference(got, want, atol=1e-5, rtol=1e-4) -> str:
    """Where and by how much `got` differs from `want`, and a guess at why."""
    if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)):
        return f"yours is {_fmt(got)}, expected {_fmt(want)}"
    g, w = got.detach().double(), want.detach().double()
    bad = ~torch.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
    idx = tuple(int(i) for i in bad.nonzero()[0]) if bad.any() else ()
    at = f"[{', '.join(map(str, idx))}]" if idx else ""
    n = int(bad.sum())
    msg = (f"{n} of {bad.numel()} entries differ; at {at or 'the value'} yours is "
           f"{g[idx].item():.6g}, expected {w[idx].item():.6g} "
           f"(off by {abs(g[idx] - w[idx]).item():.2g}; tolerance {atol:g} + {rtol:g} x |expected|)")
    cause = _cause(g, w, atol, rtol)
    return msg + (f": {cause}" if cause else "")


def _cause(g: torch.Tensor, w: torch.Tensor, atol: float, rtol: float) -> str:
    finite = torch.isfinite(g) & torch.isfinite(w)
    if not finite.any():
        return ""
    g, w = g[finite], w[finite]
    if torch.allclose(g, -w, rtol=rtol, atol=atol) and w.abs().max() > atol:
        return "yours has the opposite sign everywhere"
    nz = w.abs() > 1e-8
    if nz.any():
        ratio = g[nz] / w[nz]
        k = ratio.median()
        if torch.allclose(g, w * k, rtol=rtol, atol=atol) and not math.isclose(k.item(), 1):
            return f"yours is {k.item():.4g} x the expected value everywhere (a wrong " \
                "normaliser or a missing factor?)"
    d = (g - w).median()
    if torch.allclose(g, w + d, rtol=rtol, atol=atol) and abs(d.item()) > atol:
        return f"yours is off by a constant {d.item():.4g} everywhere"
    rel = ((g - w).abs() / w.abs().clamp(min=1e-12)).max().item()
    if rel < 1e-2:
        return "close but not equal: rounding? (compute in float32 and do not round)"
    return ""


def _fmt(x) -> str:
    if isinstance(x, torch.Tensor):
        flat = x.detach().flatten()[:6].tolist()
        return f"{[round(v, 4) if isinstance(v, float) else v for v in flat]}" + (
            "..." if x.numel() > 6 else "")
    return repr(x)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- 00 --------------------------------------------------------------------------------------
def check_count_parameters(fn: Callable) -> CheckResult:

    def case(f, model):
        _expect(f(model), count_parameters(model), "the count")

    lin = torch.nn.Linear(3, 4)
    frozen = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 5, bias=False))
    frozen[0].requires_grad_(False)  # frozen weights are still parameters
    return run_check("count_parameters", fn, count_parameters, [
        ("a 3 -> 4 linear layer (weights and bias)", lambda f: case(f, lin)),
        ("a model with a frozen layer", lambda f: case(f, frozen)),
    ])


# --- 01 --------------------------------------------------------------------------------------
def check_position_ids_from_mask(fn: Callable) -> CheckResult:
    ref = objective.position_ids_from_mask

    def case(mask):
        def run(f):
            got = f(mask.clone())
            want = ref(mask)
            if isinstance(got, torch.Tensor) and got.shape == want.shape and not torch.equal(
                got.long(), want
            ):
                row = int((got.long() != want).any(-1).nonzero()[0])
                raise Mismatch(f"row {row} with mask {mask[row].tolist()} got positions "
                               f"{got[row].tolist()}, expected {want[row].tolist()} (the first "
                               "real token is position 0, padding does not advance it)")
            _expect(got, want, "the position ids")
        return run

    return run_check("position_ids_from_mask", fn, ref, [
        ("no padding", case(torch.ones(2, 4, dtype=torch.long))),
        ("left padding of different lengths",
         case(torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]))),
        ("a row that is all padding", case(torch.tensor([[0, 0, 0], [0, 1, 1]]))),
    ])


def check_token_logprobs(fn: Callable) -> CheckResult:
    ref = objective.token_logprobs

    def case(logits, ids, what):
        def run(f):
            got = f(logits.clone(), ids.clone())
            if isinstance(got, torch.Tensor) and got.shape == ids.shape and (got > 1e-6).any():
                raise Mismatch(f"{what}: some log-probs are > 0; did you gather from the logits "
                               "instead of log_softmax(logits)?")
            _expect(got, ref(logits, ids), f"{what}: the log-probs")
        return run

    logits = torch.randn(3, 4, 7, generator=_gen(0))
    ids = torch.randint(0, 7, (3, 4), generator=_gen(1))
    big = torch.randn(2, 3, 5, generator=_gen(2)) * 1000  # softmax(exp) overflows naively
    return run_check("token_logprobs", fn, ref, [
        ("random logits", case(logits, ids, "random logits")),
        ("logits of size 1000 (use log_softmax, not log(softmax))",
         case(big, torch.zeros(2, 3, dtype=torch.long), "huge logits")),
    ])


# --- 02 --------------------------------------------------------------------------------------
def check_group_advantages(fn: Callable) -> CheckResult:
    ref = objective.group_advantages

    def case(rewards, g, **kw):
        def run(f):
            got = f(rewards.clone(), g, **kw)
            want = ref(rewards, g, **kw)
            if isinstance(got, torch.Tensor) and torch.isnan(got).any():
                raise Mismatch("your advantages are NaN when every reward in a group is "
                               "equal: divide by (std + advantage_eps)")
            if isinstance(got, torch.Tensor) and got.shape == want.shape:
                grouped = got.view(-1, g).sum(-1)
                if grouped.abs().max() > 1e-4 and want.view(-1, g).sum(-1).abs().max() < 1e-4:
                    raise Mismatch("your advantages do not sum to 0 within each group: "
                                   "subtract each group's own mean, not the batch mean")
            _expect(got, want, f"advantages for rewards {rewards.tolist()}")
        return run

    rnd = torch.rand(12, generator=_gen(3))
    return run_check("group_advantages", fn, ref, [
        ("a group whose rewards are all equal",
         case(torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 1]), 4)),
        ("random rewards, G=4", case(rnd, 4)),
        ("binary rewards, G=4", case(torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0]), 4)),
        ("scale_rewards=False only centres", case(rnd, 3, scale_rewards=False)),
        ("a larger advantage_eps", case(rnd, 6, advantage_eps=0.5)),
    ])


# --- 03 --------------------------------------------------------------------------------------
def _requires_grad(out, what: str, wrt: str = "logp") -> None:
    if not isinstance(out, torch.Tensor):
        return
    if not out.requires_grad:
        raise Mismatch(f"{what} carries no gradient with respect to {wrt}: did you .detach() "
                       "it, compute it under torch.no_grad(), or go through .item()/numpy? "
                       "Training could not learn from it")


def _grad(out: torch.Tensor, leaf: torch.Tensor, upstream: torch.Tensor, what: str):
    try:
        (g,) = torch.autograd.grad(out, leaf, upstream, allow_unused=True)
    except RuntimeError as e:
        raise Mismatch(f"the gradient of {what} could not be computed through your function "
                       f"({str(e)[:120]})") from None
    return torch.zeros_like(leaf) if g is None else g


def check_kl_k3(fn: Callable) -> CheckResult:
    ref = objective.kl_k3
    logp = -torch.rand(4, 5, generator=_gen(4)) * 3
    ref_logp = -torch.rand(4, 5, generator=_gen(5)) * 3
    upstream = torch.rand(4, 5, generator=_gen(8)) + 0.5

    def run(f):
        got = f(logp.clone(), ref_logp.clone())
        if isinstance(got, torch.Tensor) and got.shape == logp.shape and (got < -1e-6).any():
            raise Mismatch("your k3 is negative somewhere; k3 = exp(r) - r - 1 with "
                           "r = ref_logp - logp is never negative")
        if isinstance(got, torch.Tensor) and _close(got, ref(ref_logp, logp)):
            raise Mismatch("your log-ratio has the wrong sign: r = ref_logp - logp")
        if isinstance(got, torch.Tensor) and _close(got, naive.report003_kl(logp, ref_logp)):
            raise Mismatch("this is report 003's 'fix' (ref_logp - logp).clamp(0, 10): it is "
                           "biased (notebook 09 measures it); k3 = exp(r) - r - 1 is not")
        _expect(got, ref(logp, ref_logp), "k3")

    def gradient(f):
        lp = logp.clone().requires_grad_(True)
        got = f(lp, ref_logp.clone())
        _expect(got.detach() if isinstance(got, torch.Tensor) else got, ref(logp, ref_logp),
                "k3")
        _requires_grad(got, "your k3")
        lp2 = logp.clone().requires_grad_(True)
        want = _grad(ref(lp2, ref_logp), lp2, upstream, "k3")
        _expect(_grad(got, lp, upstream, "k3"), want, "the gradient of k3 with respect to logp")

    def equal(f):
        _expect(f(logp.clone(), logp.clone()), torch.zeros_like(logp), "k3 for identical policies")

    return run_check("kl_k3", fn, ref, [("random log-probs", run), ("identical policies", equal),
                                        ("the gradient with respect to logp", gradient)])


def check_clipped_surrogate(fn: Callable) -> CheckResult:
    ref = objective.clipped_surrogate
    old = -torch.rand(6, 3, generator=_gen(6)) * 2
    log_r = torch.tensor([-1.0, -0.3, -0.1, 0.0, 0.1, 0.3]).unsqueeze(-1).expand(6, 3)
    logp = old + log_r
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
    upstream = torch.rand(6, 3, generator=_gen(9)) + 0.5

    def pair(got):
        if not (isinstance(got, tuple) and len(got) == 2):
            raise Mismatch("return (per_token_loss, region_clipped), a pair of (B, C) tensors")
        return got

    def run(f, eps_low=0.2, eps_high=0.2):
        lp = logp.clone().requires_grad_(True)
        got = pair(f(lp, old.clone(), adv.clone(), eps_low, eps_high))
        want_loss, want_clipped = ref(logp, old, adv, eps_low, eps_high)
        const, _ = naive.constant_clip_surrogate(logp, old, adv, eps_low, eps_high)
        loss = got[0].detach() if isinstance(got[0], torch.Tensor) else got[0]
        if _close(loss, const) and not _close(loss, want_loss):
            raise Mismatch("your clipped term multiplies the advantage by the clip range "
                           "(report 001's `clip_ratio * advantage`); clip the *ratio*: "
                           "clamp(r, 1 - eps_low, 1 + eps_high) * A")
        _expect(loss, want_loss, f"the per-token loss (eps_low={eps_low}, eps_high={eps_high})")
        clipped = got[1]
        _expect(clipped.bool() if isinstance(clipped, torch.Tensor) else clipped, want_clipped,
                "region_clipped")
        _requires_grad(got[0], "your per-token loss")
        lp2 = logp.clone().requires_grad_(True)
        want = _grad(ref(lp2, old, adv, eps_low, eps_high)[0], lp2, upstream, "the loss")
        _expect(_grad(got[0], lp, upstream, "the loss"), want,
                "the gradient of the loss with respect to logp")

    def clamp(f):
        far = old + torch.tensor([-30.0, -3.0, 0.0, 3.0, 30.0, 1.0]).unsqueeze(-1)
        got = pair(f(far.clone(), old.clone(), adv.clone(), 0.2, 0.2, log_ratio_clamp=2.0))
        want = ref(far, old, adv, 0.2, 0.2, log_ratio_clamp=2.0)[0]
        loss = got[0].detach() if isinstance(got[0], torch.Tensor) else got[0]
        if _close(loss, ref(far, old, adv, 0.2, 0.2)[0]) and not _close(loss, want):
            raise Mismatch("log_ratio_clamp=2.0 changed nothing: clamp log r = logp - "
                           "old_logp to [-2, 2] before exp (with log r = 30, exp overflows "
                           "the loss)")
        _expect(loss, want, "the per-token loss with log_ratio_clamp=2.0 (log r of +-3, +-30)")

    def reference_ratio(f):
        # a ratio against the old policy is 1 when nothing changed: loss = -A on every token
        got = pair(f(old.clone(), old.clone(), adv.clone(), 0.2, 0.2))
        _expect(got[0], -adv.unsqueeze(-1).expand(6, 3), "the loss when logp == old_logp")

    def on_the_bound(f):
        # eps = 0 puts r = 1 exactly on both bounds: the region is strict (TRL), so nothing
        # is clipped; `<=` / `>=` would mark every token
        got = pair(f(old.clone(), old.clone(), adv.clone(), 0.0, 0.0))
        clipped = got[1]
        if isinstance(clipped, torch.Tensor) and clipped.shape == (6, 3) and bool(clipped.all()):
            raise Mismatch("region_clipped marks a ratio that sits exactly on the bound: with "
                           "eps = 0 and r = 1 every token is marked. The region is strict, "
                           "r < 1 - eps_low (A < 0) or r > 1 + eps_high (A > 0), as TRL's "
                           "clip_ratio/region_mean: use < and >, not <= and >=")
        _expect(clipped.bool() if isinstance(clipped, torch.Tensor) else clipped,
                torch.zeros(6, 3, dtype=torch.bool), "region_clipped with eps = 0 and r = 1")

    return run_check("clipped_surrogate", fn, ref, [
        ("ratios inside and outside [0.8, 1.2], both signs of A", run),
        ("asymmetric clip range (eps_high = 0.28)", lambda f: run(f, 0.2, 0.28)),
        ("ratio 1 when the policy has not moved", reference_ratio),
        ("a ratio exactly on the clip bound (eps = 0, r = 1)", on_the_bound),
        ("log_ratio_clamp bounds the log-ratio before exp", clamp),
    ])


def check_token_weights(fn: Callable) -> CheckResult:
    ref = objective.token_weights
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    cap = 8  # the completion cap; this batch happens to be padded only to 5

    def case(loss_type):
        def run(f):
            got = f(mask.clone(), loss_type, cap)
            want = ref(mask, loss_type, cap)
            if loss_type == "dr_grpo" and isinstance(got, torch.Tensor) and _close(
                    got, mask.float() / (mask.shape[0] * mask.shape[1])):
                raise Mismatch(f"you divided by the tensor's width ({mask.shape[1]}); "
                               f"divide by max_completion_length ({cap}), the cap: the weights "
                               "must not depend on how far this batch happens to be padded")
            if isinstance(got, torch.Tensor) and got.shape == want.shape and not _close(
                got.sum(), want.sum()
            ):
                raise Mismatch(f"{loss_type}: your weights sum to {float(got.sum()):.4f}, "
                               f"expected {float(want.sum()):.4f}")
            _expect(got, want, f"{loss_type} weights for lengths [3, 1, 5, 0], cap {cap}")
        return run

    def unknown(f):
        try:
            got = f(mask.clone(), "sum", cap)
        except ValueError:
            return
        raise Mismatch(f"loss_type='sum' returned {_kind(got)[:60]}; raise ValueError for a "
                       "loss_type you do not know: a typo in the config would otherwise train "
                       "with a loss nobody chose")

    return run_check("token_weights", fn, ref, [(t, case(t)) for t in
                                                ("grpo", "bnpo", "dapo", "dr_grpo")] +
                     [("an unknown loss_type", unknown)])


# --- 04 --------------------------------------------------------------------------------------
def check_addition_reward(fn: Callable) -> CheckResult:

    def case(completions, answers, what, truncated=None):
        def run(f):
            columns = {"prompt": ["?"] * len(completions)}
            if truncated is not None:
                columns["truncated"] = truncated
            got = f(completions, answer=answers, **columns)
            got = list(got) if got is not None else None
            _expect(got, addition_reward(completions, answers, truncated), what)
        return run

    return run_check("addition_reward", fn, addition_reward, [
        ("exact answers", case(["46", "7"], ["46", "7"], "rewards for right answers")),
        ("wrong answers", case(["45", "", "4"], ["46", "0", "46"], "rewards for wrong answers")),
        ("surrounding spaces", case([" 46", "46 "], ["46", "46"], "rewards with spaces")),
        ("extra columns in **kwargs", case(["1"], ["1"], "rewards")),
        ("a completion cut off at max_new_tokens", case(
            ["46", "46", "12   "], ["46", "46", "12"],
            "rewards when truncated=[False, True, True]: a completion that hit max_new_tokens "
            "without end-of-text never finished its answer and scores 0.0",
            truncated=[False, True, True])),
    ])


# --- 05 --------------------------------------------------------------------------------------
def reference_first_nonfinite_step(history: list[dict]) -> int | None:
    """The first step whose metrics show non-finite parameters, else None."""
    return next((m["step"] for m in history if m.get("nonfinite_params", 0) > 0), None)


def check_first_nonfinite_step(fn: Callable) -> CheckResult:
    ref = reference_first_nonfinite_step
    nan = float("nan")
    healthy = [{"step": s, "grad_norm": 1.0, "nonfinite_params": 0} for s in range(1, 6)]
    broken = healthy + [{"step": 6, "grad_norm": nan, "nonfinite_params": 12},
                        {"step": 7, "grad_norm": nan, "nonfinite_params": 99}]
    spike_then_nan = healthy[:3] + [{"step": 4, "grad_norm": 1e6, "nonfinite_params": 0},
                                    {"step": 5, "grad_norm": nan, "nonfinite_params": 7}]
    with_eval = [{"step": 0, "eval/accuracy": 0.4}] + broken

    def case(history, what):
        def run(f):
            _expect(f([dict(m) for m in history]), ref(history), what)
        return run

    return run_check("first_nonfinite_step", fn, ref, [
        ("a healthy run", case(healthy, "the answer for a healthy run")),
        ("a run that breaks at step 6", case(broken, "the first bad step")),
        ("a spike before the NaN", case(spike_then_nan,
                                        "the first bad step (a spike is not yet corruption)")),
        ("an eval-only row at step 0", case(with_eval, "the first bad step")),
    ])


# --- 06 --------------------------------------------------------------------------------------


def reference_clip_grad_norm(grads: list[torch.Tensor],
                             max_norm: float) -> tuple[list[torch.Tensor], float]:
    """torch.nn.utils.clip_grad_norm_ as a function of the gradients: (clipped copies, the
    global norm before clipping). A NaN norm makes the scale NaN, as in torch."""
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return [g * scale.to(g.dtype) for g in grads], float(norm)


def check_clip_grad_norm(fn: Callable) -> CheckResult:
    ref = reference_clip_grad_norm

    def all_close(xs, ys) -> bool:
        return all(_close(x, y) for x, y in zip(xs, ys, strict=True))

    def same(grads, max_norm, what):
        def case(f):
            got = f([g.clone() for g in grads], max_norm)
            if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], (list, tuple))):
                raise Mismatch("return (clipped_grads, norm): a list of tensors and the norm "
                               "before clipping")
            clipped, norm = list(got[0]), got[1]
            norm = float(norm) if isinstance(norm, (int, float, torch.Tensor)) else norm
            want, want_norm = ref(grads, max_norm)
            if len(clipped) != len(want):
                raise Mismatch(f"{what}: {len(clipped)} gradients returned for {len(want)}")
            for i, (c, w) in enumerate(zip(clipped, want, strict=True)):
                if not isinstance(c, torch.Tensor) or c.shape != w.shape:
                    raise Mismatch(f"{what}: clipped gradient {i} has {_shape(c)}, expected "
                                   f"{_shape(w)}")
            per_tensor = [ref([g], max_norm)[0][0] for g in grads]
            by_value = [g.clamp(-max_norm, max_norm) for g in grads]
            if not all_close(clipped, want):
                if all_close(clipped, per_tensor):
                    raise Mismatch(f"{what}: you clipped each tensor to max_norm on its own; "
                                   "the norm is one global norm over all tensors, "
                                   "sqrt(sum of their squared norms)")
                if all_close(clipped, by_value):
                    raise Mismatch(f"{what}: you clamped each element to [-max_norm, max_norm] "
                                   "(clip_grad_value_): that changes the gradient's direction; "
                                   "scale every tensor by one factor instead")
                if want_norm < max_norm:
                    raise Mismatch(f"{what}: the norm {want_norm:.3g} is below max_norm "
                                   f"{max_norm}, so the gradients must come back unchanged (the "
                                   "scale is min(1, max_norm / (norm + 1e-6)), never above 1)")
            if isinstance(norm, float) and want_norm > max_norm and math.isclose(
                norm, max_norm, rel_tol=1e-3
            ):
                raise Mismatch(f"{what}: you returned the norm after clipping ({norm:.3g}); "
                               "return it before clipping (TRL logs that as grad_norm)")
            _expect(norm, want_norm, f"{what}: the norm before clipping")
            for i, (c, w) in enumerate(zip(clipped, want, strict=True)):
                _expect(c, w, f"{what}: clipped gradient {i}")
        return case

    g = _gen(7)
    rnd = [torch.randn(4, 3, generator=g) * 5, torch.randn(3, generator=g),
           torch.randn(2, 2, 2, generator=g)]
    return run_check("clip_grad_norm", fn, ref, [
        ("one tensor [6, 8] (norm 10), max_norm 5",
         same([torch.tensor([6.0, 8.0])], 5.0, "[6, 8]")),
        ("norms 5, 12, 0: global norm 13, max_norm 5",
         same([torch.tensor([3.0, 4.0]), torch.tensor([[12.0]]), torch.zeros(3)], 5.0,
              "global norm 13")),
        ("a norm below max_norm is left alone",
         same([torch.tensor([0.3, 0.4]), torch.tensor([1.2])], 5.0, "norm 1.3")),
        ("random gradients of three shapes, max_norm 1", same(rnd, 1.0, "random")),
    ])


def reference_should_skip(grad_norm: float, recent, factor: float) -> bool:
    """The trainer's skip rule (step.guarded_update with skip_nonfinite_grad and
    spike_skip_factor): skip a non-finite norm; skip a finite one above factor x the median of
    the recent norms, once there are SPIKE_MIN_HISTORY of them."""
    if not math.isfinite(grad_norm):
        return True
    return len(recent) >= SPIKE_MIN_HISTORY and grad_norm > factor * statistics.median(recent)


def check_should_skip(fn: Callable) -> CheckResult:
    ref = reference_should_skip
    steady = [1.1, 0.9, 1.0, 1.2, 0.8, 1.0]

    def same(grad_norm, recent, factor, what, hint=""):
        def case(f):
            got = f(grad_norm, type(recent)(recent), factor)
            as_bool = got
            if hasattr(got, "item"):  # a one-element torch or numpy bool is fine
                with contextlib.suppress(ValueError, RuntimeError):
                    as_bool = got.item()
            if not isinstance(as_bool, bool):
                raise Mismatch(f"{what}: return True or False (got {got!r})")
            want = ref(grad_norm, recent, factor)
            if as_bool != want:
                raise Mismatch(f"{what}: you returned {as_bool}, expected {want}" +
                               (f"; {hint}" if hint else ""))
        return case

    return run_check("should_skip", fn, ref, [
        ("a NaN grad norm", same(float("nan"), steady, 20.0, "grad_norm NaN",
                                 "NaN > x is False for every x, so a comparison never flags it: "
                                 "check math.isfinite(grad_norm) first (report 000's "
                                 "`if grad_norm > 10` let the NaN update through)")),
        ("an inf grad norm", same(float("inf"), steady, 20.0, "grad_norm inf",
                                  "skip any non-finite norm")),
        ("a spike 100x the median", same(100.0, steady, 20.0, "grad_norm 100, median 1")),
        ("3x the median with factor 20 is kept", same(3.0, steady, 20.0, "grad_norm 3, median 1")),
        ("a larger model: recent norms near 40, a norm of 50 is kept",
         same(50.0, [38.0, 41.0, 40.0, 45.0, 39.0], 20.0, "grad_norm 50, median 40",
              "the threshold is factor x the median of the recent norms, not a fixed number: "
              "a fixed one depends on the model's scale")),
        ("one earlier spike among the recent norms (a deque)",
         same(500.0, deque([1.0, 1.0, 1.0, 1.0, 1.0, 1e4]), 20.0, "grad_norm 500, median 1",
              "use the median: one earlier spike inflates the mean of the recent norms and "
              "hides the next one")),
        ("fewer than 5 recent norms: no baseline yet",
         same(100.0, [1.0, 1.0], 20.0, "grad_norm 100 with 2 recent norms",
              f"with fewer than {SPIKE_MIN_HISTORY} recent norms there is no baseline: keep "
              "any finite norm")),
    ])


# --- 07 --------------------------------------------------------------------------------------
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
            n_nan = sum(1 for v in values.values() if v != v)
            if got == n_nan != want:
                raise Mismatch(f"{what}: you counted NaN but not inf (use torch.isfinite)")
            _expect(got, want, f"{what}: the count")
        return run

    inf, nan = float("inf"), float("nan")
    return run_check("nonfinite_params", fn, nonfinite_params, [
        ("a healthy model", case({}, "a healthy model")),
        ("one NaN weight", case({"0.weight": nan}, "one NaN")),
        ("NaN and inf in different layers",
         case({"0.weight": nan, "1.bias": inf, "1.weight": -inf}, "NaN and +-inf")),
    ])


# --- 08 --------------------------------------------------------------------------------------
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
            _expect(list(got) if isinstance(got, tuple) else got, micro_batch_slices(n, k),
                    f"the slices for {n} rows, k={k}")
        return case

    def refuses(n, k):
        def case(f):
            try:
                got = f(n, k)
            except ValueError:
                return
            raise Mismatch(f"micro_batch_slices({n}, {k}) returned {got}; it must raise "
                           "ValueError (a micro-batch would be empty: report 004)")
        return case

    return run_check("micro_batch_slices", fn, micro_batch_slices, [
        ("16 rows into 3 (sizes 6, 5, 5)", same_split(16, 3)),
        ("64 rows into 4", same_split(64, 4)),
        ("k = 1: the whole batch", same_split(5, 1)),
        ("k = n_rows: one row each", same_split(4, 4)),
        ("1 row into 4 micro-batches (report 004)", refuses(1, 4)),
        ("k = 0", refuses(3, 0)),
    ])


# --- 09 --------------------------------------------------------------------------------------
def check_exact_kl(fn: Callable) -> CheckResult:
    ref = objective.exact_kl

    def same_kl(logits, ref_logits, what):
        def case(f):
            got = f(logits.clone(), ref_logits.clone())
            want, swapped = ref(logits, ref_logits), ref(ref_logits, logits)
            if isinstance(got, torch.Tensor) and got.shape == want.shape:
                if not torch.isfinite(got).all() and torch.isfinite(want).all():
                    raise Mismatch(f"{what}: your KL is not finite; normalise with log_softmax, "
                                   "not log(softmax) or exp() of the raw logits")
                if _close(got, swapped) and not _close(got, want):
                    raise Mismatch(f"{what}: you computed KL(q || p); the expectation is over "
                                   "the policy p = softmax(logits)")
            _expect(got, want, f"{what}: the KL")
        return case

    g = _gen(0)
    a, b = torch.randn(3, 4, 7, generator=g), torch.randn(3, 4, 7, generator=g)
    return run_check("exact_kl", fn, ref, [
        ("random (3, 4, 7) logits", same_kl(a, b, "random logits")),
        ("a single distribution of shape (V,)", same_kl(a[0, 0], b[0, 0], "shape (7,)")),
        ("identical logits give 0", same_kl(a, a, "identical logits")),
        ("logits shifted by a constant are the same distribution",
         same_kl(a, a + 5.0, "shifted")),
        ("logits of size 1000", same_kl(a * 1000, b * 1000, "huge logits")),
    ])


def check_kl_k2(fn: Callable) -> CheckResult:
    ref = objective.kl_k2

    def same_k2(logp, ref_logp, what):
        def case(f):
            got = f(logp.clone(), ref_logp.clone())
            want = ref(logp, ref_logp)
            if isinstance(got, torch.Tensor) and got.shape == want.shape and _close(
                got, 2 * want
            ) and not _close(want, torch.zeros_like(want)):
                raise Mismatch(f"{what}: yours is twice k2; k2 = (log r)^2 / 2")
            _expect(got, want, f"{what}: k2")
        return case

    g = _gen(1)
    logp, ref_logp = -torch.rand(4, 5, generator=g) * 3, -torch.rand(4, 5, generator=g) * 3
    return run_check("kl_k2", fn, ref, [
        ("random log-probs", same_k2(logp, ref_logp, "random log-probs")),
        ("identical policies give 0", same_k2(logp, logp, "identical policies")),
    ])


# --- 10 --------------------------------------------------------------------------------------
def reference_sanitize_logits(logits: torch.Tensor) -> torch.Tensor:
    """The package's SanitizeLogits as a function of the logits alone, raising ValueError."""
    try:
        return SanitizeLogits()(torch.zeros(logits.shape[0], 0, dtype=torch.long), logits)
    except SamplingError as e:
        raise ValueError(str(e)) from None


def check_sanitize_logits(fn: Callable) -> CheckResult:
    ref = reference_sanitize_logits

    def same(scores, what):
        def case(f):
            _expect(f(scores.clone()), ref(scores), what)
        return case

    def refuses(scores, what):
        def case(f):
            try:
                f(scores.clone())
            except ValueError:
                return
            raise Mismatch(f"{what}: no ValueError; a row of NaN cannot be sampled from")
        return case

    nan, inf = float("nan"), float("inf")
    return run_check("sanitize_logits", fn, ref, [
        ("finite logits pass unchanged", same(torch.randn(3, 6, generator=_gen(0)), "finite")),
        ("NaN becomes -inf",
         same(torch.tensor([[1.0, nan, 0.5, nan], [0.0, 1.0, 2.0, 3.0]]), "logits with NaN")),
        ("+inf becomes the largest float32", same(torch.tensor([[2.0, inf, -1.0]]), "+inf")),
        ("float16: +inf becomes float16's largest",
         same(torch.tensor([[inf, 0.0, 1.0]], dtype=torch.float16), "float16 logits")),
        ("a row of NaN must raise ValueError",
         refuses(torch.tensor([[0.0, 1.0, 2.0], [nan, nan, nan]]), "a row of NaN")),
    ])


def check_completion_mask_from_ids(fn: Callable) -> CheckResult:

    def same_mask(ids, eos, what):
        def case(f):
            got = f(ids.clone(), eos)
            want = completion_mask_from_ids(ids, eos)
            if isinstance(got, torch.Tensor) and got.shape == want.shape:
                first = (ids == eos) & (want == 1)
                if (got[first] == 0).any():
                    raise Mismatch(f"{what}: your mask drops the first EOS; keep it (the model "
                                   "must learn to stop)")
            _expect(got, want, f"{what}: the mask for ids {ids.tolist()}")
        return case

    return run_check("completion_mask_from_ids", fn, completion_mask_from_ids, [
        ("no EOS: every token counts", same_mask(torch.tensor([[5, 6, 7], [8, 9, 10]]), 0,
                                                 "no EOS")),
        ("EOS kept, padding after it dropped",
         same_mask(torch.tensor([[5, 6, 0, 1, 1], [7, 0, 1, 1, 1], [0, 1, 1, 1, 1]]), 0,
                   "EOS then pad")),
        ("a later EOS does not count again",
         same_mask(torch.tensor([[5, 0, 0, 0], [0, 5, 0, 5]]), 0, "repeated EOS")),
        ("another EOS id (GPT-2's 50256)",
         same_mask(torch.tensor([[464, 50256, 50256], [464, 318, 50256]]), 50256, "eos 50256")),
    ])


# --- 11 --------------------------------------------------------------------------------------
def reference_accumulation_for_budget(rows: int, mib_per_row: float, budget_mib: float) -> int:
    if mib_per_row > budget_mib:
        raise ValueError(f"one row needs {mib_per_row} MiB, more than the budget of "
                         f"{budget_mib} MiB: no accumulation fits")
    return next(k for k in range(1, rows + 1) if math.ceil(rows / k) * mib_per_row <= budget_mib)


def check_accumulation_for_budget(fn: Callable) -> CheckResult:
    ref = reference_accumulation_for_budget

    def same(rows, per_row, budget, hint=""):
        def case(f):
            got, want = f(rows, per_row, budget), ref(rows, per_row, budget)
            if got != want:
                raise Mismatch(f"{rows} rows at {per_row} MiB/row, budget {budget} MiB: you "
                               f"returned {got!r}, expected {want}" + (f"; {hint}" if hint else ""))
        return case

    def refuses(f):
        try:
            got = f(8, 5.0, 4.0)
        except ValueError:
            return
        raise Mismatch(f"one row needs 5 MiB and the budget is 4 MiB: raise ValueError (you "
                       f"returned {got!r}; no number of micro-batches makes one row smaller)")

    return run_check("accumulation_for_budget", fn, ref, [
        ("everything fits at once", same(64, 1.0, 100.0, "k = 1 when the whole batch fits")),
        ("an exact fit at the boundary", same(64, 1.0, 32.0,
                                              "<= budget fits: 32 rows of 1 MiB fit in 32 MiB")),
        ("the smallest k, not the first divisor", same(10, 1.0, 4.0,
                                                      "k = 3 gives micro-batches of 4, 3 and 3 "
                                                      "rows: k need not divide the rows")),
        ("rows that do not divide evenly", same(10, 1.0, 3.0,
                                                "the largest micro-batch has ceil(10 / k) rows: "
                                                "k = 3 gives 4, 3 and 3 (too many), k = 4 gives "
                                                "3, 3, 2 and 2")),
        ("fractional MiB per row", same(512, 0.655, 100.0)),
        ("a single row that fits exactly", same(7, 2.5, 2.5, "k = rows: one row each")),
        ("one row too big", refuses),
    ])


# --- 12 --------------------------------------------------------------------------------------
def reference_shard_rows(prompts: int, group_size: int, rank: int, world_size: int) -> range:

    if prompts % world_size:
        raise ValueError(f"prompts ({prompts}) must be divisible by world_size ({world_size})")
    mine = shard(prompts, World(rank=rank, world_size=world_size))  # this rank's prompts
    return range(mine.start * group_size, mine.stop * group_size)


def check_shard_rows(fn: Callable) -> CheckResult:
    ref = reference_shard_rows

    def same(prompts, group_size, world_size, hint=""):
        def case(f):
            for rank in range(world_size):
                got = f(prompts, group_size, rank, world_size)
                want = list(ref(prompts, group_size, rank, world_size))
                if list(got) != want:
                    shown = list(got)[:8]
                    raise Mismatch(f"{prompts} prompts x G={group_size} on {world_size} ranks, "
                                   f"rank {rank}: you returned rows {shown}, expected "
                                   f"{want[:8]}" + (f"; {hint}" if hint else ""))
        return case

    def refuses(f):
        try:
            got = f(3, 2, 0, 2)
        except ValueError:
            return
        raise Mismatch(f"3 prompts on 2 ranks: raise ValueError (you returned {list(got)}); "
                       "splitting the 6 rows 3 and 3 would cut prompt 1's group in half, and "
                       "its advantages need the whole group")

    return run_check("shard_rows", fn, ref, [
        ("one process gets every row", same(4, 3, 1)),
        ("two ranks, contiguous groups", same(4, 3, 2,
                                              "rank r gets prompts [r * 2, r * 2 + 2), i.e. "
                                              "their whole groups, in order")),
        ("four ranks", same(8, 2, 4)),
        ("one prompt per rank", same(2, 5, 2)),
        ("prompts that do not divide evenly", refuses),
    ])
