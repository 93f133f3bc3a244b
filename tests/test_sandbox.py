"""The grading sandbox: hostile code that got past the static check still cannot reach the
grader, the instructor's files or other submissions, cannot outlive its submission, and
cannot crash or hang the grader; values and gradients cross back as data."""

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from grpo_lab.course import sandbox

LIMITS = sandbox.Limits(call_s=20, submission_s=60, memory_mb=3072, output_bytes=1 << 16)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    return sandbox.package_copy(tmp_path_factory.mktemp("pkg"))


def define(worker, source, name="f", prelude="import torch\n", tripwires=()):
    head, _ = worker.request(("define", name, prelude, source, [list(t) for t in tripwires]))
    return head


def test_values_and_gradients_cross_back_as_data(pkg):
    with sandbox.Worker(pkg, LIMITS) as w:
        assert define(w, "def f(x, y):\n    return (x * y).exp(), {'n': 3, 's': slice(0, 2)}")[
            "ok"]
        f = sandbox.RemoteFunction(w, "f")
        x = torch.randn(4, requires_grad=True)
        y = torch.randn(4)
        out, extra = f(x, y)
        assert extra == {"n": 3, "s": slice(0, 2)}
        assert torch.allclose(out, (x * y).exp())
        out.sum().backward()
        assert torch.allclose(x.grad, y * (x * y).exp().detach())


def test_in_place_changes_come_back_to_the_callers_tensor(pkg):
    with sandbox.Worker(pkg, LIMITS) as w:
        define(w, "def f(x):\n    x -= 1\n    return x.sum()")
        x = torch.zeros(3)
        sandbox.RemoteFunction(w, "f")(x)
        assert torch.equal(x, -torch.ones(3))


def test_exceptions_keep_their_type(pkg):
    with sandbox.Worker(pkg, LIMITS) as w:
        define(w, "def f(x):\n    raise ValueError('bad loss_type')")
        with pytest.raises(ValueError, match="bad loss_type"):
            sandbox.RemoteFunction(w, "f")(1)
        define(w, "def f(x):\n    raise NotImplementedError('todo')")
        with pytest.raises(NotImplementedError):
            sandbox.RemoteFunction(w, "f")(1)


def test_a_call_of_the_reference_is_caught_at_run_time(pkg):
    src = ("import importlib\n"
           "def f(logp, ref_logp):\n"
           "    m = importlib.import_module('grpo_lab.objective')\n"
           "    return m.kl_k3(logp, ref_logp)\n")
    with sandbox.Worker(pkg, LIMITS) as w:
        define(w, src, tripwires=[("grpo_lab/objective.py", "kl_k3")])
        with pytest.raises(sandbox.ReferenceCalled, match="grpo_lab.objective.kl_k3"):
            sandbox.RemoteFunction(w, "f")(torch.zeros(2), torch.zeros(2))


REACH_K3 = "import importlib\nk3 = importlib.import_module('grpo_lab.objective').kl_k3\n"


@pytest.mark.parametrize("body, caught", [
    ("    import threading\n    box = []\n"
     "    t = threading.Thread(target=lambda: box.append(k3(logp, ref_logp)))\n"
     "    t.start()\n    t.join()\n    return box[0]\n", "grpo_lab.objective.kl_k3"),
    ("    jobs.put((logp, ref_logp))\n    return done.get()\n", "grpo_lab.objective.kl_k3"),
    ("    import sys\n    sys.setprofile(None)\n    return k3(logp, ref_logp)\n",
     "switched the grader's call monitor off"),
    ("    import sys\n    sys.getprofile().forbidden = ()\n    return k3(logp, ref_logp)\n",
     "switched the grader's call monitor off or changed it"),
], ids=["a thread it starts", "a thread the cell started", "the monitor switched off",
        "the monitor disarmed"])
def test_the_reference_is_caught_by_any_road_the_static_check_missed(pkg, body, caught):
    """Past the static check (these cells would be flagged by it before they ran), the
    tripwire still sees the reference: in threads, started by the call or by the cell, and
    a call that switches the monitor off or changes it is reported."""
    background = ("import queue, threading\njobs, done = queue.Queue(), queue.Queue()\n"
                  "threading.Thread(target=lambda: [done.put(k3(*jobs.get())) for _ in "
                  "range(9)], daemon=True).start()\n")
    src = REACH_K3 + background + "def f(logp, ref_logp):\n" + body
    with sandbox.Worker(pkg, LIMITS) as w:
        define(w, src, tripwires=[("grpo_lab/objective.py", "kl_k3")])
        with pytest.raises(sandbox.ReferenceCalled, match=caught):
            sandbox.RemoteFunction(w, "f")(torch.zeros(2), torch.zeros(2))


