"""CPU seconds a notebook kernel spends to start and run a notebook's setup cell: started
as nbval starts it (`python -m ipykernel_launcher`), and forked from the test suite's warm
server (tests/warm_kernels.py, as the root conftest.py uses it on Linux).

    python benchmarks/kernel_start.py [NOTEBOOK ...] [--repeat 3]

For each notebook (default: every solution), a kernel is started each way in the
notebook's folder, runs the notebook's first code cell, and reports its own user + system
CPU seconds (/proc/<pid>/stat; a forked kernel's count starts at the fork). The median over
`--repeat` kernels is printed, and once the server's own CPU for its imports. Figures are
printed, not asserted. Run it on an idle machine; Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from jupyter_client.manager import KernelManager

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import warm_kernels  # noqa: E402 - tests/warm_kernels.py, the suite's server and client

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def kernel_cpu(name: str, notebook: Path) -> float:
    """Start the kernel `name`, run the notebook's first code cell, return its CPU."""
    cells = json.loads(notebook.read_text())["cells"]
    setup = "".join(next(c for c in cells if c["cell_type"] == "code")["source"])
    km = KernelManager(kernel_name=name)
    km.start_kernel(cwd=str(notebook.parent))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        reply = kc.execute_interactive(setup, timeout=300, output_hook=lambda msg: None)
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"{notebook.name}: the setup cell failed")
        pid = []
        kc.execute_interactive("import os; print(os.getpid())", timeout=60, output_hook=lambda m:
                               pid.append(m["content"]["text"]) if m["msg_type"] == "stream"
                               else None)
        return cpu_seconds(int("".join(pid)))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    notebooks = args.notebooks or sorted((ROOT / "solutions").glob("*.ipynb"))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        warm_kernels.write_kernelspec(tmp, "plain", [sys.executable, "-m", "ipykernel_launcher",
                                                     "-f", "{connection_file}"])
        warm_kernels.write_kernelspec(tmp, "warm", warm_kernels.CLIENT_ARGV)
        os.environ["JUPYTER_PATH"] = str(tmp)
        socket_path = str(tmp / "k.sock")
        server, ready = warm_kernels.start_server(socket_path)
        if not ready:
            server.kill()
            sys.exit("the warm server did not start")
        print(f"warm server: {cpu_seconds(server.pid):.2f} s of CPU for its imports, once")
        os.environ[warm_kernels.SOCKET_ENV] = socket_path
        print(f"{'notebook':<46} {'plain':>6} {'warm':>6}  (kernel CPU s, median of "
              f"{args.repeat})")
        totals = {"plain": 0.0, "warm": 0.0}
        try:
            for nb in notebooks:
                row = {}
                for name in ("plain", "warm"):
                    row[name] = statistics.median(
                        kernel_cpu(name, nb.resolve()) for _ in range(args.repeat))
                    totals[name] += row[name]
                print(f"{nb.name:<46} {row['plain']:6.2f} {row['warm']:6.2f}")
        finally:
            server.kill()
            server.wait()
        print(f"{'all':<46} {totals['plain']:6.2f} {totals['warm']:6.2f}")


if __name__ == "__main__":
    main()
