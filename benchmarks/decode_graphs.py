"""The sampler's decode step replayed as a CUDA graph (grpo_lab/graphs.py) against the eager
loop, on the bench's work: is it as accurate, and how much faster is sampling?

    python benchmarks/decode_graphs.py --device cuda --profile gpu --amp bf16 --json F
    python benchmarks/decode_graphs.py                   # CPU: the static step, no graph

For each of --batches batches (the bench's 8 prompts x G=8, max 5 new tokens, T=1), the same
seed is sampled by the eager loop and by the static decoder. Per path, the error of the raw
logits of the tokens it drew against the same forward in float64, teacher-forced; the
static path must be as accurate as the eager one (numerics.as_accurate_bound), and on a GPU
the step must have been captured as a graph (a failed capture only warns, and the decoder
runs its step without one): exit 1 if not. Reported besides: the batches whose completions came out identical (rounding in
another order can turn a draw at the edge of a token's interval), the median time of a
whole sample_group call per path after --warmup batches, the first graph call's time
(the capture), and the speed-up. benchmarks/gpu_checks.sh runs it on the GPU machine.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time

import torch

from grpo_lab import graphs
from grpo_lab.numerics import as_accurate_bound
from grpo_lab.objective import completion_logits
from grpo_lab.policy import load_policy
from grpo_lab.sampling import decode_loop, encode_prompts
from grpo_lab.tasks import ProblemStream
from grpo_lab.tools.bench import bench_config


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = bench_config(argparse.Namespace(seed=0, steps=args.batches, profile=args.profile,
                                          device=args.device, amp=args.amp))
    device = torch.device(args.device)
    model, tok = load_policy(args.profile)
    model.to(device).eval()
    model64 = copy.deepcopy(model).double()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    amp = (torch.autocast(device.type, dtype=torch.bfloat16) if args.amp == "bf16"
           else contextlib.nullcontext())
    stream = ProblemStream(0)
    G = cfg.group_size
    times = {False: [], True: []}
    errors = {False: [], True: []}
    identical, first_graph_call, worst = 0, None, None
    for i in range(args.batches):
        prompts = [p.prompt for p in stream.sample(cfg.prompts_per_step)]
        ids, mask = encode_prompts(tok, prompts, device)
        ids, mask = ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0)
        out = {}
        for static in (False, True):
            torch.manual_seed(1000 + i)
            sync()
            t0 = time.perf_counter()
            with torch.no_grad(), amp:
                out[static] = decode_loop(model, tok, ids, mask, G, cfg.max_new_tokens,
                                          cfg.temperature, cfg.top_k, cfg.top_p,
                                          cfg.safe_sampling, static=static)
            sync()
            seconds = time.perf_counter() - t0
            if static and first_graph_call is None:
                first_graph_call = seconds
            if i >= args.warmup:
                times[static].append(seconds)
        identical += torch.equal(out[False][0], out[True][0])
        scale, errs = 0.0, {}
        for static, (completions, raw) in out.items():
            drawn = completions != tok.pad_token_id
            with torch.no_grad():
                truth = completion_logits(model64, torch.cat([ids, completions], 1),
                                          torch.cat([mask, drawn.long()], 1),
                                          completions.shape[1])
            errs[static] = ((raw.double() - truth).abs() * drawn[..., None]).max().item()
            scale = max(scale, truth.abs().max().item())
        for static in errs:
            errors[static].append(errs[static])
        excess = errs[True] / as_accurate_bound(errs[False], scale)
        if worst is None or excess > worst[0]:
            worst = (excess, i, errs[False], errs[True])
    eager, static = statistics.median(times[False]), statistics.median(times[True])
    decoders = graphs._DECODERS.get(model, {})
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "profile": args.profile, "amp": args.amp, "batches": args.batches,
        "graph": any(d.use_graph and d.graph is not None for d in decoders.values()),
        "decoders": len(decoders),
        "identical_completions": identical,
        "max_error_eager": max(errors[False]), "max_error_static": max(errors[True]),
        "worst_error_over_bound": worst[0],
        "eager_ms": 1e3 * eager, "static_ms": 1e3 * static, "speedup": eager / static,
        "first_static_call_ms": 1e3 * first_graph_call,
    }
    print(f"{args.batches} batches of {len(ids)} rows, {args.profile} profile, {args.device}, "
          f"amp {args.amp}; static decoder {'as a CUDA graph' if result['graph'] else 'without a graph'}"
          f" ({result['decoders']} kept)")
    print(f"identical completions: {identical} of {args.batches} batches")
    print(f"largest error of a drawn token's raw logit against float64: eager "
          f"{result['max_error_eager']:.3g}, static {result['max_error_static']:.3g}; the "
          f"static one at most {worst[0]:.2f} of its bound (batch {worst[1]})")
    print(f"sample time, median of {len(times[False])} batches: eager {result['eager_ms']:.1f} "
          f"ms, static {result['static_ms']:.1f} ms, speed-up {result['speedup']:.2f} x "
          f"(first static call, with the capture: {result['first_static_call_ms']:.0f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    failed = 0
    if worst[0] > 1:
        print("FAILED: the static decoder's logits are less accurate than the eager loop's")
        failed = 1
    if device.type == "cuda" and not result["graph"]:
        print("FAILED: no CUDA graph was captured (see the RuntimeWarning above): this run "
              "checked the static step without a graph")
        failed = 1
    return failed


if __name__ == "__main__":
    sys.exit(main())
