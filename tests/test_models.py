"""Profiles, the shipped tiny model, pretrained loading from a local save_pretrained dir."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from grpo_lab.config import ConfigError, preset, resolve_profile
from grpo_lab.course.steps import new_run
from grpo_lab.models import (
    TINY_MODEL_DIR,
    build_char_tokenizer,
    count_parameters,
    load_pretrained_gpt2,
    requested_device,
    resolve_device,
)
from grpo_lab.numerics import float64_logprobs, logprob_allowance
from grpo_lab.objective import completion_logprobs
from grpo_lab.policy import load_policy
from grpo_lab.sampling import greedy_accuracy, sample_group
from grpo_lab.tasks import eval_problems
from grpo_lab.trainer import Trainer


def test_profile_selection(monkeypatch):
    monkeypatch.setenv("GRPO_LAB_PROFILE", "gpu")
    assert resolve_profile() == "gpu"
    assert resolve_profile("cpu") == "cpu"
    monkeypatch.setenv("GRPO_LAB_PROFILE", "tpu")
    with pytest.raises(ConfigError, match="GRPO_LAB_PROFILE"):
        resolve_profile()
    monkeypatch.delenv("GRPO_LAB_PROFILE")
    assert resolve_profile() == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_profile() == "cpu"  # chosen on purpose, never by the hardware found


def test_the_device_follows_the_profile(monkeypatch):
    # a machine with CUDA: the tiny model's runs stay on the CPU, where the notebooks'
    # claims are measured; the gpu profile asks for CUDA (None: a launcher's rank decides)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("GRPO_LAB_PROFILE", raising=False)
    assert requested_device(None, None) == "cpu"
    assert resolve_device() == torch.device("cpu")
    assert requested_device(None, "gpu") is None
    assert resolve_device(None, "gpu") == torch.device("cuda")
    assert requested_device("cuda:1", "cpu") == "cuda:1"  # a named device wins
    assert resolve_device("cpu", "gpu") == torch.device("cpu")
    monkeypatch.setenv("GRPO_LAB_PROFILE", "gpu")
    assert resolve_device() == torch.device("cuda")
    with pytest.raises(ConfigError, match="device must be"):
        resolve_device("tpu")


def test_runs_train_on_the_cpu_beside_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("GRPO_LAB_PROFILE", raising=False)
    cfg = preset("stable", steps=1, eval_size=8)
    assert Trainer(cfg).device == torch.device("cpu")
    assert next(new_run(cfg).policy.parameters()).device == torch.device("cpu")
    monkeypatch.setenv("GRPO_LAB_PROFILE", "gpu")  # the config's own profile decides
    cfg = cfg.replace(profile="cpu")
    assert Trainer(cfg).device == torch.device("cpu")
    assert next(new_run(cfg).policy.parameters()).device == torch.device("cpu")


@pytest.mark.numerics
def test_shipped_tiny_model_is_small_and_partly_right(tiny):
    model, tok = tiny
    assert 0.5e6 < count_parameters(model) < 1.5e6
    assert (TINY_MODEL_DIR / "model.safetensors").stat().st_size < 5e6
    acc = greedy_accuracy(model, tok, eval_problems(256), 5)
    assert 0.30 <= acc <= 0.60, acc  # room for RL, and reward variance from step 0


def test_char_tokenizer_round_trip_and_specials():
    tok = build_char_tokenizer()
    ids = tok("12+34=", add_special_tokens=False).input_ids
    assert len(ids) == 6 and tok.decode(ids) == "12+34="
    assert tok.eos_token_id == 0 and tok.pad_token_id == 1 and tok.padding_side == "left"


def _gpt2_like_dir(tmp_path):
    """A tiny GPT-2 saved like the hub's `gpt2`: a tokenizer with no pad token."""
    char = build_char_tokenizer()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=char.backend_tokenizer, eos_token="<|endoftext|>",
        bos_token="<|endoftext|>", unk_token="<|endoftext|>",
    )
    assert tok.pad_token is None
    cfg = GPT2Config(vocab_size=len(char), n_positions=32, n_embd=32, n_layer=2, n_head=2,
                     bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.numerics
def test_pretrained_loader_reads_a_local_save_pretrained_dir(tmp_path):
    model, tok = load_pretrained_gpt2(str(_gpt2_like_dir(tmp_path)))
    assert isinstance(model, GPT2LMHeadModel)
    assert tok.pad_token_id == tok.eos_token_id  # GPT-2 has no pad token: reuse EOS
    assert tok.padding_side == "left"
    # pad == eos: completion masks still end at the first EOS and log-probs still agree
    rollout = sample_group(model.eval(), tok, ["1+2=", "12+34="], 2, 6)
    again = completion_logprobs(
        model, rollout.input_ids, rollout.attention_mask, rollout.completion_length
    ) * rollout.completion_mask
    truth = float64_logprobs(model, rollout.input_ids, rollout.attention_mask,
                             rollout.completion_length)
    allowed = logprob_allowance(rollout.sampling_logprobs, truth, rollout.completion_mask)
    assert (again.double() - truth)[rollout.completion_mask.bool()].abs().max() <= allowed
    model2, _ = load_policy(model_path=tmp_path)
    assert count_parameters(model2) == count_parameters(model)


def test_pretrained_loader_offline_names_the_fallback(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert load_pretrained_gpt2(str(tmp_path / "not-a-model")) is None
    assert "falling back to the GPT-2 124M architecture" in capsys.readouterr().out
    assert load_pretrained_gpt2(str(tmp_path / "not-a-model")) is None  # asked again: said once
    assert capsys.readouterr().out == ""


def test_pretrained_loader_loads_a_directory_saved_after_a_miss(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert load_pretrained_gpt2(str(tmp_path / "later")) is None
    _gpt2_like_dir(tmp_path / "later")
    model, tok = load_pretrained_gpt2(str(tmp_path / "later"))
    assert count_parameters(model) > 0 and tok.pad_token_id is not None


def test_model_path_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_policy(model_path=tmp_path)


def test_gpu_profile_without_cuda_is_a_clear_error(monkeypatch, tmp_path):
    import grpo_lab.policy as policy

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(policy, "CACHE_DIR", tmp_path / "none")
    with pytest.raises(ConfigError, match="GRPO_LAB_PROFILE=cpu"):
        load_policy("gpu")


def test_completion_longer_than_the_model_is_refused(tiny):
    from grpo_lab.config import preset
    from grpo_lab.trainer import Trainer

    model, tok = tiny
    with pytest.raises(ConfigError, match="max_new_tokens must be <= 26"):
        Trainer(preset("stable", max_new_tokens=27), model, tok)
    Trainer(preset("stable", max_new_tokens=26), model, tok)


def test_a_training_step_uses_this_transformers_cache_api(caplog):
    """No deprecation from transformers in what a learner sees: the sampler and the
    shared-prompt forward pass the KV cache under the name this version takes."""
    import logging
    import warnings

    from grpo_lab import preset
    from grpo_lab.trainer import Trainer

    trainer = Trainer(preset("stable", steps=1, eval_size=4))
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING):
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        trainer.step()
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()], caplog.text
