"""The field scenarios' catalog: each one's name, field report, symptom, cause and fix.

Plain text without torch, so that `python -m grpo_lab scenario --list`, an unknown name and a
refused `--device` answer at once; `scenarios.RUNS` holds what each scenario runs.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class Scenario:
    name: str
    report: str  # the field report it comes from (its number), or "-": a failure the course adds
    symptom: str
    cause: str
    fix: str


# the scenarios that touch the device's kernels, run in a fresh process by
# scenarios.run_on_device (on CUDA their failure is a device-side assert, which leaves the
# process's CUDA context unusable)
DEVICE_SCENARIOS = ("nan-params-sampling-crash", "pad-token-vocab-mismatch")


def describe(s: Scenario) -> str:
    return textwrap.dedent(f"""\
        {s.name}  (report {s.report})
          symptom: {s.symptom}
          cause:   {s.cause}
          fix:     {s.fix}""")


CATALOG: dict[str, Scenario] = {s.name: s for s in [
    Scenario("naive-run",
             "000/001",
             "grad norm spikes by orders of magnitude, parameters go NaN, sampling crashes",
             "ratio against the reference and report 001's `clip_ratio * advantage` (read as "
             "a constant), no log-ratio clamp, lr too high",
             "the stable preset: ratio vs the sampling policy, real clipping, "
             "clamps, grad clipping, health checks"),
    Scenario("nan-params-sampling-crash",
             "000",
             "torch.multinomial: probability tensor contains either inf, nan or element < 0",
             "NaN parameters from an exploded update give NaN logits",
             "check parameter health after every update and roll back"),
    Scenario("pad-token-vocab-mismatch",
             "002",
             "IndexError: index out of range in self",
             "a pad token added to the tokenizer has no embedding row",
             "reuse EOS as pad, or resize the embeddings"),
    Scenario("accum-step-inside-loop",
             "003",
             "each update uses the last micro-batch's gradient only (the report logged "
             "KL = 0.000; notebook 08 measures that with AdamW the model still moves)",
             "zero_grad/step inside the micro-batch loop: each update sees one micro-batch",
             "zero_grad before the loop, one step after it"),
    Scenario("accum-copy-instead-of-add",
             "003",
             "accumulated gradient = the last micro-batch's",
             "p.grad.copy_(g) overwrites the earlier micro-batches",
             "p.grad.add_(g) (or let backward() accumulate)"),
    Scenario("accum-unnormalised",
             "-",
             "accumulated gradient != full-batch gradient",
             "each micro-batch's mean loss / K: micro-batches with fewer tokens weigh more",
             "token weights from the whole batch (token_weights)"),
    Scenario("empty-micro-batch",
             "004",
             "a forward pass on 0 rows fails",
             "rows per chunk = batch // accum_steps is 0 when batch < accum_steps",
             "split into non-empty chunks and refuse accum_steps > batch"),
    Scenario("zero-std-group",
             "-",
             "NaN advantages -> NaN gradients",
             "(r - mean) / std with std = 0 for a group whose rewards are all equal",
             "divide by std + eps (advantage_eps)"),
    Scenario("kl-wrong-fix",
             "003",
             "the KL estimate is biased; beta control acts on a wrong number",
             "report 003 replaced k3 with (ref - cur).clamp(0, 10)",
             "keep k3 = exp(ref - cur) - (ref - cur) - 1: unbiased and >= 0"),
    Scenario("temperature-ignored",
             "003",
             "The following generation flags are not valid and may be ignored",
             "temperature/top_p given while sampling is off (or through a logits processor)",
             "pass do_sample=True with temperature/top_k/top_p to generate()"),
    Scenario("temperature-zero",
             "000",
             "multinomial crash on NaN probabilities (the course's "
             "extension: report 000 lowered the temperature, with a floor of 0.3)",
             "logits / 0 is inf or NaN",
             "temperature > 0 is validated; use greedy for T = 0"),
    Scenario("amp-skip-no-inf-checks",
             "004",
             "AssertionError: No inf checks were recorded for this optimizer",
             "grads cleared on NaN, then scaler.step() finds nothing to unscale",
             "let GradScaler skip the step itself (or skip step and update together)"),
    Scenario("static-check",
             "003",
             "UnboundLocalError / NameError mid-run",
             "`import torch` inside a function; `delta` deleted but still used",
             "run ruff (F821, F823) before the run"),
    Scenario("no-health-monitoring",
             "000/001",
             "corruption is noticed only when sampling crashes, a step after it happened",
             "nobody checks the parameters after an update",
             "count non-finite parameters after every update; roll back to a snapshot"),
    Scenario("log-ratio-overflow",
             "001",
             "ratio = exp(105) = inf: the loss and gradients go inf/NaN",
             "log-ratios summed over a sequence against the reference, no clamp",
             "token-level ratios against the sampling policy; clamp the log-ratio as a net"),
    Scenario("crash-resume",
             "004",
             "a crash mid-training loses every step since the last "
             "checkpoint (report 004's driver crashes; its stack did resume from checkpoints)",
             "no checkpoint, or one written non-atomically",
             "atomic checkpoints and --resume"),
    Scenario("memory-pressure",
             "003/004",
             "out of memory mid-step (CUDA out of memory; on CPU DefaultCPUAllocator: "
             "can't allocate memory)",
             "the whole batch's activations held at once for one backward",
             "the same batch in micro-batches (grad_accum_steps; the gradient is the same), "
             "and/or gradient_checkpointing; `python -m grpo_lab.tools.memory` measures each"),
    Scenario("launch-without-launcher",
             "002",
             "a multi-process run hangs at start-up (the course's example; the report shows "
             "device-side asserts from runs started with plain python)",
             "started with plain python where a launcher was meant: the ranks it expects "
             "never start",
             "start it with the launcher (torchrun / accelerate launch); on a multi-GPU "
             "machine `train` refuses plain python and prints the command"),
]}
