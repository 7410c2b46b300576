"""``python -m grader selfcheck``: prove that correct work scores in a student copy, in any order.

For every task T (or those chosen): a fresh student copy (``python -m grader release``) in which
exactly T and the tasks it requires (``requires`` in the rubric, named in its handout) are solved
from the reference -- written into the assignment files, as a student would -- is graded on T,
which must score its full points. With ``--suite`` the copy's whole test suite runs as well and
must have no failure (every unfinished task is a TODO skip). ``--solve`` grades one half-done
copy instead: the tasks given solved, every other one a stub, the whole suite green.

    python -m grader selfcheck                     # every task, graded alone (a few minutes)
    python -m grader selfcheck --tasks '7.*'       # some tasks
    python -m grader selfcheck --suite --rotate 2  # CI: two tasks (chosen by the day) with the whole suite
    python -m grader selfcheck --solve '3.*' '4.*' '6.*' '7.*'   # one copy half done, its suite green

Exits 1 when a task scores less than its points or a suite fails, 0 otherwise.
"""

from __future__ import annotations

import datetime
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tinytrain import launcher

from .config import ROOT, Rubric, is_release, load_rubric
from .release import make_release
from .run import mpi_environment
from .stubs import assignment_texts

SUITE_TIMEOUT = 1800  # seconds for one copy's whole suite under mpirun on 2 cores


@dataclass
class Outcome:
    label: str  # the task graded, or the solved set of a half-done copy
    solved: tuple[str, ...]
    score: float | None = None
    points: float | None = None
    suite: str = ""  # "" (not run), "passed", or what failed
    seconds: float = 0.0
    why: str = ""

    @property
    def ok(self) -> bool:
        scored = self.score is None or self.score == self.points
        return scored and self.suite in ("", "passed")


def solve(copy: Path, rubric: Rubric, solved: tuple[str, ...]) -> None:
    """Write the reference's solutions of ``solved`` into the copy's assignment files, the rest stubs."""
    for a in rubric.assignments.values():
        mine = [t for t in solved if rubric.tasks[t].assignment == a.id]
        if mine:
            for file, text in assignment_texts(a, rubric, ROOT, solved=mine).items():
                (copy / file).write_text(text)


def copy_environment(copy: Path) -> dict:
    """The environment a student's own install of ``copy`` gives: its packages first, whatever
    folder a program runs in (this repository's editable install would serve the solutions)."""
    return dict(mpi_environment(), PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")


def _run(cmd: list[str], cwd: Path, timeout: float) -> tuple[int, str]:
    try:
        proc = subprocess.run(
            cmd, cwd=cwd, env=copy_environment(cwd), capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        return -1, f"timed out after {timeout:.0f} s\n{exc.stdout or ''}{exc.stderr or ''}"
    return proc.returncode, proc.stdout + proc.stderr


def grade_task(copy: Path, task: str, ranks: int) -> tuple[float, str]:
    """Grade ``task`` in ``copy``; returns (its score, the first failing test's message or '')."""
    out = copy / "out" / "selfcheck"
    code, text = _run(
        [sys.executable, "-m", "grader", "--tasks", task, "--ranks", str(ranks), "--out", str(out)], copy, 900
    )
    try:
        results = json.loads((out / "results.json").read_text())
    except (OSError, ValueError):
        return 0.0, f"the grader wrote no results (exit {code}): {text[-1500:]}"
    why = next((t["output"] for t in results["tests"] if t.get("score", 0) < t.get("max_score", 0)), "")
    return float(results["score"]), why.strip()[:1500]


def run_suite(copy: Path, ranks: int) -> str:
    """The copy's whole suite (README's command): 'passed', or its failures."""
    code, text = _run(
        [*launcher.mpirun_command(ranks), sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        copy,
        SUITE_TIMEOUT,
    )
    if code == 0:
        return "passed"
    failed = [ln for ln in text.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    return "\n".join(failed[:30]) or text[-3000:]


def check_copy(base: Path, work: Path, rubric: Rubric, label: str, solved, task, ranks: int, suite: bool) -> Outcome:
    start = time.monotonic()
    copy = work / label.replace("*", "x").replace(" ", "_")
    shutil.copytree(base, copy, symlinks=True)
    solve(copy, rubric, solved)
    result = Outcome(label, solved)
    if task:
        result.points = rubric.tasks[task].points
        result.score, result.why = grade_task(copy, task, ranks)
    if suite:
        result.suite = run_suite(copy, ranks)
    result.seconds = time.monotonic() - start
    shutil.rmtree(copy, ignore_errors=True)
    return result


def rotation(tasks: list[str], count: int, day: int | None = None) -> list[str]:
    """``count`` tasks, a different slice each day: over len(tasks)/count days CI sees every task."""
    day = datetime.date.today().toordinal() if day is None else day
    start = (day * count) % len(tasks)
    return [tasks[(start + i) % len(tasks)] for i in range(min(count, len(tasks)))]


def table(results: list[Outcome]) -> str:
    rows = [f"{'task':<10} {'solved':<24} {'score':>11} {'suite':<8} {'time':>6}"]
    for r in results:
        score = "" if r.score is None else f"{r.score:g}/{r.points:g}"
        suite = r.suite if r.suite in ("", "passed") else "FAILED"
        rows.append(f"{r.label:<10} {','.join(r.solved):<24} {score:>11} {suite:<8} {r.seconds:5.0f}s")
    return "\n".join(rows)


def main(args) -> int:
    if is_release():
        print("error: selfcheck solves tasks from the reference solutions, which a student copy lacks", file=sys.stderr)
        return 2
    rubric = load_rubric()
    try:
        tasks = [t.id for t in rubric.select(args.tasks)]
        chosen_solve = [t.id for t in rubric.select(args.solve)] if args.solve else None
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.rotate is not None:
        if args.rotate < 1:
            print(f"error: --rotate must be at least 1, got {args.rotate}", file=sys.stderr)
            return 2
        tasks = rotation(tasks, args.rotate)
    start = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory(prefix="tinytrain-selfcheck-") as tmp:
        base = Path(tmp) / "release"
        make_release(base)
        if chosen_solve is not None:
            solved = rubric.closure(chosen_solve)
            label = ",".join(sorted({p.split(".")[0] + ".*" for p in solved}))
            results.append(check_copy(base, Path(tmp), rubric, "half-done", solved, None, args.ranks, True))
            print(f"half-done copy ({label} solved): suite {results[-1].suite}", file=sys.stderr)
        else:
            for task in tasks:
                r = check_copy(base, Path(tmp), rubric, task, rubric.closure([task]), task, args.ranks, args.suite)
                results.append(r)
                print(f"{table([r]).splitlines()[1]}", file=sys.stderr)
    print(table(results))
    for r in results:
        if not r.ok:
            print(f"\n{r.label} (solved {', '.join(r.solved)}):")
            if r.why:
                print(f"  graded: {r.why}")
            if r.suite not in ("", "passed"):
                print(f"  suite: {r.suite}")
    bad = [r.label for r in results if not r.ok]
    print(f"\n{len(results) - len(bad)}/{len(results)} passed in {time.monotonic() - start:.0f} s")
    return 1 if bad else 0
