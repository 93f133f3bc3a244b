"""A sandboxed worker process for one submission, and the proxy functions the checkers call.

Layers, each used where the machine offers it (`describe()` says which are on):
- always: a separate process in its own session (forked by `_zygote.py`, a clean process
  that imported torch and transformers once, where it can give the worker its namespaces;
  else a fresh `python -I`), cwd and $TMPDIR a fresh temporary folder, a clean environment,
  stdout/stderr to files capped by RLIMIT_FSIZE, RLIMIT_AS (memory), RLIMIT_CPU,
  RLIMIT_NPROC, no core dumps, a wall-clock limit per request and per submission; on exit its
  process group and every descendant are killed;
- Linux user namespaces (the zygote's `unshare(2)`, else `unshare(1)`): its own PID namespace
  (killing its first process ends every process it started, setsid or not; it cannot see or
  signal the grader) and network namespace (no network);
- Landlock (Linux >= 5.13): it may write only inside its temporary folder and read only the
  Python installation and its site-packages, the system folders, the grpo_lab package and
  the private copy of it the worker imports: not the rest of the instructor's checkout
  (solutions/), other submissions or the results; with Landlock ABI >= 6 it cannot signal
  processes outside its sandbox either.

Values cross back as data (JSON and plain tensors loaded with `weights_only=True`), so
nothing the worker sends can run code in the grader.
"""

from __future__ import annotations

import functools
import io
import json
import os
import pickle
import resource
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import _worker
from ._worker import landlock_abi
from .exercises.base import Mismatch

PACKAGE = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Limits:
    call_s: float = 60.0  # one request: running the exercise cell, one call, one backward
    startup_s: float = 120.0  # the worker starting (importing torch) before its first request
    submission_s: float = 600.0  # every request of one submission together
    memory_mb: int = 4096  # RLIMIT_AS of the worker
    output_bytes: int = 1 << 20  # stdout + stderr kept (RLIMIT_FSIZE: the worker dies past it)
    reply_bytes: int = 64 << 20  # one reply of the worker
    # of which its values other than tensors (numbers, strings, lists): parsed in the
    # grader's memory at tens of bytes per item, where a tensor costs its data alone
    reply_values_bytes: int = 4 << 20
    processes: int = 64  # RLIMIT_NPROC above the user's count (not enforced for root)


class SandboxError(Mismatch):
    """The worker timed out, died, or answered something malformed (message: why, in the
    learner's terms)."""


class RemoteError(Exception):
    """The student's code raised in the worker; carries its type name and message."""

    def __init__(self, type_name: str, message: str, where: str = ""):
        super().__init__(f"{type_name}: {message}" if message else type_name)
        self.type_name, self.message, self.where = type_name, message, where


class ReferenceCalled(Mismatch):
    """The student's function called the exercise's reference."""

    def __init__(self, where: str):
        super().__init__(f"your function calls the reference {where}")




