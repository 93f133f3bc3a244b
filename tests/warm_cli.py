"""`python -m grpo_lab train|yours|scenario ...` for the test run, forked from a process that
has imported torch and transformers already.

The suite starts about forty such commands (the CLI tests, the scenarios, notebook 11's and
12's runs, torchrun's ranks), and each spent about 3.5 s of CPU importing torch and
transformers before its first step: a tenth of the suite's CPU on two cores. Each test worker
starts one server (`python warm_cli.py SOCKET`) that imports them once. The root conftest.py
puts tests/warm_cli_hook/ on PYTHONPATH: its sitecustomize.py runs first in every Python
the tests start, and where the command is one of those above, in this environment, with an
environment the server's imports cannot tell apart (COMPATIBLE), it hands its arguments,
working directory, environment, sys.path and standard streams to the server and stands for
the forked process: it relays signals to it and exits as it did (killed by a signal: by the
same signal). Anything else, or no server: the process starts as it always did.

grpo_lab itself is not imported by the server: the command imports it, in its own
environment (GRPO_LAB_* variables, the launcher's RANK and WORLD_SIZE), as a fresh process
would. WARM_CLI_LOG=FILE: each server appends one line per command it was asked for, with
the variables that kept it from forking one. What a forked command cannot show is what a fresh process does before its first line
runs (import-time warnings, the thread policy torch reads at import): the tests of those
(tests/test_startup.py, the packaging and setup tests) start other commands, or set a
variable outside COMPATIBLE, and get a fresh process. WARM_CLI=0 turns it off.

Linux only (fork without exec, file descriptors passed over a Unix socket).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

SOCKET_ENV = "WARM_CLI_SOCKET"  # this worker's server (not GRPO_LAB_*: those key the memo)
HOOK = Path(__file__).resolve().parent / "warm_cli_hook"  # on PYTHONPATH: sitecustomize.py
COMMANDS = ("train", "yours", "scenario")  # `python -m grpo_lab COMMAND`, forked
PRELOAD = ("torch", "torch.distributed", "numpy", "safetensors.torch", "tokenizers",
           "transformers.models.gpt2.modeling_gpt2", "transformers.generation")
# variables a forked command may have different from the server: none is read when the
# preloaded modules are imported (grpo_lab, not preloaded, reads GRPO_LAB_* when it is)
COMPATIBLE = {"OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONUNBUFFERED", "TMPDIR", "PWD",
              "OLDPWD", "_", "SHLVL", "MPLBACKEND", "TERM", "CLICOLOR", "CLICOLOR_FORCE",
              "FORCE_COLOR", "PAGER", "GIT_PAGER",
              "COLUMNS", "LINES", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
              "MASTER_ADDR", "MASTER_PORT", "WARM_CLI_LOG", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
              "ROLE_NAME", "ROLE_WORLD_SIZE", "NCCL_ASYNC_ERROR_HANDLING", "CUDA_MODULE_LOADING",
              "WARM_KERNELS_SOCKET", SOCKET_ENV}
COMPATIBLE_PREFIXES = ("GRPO_LAB_", "TORCHELASTIC_", "TORCH_NCCL_", "PYTEST_", "JPY_",
                       "PYDEVD_", "ACCELERATE_")  # accelerate launch's, read by no import
RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
           signal.SIGUSR2)


def start_server(path: str) -> subprocess.Popen:
    """Start a server on the Unix socket `path` in the background: it listens once its
    imports are done (a command started before that runs as a fresh process)."""
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), path],
                            stdin=subprocess.DEVNULL)


def differences(env: dict[str, str], server_env: dict[str, str],
                added: dict[str, str]) -> list[str]:
    """The variables outside COMPATIBLE in which `env` differs from the server's. `added`:
    what the server's imports set; a command that has one of them with that value (its
    parent imported torch too) or not at all (its own imports will set it) is the same."""
    names = set(env) | set(server_env)
    return sorted(n for n in names if env.get(n) != server_env.get(n) and n not in COMPATIBLE
                  and not n.startswith(COMPATIBLE_PREFIXES)
                  and not (n in added and env.get(n) in (None, added[n])))


def _command(request: dict, fds: list[int], closing: list[socket.socket],
             added: dict[str, str]) -> None:
    """In the forked child: run `python [-u] -m grpo_lab ...` as the request says; never
    returns. `added`: what the preloaded imports set in the environment where it was unset
    (torch: TORCHINDUCTOR_CACHE_DIR), as they would have in a fresh process."""
    import atexit
    import io
    import runpy
    import tempfile
    import traceback

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
        for signum in RELAYED + (signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python sets it at startup
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for name, value in added.items():
            os.environ.setdefault(name, value)
        sys.path[:] = request["path"]
        tempfile.tempdir = None  # TMPDIR is read again
        unbuffered = request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))
        encoding = sys.stdout.encoding
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(
            io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding=encoding)
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(
            io.FileIO(1, "w", closefd=False) if unbuffered
            else io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
            encoding=encoding, line_buffering=os.isatty(1), write_through=unbuffered)
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False) if unbuffered
            else io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
            encoding=encoding, errors="backslashreplace", line_buffering=True,
            write_through=unbuffered)
        import torch

        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            if os.environ.get(name, "").isdigit():
                torch.set_num_threads(int(os.environ[name]))
                break
        sys.argv = ["-m", *request["args"][1:]]  # ["grpo_lab", COMMAND, ...]: as `-m` leaves it
        try:
            runpy.run_module("grpo_lab", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:  # what the interpreter does with it
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            traceback.print_exc()
            code = -signal.SIGINT
        except BaseException:  # noqa: BLE001 - as an uncaught exception: traceback, exit 1
            sys.excepthook(*sys.exc_info())
            code = 1
    except BaseException:  # noqa: BLE001 - the setup failed: say so on the command's stderr
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            if code < 0:  # died of a signal, as a fresh process would
                signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            os._exit(code & 0xFF)


def serve(path: str) -> None:
    import importlib

    from warm_kernels import serve_forks  # this file's folder, tests/, is sys.path[0]

    log = os.environ.get("WARM_CLI_LOG")  # a file: one line per command, and what differed
    server_env = dict(os.environ)  # before the imports, which may set some (as they will in
    for name in PRELOAD:           # the command: its os.environ is the client's, then theirs)
        importlib.import_module(name)
    added = {k: v for k, v in os.environ.items() if k not in server_env}

    def refuse(request: dict) -> bool:
        differ = differences(request["env"], server_env, added)
        if log:
            with open(log, "a") as f:
                f.write(json.dumps({"args": request["args"], "differ": differ,
                                    "executable": request["executable"]}) + "\n")
        return request["executable"] != sys.executable or bool(differ)

    serve_forks(path, lambda request, fds, closing: _command(request, fds, closing, added),
                refuse)


if __name__ == "__main__":
    serve(sys.argv[1])
