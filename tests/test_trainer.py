"""The trainer: accumulation equals the full batch, sampling and training log-probs agree,
resume is exact, the presets do what the course says they do."""

import copy
import math
import re

import pytest
import torch

from grpo_lab import step as step_module
from grpo_lab.config import LOSS_TYPES, GRPOConfig, preset
from grpo_lab.health import Snapshot
from grpo_lab.models import frozen_copy
from grpo_lab.numerics import UNIT_ROUNDOFF, as_accurate_bound, sum_error_bound
from grpo_lab.objective import completion_logprobs
from grpo_lab.sampling import sample_group
from grpo_lab.trainer import Trainer, micro_batch_slices, read_metrics, without_timing

pytestmark = pytest.mark.numerics  # .ci/kernels runs this file under other CPU kernels


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_accumulated_gradient_equals_full_batch(tiny, loss_type, beta, monkeypatch):
    model, tok = tiny
    cfg = preset("stable", loss_type=loss_type, beta=beta, prompts_per_step=4, group_size=4,
                 temperature=1.3)
    trainer = Trainer(cfg, copy.deepcopy(model), tok)  # made float64 below
    # the old policy differs from the current one, so ratios are not all 1 and clipping acts
    with torch.no_grad():
        for p in trainer.policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    batch = trainer.make_batch()
    lengths = batch.rollout.completion_mask.sum(-1)
    assert lengths.unique().numel() > 1, "want micro-batches with unequal token counts"
    assert batch.advantages.abs().sum() > 0

    trainer.optimizer.zero_grad(set_to_none=True)
    full = trainer.backward(batch, grad_accum_steps=1)
    g_full = _grads(trainer.policy).clone()
    accumulated, parts = {}, {}  # parts: the sum of the micro-batch gradients' norms
    losses, loss_parts = {}, {}  # the accumulated loss, and the sum of |micro-batch loss|
    backward_pass = step_module.backward_pass

    def measured_backward_pass(run, loss):  # what each micro-batch adds into .grad
        before = _grads(trainer.policy).clone() if trainer.policy.lm_head.weight.grad \
            is not None else 0.0
        backward_pass(run, loss)
        parts[k] += (_grads(trainer.policy) - before).norm().item()
        loss_parts[k] += abs(loss.item())

    monkeypatch.setattr(step_module, "backward_pass", measured_backward_pass)
    for k in (2, 3, 16):  # 16 rows in 3 micro-batches have sizes 6, 5, 5
        parts[k] = loss_parts[k] = 0.0
        trainer.optimizer.zero_grad(set_to_none=True)
        acc = trainer.backward(batch, grad_accum_steps=k)
        accumulated[k] = _grads(trainer.policy).clone()
        losses[k] = acc["loss"].item()
    monkeypatch.setattr(step_module, "backward_pass", backward_pass)
    # The split runs smaller batches and adds k micro-batch gradients into .grad, so the
    # float32 gradients differ by rounding. Against the float64 gradient of the same loss
    # on the same inputs: the micro-batch gradients are as accurate as the full batch's
    # (2x its error: measured 0.6-1.1x in test_distributed), and the k-term sum adds at
    # most gamma~_k times the sum of their norms (numerics.sum_error_bound). A wrong
    # normalisation is off by the gradient's own size
    trainer.policy.double()
    trainer.optimizer.zero_grad(set_to_none=True)
    true_loss = trainer.backward(batch, grad_accum_steps=1)["loss"].item()
    truth = _grads(trainer.policy)
    # the loss: the same argument, for a number (k micro-batch losses summed)
    loss_error_full = abs(full["loss"].item() - true_loss)
    for k, loss in losses.items():
        assert abs(loss - true_loss) <= 2 * loss_error_full + 2 * sum_error_bound(k) * \
            loss_parts[k] + 4 * UNIT_ROUNDOFF * abs(true_loss), (loss_type, k, loss, true_loss)
    error_full = (g_full.double() - truth).norm().item()
    assert error_full < 1e-4 * truth.norm().item(), "the full-batch gradient is not float32's"
    for k, g_acc in accumulated.items():
        error = (g_acc.double() - truth).norm().item()
        assert error <= 2 * error_full + 2 * sum_error_bound(k) * parts[k], (
            f"{loss_type} k={k}: {error / truth.norm().item():.2e} (relative) from the float64 "
            f"gradient, the full batch {error_full / truth.norm().item():.2e}")