def test_a_forged_reply_is_a_reason_not_a_grader_crash(pkg):
    """Code in the worker can patch what writes its replies; a reply in a shape the worker
    never sends ends that submission with a reason."""
    forge = "import sys\nsys.modules['json'].dumps = lambda *a, **k: '{\"error\": 1}'\n"
    with sandbox.Worker(pkg, LIMITS) as w:
        with pytest.raises(sandbox.SandboxError, match="malformed"):
            define(w, forge + "def f(x):\n    return x\n")


@pytest.mark.parametrize("target", ["grpo_lab/course/exercises/nb03.py", "solutions/x.ipynb",
                                    "NEW"])
def test_writes_outside_the_sandbox_are_refused(pkg, target):
    if not sandbox.landlock_abi():
        pytest.skip("no Landlock on this machine")
    path = ROOT / target
    before = path.read_bytes() if path.exists() else None
    with sandbox.Worker(pkg, LIMITS) as w:
        head = define(w, f"open({str(path)!r}, 'a').write('x')\ndef f():\n    return 1")
    assert head["error"]["type"] == "PermissionError"
    assert (path.read_bytes() if path.exists() else None) == before


def test_reading_other_submissions_is_refused(pkg, tmp_path):
    if not sandbox.landlock_abi():
        pytest.skip("no Landlock on this machine")
    other = tmp_path / "classmate.ipynb"
    other.write_text("secret answers")
    with sandbox.Worker(pkg, LIMITS) as w:
        head = define(w, f"s = open({str(other)!r}).read()\ndef f():\n    return 1")
    assert head["error"]["type"] == "PermissionError"


def _alive(marker: str) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker in Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace"):
                    out.append(int(entry))
            except OSError:
                pass
    return out


# fork=False: a fresh `python -I` per worker, what a machine without the zygote gets
@pytest.mark.parametrize("fork", [True, False], ids=["forked", "exec"])
def test_processes_it_starts_die_with_it_even_setsid(pkg, fork):
    if not sandbox.userns_available():
        pytest.skip("no PID namespace here (unprivileged user namespaces unavailable): a "
                    "setsid'd grandchild leaves the worker's process group, and only the "
                    "namespace's end reaches it")
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc to look for the survivors in")
    src = ("import subprocess\n"
           "for _ in range(5):\n"
           "    subprocess.Popen(['sleep', '987651'], start_new_session=True)\n"
           "subprocess.Popen(['sh', '-c', 'setsid sleep 987651 & exit 0'])\n"
           "def f():\n    return 1\n")
    with sandbox.Worker(pkg, LIMITS, fork=fork) as w:
        assert define(w, src)["ok"]
        time.sleep(0.5)
    for _ in range(50):
        if not _alive("987651"):
            break
        time.sleep(0.1)
    assert _alive("987651") == []


def _signal_scoped() -> bool:
    return sandbox.userns_available() or sandbox.landlock_abi() >= 6


NO_SIGNAL_SCOPE = ("neither a PID namespace nor Landlock signal scoping on this machine: the "
                   "worker's signal would reach the test run itself")


def test_it_cannot_signal_the_grader(pkg):
    if not _signal_scoped():
        pytest.skip(NO_SIGNAL_SCOPE)
    canary = subprocess.Popen(["sleep", "987652"])  # the grader's user, outside the sandbox
    try:
        src = (f"import os, signal\nos.kill({canary.pid}, signal.SIGSTOP)\n"
               "def f():\n    return 1")
        with sandbox.Worker(pkg, LIMITS) as w:
            head = define(w, src)
        # refused (Landlock scope) or no such pid in its namespace: the cell fails to load
        assert head["error"]["type"] in ("PermissionError", "ProcessLookupError"), head
        pid, status = os.waitpid(canary.pid, os.WNOHANG | os.WUNTRACED)
        assert pid == 0, f"the canary was stopped or died (status {status})"
    finally:
        canary.kill()
        canary.wait()


