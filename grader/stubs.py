"""Solution regions in reference files, and the assignment stubs generated from them.

A reference file marks each part a student writes::

    def _ring_all_gather(c, flat, bounds, shift):
        \"\"\"Docstring: stays in the assignment.\"\"\"
        # BEGIN SOLUTION 1.2 "Pass chunks right for n-1 steps, overwriting, not adding."
        ...
        # END SOLUTION

From the reference, this module makes three texts:

* the **assignment** (``python -m grader stubs`` writes it): each region becomes
  ``raise NotImplementedError("TODO 1.2: <hint>")`` at the region's indentation, relative imports
  become absolute ``tinytrain...`` imports (the assignment lives in ``assignments/``), and a header
  says where it came from. Signatures and docstrings are outside the regions, so they stay.
* the **released reference** (``python -m grader release``): the same stubs, imports untouched.
* the **solved assignment**: markers dropped, solutions kept, imports absolute. The grader's own
  tests plant bugs in it to check that the grader notices them.

Generating instead of copying by hand means the assignment can never drift from the reference.
"""

from __future__ import annotations

import ast
import difflib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from .config import ROOT, Assignment, Rubric, is_release, load_rubric

BEGIN = re.compile(r'^(?P<indent>[ \t]*)# BEGIN SOLUTION (?P<task>\d+\.\d+) "(?P<hint>[^"]+)"\s*$')
END = re.compile(r"^[ \t]*# END SOLUTION\s*$")


class MarkerError(ValueError):
    """A malformed solution marker; the message names the file and line."""


@dataclass(frozen=True)
class Region:
    task: str
    hint: str
    indent: str
    begin: int  # 0-based line index of the BEGIN marker
    end: int  # 0-based line index of the END marker

    @property
    def todo(self) -> str:
        return f"TODO {self.task}: {self.hint}"


def find_regions(text: str, path: str = "<text>") -> list[Region]:
    """Every ``BEGIN SOLUTION`` ... ``END SOLUTION`` region, checked: closed, not nested, with a task."""
    regions, open_at = [], None
    for i, line in enumerate(text.splitlines()):
        where = f"{path}:{i + 1}"
        if "BEGIN SOLUTION" in line:
            m = BEGIN.match(line)
            if m is None:
                raise MarkerError(
                    f'{where}: malformed marker {line.strip()!r}; write # BEGIN SOLUTION <task> "<hint>", '
                    'e.g. # BEGIN SOLUTION 1.2 "Pass chunks to the right."'
                )
            if open_at is not None:
                raise MarkerError(
                    f"{where}: BEGIN SOLUTION {m['task']} inside the region opened at line "
                    f"{open_at[0] + 1}; regions cannot nest (close that one with # END SOLUTION first)"
                )
            open_at = (i, m)
        elif "END SOLUTION" in line:
            if not END.match(line):
                raise MarkerError(f"{where}: malformed marker {line.strip()!r}; write # END SOLUTION")
            if open_at is None:
                raise MarkerError(f"{where}: END SOLUTION without a BEGIN SOLUTION before it")
            start, m = open_at
            regions.append(Region(m["task"], m["hint"], m["indent"], start, i))
            open_at = None
    if open_at is not None:
        raise MarkerError(
            f"{path}:{open_at[0] + 1}: BEGIN SOLUTION {open_at[1]['task']} has no # END SOLUTION after it"
        )
    return regions


def _replace_regions(lines: list[str], regions: list[Region], keep_solution: bool) -> list[str]:
    out, i = [], 0
    for r in regions:
        out += lines[i : r.begin]
        if keep_solution:
            out += lines[r.begin + 1 : r.end]
        else:
            out.append(f"{r.indent}raise NotImplementedError({json.dumps(r.todo, ensure_ascii=False)})")
        i = r.end + 1
    return out + lines[i:]


