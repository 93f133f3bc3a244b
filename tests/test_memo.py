"""grpo_lab/memo.py: a test session computes each deterministic result once, in any of its
processes; outside a session every call runs."""

import subprocess
import sys
import textwrap

import pytest

from grpo_lab import memo
from grpo_lab.config import preset

COUNTED = textwrap.dedent("""\
    import os, time
    from grpo_lab.memo import once_per_session

    @once_per_session
    def slow_square(x, log, pause=0.0):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\\n")  # one line per real computation
        time.sleep(pause)
        if x < 0:
            raise ValueError("negative")
        return {"square": x * x, "pid": os.getpid()}
""")


@pytest.fixture
def counted(tmp_path, monkeypatch):
    """An importable module with a decorated function that logs each real computation, and a
    fresh session folder in the environment (inherited by subprocesses)."""
    (tmp_path / "counted.py").write_text(COUNTED)
    monkeypatch.syspath_prepend(str(tmp_path))
    folder = tmp_path / "session"
    folder.mkdir()
    monkeypatch.setenv(memo.SESSION_CACHE, str(folder))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    sys.modules.pop("counted", None)
    import counted

    log = tmp_path / "computed.log"
    return counted, log, lambda: log.read_text().splitlines() if log.exists() else []


def test_second_call_reads_the_first_ones_result(counted):
    module, log, computed = counted
    first = module.slow_square(3, str(log))
    again = module.slow_square(3, str(log))
    assert first == again == {"square": 9, "pid": first["pid"]}
    assert len(computed()) == 1
    module.slow_square(4, str(log))  # other arguments: computed
    assert len(computed()) == 2


def test_off_outside_a_session(counted, monkeypatch):
    module, log, computed = counted
    monkeypatch.delenv(memo.SESSION_CACHE)
    module.slow_square(3, str(log))
    module.slow_square(3, str(log))
    assert len(computed()) == 2


def test_an_error_stores_nothing(counted):
    module, log, computed = counted
    for _ in range(2):
        with pytest.raises(ValueError, match="negative"):
            module.slow_square(-1, str(log))
    assert len(computed()) == 2


def test_an_argument_that_is_not_plain_data_runs_uncached(counted):
    class Opaque:  # a key cannot see its state
        pass

    with pytest.raises(TypeError):
        memo.plain(Opaque())
    calls = []

    @memo.once_per_session
    def f(x):
        calls.append(x)
        return len(calls)

    assert [f(Opaque()), f(Opaque()), f(7), f(7)] == [1, 2, 3, 3]


