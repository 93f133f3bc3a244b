"""Classroom grading: `python -m grpo_lab grade SUBMISSION... [--json OUT] [--csv OUT]
[--feedback DIR] [--journal FILE] [--hints]`.

Nothing the student's notebook prints, writes or patches decides a grade:
- the exercises a notebook has come from the exercise manifest (grpo_lab/course/
  exercises.json, written from the solution notebooks by `python -m grpo_lab labs`): the
  cell id and function of each exercise, its checker, its reference, what it may use;
- a submission is matched to a course notebook by its content (the exercise functions and
  cell ids it holds), so a renamed file is still graded as what it is;
- only each exercise's own cell is taken from the submission (check cells are ignored:
  deleting, duplicating or editing them changes nothing); a missing exercise scores 0;
- the cell is read first (`integrity`): importing or calling the exercise's own reference
  scores 0 with the reason;
- the cell runs in a sandboxed worker (`sandbox`: its own temporary folder, process limits,
  namespaces and Landlock where available); the exercise's checker runs here in the grader,
  calling the student's function through a proxy: the inputs are the checker's, values and
  gradients come back as data and are compared with the reference here;
- results go to an append-only journal (JSON lines, fsync'd) written by the grader alone: a
  grader stopped mid-class and started again skips what is done and ends with the same
  grades; the JSON, the gradebook CSV and the feedback files are written from it at the end.

Notebook 13's diagnoses of mystery runs are scored against the set's key (`--mystery-key
FILE`, from `python -m grpo_lab mystery`; default: the course's own set, whose key is the
answers of solutions/13): read from the cell's literal arguments, nothing of them runs
(course/diagnose.py, score_run).

With `--hints` the gradebook also counts the hints a student opened (`hint("name")`, two
tiers per exercise; grpo_lab/course/hints.py), from the lines they left in the submission's
stored outputs: information for the instructor, never part of a grade.
"""

from __future__ import annotations

import ast
import contextlib
import csv
import hashlib
import io
import json
import os
import re
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import diagnose, integrity, predictions, sandbox
from .hints import opened_hints
from .labs import (
    diagnosis_key,
    find_checker,
    load_manifest,
    predict_calls,
    python_source,
)

MAX_NOTEBOOK_BYTES = 20 << 20
MAX_CODE_CHARS = 1 << 20  # a lab's code cells hold about 50 kB; the grader parses them all
MAX_REASON_CHARS = 600  # what a record keeps of a reason (a submission's text can be in it)
UNPARSEABLE = (SyntaxError, ValueError, MemoryError, RecursionError)  # what ast.parse raises


