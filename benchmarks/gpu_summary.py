"""The one summary of benchmarks/gpu_checks.sh's outputs: OUT/summary.json.

    python benchmarks/gpu_summary.py OUT --commit SHA --seconds S --notebook-seconds N

card, date, commit; the notebooks passed and total (a notebook passes when every one of its
code cells passed under nbval; one the deadline cut short is listed as not finished); the
seconds of the whole run and of the notebooks; the bench per side (s/step, completion
tokens/s, MFU against the card's peak), the step-time ratio grpo_lab/TRL and whether the
bench ran with CUDA graphs; the step's profile per phase; the graphs' check per amp
(benchmarks/decode_graphs.py: the sampler, the reference's forward, the training pass); the
exit code of each other command. Prints the summary too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat


def notebook_results(junit: Path, expected: list[str]) -> dict:
    """Per notebook: passed when every code cell of the file passed in the junit report;
    `expected` (the notebooks the run was given) counts those that never started, or all of
    them when the report is missing, as not finished."""
    cases: dict[str, list[str]] = {}
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            path = case.get("file") or case.get("classname", "").replace(".", "/")
            if not path:  # a nameless, empty case (seen in pytest-xdist's report): no notebook
                continue
            path = re.sub(r"/ipynb$", ".ipynb", path)
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome = "failed"
                elif child.tag == "skipped":
                    outcome = "skipped"
            cases.setdefault(path, []).append(outcome)
    passed, failed, unfinished = [], [], sorted(set(expected) - set(cases))
    for path, outcomes in sorted(cases.items()):
        cells = sum(c.cell_type == "code" for c in nbformat.read(path, as_version=4).cells) \
            if Path(path).exists() else len(outcomes)
        if "failed" in outcomes:
            failed.append(path)
        elif len(outcomes) < cells or "skipped" in outcomes:
            unfinished.append(path)
        else:
            passed.append(path)
    return {"passed": len(passed), "total": len(set(expected) | set(cases)), "failed": failed,
            "not_finished": sorted(unfinished)}


def exit_codes(out: Path) -> dict[str, int | None]:
    """Each saved command's exit code, from its '(exit N, S s)' last line."""
    codes = {}
    for txt in sorted(out.glob("*.txt")):
        found = re.findall(r"^\(exit (\d+), \d+ s\)$", txt.read_text(), re.M)
        codes[txt.stem] = int(found[-1]) if found else None
    return codes


def card(out: Path) -> tuple[str, str]:
    """The card and torch of the run: from its environment.txt (so that a summary rebuilt
    elsewhere from the run's files names the run's machine), else this process's."""
    import platform

    env = out / "environment.txt"
    if env.exists():
        lines = env.read_text().splitlines()
        versions = next((ln.split() for ln in lines if ln.startswith("torch ")), None)
        if versions and len(lines) > 2 and lines[2] != "no CUDA device":
            return lines[2], versions[1]

    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(), torch.__version__
    return f"CPU ({platform.processor() or platform.machine()})", torch.__version__


def graph_switch(command_output: Path) -> bool | None:
    """Whether a command ran with the CUDA graphs on (the notebooks): its output's first line
    is the command, with GRPO_LAB_CUDA_GRAPHS=0 or 1 (None: not run, or not set)."""
    if not command_output.exists():
        return None
    switch = re.search(r"GRPO_LAB_CUDA_GRAPHS=(\d)", command_output.read_text().split("\n", 1)[0])
    return None if switch is None else switch.group(1) == "1"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--seconds", type=int, required=True)
    ap.add_argument("--notebook-seconds", type=int, required=True)
    ap.add_argument("--failed", type=int, default=0, help="commands failed before this one")
    ap.add_argument("--notebooks", nargs="*", default=[], help="the notebooks the run was given")
    args = ap.parse_args(argv)
    name, torch_version = card(args.out)
    bench = {}
    bench_file = args.out / "bench.json"
    if bench_file.exists():
        figures = json.loads(bench_file.read_text())["figures"]
        bench = {side: {k: figures[side][k] for k in ("s_per_step", "tokens_per_s", "mfu")}
                 for side in ("grpo_lab", "TRL")}
        bench |= {k: figures[k] for k in ("step_time_ratio", "accuracy_delta", "peak_tflops",
                                          "cuda_graphs") if k in figures}
    step_profile = {}  # where grpo_lab's step goes, per phase (benchmarks/step_profile.py)
    profile_file = args.out / "step_profile.json"
    if profile_file.exists():
        figures = json.loads(profile_file.read_text())
        step_profile = {"wall_ms": figures["wall_ms"], "phases": {
            phase: {k: round(row[k], 2) for k in ("host_ms", "device_ms", "launches", "syncs")}
            for phase, row in figures["phases"].items()}}
    decode_graphs = {}  # the graphs' check (decode step, reference's forward, training), per amp
    for path in sorted(args.out.glob("decode_graphs*.json")):
        figures = json.loads(path.read_text())
        decode_graphs[figures["amp"]] = figures
    notebooks = notebook_results(args.out / "notebooks.xml", args.notebooks)
    if (switch := graph_switch(args.out / "notebooks.txt")) is not None:
        notebooks["cuda_graphs"] = switch
    summary = {
        "card": name, "torch": torch_version,
        "date": datetime.date.today().isoformat(), "commit": args.commit,
        "notebooks": notebooks,
        "seconds": {"total": args.seconds, "notebooks": args.notebook_seconds},
        "bench": bench,
        "step_profile": step_profile,
        "decode_graphs": decode_graphs,
        "commands": {k: v for k, v in exit_codes(args.out).items() if k != "summary"},
        "commands_failed": args.failed,
    }
    text = json.dumps(summary, indent=1)
    (args.out / "summary.json").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
