"""Parameter health checks, snapshots and rollback.

The failure chain in report 000: a huge gradient -> NaN/inf parameters -> NaN logits ->
a sampling crash one step later. Counting non-finite parameters after every update finds
the corruption at the step it happens; a snapshot of the last healthy state undoes it.
"""

from __future__ import annotations

import copy

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
    """A copy of a state dict: its tensors cloned, its dicts, lists and tuples rebuilt, any
    other value deep-copied. copy.deepcopy gives the same and costs ~5x as much on an
    optimizer's state (its generic walk over every tensor), every snapshot_every steps."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if type(state) is dict:
        return {k: cloned(v) for k, v in state.items()}
    if type(state) in (list, tuple):
        return type(state)(cloned(v) for v in state)
    return copy.deepcopy(state)


class Snapshot:
    """A copy of model and optimizer state, kept in memory for rollback."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int):
        self.step = step
        self.model_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.optimizer_state = cloned(optimizer.state_dict())

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        model.load_state_dict(self.model_state)
        optimizer.load_state_dict(cloned(self.optimizer_state))