def clean_reason(text: str) -> str:
    """A reason as the gradebook, the journal and a terminal can hold it, whatever a
    submission put in it: lone surrogates escaped (UTF-8 cannot write them), control
    characters other than a newline or a tab shown as escapes (no terminal codes), at most
    MAX_REASON_CHARS characters."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    text = "".join(ch if ch.isprintable() or ch in "\n\t" else repr(ch)[1:-1] for ch in text)
    return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS - 15] + " ... (cut)"


JOURNAL_VERSION = 1


@dataclass
class Record:
    notebook: str  # the submission's path
    student: str
    exercise: str
    points: int
    max_points: int
    status: str  # passed | failed | not implemented | missing | flagged | not graded
    reason: str


class JournalError(Exception):
    """The journal cannot be read back (message: one line naming the file and line)."""


# --- reading a submission ---------------------------------------------------------------------
@dataclass
class Cell:
    index: int
    id: str | None
    source: str


def read_cells(raw: bytes) -> list[Cell]:
    nb = json.loads(raw.decode("utf-8"))
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise ValueError("not a notebook (no list of cells)")
    cells = []
    for i, c in enumerate(nb["cells"]):
        if not isinstance(c, dict) or c.get("cell_type") != "code":
            continue
        src = c.get("source", "")
        if isinstance(src, list):
            src = "".join(s for s in src if isinstance(s, str))
        if not isinstance(src, str):
            continue
        cid = c.get("id")
        cells.append(Cell(i, cid if isinstance(cid, str) else None, src))
    return cells


def defines(source: str) -> set[str]:
    try:
        tree = ast.parse(python_source(source))
    except UNPARSEABLE:
        return set(re.findall(r"^def\s+(\w+)\s*\(", source, re.M))
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def match_notebook(name: str, cells: list[Cell], manifest: dict) -> tuple[str | None, str]:
    """The course notebook a submission is, by content (exercise functions and cell ids);
    the file name only breaks ties. Returns (notebook name or None, note)."""
    defined = set().union(*(defines(c.source) for c in cells)) if cells else set()
    ids = {c.id for c in cells if c.id}
    scores = {}
    diagnosed = {run for c in cells for run, _ in predict_calls(c.source, "diagnose")}
    for nb, spec in manifest["notebooks"].items():
        exercises, diagnoses = spec["exercises"], spec.get("diagnoses", [])
        if not exercises and not diagnoses:
            continue
        score = sum(e["function"] in defined for e in exercises) + \
            sum(e["cell_id"] in ids for e in exercises) + \
            sum(d["run"] in diagnosed for d in diagnoses)
        scores[nb] = score
    best = max(scores.values(), default=0)
    if best == 0:
        spec = manifest["notebooks"].get(name)
        if spec and (spec["exercises"] or spec.get("diagnoses")):
            return name, ""
        return None, ("matches no course notebook: it defines none of their exercise "
                      "functions (graded 0; is it the right file?)")
    top = sorted(nb for nb, s in scores.items() if s == best)
    chosen = name if name in top else top[0]
    note = "" if chosen == name else f" (the file is named {name}; graded as {chosen} by " \
        "its content)"
    return chosen, note


def exercise_cell(cells: list[Cell], exercise: dict) -> Cell | None:
    """The student's cell for `exercise`: the cell with its id if that still defines the
    function, else the last cell that defines it."""
    fn = exercise["function"]
    for c in cells:
        if c.id == exercise["cell_id"] and fn in defines(c.source):
            return c
    candidates = [c for c in cells if fn in defines(c.source)]
    return candidates[-1] if candidates else None


def prelude(exercise: dict, source: str, forbidden: set[str], provided: bool = True) -> str:
    """The setup imports the student's cell refers to (from the solution notebook), never the
    exercise's own reference; with `provided`, the functions the cell may call that come
    from earlier exercises, bound to their references (each exercise is graded alone)."""
    try:
        used = {n.id for n in ast.walk(ast.parse(python_source(source)))
                if isinstance(n, ast.Name)}
    except UNPARSEABLE:
        used = set(re.findall(r"\w+", source))
    lines = []
    for stmt in exercise["setup"]:
        if set(stmt["binds"]) & used and not set(stmt["binds"]) & forbidden and not (
                set(stmt["names"]) & forbidden):
            lines.append(stmt["source"])
    for name, reference in (exercise.get("provided") or {}).items() if provided else ():
        module, ref_name = reference.rsplit(".", 1)
        if name in used and name not in forbidden and ref_name not in forbidden:
            lines.append(f"from {module} import {ref_name} as {name}")
    return "\n".join(lines) + "\n"


# --- grading one submission ------------------------------------------------------------------
def student_name(path: Path, all_paths: list[Path]) -> str:
    parents = {p.parent for p in all_paths}
    name = path.parent.name if len(parents) > 1 or len(all_paths) == 1 and \
        path.parent.name not in ("", ".") else path.stem
    return name.encode("utf-8", "backslashreplace").decode("utf-8")  # a file name's odd bytes


def grade_submission(path: Path, student: str, manifest: dict, pkg_root: Path,
                     limits: sandbox.Limits, raw: bytes | None = None,
                     mystery_key: dict | None = None) -> list[Record]:
    """The records of one submission. Whatever happens while grading it (a worker's answer
    forged into a shape the grader does not expect, a bug of the grader's) ends this
    submission with the reason, never the class's run."""
    try:
        return _grade_submission(path, student, manifest, pkg_root, limits, raw, mystery_key)
    except Exception as e:  # noqa: BLE001 - one submission must not stop the others
        print(f"[grade] {path}: not graded, {type(e).__name__}: {e}", file=sys.stderr)
        return refused(path, student, manifest["notebooks"].get(path.name),
                       f"the grader could not grade this submission ({type(e).__name__}: "
                       f"{str(e)[:200]}); the others were graded")


def refused(path: Path, student: str, spec: dict | None, why: str) -> list[Record]:
    """0 points and `why` for every item of `spec` (its exercises and diagnoses), or one
    '(none)' record where the file is no course notebook."""
    items = [(e["function"], e["points"]) for e in spec["exercises"]] + [
        (f"diagnose {d['run']}", d["points"]) for d in spec.get("diagnoses", [])] \
        if spec else [("(none)", 0)]
    return [Record(str(path), student, item, 0, pts, "not graded", clean_reason(why))
            for item, pts in items]


def _grade_submission(path: Path, student: str, manifest: dict, pkg_root: Path,
                      limits: sandbox.Limits, raw: bytes | None = None,
                      mystery_key: dict | None = None) -> list[Record]:
    def one(exercise: str, points: int, max_points: int, status: str, reason: str) -> Record:
        return Record(str(path), student, exercise, points, max_points, status,
                      clean_reason(reason))

    try:
        raw = raw if raw is not None else _read(path)
        cells = read_cells(raw)
    except Exception as e:  # noqa: BLE001 - any unreadable file is graded 0 with why
        return refused(path, student, manifest["notebooks"].get(path.name),
                       f"could not read the notebook: {type(e).__name__}: {str(e)[:160]}")
    named = manifest["notebooks"].get(path.name)
    code = sum(len(c.source) for c in cells)
    if code > MAX_CODE_CHARS:
        return refused(path, student, named,
                       f"its code cells hold {code:,} characters, more than the "
                       f"{MAX_CODE_CHARS:,} the grader reads (a lab's hold about 50,000)")
    nb_name, note = match_notebook(path.name, cells, manifest)
    if nb_name is None:
        return [one("(none)", 0, 0, "not graded", note)]
    if named and (named["exercises"] or named.get("diagnoses")) and nb_name != path.name:
        # named as one course notebook, holding another's lab: graded as what it is named,
        # so a finished easier lab cannot stand in for the assignment
        return refused(path, student, named,
                       f"the file is named {path.name} but holds the lab of {nb_name} (by "
                       f"its exercises): none of {path.name}'s is in it; submit your "
                       f"{path.name}")
    spec = manifest["notebooks"][nb_name]
    records: list[Record] = []
    if spec["exercises"]:
        worker = sandbox.Worker(pkg_root, limits)
        try:
            for ex in spec["exercises"]:
                record = _grade_exercise(worker, cells, ex, one, note)
                if worker.lost_zygote:  # the grader's failure, not the student's: once more
                    worker.restart()
                    record = _grade_exercise(worker, cells, ex, one, note)
                records.append(record)
        finally:
            worker.close()
    records += [_grade_prediction(cells, pred, one) for pred in spec.get("predictions", [])]
    records += [_grade_diagnosis(cells, d, mystery_key, one) for d in spec.get("diagnoses", [])]
    return records


def _grade_diagnosis(cells: list[Cell], spec: dict, key: dict | None, one) -> Record:
    """One mystery run's diagnosis against the key (diagnose.score_run), read from the cell's
    literal arguments: nothing runs."""
    run, pts = spec["run"], spec["points"]
    name = f"diagnose {run}"
    if key is None or run not in key:
        return one(name, 0, pts, "not graded", f"no key for run {run}: pass --mystery-key "
                   "(the key.json of the set the class was given)")
    answers = [v for c in cells for r, v in predict_calls(c.source, "diagnose") if r == run]
    if not answers:
        return one(name, 0, pts, "missing", f"no cell calls diagnose({run!r}) (deleted?)")
    values = answers[-1]  # the last one written counts, as in the notebook
    problem = diagnose.form_problem(run, values.get("cause"), values.get("fix"),
                                    values.get("evidence"))
    if problem and problem.startswith("no diagnosis"):
        return one(name, 0, pts, "not implemented", problem)
    points, why = diagnose.score_run(values, key[run])
    if problem:
        why += f" ({problem})"
    return one(name, points, pts, "passed" if points == pts else "failed", why)


COURSE_KEY_NOTEBOOK = "13_diagnose_the_run.ipynb"


def load_mystery_key(path: str | None) -> dict | None:
    """{run: {cause, fix}} of the mystery set being graded: `path` (a key.json written by
    `python -m grpo_lab mystery`), else the answers of solutions/13 in the course checkout
    this package runs from, else None (diagnoses are then not graded, with the reason)."""
    if path:
        data = json.loads(Path(path).read_text())
        runs = data.get("runs", data) if isinstance(data, dict) else None
        if not isinstance(runs, dict) or not all(
                isinstance(v, dict) and {"cause", "fix"} <= set(v) for v in runs.values()):
            raise ValueError(f"{path}: not a mystery key (expected {{'runs': {{name: "
                             "{'cause': ..., 'fix': ...}}}}, as `python -m grpo_lab mystery` "
                             "writes it)")
        return with_citable(runs, Path(path).parent / "runs")  # mystery --out DIR writes both
    # the checkout this package runs from, never the current directory (which a class's
    # unpacked submissions could hold a solutions/ of their own in)
    solution = Path(__file__).resolve().parents[2] / "solutions" / COURSE_KEY_NOTEBOOK
    if not solution.exists():
        return None
    return with_citable(diagnosis_key(solution), diagnose.SHIPPED_RUNS)


def with_citable(key: dict, runs_folder: Path) -> dict:
    """The key with each run's citable data (diagnose.citable), where the runs are in
    `runs_folder`; without them evidence is checked for its form only."""
    try:
        runs = diagnose.load_runs(runs_folder)
    except FileNotFoundError:
        return key
    return {name: {**truth, **({"citable": diagnose.citable(runs[name])} if name in runs
                              else {})} for name, truth in key.items()}


def _grade_prediction(cells: list[Cell], pred: dict, one) -> Record:
    """A prediction cell scores its points when it commits a well-formed prediction
    (predictions.form_problem), read from the cell's literal arguments: nothing runs, and
    whether the prediction was right does not count."""
    q, pts = pred["question"], pred["points"]
    name = f"predict {q}"
    marks = (f'predict("{q}"', f"predict('{q}'")
    cell = next((c for c in cells if c.id == pred["cell_id"]), None)
    if cell is None or not any(m in cell.source for m in marks):
        cell = next((c for c in cells if any(m in c.source for m in marks)), None)
    if cell is None:
        return one(name, 0, pts, "missing", f"no cell calls predict({q!r}) (deleted?)")
    values = next((v for question, v in predict_calls(cell.source) if question == q), None)
    if values is None:
        return one(name, 0, pts, "failed", f"cell {cell.index}: predict({q!r}) does not parse")
    problem = predictions.form_problem(q, values)
    if problem is None:
        return one(name, pts, pts, "passed", "a well-formed prediction")
    status = "not implemented" if problem.startswith("no prediction yet") else "failed"
    return one(name, 0, pts, status, f"cell {cell.index}: {problem}")


def _grade_exercise(worker: sandbox.Worker, cells: list[Cell], ex: dict, one, note: str
                    ) -> Record:
    name, pts = ex["function"], ex["points"]
    cell = exercise_cell(cells, ex)
    if cell is None:
        return one(name, 0, pts, "missing", f"no cell defines {name}() (deleted or renamed?)"
                   + note)
    forbidden = set(ex["forbidden"])
    source = python_source(cell.source)
    problems = integrity.violations(source, name, forbidden, set(ex["may_use"]))
    if problems:
        p = problems[0]
        return one(name, 0, pts, "flagged", f"{name}() {p.reason} (cell {cell.index}, line "
                   f"{p.line}): write the exercise yourself" + note)
    if worker.dead:
        worker.restart()
    try:
        head, _ = worker.request(("define", name, prelude(ex, source, forbidden), source,
                                  ex["tripwires"]))
    except sandbox.SandboxError as e:
        return one(name, 0, pts, "failed", f"running the cell of {name}(): {e}" + note)
    if "error" in head:
        err = head["error"]
        if err.get("builtin") == "NotImplementedError" or err.get("type") == "NotImplementedError":
            return one(name, 0, pts, "not implemented", "not implemented yet" + note)
        where = f" ({err.get('where')} of the cell)" if err.get("where") else ""
        why = str(err.get("message"))[:200]
        if "Permission denied" in why or "Operation not permitted" in why:
            why += " (a graded cell may only write in its own temporary folder)"
        return one(name, 0, pts, "failed", f"the cell of {name}() raised {err.get('type')}: "
                   f"{why}{where}" + note)
    remote = sandbox.RemoteFunction(worker, name)
    checker = find_checker(ex["checker"])
    with contextlib.redirect_stdout(io.StringIO()):
        result = checker(remote)
    if remote.reference_called and remote.reference_called.startswith("!"):
        return one(name, 0, pts, "flagged", f"{name}() {remote.reference_called[1:]}: only "
                   "code that hides its calls needs that; write the exercise yourself" + note)
    if remote.reference_called:
        return one(name, 0, pts, "flagged", f"{name}() calls the reference "
                   f"{remote.reference_called}: write the exercise yourself" + note)
    reason = "not implemented yet" if result.status == "not implemented" else result.reason
    return one(name, pts if result.passed else 0, pts, result.status, reason + note)


def _read(path: Path) -> bytes:
    with open(path, "rb") as f:
        raw = f.read(MAX_NOTEBOOK_BYTES + 1)
    if len(raw) > MAX_NOTEBOOK_BYTES:
        raise ValueError(f"larger than {MAX_NOTEBOOK_BYTES >> 20} MiB")
    return raw


# --- the journal -----------------------------------------------------------------------------
RECORD_KEYS = {"notebook": str, "student": str, "exercise": str, "points": int,
               "max_points": int, "status": str, "reason": str}


def read_journal(path: Path) -> dict[tuple[str, str], list[Record]]:
    """Finished submissions: (path, sha256) -> records. A record line without its
    submission's closing line (a grader stopped mid-submission) is dropped: it is re-graded."""
    done: dict[tuple[str, str], list[Record]] = {}
    pending: dict[tuple[str, str], list[Record]] = {}
    if not path.exists():
        return done
    with open(path, encoding="utf-8", errors="strict") as f:
        lines = f.read().split("\n")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            key = (entry["path"], entry["sha256"])
            if not all(isinstance(k, str) for k in key):
                raise ValueError("path and sha256 must be strings")
            if entry.get("v") != JOURNAL_VERSION:
                raise ValueError(f"version {entry.get('v')!r}, expected {JOURNAL_VERSION}")
            if entry["kind"] == "record":
                rec = entry["record"]
                for k, t in RECORD_KEYS.items():
                    if not isinstance(rec.get(k), t):
                        raise ValueError(f"field {k!r} missing or not {t.__name__}")
                pending.setdefault(key, []).append(Record(**{k: rec[k] for k in RECORD_KEYS}))
            elif entry["kind"] == "done":
                done[key] = pending.pop(key, [])
            else:
                raise ValueError(f"unknown kind {entry['kind']!r}")
        except Exception as e:  # noqa: BLE001
            if n == len(lines) or n == len(lines) - 1 and not lines[-1]:
                break  # a last line cut short by a kill: ignore it, it is re-graded
            raise JournalError(f"{path}: line {n} is corrupt ({type(e).__name__}: "
                               f"{str(e)[:100]}); move the journal away to start over") from None
    return done


class Journal:
    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "a", encoding="utf-8")

    def write(self, entry: dict) -> None:
        self.f.write(json.dumps({"v": JOURNAL_VERSION, **entry}, ensure_ascii=False) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())

    def submission(self, path: str, sha: str, records: list[Record]) -> None:
        for r in records:
            self.write({"kind": "record", "path": path, "sha256": sha, "record": asdict(r)})
        self.write({"kind": "done", "path": path, "sha256": sha})

    def close(self) -> None:
        self.f.close()