def test_micro_batches_are_never_empty():
    assert [s.stop - s.start for s in micro_batch_slices(16, 3)] == [6, 5, 5]
    assert [s.stop - s.start for s in micro_batch_slices(2, 2)] == [1, 1]
    with pytest.raises(ValueError, match="non-empty"):
        micro_batch_slices(1, 4)  # report 004: batch_size=1 with accum_steps>1


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_training_logprobs_match_sampling_logprobs(tiny, temperature):
    model, tok = tiny
    prompts = ["1+2=", "12+34=", "5+67=", "99+99=", "0+0="]  # 4 to 6 tokens: left padding
    rollout = sample_group(model, tok, prompts, 3, 5, temperature=temperature)
    assert rollout.attention_mask[:, 0].min() == 0, "some rows must be left-padded"
    args = (rollout.input_ids, rollout.attention_mask, rollout.completion_length, temperature)
    recomputed = completion_logprobs(model, *args) * rollout.completion_mask
    truth = completion_logprobs(copy.deepcopy(model).double(), *args) * rollout.completion_mask
    # generate() computes them one token at a time with a KV cache, the training forward all
    # at once: float32 both, rounded differently. Against the float64 forward, the sampler's
    # are as accurate as the training path's (numerics.as_accurate_bound); a misaligned
    # position or a missing temperature is off by the log-probs' own size
    err_train = (recomputed.double() - truth).abs().max().item()
    err_sampler = (rollout.sampling_logprobs.double() - truth).abs().max().item()
    assert err_sampler <= as_accurate_bound(err_train, truth.abs().max().item()), (
        err_sampler, err_train)


def test_first_update_starts_at_ratio_one_and_zero_kl(tiny):
    model, tok = tiny
    trainer = Trainer(preset("stable", steps=1), model, tok)
    m = trainer.step()
    # exact by construction: pi_old is this forward's own log-probs, detached, so the
    # log-ratio is x - x = 0 in any arithmetic
    assert m["log_ratio/max_abs"] == 0.0
    # the reference's log-probs come from another forward of the same weights (no_grad, in
    # the batch), which may use other kernels: a difference d per token, and k3(d) = d^2/2 +
    # O(d^3). Two float32 computations of one log-prob (|logp| < 20 here) differ by far less
    # than 1e-3 (float32 keeps 7 digits; a 2-layer forward loses a few), so kl < 5e-7;
    # 1e-5 still admits |d| up to 4.5e-3 and is far below one update's drift (kl ~ 1e-3 at
    # step 2 of the course's runs)
    assert 0.0 <= m["kl"] < 1e-5
    assert m["clip_ratio/region_mean"] == 0


def test_reference_is_frozen(tiny):
    model, tok = tiny
    ref = frozen_copy(model)
    assert all(not p.requires_grad for p in ref.parameters())
    trainer = Trainer(preset("stable", steps=2), model, tok)
    before = [p.clone() for p in trainer.reference.parameters()]
    trainer.step()
    trainer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.reference.parameters(), strict=True))
    changed = any(
        not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters(), strict=True)
    )
    assert changed, "the policy should have moved"


