"""A small GPT-2 saved the way the hub's `gpt2` is: a byte-level BPE tokenizer (trained here
on the task's text, so numbers become multi-digit tokens as in GPT-2's vocabulary) with
`<|endoftext|>` as its only special token and no pad token, and a GPT2LMHeadModel, both
written with save_pretrained. The tests run pretrained `gpt2`'s code paths on it, offline."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

from grpo_lab.tasks import ProblemStream

EOS = "<|endoftext|>"


def build_bpe_gpt2(folder: Path, vocab_size: int = 400, seed: int = 0) -> Path:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # as GPT-2
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    text = [p.prompt + p.answer for p in ProblemStream(seed + 99).sample(4000)]
    backend.train_from_iterator(text, trainer)
    tokenizer = GPT2TokenizerFast(tokenizer_object=backend, eos_token=EOS, bos_token=EOS,
                                  unk_token=EOS)
    assert tokenizer.pad_token is None  # like gpt2
    eos = tokenizer.convert_tokens_to_ids(EOS)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2,
                        n_head=2, bos_token_id=eos, eos_token_id=eos)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
