"""The field failures as reproducible scenarios: broken code in, real symptom out.

Each scenario runs the broken variant (`fixed=False`) or its fix (`fixed=True`) on CPU,
deterministically, and returns what it saw: the real error text or the metric that shows
the symptom. `python -m grpo_lab scenario --list | NAME [--fixed]` runs them. The two
that fail inside the device's kernels (DEVICE_SCENARIOS) also run on a GPU, each in a fresh
process: `python -m grpo_lab scenario NAME --device cuda` (run_on_device).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import naive
from ..config import GRPOConfig, preset
from ..health import Snapshot, nonfinite_params
from ..memo import SESSION_CACHE, once_per_session
from ..objective import exact_kl, group_advantages, kl_k3
from ..policy import load_policy
from ..sampling import encode_prompts, generation_config, transformers_messages
from ..tools import memory
from ..trainer import Trainer, micro_batch_slices, read_metrics
from . import bugs
from .catalog import CATALOG, DEVICE_SCENARIOS


@dataclass
class Outcome:
    symptom: bool  # the failure's symptom showed up
    evidence: str  # the error text or the numbers that show it (or show it gone)
    value: float | None = None  # the measured number the evidence quotes, where there is one

    def line(self, side: str) -> str:
        """What `python -m grpo_lab scenario` prints of it: "[broken] symptom reproduced: ..."."""
        return f"[{side}] {'symptom reproduced' if self.symptom else 'symptom gone'}: {self.evidence}"


def _describe(e: BaseException) -> str:
    """'Type: first line of the message'."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def _error_text(fn: Callable[[], object]) -> str | None:
    try:
        fn()
    except Exception as e:
        return _describe(e)
    return None


# run_on_device's child reads its device from this variable; everything else runs on the CPU
DEVICE_ENV = "GRPO_LAB_SCENARIO_DEVICE"


def _device() -> torch.device:
    return torch.device(os.environ.get(DEVICE_ENV, "cpu"))


def _tiny():
    torch.manual_seed(0)
    model, tok = load_policy("cpu")
    return model.to(_device()), tok


# --- 000: NaN parameters -> sampling crash in round 2 ------------------------------------
def nan_params_sampling_crash(fixed: bool) -> Outcome:

    model, tok = _tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    snapshot = Snapshot(model, opt, step=0)
    with torch.no_grad():  # what a 1e8 gradient through Adam leaves behind (see `naive`)
        model.transformer.wte.weight.fill_(float("nan"))
    bad = nonfinite_params(model)
    if fixed:  # health check after the update: roll back before sampling again
        snapshot.restore(model, opt)
    # the report's sampler, generate(): torch.multinomial as it is, so that on CUDA this is
    # the real device-side assert (the course's sampler checks first, sampling.sampleable_rows)
    ids, mask = encode_prompts(tok, ["12+34="] * 4, model.device)
    err = _error_text(lambda: model.generate(input_ids=ids, attention_mask=mask,
                                             generation_config=generation_config(tok, 5, True)))
    if err:  # (on CUDA a device-side assert: nothing more may run on the device)
        return Outcome(True, f"{bad} non-finite parameters, then sampling: {err}")
    healthy = nonfinite_params(model)
    return Outcome(False, f"{bad} non-finite parameters found, rolled back ({healthy} left); "
                          "sampling works")


# --- 002: a pad token the embedding does not have ---------------------------------------
def pad_token_vocab_mismatch(fixed: bool) -> Outcome:

    model, tok = _tiny()
    tok.add_special_tokens({"pad_token": "<new-pad>"})  # id == vocab size: no embedding row
    if fixed:
        model.resize_token_embeddings(len(tok), mean_resizing=False)
    ids, mask = encode_prompts(tok, ["1+2=", "12+34="], _device())
    # .sum().item(): on CUDA the lookup's failure surfaces when its result is read
    err = _error_text(lambda: model(input_ids=ids, attention_mask=mask).logits.sum().item())
    if err:
        return Outcome(True, f"pad id {tok.pad_token_id}, embedding rows "
                             f"{model.get_input_embeddings().num_embeddings}: {err}")
    return Outcome(False, f"embeddings resized to {len(tok)} rows; forward works")


