"""The speed-ups of fast.py, each against the plain path it replaces."""

import copy

import pytest
import torch
from transformers.activations import NewGELUActivation

from grpo_lab.fast import (
    cached_forward,
    fuse_gelu,
    fused_adamw,
    gpt2_forward,
    keep_fused,
    shared_prompt_logits,
    writes_out,
)
from grpo_lab.numerics import as_accurate_bound
from grpo_lab.objective import completion_logits, position_ids_from_mask
from grpo_lab.sampling import sample_group

pytestmark = pytest.mark.numerics  # .ci/kernels runs this file under other CPU kernels


@pytest.mark.parametrize("rows", [slice(None), slice(1, 10)], ids=["groups", "split-groups"])
def test_shared_prompt_forward_equals_the_full_one(tiny, rows):
    """shared_prompt_logits runs each distinct prompt once: the same logits and gradients
    as the plain completion_logits, also for a micro-batch that cuts through groups."""
    model, tok = tiny
    r = sample_group(model, tok, ["1+2=", "12+34=", "5+67="], 4, 5)  # left-padded groups
    ids, attn, C = r.input_ids[rows], r.attention_mask[rows], r.completion_length
    m = r.completion_mask[rows].bool()
    weights = torch.randn(m.shape) * m

    batch_sizes = []  # rows of each transformer call: the shared path runs the prompts alone

    def count_rows(module, args, kwargs):
        ids = kwargs["input_ids"] if kwargs.get("input_ids") is not None else args[0]
        batch_sizes.append(len(ids))

    # every forward embeds its ids first: transformers' and fast.gpt2_forward alike
    hook = model.transformer.wte.register_forward_pre_hook(count_rows, with_kwargs=True)

    def logits_and_grad(share: bool, net=model):
        net.zero_grad(set_to_none=True)
        batch_sizes.clear()
        forward = shared_prompt_logits if share else completion_logits
        logits = forward(net, ids, attn, C, 0.7)
        calls[share] = list(batch_sizes)
        w = weights.to(logits.dtype)
        (logits.log_softmax(-1).gather(-1, ids[:, -C:, None]).squeeze(-1) * w).sum().backward()
        return logits.detach(), torch.cat([p.grad.flatten() for p in net.parameters()])

    calls = {}
    (full, g_full), (shared, g_shared) = logits_and_grad(False), logits_and_grad(True)
    hook.remove()
    distinct = len(set(r.prompt_index[rows].tolist()))
    assert calls[False] == [len(ids)] and calls[True] == [distinct, len(ids)], calls
    # The two paths are float32 computations of the same function with other batch shapes
    # (other kernel blocking), so they round differently; neither is the reference. Against
    # the float64 computation of the same forward and backward, the shared path must be as
    # accurate as the plain one (numerics.as_accurate_bound).
    truth, g_truth = logits_and_grad(False, copy.deepcopy(model).double())
    err_full = ((full.double() - truth).abs() * m[..., None]).max().item()
    err_shared = ((shared.double() - truth).abs() * m[..., None]).max().item()
    assert err_shared <= as_accurate_bound(err_full, truth.abs().max().item()), (
        err_shared, err_full)
    gerr_full = (g_full.double() - g_truth).norm().item()
    gerr_shared = (g_shared.double() - g_truth).norm().item()
    assert gerr_shared <= as_accurate_bound(gerr_full, g_truth.norm().item()), (
        gerr_shared, gerr_full)


def test_shared_prompt_forward_of_a_frozen_model_with_autograd_on(tiny):
    """A model whose parameters need no gradient, called with autograd on (a reference
    outside inference mode, a frozen layer): the shared path runs, and gives what it gives
    under no_grad."""
    model, tok = tiny
    r = sample_group(model, tok, ["1+2=", "12+34="], 4, 5)
    model.requires_grad_(False)
    with torch.enable_grad():
        logits = shared_prompt_logits(model, r.input_ids, r.attention_mask, r.completion_length)
    with torch.no_grad():
        expected = shared_prompt_logits(model, r.input_ids, r.attention_mask,
                                        r.completion_length)
    assert not logits.requires_grad and torch.equal(logits, expected)


