"""What an exercise cell may use: a static look at the student's source before it runs.

An exercise scores 0, with the reason, when its cell
- imports the exercise's own reference, or reaches it as an attribute
  (`from grpo_lab.objective import kl_k3`, `objective.kl_k3`, `checks.check_kl_k3`), or
  names it in a string handed to getattr;
- imports a grpo_lab module or name the exercise does not list (its notebook's own imports
  of other references stay allowed: they are the names the setup cells import);
- looks names up dynamically (getattr with a computed name, eval, exec, compile,
  __import__, importlib, globals(), vars(), sys.modules, frame or code introspection), or
  switches off the profiler that watches for calls of the reference.
The worker also watches at run time: a call of the reference's code, by any name, is a 0.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

# modules an exercise may import besides the names its notebook's setup imports
ALLOWED_MODULES = ("torch", "math", "cmath", "statistics", "numpy", "collections", "typing",
                   "functools", "itertools", "operator", "dataclasses", "__future__",
                   "numbers", "decimal", "fractions", "re", "string", "heapq", "bisect",
                   "copy", "enum", "abc", "warnings", "contextlib")
DYNAMIC_CALLS = {"eval", "exec", "compile", "__import__", "globals", "vars", "locals",
                 "breakpoint", "open", "input", "setattr", "delattr"}
BLOCKED_NAMES = {"importlib", "builtins", "__builtins__", "inspect", "gc", "ctypes", "sys",
                 "os", "subprocess", "pickle", "marshal", "runpy", "imp", "types", "code",
                 "codeop", "__loader__", "__spec__"}
SAFE_DUNDERS = {"__init__", "__name__", "__class__", "__len__", "__call__", "__doc__",
                "__future__", "__annotations__", "__qualname__", "__module__"}


@dataclass(frozen=True)
class Violation:
    line: int
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


def violations(source: str, function: str, forbidden: set[str], may_import: set[str]
               ) -> list[Violation]:
    """Problems in an exercise cell's `source` defining `function`; `forbidden`: the names
    of the exercise's reference (and its checker); `may_import`: grpo_lab names allowed
    (dotted module paths and names, e.g. 'grpo_lab.objective.exact_kl')."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return []  # the worker reports the error itself, in its sandbox
    out: list[Violation] = []

    def flag(node: ast.AST, reason: str) -> None:
        out.append(Violation(getattr(node, "lineno", 0), reason))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                _check_module(node, alias.name, None, forbidden, may_import, flag)
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            for alias in node.names:
                _check_module(node, module, alias.name, forbidden, may_import, flag)
        elif isinstance(node, ast.Attribute):
            if node.attr in forbidden:
                flag(node, f"reaches the reference `{node.attr}` as an attribute")
            elif node.attr.startswith("__") and node.attr not in SAFE_DUNDERS:
                flag(node, f"uses the introspection attribute `{node.attr}`")
            elif node.attr in WATCHED_ATTRIBUTES:
                flag(node, f"uses `{node.attr}`")
        elif isinstance(node, ast.Name):
            if node.id in forbidden and node.id != function:
                flag(node, f"uses the reference `{node.id}`")
            elif node.id in DYNAMIC_CALLS or node.id in BLOCKED_NAMES:
                flag(node, f"uses `{node.id}`, which an exercise may not")
            elif node.id == "getattr":
                pass  # judged at the call below
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and \
                node.value.id in ("getattr", "hasattr", "setattr"):
            flag(node, f"takes {node.value.id} under another name")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr"):
            name = node.args[1] if len(node.args) > 1 else None
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                flag(node, f"calls {node.func.id}() with a computed name")
            elif name.value in forbidden or name.value.startswith("__"):
                flag(node, f"reaches `{name.value}` through {node.func.id}()")
    return sorted(set(out), key=lambda v: (v.line, v.reason))


# attributes that reach the grader's monitor, frames, modules or hooks by another road
WATCHED_ATTRIBUTES = frozenset({
    "setprofile", "settrace", "getprofile", "gettrace", "_getframe", "modules", "f_globals",
    "f_back", "gi_frame", "cr_frame", "tb_frame", "attrgetter", "methodcaller", "sys", "hub",
    "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"})


def _check_module(node, module: str, name: str | None, forbidden: set[str],
                  may_import: set[str], flag) -> None:
    top = module.lstrip(".").split(".")[0]
    if name in forbidden or module.split(".")[-1] in forbidden:
        what = f"{module}.{name}" if name else module
        flag(node, f"imports the reference `{what}`")
        return
    if module.startswith(".") or top == "grpo_lab":
        full = f"{module}.{name}" if name else module
        if full not in may_import and name != "*":
            flag(node, f"imports `{full}`, which this exercise does not list")
        elif name == "*":
            flag(node, f"imports * from {module}")
        return
    if top in BLOCKED_NAMES:
        flag(node, f"imports `{module}`, which an exercise may not")
    elif top not in ALLOWED_MODULES:
        flag(node, f"imports `{module}`, which an exercise may not (allowed: "
                   f"{', '.join(ALLOWED_MODULES[:6])}, ...)")
