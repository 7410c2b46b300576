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
  says where it came from. An assignment of several files (a reference package) becomes an
  assignment package: each file's imports of its sibling reference files become imports of the
  sibling assignment files (``tinytrain.parallel.tensor_parallel.layers`` ->
  ``assignments.a4_tensor_parallel.layers``), so the stubs import each other, never the reference.
  Signatures and docstrings are outside the regions, so they stay.
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

BEGIN = re.compile(
    r'^(?P<indent>[ \t]*)# BEGIN SOLUTION (?P<task>\d+\.\d+) "(?P<hint>[^"]+)"(?: full="(?P<full>[^"]+)")?\s*$'
)
# How much a stub tells (``python -m grader release OUT --hints LEVEL``): ``brief`` (the default,
# and the checked-in assignments/) is the marker's first string, the intent without the calls;
# ``full`` its ``full="..."`` string, the steps spelled out, for a gentler course; ``none``, the task alone.
HINT_LEVELS = ("brief", "full", "none")
END = re.compile(r"^[ \t]*# END SOLUTION\s*$")


class MarkerError(ValueError):
    """A malformed solution marker; the message names the file and line."""


@dataclass(frozen=True)
class Region:
    task: str
    hint: str  # the brief hint: what the region achieves, not how
    indent: str
    begin: int  # 0-based line index of the BEGIN marker
    end: int  # 0-based line index of the END marker
    full: str = ""  # the full hint (the steps), where the marker gives one

    def todo(self, hints: str = "brief") -> str:
        """The stub's message at hint level ``hints`` (one of HINT_LEVELS)."""
        if hints not in HINT_LEVELS:
            raise ValueError(f"hint level {hints!r}: choose one of {', '.join(HINT_LEVELS)}")
        text = {"brief": self.hint, "full": self.full or self.hint, "none": "see the handout"}[hints]
        return f"TODO {self.task}: {text}"


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
            regions.append(Region(m["task"], m["hint"], m["indent"], start, i, m["full"] or ""))
            open_at = None
    if open_at is not None:
        raise MarkerError(
            f"{path}:{open_at[0] + 1}: BEGIN SOLUTION {open_at[1]['task']} has no # END SOLUTION after it"
        )
    return regions


def solution_regions(root: Path = ROOT):
    """(reference file, region, the region's code lines) of every solution region the rubric knows."""
    rubric = load_rubric(root / "grader" / "rubric.toml")
    for a in rubric.assignments.values():
        for reference in a.references:
            text = (root / reference).read_text()
            lines = text.splitlines()
            for r in find_regions(text, reference):
                yield reference, r, lines[r.begin + 1 : r.end]


def _solved(regions: list[Region], solved) -> set[str]:
    """The tasks whose solutions stay: ``solved`` is a bool (all or none) or a collection of task ids."""
    if isinstance(solved, bool):
        return {r.task for r in regions} if solved else set()
    return set(solved)


def _replace_regions(lines: list[str], regions: list[Region], solved=False, hints: str = "brief") -> list[str]:
    """The text with each region's solution kept (its task in ``solved``) or replaced by its stub."""
    keep, out, i = _solved(regions, solved), [], 0
    for r in regions:
        out += lines[i : r.begin]
        if r.task in keep:
            out += lines[r.begin + 1 : r.end]
        else:
            out.append(f"{r.indent}raise NotImplementedError({json.dumps(r.todo(hints), ensure_ascii=False)})")
        i = r.end + 1
    return out + lines[i:]


def _absolute_imports(lines: list[str], text: str, module: str, renames: dict[str, str] | None = None) -> list[str]:
    """Rewrite ``from .x import y`` in ``module``'s source as ``from <package>.x import y``, and
    imports of the modules in ``renames`` (an assignment's other reference files) as imports of
    their assignment modules, so the assignment's files import each other, never the reference."""
    package, renames = module.split("."), renames or {}
    edits = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level]
            target = ".".join(base + ([node.module] if node.module else []))
            target = renames.get(target, target)
            names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in node.names)
            indent = re.match(r"[ \t]*", lines[node.lineno - 1]).group(0)
            edits.append((node.lineno - 1, node.end_lineno, f"{indent}from {target} import {names}"))
        elif isinstance(node, ast.ImportFrom) and node.module in renames:
            first = lines[node.lineno - 1]  # keep the layout: only the module's name changes
            new = first.replace(f"from {node.module} import", f"from {renames[node.module]} import", 1)
            edits.append((node.lineno - 1, node.lineno, new))
        elif isinstance(node, ast.Import) and any(a.name in renames for a in node.names):
            names = ", ".join(renames.get(a.name, a.name) + (f" as {a.asname}" if a.asname else "") for a in node.names)
            indent = re.match(r"[ \t]*", lines[node.lineno - 1]).group(0)
            edits.append((node.lineno - 1, node.end_lineno, f"{indent}import {names}"))
    for start, stop, new in sorted(edits, reverse=True):
        lines[start:stop] = [new]
    return lines


