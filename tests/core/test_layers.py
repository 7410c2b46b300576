"""Layers point one way: no module in ``tinytrain`` imports a module of a higher layer, and the
import graph has no cycle. Every import counts, including those inside functions (a lazy import
is still an arrow). The layer list is written once, here, and drawn in docs/design.md."""

from __future__ import annotations

import ast
from pathlib import Path

import tinytrain

PACKAGE = Path(tinytrain.__file__).parent

# Lowest first. A module may import its own layer's modules (without a cycle) and lower layers.
LAYERS = [
    ("env", ["tinytrain.env", "tinytrain.launcher"]),
    ("backend", ["tinytrain.backend"]),
    ("trace", ["tinytrain.trace"]),
    (
        "autograd",
        ["tinytrain.autograd", "tinytrain.random", "tinytrain.functional", "tinytrain.testing", "tinytrain"],
    ),  # the package's own __init__: Tensor, no_grad, manual_seed
    ("nn", ["tinytrain.nn", "tinytrain.optim", "tinytrain.memory", "tinytrain.data", "tinytrain.checkpoint"]),
    ("distributed", ["tinytrain.distributed"]),
    ("parallel", ["tinytrain.parallel"]),
    ("viz", ["tinytrain.viz"]),
    ("trainer", ["tinytrain.trainer", "tinytrain.sample", "tinytrain.bench", "tinytrain.planner", "tinytrain.doctor"]),
    ("elastic", ["tinytrain.elastic"]),
    ("cli", ["tinytrain.cli"]),
]


def layer_of(module: str) -> int:
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or (prefix != "tinytrain" and module.startswith(prefix + ".")):
                if best is None or len(prefix) > best[1]:
                    best = (i, len(prefix))
    assert best is not None, f"{module} is in no layer: add it to LAYERS (and to docs/design.md)"
    return best[0]


def module_name(path: Path) -> str:
    parts = ["tinytrain", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, name: str, modules) -> set[str]:
    """Every tinytrain module ``path`` imports, anywhere in the file (``from pkg import mod``
    imports ``pkg.mod``; the package itself only for names that are not modules)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            submodules = {f"{base}.{a.name}" for a in node.names} & set(modules)
            found |= submodules
            if len(submodules) < len(node.names):
                found.add(base)
    return {m for m in found if m == "tinytrain" or m.startswith("tinytrain.")}


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        edges[name] = {m for m in imports_of(path, name, modules) if m in modules and m != name}
    return edges


def test_no_module_imports_a_higher_layer():
    upward = [f"{a} -> {b}" for a, targets in graph().items() for b in targets if layer_of(b) > layer_of(a)]
    assert not upward, "imports that point up a layer:\n" + "\n".join(sorted(upward))


def find_cycles(edges: dict[str, set[str]]) -> list[str]:
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return cycles


def test_the_import_graph_has_no_cycle():
    # a package's __init__ re-exports its own modules: that arrow is the package, not a cycle
    edges = {name: {m for m in targets if not m.startswith(name + ".")} for name, targets in graph().items()}
    cycles = find_cycles(edges)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checker_finds_a_lazy_import_cycle(tmp_path):
    """The checker itself: an import inside a function still closes a cycle."""
    (tmp_path / "a.py").write_text("import tinytrain.b\n")
    (tmp_path / "b.py").write_text("def f():\n    from tinytrain import a\n")
    modules = {"tinytrain.a": tmp_path / "a.py", "tinytrain.b": tmp_path / "b.py"}
    edges = {name: imports_of(path, name, modules) & set(modules) for name, path in modules.items()}
    assert find_cycles(edges) == ["tinytrain.a -> tinytrain.b -> tinytrain.a"]


def test_the_layer_list_catches_an_upward_import(tmp_path):
    """The checker itself: a parallel module importing the trainer is reported."""
    assert layer_of("tinytrain.trainer.loop") > layer_of("tinytrain.parallel.hybrid")
    assert layer_of("tinytrain.parallel.hybrid") > layer_of("tinytrain.distributed.collectives")
    assert layer_of("tinytrain.distributed") > layer_of("tinytrain.autograd.engine") > layer_of("tinytrain.backend")
