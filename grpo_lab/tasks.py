"""The course task: two-number addition with a verifiable reward.

A prompt is "a+b=" with 0 <= a, b <= 99 (4 to 6 characters, so batches have prompts of
different lengths); the right completion is the sum followed by end-of-text. The reward
is checked, not learned: 1.0 when the completion, stripped of spaces, is exactly the sum
*and* it ended with end-of-text; else 0.0. A completion cut off at max_new_tokens
("12   " with no end-of-text) has not given an answer and scores 0.

Reward functions follow TRL's signature: `reward_fn(completions, **columns) -> list[float]`,
one float per completion, where `columns` carries the dataset's other fields (`answer`)
and, from this course's trainer, `truncated`: one bool per completion, True where it hit
max_new_tokens without end-of-text.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

RewardFn = Callable[..., Sequence[float]]

MAX_OPERAND = 99
EVAL_SEED = 10_000  # the held-out set is drawn from its own stream and excluded from training


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def make_problem(a: int, b: int) -> Problem:
    return Problem(prompt=f"{a}+{b}=", answer=str(a + b))


def all_pairs() -> list[tuple[int, int]]:
    return [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]


def eval_problems(n: int = 256) -> list[Problem]:
    """The fixed held-out set: the same n problems on every machine and every run."""
    pairs = all_pairs()
    random.Random(EVAL_SEED).shuffle(pairs)
    return [make_problem(a, b) for a, b in pairs[:n]]


class ProblemStream:
    """Training problems, drawn with a seeded RNG, never from the held-out set."""

    def __init__(self, seed: int, held_out: int = 256):
        pairs = all_pairs()
        random.Random(EVAL_SEED).shuffle(pairs)
        self.pairs = pairs[held_out:]
        self.rng = random.Random(seed)

    def sample(self, n: int) -> list[Problem]:
        return [make_problem(*self.rng.choice(self.pairs)) for _ in range(n)]

    def state(self) -> object:
        return self.rng.getstate()

    def set_state(self, state: object) -> None:
        self.rng.setstate(_as_tuple(state))


def _as_tuple(x: object) -> object:
    # random.setstate needs tuples; a JSON/pickle round trip may have produced lists
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def addition_reward(completions: Sequence[str], answer: Sequence[str],
                    truncated: Sequence[bool] | None = None, **_: object) -> list[float]:
    """1.0 where the completion (stripped of spaces) is exactly the answer and was not
    truncated (it ended with end-of-text), else 0.0. `truncated` None: none was."""
    truncated = [False] * len(completions) if truncated is None else truncated
    return [1.0 if c.strip() == a and not cut else 0.0
            for c, a, cut in zip(completions, answer, truncated, strict=True)]


class RewardError(ValueError):
    """A reward function broke its contract (wrong length, non-numbers, NaN)."""


def _call_with_timeout(fn: Callable, timeout: float | None, *args, **kwargs):
    """fn(*args, **kwargs), or RewardError when it has not returned within `timeout` s.
    (A thread cannot be killed: a hung call keeps its daemon thread, the run stops.)"""
    if timeout is None:
        return fn(*args, **kwargs)
    box: dict = {}

    def target():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller below
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        name = getattr(fn, "__name__", type(fn).__name__)
        raise RewardError(
            f"reward function {name!r} did not return within reward_timeout={timeout:g} s"
        )
    if "error" in box:
        raise box["error"]
    return box["value"]


def checked_rewards(reward_fn: RewardFn, completions: list[str], timeout: float | None = None,
                    **columns) -> list[float]:
    """Call `reward_fn` and refuse anything the trainer must not learn from: an exception,
    a hang past `timeout`, the wrong number of rewards, a non-number or NaN/inf."""
    name = getattr(reward_fn, "__name__", type(reward_fn).__name__)
    try:
        rewards = list(_call_with_timeout(reward_fn, timeout, completions, **columns))
    except RewardError:
        raise
    except Exception as e:
        raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
    if len(rewards) != len(completions):
        raise RewardError(
            f"reward function {name!r} returned {len(rewards)} rewards for "
            f"{len(completions)} completions; it must return one float per completion"
        )
    for i, r in enumerate(rewards):
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
            raise RewardError(
                f"reward function {name!r} returned {r!r} for completion {i} "
                f"({completions[i]!r}); rewards must be finite numbers"
            )
    return [float(r) for r in rewards]
