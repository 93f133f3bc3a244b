"""tests/warm_kernels.py: a notebook kernel forked from the warm server behaves as one that
`python -m ipykernel_launcher` started (the suite's notebooks run in these)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jupyter_client.manager import KernelManager

WARM_KERNELS = Path(__file__).parent / "warm_kernels.py"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the suite forks warm kernels on Linux only")


def run(kc, code: str, timeout: float = 60) -> dict:
    """Execute `code`; its result: 'reply' (status), 'stdout', 'data' (MIME types shown),
    'error' (the exception's name)."""
    out = {"stdout": "", "data": [], "error": None}

    def hook(msg):
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out["stdout"] += content["text"]
        elif kind in ("display_data", "execute_result"):
            out["data"] += list(content["data"])
        elif kind == "error":
            out["error"] = content["ename"]

    out["reply"] = kc.execute_interactive(code, timeout=timeout, output_hook=hook)["content"][
        "status"]
    return out


@pytest.fixture
def kernel_spec(tmp_path, monkeypatch):
    """A kernelspec named 'warm' whose command is the client, found through JUPYTER_PATH."""
    spec = tmp_path / "jupyter" / "kernels" / "warm"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, str(WARM_KERNELS), "-f", "{connection_file}"],
        "display_name": "warm", "language": "python", "interrupt_mode": "signal"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    return "warm"


@pytest.fixture
def server(tmp_path, monkeypatch):
    path = str(tmp_path / "k.sock")
    proc = subprocess.Popen([sys.executable, str(WARM_KERNELS), "--serve", path])
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    monkeypatch.setenv("WARM_KERNELS_SOCKET", path)
    yield proc
    proc.kill()
    proc.wait()


def start(kernel_spec, cwd, **env):
    km = KernelManager(kernel_name=kernel_spec)
    km.start_kernel(cwd=str(cwd), env={**os.environ, **env})
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    return km, kc


def test_a_forked_kernel_runs_where_and_as_asked_plots_and_can_be_interrupted(
        kernel_spec, server, tmp_path):
    cwd = tmp_path / "notebooks"
    cwd.mkdir()
    km, kc = start(kernel_spec, cwd, GRPO_LAB_PROBE="from the client")
    try:
        r = run(kc, "import os, sys\nprint(os.getppid(), 'torch' in sys.modules, os.getcwd(), "
                    "os.environ.get('GRPO_LAB_PROBE').replace(' ', '_'), sys.path[0], os.getpgid(0) == os.getpid())")
        ppid, preloaded, where, probe, path0, leader = r["stdout"].split(" ", 5)[:6]
        assert int(ppid) == server.pid and preloaded == "True", r  # forked, warm
        assert where == str(cwd) and path0 == str(cwd) and probe == "from_the_client", r
        assert leader.split()[-1] == "True", r  # its own process group, as the launcher gives it

        r = run(kc, "import matplotlib.pyplot as plt\nplt.plot([0, 1])\nplt.show()")
        assert r["reply"] == "ok" and "image/png" in r["data"], r  # the inline backend

        kc.execute("import time\ntime.sleep(60)")
        time.sleep(1.0)
        t0 = time.monotonic()
        km.interrupt_kernel()  # SIGINT to the client's process group: relayed
        errors = []
        while True:  # to the end of the interrupted request (a request sent before would be
            msg = kc.get_iopub_msg(timeout=30)  # aborted, as by any kernel after an error)
            if msg["msg_type"] == "error":
                errors.append(msg["content"]["ename"])
            if msg["content"].get("execution_state") == "idle":
                break
        assert errors == ["KeyboardInterrupt"], errors
        assert time.monotonic() - t0 < 10
        assert run(kc, "print(6 * 7)")["stdout"].strip() == "42"  # still alive

        pid = int(run(kc, "print(os.getpid())")["stdout"])
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)  # SIGKILL to the client: the server kills the kernel
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the kernel outlived its client")


def test_without_a_server_the_client_starts_a_plain_kernel(kernel_spec, tmp_path, monkeypatch):
    monkeypatch.setenv("WARM_KERNELS_SOCKET", str(tmp_path / "nobody.sock"))
    km, kc = start(kernel_spec, tmp_path)
    try:
        r = run(kc, "import sys\nprint('torch' in sys.modules, 1 + 1)")
        assert r["stdout"].split() == ["False", "2"], r
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
