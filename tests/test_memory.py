"""Peak step memory: the measurement moves the way it must, the reset between
measurements is real, and the command prints the table (grpo_lab/tools/memory.py)."""

import contextlib
import io
import json
import sys

import pytest
import torch

from grpo_lab.tools import memory


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """`python -m grpo_lab.tools.memory --quick` once: its exit code, printout and rows."""
    path = tmp_path_factory.mktemp("memory") / "rows.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = memory.main(["--quick", "--device", "cpu", "--json", str(path)])
    rows = {r["row"]: r for r in json.loads(path.read_text())}
    return rc, out.getvalue(), rows


def test_quick_mode_prints_the_table(quick):
    rc, printed, rows = quick
    assert rc == 0
    assert list(rows) == ["baseline", "prompts x2", "accum 4", "checkpointing"]
    header = printed.splitlines()[1]
    for column in memory.COLUMNS:
        assert column in header
    assert "of tiny GPT-2" in printed.splitlines()[0]
    for name, row in rows.items():
        assert row["profile"] == "cpu"
        assert name in printed and f"{row['peak_mib']:.1f}" in printed
        # /proc where it can reset the peak (Linux), else getrusage
        assert row["method"] == memory.default_method("cpu", "cpu")
        assert row["idle_mib"] > 50  # torch + the model, in MiB
    assert rows["baseline"]["ratio"] == 1.0
    assert rows["prompts x2"]["rows"] == 2 * rows["baseline"]["rows"]


def test_bigger_batch_needs_more_memory(quick):
    rows = quick[2]
    assert rows["baseline"]["peak_mib"] > 20  # tens of MiB: far above measurement noise
    assert rows["prompts x2"]["peak_mib"] > 1.5 * rows["baseline"]["peak_mib"]


def test_accumulation_and_checkpointing_need_less(quick):
    rows = quick[2]
    # the same 256 rows: 4 micro-batches hold a quarter of the activations at a time;
    # checkpointing keeps one tensor per block instead of all of them (and gives up the
    # shared prompt forward, whose keys and values it would have to keep: measured 0.70x)
    assert rows["accum 4"]["peak_mib"] < 0.6 * rows["baseline"]["peak_mib"]
    assert rows["checkpointing"]["peak_mib"] < 0.85 * rows["baseline"]["peak_mib"]


def test_the_reset_between_measurements_is_real(quick):
    """In one process: a smaller config after a bigger one, then the same config again,
    read what each reads first in its own process (the fixture's)."""
    by_name = dict(memory.table_configs(quick=True))
    big, small, again = memory.measure_configs(
        [by_name["prompts x2"], by_name["baseline"], by_name["baseline"]]
    )
    alone = quick[2]
    assert small["peak_mib"] == pytest.approx(alone["baseline"]["peak_mib"], rel=0.1, abs=3)
    assert again["peak_mib"] == pytest.approx(small["peak_mib"], rel=0.05, abs=2)
    assert big["peak_mib"] == pytest.approx(alone["prompts x2"]["peak_mib"], rel=0.1, abs=3)


def test_maxrss_units():
    """The peak RSS against the current RSS from `ps` (KiB on Linux and macOS): the peak is
    at least the current and not 1024x it, which wrong units (bytes vs KiB) would give.
    Where /proc exists, also against the kernel's own peak (VmHWM)."""
    import os
    import subprocess

    current_mib = int(subprocess.run(["ps", "-o", "rss=", "-p", str(os.getpid())],
                                     capture_output=True, text=True, check=True).stdout) / 1024
    peak = memory.maxrss_mib()
    assert 0.95 * current_mib <= peak < 100 * current_mib, (peak, current_mib)
    if sys.platform.startswith("linux"):
        assert peak == pytest.approx(memory._proc_status_mib("VmHWM"), rel=0.05, abs=5)


def test_the_method_follows_the_device_the_run_trains_on(monkeypatch):
    # with CUDA present and GRPO_LAB_PROFILE=gpu, the tiny model's config still trains on the
    # CPU: measuring it with CUDA's counters would read nothing (and synchronize a CPU device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("GRPO_LAB_PROFILE", "gpu")
    requests = []
    monkeypatch.setattr(memory, "_run_worker", lambda request: requests.append(request)
                        or {"rows": [{}]})
    memory.measure_configs([memory.measuring_config()])  # profile 'cpu'
    assert requests[0]["method"] in ("proc", "rusage")
    # without /proc the CPU's peak cannot be reset, which capped_step needs: it must see that
    # the tiny model's step runs on the CPU, not take CUDA's counters from the environment
    monkeypatch.setattr(memory, "_proc_peak_resettable", lambda: False)
    with pytest.raises(RuntimeError, match="needs Linux's /proc"):
        memory.capped_step(memory.measuring_config(max_grad_norm=None))
    assert len(requests) == 1
    assert memory.default_method(None, "gpu") == "cuda"
    assert memory.default_method("cpu", "gpu") != "cuda"


def test_bad_input_is_refused_with_its_name(capsys):
    assert memory.main(["--device", "tpu"]) == 2
    err = capsys.readouterr().err
    assert "GRPOConfig.device must be None (automatic), 'cpu', 'cuda', 'cuda:N' or 'mps'" in err
    assert memory.main(["--profile", "big", "--device", "cpu"]) == 2
    assert "--profile must be 'cpu' or 'gpu' (got 'big')" in capsys.readouterr().err
    assert memory.main(["--profile", "gpu", "--device", "cpu"]) == 2
    assert "--profile gpu (GPT-2 124M) needs a CUDA device" in capsys.readouterr().err
    assert memory.main(["--batch", "9"]) == 2
    assert "unrecognized arguments: --batch 9" in capsys.readouterr().err
    with pytest.raises(ValueError, match="method must be None"):
        memory.measure_configs([memory.measuring_config()], method="vmstat")
    with pytest.raises(ValueError, match="max_grad_norm=None"):
        memory.capped_step(memory.measuring_config(max_grad_norm=1.0))


def test_the_step_is_measured_with_the_graphs_off(monkeypatch):
    """A CUDA graph keeps buffers and a memory pool of its own across steps: the table, a
    peak and the capped step measure the step's own tensors, with GRPO_LAB_CUDA_GRAPHS=0
    inside the measuring worker whatever the caller's environment says (restored after)."""
    from grpo_lab import graphs

    class Measured(Exception):
        pass

    seen = []

    def record(*args, **kwargs):
        seen.append(graphs.graphs_wanted())
        raise Measured

    monkeypatch.setenv(graphs.GRAPHS_ENV, "1")
    monkeypatch.setattr(memory, "_fix_mmap_threshold", lambda: None)
    monkeypatch.setattr(memory, "_measure_here", record)
    monkeypatch.setattr(memory, "_build_trainer", record)
    cfg = memory.measuring_config()
    threads = torch.get_num_threads()
    try:
        for worker in (lambda: memory._measure_worker([cfg.to_dict()], "proc", False),
                       lambda: memory._capped_step_worker(cfg, 1.0, False)):
            with pytest.raises(Measured):
                worker()
            assert graphs.graphs_wanted()  # the caller's switch, back after the worker
    finally:
        torch.set_num_threads(threads)
    assert seen == [False, False]
