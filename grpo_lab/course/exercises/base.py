"""What every exercise's check is made of: the exercise as data (`Exercise`, `Case`,
`Mistake`), the verdict (`CheckResult`), and the comparisons that say, in the learner's
terms, where a result differs.

A checker never raises. It prints one verdict and returns a `CheckResult`:

    result = check_group_advantages(group_advantages)
    group_advantages = result.use()  # yours if it passed, else the reference: the rest runs

An exercise still raising NotImplementedError reports "not implemented yet".

Each notebook's exercises live in one module, `nbNN.py`, as `Exercise` records: the
reference, the check (written out, or built from `cases`), the driver where the check needs
a model, and the known mistakes, each a `Mistake`: the reference with that one mistake put in
and the message a learner whose result it reproduces reads. docs/contributing.md says how to
add one.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


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


@dataclass(frozen=True, eq=False)
class Mistake:
    """A known mistake of an exercise, as data."""

    name: str
    """What the mistake is, in a few words (`kl_sign`): listed in docs/exercises.md."""
    wrong: Callable
    """The reference with this one mistake put in: the exercise's signature (or, for a
    whole-step exercise, what its driver runs)."""
    message: str
    """What a learner whose result matches `wrong`'s reads: what is wrong and what to do."""


@dataclass(frozen=True, eq=False)
class Case:
    """One input an exercise's function is called on, beside the reference."""

    label: str
    """What the learner reads when this case fails: "one group of four, all rewards equal"."""
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    hint: str = ""
    """Added to the message when the learner's result differs here and matches no known
    mistake: what this case is about ("k need not divide the rows")."""


@dataclass(frozen=True, eq=False)
class Exercise:
    """One graded function of a notebook. `python -m grpo_lab labs` finds it by name:
    the solution notebook calls `check_<name>(...)` after defining `<name>`."""

    name: str
    """The function the learner writes, and the `check_<name>` that checks it."""
    reference: Callable
    """The correct function: the engine's (grpo_lab.objective.kl_k3) or one written beside
    the exercise. The grader binds it wherever a later exercise needs this one."""
    check: Callable[[Callable], CheckResult] | None = None
    """A written-out checker, for what cases cannot say (a model, an update, a whole step).
    None: built from `cases` and `mistakes` (`check_cases`)."""
    cases: tuple[Case, ...] = ()
    """The inputs the built checker calls both functions on; the first that differs fails."""
    mistakes: tuple[Mistake, ...] = ()
    """The known mistakes the check recognises and names."""
    driver: Callable | None = None
    """For a whole-step exercise: the function that builds its case around the learner's
    function and returns what the check compares (it runs in the grader's sandbox)."""
    tolerance: dict = field(default_factory=lambda: dict(atol=1e-5, rtol=1e-4))
    """How close to the reference's a built checker's results must be (atol, rtol)."""

    def __post_init__(self):
        if self.check is None:
            if not self.cases:
                raise ValueError(f"exercise {self.name!r}: give it a check or cases")
            object.__setattr__(self, "check", _case_checker(self))

    def mistake(self, name: str) -> Mistake:
        """The known mistake `name` of this exercise."""
        for m in self.mistakes:
            if m.name == name:
                return m
        raise KeyError(f"exercise {self.name!r} knows no mistake {name!r}; it knows "
                       f"{[m.name for m in self.mistakes]}")


def _case_checker(exercise: Exercise) -> Callable[[Callable], CheckResult]:
    def check(fn: Callable) -> CheckResult:
        return check_cases(exercise, fn)
    check.__name__ = check.__qualname__ = f"check_{exercise.name}"
    check.__doc__ = f"Check your `{exercise.name}` against the reference on " \
        f"{len(exercise.cases)} cases."
    return check