@pytest.mark.parametrize("mu", [2])
def test_mu_iterations_keep_the_sampling_policy_as_old(tiny, mu):
    model, tok = tiny
    trainer = Trainer(preset("stable", num_iterations=mu, steps=1), model, tok)
    m = trainer.step()
    # the second pass sees a moved policy: its log-ratio to pi_old is no longer 0
    assert m["log_ratio/max_abs"] > 1e-4
    assert math.isfinite(m["loss"])


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    cfg = preset("stable", steps=6, checkpoint_every=3, eval_every=3, eval_size=32)
    full = Trainer(cfg, out_dir=tmp_path / "full")
    full.train(progress=False)

    def kill_after_step_4(m):
        if m["step"] == 4:
            raise KeyboardInterrupt  # checkpoint at 3; step 4's metrics are already written

    part = Trainer(cfg, out_dir=tmp_path / "part")
    with pytest.raises(KeyboardInterrupt):
        part.train(progress=False, callback=kill_after_step_4)
    assert [m["step"] for m in read_metrics(tmp_path / "part")] == [0, 1, 2, 3, 4]
    resumed = Trainer(cfg, out_dir=tmp_path / "part")
    resumed.load_checkpoint()
    assert resumed.step_count == 3
    resumed.train(progress=False)

    a = without_timing(read_metrics(tmp_path / "full"))
    b = without_timing(read_metrics(tmp_path / "part"))
    assert [m["step"] for m in b] == list(range(7))
    assert a == b


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    cfg = preset("stable", steps=1, eval_size=8)
    trainer = Trainer(cfg, out_dir=tmp_path)
    trainer.train(progress=False)
    good = (tmp_path / "checkpoint.pt").read_bytes()

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        trainer.save_checkpoint()
    assert (tmp_path / "checkpoint.pt").read_bytes() == good


def test_health_check_rolls_back_nonfinite_parameters(tiny):
    model, tok = tiny
    trainer = Trainer(preset("stable", steps=3), model, tok)
    trainer.step()
    healthy = {k: v.clone() for k, v in trainer.snapshot.model_state.items()}
    with torch.no_grad():
        next(trainer.policy.parameters())[0, 0] = float("nan")
    assert trainer._check_health() == 1
    assert trainer.last_nonfinite_params == 1
    for k, v in trainer.policy.state_dict().items():
        assert torch.equal(v, healthy[k]), k


