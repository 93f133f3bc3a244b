"""Sampling G completions per prompt (generate()'s loop, each prompt run once per group),
and greedy evaluation with `model.generate`.

Prompts are left-padded (so every row's last prompt token sits at the same column and
generation appends after it) with an attention mask; position ids come from the mask.
A completion ends at its first end-of-text token, which is kept (the model must learn to
stop); everything after it is padding and masked out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fast import cached_forward, select_rows
from .graphs import static_decoder, static_prompt_forward
from .objective import position_ids_from_mask, scale_logits, token_logprobs
from .startup import gc_paused
from .tasks import addition_reward

with gc_paused():  # startup.py
    from transformers import (
        GenerationConfig,
        LogitsProcessor,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )


class SamplingError(RuntimeError):
    """The policy produced logits that cannot be sampled from (safe sampling only)."""


class SanitizeLogits(LogitsProcessor):
    """NaN -> -inf and +inf -> the largest finite float, then refuse a row with no
    finite logit left, with a message that names the cause instead of a multinomial crash.
    It runs after the temperature: +inf made finite first would overflow again when a
    temperature below 1 divides it."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        bad = ~torch.isfinite(scores)
        if not bad.any():
            return scores
        n_nan = int(torch.isnan(scores).sum())
        scores = torch.nan_to_num(scores, nan=float("-inf"), posinf=torch.finfo(scores.dtype).max,
                                  neginf=float("-inf"))  # -inf (top-k's "excluded") stays
        dead = ~torch.isfinite(scores).any(-1)
        if dead.any():
            raise SamplingError(
                f"{int(dead.sum())} of {scores.shape[0]} rows have no finite logit "
                f"({n_nan} NaN values) for the token after the first {input_ids.shape[1]} "
                "(prompt and completion so far): the "
                "policy's parameters are probably non-finite; check the health metrics "
                "(nonfinite_params) and roll back to the last healthy snapshot"
            )
        return scores


MULTINOMIAL_ERROR = "probability tensor contains either `inf`, `nan` or element < 0"


def sampleable_rows(probs: torch.Tensor) -> torch.Tensor:
    """(B, V) probabilities -> (B,) bool: the rows torch.multinomial can draw from (every
    entry finite and >= 0)."""
    return (torch.isfinite(probs) & (probs >= 0)).all(-1)


def unsampleable(device: torch.device) -> RuntimeError:
    """The error torch.multinomial raises on the CPU for probabilities it cannot draw from.
    On CUDA torch.multinomial does not raise: a NaN, inf or negative entry is a device-side
    assert, and every later CUDA call in the process fails with it (report 000), so a
    crashed run could not be diagnosed, and a notebook's kernel would be lost. decode_loop
    finds such rows before the draw on CUDA and raises this: a crash then ends a run the
    same way on both devices. The real device-side assert is shown in a fresh process
    (`python -m grpo_lab scenario nan-params-sampling-crash --device cuda`)."""
    return RuntimeError(f"{MULTINOMIAL_ERROR} (found before torch.multinomial, which on "
                        f"{device.type} would end in a device-side assert)")


@dataclass
class Rollout:
    """One step's samples. B = prompts x G; P prompt columns; C completion columns."""

    input_ids: torch.Tensor  # (B, P + C) prompt then completion, left-padded
    attention_mask: torch.Tensor  # (B, P + C) 1 on prompt tokens and on the completion up to EOS
    completion_mask: torch.Tensor  # (B, C) 1 up to and including the first EOS
    sampling_logprobs: torch.Tensor  # (B, C) log-probs the sampler drew each token with
    completions: list[str]  # (B,) decoded completions, without EOS
    prompt_index: torch.Tensor  # (B,) which prompt each row belongs to
    truncated: torch.Tensor | None = None  # (B,) bool: hit max_new_tokens without an EOS

    @property
    def completion_ids(self) -> torch.Tensor:  # (B, C)
        return self.input_ids[:, -self.completion_length :]

    @property
    def completion_length(self) -> int:
        return self.completion_mask.shape[1]