def test_other_processes_read_it_and_concurrent_callers_wait(counted, tmp_path):
    """Three processes ask for the same key at once: one computes (holding the lock for
    1 s), the others wait and read its result; a fourth, later, reads it too."""
    module, log, computed = counted
    call = ("import counted, json; "
            f"print(json.dumps(counted.slow_square(5, {str(log)!r}, pause=1.0)))")
    procs = [subprocess.Popen([sys.executable, "-c", call], stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    answers = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(answers)) == 1, answers
    assert len(computed()) == 1
    assert module.slow_square(5, str(log), pause=1.0)["square"] == 25
    assert len(computed()) == 1


def test_the_key_sees_the_config_and_the_package(monkeypatch):
    def f(cfg):
        return cfg

    base = memo.key_of(f, (preset("stable"),), {})
    assert memo.key_of(f, (preset("stable"),), {}) == base
    assert memo.key_of(f, (preset("stable", seed=1),), {}) != base
    assert memo.key_of(f, (preset("stable", learning_rate=1e-4 + 1e-12),), {}) != base
    assert memo.key_of(f, (), {"cfg": preset("stable")}) != base
    assert memo.plain(1) != memo.plain(1.0) and memo.plain((1,)) != memo.plain([1])
    monkeypatch.setenv(memo.SESSION_CACHE, "/another/session")  # not a switch of the run
    assert memo.key_of(f, (preset("stable"),), {}) == base
    monkeypatch.setenv("GRPO_LAB_THREADS", "2")
    assert memo.key_of(f, (preset("stable"),), {}) != base
    monkeypatch.delenv("GRPO_LAB_THREADS")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert memo.key_of(f, (preset("stable"),), {}) != base
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setattr(memo, "package_digest", lambda: "an edited package")
    assert memo.key_of(f, (preset("stable"),), {}) != base


def test_a_cached_run_is_the_run(tmp_path, monkeypatch):
    """What a session reads back is what running it again gives, to the bit."""
    from grpo_lab.field import variants
    from grpo_lab.trainer import Trainer

    monkeypatch.setenv(memo.SESSION_CACHE, str(tmp_path))
    cfg = preset("naive", steps=3, prompts_per_step=2, eval_every=0, eval_size=8, seed=4)
    first = variants.short_run(cfg)

    def no_training(*args, **kwargs):
        raise AssertionError("the second call trained instead of reading the first's result")

    monkeypatch.setattr(variants, "Trainer", no_training)
    read = variants.short_run(cfg)
    assert repr(read) == repr(first)  # pickled and read back (repr: NaN equals NaN)
    monkeypatch.setattr(variants, "Trainer", Trainer)
    again = variants.short_run.uncached(cfg)

    def numbers(run):  # every value but the wall-clock step time
        rows = [{k: v for k, v in m.items() if k != "step_time"} for m in run["history"]]
        return repr({**run, "history": rows})

    assert numbers(again) == numbers(first)
    assert "nan" in numbers(first)  # the naive run broke: the comparison covers NaN too
    assert len(list(tmp_path.glob("*.pkl"))) == 1


def test_a_device_scenario_runs_in_its_own_process_without_the_session(monkeypatch):
    """run_on_device exists to run a scenario fresh (a CUDA context broken by an assert): its
    child must not read a result another process computed."""
    from grpo_lab.field import scenarios

    seen = {}

    def fake_run(cmd, env, **kwargs):
        seen.update(env)
        return subprocess.CompletedProcess(cmd, 0, '@@scenario@@ {"symptom": true, '
                                                   '"evidence": "x", "after": "works"}\n', "")

    monkeypatch.setenv(memo.SESSION_CACHE, "/somewhere")
    monkeypatch.setattr(scenarios.subprocess, "run", fake_run)
    scenarios.run_on_device("pad-token-vocab-mismatch", False, "cpu")
    assert memo.SESSION_CACHE not in seen and seen[scenarios.DEVICE_ENV] == "cpu"


def test_a_command_runs_once_and_each_caller_gets_its_files_and_output(tmp_path, monkeypatch):
    """notebooks.run_command: the second caller (another notebook) gets the exit code, the
    output with its own folder in it, and a copy of the files; the command ran once."""
    from grpo_lab.course.notebooks import run_command

    folder = tmp_path / "session"
    folder.mkdir()
    monkeypatch.setenv(memo.SESSION_CACHE, str(folder))
    log = tmp_path / "ran.log"
    script = ("import pathlib, sys; out = pathlib.Path(sys.argv[1]); out.mkdir();"
              "(out / 'sub').mkdir(); (out / 'sub' / 'data.bin').write_bytes(bytes(range(256)));"
              f"open({str(log)!r}, 'a').write('ran\\n');"
              "print('wrote', out); print('problem in', out, file=sys.stderr); sys.exit(3)")
    first = run_command([sys.executable, "-c", script, "{out}"], tmp_path / "lab")
    second = run_command([sys.executable, "-c", script, "{out}"], tmp_path / "solution")
    assert log.read_text() == "ran\n"
    for run, out in ((first, tmp_path / "lab"), (second, tmp_path / "solution")):
        assert run.returncode == 3
        assert run.stdout == f"wrote {out}\n" and run.stderr == f"problem in {out}\n"
        assert (out / "sub" / "data.bin").read_bytes() == bytes(range(256))
    assert second.seconds == first.seconds > 0  # the run's own time, not the read's
    monkeypatch.delenv(memo.SESSION_CACHE)  # outside a test run: it runs every time
    run_command([sys.executable, "-c", script, "{out}"], tmp_path / "again")
    assert log.read_text() == "ran\nran\n"
