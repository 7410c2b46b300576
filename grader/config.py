"""The rubric (``grader/rubric.toml``) and where things are: one place every grader tool reads.

An *assignment* is a reference file of the framework (or the files of a reference package) with
its solution regions cut out; a *task* is one region (or a few) with a title and points. Task ids
are ``"<assignment>.<k>"``, so task
"1.3" belongs to assignment 1.
"""

from __future__ import annotations

import fnmatch
import sys
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (pyproject.toml installs tomli there)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
RUBRIC = ROOT / "grader" / "rubric.toml"
# Present only in a student copy made by `python -m grader release`: it switches the default
# implementation to the student's and skips the tests of solutions that were removed.
RELEASE_MARKER = ROOT / "grader" / "RELEASE"


@dataclass(frozen=True)
class Task:
    id: str
    title: str
    points: float
    # Tasks whose code this one runs (its handout names them): solve those first. A task's tests
    # depend on nothing else, so that it scores in full whatever else is done.
    requires: tuple[str, ...] = ()

    @property
    def assignment(self) -> str:
        return self.id.split(".")[0]


@dataclass(frozen=True)
class Assignment:
    """One assignment: reference file(s) of the framework and the assignment file(s) made from them.

    Most assignments are one file. A chapter split into several files (a package, like
    ``tinytrain/parallel/tensor_parallel/``) is an assignment of several files, paired in order:
    ``references[i]`` becomes ``files[i]``; the first pair is the packages' ``__init__.py``, so
    ``impl.<name>`` is the package and exposes the same names as the reference package.

    A subject whose code lives in several places of the framework (memory: ``autograd/checkpoint.py``
    and ``optim.py``) has a *front* module first instead of a package's ``__init__.py``
    (``tinytrain/memory.py``), which imports the names of the others; it becomes the assignment
    package's ``__init__.py`` and ``impl.<name>`` is the front module (reference) or the package.
    """

    id: str
    title: str
    name: str  # attribute of the impl fixture: impl.<name>
    references: tuple[str, ...]  # paths of the reference files, relative to the repository root
    files: tuple[str, ...]  # paths of the generated assignment files, in the same order
    handout: str = ""
    reference_tests: tuple[str, ...] = ()
    tasks: tuple[Task, ...] = field(default=())

    @property
    def pairs(self) -> tuple[tuple[str, str], ...]:
        """(reference file, assignment file) for every file of the assignment."""
        return tuple(zip(self.references, self.files))

    @property
    def reference(self) -> str:
        """The reference: its one file, or the folder of its package."""
        return _entry(self.references)

    @property
    def file(self) -> str:
        """The assignment: its one file, or the folder of its package."""
        return _entry(self.files)

    @property
    def reference_module(self) -> str:
        """Dotted module name of the reference (tinytrain/x/y.py -> tinytrain.x.y; a package's folder)."""
        return module_name(self.reference)

    @property
    def reference_modules(self) -> tuple[str, ...]:
        """The modules the assignment replaces: the reference (a package covers its files), or with
        a front module, the front and each file it imports from."""
        if self.reference in self.references and len(self.references) > 1:
            return tuple(module_name(r) for r in self.references)
        return (self.reference_module,)

    @property
    def module(self) -> str:
        return module_name(self.file)

    @property
    def renames(self) -> dict[str, str]:
        """Reference module -> assignment module, for every file (and the package) of the assignment."""
        pairs = [(self.reference, self.file), *self.pairs]
        return {module_name(ref): module_name(own) for ref, own in pairs}


def _entry(paths: tuple[str, ...]) -> str:
    """One file; a package's folder; or a front module (several files, the first no __init__.py)."""
    if len(paths) == 1 or not paths[0].endswith("/__init__.py"):
        return paths[0]
    return paths[0].rpartition("/")[0]