def check_cases(exercise: Exercise, fn: Callable) -> CheckResult:
    """Call `fn` and the reference on each case; where a result differs, name the known
    mistake that gives it, else say where it differs (`expect_result`)."""
    tol = exercise.tolerance

    def case(c: Case):
        hint = f"; {c.hint}" if c.hint else ""

        def run(f):
            try:
                want = exercise.reference(*c.args, **c.kwargs)
            except Exception as refusal:  # noqa: BLE001 - the reference refuses this input
                expect_refusal(f, c, refusal, hint)
                return
            got = f(*c.args, **c.kwargs)
            if not matches(got, want, **tol):
                for m in exercise.mistakes:
                    try:
                        wrong = m.wrong(*c.args, **c.kwargs)
                    except Exception:  # noqa: BLE001 - a mistake that cannot run matches nothing
                        continue
                    if matches(got, wrong, **tol):
                        raise Mismatch(m.message)
            try:
                expect_result(got, want, "your result", **tol)
            except Mismatch as e:
                raise Mismatch(f"{e}{hint}") from None
        return run

    return run_check(exercise.name, fn, exercise.reference, [(c.label, case(c))
                                                             for c in exercise.cases])


def expect_refusal(fn: Callable, case: Case, refusal: Exception, hint: str = "") -> None:
    """Where the reference raises, the learner's function must raise the same kind of error
    (a stub's NotImplementedError still means "not implemented yet")."""
    kind = type(refusal)
    try:
        got = fn(*case.args, **case.kwargs)
    except NotImplementedError:
        raise
    except kind:
        return
    except Exception as e:  # noqa: BLE001 - another error than the reference's
        raise Mismatch(f"raise {kind.__name__} here, as the reference does ({refusal}); "
                       f"yours raised {type(e).__name__}: {e}{hint}") from None
    raise Mismatch(f"raise {kind.__name__} here, as the reference does ({refusal}); you "
                   f"returned {fmt(got)}{hint}")


def expect_result(got, want, what: str, **tol) -> None:
    """`got` must be `want` within `tol`, whatever the reference returns: a tensor, a
    number (a one-element tensor for it is fine), a bool, or a tuple, list or dict of them
    (checked entry by entry, the message naming the entry)."""
    if isinstance(want, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(want):
            raise Mismatch(f"{what}: you returned {kind_of(got)}, expected "
                           f"{type(want).__name__} of {len(want)}")
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            expect_result(g, w, f"{what}[{i}]", **tol)
    elif isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            raise Mismatch(f"{what}: you returned {kind_of(got)}, expected a dict with keys "
                           f"{sorted(want, key=str)}")
        for k in want:
            expect_result(got[k], want[k], f"{what}[{k!r}]", **tol)
    elif isinstance(want, bool):
        if isinstance(got, torch.Tensor) and got.numel() == 1 and got.dtype == torch.bool:
            got = bool(got.item())
        if not isinstance(got, bool) or got != want:
            raise Mismatch(f"{what} is {fmt(got)}, expected {want}")
    elif isinstance(want, (int, float)) or (isinstance(want, torch.Tensor) and want.dim() == 0
                                           and isinstance(as_float(got), (int, float))):
        g, w = as_float(got), float(as_float(want))
        if isinstance(g, bool) or not isinstance(g, (int, float)):
            raise Mismatch(f"{what}: you returned {kind_of(got)}, expected a number ({w:g})")
        if not (math.isnan(g) and math.isnan(w)) and not math.isclose(
                g, w, rel_tol=tol.get("rtol", 1e-4), abs_tol=tol.get("atol", 1e-5)):
            raise Mismatch(f"{what} is wrong: yours is {g:.6g}, expected {w:.6g}")
    elif isinstance(want, torch.Tensor):
        expect(got, want, what, **tol)
    else:
        try:
            same = bool(got == want)
        except Exception:  # noqa: BLE001 - a value that cannot be compared is not the reference's
            same = False
        if not same:
            raise Mismatch(f"{what} is {fmt(got)}, expected {fmt(want)}")


def matches(got, want, **tol) -> bool:
    """Whether `expect_result` accepts `got` for `want`."""
    try:
        expect_result(got, want, "", **tol)
    except Mismatch:
        return False
    return True


def close(a, b, atol=1e-5, rtol=1e-4) -> bool:
    if isinstance(b, torch.Tensor):
        if not isinstance(a, torch.Tensor) or a.shape != b.shape:
            return False
        return bool(torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol, equal_nan=True))
    if isinstance(b, float):
        return isinstance(a, (int, float)) and math.isclose(a, b, rel_tol=rtol, abs_tol=atol)
    return a == b


def shape_of(x) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)[:60]