# --- 003 and the course: gradient accumulation----------------------------------------------
def _accumulation_error(variant: str) -> float:
    """Relative error of an accumulated gradient against the full-batch one."""
    model, tok = _tiny()
    trainer = Trainer(preset("stable", prompts_per_step=4, group_size=4, temperature=1.3),
                      model, tok)
    batch = trainer.make_batch()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.backward(batch, grad_accum_steps=1)
    full = [p.grad.clone() for p in trainer.policy.parameters()]
    trainer.optimizer.zero_grad(set_to_none=True)
    if variant == "correct":
        trainer.backward(batch, grad_accum_steps=3)
    else:
        bugs.broken_accumulation(trainer, batch, 3, variant)
    acc = [p.grad if p.grad is not None else torch.zeros_like(p)
           for p in trainer.policy.parameters()]
    num = sum(((a - f) ** 2).sum() for a, f in zip(acc, full, strict=True)) ** 0.5
    den = sum((f**2).sum() for f in full) ** 0.5
    return float(num / den)


def _accumulation_scenario(variant: str) -> Callable[[bool], Outcome]:
    def run(fixed: bool) -> Outcome:
        err = _accumulation_error("correct" if fixed else variant)
        return Outcome(err > 1e-3, f"accumulated vs full-batch gradient: relative error "
                                   f"{err:.2e} ({'fixed' if fixed else variant})", err)

    return run


# --- 004: report 004's chunking ----------------------------------------------------------
def empty_micro_batch(fixed: bool) -> Outcome:

    model, _ = _tiny()
    ids = torch.full((1, 6), 3)  # batch_size=1 with accum_steps=4
    if fixed:
        err = _error_text(lambda: micro_batch_slices(1, 4))
        return Outcome(False, f"refused before any forward pass: {err}")
    rows = ids.shape[0] // 4  # report 004: rows per chunk = batch // accum_steps = 0
    chunk = ids[:rows]
    err = _error_text(lambda: model(input_ids=chunk))
    return Outcome(err is not None, f"micro-batch of {chunk.shape[0]} rows -> {err}")


# --- the course: all-equal rewards in a group ------------------------------------------
def zero_std_group(fixed: bool) -> Outcome:

    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0])  # second group all right
    adv = group_advantages(rewards, 4, advantage_eps=1e-4 if fixed else 0.0)
    n_nan = int(torch.isnan(adv).sum())
    return Outcome(n_nan > 0, f"advantages {[round(a, 3) for a in adv.tolist()]}: {n_nan} NaN")


# --- 003: the KL "fix" --------------------------------------------------------------------
def kl_wrong_fix(fixed: bool) -> Outcome:

    g = torch.Generator().manual_seed(0)
    logits_p, logits_q = torch.randn(50, generator=g), torch.randn(50, generator=g)
    x = torch.multinomial(logits_p.softmax(-1), 200_000, replacement=True, generator=g)
    logp, ref_logp = logits_p.log_softmax(-1)[x], logits_q.log_softmax(-1)[x]
    if fixed:
        est = kl_k3(logp, ref_logp)
    else:  # report 003: delta = (ref - cur).clamp(-10, 10); kl = delta.clamp(0, 10)
        est = naive.report003_kl(logp, ref_logp)
    exact = float(exact_kl(logits_p, logits_q))
    sem = float(est.std() / len(est) ** 0.5)
    z = abs(float(est.mean()) - exact) / sem
    return Outcome(z > 5, f"exact KL {exact:.4f}, estimate {float(est.mean()):.4f} "
                          f"({z:.1f} standard errors away)")


# --- 003: sampling flags that generate() ignores ------------------------------------------
def temperature_ignored(fixed: bool) -> Outcome:

    model, tok = _tiny()
    ids, mask = encode_prompts(tok, ["1+2="], torch.device("cpu"))
    if fixed:
        def call():
            model.generate(input_ids=ids, attention_mask=mask,
                           generation_config=generation_config(tok, 3, True, 0.9, 0, 1.0))
    else:  # temperature set, but sampling not switched on: greedy, flags ignored
        def call():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3,
                           temperature=0.9, top_p=0.9, pad_token_id=tok.pad_token_id)
    seen = [m for m in transformers_messages(call) if "generation flags are not valid" in m]
    return Outcome(bool(seen), seen[0] if seen else "no warning: flags passed to generate()")


# --- 000: temperature 0 / non-finite logits into the sampler -----------------------------
def temperature_zero(fixed: bool) -> Outcome:

    if fixed:
        err = _error_text(lambda: GRPOConfig(temperature=0.0))
        return Outcome(False, f"rejected up front: {err}" if err else "accepted")
    logits = torch.tensor([[2.0, 1.0, 0.5]])
    probs = torch.softmax(logits / 0.0, dim=-1)  # a hand-rolled sampler at T=0
    err = _error_text(lambda: torch.multinomial(probs, 1))
    return Outcome(err is not None, f"softmax(logits / 0) = {probs.tolist()} -> {err}")