# --- reports ---------------------------------------------------------------------------------
def print_table(records: list[Record], width: int = 100) -> None:
    name_w = max([len(r.student) for r in records] + [7])
    ex_w = max([len(r.exercise) for r in records] + [8])
    head = f"{'student':{name_w}}  {'exercise':{ex_w}}  points  {'status':15}  "
    print(head + "reason")
    indent = " " * len(head)
    for r in records:
        lines = textwrap.wrap(r.reason, max(30, width - len(head))) or [""]
        print(f"{r.student:{name_w}}  {r.exercise:{ex_w}}  {r.points}/{r.max_points}     "
              f"{r.status:15}  {lines[0]}")
        for line in lines[1:]:
            print(indent + line)
    stretch = stretch_exercises()
    for student, rs in _by_student(records).items():
        print(f"total {student}: {_totals(rs, stretch)}")


def stretch_exercises(manifest: dict | None = None) -> set[str]:
    """The exercises of the stretch tier (checked, not needed later in the course)."""
    manifest = manifest or load_manifest()
    return {e["function"] for nb in manifest["notebooks"].values() for e in nb["exercises"]
            if e.get("tier") == "stretch"}


def _totals(rs: list[Record], stretch: set[str]) -> str:
    """'7/9' or, where stretch exercises were graded, '7/9 (core 5/6, stretch 2/3)'."""
    text = f"{sum(r.points for r in rs)}/{sum(r.max_points for r in rs)}"
    extra = [r for r in rs if r.exercise in stretch]
    if not extra:
        return text
    core = [r for r in rs if r.exercise not in stretch]
    return (f"{text} (core {sum(r.points for r in core)}/{sum(r.max_points for r in core)}, "
            f"stretch {sum(r.points for r in extra)}/{sum(r.max_points for r in extra)})")


