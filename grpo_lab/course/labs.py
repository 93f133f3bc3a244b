"""Student notebooks from the solutions: `python -m grpo_lab labs [--check]`.

In every code cell of solutions/NN_*.ipynb (nbgrader's conventions):
- the lines between `### BEGIN SOLUTION` and `### END SOLUTION` become one
  `raise NotImplementedError(...)` at the same indentation whose message says what the
  function must do (its docstring's first line) and points to `hint("name")`: never the
  code. The block's `# Idea:` and `# Hint:` comments are the two tiers `hint()` gives
  (grpo_lab/course/hints.py); every exercise needs both;
- the lines between `### BEGIN HIDDEN TESTS` and `### END HIDDEN TESTS` are removed;
- between `### BEGIN PREDICTION` and `### END PREDICTION`, each `predict("question", ...)`
  call keeps its question and gets every field set to None, for the learner to fill
  (grpo_lab/course/predictions.py); between `### BEGIN DIAGNOSIS` and `### END DIAGNOSIS`
  each `diagnose("run", ...)` call the same (notebook 13, grpo_lab/course/diagnose.py: the
  answers in the solution are the key, and never reach the lab or the manifest);
- outputs and execution counts are cleared.
It also writes the exercise manifest, `grpo_lab/course/exercises.json`: for each notebook
the exercises it must have (the functions whose `check_<name>(` the solution calls, in
order), each with what `grade` needs to grade it without running the student's notebook:
its cell id, function, checker, reference, points (cell metadata `grpo_lab: {points: N}`,
default 1), idea and hint (the two tiers of `hint()`), the setup imports before it, and the
grpo_lab names it may and may not use; and its prediction cells (question, cell id, points). It ships inside the package, so `grade` knows them wherever grpo_lab is installed from.
`--check` regenerates in memory and exits 1 when labs/ or the manifest differs (CI runs
it as a test). `--nbgrader DIR` writes an nbgrader source folder instead (see `nbgrader_source`).

The course's files are found from `--root`, else from the current directory or one of its
parents that holds solutions/ and labs/, else from a source checkout the package runs from.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

from . import diagnose, exercises, predictions

MANIFEST = Path(__file__).with_name("exercises.json")
CHECK_CALL = re.compile(r"\bcheck_(\w+)\(")
DEFAULT_TASK = "write this function: its docstring says what it takes and returns"


class MarkerError(ValueError):
    """Unbalanced or nested solution / hidden-test markers in a solution cell."""


def _enclosing_functions(source: str) -> dict[int, tuple[str, str]]:
    """{line number: (function name, first line of its docstring)} for every line inside a
    function of `source` (the innermost function wins); {} when it does not parse."""
    try:
        tree = ast.parse(python_source(source))
    except SyntaxError:
        return {}
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    spans = sorted((n.lineno, n.end_lineno, n.name, (ast.get_docstring(n) or "").split("\n")[0])
                   for n in functions)  # outer functions first: an inner one overwrites them
    return {line: (name, doc) for start, end, name, doc in spans for line in range(start, end + 1)}


def task_message(name: str | None, doc: str) -> str:
    """What a stub says: what the function must do, and where the hints are; never its code."""
    if not name:
        return DEFAULT_TASK
    what = f"{name}: {doc.rstrip('.')}." if doc else f"{name}: {DEFAULT_TASK}."
    return (f"{what} Not written yet: its docstring has the details. Stuck? "
            f"hint({name!r}) gives the idea; a second call, the shape of the code.")


def student_source(source: str, where: str = "") -> str:
    out: list[str] = []
    mode, indent = None, ""
    functions = _enclosing_functions(source)
    for n, line in enumerate(source.splitlines(), 1):
        tag = line.strip()
        if tag in ("### BEGIN SOLUTION", "### BEGIN HIDDEN TESTS", "### BEGIN PREDICTION",
                   "### BEGIN DIAGNOSIS"):
            if mode is not None:
                raise MarkerError(f"{where} line {n}: {tag!r} inside an open {mode} block")
            mode, indent = tag.split()[-1], line[: len(line) - len(line.lstrip())]
            task, block = task_message(*functions.get(n, (None, ""))), []
            continue
        if tag in ("### END SOLUTION", "### END HIDDEN TESTS", "### END PREDICTION",
                   "### END DIAGNOSIS"):
            if mode != tag.split()[-1]:
                raise MarkerError(f"{where} line {n}: {tag!r} without its BEGIN")
            if mode == "SOLUTION":
                out.append(f"{indent}raise NotImplementedError({json.dumps(task, ensure_ascii=False)})")
            if mode in BLANKED:
                out.append(blank_predictions("\n".join(block), f"{where} line {n}", BLANKED[mode]))
            mode = None
            continue
        if mode in BLANKED:
            block.append(line)
            continue
        if mode == "SOLUTION":
            continue
        if mode == "TESTS":
            continue
        out.append(line)
    if mode is not None:
        raise MarkerError(f"{where}: a {mode} block is never closed")
    return "\n".join(out)


# the blocks whose calls the lab blanks, and the function each one calls
BLANKED = {"PREDICTION": "predict", "DIAGNOSIS": "diagnose"}


def _predict_nodes(tree: ast.AST, function: str = "predict") -> list[ast.Call]:
    """The `predict("question", ...)` calls (or another function's) in a parsed cell: a
    string literal first."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and getattr(n.func, "id", None) == function and n.args
            and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str)]


