"""GPT-2's forwards as CUDA graphs (grpo_lab/graphs.py) against the eager ones, on the bench's
work: the sampler (its prompts' forward and its decode step), the reference's forward, and
the training forward with its backward. Are they as accurate, and how much faster?

    python benchmarks/decode_graphs.py --device cuda --profile gpu --amp bf16 --json F
    python benchmarks/decode_graphs.py                   # CPU: the static buffers, no graph

For each of --batches batches (the bench's 8 prompts x G=8, max 5 new tokens, T=1), the same
seed is sampled by the eager loop and by the static decoder, and the reference's forward is
run eagerly and through graphed() on the eager loop's completions; so is the training pass:
the gradient of the mean log-probability of the drawn tokens, accumulated over two
micro-batches of one shape (the second replays the graph the first one's gradient came
from: a gradient that aliased the graph's buffer would come out as the second one twice).
Per path, the error against the same computation in float64 (the drawn tokens' logits,
teacher-forced; the gradient's entries); each static path must be as accurate as its eager
one (numerics.as_accurate_bound), and on a GPU each must have been captured as a graph (a
failed capture only warns, and the computation runs without one): exit 1 if not. Reported besides: the batches whose completions came out
identical (rounding in another order can turn a draw at the edge of a token's interval),
the median time per path after --warmup batches, the first static call's time (the
capture), and the speed-ups. benchmarks/gpu_checks.sh runs it on the GPU machine.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
from functools import partial

import torch

from grpo_lab import fast, graphs
from grpo_lab.models import disable_dropout
from grpo_lab.numerics import as_accurate_bound
from grpo_lab.objective import completion_logits, token_logprobs
from grpo_lab.policy import load_policy
from grpo_lab.sampling import decode_loop, encode_prompts
from grpo_lab.tasks import ProblemStream
from grpo_lab.tools.bench import bench_config

PARTS = ("sampler", "reference", "training")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--profile", default="cpu", choices=("cpu", "gpu"))
    ap.add_argument("--amp", default="none", choices=("none", "bf16"))
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="batches left out of the timing")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", metavar="FILE")
    return ap.parse_args(argv)


def reference_forward(model, ids, mask, C: int, static: bool) -> torch.Tensor:
    """The reference's forward as the step runs it (fast.shared_prompt_logits, T=1), eager
    or through graphs.graphed (a CUDA graph on a GPU)."""
    run_forward = partial(graphs.graphed, static=True) if static else None
    with torch.inference_mode():
        return fast.shared_prompt_logits(model, ids, mask, C, run_forward=run_forward)


def training_gradient(model, ids, mask, completions, drawn, static: bool,
                      amp) -> list[torch.Tensor]:
    """The gradient of the drawn tokens' mean log-probability, as the step takes it
    (fast.shared_prompt_logits with autograd on), accumulated over the rows' two halves, as
    a float64 vector per parameter; eager, or through graphs.graphed (CUDA graphs on a
    GPU)."""
    run_forward = partial(graphs.graphed, static=True) if static else None
    full_ids, full_mask = torch.cat([ids, completions], 1), torch.cat([mask, drawn.long()], 1)
    C, B = completions.shape[1], len(ids)
    model.zero_grad(set_to_none=True)
    for half in (slice(0, B // 2), slice(B // 2, B)):
        with amp():
            logits = fast.shared_prompt_logits(model, full_ids[half], full_mask[half], C,
                                               run_forward=run_forward)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16: float32
        logp = token_logprobs(logits, completions[half]) * drawn[half]
        (logp.sum() / drawn.sum()).backward()
    return [(p.grad if p.grad is not None else torch.zeros_like(p)).double().flatten()
            for p in model.parameters()]


def training_excess(eager, static, truth) -> float:
    """The static gradient's error over its bound, parameter by parameter, each against its
    own scale (a small-gradient tensor's error would vanish in the largest one's): the
    largest ratio."""
    return max((s - t).abs().max().item() / as_accurate_bound((e - t).abs().max().item(),
                                                              t.abs().max().item())
               for e, s, t in zip(eager, static, truth, strict=True))


@torch.no_grad()
def move(trained, trained64, seed: int) -> None:
    """A small update of the trained model's parameters, in place, as an optimizer step is
    (the float64 copy gets the same values): a graph must read the parameters as they are
    at its replay, not as they were at its capture."""
    g = torch.Generator(next(trained.parameters()).device)
    g.manual_seed(seed)
    for p, p64 in zip(trained.parameters(), trained64.parameters(), strict=True):
        p.add_(1e-3 * p.abs().mean() * torch.randn(p.shape, generator=g, device=p.device))
        p64.copy_(p)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = bench_config(argparse.Namespace(seed=0, steps=args.batches, profile=args.profile,
                                          device=args.device, amp=args.amp))
    device = torch.device(args.device)
    model, tok = load_policy(args.profile)
    model.to(device).eval()
    model64 = copy.deepcopy(model).double()
    trained = disable_dropout(copy.deepcopy(model).train())  # the training forward's model
    trained64 = copy.deepcopy(trained).double()  # its truth, moved with it (move)
    for p in (*trained.parameters(), *trained64.parameters()):
        p.requires_grad_(True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def amp():
        return (torch.autocast(device.type, dtype=torch.bfloat16) if args.amp == "bf16"
                else contextlib.nullcontext())

    def timed(part, static_path, i, fn, *fn_args, **fn_kwargs):
        sync()
        t0 = time.perf_counter()
        out = fn(*fn_args, **fn_kwargs)
        sync()
        seconds = time.perf_counter() - t0
        first.setdefault((part, static_path), seconds)
        if i >= args.warmup:
            times[part, static_path].append(seconds)
        return out

    stream = ProblemStream(0)
    G = cfg.group_size
    times = {(part, static): [] for part in PARTS for static in (False, True)}
    first, errors, worst, identical = {}, {}, {part: (0.0, None) for part in PARTS}, 0
    for i in range(args.batches):
        prompts = [p.prompt for p in stream.sample(cfg.prompts_per_step)]
        ids, mask = encode_prompts(tok, prompts, device)
        ids, mask = ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0)
        out = {}
        for static in (False, True):
            torch.manual_seed(1000 + i)
            with torch.no_grad(), amp():
                out[static] = timed("sampler", static, i, decode_loop, model, tok, ids, mask,
                                    G, cfg.max_new_tokens, cfg.temperature, cfg.top_k,
                                    cfg.top_p, cfg.safe_sampling, static=static)
        identical += torch.equal(out[False][0], out[True][0])
        found, scale = {}, 0.0  # per (part, static): the largest error of a drawn token
        for static, (completions, raw) in out.items():
            drawn = completions != tok.pad_token_id
            full_ids = torch.cat([ids, completions], 1)
            full_mask = torch.cat([mask, drawn.long()], 1)
            C = completions.shape[1]
            with torch.no_grad():
                truth = completion_logits(model64, full_ids, full_mask, C)
            scale = max(scale, truth.abs().max().item())
            found["sampler", static] = ((raw.double() - truth).abs() * drawn[..., None]).max()
            if not static:  # the reference's forward, both ways, on the eager loop's rows
                for ref_static in (False, True):
                    with amp():
                        logits = timed("reference", ref_static, i, reference_forward, model,
                                       full_ids, full_mask, C, ref_static)
                    found["reference", ref_static] = (
                        (logits.double() - truth).abs() * drawn[..., None]).max()
        completions, _ = out[False]
        drawn = completions != tok.pad_token_id
        if i > 0:
            move(trained, trained64, seed=i)
        truth = training_gradient(trained64, ids, mask, completions, drawn, False,
                                  contextlib.nullcontext)
        grads = {}
        for static in (False, True):
            grads[static] = timed("training", static, i, training_gradient, trained, ids, mask,
                                  completions, drawn, static, amp)
            found["training", static] = max((g - t).abs().max()
                                            for g, t in zip(grads[static], truth, strict=True))
        for (part, static), err in found.items():
            errors.setdefault((part, static), []).append(err.item())
        for part in PARTS:
            excess = (training_excess(grads[False], grads[True], truth) if part == "training"
                      else found[part, True].item() / as_accurate_bound(
                          found[part, False].item(), scale))
            worst[part] = max(worst[part], (excess, i), key=lambda w: w[0])
    kept = graphs._KEPT.get(model, {}).values()
    # a set of shapes is captured at its second call: those called once ran eagerly
    forwards = [g for g in kept if isinstance(g, graphs.GraphedCall) and g.calls > 1]
    captured = {"sampler": [g.run.graph is not None for g in kept  # its prompts', its step
                            if isinstance(g, graphs.StaticDecoder)]
                + [g.run.graph is not None for g in forwards if g.fn is graphs._prompt_pass],
                "reference": [g.run.graph is not None for g in forwards
                              if g.fn is not graphs._prompt_pass],
                "training": [g.forward_graph is not None for g in
                             graphs.training_calls(trained) if g.calls > 1]}
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "profile": args.profile, "amp": args.amp, "batches": args.batches,
              "identical_completions": identical}
    print(f"{args.batches} batches of {len(ids)} rows, {args.profile} profile, {args.device}, "
          f"amp {args.amp}; identical completions in {identical} of them")
    failed = 0
    for part in PARTS:
        eager, static = (statistics.median(times[part, s]) for s in (False, True))
        result[part] = {
            "graphs": sum(captured[part]), "kept": len(captured[part]),
            "max_error_eager": max(errors[part, False]),
            "max_error_static": max(errors[part, True]),
            "worst_error_over_bound": worst[part][0],
            "eager_ms": 1e3 * eager, "static_ms": 1e3 * static, "speedup": eager / static,
            "first_static_call_ms": 1e3 * first[part, True]}
        r = result[part]
        what = "a gradient entry" if part == "training" else "a drawn token's logit"
        print(f"{part}: {r['graphs']} of {r['kept']} kept as CUDA graphs; largest error of "
              f"{what} against float64: eager {r['max_error_eager']:.3g}, static "
              f"{r['max_error_static']:.3g} (at most {r['worst_error_over_bound']:.2f} of its "
              f"bound, batch {worst[part][1]}); median of {len(times[part, False])}: eager "
              f"{r['eager_ms']:.1f} ms, static {r['static_ms']:.1f} ms, speed-up "
              f"{r['speedup']:.2f} x (first static call, with the capture: "
              f"{r['first_static_call_ms']:.0f} ms)")
        if r["worst_error_over_bound"] > 1:
            print(f"FAILED: the {part}'s static path is less accurate than its eager one")
            failed = 1
        if device.type == "cuda" and (not captured[part] or not all(captured[part])):
            print(f"FAILED: the {part}'s forward was not captured as a CUDA graph (see the "
                  "RuntimeWarning above): this run checked it without a graph")
            failed = 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return failed


if __name__ == "__main__":
    sys.exit(main())