def run_check(name: str, yours: Callable, reference: Callable,
              cases: list[tuple[str, Callable[[Callable], None]]]) -> CheckResult:
    """Run each (description, test) case; the first failing one gives the reason. Every call
    of `yours` is watched: changing an input tensor in place fails the case."""
    label = f"check_{name}"
    status, reason = "passed", ""
    guarded = no_mutation(yours, reference)
    for description, case in cases:
        try:
            case(guarded)
        except NotImplementedError:
            status, reason = "not implemented", "not implemented yet: the notebook carries on " \
                "with the reference"
        except Mismatch as e:
            # a case's message may already begin with its description: say it once
            message = str(e)
            status, reason = "failed", message if message.startswith(f"{description}:") \
                else f"{description}: {message}"
        except Exception as e:
            kind = getattr(e, "type_name", type(e).__name__)
            status, reason = "failed", f"{description}: your function raised {kind}: {e}" \
                if not hasattr(e, "type_name") else f"{description}: your function raised {e}"
        if status != "passed":
            break
    icon = {"passed": "✅", "failed": "❌", "not implemented": "⏳"}[status]
    print(f"{icon} {label}: " + (reason or f"passed {len(cases)} cases"))
    if status == "failed":  # result.use() hands the next cells the reference, not yours
        print(f"   until {label} passes, the cells below run the course's {name}, not yours: "
              "fix it and run this cell again")
    return CheckResult(name, status, reason, yours, reference)


def tensor_args(args, kwargs, names: list[str]) -> list[tuple[str, torch.Tensor]]:
    out = []
    for i, a in enumerate(args):
        label = f"`{names[i]}`" if i < len(names) else f"argument {i + 1}"
        out += [(label, t) for t in flat_tensors(a)]
    for k, v in kwargs.items():
        out += [(f"`{k}`", t) for t in flat_tensors(v)]
    return out


def flat_tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in flat_tensors(v)]
    return []


def no_mutation(fn: Callable, reference: Callable) -> Callable:
    try:
        names = list(inspect.signature(reference).parameters)
    except (TypeError, ValueError):
        names = []

    def call(*args, **kwargs):
        watched = tensor_args(args, kwargs, names)
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


def expect(got, want, what: str, **tol) -> None:
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise Mismatch(f"{what}: you returned {kind_of(got)}, expected a tensor of "
                           f"{shape_of(want)}")
        if got.shape != want.shape:
            raise Mismatch(f"{what} has {shape_of(got)}, expected {shape_of(want)}")
        if got.is_complex() or (got.dtype == torch.bool) != (want.dtype == torch.bool) and \
                want.dtype != torch.bool:
            raise Mismatch(f"{what} has dtype {got.dtype}, expected {want.dtype}")
        if torch.isnan(got).any() and not torch.isnan(want).any():
            raise Mismatch(f"{what} contains NaN where the reference has none")
    if not close(got, want, **tol):
        raise Mismatch(f"{what} is wrong: {difference(got, want, **tol)}")


def kind_of(x) -> str:
    return f"{type(x).__name__} {fmt(x)}" if x is not None else "None"


def difference(got, want, atol=1e-5, rtol=1e-4) -> str:
    """Where and by how much `got` differs from `want`, and a guess at why."""
    if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)):
        return f"yours is {fmt(got)}, expected {fmt(want)}"
    if not (got.is_floating_point() or want.is_floating_point()):  # ids, masks, counts
        bad = got != want
        idx = tuple(int(i) for i in bad.nonzero()[0]) if bad.any() else ()
        return (f"{int(bad.sum())} of {bad.numel()} entries differ; the first at "
                f"[{', '.join(map(str, idx))}]: yours is {got[idx].item()}, expected "
                f"{want[idx].item()}")
    g, w = got.detach().double(), want.detach().double()
    bad = ~torch.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
    idx = tuple(int(i) for i in bad.nonzero()[0]) if bad.any() else ()
    at = f"[{', '.join(map(str, idx))}]" if idx else ""
    n = int(bad.sum())
    msg = (f"{n} of {bad.numel()} entries differ; at {at or 'the value'} yours is "
           f"{g[idx].item():.6g}, expected {w[idx].item():.6g} "
           f"(off by {abs(g[idx] - w[idx]).item():.2g}; tolerance {atol:g} + {rtol:g} x |expected|)")
    cause = cause_of(g, w, atol, rtol) or where_it_differs(g, w, bad, atol, rtol)
    narrow = got.dtype in (torch.float16, torch.bfloat16)
    if narrow and bool((torch.isinf(g) & torch.isfinite(w)).any()):
        cause += (f" ({got.dtype}'s largest finite number is {torch.finfo(got.dtype).max:g}: "
                  "a larger one, such as float32's largest, becomes inf in this dtype; take "
                  "the limits from the tensor's own dtype, torch.finfo(x.dtype))")
    return msg + (f": {cause}" if cause else "")


