"""Speed-ups beside the plain path, each tested equal to it (tests/test_fast.py).

The learner reads `objective.completion_logits`, `models` and a plain AdamW; the trainer
runs these instead where they give the same numbers faster:

- `shared_prompt_logits`: the G rows of a group run their prompt through the model once
  and share its keys and values; only the completions run per row. With prompts as long
  as the completions, about half the work.
- `fuse_gelu`: torch's one-kernel tanh GELU in place of GPT-2's five-op `gelu_new`.
- `fused_adamw`: AdamW as one fused kernel over all parameters (TRL's default too), and
  `keep_fused` to keep it fused when a checkpoint's param groups are loaded.
- `cached_forward`: GPT-2's forward written out over the model's own modules, for the
  sampler and the shared-prompt forwards, without transformers' per-call machinery (mask
  building, cache objects, output records, and the module calls of its Conv1D and
  LayerNorm layers where no hook could tell): on the tiny model that machinery costs as
  much as the arithmetic of a decode step. Any other model keeps transformers' forward.
"""

from __future__ import annotations

import weakref
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.modules import module as torch_module

from .objective import completion_logits, position_ids_from_mask, scale_logits
from .startup import gc_paused

with gc_paused():  # startup.py
    from transformers.activations import GELUTanh, NewGELUActivation
    from transformers.pytorch_utils import Conv1D


def shared_prompt_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_length: int,
    temperature: float = 1.0,
    logit_clamp: float | None = None,
    run_forward=None,
) -> torch.Tensor:
    """`objective.completion_logits`, with each distinct prompt run once: (B, T) -> (B, C, V).

    The same logits and gradients up to float rounding. Needs the KV cache, so it falls
    back to the plain forward when the model returns none (activation checkpointing in
    train mode) or when no prompt repeats. `run_forward`, for gpt2_forward's models: called
    as run_forward(fn, model, *tensors) to run the forward from the distinct prompts
    (`graphs.graphed`: as a CUDA graph where that applies); None: fn(model, *tensors)."""
    C = completion_length
    P = input_ids.shape[1] - C
    if P > 0:
        # one row per distinct prompt (ids and mask), and which of them each row uses
        prompts, row_prompt = torch.unique(
            torch.cat([input_ids[:, :P], attention_mask[:, :P]], 1), dim=0, return_inverse=True
        )  # (U, 2P), (B,)
        if len(prompts) < len(input_ids):
            args = (input_ids, attention_mask, prompts[:, :P], prompts[:, P:], row_prompt)
            if run_forward is not None and writes_out(model):
                logits = run_forward(_logits_from_prompt_cache, model, *args)
            else:
                logits = _logits_from_prompt_cache(model, *args)
            if logits is not None:
                return scale_logits(logits, temperature, logit_clamp)
    return completion_logits(model, input_ids, attention_mask, C, temperature, logit_clamp)


def _logits_from_prompt_cache(model, input_ids, attention_mask, prompt_ids, prompt_mask,
                              row_prompt) -> torch.Tensor | None:
    """(B, C, V) unscaled completion logits, each of the U distinct prompts run once; None
    when the model returns no KV cache."""
    P = prompt_ids.shape[1]
    C = input_ids.shape[1] - P
    forward = cached_forward(model)
    logits, cache = forward(prompt_ids, prompt_mask, position_ids_from_mask(prompt_mask))
    if cache is None:
        return None
    cache = select_rows(cache, row_prompt)  # keys and values (U, ...) -> (B, ...), per row
    if isinstance(cache, list):  # gpt2_forward's: a row's keys and values get their gradient
        # as a slice of the attention's cat; index_select's backward sums it ~1.5x faster whole
        for t in (t for kv in cache for t in kv if t.requires_grad):
            t.register_hook(torch.Tensor.contiguous)
    logits = logits[:, -1:].index_select(0, row_prompt)  # (B, 1, V): each prompt's last
    # position predicts its rows' token 1
    if C > 1:  # completion tokens 1..C-1 predict tokens 2..C, attending to their prompt's cache
        position_ids = position_ids_from_mask(attention_mask)
        rest, _ = forward(input_ids[:, P:-1], attention_mask[:, :-1], position_ids[:, P:-1],
                          cache)  # (B, C - 1, V)
        logits = torch.cat([logits, rest], dim=1)  # (B, C, V)
    return logits


