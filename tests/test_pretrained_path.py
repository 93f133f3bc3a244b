"""Pretrained `gpt2`'s code paths without a hub (issue 30): a small GPT-2 with a byte-level
BPE tokenizer (tests/bpe_gpt2.py) goes through the loader, the warm start and its cache,
sampling, reward parsing and one GRPO step of the package's Trainer and of the learner's
step; pretrained and offline models are cached apart."""

import math

import pytest
import torch
from bpe_gpt2 import build_bpe_gpt2

from grpo_lab import policy
from grpo_lab.config import GRPOConfig
from grpo_lab.course import steps
from grpo_lab.models import build_char_tokenizer, load_pretrained_gpt2, prepare_tokenizer
from grpo_lab.sampling import sample_group
from grpo_lab.tasks import ProblemStream, addition_reward
from grpo_lab.trainer import Trainer


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    return build_bpe_gpt2(tmp_path_factory.mktemp("bpe-gpt2"))


def test_the_bpe_tokenizer_has_multi_digit_tokens_and_no_pad(bpe_dir):
    model, tok = load_pretrained_gpt2(str(bpe_dir))
    assert tok.pad_token_id == tok.eos_token_id and tok.padding_side == "left"
    pieces = tok.convert_ids_to_tokens(tok("77+40=117", add_special_tokens=False).input_ids)
    assert any(len(p) > 1 and p.isdigit() for p in pieces), pieces  # e.g. '77', '117'
    answers = [p.answer for p in ProblemStream(3).sample(50)]
    ids = tok(answers, add_special_tokens=False).input_ids
    assert [tok.decode(i) for i in ids] == answers  # what the reward compares, round trip
    assert min(map(len, ids)) < max(map(len, answers))  # fewer tokens than digits


def test_a_bpe_completion_is_parsed_and_scored_like_a_character_one(bpe_dir):
    """An answer's tokens then EOS, decoded as the sampler decodes a completion, score 1;
    the same cut off before EOS scores 0."""
    model, tok = load_pretrained_gpt2(str(bpe_dir))
    p = ProblemStream(5).sample(1)[0]
    ids = tok(p.answer, add_special_tokens=False).input_ids + [tok.eos_token_id]
    text = tok.decode(ids, skip_special_tokens=True)
    assert addition_reward([text], [p.answer], [False]) == [1.0]
    assert addition_reward([text], [p.answer], [True]) == [0.0]


def test_pretrained_warm_start_sampling_and_one_grpo_step(bpe_dir, tmp_path):
    """gpu_policy on the BPE model: the warm start runs on BPE batches and writes the
    pretrained cache (not the offline one); the cached model samples, its completions
    decode and score, and one step of Trainer and of the learner's step run on it."""
    model, tok = policy.gpu_policy(tmp_path, pretrained=str(bpe_dir), max_steps=6,
                                   check_every=3, log=lambda *_: None)
    cache = tmp_path / policy.PRETRAINED_CACHE
    assert (cache / "config.json").is_file() and (cache / "tokenizer.json").is_file()
    assert not (tmp_path / policy.OFFLINE_CACHE).exists()
    assert policy.gpu_cache_ready(tmp_path)

    torch.manual_seed(0)
    problems = ProblemStream(1).sample(4)
    rollout = sample_group(model.eval(), tok, [p.prompt for p in problems], 4, 5)
    assert len(rollout.completions) == 16 and rollout.completion_ids.max() < len(tok)
    rewards = addition_reward(rollout.completions, [p.answer for p in problems for _ in range(4)],
                              rollout.truncated.tolist())
    assert set(rewards) <= {0.0, 1.0}

    cfg = GRPOConfig(model_path=str(cache), steps=1, prompts_per_step=4, group_size=4,
                     eval_size=16, eval_every=0, checkpoint_every=0)
    m = Trainer(cfg).step()
    assert all(math.isfinite(m[k]) for k in ("loss", "grad_norm", "kl", "reward"))
    run = steps.new_run(cfg)
    metrics = steps.grpo_step(run, run.stream.sample(4), loss_fn=steps.grpo_loss)
    assert run.step_count == 1 and math.isfinite(metrics["loss"])


def test_pretrained_and_offline_models_are_cached_apart(bpe_dir, tmp_path, monkeypatch):
    """Offline first (no hub): the offline cache. Then the hub is reachable: the pretrained
    model is loaded and cached on its own, not the offline one reused; from then on the
    pretrained cache is what loads."""
    def tiny_offline():
        tok = prepare_tokenizer(build_char_tokenizer())
        return load_pretrained_gpt2(str(bpe_dir))[0], tok
    monkeypatch.setattr(policy, "offline_gpt2_124m", tiny_offline)
    warm = dict(max_steps=0, log=lambda *_: None)
    offline_tok = policy.gpu_policy(tmp_path, pretrained=str(tmp_path / "no-hub"), **warm)[1]
    assert (tmp_path / policy.OFFLINE_CACHE / "config.json").is_file()
    assert len(offline_tok) == len(build_char_tokenizer())  # the character vocabulary
    _, pre_tok = policy.gpu_policy(tmp_path, pretrained=str(bpe_dir), **warm)
    assert (tmp_path / policy.PRETRAINED_CACHE / "config.json").is_file()
    assert len(pre_tok) != len(offline_tok)  # the BPE vocabulary, not the character one
    again = policy.gpu_policy(tmp_path, pretrained=str(tmp_path / "no-hub"), **warm)[1]
    assert len(again) == len(pre_tok)