def predict_calls(source: str, function: str = "predict") -> list[tuple[str, dict]]:
    """(question, {field: literal value}) for each `predict("question", field=...)` call in
    `source` (or `diagnose("run", ...)` with function="diagnose"); a field whose value is
    not a literal reads as the string "<not a literal>" (nothing is evaluated). [] when the
    source does not parse."""
    try:
        tree = ast.parse(python_source(source))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    calls = []
    for node in _predict_nodes(tree, function):
        values = {}
        for kw in node.keywords:
            try:
                values[kw.arg] = ast.literal_eval(kw.value)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                values[kw.arg] = "<not a literal>"
        calls.append((node.args[0].value, values))
    return calls


def blank_predictions(block: str, where: str = "", function: str = "predict") -> str:
    """A prediction block as the lab has it: every `predict(...)` call's fields set to None
    (its question kept); a diagnosis block's `diagnose(...)` calls the same. The block holds
    statements only: comments go above its marker."""
    try:
        tree = ast.parse(block)
    except SyntaxError as e:
        raise MarkerError(f"{where}: the {function} block does not parse ({e.msg})") from None
    calls = _predict_nodes(tree, function)
    if not calls:
        raise MarkerError(f"{where}: a block without a {function}(...) call")
    for call in calls:
        for kw in call.keywords:
            kw.value = ast.Constant(None)
    return ast.unparse(tree)


def find_root(root: str | Path | None = None) -> Path:
    """The course repository: `root`, else the current directory or a parent holding
    solutions/ and labs/, else the source checkout this package runs from."""
    def is_course(d: Path) -> bool:
        return (d / "solutions").is_dir() and (d / "labs").is_dir()

    if root is not None:
        root = Path(root).resolve()
        if not is_course(root):
            raise FileNotFoundError(f"--root {root}: no solutions/ and labs/ there")
        return root
    here = Path.cwd().resolve()
    for d in (here, *here.parents, Path(__file__).resolve().parents[2]):
        if is_course(d):
            return d
    raise FileNotFoundError(
        "the course's solutions/ and labs/ were not found from the current directory; run "
        "this inside the course repository or pass --root DIR"
    )


def find_checker(checker: str):
    """The checker function of this name (`check_<exercise>`), from the exercises
    (grpo_lab/course/exercises); None when there is none."""
    exercise = exercises.find(checker.removeprefix("check_"))
    return exercise.check if exercise is not None and checker.startswith("check_") else None


def exercises_of(nb) -> list[str]:
    """The exercises a notebook checks, in order: its `check_<name>(` calls that are
    exercise checkers (`sampling.check_token_ids` is not one)."""
    names: list[str] = []
    for cell in nb.cells:
        if cell.cell_type == "code":
            for name in CHECK_CALL.findall(cell.source):
                if find_checker(f"check_{name}") and name not in names:
                    names.append(name)
    return names


MANIFEST_VERSION = 4  # 3: each exercise has an idea (hint 1) besides its hint; 4: diagnoses
SETUP_ROOTS = ("grpo_lab",)
EXERCISE_MODULES = exercises.__name__  # no exercise cell may import from these