def test_gpt2_forward_is_the_transformers_forward(tiny):
    """fast.gpt2_forward, over left-padded rows: in one call and as a prompt then its
    continuation from the cache, the logits at every real position are transformers'
    logits, as accurate against the float64 forward as transformers' own."""
    model, tok = tiny
    enc = tok(["1+2=3", "12+34=46", "5+67=72"], return_tensors="pt", padding=True)
    ids, mask = enc.input_ids, enc.attention_mask
    assert not mask.all(), "the rows must be padded for this test to mean anything"
    pos = position_ids_from_mask(mask)
    real = mask.bool()[..., None]
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        whole, _ = gpt2_forward(model, ids, mask, pos)
        P = 4  # a prompt, then the rest attending to its cache
        head, cache = gpt2_forward(model, ids[:, :P], mask[:, :P], pos[:, :P])
        tail, cache = gpt2_forward(model, ids[:, P:], mask, pos[:, P:], cache)
        double = copy.deepcopy(model).double()
        truth = double(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert [k.shape[2] for k, _ in cache] == [ids.shape[1]] * model.config.n_layer
    err_plain = ((plain.double() - truth).abs() * real).max().item()
    for mine in (whole, torch.cat([head, tail], 1)):
        assert torch.isfinite(mine).all()  # padding queries too (they attend to themselves)
        err = ((mine.double() - truth).abs() * real).max().item()
        assert err <= as_accurate_bound(err_plain, truth.abs().max().item()), (err, err_plain)


def test_gpt2_forward_calls_a_layer_directly_only_where_nothing_can_tell(tiny, monkeypatch):
    """gpt2_forward runs GPT-2's Conv1D and LayerNorm as their forward's own function call:
    the same numbers as calling the modules, and a module with a hook (its own, or one
    registered for every module) or a forward of its own is called as a module."""
    from grpo_lab import fast

    model, _ = tiny
    ids = torch.tensor([[3, 4, 5], [6, 7, 8]])
    mask, positions = torch.ones_like(ids), torch.arange(3).expand(2, 3)

    def logits():
        return gpt2_forward(model, ids, mask, positions)[0]

    direct = logits()
    with monkeypatch.context() as m:
        m.setattr(fast, "_direct_call", fast._module_call)
        assert torch.equal(logits(), direct)
    seen = []
    hook = model.transformer.h[1].mlp.c_fc.register_forward_hook(lambda *a: seen.append("c_fc"))
    assert torch.equal(logits(), direct) and seen == ["c_fc"]
    hook.remove()
    ln = model.transformer.h[2].ln_2  # a forward set on the instance (accelerate's hooks do)
    ln.forward = lambda x: seen.append("patched") or type(ln).forward(ln, x)
    try:
        assert torch.equal(logits(), direct) and seen == ["c_fc", "patched"]
    finally:
        del ln.forward
    seen.clear()
    everywhere = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: seen.append(type(module).__name__))
    try:
        assert torch.equal(logits(), direct)
    finally:
        everywhere.remove()
    # per layer: c_attn, attention's c_proj, c_fc, the MLP's c_proj; ln_1, ln_2 (and ln_f)
    assert seen.count("Conv1D") == 4 * model.config.n_layer
    assert seen.count("LayerNorm") == 2 * model.config.n_layer + 1


