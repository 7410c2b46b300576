"""Layering: the modules of tinytrain.distributed form a DAG, and tinytrain.trace imports only tinytrain.backend.

Every import statement counts, also one inside a function (a "lazy" import is still a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import tinytrain

ROOT = Path(tinytrain.__file__).resolve().parent
PACKAGE = ROOT / "distributed"


def module_of(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str] = frozenset()) -> set[str]:
    """Every tinytrain module ``path`` imports anywhere in the file (relative imports resolved).

    ``from pkg import name`` imports the module ``pkg.name`` when that is one of ``modules``, else ``pkg``.
    """
    here = module_of(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            found |= {f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names}
    return {m for m in found if m == "tinytrain" or m.startswith("tinytrain.")}


def graph() -> dict[str, set[str]]:
    files = [*PACKAGE.glob("*.py"), ROOT / "trace.py", ROOT / "backend.py"]
    known = {module_of(f) for f in files}
    return {module_of(f): {m for m in imports(f, known) if m in known and m != module_of(f)} for f in files}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_distributed_modules_form_a_dag():
    edges = graph()
    assert "tinytrain.distributed.work" in edges and "tinytrain.distributed.algorithms" in edges
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_trace_imports_only_backend():
    assert imports(ROOT / "trace.py") <= {"tinytrain.backend"}, imports(ROOT / "trace.py")
    assert imports(ROOT / "backend.py") == set()


def test_the_cycle_finder_finds_a_lazy_import_cycle(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
