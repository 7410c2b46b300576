"""The rubric (``grader/rubric.toml``) and where things are: one place every grader tool reads.

An *assignment* is a reference file of the framework with its solution regions cut out; a *task*
is one region (or a few) with a title and points. Task ids are ``"<assignment>.<k>"``, so task
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

    @property
    def assignment(self) -> str:
        return self.id.split(".")[0]


@dataclass(frozen=True)
class Assignment:
    id: str
    title: str
    name: str  # attribute of the impl fixture: impl.<name>
    reference: str  # path of the reference file, relative to the repository root
    file: str  # path of the generated assignment file
    handout: str = ""
    reference_tests: tuple[str, ...] = ()
    tasks: tuple[Task, ...] = field(default=())

    @property
    def reference_module(self) -> str:
        """Dotted module name of the reference file (tinytrain/x/y.py -> tinytrain.x.y)."""
        return self.reference[: -len(".py")].replace("/", ".")

    @property
    def module(self) -> str:
        return self.file[: -len(".py")].replace("/", ".")


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
            raise ValueError(f"{path}: [task.\"{tid}\"] needs a title and points")
        tasks[tid] = Task(tid, entry["title"], float(entry["points"]))
    assignments = {}
    for aid, entry in data.get("assignment", {}).items():
        missing = [k for k in ("title", "name", "reference", "file") if k not in entry]
        if missing:
            raise ValueError(f"{path}: [assignment.{aid}] is missing {', '.join(missing)}")
        own = tuple(t for t in tasks.values() if t.assignment == aid)
        assignments[aid] = Assignment(
            aid, entry["title"], entry["name"], entry["reference"], entry["file"],
            entry.get("handout", ""), tuple(entry.get("reference_tests", ())), own,
        )
    orphans = [t.id for t in tasks.values() if t.assignment not in assignments]
    if orphans:
        raise ValueError(f"{path}: tasks {', '.join(orphans)} belong to no [assignment.N]")
    return Rubric(assignments, tasks)


def is_release() -> bool:
    return RELEASE_MARKER.exists()