# ---- GPT-2's forward, written out --------------------------------------------------------
def cached_forward(model: torch.nn.Module):
    """The forward the sampler and the shared-prompt path call:
    (ids (B, T), key mask (B, S), position ids (B, T), cache or None) -> (logits (B, T, V),
    cache), where the cache holds the keys and values of all S columns (None: the model kept
    none). `gpt2_forward` where it computes what transformers' forward computes (`writes_out`),
    else transformers' forward with its own cache object."""
    if writes_out(model):
        return lambda ids, mask, positions, cache=None: gpt2_forward(model, ids, mask,
                                                                    positions, cache)

    def transformers_forward(ids, mask, positions, cache=None):
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                    use_cache=True)
        return out.logits, out.cache
    return transformers_forward


def select_rows(cache, rows: int | torch.Tensor):
    """The cache with the keys and values of the rows `rows` names: each row's prompt (B,),
    g for g consecutive rows per prompt, or (in the sampler) the rows still drawing, by
    their place in the cache."""
    if isinstance(cache, list):  # gpt2_forward's: (keys, values) per layer
        if isinstance(rows, int):
            return [(k.repeat_interleave(rows, 0), v.repeat_interleave(rows, 0)) for k, v in cache]
        return [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in cache]
    if isinstance(rows, int):  # transformers' Cache, in place
        cache.batch_repeat_interleave(rows)
    else:
        cache.batch_select_indices(rows)
    return cache


def writes_out(model: torch.nn.Module) -> bool:
    """gpt2_forward reproduces this model's forward: a GPT2LMHeadModel with no dropout
    active, no activation checkpointing active, and none of the options it leaves out
    (cross-attention, per-layer attention scaling, upcast attention)."""
    if type(model).__name__ != "GPT2LMHeadModel":
        return False
    cfg = model.config
    if (cfg.add_cross_attention or cfg.scale_attn_by_inverse_layer_idx
            or cfg.reorder_and_upcast_attn):
        return False
    if not model.training:
        return True
    dropouts, checkpointed = _switches(model)
    return not (any(m.p > 0 for m in dropouts) or any(m.gradient_checkpointing
                                                      for m in checkpointed))


_SWITCHES = weakref.WeakKeyDictionary()


def _switches(model: torch.nn.Module) -> tuple[list, list]:
    """The model's dropout modules and the modules that can checkpoint activations, found
    once per model (a walk over every module, as `is_activation_checkpointing` makes, costs
    more than a decode step's bookkeeping); their settings are read at each call."""
    if model not in _SWITCHES:
        modules = list(model.modules())
        _SWITCHES[model] = ([m for m in modules if isinstance(m, torch.nn.Dropout)],
                            [m for m in modules if hasattr(m, "gradient_checkpointing")])
    return _SWITCHES[model]


