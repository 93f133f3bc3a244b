"""Notebook 02, rewards and advantages: the checks of its exercises, and each exercise as
data in `EXERCISES`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ... import objective
from ...objective import group_advantages
from .base import CheckResult, Exercise, Mismatch, close, expect, fmt, gen, run_check, same_value


def check_group_advantages(fn: Callable) -> CheckResult:
    ref = objective.group_advantages

    def case(rewards, g, **kw):
        def run(f):
            got = f(rewards.clone(), g, **kw)
            want = ref(rewards, g, **kw)
            if isinstance(got, torch.Tensor) and torch.isnan(got).any():
                raise Mismatch("your advantages are NaN when every reward in a group is "
                               "equal: divide by (std + advantage_eps)")
            n = rewards.numel()
            if isinstance(got, torch.Tensor) and got.shape == want.shape and n // g != g:
                chunks = ref(rewards, n // g, **kw)  # G groups of B/G consecutive rewards
                columns = ref(rewards.view(g, -1).T.reshape(-1), g, **kw).view(-1, g).T
                for theirs, how in ((chunks, f"G groups of B/G = {n // g} consecutive rewards"),
                                    (columns.reshape(-1), "groups of every B/G-th reward (the "
                                     "columns of rewards.view(G, -1))")):
                    if close(got, theirs):
                        raise Mismatch(f"your groups are {how}; a group is G = {g} "
                                       "consecutive rewards: rewards.view(-1, G), a row per "
                                       "group, and the statistics over dim 1")
            if isinstance(got, torch.Tensor) and got.shape == want.shape:
                grouped = got.view(-1, g).sum(-1)
                if grouped.abs().max() > 1e-4 and want.view(-1, g).sum(-1).abs().max() < 1e-4:
                    raise Mismatch("your advantages do not sum to 0 within each group: "
                                   "subtract each group's own mean, not the batch mean")
            if isinstance(got, torch.Tensor) and got.shape == want.shape and \
                    kw.get("scale_rewards", True) and not close(got, want):
                grouped = rewards.view(-1, g)
                centred = grouped - grouped.mean(dim=1, keepdim=True)
                eps = kw.get("advantage_eps", 1e-4)
                population = (centred / (grouped.std(dim=1, correction=0, keepdim=True) + eps))
                floored = centred / grouped.std(dim=1, keepdim=True).clamp(min=eps)
                if close(got, population.reshape(-1)):
                    raise Mismatch(f"for rewards {rewards.tolist()} you divided by the "
                                   "population std (over G): GRPO, like TRL, uses the sample "
                                   "std with Bessel's correction, over G - 1, torch's default "
                                   "`std()`")
                if close(got, floored.reshape(-1)):
                    raise Mismatch(f"for rewards {rewards.tolist()} your mixed groups were "
                                   "divided by their std without advantage_eps added (no eps, "
                                   "an eps far smaller than the default 1e-4, or eps as a "
                                   "floor, `clamp(min=eps)`): divide by std + advantage_eps, "
                                   "so every group's scale moves by the same eps")
            expect(got, want, f"advantages for rewards {rewards.tolist()}")
        return run

    rnd = torch.rand(12, generator=gen(3))
    return run_check("group_advantages", fn, ref, [
        ("one group all equal, one mixed (G=4)",
         case(torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 1]), 4)),
        ("random rewards, G=4", case(rnd, 4)),
        ("binary rewards, G=4", case(torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0]), 4)),
        ("scale_rewards=False only centres", case(rnd, 3, scale_rewards=False)),
        ("a larger advantage_eps", case(rnd, 6, advantage_eps=0.5)),
    ])


def reference_rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) rewards, consecutive groups of `group_size` >= 2 -> (B,) advantages.

    REINFORCE leave-one-out (RLOO; Ahmadian et al. 2024, TRL's RLOOTrainer): each reward
    minus the mean of the *other* G - 1 rewards of its group,
    A_i = r_i - (sum_j r_j - r_i) / (G - 1) = G / (G - 1) * (r_i - mean(group)).
    The advantages of a group sum to 0; an all-equal group gets 0.
    """
    if group_size < 2 or rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} >= 2 "
                         f"entries (got shape {tuple(rewards.shape)})")
    grouped = rewards.view(-1, group_size)  # (n_groups, G)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others).reshape(-1)


