"""Notebook 10, fix safe sampling: the checks of its exercises, and each exercise as
data in `EXERCISES`."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from ...sampling import (
    MULTINOMIAL_ERROR,
    completion_mask_from_ids,
)
from .. import steps
from .base import CheckResult, Exercise, Mismatch, expect, gen, run_check
from .base import same as same_values
from .fixtures import drive, drive_sample, tiny_model


def check_sanitize_logits(fn: Callable) -> CheckResult:
    ref = steps.sanitize_logits

    def same(scores, what):
        def case(f):
            expect(f(scores.clone()), ref(scores), what)
        return case

    def refuses(scores, what, names_the_count=False):
        def case(f):
            try:
                f(scores.clone())
            except ValueError as e:
                bad = int((~torch.isfinite(scores).any(-1)).sum())
                if names_the_count and not re.search(rf"(?<![0-9.]){bad}(?![0-9.])", str(e)):
                    raise Mismatch(f"{what}: your ValueError says {str(e)[:120]!r}: name how "
                                   f"many rows have nothing finite left ({bad} here), so the "
                                   "reader knows whether one row or the whole batch broke") \
                        from None
                return
            raise Mismatch(f"{what}: no ValueError; a row with no finite logit left cannot be "
                           "sampled from (NaN made -inf, or -inf already): refuse every row "
                           "where no entry is finite, not only rows of NaN")
        return case

    nan, inf = float("nan"), float("inf")
    return run_check("sanitize_logits", fn, ref, [
        ("finite logits pass unchanged", same(torch.randn(3, 6, generator=gen(0)), "finite")),
        ("NaN becomes -inf",
         same(torch.tensor([[1.0, nan, 0.5, nan], [0.0, 1.0, 2.0, 3.0]]), "logits with NaN")),
        ("+inf becomes the largest float32", same(torch.tensor([[2.0, inf, -1.0]]), "+inf")),
        ("float16: +inf becomes float16's largest",
         same(torch.tensor([[inf, 0.0, 1.0]], dtype=torch.float16), "float16 logits")),
        ("a row of NaN must raise ValueError",
         refuses(torch.tensor([[0.0, 1.0, 2.0], [nan, nan, nan]]), "a row of NaN")),
        ("-inf stays -inf (a token the model rules out)",
         same(torch.tensor([[2.0, -inf, -1.0]]), "logits with -inf (a valid logit, "
              "probability 0: leave it; only NaN and +inf are replaced, and torch.nan_to_num "
              "also replaces -inf unless you pass neginf=-inf)")),
        ("a row of -inf must raise ValueError",
         refuses(torch.tensor([[0.0, 1.0, 2.0], [-inf, -inf, -inf]]), "a row of -inf")),
        ("three of five rows with nothing finite: the error names 3",
         refuses(torch.tensor([[nan, nan], [0.0, 1.0], [-inf, nan], [2.0, 0.5], [-inf, -inf]]),
                 "three rows of five with nothing finite", names_the_count=True)),
    ])


def expect_mask(got, want: torch.Tensor, ids: torch.Tensor, is_end: torch.Tensor,
                what: str) -> None:
    """`expect`, with the first entry that differs said in the ids' terms: where that row's
    first end token is, and whether the token counts."""
    try:
        expect(got, want, what)
    except Mismatch as e:
        if not (isinstance(got, torch.Tensor) and got.shape == want.shape) or \
                not (got.long() != want).any():  # the dtype, NaN: expect's reason says it
            raise
        r, t = (int(i) for i in (got.long() != want).nonzero()[0])
        ends = [int(i) for i in is_end[r].nonzero().flatten()]
        token = f"row {r}, position {t} (token {int(ids[r, t])})"
        if want[r, t] == 1:
            where = (f"the row's first end token is at position {ends[0]}" if ends else
                     "the row has no end token")
            words = (f"{token} counts and yours drops it: {where}, and every token up to and "
                     "including the first end token counts")
        else:
            words = (f"{token} comes after the row's first end token (position {ends[0]}) "
                     "and yours keeps it: nothing after the first end token counts, not "
                     "even another end token")
        raise Mismatch(f"{e}; {words}") from None


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
            expect_mask(got, want, ids, ids == eos, f"{what}: the mask for ids {ids.tolist()}")
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
            expect_mask(got, ref(ids, list(stop)), ids, torch.isin(ids, torch.tensor(stop)),
                        what)
        return run

    return run_check("completion_mask_any_eos", fn, ref, [
        ("one end id", case([0], "the mask with end id 0")),
        ("two end ids, a row ending at each, one at neither",
         case([0, 9], "the mask with end ids 0 and 9 (a row ends at the FIRST of any)")),
    ])


def check_safe_sample(fn: Callable) -> CheckResult:
    ref = steps.safe_sample

    def healthy(seed):
        def run(f):
            out, want = drive(f, drive_sample, seed=seed), drive_sample(ref, seed)
            if "error" in out:
                raise Mismatch(f"a healthy model: your sampler raised {out['error']}")
            if out["ids"] is None:
                raise Mismatch("return sample_group's Rollout (it has .completion_ids)")
            if same_values(out["ids"], want["ids"]):
                return
            at_one = drive_sample(lambda *a: ref(*a[:5], 1.0, *a[6:]), seed)["ids"]
            if not same_values(want["ids"], at_one) and same_values(out["ids"], at_one):
                raise Mismatch("your draws are sample_group's at temperature 1.0, and this "
                               "case samples at 0.8: pass temperature (and top_k, top_p) on "
                               "to sample_group")
            expect(out["ids"], want["ids"], "the sampled completion ids (same seed: the "
                    "same draws as sample_group)")
        return run

    def nan_params(f):
        out = drive(f, drive_sample, fault="nan-params")
        if "error" not in out:
            raise Mismatch("a model whose parameters are NaN sampled without an error: it "
                           "cannot have produced anything but garbage")
        if out["error"].startswith("SamplingError"):
            raise Mismatch("the NaN logits were refused by the package's sanitiser "
                           "(sample_group's safe=True raises SamplingError): sanitise with "
                           "yours, sample_group(..., sanitize=sanitize_logits), whose "
                           "ValueError says what the learner's code found")
        if MULTINOMIAL_ERROR in out["error"]:
            raise Mismatch("the NaN logits reached torch.multinomial (on CUDA: a device-side "
                           "assert that kills the process): sanitise them first, "
                           "sample_group(..., sanitize=sanitize_logits)")

    def refused_as_bad_input(error: str, what: str):
        rows = tiny_model()[0].get_input_embeddings().num_embeddings
        if not error.startswith("ValueError") or str(rows) not in error:
            raise Mismatch(f"the bad {what} was refused with {error[:120]!r}: raise a "
                           f"ValueError (bad input, not a crash) that names the id and the "
                           f"embedding's size ({rows} rows), so the user knows what to fix")

    def reached_the_embedding(out: dict) -> bool:  # IndexError on CPU
        return "error" in out and ("index out of range" in out["error"]
                                   or "IndexError" in out["error"])

    def new_pad(f, fault="new-pad"):
        out = drive(f, drive_sample, fault=fault)
        reached = reached_the_embedding(out)
        if fault == "new-pad-unpadded" and not out.get("error", "").startswith("ValueError"):
            raise Mismatch("the prompts here have one length, so the bad pad id is in none "
                           "of them, and your sampler let it through; the sampler writes the "
                           "pad id after each finished row's end of text, and the reference's "
                           "and the training forward look it up in the embedding: check "
                           "tokenizer.pad_token_id itself against "
                           "model.get_input_embeddings().num_embeddings")
        if "error" not in out:
            raise Mismatch("a pad token with no embedding row was sampled with: check the "
                           "prompt ids against model.get_input_embeddings().num_embeddings")
        if reached:
            raise Mismatch("the bad pad id reached the embedding (IndexError on CPU, a "
                           "device-side assert on CUDA): check the ids before the forward, "
                           "and name the id and the table's size in the error")
        refused_as_bad_input(out["error"], "pad id")

    def new_prompt_token(f):
        out = drive(f, drive_sample, fault="new-prompt-token")
        if "error" not in out:
            raise Mismatch("a prompt holds a token the embedding has no row for (added to the "
                           "tokenizer only) and your sampler let it through: check the "
                           "prompts' ids too, not only the pad token's")
        if reached_the_embedding(out):
            raise Mismatch("a prompt's token id with no embedding row reached the embedding "
                           "(IndexError on CPU, a device-side assert on CUDA): check every "
                           "prompt id against model.get_input_embeddings().num_embeddings "
                           "before the forward")
        refused_as_bad_input(out["error"], "prompt id")

    return run_check("safe_sample", fn, ref, [
        ("a healthy model, seed 0", healthy(0)), ("a healthy model, seed 1", healthy(1)),
        ("NaN parameters (report 000)", nan_params),
        ("a new pad token the embedding lacks (report 002)", new_pad),
        ("the same pad token, prompts of one length (no padding in them)",
         lambda f: new_pad(f, "new-pad-unpadded")),
        ("a prompt token the embedding lacks (added to the tokenizer only)", new_prompt_token),
    ])


# --- the notebook's exercises, in its order -------------------------------------------------
EXERCISES = (
    Exercise('sanitize_logits', steps.sanitize_logits, check_sanitize_logits),
    Exercise('completion_mask_from_ids', completion_mask_from_ids, check_completion_mask_from_ids),
    Exercise('completion_mask_any_eos', reference_completion_mask_any_eos, check_completion_mask_any_eos),
    Exercise('safe_sample', steps.safe_sample, check_safe_sample,
             driver=drive_sample),
)
