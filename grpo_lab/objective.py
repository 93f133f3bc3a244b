"""The GRPO objective, one small function per idea.

Shapes: B sequences (prompts x G), T = P + C tokens (left-padded prompt, then completion),
C completion positions, V vocabulary. Masks are 1 for real tokens, 0 for padding.

The objective (DeepSeekMath; TRL's GRPOTrainer), per completion token t of sequence i:

    r_it   = exp(logp_it - old_logp_it)                      ratio to the sampling policy
    L_it   = -min(r_it * A_i, clip(r_it, 1 - eps_low, 1 + eps_high) * A_i) + beta * k3_it
    k3_it  = exp(ref_logp_it - logp_it) - (ref_logp_it - logp_it) - 1

and the loss is a weighted sum of L over completion tokens, with weights set by loss_type.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) 0/1 mask -> (B, T) position ids that start at 0 on each row's first real
    token, so a left-padded prompt sees the same positions as an unpadded one."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """x in float32 when it is in a narrower float (bf16, fp16: a log-softmax over V there
    loses the small probabilities), else unchanged: float64 stays float64, so a float64
    model computes a float64 truth to compare float32 results with."""
    return x if x.dtype == torch.float64 else x.float()


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """(B, C, V) logits, (B, C) ids -> (B, C) log p(token) under softmax(logits)."""
    logp = at_least_float32(logits).log_softmax(dim=-1)
    return logp.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)


def scale_logits(logits: torch.Tensor, temperature: float = 1.0,
                 logit_clamp: float | None = None) -> torch.Tensor:
    """Raw logits -> the logits of the distribution the policy samples from and is trained
    on: divided by the temperature, then clamped to [-c, c] when logit_clamp is set. The
    sampler and every training and reference forward go through this one function, so
    they all mean the same distribution."""
    logits = logits / temperature
    return logits if logit_clamp is None else logits.clamp(-logit_clamp, logit_clamp)


def completion_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_length: int,
    temperature: float = 1.0,
    logit_clamp: float | None = None,
) -> torch.Tensor:
    """(B, T) ids and mask -> (B, C, V) scaled logits predicting the last C tokens, i.e.
    the logits the sampler drew each completion token from. One plain forward over the
    whole rows; `fast.shared_prompt_logits` gives the same with each prompt run once."""
    C = completion_length
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,  # one full forward: a KV cache would only cost memory
    ).logits  # (B, T, V)
    # position t predicts token t + 1: the C positions before each completion token
    return scale_logits(logits[:, -C - 1 : -1, :], temperature, logit_clamp)  # (B, C, V)


def completion_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_length: int,
    temperature: float = 1.0,
    logit_clamp: float | None = None,
) -> torch.Tensor:
    """(B, T) -> (B, C) log-probs of the completion tokens, scaled like the sampler, so at
    the sampling weights they equal the sampling-time log-probs."""
    logits = completion_logits(
        model, input_ids, attention_mask, completion_length, temperature, logit_clamp
    )
    return token_logprobs(logits, input_ids[:, -completion_length:])


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) logits -> (...) entropy of softmax(logits) in nats."""
    logp = at_least_float32(logits).log_softmax(dim=-1)
    return -(logp.exp() * logp).sum(-1)


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    advantage_eps: float = 1e-4,
    scale_rewards: bool = True,
) -> torch.Tensor:
    """(B,) rewards, consecutive groups of `group_size` >= 2 -> (B,) advantages.

    A_i = (r_i - mean(group)) / (std(group) + eps), std with Bessel's correction (as TRL).
    A group whose rewards are all equal gets A = 0 (it carries no signal), not NaN:
    that is what `advantage_eps` > 0 is for. scale_rewards=False only centres (Dr. GRPO).
    """
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} entries "
            f"(got shape {tuple(rewards.shape)})"
        )
    grouped = rewards.view(-1, group_size)  # (B/G, G)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_rewards:
        centred = centred / (grouped.std(dim=1, keepdim=True) + advantage_eps)
    return centred.reshape(-1)


# --- KL estimators (Schulman, "Approximating KL divergence") ---------------------------
# Samples come from the policy p; q is the reference. With log_r = ref_logp - logp:
#   k1 = -log_r               unbiased, high variance, can be negative
#   k2 = log_r**2 / 2         biased, low variance, >= 0
#   k3 = exp(log_r) - log_r - 1   unbiased, low variance, >= 0  (DeepSeekMath, TRL)


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (ref_logp - logp) ** 2


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    log_r = ref_logp - logp
    return torch.exp(log_r) - log_r - 1