def _same_state(a, b) -> bool:
    """Two state dicts hold the same values: tensors equal with the same dtype and device."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.device == b.device
                and torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_same_state(x, y) for x, y in zip(a, b, strict=True)))
    return a == b


def test_a_snapshot_is_a_copy_that_restores_the_exact_state(tiny):
    """A Snapshot copies the parameters and the optimizer's state (moments, step counters,
    param groups): later steps change none of it, and each restore brings all of it back,
    the second as exactly as the first (the optimizer cannot write into the snapshot)."""
    model, tok = tiny
    trainer = Trainer(preset("stable", steps=5, eval_every=0, eval_size=8), model, tok)
    trainer.step()
    snapshot = Snapshot(trainer.policy, trainer.optimizer, 1)
    model_then = copy.deepcopy(trainer.policy.state_dict())
    optimizer_then = copy.deepcopy(trainer.optimizer.state_dict())
    trainer.step()
    assert not _same_state(trainer.policy.state_dict(), model_then)  # the step moved them
    for _ in range(2):
        snapshot.restore(trainer.policy, trainer.optimizer)
        assert _same_state(trainer.policy.state_dict(), model_then)
        assert _same_state(trainer.optimizer.state_dict(), optimizer_then)
        trainer.step()  # training on from the restored state


def test_cloned_is_deepcopy_where_a_state_shares_tensors():
    """health.cloned gives what copy.deepcopy gives: the same values, types, strides and
    requires_grad, a tensor met twice copied once, views of one storage sharing their copy;
    none of it shares memory with the original."""
    from collections import OrderedDict, namedtuple

    from grpo_lab.health import cloned

    pair = namedtuple("pair", "a b")
    base, lr = torch.arange(12.0).reshape(3, 4), torch.tensor(1e-3)
    state = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3).t()},
                  1: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2)}},
        "param_groups": [{"params": [0], "lr": lr, "betas": (0.9, 0.99)},
                         {"params": [1], "lr": lr, "betas": (0.9, 0.99)}],  # one lr tensor
        "row": base[0], "column": base[:, 1], "parameter": torch.nn.Parameter(torch.ones(2)),
        "needs_grad": torch.ones(2, requires_grad=True), "pair": pair(torch.zeros(1), 2),
        "ordered": OrderedDict(x=torch.zeros(1)), "empty": torch.zeros(0), "none": None,
    }
    state["twice"] = [state["state"][1], state["state"][1]]  # one dict met twice
    fast, slow = cloned(state), copy.deepcopy(state)

    def leaves(x, path=()):
        if isinstance(x, torch.Tensor):
            yield path, x
        elif isinstance(x, dict):
            for k, v in x.items():
                yield from leaves(v, path + (k,))
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                yield from leaves(v, path + (i,))

    def layout(x):  # every tensor's path, type, value, strides, and whom it shares with
        tensors = list(leaves(x))
        return [(path, type(t), t.dtype, t.tolist(), t.stride(), t.requires_grad,
                 [q for q, u in tensors if u is t],
                 [q for q, u in tensors
                  if u.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()])
                for path, t in tensors]

    assert layout(fast) == layout(slow) == layout(state)
    assert fast["param_groups"][0]["lr"] is fast["param_groups"][1]["lr"]
    assert fast["twice"][0] is fast["twice"][1] is fast["state"][1]
    assert type(fast["pair"]) is pair and type(fast["ordered"]) is OrderedDict
    originals = {t.untyped_storage().data_ptr() for _, t in leaves(state) if t.numel()}
    assert not originals & {t.untyped_storage().data_ptr() for _, t in leaves(fast)}


def test_skip_nonfinite_gradient(tiny):
    model, tok = tiny
    trainer = Trainer(preset("stable", steps=1), model, tok)
    before = [p.clone() for p in trainer.policy.parameters()]
    for p in trainer.policy.parameters():
        p.grad = torch.zeros_like(p)
    next(trainer.policy.parameters()).grad[0, 0] = float("inf")
    assert trainer._update() == 1
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters(), strict=True))


def naive_crash_run():
    """The naive preset trained until it crashes: the trainer and the error."""
    trainer = Trainer(preset("naive", steps=60, eval_every=0, eval_size=16))
    with pytest.raises(RuntimeError) as crash:
        trainer.train(progress=False)
    return trainer, crash.value


@pytest.fixture(scope="module")
def naive_crash():
    """One naive crash for the module: two tests read it (the trainer seeds itself)."""
    return naive_crash_run()


def test_naive_preset_breaks_the_way_the_reports_describe(naive_crash):
    trainer, error = naive_crash
    assert re.search(r"probability tensor contains either `inf`, `nan`", str(error)), error
    norms = [m["grad_norm"] for m in trainer.history if "grad_norm" in m]
    finite = [g for g in norms if math.isfinite(g)]
    stable_median = 5.0  # generous: the stable run's median grad norm is ~1.5
    assert max(finite) > 1000 * stable_median, max(finite)
    assert trainer.history[-1]["nonfinite_params"] > 0
    assert "first non-finite parameter: transformer" in trainer.diagnosis()


def test_diagnosis_after_the_device_failed_still_reports_the_history(naive_crash, monkeypatch):
    # after a CUDA device-side assert every call on the device fails; the diagnosis must not
    trainer, _ = naive_crash
    from grpo_lab import trainer as trainer_module

    def device_gone(model):
        raise torch.AcceleratorError("CUDA error: device-side assert triggered\nmore")

    monkeypatch.setattr(trainer_module, "first_nonfinite_param", device_gone)
    monkeypatch.setattr(trainer_module, "first_nonfinite_grad", device_gone)
    monkeypatch.setattr(trainer.run, "first_bad_grad", None)
    text = trainer.diagnosis()
    assert "first non-finite parameter: unknown (the device failed: CUDA error: " \
        "device-side assert triggered)" in text
    assert "last healthy step: " in text and "grad norm median over the run: " in text

    def a_bug(model):
        raise RuntimeError("shape mismatch")  # not the device: the diagnosis must not hide it

    monkeypatch.setattr(trainer_module, "first_nonfinite_param", a_bug)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        trainer.diagnosis()


def test_stable_preset_survives_what_breaks_naive():
    trainer = Trainer(preset("stable", steps=60, eval_every=0, eval_size=16))
    trainer.train(progress=False)
    assert all(m["nonfinite_params"] == 0 for m in trainer.history)


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_amp_steps_are_finite(tiny, amp):
    model, tok = tiny
    trainer = Trainer(preset("stable", amp=amp, steps=2), model, tok)
    for _ in range(2):
        m = trainer.step()
        assert math.isfinite(m["loss"]) and m["nonfinite_params"] == 0


@pytest.mark.parametrize("amp, sampled_in", [("bf16", torch.bfloat16), ("fp16", torch.float32),
                                              ("none", torch.float32)])
def test_bf16_samples_under_autocast_and_fp16_does_not(tiny, amp, sampled_in):
    # the policy's forwards in make_batch are the sampler's only (the reference is its own
    # model); fp16 samples in float32: a logit past 65504 would be inf there
    model, tok = tiny
    trainer = Trainer(preset("stable", amp=amp, steps=1), model, tok)
    seen = []
    block = trainer.policy.transformer.h[0].mlp.c_fc
    handle = block.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    try:
        batch = trainer.make_batch()
    finally:
        handle.remove()
    assert seen and set(seen) == {sampled_in}, seen
    assert batch.rollout.sampling_logprobs.dtype == torch.float32


def test_fp16_skip_keeps_the_grad_scaler_consistent(tiny):
    """Report 004: skipping after a NaN must not leave GradScaler expecting a step."""
    model, tok = tiny
    trainer = Trainer(preset("stable", amp="fp16", steps=3), model, tok)
    trainer.step()
    for p in trainer.policy.parameters():
        p.grad = torch.zeros_like(p)
    next(trainer.policy.parameters()).grad[0, 0] = float("nan")
    assert trainer._update() == 1
    m = trainer.step()  # would raise "No inf checks were recorded" if the state leaked
    assert m["nonfinite_params"] == 0


def test_naive_crash_is_deterministic(naive_crash):
    def crash_step(trainer):
        return trainer.step_count, [m.get("grad_norm") for m in trainer.history]

    # the module's crash against a fresh one
    first, second = crash_step(naive_crash[0]), crash_step(naive_crash_run()[0])
    assert first[0] == second[0]
    assert str(first[1]) == str(second[1])  # str: NaN == NaN


def test_rollback_on_a_checkpoint_step_still_checkpoints(tmp_path):
    cfg = preset("stable", steps=2, checkpoint_every=2, eval_size=8)
    trainer = Trainer(cfg, out_dir=tmp_path)
    real_update = trainer.update_fn

    def poisoned_update(run):
        out = real_update(run)
        if trainer.step_count == 1:  # the update of step 2 corrupts a weight
            with torch.no_grad():
                next(trainer.policy.parameters())[0, 0] = float("nan")
        return out

    trainer.use(update_fn=poisoned_update)
    trainer.train(progress=False)
    ms = read_metrics(tmp_path)
    assert ms[-1]["rolled_back"] == 1 and ms[-1]["nonfinite_params"] == 1
    assert (tmp_path / "checkpoint.pt").exists()


def test_train_with_fewer_steps_ends_with_eval(tiny):
    model, tok = tiny
    trainer = Trainer(preset("stable", steps=200, eval_every=0, eval_size=8), model, tok)
    trainer.train(steps=2, progress=False)
    assert "eval/accuracy" in trainer.history[-1]


def test_bf16_old_logprobs_come_from_the_training_path(tiny):
    model, tok = tiny
    trainer = Trainer(preset("stable", amp="bf16", steps=1), model, tok)
    m = trainer.step()
    assert m["log_ratio/max_abs"] == 0.0  # pi_old is this forward's log-probs: x - x = 0


def test_metrics_file_is_strict_json_and_survives_a_torn_last_line(tmp_path):
    import json

    out = tmp_path / "naive"
    trainer = Trainer(preset("naive", steps=60, eval_every=0, eval_size=8), out_dir=out)
    with pytest.raises(RuntimeError):
        trainer.train(progress=False)
    text = (out / "metrics.jsonl").read_text()
    for line in text.splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))
    assert math.isnan(read_metrics(out)[-1]["grad_norm"])
    (out / "metrics.jsonl").write_text(text + '{"step": 99, "rew')
    assert len(read_metrics(out)) == len(text.splitlines())
    assert "first non-finite gradient: step" in trainer.diagnosis()


def test_a_norm_that_overflows_with_finite_entries_is_named_so(tiny):
    """The float32 norm of finite gradients can overflow (its sum of squares passes 3.4e38):
    the diagnosis says so, and gives the largest entry, instead of 'None'."""
    from grpo_lab.step import guarded_update

    model, tok = tiny
    trainer = Trainer(preset("stable", steps=1), model, tok)
    for p in trainer.policy.parameters():
        p.grad = torch.full_like(p, 1e20)
    grad_norm, skipped = guarded_update(trainer.run)
    assert math.isinf(grad_norm) and skipped == 1
    assert "first non-finite gradient: step 1: every entry finite, the norm overflowed float32 " \
        "(largest |entry| 1e+20)" in trainer.diagnosis()


def test_spike_rule_skips_a_spike_but_absorbs_a_lasting_shift(tiny):
    model, tok = tiny
    trainer = Trainer(preset("stable", spike_skip_factor=10.0), model, tok)

    def update_with_norm(value):
        for p in trainer.policy.parameters():
            p.grad = torch.zeros_like(p)
        next(trainer.policy.parameters()).grad[0, 0] = value
        return trainer._update()

    assert [update_with_norm(1.0) for _ in range(5)] == [0] * 5
    assert update_with_norm(1000.0) == 1  # a spike is skipped
    skips = [update_with_norm(100.0) for _ in range(20)]  # the scale really changed
    assert skips[-1] == 0 and sum(skips) < 10


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 3e38], ids=["nan", "inf", "huge"])
def test_health_count_is_exact_behind_the_fast_check(tiny, value):
    """The one-kernel finiteness check (a norm per tensor) only decides 'all finite'; a NaN,
    an inf, or finite values whose norm overflows get the exact count."""
    from grpo_lab.health import all_finite, nonfinite_params

    model, _ = tiny
    model = copy.deepcopy(model)
    assert all_finite(model) and nonfinite_params(model) == 0
    with torch.no_grad():
        model.transformer.wte.weight[0, :2] = value
    assert not all_finite(model)
    assert nonfinite_params(model) == (0 if value == 3e38 else 2)


def test_checkpointing_with_autocast_runs_and_the_ratio_starts_at_one(tiny):
    """Activation checkpointing drops the KV cache the shared prompt forward needs; under
    autocast pi_old is recomputed on the training path, which must then fall back to the
    full forward (it crashed on the missing cache) and agree with the training forward."""
    model, tok = tiny
    cfg = preset("stable", gradient_checkpointing=True, amp="bf16", prompts_per_step=2,
                 group_size=4, eval_every=0, eval_size=8)
    m = Trainer(cfg, copy.deepcopy(model), tok).step()
    assert math.isfinite(m["loss"]) and m["skipped"] == 0
    assert m["log_ratio/max_abs"] == 0.0, m["log_ratio/max_abs"]  # x - x, exactly


def test_resuming_a_checkpoint_of_the_unfused_optimizer_keeps_fused_adamw(tmp_path, tiny):
    """Checkpoints written before AdamW was fused carry fused=None in their param groups;
    loading one must not switch the optimizer back (with fp16, GradScaler then failed:
    'Expected grad_scale and found_inf to be None')."""
    model, tok = tiny
    cfg = preset("stable", amp="fp16", prompts_per_step=2, group_size=4, eval_every=0,
                 eval_size=8)
    first = Trainer(cfg, copy.deepcopy(model), tok, out_dir=tmp_path)
    first.step()
    for group in first.optimizer.param_groups:  # what the older trainer saved
        group["fused"], group["foreach"] = None, None
    first.save_checkpoint()
    resumed = Trainer(cfg, copy.deepcopy(model), tok, out_dir=tmp_path)
    resumed.load_checkpoint()
    assert all(g["fused"] for g in resumed.optimizer.param_groups)
    m = resumed.step()
    assert math.isfinite(m["loss"]) and m["skipped"] == 0


def test_reward_metrics_follow_trl(tiny):
    """reward_std is TRL's: the std of every reward in the batch (Bessel); the mean of the
    per-group stds, which the advantages divide by, is logged as reward_std/group_mean."""
    model, tok = tiny
    cfg = GRPOConfig(prompts_per_step=4, group_size=4, max_new_tokens=3, eval_every=0,
                     eval_size=1, steps=1)
    trainer = Trainer(cfg, model, tok)
    rewards = []
    trainer.reward_fn = lambda completions, **cols: rewards.extend(
        [float(i % 3) for i in range(len(completions))]) or rewards[-len(completions):]
    m = trainer.step()
    r = torch.tensor(rewards)
    assert m["reward_std"] == pytest.approx(r.std().item(), rel=1e-6)
    assert m["reward_std/group_mean"] == pytest.approx(r.view(4, 4).std(1).mean().item(), rel=1e-6)
    assert m["reward_std"] != pytest.approx(m["reward_std/group_mean"])


@pytest.mark.parametrize("masked", [False, True])
def test_mask_truncated_completions(tiny, masked):
    """TRL's switch: rows cut off at max_new_tokens get no loss weight (but keep their
    reward in the group's advantages); completions/clipped_ratio counts them either way."""
    model, tok = tiny
    cfg = GRPOConfig(prompts_per_step=8, group_size=4, max_new_tokens=3, eval_every=0,
                     eval_size=1, steps=1, mask_truncated_completions=masked)
    trainer = Trainer(cfg, model, tok)
    batch = trainer.make_batch()
    cut = batch.rollout.truncated
    assert cut.any() and (~cut).any()
    assert (batch.weights[cut] == 0).all() == masked
    assert (batch.weights[~cut].sum(-1) > 0).all()
    m = trainer.step()
    assert 0 < m["completions/clipped_ratio"] < 1


def test_the_batch_holds_ordinary_tensors_a_loss_may_keep_for_backward():
    """The sampler's and the reference's forwards run in inference mode; what reaches the
    loss is ordinary tensors, so a loss that multiplies by ref_logp (autograd keeps it for
    the backward) works."""
    trainer = Trainer(preset("stable", prompts_per_step=2, group_size=4, beta=0.1))
    batch = trainer.make_batch()
    r = batch.rollout
    assert not any(t.is_inference() for t in (batch.ref_logp, r.input_ids, r.attention_mask,
                                              r.completion_mask, r.sampling_logprobs))
    logp = completion_logprobs(trainer.policy, r.input_ids, r.attention_mask,
                               r.completion_length)
    (logp * batch.ref_logp).sum().backward()
    assert all(p.grad is not None for p in trainer.policy.parameters() if p.requires_grad)
