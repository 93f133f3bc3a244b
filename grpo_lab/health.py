"""Parameter health checks, snapshots and rollback.

The failure chain in report 000: a huge gradient -> NaN/inf parameters -> NaN logits ->
a sampling crash one step later. Counting non-finite parameters after every update finds
the corruption at the step it happens; a snapshot of the last healthy state undoes it.
"""

from __future__ import annotations

import copy
from collections import Counter

import torch


def nonfinite_count(tensors) -> int:
    """Number of NaN/inf entries over an iterable of tensors (None entries ignored)."""
    total = None
    for t in tensors:
        if t is None:
            continue
        bad = (~torch.isfinite(t)).sum()
        total = bad if total is None else total + bad
    return 0 if total is None else int(total)


def nonfinite_params(model: torch.nn.Module) -> int:
    return nonfinite_count(p.detach() for p in model.parameters())


def all_finite(model: torch.nn.Module) -> bool:
    """True when no parameter has a NaN/inf, from one norm per tensor (a single foreach
    kernel): NaN/inf make the norm NaN/inf. False can also mean a finite norm too large
    for float32; the exact count (nonfinite_params) then decides."""
    with torch.no_grad():
        norms = torch._foreach_norm(list(model.parameters()))
    return bool(torch.isfinite(torch.stack(norms)).all())


def first_nonfinite(named_tensors) -> str | None:
    """Name, shape and NaN/inf counts of the first tensor with a non-finite entry."""
    for name, t in named_tensors:
        if t is None:
            continue
        t = t.detach()
        if not torch.isfinite(t).all():
            n_nan, n_inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            return f"{name} {tuple(t.shape)}: {n_nan} NaN, {n_inf} inf of {t.numel()}"
    return None


def first_nonfinite_param(model: torch.nn.Module) -> str | None:
    return first_nonfinite(model.named_parameters())


def first_nonfinite_grad(model: torch.nn.Module) -> str | None:
    return first_nonfinite((n, p.grad) for n, p in model.named_parameters())


def cloned(state):
    """copy.deepcopy(state), faster on an optimizer's state dict (3.5 -> 0.9 ms on the tiny
    model's, every snapshot_every steps): a plain tensor that needs no gradient and shares
    its memory with no other tensor of the state is cloned up front and handed to deepcopy
    in its memo, so deepcopy's slow per-tensor copy runs only for the rest; deepcopy's walk
    keeps the rest of what it keeps (a tensor or container met twice copied once, views of
    one storage sharing a copy, a Parameter's type, a namedtuple's)."""
    tensors = {id(t): t for t in _tensors(state)}  # each tensor once
    sharing = Counter(t.untyped_storage().data_ptr() for t in tensors.values())
    memo = {i: t.clone() for i, t in tensors.items()  # dense tensors keep their strides
            if type(t) is torch.Tensor and not t.requires_grad and t.numel()
            and sharing[t.untyped_storage().data_ptr()] == 1}
    return copy.deepcopy(state, memo)


def _tensors(x):
    """Every tensor in nested dicts, lists and tuples (deepcopy's walk goes further; a
    tensor found only there is copied by deepcopy itself)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)


class Snapshot:
    """A copy of model and optimizer state, kept in memory for rollback."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int):
        self.step = step
        self.model_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.optimizer_state = cloned(optimizer.state_dict())

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        model.load_state_dict(self.model_state)
        optimizer.load_state_dict(cloned(self.optimizer_state))