def _header(a: Assignment, reference: str) -> list[str]:
    handout = f" (handout: {a.handout})" if a.handout else ""
    return [
        f"# Assignment {a.id}: {a.title}{handout}.",
        f"# Generated from {reference} by `python -m grader stubs`. Replace each",
        '# `raise NotImplementedError("TODO ...")` with your code; grade it with `python -m grader`.',
        "",
    ]


def _check_tasks(regions: list[Region], a: Assignment, rubric: Rubric, path: str) -> None:
    for r in regions:
        if r.task not in rubric.tasks:
            raise MarkerError(
                f'{path}:{r.begin + 1}: task {r.task} is not in grader/rubric.toml; add [task."{r.task}"]'
            )
        if rubric.tasks[r.task].assignment != a.id:
            raise MarkerError(
                f"{path}:{r.begin + 1}: task {r.task} belongs to assignment "
                f"{rubric.tasks[r.task].assignment}, but this file is assignment {a.id}'s reference"
            )


def assignment_texts(
    a: Assignment, rubric: Rubric, root: Path = ROOT, solved=False, hints: str = "brief"
) -> dict[str, str]:
    """Assignment file -> its text, generated from its reference. ``solved``: keep every solution
    (True), none (False), or those of the given task ids; ``hints``: the stubs' hint level."""
    out, found = {}, 0
    for reference, file in a.pairs:
        text = (root / reference).read_text()
        regions = find_regions(text, reference)
        _check_tasks(regions, a, rubric, reference)
        found += len(regions)
        lines = _replace_regions(text.splitlines(), regions, solved, hints)
        body = "\n".join(lines) + "\n"
        lines = _absolute_imports(body.splitlines(), body, reference.removesuffix(".py").replace("/", "."), a.renames)
        out[file] = "\n".join(_header(a, reference) + lines) + "\n"
        ast.parse(out[file], file)  # a generated file that does not parse is a bug here, not the student's
    if not found:
        raise MarkerError(f"{a.reference}: no BEGIN SOLUTION regions, so there is nothing to hand out")
    return out


def assignment_text(
    a: Assignment, rubric: Rubric, root: Path = ROOT, solved=False, file: str | None = None, hints: str = "brief"
) -> str:
    """The text of one assignment file: ``file``, or the only file of a one-file assignment."""
    texts = assignment_texts(a, rubric, root, solved, hints)
    if file is None and len(texts) > 1:
        raise ValueError(f"assignment {a.id} has {len(texts)} files; say which: file={', '.join(texts)}")
    return texts[file or a.files[0]]


def released_reference_text(
    a: Assignment, root: Path = ROOT, reference: str | None = None, hints: str = "brief"
) -> str:
    """A reference file as a student release ships it: regions stubbed, nothing else changed."""
    reference = reference or a.references[0]
    text = (root / reference).read_text()
    lines = _replace_regions(text.splitlines(), find_regions(text, reference), hints=hints)
    return "\n".join(lines) + "\n"


def write_stubs(root: Path = ROOT, check: bool = False) -> tuple[list[str], str]:
    """Regenerate every assignment file (or with ``check``, only diff). Returns (stale files, diff)."""
    rubric = load_rubric(root / "grader" / "rubric.toml")
    stale, diffs = [], []
    for a in rubric.assignments.values():
        for (reference, file), want in zip(a.pairs, assignment_texts(a, rubric, root).values()):
            path = root / file
            have = path.read_text() if path.exists() else ""
            if have == want:
                continue
            stale.append(file)
            diffs += difflib.unified_diff(
                have.splitlines(True),
                want.splitlines(True),
                f"{file} (checked in)",
                f"{file} (generated from {reference})",
            )
            if not check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(want)
    return stale, "".join(diffs)


def main(check: bool) -> int:
    """``python -m grader stubs [--check]``."""
    if is_release():
        print(
            "This is a student copy: the assignment files are yours to edit, and their reference "
            "solutions are not here, so there is nothing to regenerate."
        )
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
