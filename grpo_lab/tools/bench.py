"""grpo_lab vs TRL: the same GRPO run through both trainers, side by side.

    python -m grpo_lab.tools.bench [--steps 150] [--seeds 3] [--threads 1] [--device cpu]
    python -m grpo_lab.tools.bench --steps 3 --seeds 1   # smoke test
    python -m grpo_lab.tools.bench --profile gpu --device cuda --steps 50   # GPT-2 124M on a GPU

Both sides start from the same weights (the profile's model: the shipped tiny GPT-2, or
GPT-2 124M with `--profile gpu`), see the same prompts in
the same order (grpo_lab's seeded ProblemStream, handed to TRL as an unshuffled dataset),
score them with the same reward (`tasks.addition_reward`, in TRL's signature; the TRL side
works out `truncated` from the completion ids TRL passes) and
use the same G, completion cap, temperature, learning rate, beta and grad clipping. Each
side runs in its own subprocess, so its peak memory is its own, and the two take turns step
by step, never both at once (`turns.py` says why). Accuracy is measured identically on
both: greedy `sampling.greedy_accuracy` on `tasks.eval_problems(256)`, averaged over the
seeds, since one run's accuracy after 150 steps moves by several points from seed to seed.

Throughput: completion tokens per second, and model FLOPs utilisation (MFU): the FLOPs the
step's work needs, counted the same way for both sides (`model_flops_per_step`), over the
time it took and the device's peak (`--peak-tflops`, or the known fp32 peak of the GPU;
none on CPU). Running a prompt once per group saves grpo_lab work that this count still
credits, as MFU conventionally counts the model's work, not the implementation's.

Figures are printed, never asserted: on a shared machine the timings are noisy; the CPU
seconds per step (not counting time other jobs hold the core) are the steadier figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from ..config import PROFILE_MODELS, preset
from ..graphs import GRAPHS_ENV, graphs_wanted
from ..memo import once_per_session
from ..models import quiet_loading
from ..policy import load_policy
from ..sampling import greedy_accuracy
from ..startup import gc_paused
from ..tasks import ProblemStream, addition_reward, eval_problems
from ..trainer import Trainer
from .memory import maxrss_mib
from .parser import Parser, UsageError
from .turns import RESULT, Progress, run_in_turns

SIDES = ("grpo_lab", "TRL")
EVAL_SIZE = 256
# dense float32 peaks (TFLOP/s, no tensor-core TF32: both sides train in float32 at torch's
# default matmul precision), by a substring of torch.cuda.get_device_name(), the longest that
# matches ("L40S" before "L4"); NVIDIA data sheets, SXM unless named
PEAK_FP32_TFLOPS = {"H200": 67.0, "H100 PCIe": 51.0, "H100 NVL": 60.0, "H100": 67.0,
                    "A100": 19.5, "L40S": 91.6, "L40": 90.5, "L4": 30.3, "A10G": 31.2,
                    "T4": 8.1}
# dense bfloat16 tensor-core peaks (the datasheets' figures "with sparsity", halved); None:
# not certain here (the name must still be listed, or "H100" would match it): --peak-tflops
PEAK_BF16_TFLOPS = {"H200": 989.5, "H100 PCIe": 756.5, "H100 NVL": None, "H100": 989.5,
                    "A100": 312.0, "L40S": 362.05, "L40": None, "L4": 121.0, "A10G": None}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The benchmark's options; a bad one raises cli.UsageError (one line, exit 2 in main)."""
    ap = Parser(prog="python -m grpo_lab bench", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=150, help="optimizer steps per run (3: smoke)")
    ap.add_argument("--seeds", type=int, default=3,
                    help="runs per side, seeds SEED..SEED+SEEDS-1 (accuracy is their mean)")
    ap.add_argument("--seed", type=int, default=0, help="the first seed")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads per side, the same for both (1: on a shared "
                         "2-core machine two spinning threads run the tiny model far slower)")
    ap.add_argument("--device", default="cpu", help="'cpu' or 'cuda'")
    ap.add_argument("--profile", default="cpu",
                    help="'cpu' (the shipped tiny GPT-2) or 'gpu' (GPT-2 124M; needs --device cuda)")
    ap.add_argument("--amp", default="none", choices=("none", "bf16"),
                    help="'bf16': grpo_lab's amp='bf16' (sampling, reference and training "
                         "forwards under bf16 autocast) against TRL's bf16=True, fp32 master "
                         "weights on both sides; MFU against the bf16 peak")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the device's peak TFLOP/s for MFU (default: the known float32, or "
                         "with --amp bf16 bfloat16, peak of the GPU; on CPU no MFU is printed "
                         "without it)")
    ap.add_argument("--json", metavar="FILE", help="also write every figure, per side, as JSON")
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # internal: run one side
    args = ap.parse_args(argv)
    for name in ("steps", "seeds", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be an integer >= 1 (got {getattr(args, name)})")
    if args.seed < 0:
        ap.error(f"--seed must be an integer >= 0 (got {args.seed})")
    if args.device not in ("cpu", "cuda"):
        ap.error(f"--device must be 'cpu' or 'cuda' (got {args.device!r})")
    if args.profile not in PROFILE_MODELS:
        ap.error(f"--profile must be 'cpu' or 'gpu' (got {args.profile!r})")
    if args.profile == "gpu" and args.device != "cuda":
        ap.error("--profile gpu (GPT-2 124M) needs --device cuda")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        ap.error(f"--peak-tflops must be a number > 0 (got {args.peak_tflops})")
    return args


def bench_config(args: argparse.Namespace):
    """grpo_lab's stable preset (every safety switch on) on the tiny model; TRL copies the
    knobs it shares with it from this config."""

    return preset("stable", seed=args.seed, steps=args.steps, profile=args.profile,
                  device=args.device, eval_every=0, eval_size=EVAL_SIZE, checkpoint_every=0,
                  amp=args.amp)


def model_flops_per_step(n_params: int, rows: int, tokens_per_row: float, beta: float,
                         num_iterations: int) -> float:
    """FLOPs one GRPO step's work needs, by the usual count of 2 per parameter per token
    forward and 6 forward + backward (attention's T^2 term, small for these short rows,
    left out): sampling and, with beta > 0, the reference are forwards over every row's
    prompt and completion; training is num_iterations forward + backward passes.
    n_params: the parameters a token's forward multiplies by (see matmul_params)."""
    passes = 2 + (2 if beta > 0 else 0) + 6 * num_iterations
    return passes * n_params * rows * tokens_per_row


def matmul_params(model) -> int:
    """Parameters counted once (the tied LM head is the embedding matrix, used as a matmul),
    less the position embeddings, which are only looked up."""
    wpe = getattr(getattr(model, "transformer", None), "wpe", None)  # GPT-2's
    return sum(p.numel() for p in model.parameters()) - (wpe.weight.numel() if wpe else 0)


def mean_prompt_tokens(tokenizer, cfg) -> float:
    """Mean tokens per prompt over the run's prompts (ProblemStream(seed), in order)."""
    problems = ProblemStream(cfg.seed).sample(cfg.prompts_per_step * cfg.steps)
    ids = tokenizer([p.prompt for p in problems], add_special_tokens=False).input_ids
    return sum(map(len, ids)) / len(ids)


def peak_tflops(args: argparse.Namespace) -> tuple[float | None, str]:
    """(peak TFLOP/s for MFU or None, where it comes from)."""
    if args.peak_tflops is not None:
        return args.peak_tflops, "--peak-tflops"
    if args.device != "cuda":
        return None, ""
    import torch

    return known_peak(torch.cuda.get_device_name(), args.amp)


def known_peak(device_name: str, amp: str = "none") -> tuple[float | None, str]:
    peaks, dtype = (PEAK_BF16_TFLOPS, "bfloat16") if amp == "bf16" else (PEAK_FP32_TFLOPS,
                                                                         "float32")
    matches = sorted((k for k in peaks if k in device_name), key=len, reverse=True)
    if not matches or peaks[matches[0]] is None:
        return None, device_name
    return peaks[matches[0]], f"{device_name}, {dtype}"


# ---- the two sides, each in its own process ------------------------------------------------
def distance(model, start: list) -> float:
    """L2 distance of the model's parameters from `start`: > 0 once it has trained. `start`
    may lie on another device (TRL moves the model to the GPU after the copy was taken)."""
    import torch

    return float(torch.sqrt(sum(((p.detach() - q.to(p.device)) ** 2).sum() for p, q in
                                zip(model.parameters(), start, strict=True))))


def peak_memory_mib(device: str) -> dict:
    import torch


    out = {"peak_rss_mib": maxrss_mib()}
    if device == "cuda":
        out["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def run_grpo_lab(args: argparse.Namespace) -> dict:

    cfg = bench_config(args)
    trainer = Trainer(cfg)
    start = [p.detach().clone() for p in trainer.policy.parameters()]
    acc0 = trainer.evaluate()
    rows = cfg.prompts_per_step * cfg.group_size
    progress = Progress(f"grpo_lab seed {cfg.seed}", cfg.steps)
    sync = _device_sync(args.device)
    # the last step also runs the trainer's end-of-run eval; the median step ignores it
    for _ in range(cfg.steps):
        progress.begin()
        m = trainer.step()
        sync()
        progress.step_done(m["reward"], m["completions/mean_length"] * rows)
    return {**progress.figures(), "acc0": acc0, "acc": trainer.evaluate(),
            "moved": distance(trainer.policy, start), "matmul_params": matmul_params(trainer.policy),
            "prompt_tokens": mean_prompt_tokens(trainer.tokenizer, cfg)}


def run_trl(args: argparse.Namespace) -> dict:
    from datasets import Dataset


    cfg = bench_config(args)
    model, tokenizer = load_policy(cfg.profile)
    # the prompts grpo_lab's stream draws with this seed, in its order
    problems = ProblemStream(cfg.seed).sample(cfg.prompts_per_step * cfg.steps)
    dataset = Dataset.from_dict({"prompt": [p.prompt for p in problems],
                                 "answer": [p.answer for p in problems]})
    eval_set = eval_problems(EVAL_SIZE)
    start = [p.detach().clone() for p in model.parameters()]
    acc0 = greedy_accuracy(model, tokenizer, eval_set, cfg.max_new_tokens)
    with tempfile.TemporaryDirectory(prefix="grpo_lab_bench_trl_") as out_dir:
        trainer, timer = _trl_trainer(args, cfg, model, tokenizer, dataset, out_dir)
        trainer.train()
    acc = greedy_accuracy(trainer.model, tokenizer, eval_set, cfg.max_new_tokens)
    return {**timer.progress.figures(), "acc0": acc0, "acc": acc,
            "moved": distance(trainer.model, start), "matmul_params": matmul_params(trainer.model),
            "prompt_tokens": mean_prompt_tokens(tokenizer, cfg)}


@once_per_session
def both_sides(args: argparse.Namespace) -> dict[str, tuple[dict, float]]:
    """Both sides in this process, grpo_lab's then TRL's (notebook 12): {side: (its result,
    the seconds it took)}. No peak memory: in one process the second side's would include
    the first's (the comparison, `main`, runs each side in a fresh process)."""
    out = {}
    for side, run in (("grpo_lab", run_grpo_lab), ("TRL", run_trl)):
        t0 = time.perf_counter()
        result = run(args)
        out[side] = (result, time.perf_counter() - t0)
    return out


def _trl_trainer(args, cfg, model, tokenizer, dataset, out_dir: str):
    """A GRPOTrainer set up for the same work as grpo_lab's step, and its step timer."""
    with gc_paused():  # startup.py
        from transformers import TrainerCallback
        from trl import GRPOConfig as TRLConfig
        from trl import GRPOTrainer


    trl_args = TRLConfig(
        output_dir=out_dir,
        use_cpu=args.device == "cpu",
        seed=cfg.seed,
        max_steps=cfg.steps,
        # one step = prompts_per_step prompts x G completions, one optimizer update:
        # per-device batch = all completions of the step, no accumulation, so
        # steps_per_generation (default: gradient_accumulation_steps) = 1, and mu = 1
        per_device_train_batch_size=cfg.prompts_per_step * cfg.group_size,
        gradient_accumulation_steps=1,
        num_generations=cfg.group_size,
        num_iterations=cfg.num_iterations,
        shuffle_dataset=False,  # the dataset is already grpo_lab's seeded order
        max_completion_length=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        # objective: same loss, clip range, KL and reward scaling
        loss_type=cfg.loss_type,
        beta=cfg.beta,
        epsilon=cfg.epsilon_low,
        epsilon_high=cfg.epsilon_high,
        scale_rewards="group" if cfg.scale_rewards else "none",
        use_bias_correction_kl=False,  # TRL 1.16's default multiplies k3 by the ratio
        # already plain GRPO by default: token-level ratios, no entropy mask or bonus, no
        # two-sided (delta) clip, no off-policy mask, no vLLM importance weights, truncated
        # completions kept in the loss
        importance_sampling_level="token",
        mask_truncated_completions=False,
        # optimizer: TRL's default, torch's fused AdamW (the same update rule as
        # grpo_lab's torch.optim.AdamW); constant lr, no warmup, same decay and clipping
        learning_rate=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=cfg.max_grad_norm,
        # precision and memory: grpo_lab's amp (float32 by default; TRL defaults to bf16)
        # and no activation checkpointing (TRL defaults to it; grpo_lab's stable has it off)
        bf16=cfg.amp == "bf16",
        activation_checkpointing=False,
        disable_dropout=True,
        # no eval, no saving, no reporting; logging stays at TRL's default interval, and
        # the progress line below replaces the tqdm bar (both sides print the same)
        eval_strategy="no",
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )

    class Timer(TrainerCallback):
        """Wall time from one step's end to the next: generation, loss, update, logging."""

        def __init__(self):
            self.progress = Progress(f"TRL seed {cfg.seed}", cfg.steps)
            self.sync = _device_sync(args.device)

        def on_step_begin(self, args, state, control, **kwargs):
            if self.progress.last_wall is None:  # later steps count from the previous end
                self.progress.begin()

        def on_step_end(self, args, state, control, **kwargs):
            self.sync()
            # this step's mean reward and completion length; TRL empties _metrics when it
            # logs, after this hook
            metrics = trainer._metrics["train"]
            self.progress.step_done(metrics["reward"][-1], metrics["completions/mean_length"][-1]
                                    * cfg.prompts_per_step * cfg.group_size)

    def reward(completions, answer, completion_ids, **_):
        # the same contract as grpo_lab's trainer: a completion without EOS scores 0
        truncated = [tokenizer.eos_token_id not in ids for ids in completion_ids]
        return addition_reward(completions, answer, truncated)

    timer = Timer()
    with quiet_loading():  # TRL loads the reference from the model's directory
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=trl_args,
                              train_dataset=dataset, processing_class=tokenizer,
                              callbacks=[timer])
    return trainer, timer


def _device_sync(device: str):
    """Wait for queued GPU work before reading the clock; a no-op on CPU."""
    import torch

    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def run_side(args: argparse.Namespace) -> int:
    import warnings

    import torch

    # transformers' own deprecation notice, raised inside TRL's generation path
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
    torch.set_num_threads(args.threads)
    result = run_grpo_lab(args) if args.side == "grpo_lab" else run_trl(args)
    result.update(peak_memory_mib(args.device))
    print(RESULT + json.dumps(result), flush=True)
    return 0


# ---- the comparison ------------------------------------------------------------------------
def side_command(side: str, seed: int, args: argparse.Namespace) -> list[str]:
    """The command that runs one side for one seed in a fresh process."""
    return [sys.executable, "-m", "grpo_lab.tools.bench", "--side", side, "--steps",
            str(args.steps), "--seed", str(seed), "--threads", str(args.threads), "--device",
            args.device, "--profile", args.profile, "--amp", args.amp]


def merge(runs: list[dict]) -> dict:
    """One side's runs (one per seed) -> its figures: step times pooled over the runs,
    the largest peak memory, accuracies and rewards per seed."""
    out = {key: [t for r in runs for t in r[key]] for key in ("times", "cpu_times", "tokens")}
    out["matmul_params"] = runs[0]["matmul_params"]
    out["prompt_tokens"] = statistics.mean(r["prompt_tokens"] for r in runs)
    out["peak_rss_mib"] = max(r["peak_rss_mib"] for r in runs)
    if "peak_cuda_mib" in runs[0]:
        out["peak_cuda_mib"] = max(r["peak_cuda_mib"] for r in runs)
    for key in ("acc0", "acc", "reward_last10", "moved"):
        out[key] = [r[key] for r in runs]
    return out


def summary(results: dict, args: argparse.Namespace, seeds: list[int]) -> str:
    """The table, then the two figures the benchmark is about, last."""
    import torch
    import trl

    cfg = bench_config(args)
    per_step = cfg.prompts_per_step * cfg.group_size
    cuda = args.device == "cuda"
    mean = statistics.mean
    peak, peak_source = peak_tflops(args)
    head = ["side", "s/step", "CPU s/step", "compl/s", "tok/s", "MFU", "peak RSS",
            "eval accuracy", "reward"]
    unit = ["", "median", "median", "", "median", "median", "MiB", f"step 0 -> {cfg.steps}",
            "last 10"]
    if cuda:
        head.insert(7, "peak CUDA")
        unit.insert(7, "MiB")
    rows = [head, unit]
    figures = headline(results, args)
    for side in SIDES:
        r, f = results[side], figures[side]
        wall, tok_s = f["s_per_step"], f["tokens_per_s"]
        mfu = "n/a" if f["mfu"] is None else f"{100 * f['mfu']:.2f}%"
        row = [side, f"{wall:.3f}", f"{statistics.median(r['cpu_times']):.3f}",
               f"{per_step / wall:.0f}", f"{tok_s:.0f}", mfu, f"{r['peak_rss_mib']:.0f}",
               f"{mean(r['acc0']):.3f} -> {mean(r['acc']):.3f}",
               f"{mean(r['reward_last10']):.2f}"]
        if cuda:
            row.insert(7, f"{r['peak_cuda_mib']:.0f}")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    table = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()
             for row in rows]
    per_seed = [f"  eval accuracy at step {cfg.steps} by seed ({', '.join(map(str, seeds))}): "
                + "; ".join(f"{side} " + ", ".join(f"{a:.3f}" for a in results[side]["acc"])
                            for side in SIDES)]

    def ratio(key: str) -> float:
        return statistics.median(results["grpo_lab"][key]) / statistics.median(results["TRL"][key])

    return "\n".join([
        f"grpo_lab vs TRL {trl.__version__}: torch {torch.__version__}, {args.device}, "
        f"{args.threads} thread(s) per side, {os.cpu_count()} cores",
        f"{PROFILE_MODELS[args.profile]}, addition, stable preset, {cfg.steps} steps x {cfg.prompts_per_step} "
        f"prompts x G={cfg.group_size} = {per_step} completions/step, max "
        f"{cfg.max_new_tokens} new tokens, T={cfg.temperature:g}, lr {cfg.learning_rate:g} "
        f"(constant), beta {cfg.beta:g}, loss {cfg.loss_type}, max_grad_norm "
        f"{cfg.max_grad_norm:g}, {len(seeds)} seed(s), "
        + ("bf16 autocast, fp32 weights" if cfg.amp == "bf16" else "float32")
        + (f", grpo_lab's CUDA graphs {'on' if figures['cuda_graphs'] else 'off'} "
           f"({GRAPHS_ENV})" if args.device == "cuda" else ""),
        "",
        *table,
        *(per_seed if len(seeds) > 1 else []),
        "  MFU: " + (f"model FLOPs over a peak of {peak:g} TFLOP/s ({peak_source})" if peak else
                     "n/a, no peak known for this device (give --peak-tflops)")
        + f"; the FLOPs count {results['grpo_lab']['matmul_params'] / 1e6:.1f} M matmul "
        f"parameters and {results['grpo_lab']['prompt_tokens']:.1f} prompt tokens per row",
        "",
        f"CPU time ratio (grpo_lab/TRL): {ratio('cpu_times'):.3f}",
        f"step time ratio (grpo_lab/TRL): {figures['step_time_ratio']:.3f}",
        f"accuracy delta (grpo_lab - TRL): {figures['accuracy_delta']:+.3f}",
    ])


