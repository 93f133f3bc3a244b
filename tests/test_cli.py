"""The command line, run as a learner or CI would: in a subprocess."""

import json
import math
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "GRPO_LAB_PROFILE": "cpu"}


def run(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "grpo_lab", *args], capture_output=True, text=True,
        env=ENV, timeout=timeout,
    )


def metrics(out):
    from grpo_lab.trainer import read_metrics

    return read_metrics(out)


def capstone_run(preset: str, steps: int, out):
    """Notebook 11's run of `preset` (course.notebooks.train_command): in a test run the
    labs' and solutions' notebook 11 and this file run it once between them."""
    from grpo_lab.course.notebooks import run_command, train_command

    return run_command(train_command(preset, steps), out=out)


def test_short_stable_run_improves_eval_accuracy(tmp_path):
    out = tmp_path / "stable"
    p = capstone_run("stable", 100, out)
    assert p.returncode == 0, p.stderr
    ms = metrics(out)
    acc = [m["eval/accuracy"] for m in ms if "eval/accuracy" in m]
    assert [m["step"] for m in ms if "eval/accuracy" in m] == [0, 20, 40, 60, 80, 100]
    assert acc[-1] >= acc[0] + 0.1, acc
    assert (out / "metrics.png").stat().st_size > 10_000
    assert (out / "checkpoint.pt").exists() and not (out / "checkpoint.pt.tmp").exists()
    for key in ("reward", "reward_std", "frac_reward_zero_std", "kl", "clip_ratio/region_mean",
                "grad_norm", "entropy", "completions/mean_length", "step_time", "loss",
                "skipped", "nonfinite_params"):
        assert key in ms[1], key

    # --resume with more steps continues the same run
    p = run("train", "--steps", "102", "--out", str(out), "--resume", "--no-progress")
    assert p.returncode == 0, p.stderr
    assert [m["step"] for m in metrics(out)] == list(range(103))


def test_naive_run_crashes_with_the_real_error_and_a_diagnosis(tmp_path):
    out = tmp_path / "naive"
    p = capstone_run("naive", 30, out)  # seed 0 crashes at step 16
    assert p.returncode == 1
    assert "RuntimeError: probability tensor contains either `inf`, `nan` or element < 0" \
        in p.stderr
    assert "last healthy step:" in p.stderr and "first non-finite parameter: " in p.stderr
    assert "Traceback" not in p.stderr
    ms = metrics(out)
    finite = [m["grad_norm"] for m in ms if "grad_norm" in m and math.isfinite(m["grad_norm"])]
    assert max(finite) > 1000 * 5.0
    assert ms[-1]["nonfinite_params"] > 0
    assert (out / "metrics.png").exists()
    assert not (out / "checkpoint.pt").exists() or ms[-1]["step"] >= 50


@pytest.mark.parametrize("args,needle", [
    (["train", "--preset", "stable", "--out", "X", "--learning-rate", "-1"], "learning_rate"),
    (["train", "--preset", "stable", "--out", "X", "--group-size", "1"], "group_size"),
    (["train", "--preset", "stable", "--out", "X", "--loss-type", "ppo"], "loss_type"),
    (["train", "--preset", "stable", "--out", "X", "--max-grad-norm", "abc"], "--max-grad-norm"),
    (["train", "--preset", "stable", "--out", "X", "--steps", "ten"], "--steps"),
    (["train", "--preset", "risky", "--out", "X"], "--preset"),
    (["train", "--preset", "stable"], "--out"),
    (["train", "--preset", "stable", "--out", "X", "--resume"], "--resume"),
    (["train", "--out", "X"], "--preset"),
    (["train", "--preset", "stable", "--out", "X", "--epsilon-low", "nan"], "epsilon_low"),
    (["fly"], "fly"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, args, needle):
    args = [str(tmp_path / "run") if a == "X" else a for a in args]
    p = run(*args, timeout=60)
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], p.stderr
    assert "Traceback" not in p.stderr


def test_a_wrong_model_path_or_device_is_refused_before_torch_loads(tmp_path):
    """Both are checked from the config alone (config.saved_model_dir, check_device_name),
    so the answer comes without the seconds that importing torch and transformers takes."""
    out = str(tmp_path / "run")
    probe = (
        "import contextlib, io, sys\n"
        "from grpo_lab.cli import main\n"
        "codes, err = [], io.StringIO()\n"
        f"for argv in (['train', '--preset', 'stable', '--out', {out!r}, '--model-path',\n"
        f"              {str(tmp_path / 'nothing')!r}],\n"
        f"             ['train', '--preset', 'stable', '--out', {out!r}, '--device', 'tpu:0'],\n"
        "             ['scenario', 'nan-params-sampling-crash', '--device', 'meta']):\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        codes.append(main(argv))\n"
        "print(codes, sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
        "print(err.getvalue(), end='')\n")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       env=ENV, timeout=60)
    assert p.returncode == 0, p.stderr
    first, *errors = p.stdout.splitlines()
    assert first == "[2, 2, 2] []", p.stdout
    assert len(errors) == 3 and "model_path" in errors[0] and "has no config.json" in errors[0]
    assert "GRPOConfig.device must be" in errors[1] and "'tpu:0'" in errors[1]
    assert "--device must be" in errors[2] and "'meta'" in errors[2]


