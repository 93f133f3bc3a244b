"""Notebook kernels for the test run, forked from a process that has imported the course's
libraries already.

Every notebook of the suite runs in a kernel of its own, and each kernel used to spend about
3.5 s of CPU importing torch, transformers, matplotlib and grpo_lab before its first cell
did any work: about 85 s of the suite's CPU (benchmarks/kernels.py). Instead, each test worker starts one server
(`python warm_kernels.py --serve SOCKET`) that imports all of that once; nbval's kernel
command becomes this file as a client (`python warm_kernels.py -f CONNECTION_FILE`, see
the root conftest.py), and the server forks a kernel for it that starts with those modules
loaded (copy-on-write). What a kernel gets is what `python -m ipykernel_launcher -f ...`
gets: the client's environment, working directory, arguments and standard streams, its
own session and process group. The modules are imported, not run: a notebook still has to
import what it uses, and every cell runs in the kernel as before.

The client stands for the kernel towards jupyter_client: it forwards the signals
jupyter_client sends (interrupt, terminate) to the kernel's process group and exits with
the kernel's exit status; when the client dies (SIGKILL on shutdown), the server kills the
kernel's process group. No server reachable: the client execs the plain ipykernel launcher.

Linux only (fork without exec, file descriptors passed over a Unix socket); elsewhere the
conftest starts plain kernels.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

SOCKET_ENV = "WARM_KERNELS_SOCKET"  # the server's socket, set in each test worker
RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
           signal.SIGUSR2)
# What the notebooks' setup cells import, once for all kernels of a worker. A module that
# looks at its surroundings when imported must see what it would in a kernel: tqdm.auto
# picks its notebook bars when ipykernel's shell module is loaded (so that comes first, and
# transformers' and grpo_lab's bars are widgets, as in a fresh kernel), matplotlib takes its
# backend from MPLBACKEND (set below as ipykernel sets it), and ipywidgets registers its comm
# targets only inside a kernel (done again in the child, see _kernel). ipykernel's kernelapp
# is not loaded here: it reads the kernel's JPY_PARENT_PID when imported.
PRELOAD = (
    "ipykernel.zmqshell", "torch", "numpy", "ipywidgets", "tqdm.auto", "IPython.display",
    "matplotlib.pyplot", "grpo_lab.trainer", "grpo_lab.policy", "grpo_lab.sampling",
    "grpo_lab.objective", "grpo_lab.course.steps", "grpo_lab.course.exercises.fixtures",
    "grpo_lab.course.workbook", "grpo_lab.course.plots", "grpo_lab.field.scenarios",
)
NOT_PRELOADED = ("ipykernel.kernelapp",)
# nbval's (or any kernelspec's) command for a kernel from the server named by SOCKET_ENV
CLIENT_ARGV = [sys.executable, str(Path(__file__).resolve()), "-f", "{connection_file}"]


# --- for the processes that use it: the root conftest.py, the tests, the benchmark ----------------
def start_server(path: str, timeout: float = 120) -> tuple[subprocess.Popen, bool]:
    """Start a server listening on the Unix socket `path`; return it and whether it is ready
    (its socket exists) within `timeout` seconds. The caller kills it when done."""
    server = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", path],
                              stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if server.poll() is not None or time.monotonic() > deadline:
            return server, False
        time.sleep(0.05)
    return server, True


def write_kernelspec(folder: Path, name: str, argv: list[str]) -> None:
    """A kernelspec `name` running `argv`, for JUPYTER_PATH=folder."""
    spec = Path(folder) / "kernels" / name
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps(
        {"argv": argv, "display_name": name, "language": "python", "interrupt_mode": "signal"}))


# --- the client: what jupyter_client starts as the kernel -------------------------------------
def client(argv: list[str]) -> None:
    path = os.environ.get(SOCKET_ENV, "")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:  # no server: the kernel jupyter_client would have started
        conn.close()
        os.execv(sys.executable, [sys.executable, "-m", "ipykernel_launcher", *argv])
    request = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    socket.send_fds(conn, [request + b"\n"], [0, 1, 2])
    reader = conn.makefile("rb")
    pid = int(reader.readline())

    def forward(signum, _frame):
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            pass

    for signum in RELAYED:
        signal.signal(signum, forward)
    status = reader.readline().strip()
    sys.exit(int(status) if status else 1)


# --- the server: one per test worker ----------------------------------------------------------
def _kernel(request: dict, fds: list[int], closing: list[socket.socket]) -> None:
    """In the forked child: become the kernel the request asks for; never returns."""
    code = 1
    try:
        for s in closing:
            s.close()
        os.setsid()
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        for signum in RELAYED + (signal.SIGCHLD,):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        import ipykernel_launcher

        sys.argv = [ipykernel_launcher.__file__, *request["argv"]]
        # the launcher removes its own folder (the kernel's cwd) from the front of sys.path
        # before importing ipykernel; this server's front entry is its own folder
        del sys.path[0]
        import ipywidgets
        from ipykernel.kernelapp import IPKernelApp

        try:
            app = IPKernelApp.instance()  # what launch_new_instance does, with one step added
            app.initialize()
            ipywidgets.register_comm_target()  # what importing it in a kernel would have done
            app.start()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - report it on the kernel's stderr, then exit
        import traceback

        traceback.print_exc()
    finally:
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(path: str) -> None:
    import importlib

    mplbackend = os.environ.get("MPLBACKEND")  # ipykernel sets it where it is not set
    os.environ["MPLBACKEND"] = mplbackend or "module://matplotlib_inline.backend_inline"
    for name in PRELOAD:
        importlib.import_module(name)
    if not mplbackend:
        del os.environ["MPLBACKEND"]
    loaded = [name for name in NOT_PRELOADED if name in sys.modules]
    if loaded:
        sys.exit(f"warm_kernels: {loaded} must not be imported before the kernel's environment")
    serve_forks(path, _kernel)


def serve_forks(path: str, become, refuse=None) -> None:
    """Listen on the Unix socket `path` while the process that started this one lives. Each
    client sends a JSON request line with its standard streams; the server forks a child
    that calls `become(request, fds, sockets to close)` (it never returns), answers the
    child's pid, and later its exit status; a client that goes away takes its child with it.
    `refuse(request)` true: the answer is "fresh" and the client starts as usual."""
    import select

    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # ready: a client connecting now is forked warm
    listener.listen(16)
    children: dict[socket.socket, int] = {}  # client connection -> forked child's pid
    try:
        while os.getppid() == parent:  # the worker that started this server is alive
            ready, _, _ = select.select([listener, *children], [], [], 0.2)
            for s in ready:
                if s is not listener:  # the client went away before its child: kill it
                    _kill(children.pop(s))
                    s.close()
                    continue
                conn, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                while not message.endswith(b"\n"):
                    message += conn.recv(1 << 20)
                request = json.loads(message)
                if refuse is not None and refuse(request):
                    for fd in fds:
                        os.close(fd)
                    conn.sendall(b"fresh\n")
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    become(request, fds, [listener, conn, *children])
                for fd in fds:
                    os.close(fd)
                conn.sendall(f"{pid}\n".encode())
                children[conn] = pid
            for conn, pid in list(children.items()):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    try:
                        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                    except OSError:
                        pass
                    conn.close()
                    del children[conn]
    finally:
        for pid in children.values():
            _kill(pid)
        try:
            os.unlink(path)
        except OSError:
            pass


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        client(sys.argv[1:])