def _by_student(records: list[Record]) -> dict[str, list[Record]]:
    out: dict[str, list[Record]] = {}
    for r in records:
        out.setdefault(r.student, []).append(r)
    return out


def submission_hints(raw: bytes) -> dict[str, int]:
    """{exercise: the highest hint tier (1 or 2) opened} from a submission's stored outputs;
    {} for anything that is not a readable notebook."""
    try:
        nb = json.loads(raw.decode("utf-8"))
        outputs = [o for c in nb.get("cells", []) if isinstance(c, dict)
                   for o in c.get("outputs", []) or [] if isinstance(o, dict)]
    except (ValueError, UnicodeDecodeError, AttributeError, TypeError, RecursionError,
            MemoryError):
        return {}
    text = []
    for o in outputs:
        for part in (o.get("text"), *(o.get("data") or {}).values()):
            if isinstance(part, list):
                part = "".join(x for x in part if isinstance(x, str))
            if isinstance(part, str):
                text.append(part)
    return opened_hints("\n".join(text))


def write_gradebook(records: list[Record], path: Path,
                    hints: dict[str, dict[str, int]] | None = None) -> None:
    """One row per student, one column per exercise, then total and max (LMS import); where
    stretch exercises were graded, then the stretch points and their max too (included in
    the total: a course that counts only the core subtracts them). With `hints` ({student:
    {exercise: tiers opened}}), a last column: the hints each student opened in all."""
    exercises = list(dict.fromkeys(r.exercise for r in records if r.exercise != "(none)"))
    stretch = [e for e in exercises if e in stretch_exercises()]
    max_of = {e: next((x.max_points for x in records if x.exercise == e), 0) for e in exercises}
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["student", *exercises, "total", "max",
                    *(["stretch", "stretch_max"] if stretch else []),
                    *(["hints_opened"] if hints is not None else [])])
        for student, rs in _by_student(records).items():
            pts = {r.exercise: r.points for r in rs}
            row = [inert(student), *(pts.get(e, 0) for e in exercises),
                   sum(r.points for r in rs), sum(r.max_points for r in rs) or sum(max_of.values())]
            if stretch:
                row += [sum(pts.get(e, 0) for e in stretch), sum(max_of[e] for e in stretch)]
            if hints is not None:
                row.append(sum(n for e, n in hints.get(student, {}).items() if e in exercises))
            w.writerow(row)


