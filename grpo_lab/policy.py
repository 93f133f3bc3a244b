"""The policy a profile trains, and the warm start that makes it trainable.

- cpu: the tiny GPT-2 shipped in the package (`assets/tiny-gpt2`, rebuilt bit for bit by
  `python -m grpo_lab build-model`).
- gpu: GPT-2 124M: the pretrained `gpt2` when the hub or its cache has it, else the 124M
  architecture; either way warm-started on the task once and cached.

Warm start: a short supervised run on the task that stops while the model is only partly
right (greedy accuracy in the target band), so GRPO's groups have reward variance from
step 0 and RL has room to climb.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .config import ConfigError, resolve_profile
from .models import (
    CACHE_DIR,
    TINY_MODEL_DIR,
    GPT2LMHeadModel,
    apply_thread_policy,
    build_char_tokenizer,
    gpt2_124m_config,
    load_local,
    load_pretrained_gpt2,
    prepare_tokenizer,
)
from .objective import position_ids_from_mask, sequence_mean_nll
from .sampling import greedy_accuracy
from .tasks import ProblemStream

TARGET_ACCURACY = 0.40  # stop once greedy accuracy on the dev set reaches this
DEV_SIZE = 256


def supervised_batch(tokenizer, problems, device):
    """Left-padded "prompt answer<eos>" rows; the loss covers the answer and EOS only."""
    # one tokenizer call per column, not per problem: the warm start makes 64-row batches
    # hundreds of times (a cProfile of build-model: 7 s of 69 s in per-problem calls)
    prompts = tokenizer([p.prompt for p in problems], add_special_tokens=False).input_ids
    answers = tokenizer([p.answer for p in problems], add_special_tokens=False).input_ids
    rows = [p + a + [tokenizer.eos_token_id] for p, a in zip(prompts, answers, strict=True)]
    n_target = [len(a) + 1 for a in answers]
    width = max(map(len, rows))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    loss_mask = torch.tensor([[0] * (width - n) + [1] * n for n in n_target])
    return ids.to(device), mask.to(device), loss_mask.to(device)


def warm_start(
    model: GPT2LMHeadModel,
    tokenizer,
    target_accuracy: float = TARGET_ACCURACY,
    lr: float = 1e-3,
    batch_size: int = 64,
    max_steps: int = 20_000,
    check_every: int = 25,
    seed: int = 1234,
    max_new_tokens: int = 5,
    log=print,
) -> dict:
    """Train on the task until greedy dev accuracy >= target_accuracy. Returns a summary."""
    device = next(model.parameters()).device
    torch.manual_seed(seed)
    stream = ProblemStream(seed)
    dev = ProblemStream(seed + 1).sample(DEV_SIZE)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    t0 = time.time()
    acc = greedy_accuracy(model, tokenizer, dev, max_new_tokens)
    step = 0
    while acc < target_accuracy and step < max_steps:
        ids, mask, loss_mask = supervised_batch(tokenizer, stream.sample(batch_size), device)
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)
        ).logits  # (B, T, V)
        loss = sequence_mean_nll(logits[:, :-1], ids[:, 1:], loss_mask[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if step % check_every == 0:
            acc = greedy_accuracy(model, tokenizer, dev, max_new_tokens)
            log(f"[warm start] step {step}: loss {loss.item():.3f}, dev accuracy {acc:.3f}")
    model.eval()
    return {"steps": step, "dev_accuracy": acc, "seconds": round(time.time() - t0, 1)}


GPU_CACHE = CACHE_DIR / "gpt2-124m-warm"


GPU_WARM_START_LR = 1e-4  # the tiny model's 1e-3 is too high for 124M parameters


def offline_gpt2_124m():
    """(model, tokenizer): GPT-2 124M's architecture, untrained (seed 0), with the course's
    character tokenizer: what the gpu profile warm-starts where pretrained `gpt2` cannot
    be loaded (no hub, nothing cached)."""
    tokenizer = prepare_tokenizer(build_char_tokenizer())
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        gpt2_124m_config(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    )
    return model, tokenizer


def gpu_policy(cache_dir: Path = GPU_CACHE, pretrained: str = "gpt2"):
    """GPT-2 124M warm-started on the task, built once and cached in `cache_dir`."""
    if (cache_dir / "config.json").is_file():
        return load_local(cache_dir)
    model, tokenizer = load_pretrained_gpt2(pretrained) or offline_gpt2_124m()
    if torch.cuda.is_available():
        model.cuda()
    warm_start(model, tokenizer, lr=GPU_WARM_START_LR)
    cache_dir.mkdir(parents=True, exist_ok=True)
    model.cpu().save_pretrained(cache_dir)
    tokenizer.save_pretrained(cache_dir)
    return model, tokenizer


def load_policy(profile: str | None = None, model_path: str | Path | None = None):
    """(policy, tokenizer) for a profile, or from `model_path` when given. Applies the
    profile's CPU thread policy (models.apply_thread_policy)."""
    if model_path is not None:
        return load_local(model_path)
    profile = resolve_profile(profile)
    apply_thread_policy(profile)
    if profile == "cpu":
        if not (TINY_MODEL_DIR / "model.safetensors").is_file():
            raise FileNotFoundError(
                f"the shipped tiny model is missing from {TINY_MODEL_DIR}; "
                "regenerate it with `python -m grpo_lab build-model`"
            )
        return load_local(TINY_MODEL_DIR)
    if not torch.cuda.is_available() and not (GPU_CACHE / "config.json").is_file():
        raise ConfigError(
            "profile 'gpu' (GPT-2 124M) needs CUDA to warm-start the model, and none is "
            "available; use GRPO_LAB_PROFILE=cpu (the tiny GPT-2)"
        )
    return gpu_policy()
