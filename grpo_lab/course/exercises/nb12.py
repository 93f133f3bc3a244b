"""Notebook 12, scale out and trl: the checks of its exercises, and each exercise as
data in `EXERCISES`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...distributed import World, shard
from ...objective import (
    token_weights,
)
from .base import CheckResult, Exercise, Mismatch, expect, gen, run_check


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
                    got = list(got)
                    first = next(i for i in range(max(len(got), len(want)))
                                 if got[i:i + 1] != want[i:i + 1])
                    diff = (f"{len(got)} rows, expected {len(want)}; the first that differs is "
                            f"entry {first}")
                    raise Mismatch(f"{prompts} prompts x G={group_size} on {world_size} ranks, "
                                   f"rank {rank}: you returned rows {got[:8]}"
                                   f"{'...' if len(got) > 8 else ''}, expected {want[:8]}"
                                   f"{'...' if len(want) > 8 else ''} ({diff})"
                                   + (f"; {hint}" if hint else ""))
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


def reference_rank_token_weights(completion_mask, loss_type: str, max_completion_length: int,
                                 global_rows: int, global_tokens: float):
    """objective.token_weights of one rank's rows, normalised over the global batch."""
    return token_weights(completion_mask, loss_type, max_completion_length,
                                   n_sequences=global_rows, n_tokens=global_tokens)


def check_rank_token_weights(fn: Callable) -> CheckResult:
    ref = reference_rank_token_weights
    g = gen(12)

    def case(loss_type, rows, world, cap=5, row_lengths=None):
        def run(f):
            lengths = torch.randint(0, 6, (rows * world,), generator=g) if row_lengths is None \
                else row_lengths
            mask = (torch.arange(5)[None] < lengths[:, None]).long()  # (rows * world, 5)
            total = float(mask.sum())
            whole = token_weights(mask, loss_type, cap)
            parts = []
            for r in range(world):
                local = mask[r * rows:(r + 1) * rows]
                got = f(local, loss_type, cap, rows * world, total)
                expect(got, ref(local, loss_type, cap, rows * world, total),
                        f"rank {r}'s weights ({loss_type}, {world} ranks, "
                        f"max_completion_length {cap}, row lengths {lengths.tolist()})")
                parts.append(got)
            expect(torch.cat(parts), whole, "the ranks' weights put together (they must be "
                    "the one-process weights)")
        return run

    def unknown(f):
        try:
            got = f(torch.ones(2, 5, dtype=torch.long), "sum", 5, 4, 10.0)
        except ValueError:
            return
        raise Mismatch(f"loss_type='sum' returned {type(got).__name__}; raise ValueError for a "
                       "loss_type you do not know (as token_weights does)")

    return run_check("rank_token_weights", fn, ref, [
        (f"{t}, {w} ranks of {r} rows", case(t, r, w))
        for t, r, w in (("grpo", 3, 2), ("dr_grpo", 2, 3), ("bnpo", 4, 2), ("dapo", 3, 2))] + [
        ("grpo with empty rows", case("grpo", 2, 2, row_lengths=torch.tensor([3, 0, 0, 2]))),
        ("dr_grpo with a cap of 8 above the batch's 5 columns", case("dr_grpo", 2, 2, cap=8)),
        ("an unknown loss_type", unknown)])


# --- the notebook's exercises, in its order -------------------------------------------------
EXERCISES = (
    Exercise('shard_rows', reference_shard_rows, check_shard_rows),
    Exercise('rank_token_weights', reference_rank_token_weights, check_rank_token_weights),
)