def _nbformat():
    """nbformat, imported where a notebook file is read or written: its import loads
    jsonschema's format checkers, which the notebook kernels that import this module
    through `workbook` and `grade` never need.

    One of those checkers, rfc3987_syntax (jsonschema's optional "iri" format, installed
    with Jupyter), compiles its grammars when imported: 2.4 s of CPU, 90% of nbformat's
    import, in every `grade` and `labs` process. No notebook schema uses that format, so
    where jsonschema is not loaded yet it is loaded without it (jsonschema skips a format
    whose module is missing; the None entry makes its import fail that way). The entry
    goes once nbformat is loaded, so that anything else in the process can still import it."""
    blocked = "jsonschema" not in sys.modules and "rfc3987_syntax" not in sys.modules
    if blocked:
        sys.modules["rfc3987_syntax"] = None
    try:
        import nbformat
    finally:
        if blocked and sys.modules.get("rfc3987_syntax", 0) is None:
            del sys.modules["rfc3987_syntax"]

    return nbformat


def python_source(source: str) -> str:
    """IPython magics and shell lines become comments, so the cell parses as Python."""
    return "\n".join("# " + line if line.lstrip().startswith(("%", "!")) else line
                     for line in source.splitlines())


def _tier_comment(source: str, label: str, name: str) -> str:
    """The text of the exercise cell's `# Idea:` or `# Hint:` comment (the two tiers of
    `hint()`); a ValueError naming the exercise when it has none."""
    for line in source.splitlines():
        if line.strip().lower().startswith(f"# {label}:"):
            text = line.strip()[len(label) + 3:].strip()
            if text:
                return text
    raise ValueError(f"the cell of {name}() has no `# {label.capitalize()}: ...` comment inside "
                     "its ### BEGIN SOLUTION block: every exercise needs an idea (hint 1, in "
                     "words) and a hint (hint 2, the shape of the code)")


LOADER = "load_yours"  # workbook.load_yours: learner functions from earlier notebooks


def loaded_names(source: str) -> list[tuple[str, str]]:
    """(bound name, function name) for each `a, b = load_yours("a", "b")` in a cell."""
    try:
        tree = ast.parse(python_source(source))
    except SyntaxError:
        return []
    out = []
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        call = node.value
        if getattr(call.func, "id", None) != LOADER:
            continue
        wanted = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        target = node.targets[0]
        bound = [e.id for e in target.elts] if isinstance(target, ast.Tuple) else [target.id] \
            if isinstance(target, ast.Name) else []
        out += list(zip(bound, wanted, strict=False))
    return out


TIERS = ("core", "stretch")


def _tier(cell, name: str) -> str:
    """Cell metadata `grpo_lab: {tier: ...}`: core (needed later, the default) or stretch
    (checked, not needed later)."""
    tier = cell.metadata.get("grpo_lab", {}).get("tier", "core")
    if tier not in TIERS:
        raise ValueError(f"the cell of {name}(): tier must be one of {', '.join(TIERS)} "
                         f"(got {tier!r})")
    return tier


def _top_functions(source: str) -> list[str]:
    try:
        tree = ast.parse(python_source(source))
    except SyntaxError:
        return []
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _reference_of(name: str) -> str:
    """The dotted name of exercise `name`'s reference."""
    ref = exercises.find(name).reference
    return f"{ref.__module__}.{ref.__qualname__}"


def _setup_imports(source: str) -> list[dict]:
    """The top-level import statements of a cell: source, imported names, the names they
    bind, and the grpo_lab names among them (dotted)."""
    try:
        tree = ast.parse(python_source(source))
    except SyntaxError:
        return []
    out = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
            names = [a.name for a in node.names]
            binds = [(a.asname or a.name).split(".")[0] for a in node.names]
            module = node.module if isinstance(node, ast.ImportFrom) else None
            full = [f"{module}.{n}" if module else n for n in names]
            out.append({"source": ast.unparse(node), "names": names, "binds": binds,
                        "full": [f for f in full if f.split(".")[0] in SETUP_ROOTS]})
    return out