def headline(results: dict, args: argparse.Namespace) -> dict:
    """The figures the benchmark is about, per side: median s/step, median completion
    tokens/s, median MFU (a fraction of the peak; None with no known peak); and the step-time
    ratio grpo_lab/TRL and the accuracy delta grpo_lab - TRL."""
    cfg = bench_config(args)
    per_step = cfg.prompts_per_step * cfg.group_size
    peak, _ = peak_tflops(args)
    out: dict = {"peak_tflops": peak}
    for side in SIDES:
        r = results[side]
        # per step: completion tokens, and the model FLOPs of prompt + completion tokens
        mfu = None
        if peak is not None:
            flops = [model_flops_per_step(r["matmul_params"], per_step,
                                          r["prompt_tokens"] + n / per_step, cfg.beta,
                                          cfg.num_iterations) for n in r["tokens"]]
            mfu = statistics.median(f / t for f, t in zip(flops, r["times"], strict=True)) \
                / (peak * 1e12)
        out[side] = {
            "s_per_step": statistics.median(r["times"]),
            "tokens_per_s": statistics.median(n / t for n, t in zip(r["tokens"], r["times"],
                                                                     strict=True)),
            "mfu": mfu,
            "accuracy": statistics.mean(r["acc"]),
        }
    out["step_time_ratio"] = out["grpo_lab"]["s_per_step"] / out["TRL"]["s_per_step"]
    out["accuracy_delta"] = out["grpo_lab"]["accuracy"] - out["TRL"]["accuracy"]
    # grpo_lab's side replays its forwards as CUDA graphs where this is on (graphs.py)
    out["cuda_graphs"] = args.device == "cuda" and graphs_wanted()
    return out