@pytest.mark.parametrize("body, why, fork", [
    ("while True:\n        pass", "limit", True),
    ("import os\n    os._exit(3)", "exited with code 3", True),
    ("import os\n    os._exit(3)", "exited with code 3", False),
    ("import os, signal\n    os.kill(os.getpid(), signal.SIGSEGV)", "SIGSEGV", True),
    ("import os, signal\n    os.kill(os.getpid(), signal.SIGSEGV)", "SIGSEGV", False),
    ("print('x' * 10_000_000)", "output limit", True),
    ("import sys\n    sys.stdout.write('y' * 200_000); sys.stdout.flush()", "output limit", True),
])
def test_a_crash_or_a_hang_is_a_reason_not_a_crash(pkg, body, why, fork):
    limits = sandbox.Limits(call_s=5, submission_s=30, memory_mb=3072, output_bytes=1 << 16)
    with sandbox.Worker(pkg, limits, fork=fork) as w:
        define(w, f"def f():\n    {body}\n")
        with pytest.raises(sandbox.SandboxError, match=why):
            sandbox.RemoteFunction(w, "f")()


def test_memory_is_limited(pkg):
    with sandbox.Worker(pkg, LIMITS) as w:
        define(w, "def f():\n    return torch.ones(2_000_000_000).sum()")
        with pytest.raises((MemoryError, RuntimeError, sandbox.SandboxError)):
            sandbox.RemoteFunction(w, "f")()


def test_a_huge_or_strange_return_value_stays_data(pkg):
    with sandbox.Worker(pkg, LIMITS) as w:
        define(w, "class Evil:\n    def __repr__(self):\n        return 'evil'\n"
                  "def f():\n    return Evil(), lambda: 1, 10**100")
        got = sandbox.RemoteFunction(w, "f")()
        assert isinstance(got[0], sandbox.Opaque) and got[0].text == "evil"
        assert isinstance(got[1], sandbox.Opaque)
        assert got[2] == 10**100


def _has_zygote() -> bool:
    return sandbox._zygote(LIMITS.startup_s) is not None


WHERE_AM_I = """import os, resource, socket, sys, tempfile
def _is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False
SEEN = {"pid": os.getpid(), "parent": os.getppid(), "uid": os.getuid(), "cwd": os.getcwd(),
        "tmp": tempfile.gettempdir(), "home": os.environ.get("HOME"), "env": sorted(os.environ),
        "fds": [fd for fd in range(1024) if _is_open(fd)],
        "networks": [name for _, name in socket.if_nameindex()],
        "memory": resource.getrlimit(resource.RLIMIT_AS)[0],
        "grpo_lab": sorted(m for m in sys.modules if m.split(".")[0] == "grpo_lab")}
def f():
    return SEEN
"""


_WHERE = {}  # fork -> (what the worker saw, whether it was forked, its home): one worker each


def where_am_i(pkg, fork: bool) -> tuple[dict, bool, str]:
    if fork not in _WHERE:
        with sandbox.Worker(pkg, LIMITS, fork=fork) as w:
            assert define(w, WHERE_AM_I, prelude="")["ok"]
            _WHERE[fork] = (sandbox.RemoteFunction(w, "f")(),
                            isinstance(w.proc, sandbox._Forked), str(w.folder / "work"))
    return _WHERE[fork]


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "exec"])
def test_a_worker_starts_clean(pkg, fork):
    seen, forked, home = where_am_i(pkg, fork)
    # forked where the machine has the zygote (Linux with user namespaces), else exec'd
    assert forked == (fork and _has_zygote())
    # forked or exec'd: the same process in the same sandbox
    assert seen["cwd"] == seen["tmp"] == seen["home"] == home
    # (the exec'd worker's sh adds PWD, its folder; where sh is bash, SHLVL and _ too)
    added_by_sh = set() if forked else {"PWD", "SHLVL", "_"}
    assert set(seen["env"]) - added_by_sh == {*sandbox.WORKER_ENV, "HOME", "TMPDIR"}
    assert seen["memory"] == LIMITS.memory_mb << 20
    assert seen["grpo_lab"] == []  # nothing of the grader's package before the cell imports it
    assert len(seen["fds"]) == 5, seen["fds"]  # stdin, the output file twice, its two pipes


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "exec"])
def test_a_worker_has_its_own_user_pid_and_network_namespaces(pkg, fork):
    if not sandbox.userns_available():
        pytest.skip("no unprivileged user namespaces on this machine (`unshare -U -r -p -n` "
                    "fails): the worker runs in the grader's namespaces")
    seen, _, _ = where_am_i(pkg, fork)
    # root of its own user namespace, second process of its own PID namespace, no network
    assert (seen["pid"], seen["parent"], seen["uid"]) == (2, 1, 0), seen
    assert seen["networks"] == ["lo"]