# --- 004: skipping a step under AMP -------------------------------------------------------
def amp_skip_no_inf_checks(fixed: bool) -> Outcome:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")

    def step(poison: bool):
        loss = model(torch.ones(2, 4)).sum() * (float("nan") if poison else 1.0)
        scaler.scale(loss).backward()
        if not fixed and poison:  # report 004: on NaN, clear the grads and carry on
            opt.zero_grad(set_to_none=True)
        scaler.step(opt)  # fixed: the scaler itself skips a step whose grads are inf/NaN
        scaler.update()
        opt.zero_grad(set_to_none=True)

    err = _error_text(lambda: [step(poison=i == 1) for i in range(3)])
    if err:
        return Outcome(True, err)
    return Outcome(False, f"3 steps, the NaN one skipped by GradScaler (scale now "
                          f"{scaler.get_scale():g})")


# --- 003: static checks catch what crashes mid-run ----------------------------------------
BROKEN_SOURCE = '''\
import torch


def load_dtype(use_compile):
    dtype = torch.bfloat16
    if use_compile:
        import torch
    return dtype


def kl_penalty(ref_lp, cur_lp):
    kl = (ref_lp - cur_lp).clamp(0, 10)
    return kl.mean(), delta.abs().max()
'''
FIXED_SOURCE = BROKEN_SOURCE.replace("    if use_compile:\n        import torch\n", "").replace(
    "    kl = (ref_lp - cur_lp)", "    delta = ref_lp - cur_lp\n    kl = delta"
)


def static_check(fixed: bool) -> Outcome:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train_step.py"
        path.write_text(FIXED_SOURCE if fixed else BROKEN_SOURCE)
        ruff = subprocess.run(
            [sys.executable, "-m", "ruff", "check", "--select", "F", "--no-cache",
             "--output-format", "concise", str(path)],
            capture_output=True, text=True,
            env={**os.environ, "NO_COLOR": "1"},  # Jupyter kernels set FORCE_COLOR
        )
        found = [line.split(": ", 1)[1] for line in ruff.stdout.splitlines() if ": F" in line]
    if ruff.returncode not in (0, 1) or (ruff.returncode == 1 and not found):
        # no findings from a ruff that did not run is not "clean" (exit 1: findings, or no ruff)
        raise RuntimeError("the static check needs ruff, which did not run for this Python "
                           f"({sys.executable}): {(ruff.stderr.strip() or 'no output')[-300:]}; "
                           "install it with: pip install ruff")
    namespace: dict = {}
    exec(compile(FIXED_SOURCE if fixed else BROKEN_SOURCE, "train_step.py", "exec"), namespace)
    errors = [
        _error_text(lambda: namespace["load_dtype"](True)),
        _error_text(lambda: namespace["kl_penalty"](torch.zeros(2), torch.ones(2))),
    ]
    errors = [e for e in errors if e]
    return Outcome(bool(found or errors), "ruff: " + ("; ".join(found) or "clean")
                   + " | at run time: " + ("; ".join(errors) or "no error"))


# --- 000/001: the whole naive configuration ----------------------------------------------
def naive_run(fixed: bool) -> Outcome:

    name = "stable" if fixed else "naive"
    trainer = Trainer(preset(name, steps=40, eval_every=0, eval_size=16))
    err = None
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            trainer.train(progress=False)
        except RuntimeError as e:
            err = f"{type(e).__name__}: {e}"
    norms = [m["grad_norm"] for m in trainer.history if "grad_norm" in m]
    finite = [g for g in norms if math.isfinite(g)]
    bad = next((m["step"] for m in trainer.history if m.get("nonfinite_params")), None)
    text = (f"{name}: max grad_norm {max(finite):.3g}, first non-finite step {bad}, "
            f"{'crash at step ' + str(trainer.step_count + 1) + ': ' + err if err else 'no crash'}")
    return Outcome(err is not None or bad is not None, text)


# --- 000/001: no health monitoring ---------------------------------------------------------
def no_health_monitoring(fixed: bool) -> Outcome:

    trainer = Trainer(preset("naive", steps=30, eval_every=0, eval_size=16, health_check=fixed))
    err = None
    try:
        trainer.train(progress=False)
    except RuntimeError as e:
        err = f"{type(e).__name__}: {e}"
    first_bad = next((m["step"] for m in trainer.history if m.get("nonfinite_params")), None)
    rollbacks = sum(m.get("rolled_back", 0) for m in trainer.history)
    if err:
        return Outcome(True, f"parameters went non-finite at step {first_bad}; nothing looked "
                             f"until step {trainer.step_count + 1} crashed: {err}")
    return Outcome(False, f"health check caught non-finite parameters at step {first_bad} and "
                          f"rolled back {rollbacks} time(s); {trainer.step_count} steps, no crash")


