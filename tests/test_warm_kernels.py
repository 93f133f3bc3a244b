"""tests/warm_kernels.py: a notebook kernel forked from the warm server behaves as one that
`python -m ipykernel_launcher` started (the suite's notebooks run in these)."""

import json
import os
import signal
import sys
import time

import pytest
import warm_kernels  # tests/warm_kernels.py
from jupyter_client.manager import KernelManager

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the suite forks warm kernels on Linux only")


def run(kc, code: str, timeout: float = 60) -> dict:
    """Execute `code`; its result: 'reply' (status), 'stdout', 'data' (MIME types shown),
    'error' (the exception's name and message)."""
    out = {"stdout": "", "data": [], "error": None}

    def hook(msg):
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out["stdout"] += content["text"]
        elif kind in ("display_data", "execute_result"):
            out["data"] += list(content["data"])
        elif kind == "error":
            out["error"] = f"{content['ename']}: {content['evalue']}"

    out["reply"] = kc.execute_interactive(code, timeout=timeout, output_hook=hook)["content"][
        "status"]
    return out


@pytest.fixture
def kernel_spec(tmp_path, monkeypatch):
    """A kernelspec named 'warm' whose command is the client, found through JUPYTER_PATH."""
    warm_kernels.write_kernelspec(tmp_path / "jupyter", "warm", warm_kernels.CLIENT_ARGV)
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    return "warm"


@pytest.fixture
def server(tmp_path, monkeypatch):
    path = str(tmp_path / "k.sock")
    proc, ready = warm_kernels.start_server(path)
    try:
        assert ready, f"the server did not start (exit code {proc.poll()})"
        monkeypatch.setenv(warm_kernels.SOCKET_ENV, path)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def start(kernel_spec, cwd, **env):
    km = KernelManager(kernel_name=kernel_spec)
    km.start_kernel(cwd=str(cwd), env={**os.environ, **env})
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    return km, kc


# what a kernel looks like from inside, after a setup cell's imports: a forked kernel must
# look the same as one `python -m ipykernel_launcher` started
PROBE = """
import comm, json, os, sys
import matplotlib, torch, tqdm.auto
from huggingface_hub.utils import tqdm as hub_tqdm
import grpo_lab.course.steps, grpo_lab.trainer
from ipykernel.kernelapp import IPKernelApp
def mro(cls):
    return [c.__module__ + "." + c.__name__ for c in cls.__mro__]
print(json.dumps({
    "tqdm.auto": mro(tqdm.auto.tqdm), "huggingface_hub's tqdm": mro(hub_tqdm),
    "comm targets": sorted(comm.get_comm_manager().targets),
    "parent_handle": IPKernelApp.instance().parent_handle == int(os.environ["JPY_PARENT_PID"]),
    "matplotlib backend": matplotlib.get_backend(), "torch threads": torch.get_num_threads(),
    "cwd": os.getcwd(), "sys.path": sys.path, "own process group": os.getpgid(0) == os.getpid(),
    "GRPO_LAB_PROBE": os.environ.get("GRPO_LAB_PROBE"), "argv": sys.argv[1:2],
}))
"""


def probe(kernel_spec, cwd, socket_path) -> tuple[dict, bool, int]:
    """The PROBE's answer in a kernel whose client is told the server at socket_path, whether
    torch was loaded before any cell imported it, and the kernel's parent pid."""
    km, kc = start(kernel_spec, cwd, GRPO_LAB_PROBE="from the client",
                   **{warm_kernels.SOCKET_ENV: socket_path})
    try:
        before = run(kc, "import os, sys\nprint('torch' in sys.modules, os.getppid())")
        preloaded, ppid = before["stdout"].split()
        answer = run(kc, PROBE)
        assert answer["reply"] == "ok", answer
        return json.loads(answer["stdout"]), preloaded == "True", int(ppid)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_a_forked_kernel_is_a_plain_one_with_its_modules_loaded(kernel_spec, server, tmp_path):
    cwd = tmp_path / "notebooks"
    cwd.mkdir()
    forked, warm, parent = probe(kernel_spec, cwd, os.environ[warm_kernels.SOCKET_ENV])
    assert warm and parent == server.pid  # forked from the server, torch loaded
    plain, warm, parent = probe(kernel_spec, cwd, str(tmp_path / "nobody.sock"))
    assert not warm and parent != server.pid  # no server there: ipykernel_launcher
    assert forked == plain
    assert plain["cwd"] == str(cwd) and plain["own process group"]
    assert plain["GRPO_LAB_PROBE"] == "from the client" and plain["parent_handle"]
    assert "tqdm.notebook.tqdm_notebook" in plain["tqdm.auto"]  # widget bars, in both


def test_a_forked_kernel_plots_can_be_interrupted_and_dies_with_its_client(
        kernel_spec, server, tmp_path):
    km, kc = start(kernel_spec, tmp_path)
    try:
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

        pid = int(run(kc, "import os\nprint(os.getpid())")["stdout"])
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
