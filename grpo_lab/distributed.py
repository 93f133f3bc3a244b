"""Data-parallel training under a launcher: `torchrun` or `accelerate launch` (DDP).

A launcher starts one process per device and tells each who it is through the
environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
The trainer reads that, joins the process group (gloo on CPU, nccl on CUDA) and wraps
the policy in torch's DistributedDataParallel. What changes, and why:

    prompts       each step's global prompts are drawn from one shared stream, and rank r
                  takes its contiguous share, so the world samples what one process would
    token weights normalised by the *global* batch (rows and tokens summed over ranks),
                  so the per-rank losses add up to the single-process loss
    gradients     DDP all-reduces them as a mean; each rank scales its loss by world_size,
                  which turns that mean into the sum the global weights call for
    metrics       sums and maxima reduced over ranks; rank 0 alone evaluates, writes
                  metrics.jsonl, the plot and the checkpoint

Report 002's pitfall is starting a multi-GPU run with plain `python`: one process, so
every GPU but the first idles (and HF's Trainer falls back to DataParallel). The check
below names the launcher command to run instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .config import ConfigError

# how long ranks wait for each other (rendezvous and collectives) before failing with
# an error instead of hanging forever, e.g. when a launcher started fewer processes
# than WORLD_SIZE says
TIMEOUT = timedelta(seconds=float(os.environ.get("GRPO_LAB_DIST_TIMEOUT", "300")))

LAUNCH_HINT = (
    "torchrun --standalone --nproc_per_node {n} -m grpo_lab train ... "
    "(or: accelerate launch --multi_gpu --num_processes {n} -m grpo_lab train ...)"
)


@dataclass(frozen=True)
class World:
    """Where this process sits among the launched ones."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name} must be an integer (got {raw!r})") \
            from None


def world_from_env() -> World:
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"RANK={rank} and WORLD_SIZE={world_size} from the launcher are "
                          f"inconsistent: need 0 <= RANK < WORLD_SIZE")
    return World(rank, world_size, _env_int("LOCAL_RANK", 0))


def launch_problem(device: str | None = None) -> str | None:
    """One line on how this process was launched wrong, or None.

    Plain `python` on a machine with several visible GPUs (and no device chosen) trains on
    one of them; a launcher that starts more processes per node than there are GPUs maps
    ranks to devices that do not exist."""
    if not torch.cuda.is_available():
        return None
    n_gpus = torch.cuda.device_count()
    launched = os.environ.get("WORLD_SIZE") is not None
    if not launched and n_gpus > 1 and device is None:
        return (f"{n_gpus} GPUs are visible but this is a single process started without a "
                f"launcher, so only cuda:0 would train; run: " + LAUNCH_HINT.format(n=n_gpus)
                + "; to use one GPU on purpose set CUDA_VISIBLE_DEVICES=0 or pass --device cuda:0")
    per_node = _env_int("LOCAL_WORLD_SIZE", _env_int("WORLD_SIZE", 1))
    if launched and device in (None, "cuda") and per_node > n_gpus:
        return (f"the launcher started {per_node} processes on this node but only {n_gpus} "
                f"GPU(s) are visible; run: " + LAUNCH_HINT.format(n=n_gpus)
                + f"; to share one GPU between the {per_node} processes on purpose, pass "
                "--device cuda:0")
    return None


def shares_one_gpu(device: str | None) -> bool:
    """A launched run whose ranks all name one GPU (`--device cuda:0`): they share it,
    through gloo (NCCL refuses two ranks on one GPU). Notebook 12 runs its two ranks so on
    a machine with one GPU."""
    return device is not None and device.startswith("cuda:")


def setup(device: str | None) -> tuple[World, torch.device | None]:
    """Join the process group when launched with WORLD_SIZE > 1. Returns the world and the
    device this rank must use (None: not distributed, let the config decide)."""
    world = world_from_env()
    if not world.distributed:
        return world, None
    problem = launch_problem(device)
    if problem:
        raise ConfigError(problem)
    use_cuda = torch.cuda.is_available() and (device is None or device.startswith("cuda"))
    shared = use_cuda and shares_one_gpu(device)
    rank_device = (torch.device(device) if shared else torch.device("cuda", world.local_rank)
                   if use_cuda else torch.device("cpu"))
    if not dist.is_initialized():
        if use_cuda:
            torch.cuda.set_device(rank_device)
        dist.init_process_group("nccl" if use_cuda and not shared else "gloo", timeout=TIMEOUT)
    return world, rank_device


def shutdown(wait_for_others: bool = True) -> None:
    """Leave the process group. Drop every DDP wrapper first (Trainer.close does): a
    wrapper freed after this point destroys the gloo group from its own destructor, with
    the GIL held, while gloo's worker thread may need the GIL to free a finished work
    item: a deadlock at exit (seen here with torch 2.13).

    wait_for_others=False after an error: the other ranks are inside some collective, and
    a barrier would be matched against it; leave, so the launcher sees this rank fail and
    stops the rest."""
    if dist.is_available() and dist.is_initialized():
        if wait_for_others:
            dist.barrier()
        dist.destroy_process_group()


def all_reduce(t: torch.Tensor, world: World, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In place over ranks (SUM or MAX); the identity in a single process."""
    if world.distributed:
        dist.all_reduce(t, op=op)
    return t


def gather_objects(obj, world: World) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if not world.distributed:
        return [obj]
    out = [None] * world.world_size
    dist.all_gather_object(out, obj)
    return out


def shard(n: int, world: World) -> slice:
    """Rank's contiguous share of n items; n must divide evenly."""
    per_rank = n // world.world_size
    return slice(world.rank * per_rank, (world.rank + 1) * per_rank)
