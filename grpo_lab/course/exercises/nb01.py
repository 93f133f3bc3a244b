"""Notebook 01, gpt2 and sampling: the checks of its exercises, and each exercise as
data in `EXERCISES`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ... import objective
from ...objective import position_ids_from_mask, token_logprobs
from .. import steps
from .base import CheckResult, Exercise, Mismatch, Mistake, close, expect, gen, run_check
from .fixtures import drive, drive_sample_tokens, tiny_model


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
            expect(got, want, "the position ids")
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
            if isinstance(got, torch.Tensor) and got.is_floating_point() and \
                    got.dtype != torch.float32 and logits.dtype != torch.float64:
                raise Mismatch(f"{what}: your log-probs are {got.dtype}; return float32, with "
                               "the log-softmax computed in float32 (`logits.float()` first): "
                               "bfloat16 keeps about 3 significant digits, too few for the "
                               "log of a small probability")
            want = ref(logits, ids)
            if isinstance(got, torch.Tensor) and got.shape == want.shape and not close(got, want):
                narrow = logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
                if logits.dtype != torch.float32 and close(got, narrow.float()):
                    raise Mismatch(f"{what}: you took the log-softmax in {logits.dtype} and "
                                   "cast after it; cast the logits to float32 first "
                                   "(`logits.float().log_softmax(-1)`)")
                other = logits.float().log_softmax(-2).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
                if close(got, other):
                    raise Mismatch(f"{what}: your log-probs are normalised over the positions "
                                   "(dim -2), not over the vocabulary: log_softmax(dim=-1)")
            expect(got, want, f"{what}: the log-probs")
        return run

    logits = torch.randn(3, 4, 7, generator=gen(0))
    ids = torch.randint(0, 7, (3, 4), generator=gen(1))
    big = torch.randn(2, 3, 5, generator=gen(2)) * 1000  # softmax(exp) overflows naively
    return run_check("token_logprobs", fn, ref, [
        ("random logits", case(logits, ids, "random logits")),
        ("logits of size 1000 (use log_softmax, not log(softmax))",
         case(big, torch.zeros(2, 3, dtype=torch.long), "huge logits")),
        ("bfloat16 logits, as under autocast (the log-softmax in float32)",
         case((torch.randn(2, 3, 50, generator=gen(3)) * 4).bfloat16(),
              torch.randint(0, 50, (2, 3), generator=gen(4)), "bfloat16 logits")),
    ])


# sample_tokens's known mistakes: each is a sampler of (model, ids, mask, n, temperature,
# eos, pad)
def _sampler_no_position_ids(model, ids, mask, n, temperature, eos, pad):
    seq, m = ids, mask
    for _ in range(n):
        logits = model(input_ids=seq, attention_mask=m).logits[:, -1].float()
        token = torch.multinomial(torch.softmax(logits / temperature, -1), 1)
        seq, m = torch.cat([seq, token], 1), torch.cat([m, torch.ones_like(token)], 1)
    out = seq[:, ids.shape[1]:]
    ended = (out == eos).long().cumsum(-1) - (out == eos).long() > 0
    return out.masked_fill(ended, pad)


def _sampler_positions_from_the_width(model, ids, mask, n, temperature, eos, pad):
    # the prompt's positions from the mask, each new token's from the padded width P + t
    P = ids.shape[1]
    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                use_cache=True)
    cache, logits, m, tokens = out.cache, out.logits[:, -1].float(), mask, []
    done = torch.zeros(len(ids), dtype=torch.bool)
    for t in range(n):
        token = torch.multinomial(torch.softmax(logits / temperature, -1), 1).squeeze(1)
        token = torch.where(done, pad, token)
        tokens.append(token)
        done = done | (token == eos)
        if bool(done.all()) or t == n - 1:
            break
        m = torch.cat([m, torch.ones_like(m[:, :1])], 1)
        out = model(input_ids=token[:, None], attention_mask=m, cache=cache, use_cache=True,
                    position_ids=torch.full_like(token[:, None], P + t))
        cache, logits = out.cache, out.logits[:, -1].float()
    return torch.stack(tokens, 1)


def _sampler_at_one(model, ids, mask, n, temperature, eos, pad):
    return steps.sample_tokens(model, ids, mask, n, 1.0, eos, pad)


def _no_padding_after_eos(model, ids, mask, n, temperature, eos, pad):
    return steps.sample_tokens(model, ids, mask, n, temperature, -1, pad)


def _greedy(model, ids, mask, n, temperature, eos, pad):
    return steps.sample_tokens(model, ids, mask, n, 1e-4, eos, pad)


SAMPLE_TOKENS_MISTAKES = (
    Mistake("no_position_ids", _sampler_no_position_ids,
            "no position ids: a left-padded row then sees its tokens at shifted positions; "
            "pass position_ids from the mask (and the next position, one more, at each step)"),
    Mistake("positions_from_the_width", _sampler_positions_from_the_width,
            "each new token's position id counts the left padding (P + step): a padded row's "
            "tokens then sit further along than an unpadded row's; continue from each row's "
            "own last position, one more per step (position_ids_from_mask's last column + 1)"),
    Mistake("temperature_ignored", _sampler_at_one,
            "the temperature is missing: sample from softmax(logits / temperature)"),
    Mistake("no_padding_after_eos", _no_padding_after_eos,
            "a row goes on after its EOS: from the step after a row's first EOS, write "
            "pad_token_id, and stop when every row is done"),
    Mistake("greedy", _greedy,
            "this is greedy decoding (argmax): GRPO needs G different samples per prompt; "
            "draw with torch.multinomial"),
)


def explain_sampled_shape(out: torch.Tensor, want: torch.Tensor) -> None:
    """Mismatch where the learner's ids break a rule whatever the draws: padding after EOS,
    stopping once every row is done."""
    _, tokenizer = tiny_model()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    is_eos = (out == eos).long()
    after_eos = (is_eos.cumsum(-1) - is_eos) > 0  # positions after a row's first EOS
    rows = sorted({int(r) for r in (after_eos & (out != pad)).nonzero()[:, 0]})
    if rows:
        message = next(m.message for m in SAMPLE_TOKENS_MISTAKES
                       if m.name == "no_padding_after_eos")
        raise Mismatch(f"row(s) {rows}, EOS id {eos}, pad id {pad}: {message}")
    n = want.shape[1]
    ended = (is_eos.cumsum(-1) > 0).any(-1)  # rows that produced an EOS
    if out.shape[1] < n and not bool(ended.all()):
        open_rows = [int(r) for r in (~ended).nonzero().flatten()][:8]
        raise Mismatch(f"you returned {out.shape[1]} columns, and row(s) {open_rows} had not "
                       "produced their EOS yet: the loop goes on until every row is done "
                       "(`done.all()`), not until one is (`done.any()`), or max_new_tokens")
    if out.shape[1] > n and torch.equal(out[:, :n], want) and bool((out[:, n:] == pad).all()):
        raise Mismatch(f"you returned {out.shape[1]} columns; every row had ended after {n} "
                       "steps, where the reference stops: end the loop once every row has "
                       "produced its EOS (the columns after it would be padding only)")


def check_sample_tokens(fn: Callable) -> CheckResult:
    ref = steps.sample_tokens

    def case(seed, temperature):
        def run(f):
            out = drive(f, drive_sample_tokens, seed=seed, temperature=temperature)["ids"]
            want = drive_sample_tokens(ref, seed, temperature)["ids"]
            if isinstance(out, torch.Tensor) and out.shape == want.shape and torch.equal(out, want):
                return
            if isinstance(out, torch.Tensor) and out.ndim == 2 and out.shape[0] == want.shape[0]:
                explain_sampled_shape(out, want)
            for mistake in SAMPLE_TOKENS_MISTAKES:
                other = drive_sample_tokens(mistake.wrong, seed, temperature)["ids"]
                if isinstance(out, torch.Tensor) and out.shape == other.shape and \
                        torch.equal(out, other):
                    raise Mismatch(f"the sampled ids differ from the reference's (same seed): "
                                   f"{mistake.message}")
            if isinstance(out, torch.Tensor) and out.ndim == 2 and out.shape[0] == want.shape[0] \
                    and out.shape[1] != want.shape[1]:
                k = min(out.shape[1], want.shape[1])
                same_steps = (out[:, :k] == want[:, :k]).all(0).long().cumprod(0).sum().item()
                raise Mismatch(f"yours ran {out.shape[1]} steps, the reference {want.shape[1]}, "
                               f"with the same seed: the draws agree for the first "
                               f"{same_steps} step(s), then differ, so the rows end at other "
                               "steps: something in the forward after step 1 differs (the "
                               "attention mask grown by one column per step, the position "
                               "ids, the cache fed back, the temperature)")
            expect(out, want, "the sampled completion ids (same seed, same draws)")
        return run

    return run_check("sample_tokens", fn, ref, [
        ("left-padded prompts, T = 0.7, seed 0", case(0, 0.7)),
        ("T = 1.3, seed 1", case(1, 1.3)),
    ])


# --- the notebook's exercises, in its order -------------------------------------------------
EXERCISES = (
    Exercise('position_ids_from_mask', position_ids_from_mask, check_position_ids_from_mask),
    Exercise('sample_tokens', steps.sample_tokens, check_sample_tokens,
             driver=drive_sample_tokens, mistakes=SAMPLE_TOKENS_MISTAKES),
    Exercise('token_logprobs', token_logprobs, check_token_logprobs),
)
