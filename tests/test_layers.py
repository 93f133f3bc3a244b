"""The package's layers: the engine at grpo_lab/, above it course/, field/ and tools/, the
CLI on top. Dependencies run one way, there is no import cycle (function-level imports
included), and every module imports on its own.

    python tests/test_layers.py     # prints the import graph, module -> what it imports
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "grpo_lab"
# a module may import its own layer (without a cycle) and the layers below it
RANK = {"engine": 0, "tools": 1, "field": 2, "course": 3, "cli": 4}


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("course", "field", "tools"):
        return parts[1]
    if module in ("grpo_lab.cli", "grpo_lab.__main__"):
        return "cli"
    return "engine"


def imports_of(module: str, path: Path, known: set[str]) -> list[tuple[str, bool]]:
    """(imported grpo_lab module, whether the import sits inside a function), every one."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                for alias in child.names:  # `from pkg import module` names a module
                    sub = f"{target}.{alias.name}"
                    found.append((sub if sub in known else target, nested))
            elif isinstance(child, ast.Import):
                found.extend((a.name, nested) for a in child.names)
            visit(child, nested)

    visit(tree, False)
    return [(m, f) for m, f in found if m in known and m != module]


def graph() -> dict[str, list[tuple[str, bool]]]:
    mods = modules()
    return {m: sorted(set(imports_of(m, p, set(mods)))) for m, p in mods.items()}


def test_no_import_cycle():
    g = {m: {t for t, _ in deps} for m, deps in graph().items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def walk(m, path):
        state[m] = 1
        for t in sorted(g[m]):
            if t == "grpo_lab":  # the package's own __init__ (it imports config only)
                continue
            assert state.get(t) != 1, "import cycle: " + " -> ".join(path + [m, t])
            if t not in state:
                walk(t, path + [m])
        state[m] = 2

    for m in g:
        if m not in state:
            walk(m, [])


def test_dependencies_run_down_the_layers():
    wrong = [f"{m} ({layer(m)}) imports {t} ({layer(t)})"
             for m, deps in graph().items() for t, _ in deps
             if RANK[layer(t)] > RANK[layer(m)]]
    assert not wrong, "\n".join(wrong)


def test_no_package_import_hides_inside_a_function():
    """A function-level import of a grpo_lab module is how a cycle gets dodged; only the
    CLI imports lazily, so that a bad flag is answered before torch loads."""
    hidden = [f"{m} imports {t} inside a function" for m, deps in graph().items()
              for t, in_function in deps if in_function and layer(m) != "cli"]
    assert not hidden, "\n".join(hidden)


def test_the_layers_are_what_the_checks_expect():
    """The checks above would pass on an empty package: make sure they saw the layers."""
    by_layer: dict[str, int] = {}
    for m in graph():
        by_layer[layer(m)] = by_layer.get(layer(m), 0) + 1
    assert by_layer["engine"] >= 10 and by_layer["course"] >= 5, by_layer
    assert by_layer["field"] >= 4 and by_layer["tools"] >= 3, by_layer
    assert ("grpo_lab.trainer", False) in graph()["grpo_lab.field.bugs"]


def test_every_module_imports_on_its_own():
    """Each module imported first, in a process where no other grpo_lab module is loaded
    yet (torch and transformers stay cached between them, so this takes seconds)."""
    names = [m for m in modules() if m != "grpo_lab.__main__"]
    script = (
        "import importlib, sys, torch, transformers\n"
        "failed = []\n"
        f"for name in {names!r}:\n"
        "    for loaded in [m for m in sys.modules if m == 'grpo_lab' or m.startswith('grpo_lab.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as e:\n"
        "        failed.append(f'{name}: {type(e).__name__}: {e}')\n"
        "print('\\n'.join(failed) or 'all imported')\n"
        "sys.exit(1 if failed else 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=PACKAGE.parent, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "all imported"


if __name__ == "__main__":
    for module, deps in graph().items():
        print(f"{module} [{layer(module)}] -> {', '.join(t for t, _ in deps) or '-'}")
