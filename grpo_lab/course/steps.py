"""The learner's trainer, reference edition: what notebooks 04 to 11 have the learner write.
The step runs in the engine's loop (`Trainer`), as the engine's own step does.

Notebook 04 builds one GRPO step from the learner's own pieces:

    completion_logprobs   (B, T) ids -> (B, C) log-probs of the completion tokens
    reinforce_loss        the first working stage: REINFORCE, group mean as baseline
    grpo_loss             clipped surrogate against pi_old + beta * k3 against the reference,
                          aggregated over tokens as cfg.loss_type says
    apply_update          grad norm, clipping, optimizer step
    grpo_step             sample, score, advantages, loss, backward, update, metrics

Every loss has the same signature, `loss_fn(logp, old_logp, ref_logp, advantages,
weights, cfg) -> (loss, stats)` (the engine's, step.py: weights are the batch's token
weights), and the step takes the loss and the update as arguments: a later notebook hardens the trainer by passing a better function, and the rest
of the learner's step stays theirs. The reference versions here are what a notebook runs
where an exercise is not implemented yet; they compute what `Trainer.step()` computes (at
mu = 1, one micro-batch), which notebook 11 checks to 1e-5.

`Run` (step.py) holds what a step works on; `new_run` is a `Trainer`'s run (same seed, same
model, same prompt stream), and `train` runs any step function in `Trainer`'s loop: a
progress bar, held-out evaluation and a callback, writing the history `plots.LivePlot` reads.
The engine's step (`step.grpo_step`) has the same signature and calls its loss the same way,
so a loss of the learner's trains in it too (micro-batches, mu > 1, DDP).
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from .. import naive
from ..config import GRPOConfig
from ..field.faults import LEARNER_FAULTS, with_fault  # noqa: F401  the notebooks' import
from ..models import frozen_copy
from ..objective import (
    clipped_surrogate,
    completion_logprobs,
    group_advantages,
    kl_k3,
    masked_mean,
    token_weights,
)
from ..sampling import SamplingError, SanitizeLogits, decode_loop, encode_prompts, sample_group
from ..step import Run, global_grad_norm, is_spike
from ..tasks import Problem, addition_reward
from ..trainer import StepError, Trainer, check_step_result, diagnosis  # noqa: F401

LossFn = Callable[..., tuple[torch.Tensor, dict]]


def new_run(cfg: GRPOConfig, reward_fn: Callable = addition_reward, model=None,
            tokenizer=None, fast: bool = True) -> Run:
    """A fresh run, built as `Trainer(cfg)` builds its own (it is one): the profile's policy
    (or `model`), its frozen copy as the reference, AdamW, the prompt stream, the same seeds.

    The models' GELU is torch's one-kernel version (`fast.fuse_gelu`), as in `Trainer(cfg)`:
    the same function to float rounding, and your step runs ~13% faster. `fast=False` keeps
    GPT-2's five-op `gelu_new`, for comparing with `Trainer(cfg, fast=False)` bit for bit."""
    run = Trainer(cfg, model, tokenizer, reward_fn, fast=fast).run
    if run.reference is None:  # the learner's step always computes the reference's log-probs
        run.reference = frozen_copy(run.policy)
    return run


# --- sampling, written out (notebook 01) ----------------------------------------------------
def sample_tokens(model, prompt_ids, prompt_mask, max_new_tokens: int, temperature: float,
                  eos_token_id: int, pad_token_id: int) -> torch.Tensor:
    """(B, P) left-padded prompt ids and mask -> (B, C) sampled completion ids, C <=
    max_new_tokens: `sampling.decode_loop` with every row on its own (no prompt sharing),
    no top-k / top-p: softmax(logits / temperature) at each row's last position, position
    ids from the mask, a KV cache, pad_token_id after a row's EOS, stop when all are done."""
    class Tokens:  # what decode_loop reads of a tokenizer
        pass

    tokens = Tokens()
    tokens.eos_token_id, tokens.pad_token_id = eos_token_id, pad_token_id
    with torch.no_grad():
        ids, _ = decode_loop(model, tokens, prompt_ids, prompt_mask, 1, max_new_tokens,
                             temperature, 0, 1.0, False)
    return ids