# --- 001: exp() of a summed log-ratio ---------------------------------------------------
def log_ratio_overflow(fixed: bool) -> Outcome:

    logp = torch.tensor([[-0.1, -0.2, -0.1, -0.3]], requires_grad=True)
    ref_logp = torch.tensor([[-25.0, -30.0, -22.0, -28.0]])  # tokens the reference found unlikely
    seq_logp, seq_base = naive.sequence_log_ratio_inputs(logp, ref_logp, torch.ones_like(logp))
    loss, _ = naive.constant_clip_surrogate(seq_logp, seq_base, torch.tensor([-1.0]),
                                           log_ratio_clamp=10.0 if fixed else None)
    loss.sum().backward()
    summed = float((seq_logp - seq_base)[0, 0].detach())
    ratio = torch.exp(torch.tensor(min(summed, 10.0) if fixed else summed))
    grad = logp.grad.abs().max().item()
    finite = bool(torch.isfinite(loss).all()) and math.isfinite(grad)
    return Outcome(not finite, f"summed log-ratio {summed:.1f} -> "
                               f"ratio {float(ratio):.3g}, loss {loss.sum().item():.3g}, "
                               f"max |grad| {grad:.3g}")


# --- 004: a crash mid-training loses work ----------------------------------------------
def crash_resume(fixed: bool) -> Outcome:

    with tempfile.TemporaryDirectory() as tmp:
        cfg = preset("stable", steps=4, checkpoint_every=2 if fixed else 0, eval_size=8)
        first = Trainer(cfg, out_dir=tmp)

        def crash(m):
            if m["step"] == 3:
                raise KeyboardInterrupt

        with contextlib.suppress(KeyboardInterrupt):
            first.train(progress=False, callback=crash)
        if not Path(tmp, "checkpoint.pt").exists():
            return Outcome(True, "crashed at step 3 with no checkpoint: all 3 steps lost")
        again = Trainer(cfg, out_dir=tmp)
        again.load_checkpoint()
        start = again.step_count
        again.train(progress=False)
        steps = [m["step"] for m in read_metrics(tmp)]
    return Outcome(False, f"crashed at step 3, resumed from step {start}, finished: "
                          f"metrics for steps {steps}")


# --- 003/004: memory pressure -------------------------------------------------------------
def memory_pressure(fixed: bool) -> Outcome:

    broken, fix = memory.oom_configs(device="cpu")
    cfg = fix if fixed else broken
    # a fresh process capped at its footprint after loading + OOM_BUDGET_MIB (RLIMIT_AS),
    # between what all rows at once and 8 micro-batches need (see memory.OOM_BUDGET_MIB)
    result = memory.capped_step(cfg, memory.OOM_BUDGET_MIB)
    rows, budget = result["rows"], f"{result['budget_mib']:.0f} MiB allowed"
    if result["error"]:
        return Outcome(True, f"one step of {rows} rows ({cfg.prompts_per_step} prompts x "
                             f"G={cfg.group_size}) at once, {budget}: {result['error']}")
    err = result["relative_grad_error"]
    return Outcome(err > 1e-5, f"the same {rows} rows in {cfg.grad_accum_steps} micro-batches, "
                               f"{budget}: done, peak RSS +{result['peak_mib']:.0f} MiB; "
                               f"gradient vs all {rows} at once: relative error {err:.1e}")


# --- 002: a multi-process run started without its launcher --------------------------------
def launch_without_launcher(fixed: bool) -> Outcome:
    """Report 002 started a multi-GPU run with plain `python`. Here a run whose
    environment says two processes (WORLD_SIZE=2) is started as one process by hand: rank 0
    waits at the rendezvous for a rank that never comes (a hang, bounded here by a short
    timeout so the error text shows). The fix is the launcher, which starts every rank."""
    import socket

    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    # the broken rank waits 3 s for the rank that never comes; torchrun's ranks get 10 s
    # for each other at every collective (rank 1 waits while rank 0 evaluates)
    # the tiny model on the CPU (gloo) under either profile, like every scenario but 000/002:
    # under the gpu profile a 2-process launch on one GPU would be refused for another reason
    env.update(OMP_NUM_THREADS="1", GRPO_LAB_DIST_TIMEOUT="10", GRPO_LAB_PROFILE="cpu")
    train = ["-m", "grpo_lab", "train", "--preset", "stable", "--steps", "1", "--no-progress",
             "--prompts-per-step", "4", "--group-size", "4", "--eval-size", "8"]
    with tempfile.TemporaryDirectory() as out:
        if fixed:
            torchrun = str(Path(sys.executable).parent / "torchrun")
            cmd = [torchrun, "--standalone", "--nproc_per_node", "2", *train, "--out", out]
        else:
            env.update(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), GRPO_LAB_DIST_TIMEOUT="3")
            cmd = [sys.executable, *train, "--out", out]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        wrote = (Path(out) / "metrics.jsonl").exists()
    if run.returncode == 0 and wrote:
        line = next((ln for ln in run.stdout.splitlines() if "data-parallel" in ln), "")
        return Outcome(False, f"torchrun started both ranks: {line.removeprefix('[grpo_lab] ')}"
                              "; the step ran and metrics.jsonl was written")
    errors = [ln for ln in run.stderr.splitlines() if "Error" in ln or "error" in ln]
    return Outcome(True, f"exit {run.returncode} after waiting for the missing rank: "
                         f"{(errors or ['no error line'])[-1].strip()[:300]}")