def where_it_differs(g: torch.Tensor, w: torch.Tensor, bad: torch.Tensor, atol: float,
                     rtol: float) -> str:
    """For a (rows, columns) result, the pattern of the differing entries in words: which rows
    or columns, a shift by one position, each row off by its own constant or factor."""
    if g.dim() != 2 or not bad.any():
        return ""
    rows, cols = bad.any(1), bad.any(0)
    R, C = bad.shape
    if C > 1 and torch.allclose(g[:, 1:], w[:, :-1], rtol=rtol, atol=atol):
        return "yours is the expected one shifted right by one position (yours[:, t] is the " \
            "expected value at t - 1): an off-by-one between a position and the token it predicts?"
    if C > 1 and torch.allclose(g[:, :-1], w[:, 1:], rtol=rtol, atol=atol):
        return "yours is the expected one shifted left by one position (yours[:, t] is the " \
            "expected value at t + 1): an off-by-one between a position and the token it predicts?"
    finite = torch.isfinite(g).all() and torch.isfinite(w).all()
    if finite and R > 1 and int(rows.sum()) > 1:
        offset = (g - w).median(1, keepdim=True).values
        if torch.allclose(g, w + offset, rtol=rtol, atol=atol):
            return "each differing row is off by a constant of its own (a per-row " \
                "normaliser: a log-softmax over the wrong dimension or with the wrong " \
                "temperature, a per-row mean?)"
        nz = w.abs() > 1e-8
        if nz.all():
            factor = (g / w).median(1, keepdim=True).values
            if torch.allclose(g, w * factor, rtol=rtol, atol=atol):
                return "each differing row is off by a factor of its own (a per-row " \
                    "normaliser: its length, its count of tokens, its loss_type weight?)"
    if int(rows.sum()) < R:
        which = [int(i) for i in rows.nonzero().flatten()]
        return (f"only row{'s' if len(which) > 1 else ''} {_listed(which)} of {R} differ"
                f"{'s' if len(which) == 1 else ''}; the other rows match")
    if int(cols.sum()) < C:
        which = [int(i) for i in cols.nonzero().flatten()]
        return (f"in every row, only column{'s' if len(which) > 1 else ''} {_listed(which)} "
                f"of {C} differ{'s' if len(which) == 1 else ''}; the others match")
    return ""  # every row and column: the checker's case says what the entries are


UPDATE_ENTRIES = 10_000  # a 1-D result this long is a model's parameters (or their update)


def update_words(g: torch.Tensor, w: torch.Tensor) -> str:
    """Two parameter updates (flat vectors) compared as vectors: their sizes and directions."""
    finite = torch.isfinite(g) & torch.isfinite(w)
    if not finite.all():
        return ""
    g_norm, w_norm = g.norm().item(), w.norm().item()
    if g_norm == 0.0:
        return "yours did not change the parameters at all (no optimizer step, or the " \
            "gradients cleared before it?)"
    if w_norm == 0.0:
        return "the parameters must not change here, and yours moved them"
    cosine = (g @ w).item() / (g_norm * w_norm)
    size = f"{g_norm / w_norm:.4f} x the size of the expected one"
    if cosine > 0.999 and abs(g_norm / w_norm - 1) < 0.01:
        return (f"yours is close to the expected update (cosine {cosine:.5f}; {size}) but "
                "beyond rounding: a small change in the advantages or the log-probs (the "
                "std's unbiased flag, an epsilon, a temperature in one forward but not the "
                "other?)")
    if cosine > 0.999:
        return f"yours points the same way but is {size} (a scale: the loss's weighting, " \
            "the gradient clipping, the learning rate?)"
    if cosine < -0.999:
        return f"yours points the opposite way ({size}): a sign in the loss?"
    return (f"yours points another way (cosine {cosine:.2f} with the expected update; {size}): "
            "a different loss, different advantages or log-probs, or different samples")