# --- the pieces of one step (notebook 04) --------------------------------------------------
# Every loss takes the batch's token weights (token_weights of the step's mask, 0 on padding):
# a loss is a weighted sum over tokens, so a micro-batch's loss is the same sum over its rows.
def reinforce_loss(logp, old_logp, ref_logp, advantages, weights, cfg):
    """REINFORCE with the group mean as baseline: the policy gradient, nothing else.

    logp (B, C) log-probs of the sampled tokens (with grad); advantages (B,); weights (B, C)
    the token weights (0 on padding). old_logp, ref_logp, cfg: unused (the signature every
    loss shares). returns (scalar loss, {}): -sum_it w_it A_i logp_it; with loss_type grpo,
    -1/B sum_i A_i * mean_t logp_it over each completion's tokens
    """
    return -(advantages.detach()[:, None] * logp * weights).sum(), {}


def grpo_loss(logp, old_logp, ref_logp, advantages, weights, cfg):
    """The GRPO loss of a batch (DeepSeekMath; TRL), from the pieces of notebook 03.

    logp (B, C) now, with grad; old_logp (B, C) pi_old, detached; ref_logp (B, C) the
    frozen reference; advantages (B,); weights (B, C) the token weights.
    returns (scalar loss, stats): loss = sum_it w_it (-min(r A, clip(r) A) + beta * k3_it);
    stats: 'kl' and 'clip_ratio/region_mean', means over the completion tokens (w > 0)
    """
    advantages = advantages.detach()  # constants of the step: the loss must not move them
    per_token, clipped = clipped_surrogate(logp, old_logp, advantages, cfg.epsilon_low,
                                           cfg.epsilon_high, cfg.log_ratio_clamp)  # (B, C)
    kl = kl_k3(logp, ref_logp)  # (B, C)
    loss = ((per_token + cfg.beta * kl) * weights).sum()
    tokens = weights > 0
    return loss, {"kl": masked_mean(kl.detach(), tokens).item(),
                  "clip_ratio/region_mean": masked_mean(clipped.float(), tokens).item()}


def reported_loss(logp, old_logp, ref_logp, advantages, weights, cfg):
    """Report 001's policy loss, as the course reads it (notebook 05), same signature:
    the log-ratio against the *reference*, summed over each completion, `exp` without a
    clamp, and the clipped term the constant clip range: -min(r A, eps_low A); plus
    beta * k3. stats: 'kl' and 'log_ratio/max_abs' (the largest |summed log-ratio|)."""
    tokens = weights > 0
    per_token, log_ratio = naive.reported_surrogate(  # (B, 1) each: one ratio per row
        logp, ref_logp, advantages.detach(), tokens, cfg.epsilon_low)
    kl = kl_k3(logp, ref_logp)  # (B, C)
    loss = ((per_token + cfg.beta * kl) * weights).sum()
    return loss, {"kl": masked_mean(kl.detach(), tokens).item(),
                  "log_ratio/max_abs": log_ratio.detach().abs().max().item()}


def report003_loss(logp, old_logp, ref_logp, advantages, weights, cfg):
    """grpo_loss with report 003's KL "fix" in place of k3 (notebook 09):
    kl = (ref_logp - logp).clamp(-10, 10).clamp(0, 10). stats: 'kl' (that number, what the
    report logged) and 'kl_k3' (k3 on the same tokens: the drift it no longer shows)."""
    per_token, clipped = clipped_surrogate(logp, old_logp, advantages.detach(), cfg.epsilon_low,
                                           cfg.epsilon_high, cfg.log_ratio_clamp)  # (B, C)
    kl = naive.report003_kl(logp, ref_logp)  # (B, C)
    loss = ((per_token + cfg.beta * kl) * weights).sum()
    tokens = weights > 0
    return loss, {"kl": masked_mean(kl.detach(), tokens).item(),
                  "kl_k3": masked_mean(kl_k3(logp, ref_logp).detach(), tokens).item(),
                  "clip_ratio/region_mean": masked_mean(clipped.float(), tokens).item()}