@functools.cache
def userns_available() -> bool:
    unshare = shutil.which("unshare")
    if not unshare or not sys.platform.startswith("linux"):
        return False
    try:
        return subprocess.run([unshare, "-U", "-r", "-p", "-f", "-n", "--kill-child", "true"],
                              capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def describe() -> str:
    abi = landlock_abi()
    zygote = _zygote(Limits().startup_s)
    parts = ["process limits (memory, CPU, output, time)"]
    parts.append("PID and network namespaces" if zygote is not None or userns_available()
                 else "no PID namespace (unshare unavailable): descendants killed by tree walk")
    parts.append(f"Landlock ABI {abi} (writes confined to the submission's folder"
                 + (", no signals out)" if abi >= 6 else ")") if abi else
                 "no Landlock: a submission could write outside its folder")
    parts.append("workers forked from a process that imported torch and transformers once"
                 if zygote else "a fresh Python process per worker")
    return "; ".join(parts)


def readable_roots() -> list[str]:
    roots = {"/usr", "/lib", "/lib64", "/bin", "/sbin", "/etc", "/proc", "/sys", "/dev",
             sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    for p in sys.path:
        if p and "site-packages" in p or p.endswith("-packages"):
            roots.add(p)
            roots.add(os.path.realpath(p))
    roots.add(os.path.dirname(os.path.dirname(os.path.realpath(torch.__file__))))
    roots.add(str(PACKAGE))  # the installed grpo_lab (from a wheel: inside site-packages)
    return sorted(r for r in roots if r and os.path.exists(r))


def package_copy(dest: Path) -> Path:
    """A private copy of grpo_lab (what a worker's imports see) under `dest`."""
    shutil.copytree(PACKAGE, dest / "grpo_lab",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


# --- the worker process ----------------------------------------------------------------------
BOOT = """import sys
sys.path.insert(0, {pkg!r})
sys.setrecursionlimit(5000)
from importlib.machinery import SourceFileLoader
w = SourceFileLoader("_grading_worker", {worker!r}).load_module()
w.apply_landlock({writable!r}, {readable!r})
w.main({fd_in}, {fd_out})
"""
ZYGOTE_BOOT = """import sys
from importlib.machinery import SourceFileLoader
SourceFileLoader("_grading_zygote", {zygote!r}).load_module().serve({fd})
"""
# what a worker's environment holds besides HOME and TMPDIR (its folder)
WORKER_ENV = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}


class _Zygote:
    """The grader's end of grpo_lab/course/_zygote.py: one per grader process, started on
    the first submission, asked for every worker after it."""

    def __init__(self, startup_s: float):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        boot = ZYGOTE_BOOT.format(zygote=str(PACKAGE / "course" / "_zygote.py"),
                                  fd=theirs.fileno())
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-c", boot], cwd="/", env=WORKER_ENV,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        self.sock = mine
        self.namespaces = bool(self.ask({"op": "hello"}, timeout=startup_s)[0]["namespaces"])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ask(self, request: dict, fds: tuple[int, ...] = (), timeout: float = 30.0
            ) -> tuple[dict, list[int]]:
        """The zygote's answer to `request` and the fds that came with it."""
        with _ZYGOTE_LOCK:
            try:
                socket.send_fds(self.sock, [json.dumps(request).encode()], list(fds))
                self.sock.settimeout(timeout)
                msg, got, _, _ = socket.recv_fds(self.sock, 1 << 16, 1)
            except OSError:
                msg, got = b"", []
            if not msg:
                self.close()
                raise ZygoteLost("the grading zygote stopped answering")
            answer = json.loads(msg)
            if "error" in answer:
                for fd in got:
                    os.close(fd)
                raise SandboxError(f"the grading zygote refused: {answer['error']}")
            return answer, got

    def close(self) -> None:
        self.sock.close()
        with _quiet():
            self.proc.wait(timeout=10)


class ZygoteLost(SandboxError):
    """The zygote ended (never the submission's doing: a worker cannot reach it); its
    workers ended with it."""


class _Forked:
    """A worker forked by the zygote: as much of `subprocess.Popen` as Worker uses, and
    `kill`, through a pidfd (a pid that the zygote reaped could be another process's)."""

    def __init__(self, zygote: _Zygote, pid: int, pidfd: int):
        self.zygote, self.pid, self.pidfd, self.returncode = zygote, pid, pidfd, None
        self.lost = False  # the zygote ended: nothing to wait for

    @classmethod
    def spawn(cls, zygote: _Zygote, request: dict, fd_in: int, fd_out: int, out) -> _Forked:
        answer, pidfd = zygote.ask(request, (fd_in, fd_out, out.fileno()))
        if len(pidfd) != 1 or not isinstance(answer.get("pid"), int):
            raise SandboxError(f"the grading zygote answered a spawn with {answer}")
        return cls(zygote, answer["pid"], pidfd[0])

    def poll(self):
        return self.wait(0.0)

    def wait(self, timeout: float):
        if self.returncode is None and not self.lost:
            try:
                answer, _ = self.zygote.ask({"op": "wait", "pid": self.pid, "timeout": timeout},
                                            timeout=timeout + 30)
                self.returncode = answer["code"]
            except ZygoteLost:
                self.lost = True
            except SandboxError:  # refused: it has no such child (already reaped)
                pass
        return self.returncode

    def kill(self) -> None:
        """SIGKILL C: I dies with it (PDEATHSIG), and every process of the PID namespace
        with I."""
        with _quiet():
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    def release(self) -> None:
        with _quiet():
            os.close(self.pidfd)


_ZYGOTE: _Zygote | None = None
_ZYGOTE_LOCK = threading.RLock()
_NO_ZYGOTE = False  # it did not start, or could not give a worker its own namespaces


def _zygote(startup_s: float) -> _Zygote | None:
    """The running zygote, started if need be; None where it cannot give a worker its own
    namespaces (not Linux, no user namespaces): workers are then exec'd."""
    global _ZYGOTE, _NO_ZYGOTE
    if not sys.platform.startswith("linux"):
        return None
    with _ZYGOTE_LOCK:
        if _ZYGOTE is not None and not _ZYGOTE.alive():
            _ZYGOTE = None
        if _ZYGOTE is None and not _NO_ZYGOTE:
            try:
                _ZYGOTE = _Zygote(startup_s)
            except (OSError, SandboxError):  # it did not start: workers are exec'd
                _NO_ZYGOTE = True
                return None
            if not _ZYGOTE.namespaces:
                _ZYGOTE.close()
                _ZYGOTE, _NO_ZYGOTE = None, True
        return _ZYGOTE


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
                ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, stack = [], [pid]
    while stack:
        for c in children.get(stack.pop(), []):
            out.append(c)
            stack.append(c)
    return out


class Worker:
    """One sandboxed worker for one submission (`with Worker(...) as w:`)."""

    def __init__(self, pkg_root: Path, limits: Limits = Limits(), fork: bool = True):
        """fork: the worker is forked by the zygote (`_zygote.py`), where the machine allows
        it; False: a fresh `python -I` process, as without the zygote."""
        self.limits, self.pkg_root, self.fork = limits, pkg_root, fork
        self.deadline = time.monotonic() + limits.submission_s
        self.folder = Path(tempfile.mkdtemp(prefix="grpo-grade-"))
        self.proc: subprocess.Popen | _Forked | None = None
        self.dead: str | None = None
        self.lost_zygote = False  # it died with the zygote: the grader's failure, not the student's
        self.namespaced = False
        self.starting = False

    def restart(self) -> None:
        """A fresh process after a death (the submission's deadline stays)."""
        self.close(keep_folder=True)
        self.dead, self.lost_zygote = None, False

    # lifecycle
    def start(self) -> None:
        home = self.folder / "work"
        home.mkdir()
        limits, writable = self.limits, [str(home), "/dev/null"]
        readable = readable_roots() + [str(self.pkg_root)]
        cpu = int(limits.submission_s) + 5
        rlimits = {"RLIMIT_AS": (limits.memory_mb << 20,) * 2,
                   "RLIMIT_FSIZE": (limits.output_bytes,) * 2,
                   "RLIMIT_CPU": (cpu, cpu + 5), "RLIMIT_CORE": (0, 0)}
        running = _user_processes()
        if running is not None:  # a limit set blind could stop the worker's own forks
            rlimits["RLIMIT_NPROC"] = (running + limits.processes,) * 2
        env = {**WORKER_ENV, "HOME": str(home), "TMPDIR": str(home)}
        worker_file = self.pkg_root / "grpo_lab" / "course" / "_worker.py"
        zygote = _zygote(limits.startup_s) if self.fork else None
        if zygote is not None:
            spawn = {"op": "spawn", "pkg": str(self.pkg_root), "worker": str(worker_file),
                     "home": str(home), "env": env, "rlimits": rlimits, "writable": writable,
                     "readable": readable}
            try:
                self._launch(lambda fd_in, fd_out, out: _Forked.spawn(zygote, spawn, fd_in,
                                                                      fd_out, out))
                self.namespaced = True
                return
            except SandboxError:  # the zygote's failure, not this submission's: exec'd, on
                pass  # fresh pipes (a child of a lost zygote may hold the old ones a moment)
        self.namespaced = userns_available()
        self._launch(lambda fd_in, fd_out, out: self._exec(
            fd_in, fd_out, out, rlimits, env,
            BOOT.format(pkg=str(self.pkg_root), worker=str(worker_file), fd_in=fd_in,
                        fd_out=fd_out, writable=writable, readable=readable)))

    def _launch(self, launch) -> None:
        """Pipes and the output file for a worker, and `launch(fd_in, fd_out, out)` to start
        it with its ends; the grader keeps the other two."""
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        out = open(self.folder / "output.txt", "wb")
        try:
            self.proc = launch(to_worker_r, from_worker_w, out)
        except BaseException:
            os.close(to_worker_w)
            os.close(from_worker_r)
            raise
        finally:
            out.close()
            os.close(to_worker_r)
            os.close(from_worker_w)
        self.w, self.r = to_worker_w, from_worker_r
        self.starting = True

    def _exec(self, to_worker_r: int, from_worker_w: int, out, rlimits: dict, env: dict,
              boot: str) -> subprocess.Popen:
        """The worker as a fresh `python -I` (where there is no zygote)."""

        def preexec():  # in the child, between fork and exec
            for name, value in rlimits.items():
                resource.setrlimit(getattr(resource, name), value)
            # a grader started with SIGINT ignored (pytest-xdist's workers) would hand that
            # on through exec: the worker gets Python's KeyboardInterrupt, as a forked one does
            signal.signal(signal.SIGINT, signal.SIG_DFL)

        argv = [sys.executable, "-I", "-c", boot]
        if self.namespaced:
            # sh is the namespace's first process (init ignores signals it has no handler
            # for, so the worker must not be it); when it ends, the kernel ends the rest
            argv = [shutil.which("unshare"), "-U", "-r", "-p", "-f", "-n", "--kill-child",
                    "--", "/bin/sh", "-c", '"$0" "$@"; exit $?'] + argv
        return subprocess.Popen(
            argv, cwd=env["HOME"], env=env, stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, pass_fds=(to_worker_r, from_worker_w),
            start_new_session=True, preexec_fn=preexec, close_fds=True)

    def __enter__(self) -> Worker:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, keep_folder: bool = False) -> None:
        if self.proc is not None:
            if isinstance(self.proc, _Forked):
                self.proc.kill()
                self.proc.wait(timeout=10)
                self.proc.release()
            else:
                if self.proc.returncode is None:  # not reaped yet: its pid is still its own
                    for pid in [self.proc.pid] + _descendants(self.proc.pid):
                        with _quiet():
                            os.kill(pid, signal.SIGKILL)
                    with _quiet():
                        os.killpg(self.proc.pid, signal.SIGKILL)
                with _quiet():
                    self.proc.wait(timeout=10)
            for fd in (self.w, self.r):
                with _quiet():
                    os.close(fd)
            self.proc = None
        if keep_folder:
            shutil.rmtree(self.folder / "work", ignore_errors=True)
        else:
            shutil.rmtree(self.folder, ignore_errors=True)

    def output_tail(self, n: int = 400) -> str:
        try:
            with open(self.folder / "output.txt", "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - n))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    # requests
    def request(self, message: tuple) -> tuple[dict, list]:
        if self.dead:
            raise SandboxError(self.dead)
        if self.proc is None:
            self.start()
        if self.starting:
            self._ready()
        left = self.deadline - time.monotonic()
        timeout = min(self.limits.call_s, left)
        if timeout <= 0:
            self._die(f"the submission used up its {self.limits.submission_s:.0f} s limit")
        try:
            payload = pickle.dumps(message, protocol=4)
            _write_all(self.w, struct.pack("<Q", len(payload)) + payload, timeout)
            frame = self._read_frame(time.monotonic() + timeout)
        except TimeoutError:
            which = "its" if timeout == self.limits.call_s else "the submission's"
            limit = self.limits.call_s if which == "its" else self.limits.submission_s
            self._die(f"did not finish within {which} {limit:.0f} s limit (an endless loop?)")
        except BrokenPipeError:
            self._die(self._death())
        (n,) = struct.unpack("<Q", frame[:8])
        if n > self.limits.reply_values_bytes:
            self._die(f"its answer held {n >> 20} MiB of Python values (lists, numbers, "
                      f"strings), more than the {self.limits.reply_values_bytes >> 20} MiB "
                      "the grader reads: return tensors for large results")
        try:
            head = json.loads(frame[8:8 + n].decode())
            tensors = torch.load(io.BytesIO(frame[8 + n:]), weights_only=True)
            if not isinstance(head, dict) or not isinstance(tensors, list) or not all(
                    isinstance(t, torch.Tensor) for t in tensors):
                raise ValueError("not a reply")
            error, reference = head.get("error"), head.get("reference")
            if "error" in head and not (isinstance(error, dict) and all(
                    isinstance(v, str) for v in error.values())):
                raise ValueError("not a reply")  # the worker's own replies are well formed
            if reference is not None and not isinstance(reference, str):
                raise ValueError("not a reply")
            if sum(t.untyped_storage().nbytes() for t in tensors) > self.limits.reply_bytes or \
                    any(t.numel() * t.element_size() > self.limits.reply_bytes for t in tensors):
                raise ValueError("too large")
        except Exception as e:  # noqa: BLE001 - anything malformed is the submission's
            self._die(f"its worker answered something malformed ({type(e).__name__})")
        return head, tensors

    def _ready(self) -> None:
        """Wait for the worker's first frame (it sends one once torch is imported and its
        sandbox is on), so a slow start is not charged to the first request."""
        limit = min(self.limits.startup_s, self.deadline - time.monotonic())
        try:
            frame = self._read_frame(time.monotonic() + max(limit, 0))
        except TimeoutError:
            self._die(f"its worker did not start within {limit:.0f} s (machine overloaded?)")
        (n,) = struct.unpack("<Q", frame[:8])
        try:
            ok = json.loads(frame[8:8 + n].decode()) == {"ready": True}
        except ValueError:
            ok = False
        if not ok:
            self._die("its worker answered something malformed at start")
        self.starting = False

    def _die(self, why: str):
        self.dead = why
        self.close(keep_folder=True)
        raise SandboxError(why)

    def _death(self) -> str:
        code = self.proc.poll() if self.proc else None
        if code is None and self.proc is not None:
            with _quiet():
                code = self.proc.wait(timeout=2)
        if isinstance(self.proc, _Forked) and self.proc.lost:
            self.lost_zygote = True
            return ("the grading zygote ended, and this worker with it (not the submission's "
                    "doing)")
        tail = self.output_tail(300).strip().splitlines()
        last = f" (last output: {tail[-1][:160]!r})" if tail else ""
        if code is not None and code > 128 and self.namespaced:
            code = 128 - code  # sh reports a child killed by signal N as 128 + N
        if code is not None and code < 0:
            sig = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            hint = {"SIGXFSZ": ": it printed more than the output limit",
                    "SIGXCPU": ": it used up its CPU time",
                    "SIGKILL": ": killed (out of memory?)"}.get(sig, "")
            return f"the process running it died of {sig}{hint}{last}"
        if code is not None:
            return f"the process running it exited with code {code}{last}"
        return f"the process running it stopped answering{last}"

    def _read_frame(self, deadline: float) -> bytes:
        head = self._read(8, deadline)
        (n,) = struct.unpack("<Q", head)
        if n > self.limits.reply_bytes + (1 << 20):
            self._die(f"its answer was larger than {self.limits.reply_bytes >> 20} MiB")
        return self._read(n, deadline)

    def _read(self, n: int, deadline: float) -> bytes:
        chunks, got = [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([self.r], [], [], left)
            if not ready:
                raise TimeoutError
            b = os.read(self.r, min(n - got, 1 << 20))
            if not b:
                self._die(self._death())
            chunks.append(b)
            got += len(b)
        return b"".join(chunks)


def _write_all(fd: int, data: bytes, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    view = memoryview(data)
    while view:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        _, ready, _ = select.select([], [fd], [], left)
        if ready:
            view = view[os.write(fd, view[: 1 << 16]):]


def _user_processes() -> int | None:
    """What RLIMIT_NPROC counts against this user now: on Linux its tasks (threads
    included: a non-root desktop session or CI runner has hundreds, which a count of
    processes alone would leave the sandbox no room above), elsewhere its processes (`ps`);
    None where neither can be counted."""
    uid = os.getuid()
    if os.path.isfile("/proc/self/status"):
        n = 0
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with _quiet(), open(f"/proc/{entry}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                    if int(fields["Uid"].split()[0]) == uid:  # the real uid, as the limit
                        n += int(fields["Threads"])
        return n
    try:  # macOS, BSDs: RLIMIT_NPROC counts processes
        out = subprocess.run(["ps", "-x", "-U", str(uid), "-o", "pid="], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return len(out.stdout.split()) if out.returncode == 0 else None


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        return exc_type is not None and issubclass(exc_type, Exception)


# --- decoding and the proxy --------------------------------------------------------------
@dataclass(frozen=True)
class Opaque:
    """A value of a type that cannot cross back (shown by its type and repr)."""
    type: str
    text: str

    def __repr__(self) -> str:
        return f"<{self.type}: {self.text}>"


def decode(tree, tensors: list):
    if isinstance(tree, list):
        return [decode(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        return tree
    kind, v = tree.get("~"), tree.get("v")
    if kind == "tensor":
        return tensors[int(tree["i"])]
    if kind == "tuple":
        return tuple(decode(x, tensors) for x in v)
    if kind == "dict":
        return {_hashable(decode(k, tensors)): decode(x, tensors) for k, x in v}
    if kind == "slice":
        return slice(*(decode(x, tensors) for x in v))
    if kind == "range":
        return range(*(int(x) for x in v))
    if kind == "int":
        return int(v)
    if kind == "float":
        return float(v)
    return Opaque(str(tree.get("type")), str(v))


def _hashable(k):
    try:
        hash(k)
        return k
    except TypeError:
        return repr(k)


def _tensors(tree) -> list:
    return _worker._tensors(tree)


class _Bridge(torch.autograd.Function):
    """Outputs computed in the worker, whose backward asks the worker for the gradients."""

    @staticmethod
    def forward(ctx, proxy, outs, *leaves):
        ctx.proxy, ctx.n = proxy, len(leaves)
        return tuple(o.clone() for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        got = ctx.proxy.backward([g if g is not None else torch.zeros(()) for g in grads])
        return (None, None, *got)


class RemoteFunction:
    """Stands in for the student's function in the grader: each call runs in the worker."""

    def __init__(self, worker: Worker, name: str):
        self.worker, self.name, self.__name__ = worker, name, name
        self.reference_called: str | None = None

    def __call__(self, *args, **kwargs):
        sent = _tensors((args, kwargs))
        leaves = [t for t in sent if t.requires_grad]
        head, tensors = self.worker.request(("call", self.name, args, kwargs))
        if "error" in head:
            raise _rebuild(head["error"])
        if head.get("reference"):
            self.reference_called = str(head["reference"])
            raise ReferenceCalled(self.reference_called)
        value = decode(head.get("value"), tensors)
        after = decode(head.get("after"), tensors)
        if isinstance(after, list) and len(after) == len(sent):
            for mine, theirs in zip(sent, after, strict=True):  # in-place changes show here
                if isinstance(theirs, torch.Tensor) and theirs.shape == mine.shape and \
                        theirs.dtype == mine.dtype and not torch.equal(
                            theirs.nan_to_num(0.123), mine.detach().nan_to_num(0.123)):
                    with torch.no_grad():
                        mine.copy_(theirs)
        if not leaves:
            return value
        outs = _tensors(value)
        carry = [int(i) for i in head.get("grad_index") or [] if 0 <= int(i) < len(outs)]
        if not carry:
            return value
        bridged = _Bridge.apply(self, [outs[i] for i in carry], *leaves)
        mapping = dict(zip(carry, bridged, strict=True))
        return _replace(value, mapping)

    def drive(self, module: str, driver: str, params: dict):
        """Run a driver an exercise declares (`exercises.driver`) on the student's function
        in the worker: the case it builds (a model, an optimizer) never crosses the pipe."""
        head, tensors = self.worker.request(("drive", self.name, module, driver, params))
        if "error" in head:
            raise _rebuild(head["error"])
        if head.get("reference"):
            self.reference_called = str(head["reference"])
            raise ReferenceCalled(self.reference_called)
        return decode(head.get("value"), tensors)

    def backward(self, grads: list[torch.Tensor]) -> list:
        head, tensors = self.worker.request(("backward", grads))
        if "error" in head:
            e = head["error"]
            raise RuntimeError(f"computing the gradient in your function failed: "
                               f"{e.get('type')}: {e.get('message')}")
        got = decode(head.get("grads"), tensors)
        return [g if isinstance(g, torch.Tensor) else None for g in got]


def _replace(tree, mapping: dict[int, torch.Tensor]):
    counter = iter(range(10**9))

    def walk(x):
        if isinstance(x, torch.Tensor):
            i = next(counter)
            return mapping.get(i, x)
        if isinstance(x, tuple):
            return tuple(walk(v) for v in x)
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        return x
    return walk(tree)


_BUILTIN_ERRORS = {c.__name__: c for c in (ValueError, TypeError, RuntimeError, IndexError,
                                           KeyError, ZeroDivisionError, AttributeError,
                                           NameError, AssertionError, ArithmeticError,
                                           OverflowError, NotImplementedError, LookupError,
                                           RecursionError, MemoryError)}


def _rebuild(e: dict) -> Exception:
    name, builtin = str(e.get("type")), str(e.get("builtin"))
    message = str(e.get("message", ""))[:300]
    if builtin in ("SystemExit", "KeyboardInterrupt", "BaseException", "GeneratorExit"):
        return RemoteError(name, message or "your function tried to exit the process")
    cls = _BUILTIN_ERRORS.get(name) or _BUILTIN_ERRORS.get(builtin)
    if "File too large" in message:
        return SandboxError("it printed more than the output limit")
    if cls is NotImplementedError:
        return NotImplementedError(message)
    if cls is not None:
        err = cls(message) if name == builtin else cls(f"{name}: {message}")
        return err
    return RemoteError(name, message)
