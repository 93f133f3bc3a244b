"""The one configuration of the trainer, with its two presets.

Every safety measure is its own named switch, so "broken" (`naive`) and "stable" are two
presets of one trainer and a notebook can turn the fixes on one at a time:

    cfg = preset("naive", max_grad_norm=1.0)      # the naive run plus one fix
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOSS_TYPES = ("grpo", "dr_grpo", "bnpo", "dapo")
CHECKPOINT, METRICS = "checkpoint.pt", "metrics.jsonl"  # the files of a run directory
AMP_MODES = ("none", "bf16", "fp16")
PROFILES = ("cpu", "gpu")
PROFILE_MODELS = {"cpu": "tiny GPT-2", "gpu": "GPT-2 124M"}  # the model each profile trains


class ConfigError(ValueError):
    """A configuration value outside what is allowed; the message names the field."""


@dataclass
class GRPOConfig:
    # --- run ------------------------------------------------------------------------
    seed: int = 0
    """seed for prompts, sampling and initialisation; the same seed gives the same run"""
    steps: int = 200
    """number of optimizer steps (one sampled batch of prompts per step)"""
    profile: str | None = None
    """'cpu' (tiny GPT-2 shipped in the package) or 'gpu' (GPT-2 124M); None:
    $GRPO_LAB_PROFILE, else 'cpu' (also when CUDA is present)"""
    model_path: str | None = None
    """load the policy from this directory (save_pretrained layout) instead of the profile's"""
    device: str | None = None
    """'cpu', 'cuda', 'cuda:1'...; None: the profile's (cpu: 'cpu'; gpu: CUDA)"""

    # --- sampling -------------------------------------------------------------------
    prompts_per_step: int = 8
    """distinct prompts per step; each is sampled group_size times"""
    group_size: int = 8
    """G, completions per prompt; advantages are normalised within each group (>= 2)"""
    max_new_tokens: int = 5
    """completion length cap (TRL: max_completion_length); 0 is not allowed"""
    temperature: float = 1.0
    """sampling temperature; log-probs for training use the same temperature (> 0)"""
    top_k: int = 0
    """keep the k most likely tokens when sampling; 0 turns it off"""
    top_p: float = 1.0
    """nucleus sampling mass in (0, 1]; 1.0 turns it off"""

    # --- objective ------------------------------------------------------------------
    learning_rate: float = 3e-4
    """AdamW learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    beta: float = 0.04
    """KL coefficient against the frozen reference model (k3 estimator); 0 turns KL off
    and skips the reference forward pass"""
    epsilon_low: float = 0.2
    """the ratio is clipped from below at 1 - epsilon_low"""
    epsilon_high: float = 0.2
    """the ratio is clipped from above at 1 + epsilon_high (DAPO's clip-higher when larger)"""
    loss_type: str = "grpo"
    """token aggregation: 'grpo' (mean per sequence, then over sequences), 'dr_grpo'
    (sum / (sequences * max_new_tokens)), 'bnpo' and 'dapo' (sum / tokens in the batch)"""
    scale_rewards: bool = True
    """divide group-centred rewards by the group std (False: Dr. GRPO, centre only)"""
    advantage_eps: float = 1e-4
    """added to the group std so an all-equal group gives advantage 0, not NaN"""
    num_iterations: int = 1
    """mu, optimizer passes over each sampled batch; the ratio is against the sampling policy"""
    grad_accum_steps: int = 1
    """split each step's batch into this many micro-batches; the gradient is identical"""
    amp: str = "none"
    """mixed precision for the training and reference forwards: 'none', 'bf16', or 'fp16'
    (GradScaler); 'bf16' also samples under autocast (fp32 master weights throughout)"""
    mask_truncated_completions: bool = False
    """leave completions that hit max_new_tokens without end-of-text out of the loss (TRL's
    switch of the same name); they still count in their group's advantages"""
    gradient_checkpointing: bool = False
    """recompute each block's activations in the backward pass instead of keeping them:
    less memory for about one more forward per micro-batch; gradients are unchanged"""

    # --- the field reports' mistakes (naive preset) ---------------------------------------
    ratio_against: str = "old"
    """'old': ratio pi_theta / pi_old (the sampling policy), as in PPO/GRPO; 'reference':
    ratio against the frozen reference model, the bug in report 001 (000 is the same run)"""
    ratio_level: str = "token"
    """'token': one ratio per token (GRPO); 'sequence': the log-ratio summed over the
    completion into one ratio per sequence, as report 001's code did, which lets
    exp() overflow once the policy drifts (log-ratio ~ +-50 in the report)"""
    clip_term: str = "clipped_ratio"
    """'clipped_ratio': min(r*A, clip(r, 1-eps, 1+eps)*A); 'constant': min(r*A, eps*A),
    report 001's `clip_ratio * advantage` read with clip_ratio as the constant clip range,
    which leaves negative advantages unclipped (the report never defines clip_ratio)"""

    # --- safety switches (stable preset) ------------------------------------------------
    logit_clamp: float | None = None
    """clamp training logits to [-c, c] before log_softmax; None: off"""
    log_ratio_clamp: float | None = None
    """clamp log(pi_theta / pi_old) to [-c, c] before exp so the ratio cannot overflow"""
    advantage_clamp: float | None = None
    """clamp advantages to [-c, c]; None: off"""
    max_grad_norm: float | None = None
    """clip the global gradient norm to this value; None: no clipping"""
    skip_nonfinite_grad: bool = False
    """skip the update (and count it in `skipped`) when the gradient has NaN/inf"""
    spike_skip_factor: float | None = None
    """skip the update when the grad norm exceeds this many times the median of the last
    20 finite grad norms, skipped ones included (so a lasting change of scale is absorbed
    within 20 steps instead of freezing training behind a stale median); None: off"""
    health_check: bool = False
    """after each update check every parameter; on NaN/inf roll back to the last healthy
    snapshot: the weights and the optimizer state saved with it"""
    snapshot_every: int = 10
    """steps between in-memory snapshots of a healthy model, used for rollback"""
    check_rewards: bool = False
    """refuse a reward function's output when it raises, returns the wrong number of
    rewards, or a NaN/inf/non-number, with an error naming the function"""
    reward_timeout: float | None = None
    """with check_rewards: stop with a clear error when the reward function has not
    returned within this many seconds; None: wait forever"""
    safe_sampling: bool = False
    """sanitise logits (NaN -> -inf, +inf clamped) before sampling and raise a clear error
    if no token is left, instead of a multinomial crash; refuse prompt token ids outside
    the model's vocabulary before the embedding lookup does"""

    # --- logging and checkpoints --------------------------------------------------------
    eval_every: int = 50
    """greedy eval accuracy every this many steps (and at step 0 and the end); 0: only
    at step 0 and the end"""
    eval_size: int = 256
    """held-out problems scored greedily for `eval/accuracy`"""
    checkpoint_every: int = 50
    """steps between checkpoints in the output directory; 0: only at the end"""

    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    """free-form notes stored with the run (not used by the trainer)"""

    def __post_init__(self) -> None:
        validate(self)

    def replace(self, **changes: Any) -> GRPOConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GRPOConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"unknown config field {unknown[0]!r}; allowed: {', '.join(sorted(known))}"
            )
        return cls(**values)