def _absolute_imports(lines: list[str], text: str, module: str) -> list[str]:
    """Rewrite ``from .x import y`` in ``module``'s source as ``from <package>.x import y``."""
    package = module.split(".")
    edits = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level]
            target = ".".join(base + ([node.module] if node.module else []))
            names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in node.names)
            indent = re.match(r"[ \t]*", lines[node.lineno - 1]).group(0)
            edits.append((node.lineno - 1, node.end_lineno, f"{indent}from {target} import {names}"))
    for start, stop, new in sorted(edits, reverse=True):
        lines[start:stop] = [new]
    return lines


def _header(a: Assignment) -> list[str]:
    handout = f" (handout: {a.handout})" if a.handout else ""
    return [
        f"# Assignment {a.id}: {a.title}{handout}.",
        f"# Generated from {a.reference} by `python -m grader stubs`. Replace each",
        "# `raise NotImplementedError(\"TODO ...\")` with your code; grade it with `python -m grader`.",
        "",
    ]


def _check_tasks(regions: list[Region], a: Assignment, rubric: Rubric, path: str) -> None:
    for r in regions:
        if r.task not in rubric.tasks:
            raise MarkerError(f"{path}:{r.begin + 1}: task {r.task} is not in grader/rubric.toml; add [task.\"{r.task}\"]")
        if rubric.tasks[r.task].assignment != a.id:
            raise MarkerError(f"{path}:{r.begin + 1}: task {r.task} belongs to assignment "
                              f"{rubric.tasks[r.task].assignment}, but this file is assignment {a.id}'s reference")


def assignment_text(a: Assignment, rubric: Rubric, root: Path = ROOT, solved: bool = False) -> str:
    """The assignment file generated from ``a``'s reference (with solutions kept if ``solved``)."""
    text = (root / a.reference).read_text()
    regions = find_regions(text, a.reference)
    if not regions:
        raise MarkerError(f"{a.reference}: no BEGIN SOLUTION regions, so there is nothing to hand out")
    _check_tasks(regions, a, rubric, a.reference)
    lines = _replace_regions(text.splitlines(), regions, keep_solution=solved)
    body = "\n".join(lines) + "\n"
    lines = _absolute_imports(body.splitlines(), body, a.reference_module)
    out = "\n".join(_header(a) + lines) + "\n"
    ast.parse(out, a.file)  # a generated file that does not parse is a bug here, not the student's
    return out


def released_reference_text(a: Assignment, root: Path = ROOT) -> str:
    """The reference file as a student release ships it: regions stubbed, nothing else changed."""
    text = (root / a.reference).read_text()
    lines = _replace_regions(text.splitlines(), find_regions(text, a.reference), keep_solution=False)
    return "\n".join(lines) + "\n"


def write_stubs(root: Path = ROOT, check: bool = False) -> tuple[list[str], str]:
    """Regenerate every assignment file (or with ``check``, only diff). Returns (stale files, diff)."""
    rubric = load_rubric(root / "grader" / "rubric.toml")
    stale, diffs = [], []
    for a in rubric.assignments.values():
        want = assignment_text(a, rubric, root)
        path = root / a.file
        have = path.read_text() if path.exists() else ""
        if have == want:
            continue
        stale.append(a.file)
        diffs += difflib.unified_diff(have.splitlines(True), want.splitlines(True),
                                      f"{a.file} (checked in)", f"{a.file} (generated from {a.reference})")
        if not check:
            path.write_text(want)
    return stale, "".join(diffs)


def main(check: bool) -> int:
    """``python -m grader stubs [--check]``."""
    if is_release():
        print("This is a student copy: the assignment files are yours to edit, and their reference "
              "solutions are not here, so there is nothing to regenerate.")
        return 2
    try:
        stale, diff = write_stubs(check=check)
    except MarkerError as exc:
        print(f"error: {exc}")
        return 2
    if check:
        if stale:
            print(diff, end="")
            print(f"\nstale: {', '.join(stale)}; run `python -m grader stubs` and commit the result")
            return 1
        print("assignment stubs are up to date")
        return 0
    print(f"wrote {', '.join(stale)}" if stale else "assignment stubs were already up to date")
    return 0