def gpt2_forward(model, input_ids, attention_mask, position_ids, cache=None, write_at=None):
    """GPT-2 (GPT2LMHeadModel, `writes_out`) over the model's own modules and parameters:
    (B, T) ids and positions, the (B, S) 0/1 mask of all S = cached + T columns, the cache
    (a list of (keys, values) per layer, or None) -> ((B, T, V) logits, the cache with
    these T columns added).

    `write_at`, a (1,) long tensor: the cache is static (graphs.py), its keys and values
    allocated for all S columns; the one new column (T = 1) is written into it in place at
    column `write_at`, and the mask is 1 exactly on the columns written so far, this one
    included. No shape then depends on how many columns are written, and nothing is read
    back to the host: what a CUDA graph needs to replay the step."""
    tr, cfg = model.transformer, model.config
    B, T = input_ids.shape
    D, H = cfg.n_embd, cfg.n_head
    S = attention_mask.shape[1]
    scale = (D // H) ** -0.5 if cfg.scale_attn_weights else 1.0  # GPT2Attention's
    if write_at is None:
        # query i sits at column S - T + i: it sees the unmasked columns up to its own, and
        # always itself, so a padding query is never left with no key (its output is unused)
        cols = torch.arange(S, device=input_ids.device)
        own = cols[S - T:, None]  # (T, 1)
        visible = ((cols <= own) & attention_mask.bool()[:, None, :]) | (cols == own)  # (B, T, S)
    else:  # the static cache's mask: the columns written so far, the new one included
        visible = attention_mask.bool()[:, None, :]  # (B, 1, S)
    visible = visible[:, None]  # (B, 1, T, S): one mask for every head
    h = tr.wte(input_ids) + tr.wpe(position_ids)
    call = _direct_call if not _global_hooks() else _module_call
    present = []
    for layer, block in enumerate(tr.h):
        attn = block.attn
        qkv = call(attn.c_attn, call(block.ln_1, h))  # (B, T, 3D): q, k, v side by side
        # (B, H, T, D/H) each: the views split() + view() + transpose() make (the same
        # elements; a stride may differ along a dimension of size 1), in 3 ops not 7
        q, k, v = qkv.view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4).unbind(0)
        if write_at is not None:  # in place, at a column held on the device
            k = cache[layer][0].index_copy_(2, write_at, k)
            v = cache[layer][1].index_copy_(2, write_at, v)
        elif cache is not None:
            k, v = torch.cat([cache[layer][0], k], 2), torch.cat([cache[layer][1], v], 2)
        present.append((k, v))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
        h = h + call(attn.c_proj, a.transpose(1, 2).reshape(B, T, D))
        mlp = block.mlp
        h = h + call(mlp.c_proj, mlp.act(call(mlp.c_fc, call(block.ln_2, h))))
    return model.lm_head(call(tr.ln_f, h)), present


def _global_hooks() -> bool:
    """Hooks registered for every module (torch.nn.modules.module.register_module_*)."""
    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
                or torch_module._global_backward_hooks
                or torch_module._global_backward_pre_hooks)


def hooked(module: torch.nn.Module) -> bool:
    """Something a direct call of the module's forward would skip: a hook on it, or a
    forward set on the instance (accelerate's hooks, a patch)."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or "forward" in module.__dict__)


def _module_call(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def _direct_call(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x) for GPT-2's Conv1D and LayerNorm, as their forward's own function call
    where nothing could tell the difference (the module's own type, its class's forward, no
    hooks): a module call's bookkeeping costs ~3 us, about what a decode step's small layer
    computes in, and a step on the tiny model makes ~250 of them. The same operations, the
    same numbers. A forward set on the instance (accelerate's hooks, a patch) is called."""
    if hooked(module):
        return module(x)
    if type(module) is Conv1D:  # Conv1D.forward
        return torch.addmm(module.bias, x.view(-1, x.size(-1)), module.weight).view(
            x.size()[:-1] + (module.nf,))
    if type(module) is torch.nn.LayerNorm:  # LayerNorm.forward
        return F.layer_norm(x, module.normalized_shape, module.weight, module.bias, module.eps)
    return module(x)


class CompletionLogits(torch.nn.Module):
    """The training forward as one module, so that DDP, which expects one forward per
    backward, wraps both model calls of the shared-prompt path as one."""

    def __init__(self, model: torch.nn.Module, share_prompts: bool, run_forward=None):
        super().__init__()
        self.model = model
        self.logits_fn = (partial(shared_prompt_logits, run_forward=run_forward)
                          if share_prompts else completion_logits)

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
