"""Hostile submissions: every cheat, sabotage, crash and checker gap we know of, graded by
the real grader against the shipped manifest, each with the grade and the reason it gets.

Each submission is notebook 03's solution with some exercise cells replaced (three
exercises per submission, one sandboxed worker each), so a case costs a fraction of a
worker start. `python tests/test_hostile_submissions.py` prints the table.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import nbformat
import pytest

from grpo_lab.course import grade, labs, sandbox

ROOT = Path(__file__).resolve().parents[1]
NB03 = "03_the_grpo_objective.ipynb"
LIMITS = sandbox.Limits(call_s=10, submission_s=120, memory_mb=3072, output_bytes=1 << 16)

K3 = "def kl_k3(logp, ref_logp):\n    r = ref_logp - logp\n    return r.exp() - r - 1\n"
SIG_CS = ("def clipped_surrogate(logp, old_logp, advantages, epsilon_low=0.2, epsilon_high=0.2,"
          " log_ratio_clamp=None):\n")
CS_NO_CLAMP = SIG_CS + (
    "    ratio = torch.exp(logp - old_logp)\n    adv = advantages.unsqueeze(-1)\n"
    "    c = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)\n"
    "    return -torch.min(ratio * adv, c * adv), ((ratio < 1 - epsilon_low) & (adv < 0)) | "
    "((ratio > 1 + epsilon_high) & (adv > 0))\n")
TW = ("def token_weights(mask, loss_type, cap):\n    m = mask.float()\n    n = m.shape[0]\n"
      "    if loss_type == 'grpo':\n        return m / m.sum(-1, keepdim=True).clamp(min=1) / n\n"
      "    if loss_type in ('bnpo', 'dapo'):\n        return m / m.sum().clamp(min=1)\n"
      "    if loss_type == 'dr_grpo':\n        return m / (n * cap)\n"
      "    raise ValueError(loss_type)\n")

# (class, what the submission does, exercise, cell source or None to delete it,
#  expected status, a phrase the reason must contain)
CASES = [
    # --- cheats ------------------------------------------------------------------------
    ("cheat", "imports the reference under another name", "kl_k3",
     "from grpo_lab.objective import kl_k3 as _k\ndef kl_k3(logp, ref_logp):\n"
     "    return _k(logp, ref_logp)\n", "flagged", "imports the reference"),
    ("cheat", "calls the reference through its module", "clipped_surrogate",
     "import grpo_lab.objective as o\ndef clipped_surrogate(*a, **k):\n"
     "    return o.clipped_surrogate(*a, **k)\n", "flagged", "which this exercise does not list"),
    ("cheat", "reaches the reference with importlib", "token_weights",
     "import importlib\ndef token_weights(*a):\n"
     "    return importlib.import_module('grpo_lab.objective').token_weights(*a)\n",
     "flagged", "importlib"),
    ("cheat", "getattr with a computed name", "kl_k3",
     "import torch\ndef kl_k3(logp, ref_logp):\n"
     "    return getattr(torch, 'ex' + 'p')(ref_logp - logp) - (ref_logp - logp) - 1\n",
     "flagged", "computed name"),
    ("cheat", "patches the checker module", "clipped_surrogate",
     "import grpo_lab.course.exercises.nb03 as c\nc.check_clipped_surrogate = lambda f: None\n"
     + SIG_CS + "    raise NotImplementedError\n", "flagged", "grpo_lab.course.exercises.nb03"),
    ("cheat", "eval of a string", "token_weights",
     "def token_weights(*a):\n    return eval('1')\n", "flagged", "`eval`"),
    ("cheat", "writes a fake verdict into the grader's journal", "kl_k3",
     "import torch\ntorch.save({'points': 1}, '/tmp/grades.journal.jsonl')\n" + K3,
     "failed", "may only write in its own temporary folder"),
    ("cheat", "reaches the reference past the static check and calls it in a thread", "kl_k3",
     "import operator\n_h = lambda: 0\n_b = operator.attrgetter('__globals__')(_h)['__builtins__']\n"
     "_imp = _b['__import__'] if isinstance(_b, dict) else operator.attrgetter('__import__')(_b)\n"
     "_ref = operator.attrgetter('kl_k3')(_imp('grpo_lab.objective', fromlist=['x']))\n"
     "_thr = _imp('threading')\n"
     "def kl_k3(logp, ref_logp):\n    box = []\n"
     "    t = _thr.Thread(target=lambda: box.append(_ref(logp, ref_logp)))\n"
     "    t.start()\n    t.join()\n    return box[0]\n", "flagged", "uses `attrgetter`"),
    ("cheat", "switches the grader's call monitor off, then calls the reference",
     "clipped_surrogate",
     "g = getattr\n_h = lambda: 0\n_b = g(_h, '__glo' + 'bals__')['__buil' + 'tins__']\n"
     "_imp = _b['__import__'] if isinstance(_b, dict) else g(_b, '__import__')\n"
     "_sys = _imp('s' + 'ys')\n"
     "_ref = g(_imp('grpo_lab.objective', fromlist=['x']), 'clipped' + '_surrogate')\n"
     + SIG_CS + "    g(_sys, 'setpro' + 'file')(None)\n"
     "    return _ref(logp, old_logp, advantages, epsilon_low, epsilon_high, log_ratio_clamp)\n",
     "flagged", "takes getattr under another name"),
    ("cheat", "calls the engine's own step through an allowed object", "token_weights",
     "import grpo_lab.step as engine\ndef token_weights(*a):\n    return engine.token_weights(*a)\n",
     "flagged", "which this exercise does not list"),
    ("cheat", "disarms the grader's call monitor it found through torch.sys", "kl_k3",
     "import torch\ndef kl_k3(logp, ref_logp):\n    torch.sys.getprofile().forbidden = ()\n"
     "    r = ref_logp - logp\n    return r.exp() - r - 1\n", "flagged", "uses `getprofile`"),
    # --- sabotage ----------------------------------------------------------------------
    ("sabotage", "changes its input in place", "kl_k3",
     "def kl_k3(logp, ref_logp):\n    ref_logp -= logp\n"
     "    return ref_logp.exp() - ref_logp - 1\n", "failed", "in place"),
    ("sabotage", "endless loop", "clipped_surrogate",
     SIG_CS + "    while True:\n        pass\n", "failed", "did not finish within"),
    ("sabotage", "writes into the package", "token_weights",
     f"import torch\ntorch.save(1, {str(ROOT / 'grpo_lab' / 'PWNED')!r})\n" + TW,
     "failed", "Permission denied"),
    ("sabotage", "floods the output", "kl_k3",
     "def kl_k3(logp, ref_logp):\n    print('x' * 10_000_000)\n", "failed", "output limit"),
    ("sabotage", "allocates 8 GB", "clipped_surrogate",
     SIG_CS + "    return torch.ones(2_000_000_000).sum()\n", "failed", "your function"),
    ("sabotage", "returns 2.5 million Python objects (the grader parsed them in its memory)",
     "kl_k3", "def kl_k3(logp, ref_logp):\n    e = []\n    return [e] * 2_500_000\n",
     "failed", "of Python values"),
    ("sabotage", "raises SystemExit", "token_weights",
     "def token_weights(*a):\n    raise SystemExit(0)\n", "failed", "raised SystemExit"),
    # --- crashes -----------------------------------------------------------------------
    ("crash", "a syntax error in the cell", "kl_k3",
     "def kl_k3(logp, ref_logp)\n    return logp\n", "failed", "SyntaxError"),
    ("crash", "the exercise cell deleted", "clipped_surrogate", None, "missing",
     "no cell defines clipped_surrogate()"),
    ("crash", "kills its own process (os._exit)", "token_weights",
     "import os\ndef token_weights(*a):\n    os._exit(3)\n", "flagged", "`os`"),
    ("crash", "returns something that is no tensor", "kl_k3",
     "def kl_k3(logp, ref_logp):\n    return lambda: 0\n", "failed", "expected a tensor"),
    # --- checker gaps (each once let a wrong function pass) ----------------------------
    ("checker gap", "k3 computed on detached inputs (no gradient)", "kl_k3",
     "def kl_k3(logp, ref_logp):\n    r = (ref_logp - logp).detach()\n"
     "    return r.exp() - r - 1\n", "failed", "carries no gradient"),
    ("checker gap", "log_ratio_clamp ignored", "clipped_surrogate", CS_NO_CLAMP, "failed",
     "log_ratio_clamp=2.0 changed nothing"),
    ("checker gap", "dr_grpo normalised by the tensor's width, not the completion cap",
     "token_weights", TW.replace("m / (n * cap)", "m / (n * m.shape[1])"), "failed",
     "divided by the tensor's width"),
    ("control", "a correct function written by hand", "kl_k3", K3, "passed", ""),
    ("checker gap", "clip_ratio * advantage (report 001)", "clipped_surrogate",
     SIG_CS + "    ratio = torch.exp(logp - old_logp)\n    adv = advantages.unsqueeze(-1)\n"
     "    return -torch.min(ratio * adv, epsilon_low * adv), (ratio > epsilon_low) & (adv > 0)\n",
     "failed", "report 001's `clip_ratio * advantage`"),
    ("checker gap", "an unknown loss_type silently accepted", "token_weights",
     TW.replace("    raise ValueError(loss_type)\n", "    return m / m.sum().clamp(min=1)\n"),
     "failed", "raise ValueError for a loss_type you do not know"),
]


# stopped by Landlock alone: without it a worker may write wherever its user may (these are
# then not submitted at all, so nothing lands in the checkout or /tmp)
NEEDS_LANDLOCK = {"writes a fake verdict into the grader's journal", "writes into the package"}
NO_LANDLOCK = "no Landlock on this machine: only Landlock keeps a worker's writes in its folder"


def submitted(case) -> bool:
    return case[1] not in NEEDS_LANDLOCK or sandbox.landlock_abi() > 0


def submissions() -> list[dict[str, tuple]]:
    """CASES packed into submissions, one case per exercise each."""
    out: list[dict[str, tuple]] = []
    for case in filter(submitted, CASES):
        exercise = case[2]
        slot = next((s for s in out if exercise not in s), None)
        if slot is None:
            slot = {}
            out.append(slot)
        slot[exercise] = case
    return out


def write_submission(folder: Path, replacements: dict[str, str | None]) -> Path:
    manifest = labs.load_manifest()["notebooks"][NB03]["exercises"]
    ids = {e["function"]: e["cell_id"] for e in manifest}
    nb = nbformat.read(ROOT / "solutions" / NB03, as_version=4)
    nb = copy.deepcopy(nb)
    cells = []
    for cell in nb.cells:
        fn = next((f for f, cid in ids.items() if cell.get("id") == cid), None)
        if fn in replacements:
            if replacements[fn] is None:
                continue
            cell.source = replacements[fn]
        cells.append(cell)
    nb.cells = cells
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, folder / NB03)
    return folder / NB03


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    pkg = sandbox.package_copy(tmp / "pkg")
    manifest = labs.load_manifest()
    results = {}
    for n, sub in enumerate(submissions()):
        path = write_submission(tmp / f"s{n:02d}", {ex: c[3] for ex, c in sub.items()})
        for r in grade.grade_submission(path, f"s{n:02d}", manifest, pkg, LIMITS):
            if r.exercise in sub:
                results[id(sub[r.exercise])] = r
    return results


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}: {c[1]}" for c in CASES])
def test_each_hostile_submission_gets_its_grade_and_reason(graded, case):
    kind, what, exercise, _, status, phrase = case
    if not submitted(case):
        pytest.skip(NO_LANDLOCK)
    r = graded[id(case)]
    assert (r.status, r.points) == (status, r.max_points if status == "passed" else 0), r
    assert phrase in r.reason, r.reason


def test_nothing_was_written_outside_the_sandbox(graded):
    if not sandbox.landlock_abi():
        pytest.skip(NO_LANDLOCK)
    assert not (ROOT / "grpo_lab" / "PWNED").exists()


if __name__ == "__main__":  # the table for the README / a report
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        pkg = sandbox.package_copy(Path(tmp) / "pkg")
        manifest = labs.load_manifest()
        print("| class | submission | grade | reason |\n|---|---|---|---|")
        for n, sub in enumerate(submissions()):
            path = write_submission(Path(tmp) / f"s{n:02d}", {e: c[3] for e, c in sub.items()})
            for r in grade.grade_submission(path, f"s{n:02d}", manifest, pkg, LIMITS):
                c = sub.get(r.exercise)
                if c:
                    reason = r.reason.replace("|", "\\|").replace("\n", " ")
                    print(f"| {c[0]} | {r.exercise}: {c[1]} | {r.points}/{r.max_points} "
                          f"{r.status} | {reason} |")
        sys.stdout.flush()
