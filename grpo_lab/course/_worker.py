"""The grading worker: runs inside the sandbox, never inside the grader.

Started by `sandbox.Worker` as `python -I -c <bootstrap>` in a fresh temporary folder. It
imports nothing from grpo_lab itself at start (the exercise's own imports may, and a
"drive" request imports the exercises, among which it finds the driver it runs). It answers framed
requests on a pipe (grader -> worker: pickled; worker -> grader: JSON plus one list of
plain tensors, loaded by the grader with `torch.load(weights_only=True)`):

    ("define", name, prelude, source, forbidden)  run the student's exercise cell
    ("call", name, args, kwargs)                  call the student's function
    ("drive", name, module, driver, params)       run a driver an exercise declares on
                                                  it: a fixed case built here (a model, an
                                                  optimizer)
    ("backward", grads)                            gradients of the last call's outputs

The grader decides pass or fail; this process only computes values. Whatever it reports
that could make a grade higher (a value) is checked against the reference by the grader;
what it reports that lowers one (an exception, a call of the reference) only hurts the
submission that ran here.
"""

from __future__ import annotations

import ctypes
import importlib
import io
import json
import math
import os
import pickle
import struct
import sys
import traceback

MAX_REPR = 300


# --- Landlock (applied by the worker to itself before any exercise code runs) -------------------------------------------------------------------------------
_LL_FS_ALL_V1 = (1 << 13) - 1
_LL_READ = (1 << 0) | (1 << 2) | (1 << 3)  # execute, read file, read dir
_LL_FILE_BITS = (1 << 0) | (1 << 1) | (1 << 2) | (1 << 14) | (1 << 15)


def landlock_abi() -> int:
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return max(int(libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))), 0)
    except Exception:
        return 0


def _handled_fs(abi: int) -> int:
    bits = _LL_FS_ALL_V1
    if abi >= 2:
        bits |= 1 << 13  # refer
    if abi >= 3:
        bits |= 1 << 14  # truncate
    if abi >= 5:
        bits |= 1 << 15  # ioctl_dev
    return bits