# the devices a run may name (torch.device parses more, e.g. 'meta', which trains nothing)
DEVICE_PATTERN = r"cpu|cuda(:[0-9]+)?|mps"
DEVICE_RULE = "'cpu', 'cuda', 'cuda:N' or 'mps'"


def _is_device_name(device: Any) -> bool:
    return isinstance(device, str) and re.fullmatch(DEVICE_PATTERN, device) is not None


def resolve_profile(profile: str | None = None) -> str:
    """The profile to use: the argument, else $GRPO_LAB_PROFILE, else 'cpu'.

    'cpu' also on a machine with CUDA: the notebooks' claims are measured on the tiny GPT-2
    on every CI run, and on GPT-2 124M only when a GPU run is made (28 of 28 notebooks passed
    on an H200 on 2026-11-28, benchmarks/gpu/summary.json), so the gpu profile is chosen on
    purpose, never by the hardware found."""
    if profile is None:
        env = os.environ.get("GRPO_LAB_PROFILE", "").strip()
        if env:
            if env not in PROFILES:
                raise ConfigError(f"GRPO_LAB_PROFILE must be 'cpu' or 'gpu' (got {env!r})")
            return env
        return "cpu"
    if profile not in PROFILES:
        raise ConfigError(f"profile must be 'cpu' or 'gpu' (got {profile!r})")
    return profile


def check_device_name(device: Any) -> None:
    """ConfigError unless `device` is one a run may name; needs no torch (whether CUDA is
    there is models.resolve_device's to say)."""
    if not _is_device_name(device):
        raise ConfigError(f"device must be {DEVICE_RULE} (got {device!r})")


def saved_model_dir(path: str | Path) -> str | Path:
    """`path` when it holds a model saved with `save_pretrained` (its config.json), else
    ConfigError. Checked before torch loads, so a wrong --model-path is answered at once."""
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"model_path {str(path)!r} has no config.json (save_pretrained layout)")
    return path


