"""``python -m grader``: grade the assignments, regenerate stubs, or make a student release.

    python -m grader                         # grade assignments/ on 4 ranks, print the score table
    python -m grader --tasks 1.1 1.3         # only some tasks (globs: 1.*)
    python -m grader --impl reference        # the reference must score full marks (not in a student copy)
    python -m grader --out results/          # where results.json and junit.xml go (default: out/grader)
    python -m grader stubs [--check]         # regenerate assignments/ from the reference markers
    python -m grader release OUT             # a solution-free copy of the repository for students
    python -m grader mutants [--ci]          # the mutation suite: planted bugs, catch rate per assignment
    python -m grader report                  # report.md: each assignment's analysis, measured on your code
    python -m grader hints [--level full]    # how much each stub's hint gives away (share of the solution's names)
    python -m grader leaks [--show 1.1]      # how much of each solution the copy holds (handouts, stand-ins, ...)
    python -m grader selfcheck [--suite]     # each task solved alone in a fresh student copy must score in full
    python -m grader gradescope OUT.zip      # a Gradescope autograder: setup.sh, run_autograder, a student copy
    python -m grader collect DIR... [--out scores.csv]   # a class's results.json in one table, a column per task

Grading exits 0 whenever it ran (a low score is not an error); 2 for a usage error.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import time
from pathlib import Path

from . import guard, report
from .config import ROOT, is_release, load_rubric
from .exits import GRADER_BUDGET
from .run import RunOptions, harness_deadline, run_tests
from .stubs import HINT_LEVELS

DEFAULT_OUT = ROOT / "out" / "grader"  # /out/ is in .gitignore: grading leaves the repository clean


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m grader",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--ranks", type=int, default=4, help="MPI ranks to grade with (default 4)")
    p.add_argument("--tasks", nargs="+", metavar="PATTERN", help="tasks to grade, e.g. 1.* or 1.2 1.3 (default: all)")
    if not is_release():  # a student copy has no reference solution to grade
        p.add_argument(
            "--impl",
            choices=("assignments", "reference"),
            default="assignments",
            help="grade your assignment files (default) or the reference solution",
        )
    p.add_argument("--assignments", metavar="DIR", help="grade the assignment files in DIR instead of assignments/")
    p.add_argument(
        "--out",
        metavar="DIR",
        default=str(DEFAULT_OUT),
        help="where results.json and junit.xml go (default: out/grader, which git ignores)",
    )
    p.add_argument(
        "--summary",
        metavar="FILE",
        help="also append the score table in Markdown to FILE (the GitHub workflow passes $GITHUB_STEP_SUMMARY)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=GRADER_BUDGET,
        help="budget of one test in seconds (default 60): the harness ends a test at 70%% of it with every "
        "rank's Python stacks; the grader kills a run that is still going at 100%%",
    )
    p.add_argument(
        "--comm-timeout",
        type=float,
        default=10.0,
        help="seconds any single communication may wait (TINYTRAIN_TIMEOUT, default 10)",
    )
    sub = p.add_subparsers(
        dest="command",
        metavar="{stubs,release,report}"
        if is_release()
        else "{stubs,release,report,mutants,hints,leaks,selfcheck,gradescope,collect}",
    )
    s = sub.add_parser("stubs", help="regenerate assignments/ from the solution markers in the reference")
    s.add_argument("--check", action="store_true", help="only check: exit 1 with a diff when assignments/ is stale")
    r = sub.add_parser("release", help="write a solution-free copy of the repository for students")
    r.add_argument("out", metavar="OUT", help="folder to create (must not exist)")
    r.add_argument(
        "--hints",
        choices=HINT_LEVELS,
        default="brief",
        help="what each stub's TODO says: brief (default) the intent, full the steps, none only the task",
    )
    a = sub.add_parser("report", help="write report.md: each assignment's analysis, measured on your code")
    a.add_argument("--out", default="report.md", help="where to write it (default report.md)")
    a.add_argument("--assignments", nargs="+", metavar="N", help="only these assignments (default: all)")
    if is_release():  # the mutation suite plants bugs into the reference solutions: not in a copy
        return p
    h = sub.add_parser("hints", help="how much each stub's hint gives away: the share of its solution's names it names")
    h.add_argument("--level", choices=HINT_LEVELS, default="brief", help="the hint level to measure (default brief)")
    lk = sub.add_parser(
        "leaks", help="how much of each solution the copy already holds: its expressions found elsewhere"
    )
    lk.add_argument("--level", choices=HINT_LEVELS, default="brief", help="the copy's hint level (default brief)")
    lk.add_argument("--show", nargs="+", metavar="TASK", help="list what these tasks' regions leak, and from where")
    c = sub.add_parser("selfcheck", help="solve tasks one at a time in fresh student copies; each must score in full")
    c.add_argument("--tasks", nargs="+", metavar="PATTERN", help="tasks to check (default: all)")
    c.add_argument("--suite", action="store_true", help="also run each copy's whole test suite (slow)")
    c.add_argument("--rotate", type=int, metavar="K", help="only K of the chosen tasks, a different K each day (CI)")
    c.add_argument("--solve", nargs="+", metavar="PATTERN", help="one half-done copy: these tasks solved, suite green")
    c.add_argument("--ranks", type=int, default=4, help="MPI ranks (default 4)")
    g = sub.add_parser("gradescope", help="write a Gradescope autograder zip: setup.sh, run_autograder, a student copy")
    g.add_argument("out", metavar="OUT.zip", help="the zip to write (must not exist)")
    g.add_argument("--tasks", nargs="+", metavar="PATTERN", help="what each submission is graded on (default: all)")
    g.add_argument("--hints", choices=HINT_LEVELS, default="brief", help="the copy's hint level (default brief)")
    k = sub.add_parser("collect", help="a class's scores: many copies' results.json in one table and CSV")
    k.add_argument("dirs", nargs="+", metavar="DIR", help="student copies, folders holding results.json, or the files")
    k.add_argument("--out", metavar="FILE", help="also write the table as CSV (scores.csv)")
    m = sub.add_parser("mutants", help="plant realistic bugs in the reference solutions; every one must be caught")
    m.add_argument("--ci", action="store_true", help="only the representative subset CI runs")
    m.add_argument("--only", nargs="+", metavar="PATTERN", help="only mutants of these tasks (1.* or 2.3)")
    return p


class Progress:
    """One line that updates in place on a terminal (one line per test otherwise)."""

    def __init__(self, stream=sys.stderr):
        self.stream, self.tty = stream, stream.isatty()

    def __call__(self, done: int, total: int, result) -> None:
        name = result.nodeid.split("::")[-1]
        line = f"[{done}/{total}] task {result.task} {name}: {result.outcome}"
        if self.tty:
            self.stream.write("\r\033[K" + line[:120])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()


def grade(args) -> int:
    rubric = load_rubric()
    for flag, value in (("--ranks", args.ranks), ("--timeout", args.timeout)):
        if not value > 0:  # also refuses nan
            print(f"error: {flag} must be positive, got {value:g}", file=sys.stderr)
            return 2
    if not 0 < args.comm_timeout < harness_deadline(args.timeout):
        print(
            f"error: --comm-timeout {args.comm_timeout:g} must be positive and below the harness's deadline "
            f"{harness_deadline(args.timeout):.3g} s (70% of --timeout {args.timeout:g}); raise --timeout or "
            "lower --comm-timeout",
            file=sys.stderr,
        )
        return 2
    try:
        tasks = rubric.select(args.tasks)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if Path(args.out).exists() and not Path(args.out).is_dir():
        print(
            f"error: --out {args.out} is not a folder this grader can write (it is a file); choose a folder",
            file=sys.stderr,
        )
        return 2
    try:  # before any test runs: a run of minutes must not end in a traceback about its results folder
        Path(args.out).mkdir(parents=True, exist_ok=True)
        probe = Path(args.out) / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        print(
            f"error: --out {args.out} is not a folder this grader can write ({exc.strerror}); choose another",
            file=sys.stderr,
        )
        return 2
    if args.summary:
        try:  # the same: a summary file that cannot be written is told before the tests
            with open(args.summary, "a"):
                pass
        except OSError as exc:
            why = f"cannot be written ({exc.strerror}); choose another file"
            print(f"error: --summary {args.summary} {why}", file=sys.stderr)
            return 2
    if not (shutil.which("mpirun") or shutil.which("mpiexec")):
        print(
            "error: mpirun not found: activate the virtual environment you installed into (. .venv/bin/activate), "
            'or pip install -e ".[dev]" (it brings the mpich wheel), or put your MPI\'s mpirun on PATH',
            file=sys.stderr,
        )
        return 2
    problems, runnable = [], []
    refused: dict[str, str] = {}  # task id -> why it is not graded
    args.impl = getattr(args, "impl", "assignments")
    if args.impl == "assignments":
        for a in {t.assignment for t in tasks}:
            path = Path(args.assignments) / Path(rubric.assignments[a].file).name if args.assignments else None
            for task, found in guard.refused_tasks(rubric.assignments[a], path=path).items():
                refused[task] = guard.refusal(rubric.assignments[a], found)
        for message in dict.fromkeys(refused.values()):
            print(message, file=sys.stderr)
    runnable = [t for t in tasks if t.id not in refused]

    progress = Progress()
    start = time.monotonic()
    print(f"grading {len(runnable)} task(s) of {args.impl} on {args.ranks} ranks ...", file=sys.stderr)
    results = []
    if runnable:
        opts = RunOptions(
            ranks=args.ranks,
            impl=args.impl,
            tasks=[t.id for t in runnable],
            assignments=args.assignments,
            timeout=args.timeout,
            comm_timeout=args.comm_timeout,
            progress=progress,
        )
        results, problems = run_tests(opts)
    progress.close()
    scores = report.score_tasks(tasks, results, problems)
    for s in scores:
        if s.task.id in refused:
            s.reason = refused[s.task.id].splitlines()[0]
    print(report.table(scores))
    for p in problems:
        print(f"\nproblem: {p}")
    res, junit = report.write_results(scores, Path(args.out), problems + list(dict.fromkeys(refused.values())))
    if args.summary:
        with open(args.summary, "a") as f:  # GitHub's summary file may hold earlier steps' text
            f.write(f"## tinytrain grader\n\n{report.markdown(scores)}")
    print(f"\n{time.monotonic() - start:.0f} s; wrote {res} and {junit}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if is_release() and any(a == "--impl" or a.startswith("--impl=") for a in argv):
        print(
            "error: a student copy grades only your assignments (it has no reference solution): drop --impl",
            file=sys.stderr,
        )
        return 2
    args = _parser().parse_args(argv)
    refused = _refused(args)
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    if args.command == "stubs":
        from .stubs import main as stubs_main

        return stubs_main(check=args.check)
    if args.command == "release":
        from .release import main as release_main

        return release_main(args.out, args.hints)
    if args.command == "mutants":
        return _mutants(args)
    if args.command == "report":
        from .analysis import main as report_main

        return report_main(args.out, args.assignments)
    if args.command == "hints":
        from .hints import main as hints_main

        return hints_main(args.level)
    if args.command == "leaks":
        from .leaks import main as leaks_main

        return leaks_main(args.level, args.show)
    if args.command == "gradescope":
        from .gradescope import main as gradescope_main

        return gradescope_main(args.out, args.tasks, args.hints)
    if args.command == "collect":
        from .collect import main as collect_main

        return collect_main(args.dirs, args.out)
    if args.command == "selfcheck":
        from .selfcheck import main as selfcheck_main

        return selfcheck_main(args)
    return grade(args)


def _refused(args) -> str | None:
    """What is wrong with paths and counts, before any copy is built or job launched (exit 2)."""
    ranks = getattr(args, "ranks", None)
    if ranks is not None and ranks < 1:
        return f"--ranks must be positive, got {ranks}"
    folder = getattr(args, "assignments", None)
    if args.command is None and folder and not Path(folder).is_dir():
        return f"--assignments {folder} is not a folder: give the folder that holds your a*_*.py files"
    for d in getattr(args, "dirs", None) or ():
        if not Path(d).exists():
            return f"collect {d}: no such file or folder (give the folders or results.json files to collect)"
    return None


def _mutants(args) -> int:
    path = ROOT / "tests" / "grader" / "mutants.py"
    if not path.exists():
        print("error: the mutation suite needs the reference solutions; a student copy has none", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("tinytrain_mutants", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module.main(ci=args.ci, tasks=args.only)


if __name__ == "__main__":
    sys.exit(main())
