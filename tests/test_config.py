import math

import pytest

from grpo_lab.config import ConfigError, GRPOConfig, preset

BAD_VALUES = [
    ("learning_rate", -1.0), ("learning_rate", 0.0), ("learning_rate", math.nan),
    ("learning_rate", "fast"), ("group_size", 1), ("group_size", 2.5),
    ("prompts_per_step", 0), ("max_new_tokens", 0), ("temperature", 0.0),
    ("temperature", math.inf), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1),
    ("beta", -0.1), ("epsilon_low", 1.0), ("epsilon_low", -0.1), ("epsilon_high", -0.2),
    ("loss_type", "ppo"), ("amp", "fp8"), ("num_iterations", 0), ("grad_accum_steps", 0),
    ("grad_accum_steps", 65), ("max_grad_norm", 0.0), ("max_grad_norm", -1.0),
    ("log_ratio_clamp", math.nan), ("spike_skip_factor", 1.0), ("ratio_against", "ref"),
    ("ratio_level", "batch"), ("clip_term", "clip"), ("profile", "tpu"),
    ("health_check", "yes"), ("steps", -1), ("seed", -3), ("advantage_eps", 0.0),
    ("eval_size", 0), ("snapshot_every", 0), ("device", "tpu:0"), ("device", "meta"),
    ("device", "cuda:x"), ("device", 0),
]


@pytest.mark.parametrize("device", [None, "cpu", "cuda", "cuda:1", "mps"])
def test_the_devices_a_run_may_name(device):
    assert GRPOConfig(device=device).device == device


@pytest.mark.parametrize("field,value", BAD_VALUES)
def test_bad_value_names_the_field(field, value):
    with pytest.raises(ConfigError, match=rf"GRPOConfig\.{field} must be"):
        GRPOConfig(**{field: value})


def test_defaults_and_presets_are_valid():
    GRPOConfig()
    assert preset("naive").ratio_against == "reference"
    stable = preset("stable")
    assert stable.ratio_against == "old" and stable.clip_term == "clipped_ratio"
    assert stable.health_check and stable.safe_sampling and stable.max_grad_norm


def test_preset_overrides_are_validated():
    assert preset("stable", beta=0.0).beta == 0.0
    with pytest.raises(ConfigError, match="group_size"):
        preset("stable", group_size=1)
    with pytest.raises(ConfigError, match="preset must be one of"):
        preset("bogus")


def test_a_preset_takes_its_profiles_values(monkeypatch):
    monkeypatch.delenv("GRPO_LAB_PROFILE", raising=False)
    assert preset("stable").learning_rate == 1e-4  # the tiny model's
    assert preset("stable", profile="gpu").learning_rate == 1e-5  # GPT-2 124M's
    assert preset("naive", profile="gpu").learning_rate == preset("naive").learning_rate
    monkeypatch.setenv("GRPO_LAB_PROFILE", "gpu")
    assert preset("stable").learning_rate == 1e-5
    assert preset("stable", profile="cpu").learning_rate == 1e-4
    assert preset("stable", learning_rate=3e-5).learning_rate == 3e-5  # an override wins
    with pytest.raises(ConfigError, match=r"GRPOConfig\.profile must be"):
        preset("stable", profile="tpu")
    monkeypatch.setenv("GRPO_LAB_PROFILE", "tpu")
    with pytest.raises(ConfigError, match="GRPO_LAB_PROFILE must be 'cpu' or 'gpu'"):
        preset("stable")


def test_from_dict_rejects_unknown_keys_and_round_trips():
    cfg = preset("stable", loss_type="dapo")
    assert GRPOConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown config field 'learning_rat'"):
        GRPOConfig.from_dict({"learning_rat": 1e-4})