def module_name(path: str) -> str:
    """tinytrain/x/y.py -> tinytrain.x.y; tinytrain/x/__init__.py and the folder tinytrain/x -> tinytrain.x"""
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _paths(entry, key: str, where: str) -> tuple[str, ...]:
    """A rubric's ``reference``/``file``: one path, or a list of a package's files, __init__.py first."""
    paths = (entry,) if isinstance(entry, str) else tuple(entry)
    if not paths or not all(isinstance(p, str) and p.endswith(".py") for p in paths):
        raise ValueError(f"{where}: {key} must be a .py path or a list of them, got {entry!r}")
    if len(paths) > 1 and key == "reference" and not paths[0].endswith("/__init__.py"):
        return paths  # a front module and the files whose names it imports, anywhere in the framework
    if len(paths) > 1:
        package = paths[0].removesuffix("/__init__.py")
        if not paths[0].endswith("/__init__.py") or not all(p.startswith(package + "/") for p in paths):
            raise ValueError(
                f"{where}: a {key} of several files is a package: list its __init__.py first, "
                f"then its other files ({paths[0]} is not a __init__.py, or a file is outside "
                f"{package}/)" + (", or a front module first, then the files it imports from" * (key == "reference"))
            )
    return paths


@dataclass(frozen=True)
class Rubric:
    assignments: dict[str, Assignment]
    tasks: dict[str, Task]

    def by_name(self, name: str) -> Assignment:
        for a in self.assignments.values():
            if a.name == name:
                return a
        names = ", ".join(sorted(a.name for a in self.assignments.values()))
        raise AttributeError(f"no assignment named {name!r} in grader/rubric.toml (there are: {names})")

    def closure(self, tasks) -> tuple[str, ...]:
        """The tasks and everything they require, transitively, in rubric order."""
        want, todo = set(), list(tasks)
        while todo:
            t = todo.pop()
            if t not in want:
                want.add(t)
                todo += self.tasks[t].requires
        return tuple(t.id for t in self.select(None) if t.id in want)

    def select(self, patterns: list[str] | None) -> list[Task]:
        """Tasks whose id matches any of the glob ``patterns`` ("1.*", "1.3"); all when None."""
        tasks = sorted(self.tasks.values(), key=lambda t: tuple(int(x) for x in t.id.split(".")))
        patterns = [p for item in patterns or [] for p in item.split(",") if p]
        if not patterns:
            return tasks
        chosen = [t for t in tasks if any(fnmatch.fnmatchcase(t.id, p) for p in patterns)]
        if not chosen:
            raise ValueError(f"--tasks {' '.join(patterns)} matches no task; the rubric has {', '.join(self.tasks)}")
        return chosen


def load_rubric(path: Path = RUBRIC) -> Rubric:
    """Read and validate the rubric; errors say which entry to fix."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    tasks = {}
    for tid, entry in data.get("task", {}).items():
        if "title" not in entry or "points" not in entry:
            raise ValueError(f'{path}: [task."{tid}"] needs a title and points')
        tasks[tid] = Task(tid, entry["title"], float(entry["points"]), tuple(entry.get("requires", ())))
    assignments = {}
    for aid, entry in data.get("assignment", {}).items():
        missing = [k for k in ("title", "name", "reference", "file") if k not in entry]
        if missing:
            raise ValueError(f"{path}: [assignment.{aid}] is missing {', '.join(missing)}")
        own = tuple(t for t in tasks.values() if t.assignment == aid)
        where = f"{path}: [assignment.{aid}]"
        references, files = _paths(entry["reference"], "reference", where), _paths(entry["file"], "file", where)
        if len(references) != len(files):
            raise ValueError(
                f"{where}: {len(references)} reference files but {len(files)} assignment files; "
                "list one assignment file for each reference file, in the same order"
            )
        assignments[aid] = Assignment(
            aid,
            entry["title"],
            entry["name"],
            references,
            files,
            entry.get("handout", ""),
            tuple(entry.get("reference_tests", ())),
            own,
        )
    for t in tasks.values():
        unknown = [r for r in t.requires if r not in tasks or r == t.id]
        if unknown:
            raise ValueError(f'{path}: [task."{t.id}"] requires {", ".join(unknown)}, which is not another task')
    orphans = [t.id for t in tasks.values() if t.assignment not in assignments]
    if orphans:
        raise ValueError(f"{path}: tasks {', '.join(orphans)} belong to no [assignment.N]")
    return Rubric(assignments, tasks)


def release_skips(path: Path = RUBRIC) -> dict[str, str]:
    """Test id prefix -> why a student copy skips it (``[release.skip]`` of the rubric)."""
    with open(path, "rb") as f:
        return dict(tomllib.load(f).get("release", {}).get("skip", {}))


def is_release() -> bool:
    return RELEASE_MARKER.exists()