def _fail(name: str, rule: str, value: Any) -> None:
    raise ConfigError(f"GRPOConfig.{name} must be {rule} (got {value!r})")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def validate(cfg: GRPOConfig) -> None:
    """Raise ConfigError naming the first field outside its allowed range."""
    ints = {  # name: minimum
        "seed": 0, "steps": 0, "prompts_per_step": 1, "group_size": 2, "max_new_tokens": 1,
        "top_k": 0, "num_iterations": 1, "grad_accum_steps": 1, "snapshot_every": 1,
        "eval_every": 0, "eval_size": 1, "checkpoint_every": 0,
    }
    for name, low in ints.items():
        v = getattr(cfg, name)
        if not _is_int(v) or v < low:
            _fail(name, f"an integer >= {low}", v)
    positive = ("learning_rate", "temperature", "advantage_eps")
    for name in positive:
        v = getattr(cfg, name)
        if not _is_number(v) or v <= 0:
            _fail(name, "a finite number > 0", v)
    for name in ("weight_decay", "beta"):
        v = getattr(cfg, name)
        if not _is_number(v) or v < 0:
            _fail(name, "a finite number >= 0", v)
    if not _is_number(cfg.epsilon_low) or not 0 <= cfg.epsilon_low < 1:
        _fail("epsilon_low", "in [0, 1) so that 1 - epsilon_low > 0", cfg.epsilon_low)
    if not _is_number(cfg.epsilon_high) or cfg.epsilon_high < 0:
        _fail("epsilon_high", "a finite number >= 0", cfg.epsilon_high)
    if not _is_number(cfg.top_p) or not 0 < cfg.top_p <= 1:
        _fail("top_p", "in (0, 1]", cfg.top_p)
    optional_positive = (
        "logit_clamp", "log_ratio_clamp", "advantage_clamp", "max_grad_norm", "reward_timeout",
    )
    for name in optional_positive:
        v = getattr(cfg, name)
        if v is not None and (not _is_number(v) or v <= 0):
            _fail(name, "None (off) or a finite number > 0", v)
    if cfg.spike_skip_factor is not None and (
        not _is_number(cfg.spike_skip_factor) or cfg.spike_skip_factor <= 1
    ):
        _fail("spike_skip_factor", "None (off) or a finite number > 1", cfg.spike_skip_factor)
    choices = {
        "loss_type": LOSS_TYPES, "amp": AMP_MODES,
        "ratio_against": ("old", "reference"), "ratio_level": ("token", "sequence"),
        "clip_term": ("clipped_ratio", "constant"),
    }
    for name, allowed in choices.items():
        v = getattr(cfg, name)
        if v not in allowed:
            _fail(name, "one of " + ", ".join(repr(a) for a in allowed), v)
    if cfg.profile is not None and cfg.profile not in PROFILES:
        _fail("profile", "None (automatic) or one of 'cpu', 'gpu'", cfg.profile)
    if cfg.device is not None and not _is_device_name(cfg.device):
        _fail("device", f"None (automatic), {DEVICE_RULE}", cfg.device)
    for name in ("skip_nonfinite_grad", "health_check", "safe_sampling", "scale_rewards",
                 "check_rewards", "gradient_checkpointing", "mask_truncated_completions"):
        if not isinstance(getattr(cfg, name), bool):
            _fail(name, "True or False", getattr(cfg, name))
    batch = cfg.prompts_per_step * cfg.group_size
    if cfg.grad_accum_steps > batch:
        _fail(
            "grad_accum_steps",
            f"<= prompts_per_step * group_size = {batch} so no micro-batch is empty",
            cfg.grad_accum_steps,
        )


# The field reports' starting point: ratio against the reference model, report 001's
# clipped term, no clamps, weak clipping, no health checks, a learning rate too high.
NAIVE = dict(
    learning_rate=1e-3,
    beta=0.05,
    temperature=0.8,
    top_p=0.9,
    max_new_tokens=25,
    ratio_against="reference",
    ratio_level="sequence",
    clip_term="constant",
    max_grad_norm=0.5,
)

# Every fix on, with the learning rate the tiny model tolerates.
STABLE = dict(
    learning_rate=1e-4,
    beta=0.01,
    log_ratio_clamp=10.0,
    max_grad_norm=1.0,
    skip_nonfinite_grad=True,
    spike_skip_factor=20.0,
    health_check=True,
    check_rewards=True,
    reward_timeout=60.0,
    safe_sampling=True,
)

PRESETS = {"naive": NAIVE, "stable": STABLE}

# What a preset changes under a profile. GPT-2 124M (the 124M architecture warm-started
# offline; pretrained `gpt2` not measured) at the stable preset's 1e-4 collapses in notebook
# 04's 150-step run (greedy accuracy 0.35 -> 0.02 on an H200) and improves at 1e-5 (0.35 ->
# 0.59): benchmarks/RESULTS.md, "GPU calibration". The naive preset breaks either way.
PROFILE_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "cpu": {},
    "gpu": {"stable": dict(learning_rate=1e-5)},
}


def preset(name: str, **overrides: Any) -> GRPOConfig:
    """A preset's config with `overrides` applied on top (validated). The preset's values
    are its profile's (PROFILE_PRESETS): the `profile` override, else $GRPO_LAB_PROFILE as
    it is now. The config keeps profile=None unless given one (the run resolves it again),
    so build it under the profile it will run with."""
    if name not in PRESETS:
        raise ConfigError(f"preset must be one of {', '.join(PRESETS)} (got {name!r})")
    profile = overrides.get("profile") or resolve_profile()  # a bad one: GRPOConfig says so
    for_profile = PROFILE_PRESETS.get(profile, {}).get(name, {})
    return GRPOConfig(**{**PRESETS[name], **for_profile, **overrides})
