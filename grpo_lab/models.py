"""Policy, tokenizer and reference model for the two profiles.

- `cpu`: a tiny GPT-2 (GPT2LMHeadModel, ~0.8M parameters) with a character tokenizer,
  warm-started on the addition task and shipped in `grpo_lab/assets/tiny-gpt2`.
- `gpu`: GPT-2 124M. Pretrained `gpt2` via `from_pretrained` where the hub (or its cache)
  is reachable, else the 124M architecture with the character tokenizer; either way
  warm-started on the task once and cached (see `policy.py`, which loads either).
"""

from __future__ import annotations

import copy
import os
from contextlib import contextmanager
from pathlib import Path

import torch

from .config import ConfigError, check_device_name, resolve_profile, saved_model_dir
from .startup import gc_paused

with gc_paused():  # startup.py: a second of CPU less per process
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        PreTrainedTokenizerBase,
        PreTrainedTokenizerFast,
    )

ASSETS = Path(__file__).parent / "assets"
TINY_MODEL_DIR = ASSETS / "tiny-gpt2"
CACHE_DIR = Path(os.environ.get("GRPO_LAB_CACHE", Path.home() / ".cache" / "grpo_lab"))

EOS = "<|endoftext|>"
PAD = "<pad>"
CHARS = "0123456789+= "


THREADS_ENV = "GRPO_LAB_THREADS"


def apply_thread_policy(profile: str) -> int:
    """The CPU thread policy: torch's intra-op threads for this process. Returns the count.

    The tiny model's matrices are too small to share across cores. Measured on 2 cores
    (benchmarks/threads.py, median step of the stable preset): idle, 1 thread 0.066 s and
    2 threads 0.077 s; with one core held by another process, 1 thread 0.076 s and 2
    threads 0.277 s, as the two threads wait on each other. So the cpu profile runs on 1
    thread, which degrades gracefully under load; the gpu profile (GPT-2 124M) keeps torch's
    default. $GRPO_LAB_THREADS=N overrides both."""
    env = os.environ.get(THREADS_ENV, "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ConfigError(f"{THREADS_ENV} must be a whole number >= 1 (got {env!r})")
        torch.set_num_threads(int(env))
    elif profile == "cpu":
        torch.set_num_threads(1)
    return torch.get_num_threads()


def requested_device(device: str | None = None, profile: str | None = None) -> str | None:
    """The device a run asks for: `device` when named; else 'cpu' for the cpu profile (the
    tiny GPT-2 trains on the CPU, where its notebooks are measured, also beside a GPU), and
    None for the gpu profile: CUDA, on the rank's GPU when a launcher started the run."""
    if device is not None:
        return device
    return None if resolve_profile(profile) == "gpu" else "cpu"


def resolve_device(device: str | None = None, profile: str | None = None) -> torch.device:
    device = requested_device(device, profile)
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_device_name(device)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device is {device!r} but CUDA is not available on this machine")
    return dev


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """The offline character tokenizer: end-of-text (id 0), pad (id 1), then one id per
    character of CHARS. Built in code, so no hub is needed."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate([EOS, PAD, *CHARS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=EOS, bos_token=EOS, unk_token=EOS, pad_token=PAD,
        padding_side="left", model_max_length=32,
    )


def tiny_gpt2_config(vocab_size: int) -> GPT2Config:
    """~0.8M parameters: 4 layers, 4 heads, width 128, 32 positions."""
    return GPT2Config(
        vocab_size=vocab_size, n_positions=32, n_embd=128, n_layer=4, n_head=4,
        bos_token_id=0, eos_token_id=0, pad_token_id=1,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )


def gpt2_124m_config(vocab_size: int, pad_token_id: int, eos_token_id: int) -> GPT2Config:
    """The GPT-2 small architecture (12 layers, 12 heads, width 768)."""
    return GPT2Config(
        vocab_size=vocab_size, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
        bos_token_id=eos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
    )


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Left padding for generation; GPT-2's tokenizer has no pad token, so reuse EOS
    (adding a new pad token would need resized embeddings: see the sampling notebook)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_local(path: str | Path) -> tuple[GPT2LMHeadModel, PreTrainedTokenizerBase]:
    """Load a policy and tokenizer saved with `save_pretrained` in one directory."""
    from transformers import AutoTokenizer

    path = Path(saved_model_dir(path))
    with quiet_loading():
        model = GPT2LMHeadModel.from_pretrained(path)
        tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(path))
    return model, tokenizer


@contextmanager
def quiet_loading():
    """No 'Loading weights' progress bar for a model that loads in milliseconds."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


_UNREACHABLE: set[str] = set()  # names this process could not load: asked once, said once


def load_pretrained_gpt2(name_or_path: str = "gpt2"):
    """Pretrained GPT-2 from the hub, its cache, or a local `save_pretrained` directory.

    Returns (model, tokenizer), or None with a printed message naming the fallback when
    it cannot be reached (offline, no cache). A name that failed once in this process is
    not asked for again: a notebook that builds 36 trainers prints the message once, not 36
    times (as it did on the H200 run of notebook 06), and waits on the hub once."""
    from transformers import AutoTokenizer

    if name_or_path in _UNREACHABLE and not Path(name_or_path).is_dir():  # saved since: load it
        return None
    try:
        model = GPT2LMHeadModel.from_pretrained(name_or_path)
        tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(name_or_path))
    except OSError as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        _UNREACHABLE.add(name_or_path)
        print(
            f"[grpo_lab] pretrained {name_or_path!r} is not reachable ({first_line[:160]}); "
            "falling back to the GPT-2 124M architecture warm-started on the task"
        )
        return None
    return model, tokenizer


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Dropout off everywhere (as TRL does for GRPO): with it on, the training forward
    would not reproduce the sampling-time log-probs and the ratio would not start at 1."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The reference model: a copy that never trains and never tracks gradients."""
    ref = copy.deepcopy(model)
    ref.eval()
    ref.requires_grad_(False)
    return ref


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
