"""Speed-ups beside the plain path, each tested equal to it (tests/test_fast.py).

The learner reads `objective.completion_logits`, `models` and a plain AdamW; the trainer
runs these instead where they give the same numbers faster:

- `shared_prompt_logits`: the G rows of a group run their prompt through the model once
  and share its keys and values; only the completions run per row. With prompts as long
  as the completions, about half the work.
- `fuse_gelu`: torch's one-kernel tanh GELU in place of GPT-2's five-op `gelu_new`.
- `fused_adamw`: AdamW as one fused kernel over all parameters (TRL's default too), and
  `keep_fused` to keep it fused when a checkpoint's param groups are loaded.
"""

from __future__ import annotations

import torch

from .objective import completion_logits, position_ids_from_mask, scale_logits
from .startup import gc_paused

with gc_paused():  # startup.py
    from transformers.activations import GELUTanh, NewGELUActivation


def shared_prompt_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_length: int,
    temperature: float = 1.0,
    logit_clamp: float | None = None,
) -> torch.Tensor:
    """`objective.completion_logits`, with each distinct prompt run once: (B, T) -> (B, C, V).

    The same logits and gradients up to float rounding. Needs the KV cache, so it falls
    back to the plain forward when the model returns none (activation checkpointing in
    train mode) or when no prompt repeats."""
    C = completion_length
    P = input_ids.shape[1] - C
    if P > 0:
        # one row per distinct prompt (ids and mask), and which of them each row uses
        prompts, row_prompt = torch.unique(
            torch.cat([input_ids[:, :P], attention_mask[:, :P]], 1), dim=0, return_inverse=True
        )  # (U, 2P), (B,)
        if len(prompts) < len(input_ids):
            logits = _logits_from_prompt_cache(
                model, input_ids, attention_mask, C, prompts[:, :P], prompts[:, P:], row_prompt
            )
            if logits is not None:
                return scale_logits(logits, temperature, logit_clamp)
    return completion_logits(model, input_ids, attention_mask, C, temperature, logit_clamp)


def _logits_from_prompt_cache(model, input_ids, attention_mask, C, prompt_ids, prompt_mask,
                              row_prompt) -> torch.Tensor | None:
    """(B, C, V) unscaled completion logits, each of the U distinct prompts run once; None
    when the model returns no KV cache."""
    P = prompt_ids.shape[1]
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask,
                position_ids=position_ids_from_mask(prompt_mask), use_cache=True)
    cache = out.cache
    if cache is None:
        return None
    cache.batch_select_indices(row_prompt)  # keys and values (U, ...) -> (B, ...), per row
    logits = out.logits[row_prompt, -1:]  # (B, 1, V): the prompt's last position predicts token 1
    if C > 1:  # completion tokens 1..C-1 predict tokens 2..C, attending to their prompt's cache
        position_ids = position_ids_from_mask(attention_mask)
        rest = model(
            input_ids=input_ids[:, P:-1], attention_mask=attention_mask[:, :-1],
            position_ids=position_ids[:, P:-1], cache=cache, use_cache=True,
        ).logits  # (B, C - 1, V)
        logits = torch.cat([logits, rest], dim=1)  # (B, C, V)
    return logits


class CompletionLogits(torch.nn.Module):
    """The training forward as one module, so that DDP, which expects one forward per
    backward, wraps both model calls of the shared-prompt path as one."""

    def __init__(self, model: torch.nn.Module, share_prompts: bool):
        super().__init__()
        self.model = model
        self.logits_fn = shared_prompt_logits if share_prompts else completion_logits

    def forward(self, input_ids, attention_mask, completion_length: int, temperature: float,
                logit_clamp: float | None) -> torch.Tensor:
        return self.logits_fn(self.model, input_ids, attention_mask, completion_length,
                              temperature, logit_clamp)


def fuse_gelu(model: torch.nn.Module) -> torch.nn.Module:
    """GPT-2's 'gelu_new' is the tanh-approximated GELU written as five elementwise ops (and
    as many again in backward); torch's gelu(approximate='tanh') is the same function in
    one kernel. Swap it in: the same outputs to ~5e-7, ~6% less time per step on the tiny
    model. (TRL patches its models too: a fused LM head.)"""
    for module in model.modules():
        for name, child in module.named_children():
            if type(child) is NewGELUActivation:
                setattr(module, name, GELUTanh())
    return model


def fused_adamw(params, device: torch.device, **kwargs) -> torch.optim.AdamW:
    """AdamW with one fused kernel for all parameters where the device has it: the same
    update, ~5x faster than the per-tensor loop on the tiny model."""
    return torch.optim.AdamW(params, fused=device.type in ("cpu", "cuda"), **kwargs)


def keep_fused(optimizer: torch.optim.Optimizer) -> None:
    """After load_state_dict: the saved param groups come back whole, 'fused' included, so
    a checkpoint written before AdamW was fused would switch it back (and with fp16
    GradScaler would then skip its unscale for an optimizer that does not do it itself).
    Keep this optimizer's own choice, with its step counters where the fused kernel wants
    them (float32, on the parameters' device)."""
    fused = optimizer.defaults.get("fused")
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = fused, optimizer.defaults.get("foreach")
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if fused and "step" in state:
                state["step"] = state["step"].to(p.device, torch.float32)