def main(argv: list[str] | None = None) -> int:

    try:
        args = parse_args(argv)
    except UsageError as e:
        print(f"grpo_lab bench: error: {e}", file=sys.stderr)
        return 2
    if args.side is not None:
        return run_side(args)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("grpo_lab bench: error: --device cuda but CUDA is not available on this "
                  "machine", file=sys.stderr)
            return 2
    t0 = time.time()
    seeds = list(range(args.seed, args.seed + args.seeds))
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    env = {**os.environ, "GRPO_LAB_PROFILE": args.profile, "TOKENIZERS_PARALLELISM": "false"}
    for seed in seeds:
        print(f"[seed {seed}] {args.steps} steps per side, the sides taking turns ...",
              file=sys.stderr, flush=True)
        commands = {side: side_command(side, seed, args) for side in SIDES}
        try:
            for side, result in run_in_turns(commands, args.steps, env).items():
                runs[side].append(result)
        except RuntimeError as e:
            print(f"error: seed {seed}: {e}", file=sys.stderr)
            return 1
    print(f"(all runs took {time.time() - t0:.0f} s)", file=sys.stderr)
    results = {side: merge(r) for side, r in runs.items()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seeds": seeds, "steps": args.steps, "figures": headline(results, args),
                       **results}, f)
    print(summary(results, args, seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
