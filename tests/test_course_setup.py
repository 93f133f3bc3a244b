"""`./course setup` when it cannot finish: one line with the fix, nothing half-installed kept.

Each case runs a copy of `course` in a temporary directory (never the real .venv) with the
failure made cheaply: interpreters that are too old, a Python without its venv module, a
package index that refuses connections.
"""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BASE_PYTHON = Path(getattr(sys, "_base_executable", sys.executable))


@pytest.fixture
def copy(tmp_path):
    for name in ("course", "pyproject.toml"):
        shutil.copy2(ROOT / name, tmp_path / name)
    return tmp_path


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens on it once closed


def run_setup(copy: Path, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    # no pip.conf, no local wheels: only the index given here
    base.update(PIP_CONFIG_FILE=os.devnull, **env)
    result = subprocess.run(
        [str(copy / "course"), "setup"], cwd=copy, env=base, capture_output=True, text=True,
        timeout=300,
    )
    print(result.stderr)
    return result


def last_line(result) -> str:
    return result.stderr.strip().splitlines()[-1]


def test_no_python_311_says_so(copy, tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for name in ("python3.13", "python3.12", "python3.11", "python3"):
        (fake_bin / name).write_text("#!/bin/sh\nexit 1\n")  # as a Python 3.9 answers the check
        (fake_bin / name).chmod(0o755)
    result = run_setup(copy, PATH=f"{fake_bin}:{os.environ['PATH']}")
    assert result.returncode == 1
    assert last_line(result).startswith("[course] error: no Python >= 3.11 found: install one")
    assert not (copy / ".venv").exists()


def test_python_without_venv_module_says_apt_install(copy, tmp_path):
    shadow = tmp_path / "shadow"
    (shadow / "ensurepip").mkdir(parents=True)  # as on Debian without python3-venv
    (shadow / "ensurepip" / "__init__.py").write_text("raise ImportError('no ensurepip')\n")
    python = tmp_path / "python3"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={shadow} exec {BASE_PYTHON} "$@"\n')
    python.chmod(0o755)
    result = run_setup(copy, PYTHON=str(python))
    assert result.returncode == 1
    assert "has no venv module: on Debian/Ubuntu apt install python3-venv" in last_line(result)
    assert not (copy / ".venv").exists()


def test_no_network_to_the_index_leaves_nothing_and_the_next_run_starts_afresh(copy):
    index = f"http://127.0.0.1:{closed_port()}/simple"
    env = {"PYTHON": str(BASE_PYTHON), "PIP_INDEX_URL": index}
    # a .venv left without pip (an older setup interrupted, or a failed venv creation)
    subprocess.run([BASE_PYTHON, "-m", "venv", "--without-pip", copy / ".venv"], check=True)

    first = run_setup(copy, **env)
    assert first.returncode == 1
    assert "removing an unfinished .venv" in first.stderr
    assert last_line(first).startswith("[course] error: no network to the package index: check")
    assert not (copy / ".venv").exists()

    second = run_setup(copy, **env)
    assert "removing an unfinished" not in second.stderr
    assert "1/3 creating .venv" in second.stderr
    assert last_line(second) == last_line(first)
    assert not (copy / ".venv").exists()