def apply_landlock(writable: list[str], readable: list[str]) -> int:
    """Restrict this process (and its future children) for good; returns the ABI used."""
    abi = landlock_abi()
    if abi < 1:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    fs = _handled_fs(abi)
    net = 3 if abi >= 4 else 0  # bind and connect TCP: none allowed
    scoped = 3 if abi >= 6 else 0  # abstract unix sockets and signals outside the sandbox
    attr = struct.pack("<QQQ", fs, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = libc.syscall(444, buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")

    def allow(path: str, access: int) -> None:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return
        try:
            if not os.path.isdir(path):
                access &= _LL_FILE_BITS
            rule = ctypes.create_string_buffer(struct.pack("<Qi", access & fs, fd), 12)
            if libc.syscall(445, ctypes.c_int(ruleset), ctypes.c_int(1), rule,
                            ctypes.c_uint32(0)) < 0:
                raise OSError(ctypes.get_errno(), f"landlock_add_rule {path} failed")
        finally:
            os.close(fd)

    for p in readable:
        allow(p, _LL_READ)
    for p in writable:
        allow(p, fs)
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    if libc.syscall(446, ctypes.c_int(ruleset), ctypes.c_uint32(0)) < 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    os.close(ruleset)
    return abi


class _Stop(Exception):
    pass


def read_frame(fd: int) -> bytes:
    head = _read_exact(fd, 8)
    (n,) = struct.unpack("<Q", head)
    return _read_exact(fd, n)


def _read_exact(fd: int, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        b = os.read(fd, min(n - got, 1 << 20))
        if not b:
            raise _Stop
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def write_frame(fd: int, payload: bytes) -> None:
    data = struct.pack("<Q", len(payload)) + payload
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def encode(value, tensors: list) -> object:
    """A JSON tree for `value`; tensors go to `tensors` (plain, dense, CPU, detached)."""
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.layout != torch.strided:
            t = t.to_dense()
        t = torch.Tensor._make_subclass(torch.Tensor, t.cpu().contiguous().clone()) \
            if type(t) is not torch.Tensor else t.cpu().contiguous().clone()
        tensors.append(t)
        return {"~": "tensor", "i": len(tensors) - 1}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value if abs(value) < 2**53 else {"~": "int", "v": str(value)}
    if isinstance(value, float):
        return value if math.isfinite(value) else {"~": "float", "v": repr(value)}
    if isinstance(value, complex):
        return {"~": "repr", "type": "complex", "v": repr(value)}
    if isinstance(value, tuple):
        return {"~": "tuple", "v": [encode(v, tensors) for v in value]}
    if isinstance(value, list):
        return [encode(v, tensors) for v in value]
    if isinstance(value, dict):
        return {"~": "dict", "v": [[encode(k, tensors), encode(v, tensors)]
                                   for k, v in value.items()]}
    if isinstance(value, slice):
        return {"~": "slice", "v": [encode(value.start, tensors), encode(value.stop, tensors),
                                    encode(value.step, tensors)]}
    if isinstance(value, range):
        return {"~": "range", "v": [value.start, value.stop, value.step]}
    mod = type(value).__module__
    if mod == "numpy" and hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return encode(value.item(), tensors)  # a numpy scalar: its Python value
    if mod == "numpy" and hasattr(value, "shape"):
        return encode(torch.from_numpy(value.copy()), tensors)
    try:
        text = repr(value)[:MAX_REPR]
    except Exception:
        text = "<unprintable>"
    return {"~": "repr", "type": f"{mod}.{type(value).__qualname__}", "v": text}


def reply(fd: int, message: dict, tensors: list | None = None) -> None:
    import torch

    buf = io.BytesIO()
    torch.save(list(tensors or []), buf)
    body = json.dumps(message).encode()
    write_frame(fd, struct.pack("<Q", len(body)) + body + buf.getvalue())


def error_message(e: BaseException) -> dict:
    mro = [c.__name__ for c in type(e).__mro__ if c.__module__ == "builtins"]
    tb = traceback.extract_tb(e.__traceback__)
    where = next((f"line {f.lineno}" for f in reversed(tb) if f.filename == "<exercise>"), "")
    try:
        text = str(e)[:MAX_REPR]
    except Exception:
        text = ""
    return {"error": {"type": type(e).__name__, "builtin": mro[0] if mro else "Exception",
                      "message": text, "where": where}}


class Tripwire:
    """A profile hook that notes a call of a forbidden function (matched by its code's
    file name and function name, so re-imported copies count too)."""

    def __init__(self):
        self.forbidden: list[tuple[str, str]] = []
        self.hit: str | None = None

    def __call__(self, frame, event, arg):
        if event == "call" and self.hit is None:
            code = frame.f_code
            for suffix, name in self.forbidden:
                if code.co_name == name and code.co_filename.replace("\\", "/").endswith(suffix):
                    self.hit = f"{suffix[:-3].replace('/', '.')}.{name}"


TAMPERED = "!switched the grader's call monitor off or changed it during the call"
_monitor: Tripwire | None = None  # the call in progress: threads it starts are watched too


def _to_the_monitor(frame, event, arg):
    """The profile hook of every thread the student's code starts: the Tripwire of the call
    in progress, whenever that call is (a thread started by a cell, at definition time, may
    do a later call's work)."""
    if _monitor is not None:
        _monitor(frame, event, arg)


def _watch_new_threads() -> None:
    """Every thread the student's code starts reports to the Tripwire of the call in
    progress: a profile hook is per thread, and a reference called in a thread of the
    student's own went unseen. Installed before any student code runs (threading keeps its
    own name for the start function, so both are wrapped)."""
    import _thread
    import threading

    def watched(start):
        def start_new_thread(function, args=(), kwargs=None, *rest):
            def run(*a, **k):
                sys.setprofile(_to_the_monitor)
                return function(*a, **k)
            return start(run, args, {} if kwargs is None else kwargs, *rest)
        return start_new_thread

    _thread.start_new_thread = watched(_thread.start_new_thread)
    threading._start_new_thread = watched(threading._start_new_thread)


def _watched_call(trip: Tripwire, function, *args, **kwargs):
    """function(*args, **kwargs) under `trip`, in this thread and the threads it starts; a
    call that removes the hook is itself flagged (TAMPERED)."""
    global _monitor
    _monitor, watched = trip, trip.forbidden
    sys.setprofile(trip)
    try:
        return function(*args, **kwargs)
    finally:
        if (sys.getprofile() is not trip or trip.forbidden is not watched) and trip.hit is None:
            trip.hit = TAMPERED
        sys.setprofile(None)
        _monitor = None


def main(fd_in: int, fd_out: int) -> None:
    import torch

    _watch_new_threads()

    torch.set_num_threads(1)
    reply(fd_out, {"ready": True})  # started: the grader's per-request limits apply from here
    functions: dict[str, object] = {}
    forbidden: dict[str, list] = {}
    last: dict = {}
    trip = Tripwire()
    while True:
        try:
            request = pickle.loads(read_frame(fd_in))
        except _Stop:
            return
        kind = request[0]
        try:
            if kind == "define":
                _, name, prelude, source, banned = request
                namespace: dict = {"__name__": "__exercise__"}
                exec(compile(prelude, "<setup>", "exec"), namespace)
                exec(compile(source, "<exercise>", "exec"), namespace)
                fn = namespace.get(name)
                if not callable(fn):
                    reply(fd_out, {"error": {"type": "NameError", "builtin": "NameError",
                                             "message": f"the cell does not define {name}()",
                                             "where": ""}})
                    continue
                functions[name], forbidden[name] = fn, tuple(tuple(b) for b in banned)
                reply(fd_out, {"ok": True})
            elif kind == "call":
                _, name, args, kwargs = request
                trip.forbidden, trip.hit = forbidden[name], None
                last.clear()
                out = _watched_call(trip, functions[name], *args, **kwargs)
                inputs = [t for t in _tensors((args, kwargs)) if t.requires_grad]
                every = _tensors(out)
                index = [i for i, t in enumerate(every) if t.requires_grad]
                outs = [every[i] for i in index]
                last.update(inputs=inputs, outs=outs)
                tensors: list = []
                value = encode(out, tensors)
                after = encode([t for t in _tensors((args, kwargs))], tensors)
                reply(fd_out, {"value": value, "after": after, "reference": trip.hit,
                               "grad_index": index}, tensors)
            elif kind == "drive":
                # a trusted driver of the package builds the case (a model, an optimizer)
                # here, beside the student's function, and returns tensors and numbers
                _, name, module, driver, params = request
                # the package's registry, imported on the first drive request (see above)
                exercises = importlib.import_module("grpo_lab.course.exercises")
                run_driver = exercises.driver(str(module), str(driver))  # a declared one
                if run_driver is None:
                    raise ValueError(f"no exercise's driver is {module}.{driver}")
                trip.forbidden, trip.hit = forbidden[name], None
                last.clear()
                out = _watched_call(trip, run_driver, functions[name], **params)
                tensors = []
                reply(fd_out, {"value": encode(out, tensors), "reference": trip.hit}, tensors)
            elif kind == "backward":
                _, grads = request
                if not last.get("outs"):
                    raise RuntimeError("no output of the last call carries a gradient")
                got = torch.autograd.grad(last["outs"], last["inputs"], grads,
                                          allow_unused=True)
                tensors = []
                reply(fd_out, {"grads": encode(list(got), tensors)}, tensors)
            else:
                reply(fd_out, {"error": {"type": "ValueError", "builtin": "ValueError",
                                         "message": f"unknown request {kind!r}", "where": ""}})
        except _Stop:
            return
        except BaseException as e:  # the student's code raised: the grader decides
            sys.setprofile(None)
            reply(fd_out, error_message(e))


def _tensors(tree) -> list:
    import torch

    out: list = []
    stack, seen = [tree], 0
    while stack and seen < 100_000:
        x = stack.pop()
        seen += 1
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(reversed(x))
        elif isinstance(x, dict):
            stack.extend(reversed(list(x.values())))
    return out