def test_config_file_unknown_key_is_rejected(tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"learning_rat": 1e-4}))
    p = run("train", "--preset", "stable", "--out", str(tmp_path / "r"), "--config", str(cfg))
    assert p.returncode == 2 and "learning_rat" in p.stderr


def test_refuses_to_mix_runs_in_one_directory(tmp_path):
    out = tmp_path / "r"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    p = run("train", "--preset", "stable", "--out", str(out), "--steps", "1")
    assert p.returncode == 2 and "--resume" in p.stderr


def test_sigkill_mid_run_then_resume_matches_an_uninterrupted_run(tmp_path):
    """A run killed with SIGKILL continues with --resume to exactly the same metrics."""
    import signal
    import time

    common = ["--preset", "stable", "--steps", "8", "--seed", "3", "--checkpoint-every", "3",
              "--eval-every", "4", "--eval-size", "32", "--no-progress"]
    whole = tmp_path / "whole"
    assert run("train", *common, "--out", str(whole)).returncode == 0

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "grpo_lab", "train", *common, "--out", str(killed)],
        env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while time.time() < deadline:  # kill once step 5 is logged: past the step-3 checkpoint
        lines = (killed / "metrics.jsonl").read_text().splitlines() \
            if (killed / "metrics.jsonl").exists() else []
        if len(lines) >= 6:
            break
        time.sleep(0.02)
    else:
        proc.kill()
        pytest.fail("step 5 was never logged within 120 s")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert len(metrics(killed)) < 9, "the run finished before it was killed"
    assert not (killed / "checkpoint.pt.tmp").exists() or (killed / "checkpoint.pt").exists()

    p = run("train", "--out", str(killed), "--resume", "--no-progress")
    assert p.returncode == 0, p.stderr

    from grpo_lab.trainer import without_timing

    assert without_timing(metrics(killed)) == without_timing(metrics(whole))


def test_bench_subcommand_hands_its_options_to_the_benchmark():
    p = run("bench", "--steps", "0")
    assert p.returncode == 2
    assert "--steps must be an integer >= 1" in p.stderr and p.stderr.count("\n") == 1


def test_resume_accepts_the_same_command_and_names_what_differs(tmp_path, capsys, monkeypatch):
    """The first command with --resume appended continues the run; a flag that differs
    from the saved config is refused with both values. (In-process: cli.main.)"""
    from grpo_lab.cli import main

    out = tmp_path / "r"
    first = ["train", "--preset", "stable", "--steps", "1", "--seed", "0", "--out", str(out),
             "--eval-size", "4", "--checkpoint-every", "1", "--no-progress"]
    monkeypatch.delenv("GRPO_LAB_PROFILE", raising=False)
    assert main(first) == 0
    assert json.loads((out / "config.json").read_text())["profile"] == "cpu"  # resolved
    assert main(first[:4] + ["2"] + first[5:] + ["--resume"]) == 0
    assert [m["step"] for m in metrics(out)][-1] == 2
    capsys.readouterr()
    assert main(first[:6] + ["1"] + first[7:] + ["--resume", "--learning-rate", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "--seed (saved 0, got 1)" in err and "--learning-rate (saved 0.0001, got 0.5)" in err
    assert main(["train", "--preset", "naive", "--out", str(out), "--resume"]) == 2
    assert "--max-grad-norm (saved 1.0, got 0.5)" in capsys.readouterr().err
    # the same command in a shell that asks for the other model: refused, not a size mismatch
    monkeypatch.setenv("GRPO_LAB_PROFILE", "gpu")
    assert main(first + ["--resume"]) == 2
    assert "--profile (saved 'cpu', got 'gpu')" in capsys.readouterr().err