def exercise_specs(nb) -> list[dict]:
    """The graded exercises of one solution notebook, in order (`exercises_of`), each with
    what the grader needs (module docstring)."""
    names = exercises_of(nb)
    cells = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    out = []
    for name in names:
        where = next(((i, c) for i, c in cells if name in _top_functions(c.source)), None)
        if where is None:
            raise ValueError(f"the solution calls check_{name}( but no cell defines {name}()")
        index, cell = where
        check_cell = next((c for i, c in cells if i > index and
                           re.search(rf"\bcheck_{name}\(", c.source)), None)
        checker = f"check_{name}"
        reference = _reference_of(name)
        module, ref_name = reference.rsplit(".", 1)
        forbidden = sorted({name, checker, ref_name})
        # the setup imports an exercise cell may lean on; never the exercises' own modules
        # (the checkers, every reference and every known mistake's function live there)
        setup = [s for i, c in cells if i < index for s in _setup_imports(c.source)
                 if not any(f.startswith(EXERCISE_MODULES) for f in s["full"])]
        # names the cell may use besides its imports: functions loaded from earlier
        # notebooks and this notebook's earlier exercises; the grader binds them to their
        # references (each is graded on its own)
        provided = {bound: _reference_of(fn)
                    for i, c in cells if i < index for bound, fn in loaded_names(c.source)}
        provided.update({e["function"]: e["reference"] for e in out})
        may_use = sorted({f for s in setup for f in s["full"]
                          if f.rsplit(".", 1)[-1] not in forbidden})
        out.append({
            "function": name, "cell_id": cell.get("id"), "cell_index": index,
            "check_cell_id": check_cell.get("id") if check_cell is not None else None,
            "checker": checker, "reference": reference,
            "points": int(cell.metadata.get("grpo_lab", {}).get("points", 1)),
            "tier": _tier(cell, name),
            "idea": _tier_comment(cell.source, "idea", name),
            "hint": _tier_comment(cell.source, "hint", name), "forbidden": forbidden,
            "tripwires": [[module.replace(".", "/") + ".py", ref_name]]
            + [list(t) for t in ENGINE_TWINS.get(name, ())],
            "setup": setup, "may_use": may_use, "provided": provided,
        })
    return out


# The engine's own versions of whole-step exercises, reachable through objects an exercise
# may use (a Trainer, the Run): calling one is calling the reference, as its tripwire says
ENGINE_TWINS = {
    "grpo_step": (("grpo_lab/step.py", "grpo_step"),),
    "accumulated_grpo_step": (("grpo_lab/step.py", "grpo_step"),
                              ("grpo_lab/step.py", "accumulate")),
    "apply_update": (("grpo_lab/step.py", "guarded_update"),),
    "guarded_update": (("grpo_lab/step.py", "guarded_update"),),
    "health_check": (("grpo_lab/step.py", "check_health"),),
    "healthy_update": (("grpo_lab/step.py", "check_health"),),
}


def prediction_specs(nb, where: str = "") -> list[dict]:
    """The prediction cells of one solution notebook (`### BEGIN PREDICTION`), in order:
    question, cell id and index, points. Each must name a question of predictions.QUESTIONS
    and carry a well-formed example prediction."""
    out = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or "### BEGIN PREDICTION" not in cell.source:
            continue
        for question, values in predict_calls(cell.source):
            problem = predictions.form_problem(question, values)
            if problem:
                raise ValueError(f"{where} cell {i}: predict({question!r}): {problem}")
            out.append({"question": question, "cell_id": cell.get("id"), "cell_index": i,
                        "points": int(cell.metadata.get("grpo_lab", {}).get("points", 1))})
    return out


def diagnosis_specs(nb, where: str = "") -> list[dict]:
    """The runs a notebook's DIAGNOSIS cell diagnoses (notebook 13): run name, cell id and
    index, points. The answers stay out: they are the key (`diagnosis_key`)."""
    out = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or "### BEGIN DIAGNOSIS" not in cell.source:
            continue
        for run, values in predict_calls(cell.source, "diagnose"):
            problem = diagnose.form_problem(run, values.get("cause"), values.get("fix"),
                                            values.get("evidence"))
            if problem:
                raise ValueError(f"{where} cell {i}: diagnose({run!r}): {problem}")
            out.append({"run": run, "cell_id": cell.get("id"), "cell_index": i,
                        "points": diagnose.POINTS})
    return out


def diagnosis_key(solution: Path) -> dict[str, dict]:
    """{run: {cause, fix}}: the answers a solution notebook's DIAGNOSIS cell gives, the key
    of the mystery set the course ships."""
    nb = _nbformat().read(solution, as_version=4)
    return {run: {"cause": v.get("cause"), "fix": v.get("fix")}
            for cell in nb.cells if cell.cell_type == "code"
            and "### BEGIN DIAGNOSIS" in cell.source
            for run, v in predict_calls(cell.source, "diagnose")}


def manifest(solutions: list[Path]) -> dict:
    notebooks = {}
    for p in solutions:
        nb = _nbformat().read(p, as_version=4)
        notebooks[p.name] = {"exercises": exercise_specs(nb),
                             "predictions": prediction_specs(nb, p.name),
                             "diagnoses": diagnosis_specs(nb, p.name)}
    return {"version": MANIFEST_VERSION, "notebooks": notebooks}


