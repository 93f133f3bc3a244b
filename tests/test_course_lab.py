"""The README's first command, `./course lab`, run as the README gives it (issue 17).

On a fresh copy of the checkout, as the current user (root in most containers), on a
headless machine with the default port taken and a user-level kernel that has the same
name as the notebooks' kernel: the server answers with its token, serves labs/, runs a
notebook's kernel on .venv's Python, and leaves nothing behind when stopped.
"""

import json
import os
import socket
from pathlib import Path

import pytest
from course_lab import LabServer, fresh_checkout

DEFAULT_PORT = 8888


@pytest.fixture
def hold_default_port():
    """Keep the default port busy (it may already be): ./course lab must pick another."""
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", DEFAULT_PORT))
        holder.listen()
    except OSError:
        pass  # busy already
    yield
    holder.close()


def user_kernel_named(name: str, home: Path) -> None:
    """A user-level kernelspec `name` that ./course lab must not use: it marks its kernels."""
    spec = home / ".local/share/jupyter/kernels" / name
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": ["python3", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "someone else's Python 3",
        "language": "python",
        "env": {"GRPO_LAB_WRONG_KERNEL": "1"},
    }))


CELL = """\
import os, sys
import grpo_lab
print(sys.executable)
print(os.getpid())
print(os.environ.get("GRPO_LAB_WRONG_KERNEL", "-"))
"""


def test_course_lab_as_the_readme_gives_it(tmp_path, hold_default_port):
    checkout = fresh_checkout(tmp_path / "grpo-lab")
    home = tmp_path / "home"
    first = checkout / "labs" / sorted(p.name for p in (checkout / "labs").glob("*.ipynb"))[0]
    kernel_name = json.loads(first.read_text())["metadata"]["kernelspec"]["name"]
    user_kernel_named(kernel_name, home)

    with LabServer(checkout, home) as lab:
        said = lab.output()
        assert lab.port != DEFAULT_PORT
        assert f"[course] port {DEFAULT_PORT} is busy: using port {lab.port}" in said
        assert f"ssh -L {lab.port}:localhost:{lab.port}" in said
        assert ("passing --allow-root" in said) == (os.geteuid() == 0)

        status, page = lab.get(f"/lab?token={lab.token}", token=False)
        assert status == 200 and "<title>JupyterLab</title>" in page
        with pytest.raises(Exception, match="403"):
            lab.get("/api/contents/", token=False)
        listing = lab.api("GET", "/api/contents/")
        served = {item["name"] for item in listing["content"]}
        assert served == {p.name for p in (checkout / "labs").iterdir()}

        kernel_id = lab.start_notebook_session(first.name)
        executable, pid, wrong = lab.execute(kernel_id, CELL).split()
        lab.kernel_pids.append(int(pid))
        print(f"kernel {pid}: sys.executable = {executable}")
        assert wrong == "-", "the notebook ran on the user-level kernel, not .venv's"
        assert Path(executable).parent.resolve() == (checkout / ".venv" / "bin").resolve()

        lab.stop()
        assert lab.leftovers() == []