def test_a_worker_that_kills_every_process_it_can_hurts_only_itself(pkg):
    if not _signal_scoped():
        pytest.skip(NO_SIGNAL_SCOPE)
    canary = subprocess.Popen(["sleep", "987653"])  # the grader's user, outside the sandbox
    try:
        with sandbox.Worker(pkg, LIMITS) as w:
            src = ("import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\n"
                   "except OSError:\n    pass\ndef f():\n    return 1\n")
            define(w, src)
        assert canary.poll() is None
        assert sandbox._ZYGOTE is None or sandbox._ZYGOTE.alive()
        with sandbox.Worker(pkg, LIMITS) as w:  # the next submission is graded as usual
            assert define(w, "def f():\n    return 2")["ok"]
            assert sandbox.RemoteFunction(w, "f")() == 2
    finally:
        canary.kill()
        canary.wait()


def test_workers_end_with_their_zygote_and_a_new_zygote_takes_over(pkg, monkeypatch):
    if not _has_zygote():
        pytest.skip("no zygote on this machine (not Linux, or no user namespaces)")
    with sandbox.Worker(pkg, LIMITS) as w:
        assert define(w, "import subprocess\nsubprocess.Popen(['sleep', '987654'], "
                         "start_new_session=True)\ndef f():\n    return 1\n")["ok"]
        zygote = sandbox._ZYGOTE
        # what the kernel does to the grader's end when the grader dies, however it dies
        zygote.sock.close()
        zygote.proc.wait(timeout=30)
        for _ in range(100):
            if not _alive("987654") and not os.path.exists(f"/proc/{w.proc.pid}/stat"):
                break
            time.sleep(0.1)
        assert _alive("987654") == []
        # C was reaped by init: its pid may be another process's by now, so closing the
        # worker must not signal that pid (it kills through C's pidfd, which is stale)
        sent = []
        with monkeypatch.context() as patched:
            patched.setattr(os, "kill", lambda pid, sig: sent.append(("kill", pid, sig)))
            patched.setattr(os, "killpg", lambda pid, sig: sent.append(("killpg", pid, sig)))
            w.close()
        assert sent == []
    with sandbox.Worker(pkg, LIMITS) as w:
        assert define(w, "def f():\n    return 3")["ok"]
        assert sandbox.RemoteFunction(w, "f")() == 3
        assert sandbox._ZYGOTE is not zygote and sandbox._ZYGOTE.alive()


@pytest.mark.parametrize("kill_at", [1, 3], ids=["before-a-cell", "mid-checker"])
def test_a_zygote_lost_mid_grading_costs_the_student_nothing(pkg, monkeypatch, kill_at):
    """The zygote killed (by the machine: no worker can reach it) before the first worker
    starts (a new zygote starts it) or in the middle of a checker's calls (the exercise is
    graded again on a fresh worker): either way the student loses nothing."""
    from grpo_lab.course import grade, labs

    if not _has_zygote():
        pytest.skip("no zygote on this machine (not Linux, or no user namespaces)")
    requests = []
    request = sandbox.Worker.request

    def request_then_maybe_kill(self, message):
        requests.append(message[0])
        if len(requests) == kill_at and isinstance(self.proc, sandbox._Forked | None):
            zygote = sandbox._zygote(LIMITS.startup_s)
            zygote.proc.kill()
            zygote.proc.wait()
        return request(self, message)

    monkeypatch.setattr(sandbox.Worker, "request", request_then_maybe_kill)
    path = ROOT / "solutions" / "02_rewards_and_advantages.ipynb"
    records = grade.grade_submission(path, "alice", labs.load_manifest(), pkg, LIMITS)
    assert len(requests) > kill_at
    assert records and all(r.status == "passed" and r.points == r.max_points for r in records), \
        [(r.exercise, r.status, r.reason) for r in records]


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "exec"])
def test_sigint_is_a_keyboardinterrupt_in_the_students_code(pkg, fork):
    """As in any fresh Python: the worker forked by the zygote restores Python's handler."""
    with sandbox.Worker(pkg, LIMITS, fork=fork) as w:
        define(w, "import os, signal\ndef f():\n    os.kill(os.getpid(), signal.SIGINT)\n"
                  "    return 1\n")
        with pytest.raises(sandbox.RemoteError) as got:
            sandbox.RemoteFunction(w, "f")()
    assert got.value.type_name == "KeyboardInterrupt"