def manifest_text(solutions: list[Path]) -> str:
    return json.dumps(manifest(solutions), indent=1) + "\n"


def load_manifest(path: Path | None = None) -> dict:
    """The exercise manifest (the shipped one unless `path`)."""
    data = json.loads(Path(path or MANIFEST).read_text())
    if not isinstance(data, dict) or data.get("version") != MANIFEST_VERSION:
        raise ValueError(f"{path or MANIFEST}: not a version {MANIFEST_VERSION} exercise "
                         "manifest; run `python -m grpo_lab labs` to rewrite it")
    return data


def expected_exercises(notebook_name: str) -> list[str] | None:
    """The exercises of the course notebook of this file name, from the shipped manifest;
    None when the course has no notebook of that name."""
    nb = load_manifest()["notebooks"].get(notebook_name)
    return None if nb is None else [e["function"] for e in nb["exercises"]]


def student_notebook(path: Path):
    nb = _nbformat().read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            cell.source = student_source(cell.source, f"{path.name} cell {i}")
            cell.outputs = []
            cell.execution_count = None
            cell.metadata.pop("execution", None)
    nb.metadata.pop("widgets", None)
    return nb


def render(nb) -> str:
    return _nbformat().writes(nb) + "\n"


# --- nbgrader ----------------------------------------------------------------------------------
NBGRADER_SCHEMA = 3


def _nbgrader(grade_id: str, *, solution=False, grade=False, locked=False, points=None) -> dict:
    meta = {"grade": grade, "grade_id": grade_id, "locked": locked,
            "schema_version": NBGRADER_SCHEMA, "solution": solution, "task": False}
    if points is not None:
        meta["points"] = points
    return meta


def _task_outside(source: str) -> str:
    """The stub's message (`task_message`) as a comment above `### BEGIN SOLUTION`, so that
    nbgrader's stub (which replaces the whole block by a bare `raise NotImplementedError()`)
    still says what to write and where the hints are."""
    lines = source.splitlines()
    try:
        begin = next(i for i, x in enumerate(lines) if x.strip() == "### BEGIN SOLUTION")
    except StopIteration:
        return source
    indent = lines[begin][: len(lines[begin]) - len(lines[begin].lstrip())]
    task = task_message(*_enclosing_functions(source).get(begin + 1, (None, "")))
    return "\n".join(lines[:begin] + [f"{indent}# {task}"] + lines[begin:])


def nbgrader_notebook(path: Path):
    """A solution notebook as an nbgrader source notebook: each exercise cell is a solution
    cell (nbgrader replaces its `### BEGIN SOLUTION` block by a stub), each check cell an
    autograded test cell worth the exercise's points (its hidden asserts run at autograde),
    every other cell locked (nbgrader restores it from the source before grading), except
    the prediction cells, which the learner fills in."""
    nb = _nbformat().read(path, as_version=4)
    specs = {e["cell_id"]: e for e in exercise_specs(nb)}
    checks_of = {e["check_cell_id"]: e for e in specs.values() if e["check_cell_id"]}
    for i, cell in enumerate(nb.cells):
        cid = cell.get("id")
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
            cell.metadata.pop("execution", None)
        if cid in specs:
            cell.source = _task_outside(cell.source)
            cell.metadata["nbgrader"] = _nbgrader(specs[cid]["function"], solution=True)
        elif "### BEGIN PREDICTION" in cell.source:  # the learner fills it in: not locked,
            # and not a solution cell (nbgrader would replace it by its stub); graded for
            # its form by `python -m grpo_lab grade`, not by nbgrader
            cell.source = student_source(cell.source, f"{path.name} cell {i}")
            cell.metadata.pop("nbgrader", None)
        elif cid in checks_of:
            e = checks_of[cid]
            if "### BEGIN HIDDEN TESTS" not in cell.source:
                raise ValueError(f"{path.name} cell {i}: the check cell of {e['function']} "
                                 "has no hidden test (nbgrader would give its points for free)")
            cell.metadata["nbgrader"] = _nbgrader(f"test_{e['function']}", grade=True,
                                                  locked=True, points=e["points"])
        else:
            cell.metadata["nbgrader"] = _nbgrader(f"cell-{cid or i}", locked=True)
    nb.metadata.pop("widgets", None)
    return nb


