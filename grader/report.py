"""From test outcomes to task scores: the table, Gradescope's ``results.json``, JUnit XML.

A task scores its points only if every one of its tests passed (on every rank: the harness has
already agreed on each test's outcome). Its status is

* PASS -- all its tests passed;
* TODO -- every test stopped at a stub (``NotImplementedError("TODO ...")``);
* SKIP -- its tests need more ranks than this run has (``--ranks 3``): not graded, 0 points;
* FAIL -- anything else; the first thing that went wrong is shown in words, with its rank.
"""

from __future__ import annotations

import json
import re
import textwrap
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from .config import Task
from .run import TestResult


@dataclass
class TaskScore:
    task: Task
    status: str  # PASS | FAIL | TODO | SKIP
    score: float
    reason: str  # one line: why it did not pass ("" when it did)
    tests: list[TestResult]


def _short(message: str) -> str:
    """The first line of a failure, without pytest's exception-class noise."""
    lines = [ln for ln in message.strip().splitlines() if ln.strip()] or ["failed"]
    line = lines[0]
    if len(lines) > 1 and re.fullmatch(r"(\[rank \d+\] )?[\w.]*:?\s*(\[replay[^\]]*\])?\s*", line):
        # e.g. numpy's "AssertionError: \nNot equal to tolerance ...": the words are on the next line
        line = f"{line.rstrip()} {lines[1].strip()}"
    errors = [ln for ln in lines if re.match(r"^\w+(Error|Exception): ", ln)]
    where = re.search(r'File "([^"]+)", line (\d+)', message)
    if errors and not re.search(r"\w+(Error|Exception|Timeout|Failure|Mismatch): ", line):
        # e.g. a SyntaxError: pytest's message starts with the file, the error comes last
        rank = re.match(r"^\[rank \d+\] ", line)
        line = (rank.group(0) if rank else "") + errors[-1]
        if where:
            line += f" ({where.group(1).rsplit('/', 1)[-1]}, line {where.group(2)})"
    line = re.sub(r"^(\[rank \d+\] )?(AssertionError|Failed): ", r"\1", line)
    line = re.sub(r"^(\[rank \d+\] )?(?:[a-z_]\w*\.)+([A-Z]\w*): ", r"\1\2: ", line)  # module path of the class
    line = re.sub(r"^\[rank (\d+)\] (rank \1: )", r"\2", line)  # "[rank 2] rank 2: ..." says it twice
    extra = [x for x in decisive_lines(message) if x not in line]
    return " -- ".join([line, *extra])


# Lines of an assertion's output that carry its numbers: pytest's rewritten comparison, a dict's
# differing items, numpy's mismatch counts and shapes. The summary keeps them after the first line.
_DECISIVE = re.compile(
    r"^(assert .*|E?\s*\{.*\} != \{.*\}|.*\(shapes .* mismatch\).*|Mismatched elements: .*|"
    r"Max absolute difference.*|Max relative difference.*)$"
)


def decisive_lines(message: str, most: int = 3) -> list[str]:
    """The lines of a failure that say by how much it failed (numbers, shapes, a differing row)."""
    found = []
    for line in message.strip().splitlines()[1:]:
        line = line.strip().removeprefix("E").strip()
        elided = line.startswith("assert ") and "..." in line  # pytest's shortened dicts: the != line says it
        if _DECISIVE.match(line) and not elided and line not in found:
            found.append(textwrap.shorten(line, 160, placeholder=" ..."))
    return found[:most]


def _name(result: TestResult) -> str:
    """test_x[assignments] -> test_x (the table is about one implementation anyway)."""
    return result.nodeid.split("::")[-1].split("[")[0]


def score_tasks(tasks: list[Task], results: list[TestResult], problems: list[str]) -> list[TaskScore]:
    scores = []
    for task in tasks:
        mine = [r for r in results if r.task == task.id]
        failed = [r for r in mine if r.outcome == "failed"]
        todo = [r for r in mine if r.outcome == "todo"]
        if mine and all(r.outcome == "passed" for r in mine):
            scores.append(TaskScore(task, "PASS", task.points, "", mine))
        elif failed:
            first = failed[0]
            scores.append(TaskScore(task, "FAIL", 0.0, f"{_name(first)}: {_short(first.message)}", mine))
        elif todo and len(todo) == len(mine):
            scores.append(TaskScore(task, "TODO", 0.0, todo[0].message, mine))
        elif mine and all(r.outcome == "skipped" and "MPI ranks" in r.message for r in mine):
            # e.g. --ranks 3 for a task whose tests need 4: not graded here, not a failure of the code
            reason = mine[0].message.replace("run with mpirun -n", "grade with --ranks")
            scores.append(TaskScore(task, "SKIP", 0.0, reason, mine))
        elif mine:
            odd = next(r for r in mine if r.outcome != "passed")
            scores.append(TaskScore(task, "FAIL", 0.0, f"{_name(odd)} {odd.outcome}: {odd.message}", mine))
        else:
            why = problems[0].splitlines()[0] if problems else "no graded test for this task ran"
            scores.append(TaskScore(task, "FAIL", 0.0, why, mine))
    return blame_what_it_builds_on(scores)