def write_feedback(records: list[Record], folder: Path, ideas: dict[str, str],
                   opened: dict[str, dict[str, int]] | None = None) -> list[Path]:
    """One Markdown file per student: each exercise's points and reason; where it did not
    pass, its idea (hint 1); with `opened`, the hints the student opened for it."""
    folder.mkdir(parents=True, exist_ok=True)
    stretch = stretch_exercises()
    written, taken = [], set()
    for student, rs in _by_student(records).items():
        lines = [f"# Feedback for {student}", "",
                 f"Total: **{_totals(rs, stretch)}**", ""]
        for r in rs:
            icon = "passed" if r.status == "passed" else r.status
            tier = ", stretch: checked, not needed later" if r.exercise in stretch else ""
            lines += [f"## {r.exercise}: {r.points}/{r.max_points} ({icon}{tier})", ""]
            if r.reason:
                lines += [r.reason, ""]
            if r.status != "passed" and ideas.get(r.exercise):
                lines += [f"The idea: {ideas[r.exercise]} (`hint(\"{r.exercise}\")` in the "
                          "notebook; a second call gives the shape of the code)", ""]
            if opened is not None:
                n = opened.get(student, {}).get(r.exercise, 0)
                lines += [f"Hints opened: {n} of 2", ""]
        stem, copy = _safe(student), 1
        while stem.lower() in taken:  # two students whose names make one file name
            copy += 1
            stem = f"{_safe(student)}-{copy}"
        taken.add(stem.lower())
        p = folder / f"{stem}.md"
        p.write_text("\n".join(lines), encoding="utf-8")
        written.append(p)
    return written