def norm_words(norm, grads: list[torch.Tensor]) -> str:
    """Which wrong norm of `grads` the learner's `norm` is, in words; "" where none is."""
    if not isinstance(norm, (int, float)) or isinstance(norm, bool) or not grads:
        return ""
    per_tensor = [g.detach().double().norm().item() for g in grads]
    flat = torch.cat([g.detach().double().flatten() for g in grads])
    total = math.sqrt(sum(n * n for n in per_tensor))
    wrong = {
        "the sum of the per-tensor norms; the global norm is sqrt of the sum of their "
        "squares": sum(per_tensor),
        "the squared norm: take the square root": total ** 2,
        "the largest entry's size (the inf-norm); grad_norm is the 2-norm over every "
        "entry": flat.abs().max().item(),
        "the root mean square of the entries: sum the squares, do not average them":
            flat.pow(2).mean().sqrt().item(),
        "the largest per-tensor norm; the global norm takes every tensor": max(per_tensor),
    }
    for words, value in wrong.items():
        if not math.isclose(value, total, rel_tol=1e-4) and math.isclose(norm, value,
                                                                          rel_tol=1e-4):
            return f"yours ({norm:.6g}) is {words}; expected {total:.6g}"
    return ""


def _listed(indices: list[int], most: int = 8) -> str:
    shown = ", ".join(map(str, indices[:most]))
    return shown + (f" and {len(indices) - most} more" if len(indices) > most else "")


def cause_of(g: torch.Tensor, w: torch.Tensor, atol: float, rtol: float) -> str:
    blown = ~torch.isfinite(g) & torch.isfinite(w)
    if blown.any():
        return (f"{int(blown.sum())} of yours are inf or NaN where the expected values are "
                "finite: an overflow (exp of a large number) or a log of 0 on the way?")
    lost = torch.isinf(w) & (g != w)  # an infinity the reference keeps (or makes)
    if lost.any():
        idx = tuple(int(i) for i in lost.nonzero()[0])
        at = f"[{', '.join(map(str, idx))}]"
        return (f"where the expected value is {w[idx].item():g} ({int(lost.sum())} of them, "
                f"the first at {at}), yours is {g[idx].item():.6g}: that infinity must stay "
                "(or be made) as the reference has it, not replaced by a number")
    finite = torch.isfinite(g) & torch.isfinite(w)
    if not finite.any():
        return ""
    if g.dim() == 1 and g.numel() >= UPDATE_ENTRIES and finite.all():
        return update_words(g, w)
    g, w = g[finite], w[finite]
    if torch.allclose(g, -w, rtol=rtol, atol=atol) and w.abs().max() > atol:
        return "yours has the opposite sign everywhere"
    nz = w.abs() > 1e-8
    if nz.any():
        ratio = g[nz] / w[nz]
        k = ratio.median()
        if torch.allclose(g, w * k, rtol=rtol, atol=atol) and abs(k.item() - 1) > 1e-3:
            if abs(k.item()) < 1e-3:
                return (f"yours is about 0 everywhere ({k.item():.2g} x the expected value): "
                        "the part that carries it is missing (a detach() or no_grad where "
                        "it must flow, a factor of 0?)")
            return f"yours is {k.item():.4g} x the expected value everywhere (a wrong " \
                "normaliser or a missing factor?)"
    d = (g - w).median()
    if torch.allclose(g, w + d, rtol=rtol, atol=atol) and abs(d.item()) > atol:
        return f"yours is off by a constant {d.item():.4g} everywhere"
    rel = ((g - w).abs() / w.abs().clamp(min=1e-12)).max().item()
    if rel < 1e-2:
        return "close but not equal: rounding? (compute in float32 and do not round)"
    return ""