def check_rloo_advantages(fn: Callable) -> CheckResult:
    ref = reference_rloo_advantages

    def case(rewards, g):
        def run(f):
            got = f(rewards.clone(), g)
            want = ref(rewards, g)
            grouped = rewards.view(-1, g)
            centred = (grouped - grouped.mean(1, keepdim=True)).reshape(-1)
            if same_value(got, centred) and not close(centred, want):
                raise Mismatch(
                    "you included each sample in its own baseline: r - mean(group) is "
                    f"GRPO's centring, (G-1)/G = {(g - 1) / g:.3g} times RLOO's advantage. "
                    "Subtract the mean of the *other* G - 1 rewards: (group sum - r) / (G - 1)")
            scaled = objective.group_advantages(rewards, g)
            if same_value(got, scaled) and not close(scaled, want):
                raise Mismatch("this is GRPO's advantage, divided by the group's std; "
                               "RLOO only subtracts the leave-one-out mean")
            by_g = (grouped - (grouped.sum(1, keepdim=True) - grouped) / g).reshape(-1)
            if same_value(got, by_g) and not close(by_g, want):
                raise Mismatch("you divided the other rewards' sum by G; there are "
                               "G - 1 of them")
            if isinstance(got, torch.Tensor) and got.shape == want.shape and \
                    got.is_floating_point():
                sums = got.detach().double().view(-1, g).sum(-1)
                if sums.abs().max() > 1e-4:
                    raise Mismatch("your advantages do not sum to 0 within each group "
                                   f"(sums {fmt(sums)}); the groups are consecutive, "
                                   "rewards.view(-1, group_size), and each reward's baseline "
                                   "is the mean of the others in its own group")
            expect(got, want, f"RLOO advantages for rewards {fmt(rewards)}, G={g}")
        return run

    rnd = torch.rand(12, generator=gen(11))
    return run_check("rloo_advantages", fn, ref, [
        ("binary rewards, G=4", case(torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0]), 4)),
        ("G=2: each advantage is the difference of the pair",
         case(torch.tensor([1.0, 0.0, 0.3, 0.9, 0.5, 0.5]), 2)),
        ("random rewards, G=4 (sum to 0 per group)", case(rnd, 4)),
        ("random rewards, G=3", case(rnd, 3)),
        ("an all-equal group gives 0, not NaN (no std is involved), G=4",
         case(torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 0]), 4)),
        ("one right answer in G=8", case(torch.tensor([1.0] + [0.0] * 7), 8)),
    ])