def inert(text: str) -> str:
    """A CSV cell a spreadsheet shows as text: one that starts like a formula (=, +, -, @,
    a tab, a carriage return) gets a leading apostrophe (OWASP's CSV injection advice)."""
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def _safe(name: str) -> str:
    return re.sub(r"[^\w.-]+", "_", name)[:100] or "student"


# --- the command -----------------------------------------------------------------------------
def main(paths: list[str], json_out: str | None, csv_out: str | None,
         cell_timeout: float = 60, *, journal: str | None = None,
         feedback: str | None = None, submission_timeout: float = 600,
         memory_mb: int = 4096, manifest: dict | None = None, hints: bool = False,
         mystery_key: str | None = None) -> int:
    manifest = manifest or load_manifest()
    try:
        answers_key = load_mystery_key(mystery_key)
    except (OSError, ValueError) as e:
        print(f"error: --mystery-key: {e}", file=sys.stderr)
        return 2
    # a journal entry holds the grades of one key: another key grades the submission again
    key_tag = hashlib.sha256(json.dumps(answers_key, sort_keys=True).encode()).digest() \
        if mystery_key else b""
    limits = sandbox.Limits(call_s=cell_timeout, submission_s=submission_timeout,
                            memory_mb=memory_mb)
    files = [Path(p) for p in paths]
    journal_path = Path(journal) if journal else Path(json_out or "grades.json").with_suffix(
        ".journal.jsonl")
    try:
        done = read_journal(journal_path)
    except (JournalError, UnicodeDecodeError) as e:
        print(f"error: {e}" if isinstance(e, JournalError) else
              f"error: {journal_path}: not UTF-8 text ({e.reason}); move it away to start over",
              file=sys.stderr)
        return 2
    print(f"sandbox: {sandbox.describe()}")
    if done:
        print(f"journal {journal_path}: {len(done)} submissions already graded, skipped")
    out: list[Record] = []
    opened: dict[str, dict[str, int]] = {}  # student -> {exercise: hint tiers opened}
    log = Journal(journal_path)
    with tempfile.TemporaryDirectory(prefix="grpo-grade-pkg-") as pkg:
        pkg_root = sandbox.package_copy(Path(pkg))
        try:
            for path in files:
                try:
                    raw = _read(path)
                except Exception as e:  # noqa: BLE001
                    raw = f"unreadable: {type(e).__name__}: {e}".encode()
                sha = hashlib.sha256(raw + key_tag).hexdigest()
                if hints:
                    opened.setdefault(student_name(path, files), {}).update(
                        submission_hints(raw))
                key = (str(path), sha)
                if key in done:
                    out += done[key]
                    continue
                t0 = time.time()
                rs = grade_submission(path, student_name(path, files), manifest, pkg_root,
                                      limits, raw, answers_key)
                log.submission(str(path), sha, rs)
                done[key] = rs
                out += rs
                print(f"graded {path}: {sum(r.points for r in rs)}/"
                      f"{sum(r.max_points for r in rs)} ({time.time() - t0:.0f} s)", flush=True)
        finally:
            log.close()
    print()
    print_table(out)
    if json_out:
        Path(json_out).write_text(json.dumps([asdict(r) for r in out], indent=2,
                                             ensure_ascii=False))
    if csv_out:
        write_gradebook(out, Path(csv_out), opened if hints else None)
    if feedback:
        ideas = {e["function"]: e["idea"] for nb in manifest["notebooks"].values()
                 for e in nb["exercises"]}
        write_feedback(out, Path(feedback), ideas, opened if hints else None)
    return 0