def truncated_rows(completion_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """(B, C) ids -> (B,) bool: True where the row has no EOS (cut off at the length cap)."""
    return ~(completion_ids == eos_token_id).any(-1)


def completion_mask_from_ids(completion_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """(B, C) ids -> (B, C) long mask: 1 up to and including the first EOS, else 0."""
    is_eos = completion_ids == eos_token_id
    # number of EOS strictly before each position; a token counts while that is 0
    eos_before = is_eos.long().cumsum(-1) - is_eos.long()
    return (eos_before == 0).long()


def check_token_ids(ids: torch.Tensor, vocab_size: int, tokenizer=None) -> None:
    """Refuse ids the embedding has no row for (report 002: a pad token added to the
    tokenizer but not to the model), naming the id, instead of 'index out of range'."""
    top = int(ids.max())
    if top >= vocab_size or int(ids.min()) < 0:
        which = ""
        if tokenizer is not None and top == tokenizer.pad_token_id:
            which = " (the tokenizer's pad_token_id: resize the embeddings or reuse EOS as pad)"
        raise SamplingError(
            f"token id {top} is outside the model's vocabulary of {vocab_size} "
            f"embedding rows{which}"
        )


def decode_completions(tokenizer, completion_ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    eos = tokenizer.eos_token_id
    out = []
    for ids, m in zip(completion_ids.tolist(), mask.tolist(), strict=True):
        kept = [t for t, keep in zip(ids, m, strict=True) if keep and t != eos]
        out.append(tokenizer.decode(kept))
    return out


def encode_prompts(tokenizer, prompts: list[str], device: torch.device):
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc.input_ids.to(device), enc.attention_mask.to(device)


def generation_config(tokenizer, max_new_tokens: int, do_sample: bool, temperature: float = 1.0,
                      top_k: int = 0, top_p: float = 1.0, **extra) -> GenerationConfig:
    """Sampling flags passed to generate() itself: passing temperature/top-p through a
    logits processor, or with do_sample=False, is report 003's 'flags are not valid and
    may be ignored' bug."""
    kwargs = dict(
        max_new_tokens=max_new_tokens, do_sample=do_sample,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **extra,
    )
    if do_sample:
        kwargs.update(temperature=temperature, top_k=top_k, top_p=top_p)  # top_k=0: off
    else:
        kwargs.update(temperature=None, top_k=None, top_p=None)
    return GenerationConfig(**kwargs)


def decode_loop(model, tokenizer, prompt_ids, prompt_mask, group_size, max_new_tokens,
                temperature, top_k, top_p, safe, logit_clamp=None, sanitize=None,
                check_on_device=None, static=None):
    """generate()'s sampling loop written out, with two savings: each prompt runs through the
    model once and its G rows share its KV cache, and a finished row leaves the forward (see
    below). Then one token per step for every row, padding after a row's EOS, until all rows
    are done. Each step's logits are scaled as training scales them (`scale_logits`:
    temperature, then the optional logit clamp), then sanitised (safe), then top-k and
    top-p, and a token is drawn with torch.multinomial as generate() draws it: on CPU the
    same seed gives the same completions as generate() with the same processors
    (tests/test_tasks_sampling.py). (The prompt forward runs B/G
    rows instead of B; where a kernel's rounding depends on the batch size, as it can on
    CUDA, a draw at the edge of a token's probability interval may go the other way.)

    On CUDA (or with `check_on_device`) a row torch.multinomial cannot draw from is found
    on the device and drawn from a stand-in, and the loop raises `unsampleable` at its one
    host sync per token (where it reads which rows are done): the same error as the CPU's
    multinomial, without the device-side assert, and without a second sync per token.

    Once a row has drawn its EOS, it leaves the forward: its later tokens are padding
    whatever its logits, and each row's logits depend on its own tokens only. Its KV cache
    rows are dropped, and its stand-in logits are zeros (a uniform draw, replaced by the pad
    id), so the draws consume the generator as before and every other row draws from its
    own logits. Those are the same numbers where a kernel's rounding does not depend on how
    many rows it runs. MKL's float32 matmul on the course's CI machine rounds a row
    differently in a product of 1 to 3 rows (by up to ~2e-6 in a logit), so there the
    sampling log-probs of such a step move in the 6th digit, and a draw at the edge of a
    token's probability interval may go the other way (measured: about 3 in 1e8 draws).

    With a static decoder (graphs.py: on a GPU with GRPO_LAB_CUDA_GRAPHS=1, or `static`
    True) the prompts' forward and the decode steps run over static buffers, replayed as
    CUDA graphs on a GPU: finished rows stay in the decode step's forward, their logits
    replaced by the same zeros.

    (B, P) left-padded prompts, rows grouped by prompt -> (B, C) completion ids and the
    (B, C, V) raw float32 logits each token was drawn from (before any processor; zeros
    after a row's EOS)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
    processors = [lambda ids, scores: scale_logits(scores, temperature, logit_clamp)]
    if sanitize is not None:  # a (B, V) -> (B, V) function of the caller's (notebook 10)
        processors.append(lambda ids, scores: sanitize(scores))
    elif safe:
        processors.append(SanitizeLogits())
    if top_k:
        processors.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    model_forward = cached_forward(model)  # fast.py: GPT-2's forward without transformers' overhead

    def forward(*args):  # no autograd bookkeeping at all; its outputs are read, never kept
        with torch.inference_mode():
            return model_forward(*args)
    ids, mask = prompt_ids[::group_size], prompt_mask[::group_size]  # (B/G, P)
    positions = position_ids_from_mask(mask)
    prompt_pass = static_prompt_forward(model, ids, mask, positions, static)  # graphs.py
    logits, cache = prompt_pass if prompt_pass is not None else forward(ids, mask, positions)
    cache = select_rows(cache, group_size)  # (B/G, ...) -> (B, ...)
    logits = logits[:, -1].float().repeat_interleave(group_size, 0)  # (B, V)
    mask, position = prompt_mask, positions[:, -1:].repeat_interleave(group_size, 0)
    decoder = static_decoder(model, cache, prompt_ids.shape[1] + max_new_tokens - 1, static)
    if decoder is not None:
        decoder.start(cache, mask, position)
    done = torch.zeros(len(mask), dtype=torch.bool, device=mask.device)  # (B,) row hit EOS
    on_device = prompt_ids.is_cuda if check_on_device is None else check_on_device
    bad = torch.zeros((), dtype=torch.bool, device=mask.device)  # a row was unsampleable
    sequence, raw = prompt_ids, []
    alive = list(range(len(mask)))  # the rows still drawing, whose keys and values the cache holds
    rows = None  # alive as a tensor, None while it is every row
    for t in range(max_new_tokens):
        raw.append(logits)
        scores = logits
        for process in processors:
            scores = process(sequence, scores)
        probs = torch.softmax(scores, -1)
        if on_device:  # no host sync here: the flag is read with `done` below
            ok = sampleable_rows(probs)
            bad = bad | ~ok.all()
            probs = torch.where(ok[:, None], probs, 1.0)  # a stand-in; the loop raises below
        token = torch.multinomial(probs, 1).squeeze(1)  # (B,)
        token = torch.where(done, tokenizer.pad_token_id, token)
        sequence = torch.cat([sequence, token[:, None]], 1)  # (B, P + t + 1)
        done = done | (token == tokenizer.eos_token_id)
        if on_device:
            *finished, found = torch.cat([done, bad[None]]).tolist()  # the one host sync
            if found:
                raise unsampleable(probs.device)
        else:
            finished = done.tolist()
        if t == max_new_tokens - 1 or all(finished):
            break
        if decoder is not None:
            logits = decoder.step(token, done)  # (B, V): zeros on the finished rows
            continue
        mask, position = torch.cat([mask, mask.new_ones(len(mask), 1)], 1), position + 1
        if any(finished[i] for i in alive):  # rows finished: drop them from the cache
            cache = select_rows(cache, torch.tensor(
                [j for j, i in enumerate(alive) if not finished[i]], device=mask.device))
            alive = [i for i in alive if not finished[i]]
            rows = torch.tensor(alive, device=mask.device)
        if rows is None:
            logits, cache = forward(token[:, None], mask, position, cache)
            logits = logits[:, -1].float()  # (B, V)
        else:
            out, cache = forward(token[rows, None], mask[rows], position[rows], cache)
            logits = out.new_zeros(len(mask), out.shape[-1], dtype=torch.float32)
            logits[rows] = out[:, -1].float()  # (B, V): zeros on the finished rows
    return sequence[:, prompt_ids.shape[1]:], torch.stack(raw, 1)


@torch.no_grad()
def sample_group(
    model,
    tokenizer,
    prompts: list[str],
    group_size: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    safe: bool = False,
    logit_clamp: float | None = None,
    sanitize=None,
) -> Rollout:
    """Sample `group_size` completions for each prompt (rows grouped by prompt), from the
    distribution training optimises: softmax(scale_logits(logits, temperature,
    logit_clamp)), then top-k / top-p. `safe`: check the prompt ids and sanitise the logits
    (SanitizeLogits); `sanitize`: a (B, V) -> (B, V) function to sanitise them with instead."""
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, device)  # (B/G, P)
    if safe:
        check_token_ids(prompt_ids, model.get_input_embeddings().num_embeddings, tokenizer)
    # each prompt's row repeated G times, rows grouped by prompt: (B, P)
    prompt_ids, prompt_mask = (t.repeat_interleave(group_size, 0)
                               for t in (prompt_ids, prompt_mask))
    was_training = model.training
    model.eval()
    completion_ids, raw_logits = decode_loop(
        model, tokenizer, prompt_ids, prompt_mask, group_size, max_new_tokens, temperature,
        top_k, top_p, safe, logit_clamp, sanitize,
    )  # (B, C), (B, C, V)
    model.train(was_training)
    completion_mask = completion_mask_from_ids(completion_ids, tokenizer.eos_token_id)
    drawn = completion_mask.bool()
    # the drawn tokens' log-probs; padding carries none (where(), not *, so a NaN there
    # cannot leak through), and its pad id is not looked up: it was never drawn
    sampling_logprobs = torch.where(drawn, token_logprobs(
        scale_logits(raw_logits, temperature, logit_clamp), completion_ids.where(drawn, 0)), 0.0)
    return Rollout(
        input_ids=torch.cat([prompt_ids, completion_ids], dim=1),
        attention_mask=torch.cat([prompt_mask, completion_mask], dim=1),
        completion_mask=completion_mask,
        sampling_logprobs=sampling_logprobs,
        completions=decode_completions(tokenizer, completion_ids, completion_mask),
        prompt_index=torch.arange(len(prompts), device=device).repeat_interleave(group_size),
        truncated=truncated_rows(completion_ids, tokenizer.eos_token_id),
    )


@torch.no_grad()
def greedy_completions(model, tokenizer, prompts: list[str], max_new_tokens: int,
                       batch_size: int = 256, safe: bool = False) -> tuple[list[str], list[bool]]:
    """Greedy (argmax) completions, for evaluation, and for each whether it was cut off at
    max_new_tokens without end-of-text; `safe` checks the prompt ids."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    texts: list[str] = []
    truncated: list[bool] = []
    for i in range(0, len(prompts), batch_size):
        ids, mask = encode_prompts(tokenizer, prompts[i : i + batch_size], device)
        if safe:
            check_token_ids(ids, model.get_input_embeddings().num_embeddings, tokenizer)
        seq = model.generate(
            input_ids=ids, attention_mask=mask,
            generation_config=generation_config(tokenizer, max_new_tokens, False),
        )
        comp = seq[:, ids.shape[1] :]
        texts += decode_completions(
            tokenizer, comp, completion_mask_from_ids(comp, tokenizer.eos_token_id)
        )
        truncated += truncated_rows(comp, tokenizer.eos_token_id).tolist()
    model.train(was_training)
    return texts, truncated


def greedy_accuracy(model, tokenizer, problems, max_new_tokens: int, safe: bool = False) -> float:
    """Fraction of `problems` whose greedy completion is exactly the answer (then EOS)."""
    texts, truncated = greedy_completions(model, tokenizer, [p.prompt for p in problems],
                                          max_new_tokens, safe=safe)
    rewards = addition_reward(texts, [p.answer for p in problems], truncated=truncated)
    return sum(rewards) / len(rewards)


def transformers_messages(fn) -> list[str]:
    """Run fn() and return what transformers logged meanwhile (its warnings go to its own
    logger, not to Python's warnings, so pytest's recwarn does not see them)."""
    import logging

    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        fn()
    finally:
        logger.removeHandler(handler)
    return messages