def test_gpt2_forward_only_where_it_computes_the_same(tiny):
    """The written-out forward runs only for a GPT-2 with no dropout active and no
    activation checkpointing active; anything else gets transformers' own forward."""
    model, _ = tiny
    model.eval()
    assert writes_out(model)
    model.train()
    assert writes_out(model)  # the shipped model has no dropout
    dropping = copy.deepcopy(model)
    dropping.transformer.h[0].attn.resid_dropout.p = 0.1
    assert not writes_out(dropping)
    assert writes_out(dropping.eval())  # eval mode: dropout does nothing
    checkpointed = copy.deepcopy(model).train()
    assert writes_out(checkpointed)  # switched on after a first look at the model
    checkpointed.activation_checkpointing_enable({"use_reentrant": False})
    assert not writes_out(checkpointed.train())
    dropping.eval().train()
    dropping.transformer.h[1].mlp.dropout.p = 0.0
    assert not writes_out(dropping)  # the first one is still on
    wrapped = torch.nn.Sequential(model)  # not a GPT2LMHeadModel
    assert not writes_out(wrapped)
    calls = []
    hook = dropping.register_forward_pre_hook(lambda *a: calls.append(1))
    ids = torch.tensor([[3, 4, 5]])
    logits, cache = cached_forward(dropping.train())(ids, torch.ones_like(ids), torch.arange(3)[None])
    hook.remove()
    assert calls == [1] and logits.shape == (1, 3, model.config.vocab_size) and cache is not None


def test_fused_gelu_is_the_same_function(tiny):
    """fuse_gelu swaps GPT-2's five-op gelu_new for torch's one-kernel tanh GELU: every
    activation module replaced, the logits the same to float32 rounding."""
    model, tok = tiny
    ids = tok(["12+34=5", "1+2=3"], return_tensors="pt", padding=True).input_ids
    fused = fuse_gelu(copy.deepcopy(model))
    assert not any(isinstance(m, NewGELUActivation) for m in fused.modules())
    assert any(isinstance(m, NewGELUActivation) for m in model.modules())
    with torch.no_grad():
        plain, mine = model(ids).logits, fused(ids).logits
        truth = copy.deepcopy(model).double()(ids).logits
    # the same function in other float32 operations: against the float64 forward, the fused
    # GELU's logits are as accurate as the five-op GELU's (numerics.as_accurate_bound)
    err_plain = (plain.double() - truth).abs().max().item()
    err_fused = (mine.double() - truth).abs().max().item()
    assert err_fused <= as_accurate_bound(err_plain, truth.abs().max().item()), (
        err_fused, err_plain)


def test_fused_adamw_takes_the_plain_adamw_step(tiny):
    """Three steps of the fused kernel and of torch's per-tensor AdamW on the same
    gradients end at the same weights, and keep_fused keeps a loaded optimizer fused."""
    model, _ = tiny
    plain_model = copy.deepcopy(model)
    fused = fused_adamw(model.parameters(), torch.device("cpu"), lr=1e-3, weight_decay=0.1)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-3, weight_decay=0.1,
                              foreach=False)
    assert fused.defaults["fused"]
    for step in range(3):
        torch.manual_seed(step)
        for p, q in zip(model.parameters(), plain_model.parameters(), strict=True):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        fused.step()
        plain.step()
    diff = max((p - q).abs().max().item()
               for p, q in zip(model.parameters(), plain_model.parameters(), strict=True))
    # Both apply AdamW elementwise (no reductions), the same ~10 float32 operations per
    # entry in another order or fused: each differs by at most ~u = 2^-24 of the values it
    # touches, the parameter (|p|) and the step lr * m_hat / (sqrt(v_hat) + eps), whose size
    # is at most lr * (1 - beta1) / sqrt(1 - beta2) = 3.2 lr (Kingma & Ba 2015, section 2.1).
    # Differences in m and v only move later steps by as little, so over the steps:
    largest = max(p.abs().max().item() for p in plain_model.parameters())
    bound = 3 * 10 * 2.0**-24 * (largest + 3.2 * 1e-3)
    assert diff <= bound, (diff, bound)
    state = plain.state_dict()  # an unfused optimizer's checkpoint, loaded into a fused one
    fused.load_state_dict(state)
    assert fused.param_groups[0]["fused"] is None
    keep_fused(fused)
    assert fused.param_groups[0]["fused"] is True
    fused.step()  # the fused kernel accepts the loaded step counters
