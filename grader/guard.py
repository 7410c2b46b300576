"""Refuse an assignment file that borrows the solution instead of writing it.

An assignment replaces a reference module (or package). If it imports that module (or the names the package
re-exports from it, or reaches it by ``importlib``), or calls MPI's own collectives, it could pass
every graded test without containing a collective of its own. This check reads the file's syntax
tree (nothing is imported or run) and says what to remove.
"""

from __future__ import annotations

import ast
from pathlib import Path

from .config import ROOT, Assignment

# mpi4py's collectives (the upper-case, buffer-based ones and the lower-case pickle-based ones
# whose names differ from ours). Point-to-point calls (Isend, Irecv, Sendrecv, ...) are allowed.
MPI_COLLECTIVES = {
    "Allreduce",
    "Iallreduce",
    "Reduce",
    "Ireduce",
    "Reduce_scatter",
    "Reduce_scatter_block",
    "Ireduce_scatter",
    "Ireduce_scatter_block",
    "Allgather",
    "Allgatherv",
    "Iallgather",
    "Iallgatherv",
    "Alltoall",
    "Alltoallv",
    "Alltoallw",
    "Ialltoall",
    "Ialltoallv",
    "Bcast",
    "Ibcast",
    "Gather",
    "Gatherv",
    "Scatter",
    "Scatterv",
    "allreduce",
    "allgather",
    "alltoall",
    "bcast",
}


class Refused(Exception):
    """The assignment file may not be graded; the message says why and what to change."""


def _defined_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def problems(a: Assignment, root: Path = ROOT, path: Path | None = None) -> list[str]:
    """What in the assignment reaches the reference solution, one line each (empty if nothing).

    ``path``: the assignment's file, or for an assignment of several files its package folder
    (default: the one in ``assignments/``). The files of an assignment package may import each
    other (``from assignments.a4_tensor_parallel.mappings import ...``), never the reference's."""
    path = path or root / a.file
    if not path.exists():
        return [f"{path} does not exist (`python -m grader stubs` generates it from the reference)"]
    files = [path] if len(a.files) == 1 else [path / Path(f).relative_to(a.file) for f in a.files]
    reexported = set().union(*(_defined_names(ast.parse((root / r).read_text())) for r in a.references))
    found = []
    for file in files:
        shown = file.name if file == path else f"{path.name}/{file.relative_to(path)}"
        if not file.exists():
            found.append(f"{file} does not exist (`python -m grader stubs` generates it from the reference)")
            continue
        found += _file_problems(a, file, shown, reexported - {"annotations"})
    return found


def _file_problems(a: Assignment, path: Path, shown: str, reexported: set[str]) -> list[str]:
    named = {a.reference, *a.references, *a.renames}  # the reference's files and modules, by name
    try:
        tree = ast.parse(path.read_text(), str(path))
    except SyntaxError:
        return []  # not a refusal: the graded tests will report the syntax error with its line
    found = []
    for ref_mod in a.reference_modules:  # a package's name covers its modules: ref_mod + ".layers"
        found += _module_problems(tree, ref_mod, shown, reexported)
    compared = {id(n) for c in ast.walk(tree) if isinstance(c, ast.Compare) for n in [c.left, *c.comparators]}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in named and id(node) not in compared:
            what = f"names the reference module {node.value!r} (to import it by name?)"
        elif isinstance(node, ast.Attribute) and node.attr in MPI_COLLECTIVES:
            what = f"calls MPI's own collective .{node.attr}(); write it from point-to-point messages"
        else:
            continue
        found.append((node.lineno, f"{shown}:{node.lineno}: {what}"))
    return [text for _, text in sorted(set(found))]