def reference_zero_std_group_filter(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) rewards, consecutive groups -> (B,) bool mask, True on every row of a group whose
    rewards are not all equal (DAPO's dynamic sampling keeps only those groups; the others
    have advantage 0 and carry no signal).

    Equality is exact (max == min). `std() > 0` can call an all-equal group mixed: the
    float32 mean of eight 0.7s need not be exactly 0.7, and torch on CPU gives
    `torch.full((1, 8), 0.7).std(dim=1)` = 6e-8. A group of one (G = 1) has nothing to
    compare with, so it is all-equal by definition and G = 1 keeps nothing.
    """
    grouped = rewards.view(-1, group_size)  # (n_groups, G)
    mixed = grouped.amax(dim=1) != grouped.amin(dim=1)  # (n_groups,)
    return mixed.repeat_interleave(group_size)


def check_zero_std_group_filter(fn: Callable) -> CheckResult:
    ref = reference_zero_std_group_filter

    def case(rewards, g):
        def run(f):
            got = f(rewards.clone(), g)
            want = ref(rewards, g)
            n_groups = rewards.numel() // g
            what = f"rewards {fmt(rewards)}, G={g}"
            if isinstance(got, torch.Tensor) and got.shape == (n_groups,) and n_groups != len(want):
                raise Mismatch(f"{what}: you returned one entry per group, shape ({n_groups},); "
                               f"return one per row, ({rewards.numel()},): each group's verdict "
                               "repeated for its G rows (repeat_interleave)")
            if isinstance(got, torch.Tensor) and got.shape == want.shape and \
                    got.dtype != torch.bool:
                raise Mismatch(f"{what}: return a bool mask (dtype {got.dtype} given): "
                               "rewards[mask] with a 0/1 integer tensor picks rows 0 and 1 "
                               "instead of masking")
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                expect(got, want, f"{what}: the mask")
            if torch.equal(got, want):
                return
            grouped = rewards.view(-1, g)
            if torch.equal(got, ~want) and want.any():
                raise Mismatch(f"{what}: you kept the groups whose rewards are all equal; keep "
                               "the others (True = the group has signal)")
            if g == 1:
                raise Mismatch(f"{what}: with G=1 you kept rows; a group of one has nothing to "
                               "compare with (its advantage is 0), so G=1 keeps nothing")
            if torch.equal(got, (grouped.std(dim=1) > 0).repeat_interleave(g)):
                raise Mismatch(f"{what}: std() > 0 called a group of equal float rewards "
                               "mixed: rounding in the float32 mean left its std slightly "
                               "above 0; compare the values themselves (max == min)")
            right = (grouped == 1).all(dim=1).repeat_interleave(g)
            if torch.equal(got, want | right):
                raise Mismatch(f"{what}: you kept a group whose rewards are all 1; an "
                               "all-right group has zero spread too, like an all-wrong one, "
                               "and carries no signal")
            if torch.equal(got, (grouped != grouped[:, :1]).any(1).repeat(g)):
                raise Mismatch(f"{what}: rows in the wrong order; the groups are consecutive, "
                               "so repeat each verdict with repeat_interleave, not repeat")
            if got.dtype == torch.bool:  # the first group whose verdict is wrong, in words
                verdicts = got.view(-1, g)
                wrong = [i for i in range(len(grouped))
                         if not bool((verdicts[i] == want.view(-1, g)[i]).all())]
                i = wrong[0]
                spread = (grouped[i].max() - grouped[i].min()).item()
                if bool(want.view(-1, g)[i, 0]) and not bool(verdicts[i].any()):
                    raise Mismatch(f"{what}: group {i}'s rewards differ (by {spread:.3g}) and "
                                   "you dropped it; any difference is signal, however small: "
                                   "compare max and min exactly, with no tolerance")
                if not bool(want.view(-1, g)[i, 0]) and bool(verdicts[i].all()):
                    raise Mismatch(f"{what}: group {i}'s rewards are all equal "
                                   f"({grouped[i, 0].item():g}) and you kept it; a std or a "
                                   "spread tested against a threshold depends on the rewards' "
                                   "size (float32's std of equal values is not always 0): "
                                   "compare max and min exactly")
            expect(got, want, f"{what}: the mask")
        return run

    return run_check("zero_std_group_filter", fn, ref, [
        ("mixed, all-right and all-wrong groups, G=4",
         case(torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0]), 4)),
        ("every group all-equal: nothing kept",
         case(torch.tensor([0.0, 0, 0, 1, 1, 1]), 3)),
        ("every group mixed: everything kept", case(torch.tensor([0.0, 1, 1, 0, 0.5, 0.5]), 2)),
        ("partial-credit rewards: one group of eight equal 0.7s",
         case(torch.tensor([0.7] * 8), 8)),
        ("partial-credit rewards, two groups", case(torch.tensor([0.7] * 7 + [0.2] + [0.3] * 8),
                                                    8)),
        ("G=1 keeps nothing", case(torch.tensor([1.0, 0.0, 1.0]), 1)),
        ("one group of 5", case(torch.tensor([0.0, 0, 0, 0, 1]), 5)),
        ("large equal rewards: seven 3333.333s (float32's std of them is 5e-4)",
         case(torch.tensor([3333.333] * 7), 7)),
        ("rewards that differ by 1e-7: still a signal",
         case(torch.tensor([0.0, 1e-7, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]), 4)),
    ])


# --- the notebook's exercises, in its order -------------------------------------------------
EXERCISES = (
    Exercise('group_advantages', group_advantages, check_group_advantages),
    Exercise('rloo_advantages', reference_rloo_advantages, check_rloo_advantages),
    Exercise('zero_std_group_filter', reference_zero_std_group_filter, check_zero_std_group_filter),
)
