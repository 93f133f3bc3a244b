"""Notebook 00, setup and diagnostics: the checks of its exercises, and each exercise as
data in `EXERCISES`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...models import count_parameters
from .base import CheckResult, Exercise, Mismatch, expect, run_check


class Tied(torch.nn.Module):
    """An embedding and an output layer that share one weight, as GPT-2's wte and lm_head."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight


TIED_TWICE = ("the shared weight is counted twice: an output layer tied to the embedding (as "
              "GPT-2's lm_head and wte) is one tensor under two names, and state_dict() or "
              "named_parameters(remove_duplicate=False) list it under both; "
              "model.parameters() lists each tensor once")


def check_count_parameters(fn: Callable) -> CheckResult:

    def case(f, model):
        got, want = f(model), count_parameters(model)
        if isinstance(model, Tied) and got == want + model.embed.weight.numel():
            raise Mismatch(TIED_TWICE)
        expect(got, want, "the count")

    lin = torch.nn.Linear(3, 4)
    frozen = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 5, bias=False))
    frozen[0].requires_grad_(False)  # frozen weights are still parameters
    return run_check("count_parameters", fn, count_parameters, [
        ("a 3 -> 4 linear layer (weights and bias)", lambda f: case(f, lin)),
        ("a model with a frozen layer", lambda f: case(f, frozen)),
        ("an output layer tied to the embedding (one weight, two names)",
         lambda f: case(f, Tied())),
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
            if isinstance(model, Tied) and got == want + 4 * model.embed.weight.numel() * \
                    model.embed.weight.element_size():
                raise Mismatch(f"{what}: {TIED_TWICE}")
            if got == ref_float32(model) != want:
                raise Mismatch(f"{what}: not every tensor is float32: use p.element_size(), "
                               "the bytes of one entry")
            expect(got, want, f"{what}: the bytes")
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
        ("an output layer tied to the embedding", case(Tied(), "a tied weight")),
    ])


# --- the notebook's exercises, in its order -------------------------------------------------
EXERCISES = (
    Exercise('count_parameters', count_parameters, check_count_parameters),
    Exercise('training_state_bytes', reference_training_state_bytes, check_training_state_bytes),
)
