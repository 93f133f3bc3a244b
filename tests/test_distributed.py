"""Data-parallel training (DDP, gloo on CPU) against one process on the same global batch,
the launchers (torchrun, accelerate launch) through the CLI, and the launch pitfalls."""

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_lab import distributed
from grpo_lab.cli import main
from grpo_lab.config import ConfigError, preset
from grpo_lab.models import requested_device
from grpo_lab.numerics import adamw_first_step, sum_error_bound
from grpo_lab.trainer import Trainer, read_metrics, without_timing

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SMALL = dict(prompts_per_step=4, group_size=4, eval_size=16, eval_every=0)


def launch(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRPO_LAB_DIST_TIMEOUT": "120"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def torchrun(*args: str) -> subprocess.CompletedProcess:
    return launch([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", *args])


CASES = [  # loss type, micro-batches per rank, mu
    dict(loss_type="grpo", grad_accum_steps=1, num_iterations=1),
    dict(loss_type="dr_grpo", grad_accum_steps=2, num_iterations=1),
    dict(loss_type="bnpo", grad_accum_steps=2, num_iterations=1),
    dict(loss_type="dapo", grad_accum_steps=1, num_iterations=1),
    # mu = 2: the second pass's ratio is != 1, so clipping is exercised
    dict(loss_type="grpo", grad_accum_steps=2, num_iterations=2),
]


def unclipped(grads: dict, grad_norm: float, max_norm: float) -> dict:
    """The gradients before clip_grad_norm_ scaled them (by max_norm / (norm + 1e-6), as
    torch does, when that is < 1), in float64."""
    scale = min(1.0, max_norm / (grad_norm + 1e-6))
    return {n: g.double() / scale for n, g in grads.items()}


def float64_update(cfg, initial: dict, batch) -> dict:
    """The one-process update of `batch` in float64: the gradient float32 rounds."""
    trainer = Trainer(cfg.replace(grad_accum_steps=1))
    trainer.policy.load_state_dict(initial)
    trainer.policy.double()
    batch = copy.deepcopy(batch)
    batch.old_logp = None
    trainer.update(batch)
    return unclipped({n: p.grad for n, p in trainer.policy.named_parameters()},
                     trainer.last_grad_norm, cfg.max_grad_norm)


def distance(a: dict, b: dict) -> float:
    return math.sqrt(sum(((a[n].double() - b[n].double()) ** 2).sum().item() for n in a))


@pytest.mark.numerics
def test_two_process_update_equals_one_process_on_the_same_global_batch(tmp_path):
    """Two ranks sum their rows' gradients in another order than one process does (and
    run half-size batches, which may pick other GEMM blocking), so the two float32
    gradients differ by rounding. How much, this test measures instead of guessing: both
    are compared with the float64 gradient of the same update, and the two-process one
    must be as accurate as the one-process one. The factor 2 is measured, not derived: each
    error is the norm of ~10^6 roundings, which concentrates, and the ratio was 0.61-1.13
    over the five cases on AVX-512 (benchmarks/RESULTS.md, "Kernels"; .ci/kernels runs it
    under AVX2, generic kernels and 2 threads). A wrong reduction (a rank's rows dropped or
    counted twice, clipping per rank, the world size applied twice) is off by the
    gradient's own size, ~10^5 times that error. At mu = 2 both float32 runs leave the
    float64 one after the first AdamW step (4.9e-4 relative, the same on both sides), so
    there the check is ~300x looser: the mu = 1 cases carry the precision.
    The update itself is then exact: each side's weights are the optimizer's step on that
    side's gradients, bit for bit (numerics.adamw_first_step)."""
    torch.set_num_threads(1)
    cases, expected = [], []
    for overrides in CASES:
        cfg = preset("stable", **SMALL, **overrides)
        # one process, the whole global batch in one micro-batch
        single = Trainer(cfg.replace(grad_accum_steps=1))
        initial = {k: v.clone() for k, v in single.policy.state_dict().items()}
        batch = single.make_batch()
        # the ranks get the batch as sampled: each computes its own pi_old (old_logp), as a
        # run does (update() below sets it on this object)
        cases.append({"config": cfg, "initial_policy": initial, "batch": copy.deepcopy(batch)})
        truth = float64_update(cfg, initial, batch)
        stats, _ = single.update(batch)
        expected.append({
            "loss": stats["loss"].item(),
            "grads": {n: p.grad.clone() for n, p in single.policy.named_parameters()},
            "grad_norm": single.last_grad_norm,
            "params": {n: p.detach().clone() for n, p in single.policy.named_parameters()},
            "float64_grads": truth,
        })
    torch.save(cases, tmp_path / "cases.pt")
    run = torchrun("tests/ddp_worker.py", str(tmp_path / "cases.pt"), str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    for i, (overrides, want) in enumerate(zip(CASES, expected, strict=True)):
        cfg, got = cases[i]["config"], torch.load(tmp_path / f"case{i}.pt", weights_only=False)
        assert got["weights_match"], f"{overrides}: per-rank token weights differ from global"
        truth = want["float64_grads"]
        error_one = distance(unclipped(want["grads"], want["grad_norm"], cfg.max_grad_norm),
                             truth)
        error_two = distance(unclipped(got["grads"], got["grad_norm"], cfg.max_grad_norm),
                             truth)
        size = math.sqrt(sum((g ** 2).sum().item() for g in truth.values()))
        assert error_one < 1e-3 * size, f"{overrides}: the float32 reference is not float32"
        assert error_two <= 2 * error_one, (
            f"{overrides}: the two-process gradient is {error_two / size:.2e} (relative) from "
            f"the float64 one, the one-process gradient {error_one / size:.2e}")
        if overrides["num_iterations"] > 1:
            continue  # two AdamW steps: the weights follow from the gradients compared above
        # mu = 1: the loss is sum_t w_t * (-A_t * r_t + beta * k3_t). Each side's pi_old is
        # its own forward, detached, so r_t = exp(0) = 1 exactly; the reference is the
        # initial policy, so k3_t = exp(d) - d - 1 with d a log-prob's rounding (~1e-6):
        # beta * k3 < 1e-13, far below the bound. What remains is a sum of n products,
        # computed in different orders (numerics module)
        terms = (cases[i]["batch"].weights * cases[i]["batch"].advantages[:, None]).abs()
        bound = 2 * sum_error_bound(terms.numel()) * terms.sum().item()
        assert abs(got["loss"] - want["loss"]) <= bound, (overrides, got["loss"], want["loss"])
        initial = {n: cases[i]["initial_policy"][n] for n in want["params"]}
        for side, result in (("one process", want), ("two processes", got)):
            stepped = adamw_first_step(initial, result["grads"], lr=cfg.learning_rate,
                                       weight_decay=cfg.weight_decay)
            for name, p in result["params"].items():
                assert torch.equal(stepped[name], p), (
                    f"{overrides}, {side}: {name} is not AdamW's step on its gradients")
        moved = max((p - initial[n]).abs().max().item() for n, p in want["params"].items())
        assert moved > 1e-5, "the update did not move the weights: equality proves nothing"


TRAIN = ["-m", "grpo_lab", "train", "--preset", "stable", "--no-progress",
         "--prompts-per-step", "4", "--group-size", "4", "--eval-size", "16",
         "--checkpoint-every", "2", "--eval-every", "2"]


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    """A 4-step torchrun run, 2 ranks: (its folder, its stdout, its metrics as written)."""
    whole = tmp_path_factory.mktemp("whole")
    run = torchrun(*TRAIN, "--steps", "4", "--out", str(whole))
    assert run.returncode == 0, run.stderr[-3000:]
    return whole, run.stdout, read_metrics(whole)


def test_torchrun_run_writes_one_metrics_file(whole_run):
    whole, stdout, metrics = whole_run
    assert "data-parallel: 2 processes, 2 prompts each per step" in stdout
    assert sorted(p.name for p in whole.iterdir()) == [
        "checkpoint.pt", "config.json", "metrics.jsonl", "metrics.png"]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]  # rank 0 alone wrote them
    assert torch.load(whole / "checkpoint.pt", weights_only=False)["world_size"] == 2
    # config.json is the plain config: the same run config works on 1 or N processes
    assert "world_size" not in json.loads((whole / "config.json").read_text())

    # a single process cannot continue a 2-process run exactly: one line, exit 2, nothing written
    before = {p.name: p.read_bytes() for p in whole.iterdir()}
    alone = launch([sys.executable, "-m", "grpo_lab", "train", "--resume", "--steps", "5",
                    "--out", str(whole)])
    assert alone.returncode == 2
    assert alone.stderr.strip().count("\n") == 0
    assert "written by 2 process(es)" in alone.stderr and "--nproc_per_node 2" in alone.stderr
    assert {p.name: p.read_bytes() for p in whole.iterdir()} == before


def test_accelerate_launch_runs_the_same_trainer_and_torchrun_resumes_it_exactly(
        whole_run, tmp_path):
    # `--multi_gpu` is accelerate's DDP launcher; with no GPU the trainer falls back to gloo
    # on CPU. (`--cpu --num_processes 2` would start a single process: accelerate's
    # multi-CPU mode needs MPI.) Its first 2 steps are then resumed to 4 by torchrun, which
    # must give the 4-step torchrun run's metrics: one run, whichever launcher started it.
    run = launch([str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                  *TRAIN, "--steps", "2", "--out", str(tmp_path)])
    assert run.returncode == 0, run.stderr[-3000:]
    assert "data-parallel: 2 processes" in run.stdout
    assert [m["step"] for m in read_metrics(tmp_path)] == [0, 1, 2]

    resumed = torchrun("-m", "grpo_lab", "train", "--resume", "--steps", "4", "--out",
                       str(tmp_path), "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stdout
    assert without_timing(read_metrics(tmp_path)) == without_timing(whole_run[2])


def fake_gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def test_plain_python_on_several_gpus_names_the_launcher(monkeypatch, tmp_path, capsys):
    fake_gpus(monkeypatch, 4)
    problem = distributed.launch_problem(None)
    assert "4 GPUs are visible" in problem
    assert "torchrun --standalone --nproc_per_node 4 -m grpo_lab train" in problem
    assert "accelerate launch --multi_gpu --num_processes 4" in problem
    assert distributed.launch_problem("cuda:0") is None  # one GPU chosen on purpose
    # the cpu profile (the default) trains on the CPU, so the GPUs are no one's concern
    assert distributed.launch_problem(requested_device(None, "cpu")) is None
    monkeypatch.setenv("GRPO_LAB_PROFILE", "gpu")
    code = main(["train", "--preset", "stable", "--steps", "1", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "nproc_per_node 4" in err
    assert not (tmp_path / "r").exists()
    fake_gpus(monkeypatch, 1)
    assert distributed.launch_problem(None) is None


def test_the_cli_checks_the_launch_for_the_device_the_run_will_use(monkeypatch, tmp_path, capsys):
    # notebook 12 on a 1-GPU machine (2026-11-25): two torchrun ranks of the tiny model were
    # refused for the GPU count, though they train on the CPU
    fake_gpus(monkeypatch, 4)
    monkeypatch.delenv("GRPO_LAB_PROFILE", raising=False)
    seen = []
    monkeypatch.setattr(distributed, "launch_problem", lambda device: seen.append(device) or "stop")
    args = ["train", "--preset", "stable", "--steps", "1", "--out", str(tmp_path / "r")]
    assert main(args) == 2 and "stop" in capsys.readouterr().err
    monkeypatch.setenv("GRPO_LAB_PROFILE", "gpu")
    assert main(args) == 2
    assert main([*args, "--device", "cuda:1"]) == 2
    assert seen == ["cpu", None, "cuda:1"]  # the cpu profile's CPU; the gpu profile's GPUs


def test_more_processes_than_gpus_is_refused(monkeypatch):
    fake_gpus(monkeypatch, 2)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    problem = distributed.launch_problem(None)
    assert "started 8 processes on this node but only 2 GPU(s)" in problem
    assert "--nproc_per_node 2" in problem
    with pytest.raises(ConfigError, match="only 2 GPU"):
        distributed.setup(None)
    # the tiny model's ranks run on the CPU (gloo): seen refused on a 1-GPU machine before
    # the cpu profile's runs asked for the CPU (notebook 12's torchrun, 2026-11-25)
    assert distributed.launch_problem(requested_device(None, "cpu")) is None
    # naming one GPU shares it between the ranks on purpose (notebook 12 on a 1-GPU machine)
    assert "pass --device cuda:0" in problem
    assert distributed.launch_problem("cuda:0") is None and distributed.launch_problem("cuda")


def test_ranks_that_name_one_gpu_share_it_through_gloo(monkeypatch):
    # NCCL refuses two ranks on one GPU; gloo takes CUDA tensors
    fake_gpus(monkeypatch, 1)
    for k, v in dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", RANK="1", LOCAL_RANK="1").items():
        monkeypatch.setenv(k, v)
    joined = []
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group",
                        lambda backend, timeout: joined.append(backend))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: joined.append(str(device)))
    world, device = distributed.setup("cuda:0")
    assert (world.world_size, str(device), joined) == (2, "cuda:0", ["cuda:0", "gloo"])
    assert distributed.shares_one_gpu("cuda:0") and not distributed.shares_one_gpu("cuda")


def test_prompts_must_split_evenly_over_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match=r"prompts_per_step must be divisible .* \(2\)"):
        Trainer(preset("stable", prompts_per_step=3))


def test_inconsistent_launcher_environment_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ConfigError, match="RANK=2 and WORLD_SIZE=2"):
        distributed.world_from_env()
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(ConfigError, match="RANK must be an integer"):
        distributed.world_from_env()



FLAKY_RANK = '''
import os, sys
from grpo_lab import cli, step
if os.environ["RANK"] == "1":  # rank 1's reward function fails on its third call
    calls, real = [], step.checked_rewards
    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("reward function failed on rank 1")
        return real(*args, **kwargs)
    step.checked_rewards = flaky
sys.exit(cli.main(sys.argv[1:]))
'''


def test_one_rank_failing_stops_the_run_instead_of_hanging(tmp_path):
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY_RANK)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRPO_LAB_DIST_TIMEOUT": "600"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    # a hang would sit out the 600 s collective timeout; the subprocess gets 120 s
    run = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2",
                          str(script), "train", "--preset", "stable", "--steps", "6",
                          "--no-progress", "--prompts-per-step", "4", "--group-size", "4",
                          "--eval-size", "8", "--out", str(tmp_path / "run")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "reward function failed on rank 1" in run.stderr
    assert not (tmp_path / "run" / "checkpoint.pt").exists()