def _module_problems(tree: ast.Module, ref_mod: str, shown: str, reexported: set[str]) -> list[tuple[int, str]]:
    """Where ``tree`` imports ``ref_mod`` (or one of its names through its package)."""
    package, _, leaf = ref_mod.rpartition(".")
    found, aliases = [], set()  # aliases: local names bound to the package (e.g. `dist`)

    def bad(node, what):
        found.append((node.lineno, f"{shown}:{node.lineno}: {what}"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for al in node.names:
                if al.name == ref_mod or al.name.startswith(ref_mod + "."):
                    bad(node, f"imports {ref_mod}, the reference this assignment replaces")
                elif al.name == package:
                    aliases.add(al.asname or al.name)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            mod = node.module or ""
            if mod == ref_mod or mod.startswith(ref_mod + "."):
                bad(node, f"imports from {mod}, the reference this assignment replaces")
            elif mod == package:
                for al in node.names:
                    if al.name == leaf:
                        bad(node, f"imports {ref_mod}, the reference this assignment replaces")
                    elif al.name in reexported:
                        bad(node, f"imports {al.name} from {package}, which is the reference's {al.name}")
            elif package.startswith(mod + ".") or package == mod:
                for al in node.names:
                    if ".".join(filter(None, [mod, al.name])) == package:
                        aliases.add(al.asname or al.name)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and (node.attr == leaf or node.attr in reexported)
        ):
            bad(node, f"uses {node.value.id}.{node.attr} from {package}, which is the reference's")
    return found


def check(a: Assignment, root: Path = ROOT, path: Path | None = None) -> None:
    """Raise :class:`Refused` naming every offending line."""
    found = problems(a, root, path)
    if found:
        raise Refused(refusal(a, found))


def refusal(a: Assignment, found: list[str]) -> str:
    """First line: the first problem (it goes into the score table); then all of them."""
    if len(found) == 1 and "does not exist" in found[0]:
        return f"cannot grade {a.file}: {found[0]}"
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    lines = "\n  ".join(found)
    return (
        f"refusing to grade {a.file}: {found[0]}{more}\n"
        f"An assignment must contain its own implementation, but\n  {lines}\n"
        "Remove these and use only point-to-point messages (c.exchange(...), tinytrain.distributed.p2p)."
    )


# --- which tasks a refusal costs -------------------------------------------------------------------


def _functions(tree: ast.Module) -> list[tuple[str, int, int]]:
    """(qualified name, first line, last line) of every function, methods as Class.method."""
    out = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out.append((name, child.lineno, child.end_lineno or child.lineno))
                visit(child, name + ".")

    visit(tree, "")
    return out


def _innermost(functions, line: int) -> str | None:
    inside = [(last - first, name) for name, first, last in functions if first <= line <= last]
    return min(inside)[1] if inside else None


def _tasks_by_function(a: Assignment, root: Path) -> dict[str, dict[str, set[str]]]:
    """Assignment file -> {function qualname -> tasks whose solution regions it holds, "" -> all}."""
    from .stubs import find_regions

    out = {}
    for reference, file in a.pairs:
        text = (root / reference).read_text()
        functions = _functions(ast.parse(text))
        by_function: dict[str, set[str]] = {"": set()}
        for region in find_regions(text, reference):
            by_function[""].add(region.task)
            name = _innermost(functions, region.begin + 1)
            by_function.setdefault(name or "", set()).add(region.task)
        out[file] = by_function
    return out


def refused_tasks(a: Assignment, root: Path = ROOT, path: Path | None = None) -> dict[str, list[str]]:
    """Task id -> the problems that refuse it. A problem inside a function costs the tasks whose
    solution regions that function holds; anything else (an import at the top, a function without a
    task) costs every task of its file. Tasks not listed are graded."""
    found = problems(a, root, path)
    if not found:
        return {}
    path = path or root / a.file
    tasks = _tasks_by_function(a, root)
    every = {t.id for t in a.tasks}
    out: dict[str, list[str]] = {}
    for problem in found:
        costs = every
        shown, _, rest = problem.partition(":")
        line = rest.partition(":")[0]
        if len(a.files) == 1:
            file = a.files[0]  # shown is the file's own name, whatever the copy is called
        else:
            file = next((f for f in a.files if f.endswith("/" + shown)), None)
        if file is not None and line.isdigit():
            own = path if len(a.files) == 1 else path / Path(file).relative_to(a.file)
            try:
                name = _innermost(_functions(ast.parse(own.read_text())), int(line))
            except (OSError, SyntaxError):
                name = None
            by_function = tasks[file]
            costs = by_function.get(name or "", set()) or by_function[""]
        for task in costs:
            out.setdefault(task, []).append(problem)
    return out