def clamped_reported_loss(logp, old_logp, ref_logp, advantages, weights, cfg):
    """reported_loss with the reports' first fix (notebook 06): the summed log-ratio clamped
    to [-cfg.log_ratio_clamp, cfg.log_ratio_clamp] before `exp`, so it cannot overflow."""
    tokens = weights > 0
    per_token, log_ratio = naive.reported_surrogate(
        logp, ref_logp, advantages.detach(), tokens, cfg.epsilon_low,
        cfg.log_ratio_clamp if cfg.log_ratio_clamp is not None else math.inf)
    kl = kl_k3(logp, ref_logp)  # (B, C)
    loss = ((per_token + cfg.beta * kl) * weights).sum()
    return loss, {"kl": masked_mean(kl.detach(), tokens).item(),
                  "log_ratio/max_abs": log_ratio.detach().abs().max().item()}


def clip_grad_norm(grads: list[torch.Tensor],
                   max_norm: float) -> tuple[list[torch.Tensor], float]:
    """torch.nn.utils.clip_grad_norm_ as a function of the gradients: (clipped copies, the
    global norm before clipping). A NaN norm makes the scale NaN, as in torch."""
    norm = global_grad_norm(grads)
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return [g * scale.to(g.dtype) for g in grads], float(norm)


def should_skip(grad_norm: float, recent, factor: float) -> bool:
    """The trainer's skip rule (step.guarded_update with skip_nonfinite_grad and
    spike_skip_factor): skip a non-finite norm, and a spike (step.is_spike: above factor x
    the median of the recent norms, once there are SPIKE_MIN_HISTORY of them)."""
    return not math.isfinite(grad_norm) or is_spike(grad_norm, recent, factor)


def guarded_update(run: Run) -> tuple[float, int]:
    """apply_update with the skip rule (notebook 06), from the notebook's two exercises
    (`clip_grad_norm`, `should_skip`): the grad norm before clipping; skip the update (clear
    the gradients, step nothing) when it is not finite, or when it is more than
    cfg.spike_skip_factor x the median of run.recent_grad_norms once 5 are known; every
    finite norm joins run.recent_grad_norms, skipped ones too; else write the clipped
    gradients back and step. Returns (grad_norm, skipped: 0 or 1), as the engine's `step.guarded_update`."""
    cfg = run.cfg
    params = [p for p in run.policy.parameters() if p.grad is not None]
    max_norm = cfg.max_grad_norm if cfg.max_grad_norm is not None else math.inf
    factor = cfg.spike_skip_factor if cfg.spike_skip_factor is not None else math.inf
    clipped, grad_norm = clip_grad_norm([p.grad for p in params], max_norm)
    skip = should_skip(grad_norm, run.recent_grad_norms, factor)
    if math.isfinite(grad_norm):
        run.recent_grad_norms.append(grad_norm)  # skipped norms count too
    if skip:
        run.optimizer.zero_grad(set_to_none=True)
        return grad_norm, 1
    for p, g in zip(params, clipped, strict=True):
        p.grad = g
    run.optimizer.step()
    return grad_norm, 0


def apply_update(run: Run) -> tuple[float, int]:
    """The update after backward: the global grad norm (before clipping), clipping to
    cfg.max_grad_norm when it is set, the optimizer step. Returns (grad_norm, skipped=0)."""
    params = [p for p in run.policy.parameters() if p.grad is not None]
    max_norm = run.cfg.max_grad_norm if run.cfg.max_grad_norm is not None else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm).item()
    run.optimizer.step()
    return grad_norm, 0