def blame_what_it_builds_on(scores: list[TaskScore]) -> list[TaskScore]:
    """A task that fails while a task it requires (rubric ``requires``) fails or is TODO may fail
    only through that one's bug: say so first, naming the earliest such task, where to look."""
    status = {s.task.id: s.status for s in scores}
    tasks = {s.task.id: s.task for s in scores}

    def broken_roots(task) -> list[str]:
        found = []
        for r in task.requires:
            if status.get(r) in ("FAIL", "TODO"):
                found += broken_roots(tasks[r]) or [r]
        return list(dict.fromkeys(found))

    for s in scores:
        roots = broken_roots(s.task) if s.status == "FAIL" else []
        if roots:
            which = " and ".join(f"task {r} ({status[r]})" for r in roots)
            s.reason = f"builds on {which}: fix that first, this may then pass. {s.reason}"
    return scores


def table(scores: list[TaskScore], width: int = 100) -> str:
    rows = [f"{'task':<5} {'title':<48} {'points':>9}  result"]
    for s in scores:
        pts = f"{s.score:g}/{s.task.points:g}"
        title = textwrap.shorten(s.task.title, 48, placeholder="...")  # whole words
        rows.append(f"{s.task.id:<5} {title:<48} {pts:>9}  {s.status}")
        if s.reason:
            rows += textwrap.wrap(
                s.reason, width, initial_indent=" " * 6, subsequent_indent=" " * 8, max_lines=4, break_on_hyphens=False
            )
    total, most = sum(s.score for s in scores), sum(s.task.points for s in scores)
    rows.append(f"{'':<5} {'total':<48} {f'{total:g}/{most:g}':>9}")
    return "\n".join(rows)


def markdown(scores: list[TaskScore]) -> str:
    """The score table in Markdown (a GitHub job's summary page): a row per task, its reason in words."""

    def cell(text: str) -> str:
        return textwrap.shorten(text, 300, placeholder=" ...").replace("|", "\\|")

    rows = ["| task | title | points | result |", "|---|---|---:|---|"]
    for s in scores:
        result = f"{s.status}: {cell(s.reason)}" if s.reason else s.status
        rows.append(f"| {s.task.id} | {cell(s.task.title)} | {s.score:g}/{s.task.points:g} | {result} |")
    total, most = sum(s.score for s in scores), sum(s.task.points for s in scores)
    rows.append(f"| | **total** | **{total:g}/{most:g}** | |")
    return "\n".join(rows) + "\n"


def _output(s: TaskScore) -> str:
    lines = [f"{s.status}: {s.reason}" if s.reason else "PASS"]
    for r in s.tests:
        lines.append(f"  {r.outcome.upper():<7} {r.nodeid}" + (f"\n          {r.message}" if r.message else ""))
    failed = next((r for r in s.tests if r.outcome == "failed"), None)
    if failed is not None:
        lines += ["", f"First failure in full ({failed.nodeid}):", failed.output]
    return "\n".join(lines)


def write_results(scores: list[TaskScore], out_dir: Path, problems: list[str]) -> tuple[Path, Path]:
    """``results.json`` (Gradescope's format) and ``junit.xml`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    gradescope = {
        "score": sum(s.score for s in scores),
        "max_score": sum(s.task.points for s in scores),
        "output": "\n\n".join(problems) if problems else "",
        "tests": [
            {
                "name": f"{s.task.id} {s.task.title}",
                "number": s.task.id,
                "score": s.score,
                "max_score": s.task.points,
                "status": "passed" if s.status == "PASS" else "failed",
                "output": _output(s),
            }
            for s in scores
        ],
    }
    results = out_dir / "results.json"
    results.write_text(json.dumps(gradescope, indent=2) + "\n")

    suite = ET.Element(
        "testsuite",
        name="tinytrain grader",
        tests=str(sum(len(s.tests) for s in scores)),
        failures=str(sum(r.outcome == "failed" for s in scores for r in s.tests)),
        skipped=str(sum(r.outcome in ("todo", "skipped", "not run") for s in scores for r in s.tests)),
    )
    for s in scores:
        for r in s.tests:
            path, _, name = r.nodeid.rpartition("::")
            case = ET.SubElement(
                suite, "testcase", classname=f"task {s.task.id}: {path}", name=name, time=f"{r.seconds:.3f}"
            )
            if r.outcome == "failed":
                ET.SubElement(case, "failure", message=r.message[:500]).text = r.output
            elif r.outcome in ("todo", "skipped", "not run"):
                ET.SubElement(case, "skipped", message=r.message[:500])
    junit = out_dir / "junit.xml"
    root = ET.Element("testsuites", name="tinytrain")
    root.append(suite)
    ET.ElementTree(root).write(junit, encoding="unicode", xml_declaration=True)
    return results, junit
