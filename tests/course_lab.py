"""Run `./course lab` as a learner would, on a fresh copy of this checkout (test helper).

`fresh_checkout` copies what a clone of the working tree holds (tracked and untracked,
not ignored, files: no .venv, no runs/, no checkpoints) and links the ready `.venv` into
it, so the copy's `./course` finds its environment at once instead of installing torch.
`LabServer` starts `./course lab` there in its own session, reads the URL with its token
from what `./course` prints, talks to the server's REST API, runs code in a kernel over
the websocket API, and stops it as Ctrl-C does, checking that nothing is left behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
URL_LINE = re.compile(r"\[course\] JupyterLab on [^:]+: (http://localhost:(\d+)/lab\?token=(\w+))")


def fresh_checkout(dest: Path) -> Path:
    """A copy of the working tree as a fresh clone of it would be, with .venv linked in."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():  # skips files deleted in the working tree
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    (dest / ".venv").symlink_to(ROOT / ".venv")
    check = subprocess.run(
        [str(dest / "course"), "setup", "--check"], cwd=dest, capture_output=True, timeout=60
    )
    if check.returncode != 0:  # a failure, not a skip: the browser test stands for nbval's runs
        pytest.fail(".venv is not ready for this checkout: run ./course setup first")
    return dest


def learner_env(home: Path) -> dict[str, str]:
    """The environment of a learner on a headless machine, with HOME at `home`."""
    drop = ("JUPYTER", "JPY_", "DISPLAY", "WAYLAND_DISPLAY", "XDG_", "VIRTUAL_ENV", "PYTHONPATH")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(HOME=str(home), PYTHONUNBUFFERED="1")
    return env


def processes_using(path: Path) -> list[str]:
    """Processes (other than this one) whose command line or working directory is under path
    (without /proc, as on macOS: whose command line is, from `ps`)."""
    found = []
    if not Path("/proc/self").is_dir():
        out = subprocess.run(["ps", "-axo", "pid=,command="], capture_output=True, text=True,
                             timeout=30).stdout
        return [line.strip() for line in out.splitlines() if str(path) in line
                and line.split(None, 1)[0] != str(os.getpid())]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            cwd = os.readlink(entry / "cwd")
        except OSError:  # gone, or not ours to read
            continue
        if str(path) in cmdline or cwd.startswith(str(path)):
            found.append(f"{entry.name}: {cmdline.strip()}")
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class LabServer:
    """`./course lab [args]` started in `checkout`; use as a context manager."""

    def __init__(self, checkout: Path, home: Path, args: tuple[str, ...] = (), timeout=180):
        self.checkout, self.home, self.args, self.timeout = checkout, home, args, timeout
        self.log_path = home / "course-lab.log"
        self.proc: subprocess.Popen | None = None
        self.url = self.token = ""
        self.port = 0
        self.kernel_pids: list[int] = []

    # -- lifecycle

    def __enter__(self) -> LabServer:
        self.home.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                ["./course", "lab", *self.args], cwd=self.checkout, env=learner_env(self.home),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
                # Ctrl-C works in a learner's terminal; a test run started in the background
                # by a non-interactive shell inherits SIGINT ignored, which Python keeps
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )
        try:
            self._wait_until_up()
        except BaseException:
            self.kill()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.kill()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_until_up(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"./course lab exited ({self.proc.returncode}):\n{self.output()}")
            if not self.url and (match := URL_LINE.search(self.output())):
                self.url, self.port, self.token = match.group(1), int(match.group(2)), match.group(3)
            if self.url:
                try:
                    self.get("/api/status")
                    return
                except (urllib.error.URLError, ConnectionError):
                    pass
            time.sleep(0.5)
        raise AssertionError(f"./course lab did not answer in {self.timeout} s:\n{self.output()}")

    def stop(self, timeout=60) -> None:
        """Ctrl-C as in a terminal (SIGINT to the process group; twice if needed), then wait."""
        pgid = os.getpgid(self.proc.pid)
        for _ in range(2):
            os.killpg(pgid, signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout / 2)
                break
            except subprocess.TimeoutExpired:
                continue
        assert self.proc.poll() is not None, f"./course lab still running after Ctrl-C twice:\n{self.output()}"

    def kill(self) -> None:
        """Last resort after a failure: end the server's process group and its kernels."""
        for kill, target in [(os.killpg, self.proc.pid)] + [(os.kill, p) for p in self.kernel_pids]:
            try:
                kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait(timeout=30)

    def leftovers(self, grace=15.0) -> list[str]:
        """What is still running from this server: its process group, kernels, anything in the checkout."""
        deadline = time.monotonic() + grace
        while True:
            left = [f"kernel {p}" for p in self.kernel_pids if alive(p)]
            try:
                os.killpg(self.proc.pid, 0)
                left.append(f"process group {self.proc.pid}")
            except ProcessLookupError:
                pass
            left += processes_using(self.checkout)
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.5)

    # -- REST API

    def request(self, method: str, path: str, body=None, token=True, timeout=30):
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"token {self.token}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data=data, headers=headers, method=method
        )
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, response.read().decode()

    def get(self, path: str, **kw):
        return self.request("GET", path, **kw)

    def api(self, method: str, path: str, body=None):
        status, text = self.request(method, path, body)
        return json.loads(text) if text else None

    # -- kernels

    def start_notebook_session(self, notebook: str) -> str:
        """Open `notebook` as JupyterLab does (a session with the kernel its metadata names)."""
        stored = self.api("GET", f"/api/contents/{notebook}")["content"]
        kernel = stored["metadata"]["kernelspec"]["name"]
        session = self.api(
            "POST", "/api/sessions",
            {"path": notebook, "type": "notebook", "name": notebook, "kernel": {"name": kernel}},
        )
        return session["kernel"]["id"]

    def execute(self, kernel_id: str, code: str, timeout=180) -> str:
        """Run `code` in the kernel over the websocket API; return its stdout. Fails on an error."""
        import websocket  # websocket-client, a dependency of jupyter_server

        session = uuid.uuid4().hex
        ws = websocket.create_connection(
            f"ws://127.0.0.1:{self.port}/api/kernels/{kernel_id}/channels?session_id={session}",
            header=[f"Authorization: token {self.token}"], timeout=timeout,
        )
        msg_id = uuid.uuid4().hex
        ws.send(json.dumps({
            "header": {"msg_id": msg_id, "session": session, "username": "test",
                       "msg_type": "execute_request", "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": False,
                        "user_expressions": {}, "allow_stdin": False, "stop_on_error": True},
        }))
        out, reply, idle = [], None, False
        deadline = time.monotonic() + timeout
        try:
            while not (reply and idle):
                assert time.monotonic() < deadline, f"no reply from the kernel in {timeout} s"
                msg = json.loads(ws.recv())
                if msg.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind, content = msg["msg_type"], msg["content"]
                if kind == "stream":
                    out.append(content["text"])
                elif kind == "error":
                    raise AssertionError("\n".join(content["traceback"]))
                elif kind == "execute_reply":
                    reply = content
                elif kind == "status" and content["execution_state"] == "idle":
                    idle = True
        finally:
            ws.close()
        assert reply["status"] == "ok", reply
        return "".join(out)