def fmt(x) -> str:
    if isinstance(x, torch.Tensor):
        flat = x.detach().flatten()[:6].tolist()
        return f"{[round(v, 4) if isinstance(v, float) else v for v in flat]}" + (
            "..." if x.numel() > 6 else "")
    return repr(x)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def requires_grad(out, what: str, wrt: str = "logp") -> None:
    if not isinstance(out, torch.Tensor):
        return
    if not out.requires_grad:
        raise Mismatch(f"{what} carries no gradient with respect to {wrt}: did you .detach() "
                       "it, compute it under torch.no_grad(), or go through .item()/numpy? "
                       "Training could not learn from it")


def grad_of(out: torch.Tensor, leaf: torch.Tensor, upstream: torch.Tensor, what: str):
    try:
        (g,) = torch.autograd.grad(out, leaf, upstream, allow_unused=True)
    except RuntimeError as e:
        raise Mismatch(f"the gradient of {what} could not be computed through your function "
                       f"({str(e)[:120]})") from None
    return torch.zeros_like(leaf) if g is None else g


STEP_TOL = dict(atol=1e-6, rtol=1e-4)


@contextlib.contextmanager
def patched(module, **names):
    old = {k: getattr(module, k) for k in names}
    for k, v in names.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


def which_mistake(got: torch.Tensor, mistakes: tuple[Mistake, ...],
                  run_wrong: Callable) -> str | None:
    """The message of the known mistake whose result matches `got`, if one does.
    `run_wrong(wrong)` runs one mistake's function on the case at hand."""
    for mistake in mistakes:
        try:
            want = run_wrong(mistake.wrong)
        except Exception:  # noqa: BLE001 - a mistake that cannot run on this case matches nothing
            continue
        if isinstance(want, torch.Tensor) and want.shape == got.shape and torch.allclose(
                got.double(), want.double(), equal_nan=True, **STEP_TOL):
            return mistake.message
    return None


def compare(got, want, what: str, mistakes: tuple[Mistake, ...], run_wrong: Callable) -> None:
    """`got` must equal `want`; where it does not, name the mistake that gives `got`."""
    if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and \
            got.shape == want.shape and torch.allclose(got.double(), want.double(), **STEP_TOL):
        return
    if isinstance(got, torch.Tensor) and got.shape == want.shape:
        named = which_mistake(got, mistakes, run_wrong)
        if named:
            raise Mismatch(f"{what} differs from the reference: {named}")
    expect(got, want, what, **STEP_TOL)


def as_float(x):
    """A one-element tensor or a numpy scalar as a Python float; anything else unchanged."""
    if isinstance(x, bool):
        return x
    if isinstance(x, torch.Tensor) and x.numel() == 1 and not x.is_complex():
        return float(x.detach())
    if not isinstance(x, (int, float)) and hasattr(x, "item") and getattr(x, "size", 0) == 1:
        try:
            return float(x.item())
        except (TypeError, ValueError):
            return x
    return float(x) if isinstance(x, int) else x


def same_value(got, want) -> bool:
    """`got` is a tensor equal to `want` (a wrong answer the checker knows)."""
    return isinstance(got, torch.Tensor) and got.shape == want.shape and close(got, want)


# --- comparing with the reference and the known mistakes ---------------------------------------
def same(got, want) -> bool:
    return isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and \
        got.shape == want.shape and torch.allclose(got.double(), want.double(), equal_nan=True,
                                                   **STEP_TOL)


def compare_all(got, want, what: str, mistakes: tuple[Mistake, ...], run_wrong: Callable,
                unnamed: Callable[[], None] | None = None) -> None:
    """`got` must equal `want`; where it does not, name every known mistake whose function
    gives `got` (two mistakes can leave the same numbers: both are named); where none does,
    `unnamed()` may raise a more precise Mismatch before the generic one."""
    if same(got, want):
        return
    if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and \
            got.shape == want.shape:
        named = []
        for mistake in mistakes:
            try:
                result = run_wrong(mistake.wrong)
            except Exception:  # noqa: BLE001 - a mistake that cannot run here matches nothing
                continue
            if same(got, result):
                named.append(mistake.message)
        if named:
            raise Mismatch(f"{what} differ from the reference: " + "; or ".join(named))
    if unnamed is not None:
        unnamed()
    expect(got, want, what, **STEP_TOL)


def number(x) -> float:
    """A returned flag or count as a float; anything else (None, a tuple) as -1."""
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        x = x.item()
    return float(x) if isinstance(x, (bool, int, float)) else -1.0
