"""The grading zygote: a clean process that imports torch once and forks every worker.

Importing torch costs a worker ~1.3 s of CPU, and transformers' GPT-2 (for a checker that
builds a model) ~2 s more: most of what a submission costs. An instructor grading forty
students' twelve notebooks would pay it 480 times (the 13 labs: 32 s of CPU exec'd, 7 s
forked; benchmarks/grading.py). `sandbox.Worker` therefore asks this process for each
worker. It is started by the grader as `python -I -c <bootstrap>` in a clean environment, holds nothing but this module, torch and
transformers' GPT-2 (no grpo_lab, no submission, no result), never runs student code
itself, and ends when the grader closes its socket (the grader ended, however it ended).

Each worker is three processes, the same shape as `unshare -U -r -p -f -n --kill-child sh -c
python`:

    zygote -> C  in the grader's namespaces: its own session and rlimits; enters new user,
                 PID and network namespaces, then waits for I and exits with I's code
              -> I  PID 1 of the new PID namespace (it dies with C); waits for W and exits
                    with its code, 128 + N for signal N (as sh does); when I ends, the kernel
                    ends every process left in the namespace
                 -> W  the worker: imports its private copy of grpo_lab, applies Landlock to
                       itself, then `_worker.main` (exactly what the exec'd worker runs)

The grader addresses C only, through the pidfd this process sends back; a worker cannot
address this process, the grader or another worker (a PID namespace of its own, Landlock on
top).
Requests, one JSON object per message on a SOCK_SEQPACKET socket:

    {"op": "hello"}        -> {"namespaces": whether it can give a worker its namespaces}
    {"op": "spawn", ...}   + 3 fds (to-worker read end, from-worker write end, output file)
                           -> {"pid": C} + a pidfd of C (the grader kills C through it: a
                              pid could be another process's once C is reaped)
    {"op": "wait", "pid", "timeout"}  -> {"code": C's exit (negative: signal) or null}
    anything that fails    -> {"error": why}; this process goes on

What forking gives up against exec: the workers share the zygote's memory layout (its
address-space randomisation is done once); a worker can reach no other process's memory.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
import time

CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG = 1
MESSAGE_BYTES = 1 << 20


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def enter_namespaces() -> None:
    """New user (this uid mapped to root), PID and network namespaces, as `unshare -U -r -p
    -n`; the PID namespace takes effect for the children forked after this."""
    uid, gid = os.getuid(), os.getgid()
    libc = _libc()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare: {os.strerror(err)}")
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"),
                       ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _code(status: int) -> int:
    """An exit status as a shell reports it: the code, or 128 + N for signal N."""
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def _close_fds_except(keep: set[int]) -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _child(req: dict, to_worker_r: int, from_worker_w: int, out: int, zygote: int) -> None:
    """C (then I, then W); never returns."""
    import resource
    import tempfile

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _die_with_parent()
    if os.getppid() != zygote:  # it ended before PDEATHSIG was set
        os._exit(1)
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    _close_fds_except({to_worker_r, from_worker_w})
    for name, value in req["rlimits"].items():
        resource.setrlimit(getattr(resource, name), tuple(value))
    home = req["home"]
    os.chdir(home)
    os.environ.clear()
    os.environ.update(req["env"])
    tempfile.tempdir = home
    enter_namespaces()
    init = os.fork()
    if init:  # C
        _, status = os.waitpid(init, 0)
        os._exit(_code(status))
    # I: PID 1 of the namespace
    _die_with_parent()
    worker = os.fork()
    if worker:
        while True:
            try:
                pid, status = os.wait()  # orphans are re-parented here: reap them too
            except ChildProcessError:
                os._exit(1)
            if pid == worker:
                os._exit(_code(status))
    # W: as a fresh python would be
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, req["pkg"])
    sys.setrecursionlimit(5000)
    from importlib.machinery import SourceFileLoader

    w = SourceFileLoader("_grading_worker", req["worker"]).load_module()
    w.apply_landlock(req["writable"], req["readable"])
    w.main(to_worker_r, from_worker_w)


def _run_child(req: dict, fds: list[int], zygote: int) -> None:
    code = 0
    try:
        _child(req, *fds, zygote)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported in the worker's output, then exit
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _probe_namespaces() -> bool:
    pid = os.fork()
    if pid == 0:
        try:
            enter_namespaces()
            init = os.fork()  # the PID namespace is made here
            if init == 0:
                os._exit(0)
            _, status = os.waitpid(init, 0)
            os._exit(status != 0)
        except BaseException:  # noqa: BLE001
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def _spawn(req: dict, fds: list[int]) -> tuple[dict, list[int]]:
    if len(fds) != 3:
        for f in fds:
            os.close(f)
        return {"error": "spawn needs 3 fds"}, []
    sys.stdout.flush()
    zygote = os.getpid()
    try:
        pid = os.fork()
    except OSError as e:  # EAGAIN, ENOMEM: refused, and this process goes on
        pid = None
        error = {"error": f"fork failed: {e}"}
    if pid == 0:
        _run_child(req, fds, zygote)  # never returns
    for f in fds:
        os.close(f)
    if pid is None:
        return error, []
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as e:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return {"error": f"pidfd_open failed: {e}"}, []
    return {"pid": pid}, [pidfd]


def _wait(pid: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"code": os.waitstatus_to_exitcode(status)}  # as Popen: -N for signal N
        if time.monotonic() >= deadline:
            return {"code": None}
        time.sleep(0.005)


def serve(fd: int) -> None:
    import gc

    gc.disable()  # importing makes objects, not garbage: no collections meanwhile
    import torch  # what every worker imports, and what a worker that builds a model adds
    from transformers import (  # noqa: F401
        AutoTokenizer,
        GenerationConfig,
        GPT2Config,
        GPT2LMHeadModel,
        PreTrainedTokenizerFast,
    )

    gc.enable()
    gc.freeze()  # kept out of the workers' collections, so their pages stay shared
    torch.set_num_threads(1)
    sock = socket.socket(fileno=fd)
    namespaces = _probe_namespaces()
    children: set[int] = set()
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, MESSAGE_BYTES, 3)
        except OSError:
            msg, fds = b"", []
        if not msg:  # the grader is gone: its workers go with this process (PDEATHSIG)
            os._exit(0)
        sent: list[int] = []
        try:
            req = json.loads(msg)
            op = req.get("op")
            if op == "hello":
                answer = {"namespaces": namespaces}
            elif op == "spawn":
                answer, sent = _spawn(req, fds)
                fds = []
                children.update([answer["pid"]] if "pid" in answer else [])
            elif op == "wait" and req.get("pid") in children:
                answer = _wait(req["pid"], float(req["timeout"]))
                if answer["code"] is not None:
                    children.discard(req["pid"])
            else:
                answer = {"error": f"bad request {op!r}"}
        except Exception as e:  # noqa: BLE001 - answered, and this process goes on
            answer = {"error": f"{type(e).__name__}: {e}"}
        for f in fds:
            os.close(f)
        try:
            socket.send_fds(sock, [json.dumps(answer).encode()], sent)
        except OSError:
            os._exit(0)
        for f in sent:
            os.close(f)
