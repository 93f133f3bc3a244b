"""The client side of tests/warm_cli.py, run by every Python the test run starts (this folder
is on PYTHONPATH during `./course test`): `python [-u] -m grpo_lab train|yours|scenario ...`
asks this worker's server to fork the command from its warm imports and stands for it;
anything else returns at once and starts as usual. Standard library only."""

import os
import sys


def _forked_command() -> None:
    path = os.environ.get("WARM_CLI_SOCKET")
    if not path or os.environ.get("WARM_CLI") == "0":
        return
    args = list(getattr(sys, "orig_argv", [])[1:])
    unbuffered = args[:1] == ["-u"]
    if unbuffered:
        args = args[1:]
    if args[:2] != ["-m", "grpo_lab"] or args[2:3] not in (["train"], ["yours"], ["scenario"]):
        return
    import json
    import signal
    import socket

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:  # not listening yet (still importing) or gone: a fresh process
        conn.close()
        return
    request = {"args": args[1:], "cwd": os.getcwd(), "env": dict(os.environ),
               "path": sys.path, "executable": sys.executable, "unbuffered": unbuffered}
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
    reader = conn.makefile("rb")
    answer = reader.readline().strip()
    if not answer.lstrip(b"-").isdigit():  # "fresh": the server cannot stand in for this one
        conn.close()
        return
    pid = int(answer)

    def relay(signum, _frame):
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
                   signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, relay)
    status = reader.readline().strip()
    code = int(status) if status.lstrip(b"-").isdigit() else 1
    if code < 0:  # the command died of a signal: so does this process
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


_forked_command()