def exact_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """(..., V), (..., V) -> (...) KL(p || q) = sum_v p_v (log p_v - log q_v), exactly,
    over the whole vocabulary: the quantity k1, k2, k3 estimate from one sample."""
    logp = logits.float().log_softmax(-1)
    logq = ref_logits.float().log_softmax(-1)
    return (logp.exp() * (logp - logq)).sum(-1)


def ratio_from_logprobs(
    logp: torch.Tensor, old_logp: torch.Tensor, log_ratio_clamp: float | None = None
) -> torch.Tensor:
    """(B, C), (B, C) -> (B, C) r = exp(logp - old_logp), the log-ratio optionally clamped
    to [-c, c] first so exp() cannot overflow."""
    log_ratio = logp - old_logp
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    return torch.exp(log_ratio)


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    log_ratio_clamp: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, C) log-probs now and at sampling, (B,) advantages -> ((B, C) per-token loss,
    (B, C) bool: token clipped by the trust region, as TRL's clip_ratio/region_mean).

    loss = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A), r = exp(logp - old_logp).
    """
    ratio = ratio_from_logprobs(logp, old_logp, log_ratio_clamp)
    adv = advantages.unsqueeze(-1)  # (B, 1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv
    per_token_loss = -torch.min(unclipped, clipped)
    region_clipped = ((ratio < 1 - epsilon_low) & (adv < 0)) | (
        (ratio > 1 + epsilon_high) & (adv > 0)
    )
    return per_token_loss, region_clipped


def token_weights(
    completion_mask: torch.Tensor,
    loss_type: str,
    max_completion_length: int,
    n_sequences: int | None = None,
    n_tokens: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """(B, C) mask of the *whole* batch -> (B, C) weights w with loss = sum(L * w).

    grpo:     mean over each sequence's tokens, then mean over sequences
    dr_grpo:  sum over tokens / (B * max_completion_length)
    bnpo:     sum over tokens / tokens in the batch
    dapo:     sum over tokens / tokens in the global accumulated batch
    (bnpo and dapo coincide here because the weights are always computed on the whole
    step batch; in TRL they differ under accumulation/DDP, where bnpo uses the local
    micro-batch count and so is not equal to the full-batch loss.)

    Computing the weights once on the whole batch and slicing them per micro-batch is
    what makes gradient accumulation equal to the full-batch gradient, whatever the
    micro-batches' token counts. Under DDP the mask is one rank's share and n_sequences,
    n_tokens give the global batch's rows and completion tokens (default: this mask's).
    """
    mask = completion_mask.float()
    n_seq = mask.shape[0] if n_sequences is None else n_sequences
    total_tokens = mask.sum() if n_tokens is None else torch.as_tensor(n_tokens).to(mask)
    if loss_type == "grpo":
        return mask / mask.sum(-1, keepdim=True).clamp(min=1.0) / n_seq
    if loss_type in ("bnpo", "dapo"):
        return mask / total_tokens.clamp(min=1.0)
    if loss_type == "dr_grpo":
        return mask / (n_seq * max_completion_length)
    raise ValueError(f"loss_type must be one of grpo, dr_grpo, bnpo, dapo (got {loss_type!r})")


def aggregate(
    per_token_loss: torch.Tensor,
    completion_mask: torch.Tensor,
    loss_type: str = "grpo",
    max_completion_length: int | None = None,
) -> torch.Tensor:
    """(B, C) per-token loss and mask -> scalar loss, aggregated as `loss_type` says."""
    max_len = max_completion_length or completion_mask.shape[1]
    return (per_token_loss * token_weights(completion_mask, loss_type, max_len)).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.float()
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def sequence_mean_nll(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor):
    """Supervised next-token loss over masked positions (used by the warm start)."""
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    return masked_mean(loss.view_as(targets), mask)


def weighted_loss(per_token: torch.Tensor, region_clipped: torch.Tensor,
                  log_ratio: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor | None,
                  weights: torch.Tensor, beta: float) -> tuple[torch.Tensor, dict]:
    """A surrogate's (b, C) per-token loss, plus beta * k3 when beta > 0, weighted by the
    token weights and summed; and the stats the step logs, token means over weights != 0:
    'kl', 'clip_ratio/region_mean', and 'log_ratio/max_abs' (the largest |log_ratio|, the
    (b, C) log-ratio the surrogate used, detached)."""
    m = weights != 0
    kl = torch.zeros_like(logp)
    if beta > 0:
        kl = kl_k3(logp, ref_logp)  # (b, C)
        per_token = per_token + beta * kl
    loss = (per_token * weights).sum()
    return loss, {
        "kl": masked_mean(kl.detach(), m),
        "clip_ratio/region_mean": masked_mean(region_clipped.float(), m),
        "log_ratio/max_abs": log_ratio.abs().masked_fill(~m, 0).max(),
    }