def sample_and_score(run: Run, problems: list[Problem], sample_fn: Callable = sample_group):
    """The part of a step before the loss: sample G completions per prompt with the current
    policy, score them (answers repeated G times in a row: rows are grouped by prompt), the
    group advantages, and the frozen reference's log-probs. Returns (rollout, rewards (B,),
    advantages (B,), ref_logp (B, C))."""
    cfg, G = run.cfg, run.cfg.group_size
    rollout = sample_fn(run.policy, run.tokenizer, [p.prompt for p in problems], G,
                        cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p)
    answers = [p.answer for p in problems for _ in range(G)]
    rewards = torch.tensor(run.reward_fn(rollout.completions, answer=answers,
                                         truncated=rollout.truncated.tolist()),
                           dtype=torch.float32, device=rollout.input_ids.device)  # (B,)
    advantages = group_advantages(rewards, G, cfg.advantage_eps, cfg.scale_rewards)  # (B,)
    with torch.no_grad():
        ref_logp = completion_logprobs(run.reference, rollout.input_ids, rollout.attention_mask,
                                       rollout.completion_length, cfg.temperature)  # (B, C)
    return rollout, rewards, advantages, ref_logp


def step_metrics(run: Run, rewards, completion_mask, loss: float, grad_norm: float,
                 skipped: int, stats: dict) -> dict:
    """A step's metrics, TRL's names; the loss's own stats (kl, clip_ratio/region_mean, ...)
    as they are."""
    groups = rewards.view(-1, run.cfg.group_size)
    return {"step": run.step_count, "reward": rewards.mean().item(),
            "reward_std": rewards.std().item(),
            "frac_reward_zero_std": (groups.std(dim=1) == 0).float().mean().item(),
            "loss": loss, "kl": 0.0, "grad_norm": grad_norm,
            "completions/mean_length": completion_mask.sum(-1).float().mean().item(),
            "skipped": skipped, **stats}


def grpo_step(run: Run, problems: list[Problem], loss_fn: LossFn,
              update_fn: Callable = apply_update, sample_fn: Callable = sample_group) -> dict:
    """One GRPO step at mu = 1: sample, score, advantages, loss, backward, update, metrics.
    `problems`: the step's prompts_per_step problems; `loss_fn`: reinforce_loss, grpo_loss
    or a later notebook's; `update_fn`: what runs after backward; `sample_fn`: the sampler,
    called as sample_group is. Returns the metrics."""
    cfg = run.cfg
    rollout, rewards, advantages, ref_logp = sample_and_score(run, problems, sample_fn)
    ids, attention, C = rollout.input_ids, rollout.attention_mask, rollout.completion_length
    mask = rollout.completion_mask  # (B, C)
    weights = token_weights(mask, cfg.loss_type, cfg.max_new_tokens)  # (B, C), 0 on padding
    run.optimizer.zero_grad(set_to_none=True)
    logp = completion_logprobs(run.policy, ids, attention, C, cfg.temperature)  # (B, C)
    # pi_old is the policy that sampled, i.e. this forward, detached: the ratio starts at 1
    loss, stats = loss_fn(logp, logp.detach(), ref_logp, advantages, weights, cfg)
    loss.backward()
    grad_norm, skipped = update_fn(run)
    run.step_count += 1
    return step_metrics(run, rewards, mask, loss.item(), grad_norm, skipped, stats)


def sanitize_logits(logits: torch.Tensor) -> torch.Tensor:
    """The package's SanitizeLogits as a function of the logits alone, raising ValueError."""
    try:
        return SanitizeLogits()(torch.zeros(logits.shape[0], 0, dtype=torch.long), logits)
    except SamplingError as e:
        raise ValueError(str(e)) from None