def nbgrader_source(dest: Path, solutions: list[Path], assignment: str) -> list[Path]:
    """Write DEST/source/ASSIGNMENT/<notebook> for each solution notebook: the folder
    `nbgrader generate_assignment ASSIGNMENT` reads (run with CourseDirectory.root=DEST)."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", assignment):
        raise ValueError(f"--assignment {assignment!r}: letters, digits, _ . - only")
    folder = dest / "source" / assignment
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for p in solutions:
        out = folder / p.name
        out.write_text(render(nbgrader_notebook(p)))
        written.append(out)
    return written


EXERCISE_TABLE = Path("docs") / "exercises.md"


def known_mistakes(exercise: str) -> list[str]:
    """The known mistakes this exercise's check names, e.g. ['no_zero_grad', ...]."""
    found = exercises.find(exercise)
    return [m.name for m in found.mistakes] if found is not None else []


def exercise_table(data: dict) -> str:
    """docs/exercises.md: every exercise with its notebook, tier, points, checker and the
    known mistakes its checker names (written by `labs`, checked by `labs --check`)."""
    rows, totals = [], {"core": [0, 0], "stretch": [0, 0]}
    for nb, spec in data["notebooks"].items():
        for e in spec["exercises"]:
            totals[e["tier"]][0] += 1
            totals[e["tier"]][1] += e["points"]
            mistakes = ", ".join(f"`{m}`" for m in known_mistakes(e["function"])) or "-"
            rows.append(f"| {nb[:2]} | `{e['function']}` | {e['tier']} | {e['points']} | "
                        f"`{e['checker']}` | {mistakes} |")
    (nc, pc), (ns, ps) = totals["core"], totals["stretch"]
    return "\n".join([
        "# Exercises", "",
        "Written by `python -m grpo_lab labs` from `solutions/` (do not edit by hand; "
        "`python -m grpo_lab labs --check` fails when it is stale).", "",
        f"{nc + ns} exercises: {nc} core ({pc} points), needed later in the course, and {ns} "
        f"stretch ({ps} points), checked and graded but not needed later (the gradebook "
        "lists their points apart: columns `stretch`, `stretch_max`). An exercise's "
        "points come from its cell's metadata, `grpo_lab: {points: N, tier: core|stretch}`.",
        "", "The last column lists the known mistakes each exercise's check names in its "
        "verdict: it reruns the reference with each one put in and reports the one that "
        "reproduces the submission (each exercise's `mistakes`, "
        "grpo_lab/course/exercises/; tests/test_exercises.py checks every one). Other "
        "checks name what they find in their messages (tests/test_checks.py).", "",
        "| notebook | exercise | tier | points | checker | named mistakes |",
        "|---|---|---|---|---|---|", *rows, ""])


def main(check: bool = False, root: str | Path | None = None, nbgrader: str | None = None,
         assignment: str = "grpo_lab") -> int:
    ROOT = find_root(root)
    SOLUTIONS, LABS = ROOT / "solutions", ROOT / "labs"
    sources = sorted(SOLUTIONS.glob("*.ipynb"))
    if nbgrader:
        written = nbgrader_source(Path(nbgrader), sources, assignment)
        print(f"nbgrader source: {len(written)} notebooks in {written[0].parent if written else nbgrader}"
              f"; next: nbgrader generate_assignment {assignment} "
              f"--CourseDirectory.root={Path(nbgrader).resolve()}")
        return 0
    expected = {LABS / p.name: render(student_notebook(p)) for p in sources}
    # the manifest in the checkout's package (the one the next install ships)
    text = manifest_text(sources)
    expected[ROOT / "grpo_lab" / "course" / MANIFEST.name] = text
    expected[ROOT / EXERCISE_TABLE] = exercise_table(json.loads(text))
    existing = set(LABS.glob("*.ipynb"))
    stale = sorted(existing - set(expected))
    differ = sorted(p for p, text in expected.items()
                    if not p.exists() or p.read_text() != text)
    if check:
        for p in differ:
            print(f"labs out of sync: {p.relative_to(ROOT)} (run `python -m grpo_lab labs`)")
        for p in stale:
            print(f"labs out of sync: {p.relative_to(ROOT)} has no solution notebook")
        if not differ and not stale:
            print(f"labs in sync: {len(sources)} notebooks and the exercise manifest")
        return 1 if differ or stale else 0
    LABS.mkdir(exist_ok=True)
    for p in differ:
        p.write_text(expected[p])
        print(f"wrote {p.relative_to(ROOT)}")
    for p in stale:
        p.unlink()
        print(f"removed {p.relative_to(ROOT)} (no solution notebook)")
    print(f"labs: {len(sources)} notebooks, {len(differ)} files written, {len(stale)} removed")
    return 0