RUNS: dict[str, Callable[[bool], Outcome]] = {  # each scenario's run(fixed)
    "naive-run": naive_run,
    "nan-params-sampling-crash": nan_params_sampling_crash,
    "pad-token-vocab-mismatch": pad_token_vocab_mismatch,
    "accum-step-inside-loop": _accumulation_scenario("step-inside"),
    "accum-copy-instead-of-add": _accumulation_scenario("copy"),
    "accum-unnormalised": _accumulation_scenario("mean-per-micro-batch"),
    "empty-micro-batch": empty_micro_batch,
    "zero-std-group": zero_std_group,
    "kl-wrong-fix": kl_wrong_fix,
    "temperature-ignored": temperature_ignored,
    "temperature-zero": temperature_zero,
    "amp-skip-no-inf-checks": amp_skip_no_inf_checks,
    "static-check": static_check,
    "no-health-monitoring": no_health_monitoring,
    "log-ratio-overflow": log_ratio_overflow,
    "crash-resume": crash_resume,
    "memory-pressure": memory_pressure,
    "launch-without-launcher": launch_without_launcher,
}


def run_scenario(name: str, fixed: bool = False) -> Outcome:
    if name not in CATALOG:
        raise KeyError(f"unknown scenario {name!r}; see `python -m grpo_lab scenario --list`")
    return _run(name, fixed, str(_device()))


@once_per_session
def _run(name: str, fixed: bool, device: str) -> Outcome:  # device: part of the session key
    return RUNS[name](fixed)


_DEVICE_CHILD = """
import json, sys, torch
from grpo_lab.field.scenarios import _describe, _device, _error_text, run_scenario
try:
    outcome = run_scenario(sys.argv[1], fixed=sys.argv[2] == "fixed")
    symptom, evidence = outcome.symptom, outcome.evidence
except Exception as e:  # a CUDA error surfacing late, outside the scenario's own check
    symptom, evidence = True, "crashed: " + _describe(e)
after = _error_text(lambda: torch.ones(2, device=_device()).sum().item())
print("@@scenario@@ " + json.dumps({"symptom": symptom, "evidence": evidence,
                                    "after": after or "works"}))
"""


def run_on_device(name: str, fixed: bool, device: str, timeout: float = 600) -> dict:
    """Run scenario `name` (one of DEVICE_SCENARIOS) on `device` in a fresh process, then
    one more operation on the device in that process. Returns {'symptom', 'evidence',
    'after': that operation's error, or 'works', 'returncode'}. On CUDA the broken side's
    evidence is the device-side assert and 'after' shows the context stays broken. Both
    scenarios' symptom is a crash, so an error escaping the scenario counts as one."""
    if name not in DEVICE_SCENARIOS:
        raise ValueError(f"scenario {name!r} runs on CPU only; on a device: "
                         f"{', '.join(DEVICE_SCENARIOS)}")
    torch.device(device)  # a bad device string fails here, in one line
    # a fresh process that runs the scenario itself, never reading a session's result
    env = {k: v for k, v in os.environ.items() if k != SESSION_CACHE} | {DEVICE_ENV: device}
    p = subprocess.run([sys.executable, "-c", _DEVICE_CHILD, name, "fixed" if fixed else "broken"],
                       capture_output=True, text=True, env=env, timeout=timeout)
    lines = [line for line in p.stdout.splitlines() if line.startswith("@@scenario@@ ")]
    if not lines:
        tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"scenario {name!r} on {device}: the process exited with code "
                           f"{p.returncode} before reporting: {tail}")
    return {**json.loads(lines[-1].split(" ", 1)[1]), "returncode": p.returncode}