def safe_sample(model, tokenizer, prompts: list[str], group_size: int, max_new_tokens: int,
                temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """sample_group made safe (notebook 10): refuse a token id the embedding has no row for,
    in the prompts or as the pad token that fills finished completions (report 002), with a
    ValueError naming the id and the table's size; and sanitise every step's logits
    (sanitize_logits: NaN -> -inf, +inf -> the largest float, a row with
    nothing finite left -> ValueError) before sampling."""
    ids, _ = encode_prompts(tokenizer, prompts, next(model.parameters()).device)
    rows = model.get_input_embeddings().num_embeddings
    for what, i in (("the pad token's id", tokenizer.pad_token_id),
                    ("prompt token id", int(ids.max()))):
        if i is not None and not 0 <= i < rows:
            raise ValueError(f"{what} {i} has no row in the embedding ({rows} rows): a pad "
                             "token added to the tokenizer but not to the model?")
    return sample_group(model, tokenizer, prompts, group_size, max_new_tokens, temperature,
                        top_k, top_p, sanitize=sanitize_logits)


# --- reading runs (notebooks 05 and 11) -----------------------------------------------------
def diagnose(history: list[dict]) -> dict:
    """A crashed run's metrics -> what broke and when (notebook 05). Rows may lack keys.

    returns {"first_bad_step": the first step with nonfinite_params > 0, or None;
             "last_healthy_step": the last step before it (the last step when none broke;
                                  None when the first row already broke);
             "max_grad_norm": the largest finite grad_norm up to the last healthy step;
             "max_log_ratio": the largest log_ratio/max_abs up to the last healthy step}
    (the two maxima 0.0 when no row has the key)"""
    bad = next((m["step"] for m in history if m.get("nonfinite_params", 0) > 0), None)
    before = [m for m in history if bad is None or m["step"] < bad]
    norms = [m["grad_norm"] for m in before if "grad_norm" in m and math.isfinite(m["grad_norm"])]
    ratios = [m["log_ratio/max_abs"] for m in before if "log_ratio/max_abs" in m]
    return {"first_bad_step": bad, "last_healthy_step": max((m["step"] for m in before), default=None),
            "max_grad_norm": max(norms, default=0.0), "max_log_ratio": max(ratios, default=0.0)}


def compare_histories(yours: list[dict], theirs: list[dict], keys) -> dict[str, float]:
    """Two runs' metrics, row by row -> for each key the largest |yours - theirs| over the
    steps both runs logged it at (matched by "step"); inf where one value is NaN and the
    other is not, 0 where both are NaN (notebook 11)."""
    gaps = {}
    for k in keys:
        gaps[k] = max((0.0 if a != a and b != b else math.inf if (a != a) != (b != b)
                       else abs(a - b) for a, b in matched_pairs(yours, theirs, k)), default=0.0)
    return gaps


def matched_pairs(yours: list[dict], theirs: list[dict], key: str) -> list[tuple]:
    """(your value, their value) of `key` at each step both runs logged it at."""
    by_step = {m["step"]: m for m in theirs}
    return [(m[key], by_step[m["step"]][key]) for m in yours
            if key in m and key in by_step.get(m["step"], {})]


# --- the harness -----------------------------------------------------------------------------
def _exercise_names() -> set[str]:
    manifest = json.loads(Path(__file__).with_name("exercises.json").read_text())
    return {e["function"] for nb in manifest["notebooks"].values() for e in nb["exercises"]}


def whose(fn) -> str:
    """'grpo_loss (yours)', 'grpo_loss (yours, notebook 04)' or 'grpo_loss (reference)'."""
    if isinstance(fn, partial):  # e.g. healthy_update around guarded_update
        inner = [whose(v) for v in fn.keywords.values() if callable(v)]
        return whose(fn.func) + (" around " + ", ".join(inner) if inner else "")
    name = getattr(fn, "__name__", type(fn).__name__)
    module = getattr(fn, "__module__", None) or ""
    if module.startswith("grpo_lab"):
        return f"{name} (reference)"
    if module.startswith("yours_"):
        return f"{name} (yours, notebook {module[6:8]})"
    return f"{name} (yours)"


def _passed_functions(step_fn: Callable) -> tuple[Callable, dict[str, Callable]]:
    """(the step function, {argument: function}) for the functions a step is given: bound
    with functools.partial, or its parameters' callable defaults."""
    fn, bound = (step_fn.func, step_fn.keywords) if isinstance(step_fn, partial) else (step_fn, {})
    try:
        defaults = {k: p.default for k, p in inspect.signature(fn).parameters.items()
                    if p.default is not inspect.Parameter.empty and callable(p.default)}
    except (TypeError, ValueError):
        defaults = {}
    return fn, {k: v for k, v in {**defaults, **bound}.items() if callable(v)}


def functions_underneath(step_fn: Callable) -> list[Callable]:
    """The exercise functions a step runs below the ones it is given: those the code of the
    step and of the functions passed to it calls by name, and, in the learner's code, those
    their code calls, all the way down (each once, in the order first met). The package's
    own functions are the reference all the way down: their callees are not listed."""
    exercises, out, seen = _exercise_names(), [], set()
    fn, passed = _passed_functions(step_fn)

    def visit(f, listed: bool) -> None:
        if isinstance(f, partial):
            visit(f.func, listed)
            for v in f.keywords.values():
                if callable(v):
                    visit(v, True)
            return
        if id(f) in seen or not callable(f):
            return
        seen.add(id(f))
        if listed:
            out.append(f)
        if (getattr(f, "__module__", None) or "").startswith("grpo_lab") and listed:
            return
        code, scope = getattr(f, "__code__", None), getattr(f, "__globals__", {})
        for name in (code.co_names if code else ()):
            if name in exercises and callable(scope.get(name)):
                visit(scope[name], True)

    visit(fn, False)
    for f in passed.values():
        visit(f, False)
    return out


def describe_step(step_fn: Callable) -> str:
    """Which functions a step runs, and whose they are: the step, the functions passed to
    it, and every exercise function underneath (functions_underneath)."""
    fn, passed = _passed_functions(step_fn)
    parts = [whose(fn)] + [f"{k}={whose(v)}" for k, v in passed.items()]
    below = functions_underneath(step_fn)
    if below:
        parts.append("underneath: " + ", ".join(whose(f) for f in below))
    return "; ".join(parts)


def step_label(step_fn: Callable) -> str:
    """What a run of this step is called on its progress bar: 'your GRPO' when every
    function in it is yours, 'the reference GRPO' when none is (yours did not pass its
    checks, or is not written yet), 'your GRPO, part reference' in between."""
    fn, passed = _passed_functions(step_fn)
    parts = [fn, *passed.values(), *functions_underneath(step_fn)]
    exercises = _exercise_names()  # the package's own helpers (sample_group) do not count
    flat = [f for p in parts for f in ([p.func, *p.keywords.values()] if isinstance(p, partial)
                                       else [p]) if getattr(f, "__name__", None) in exercises]
    reference = [(getattr(f, "__module__", None) or "").startswith("grpo_lab") for f in flat]
    if all(reference):
        return "the reference GRPO"
    return "your GRPO, part reference" if any(reference) else "your GRPO"


def train(run: Run, step_fn: Callable, steps: int | None = None,
          eval_every: int | None = None, progress: bool = True, callback=None,
          metrics_path: str | Path | None = None, verbose: bool = True) -> list[dict]:
    """Call `step_fn(run, problems)` until `steps` (default cfg.steps) steps are done, in
    `Trainer`'s loop: prompts drawn as Trainer draws them, greedy accuracy at step 0, every
    `eval_every` (default cfg.eval_every) steps and at the end. Appends each step's metrics
    to run.history (with 'step_time', 'nonfinite_params' (NaN/inf parameter entries after
    the step: the loop watches, it does not act) and, where evaluated, 'eval/accuracy') and
    returns it; with `metrics_path`, also writes each row there as a JSON line as soon as it
    is done. `verbose`: print which functions the run calls, and whose (describe_step)."""
    total = run.cfg.steps if steps is None else steps
    if verbose:
        print(f"training: {describe_step(step_fn)}, {total - run.step_count} steps")
    loop = Trainer.around(run, step_fn, metrics_path=metrics_path)
    return loop.train(total, progress=progress, callback=callback, eval_every=eval_every,
                      desc=step_label(step_fn))
