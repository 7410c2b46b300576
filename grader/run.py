"""Run the graded tests under ``mpirun`` and collect each test's agreed outcome.

One ``mpirun -n R python -m pytest tests/graded ...`` runs all selected tasks; rank 0 writes a
JSON line per event (``--grader-log``, see ``impl_plugin.py``): collected, each test's start and
agreed outcome, and ``finished`` when the session ended normally. Student code can still take
that run down: a hang, an endless loop, a segfault, an ``MPI_Abort``. So:

* **Two deadlines that cannot race.** The harness bounds every test by ``TINYTRAIN_TEST_TIMEOUT``
  = ``HARNESS_SHARE`` of the grader's budget (``--timeout``): past it each rank prints its Python
  stacks and the job aborts with exit status 87 (``EXIT_DEADLINE``). The grader's own budget --
  no event for ``timeout`` seconds, counted from the test's start like the harness's -- only
  catches a run whose harness could not act (a rank holding the GIL in C code); it kills the
  process group. Once a rank has printed the harness's deadline banner the grader waits
  ``HARNESS_GRACE`` seconds more, so a harness busy printing stacks on a loaded machine is not
  killed in the act. Each ending is told apart by its own exit status or by the kill.
* **Only tests that ran to the end count.** A run is "finished" only if mpirun exited with one of
  pytest's statuses *and* rank 0 logged the session's end; anything else (an ``MPI_Abort(1)`` in
  the student's code exits with pytest's "tests failed" status) is a crash. The test that was
  running fails with what happened (hang, crash, abort) and the output with the stacks; a test
  that never ran is "not run", so its task scores nothing.
* After a crash or a kill, the running test's task is done (it has failed), and a fresh
  ``mpirun`` runs the tests that had not run yet. A crash therefore costs only its own task.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .config import ROOT
from .exits import DEADLINE_BANNER, EXIT_DEADLINE, EXIT_ERROR, GRADER_BUDGET, HARNESS_SHARE, RAISED_BEFORE_HANG

PYTEST_STATUSES = (0, 1, 5)  # all passed, some failed, none collected


@dataclass
class TestResult:
    nodeid: str
    task: str
    outcome: str  # passed | failed | todo | skipped | not run
    message: str = ""
    output: str = ""
    seconds: float = 0.0


@dataclass
class RunOptions:
    ranks: int = 4
    impl: str = "assignments"
    tasks: list[str] = field(default_factory=list)  # task ids to run
    assignments: str | None = None  # --assignments DIR
    timeout: float = GRADER_BUDGET  # the budget: seconds one test may take before the run is called hung
    comm_timeout: float = 10.0  # TINYTRAIN_TIMEOUT for the graded run
    tests: str = "tests/graded"
    progress: object = None  # callable(done, total, result) or None


def mpi_environment() -> dict:
    """This environment minus what the launcher of this rank set for its own ranks (the user's MPI
    settings pass through), so mpirun can run from inside an MPI rank (``tinytrain.launcher``)."""
    from tinytrain import launcher

    return launcher.nested_environment()


def _command(opts: RunOptions, log: Path, nodeids: list[str] | None) -> list[str]:
    from tinytrain import launcher

    launch = launcher.mpirun_command(opts.ranks)
    if launcher.kind(launch[0]) in ("mpich", "impi"):
        launch.insert(1, "-print-all-exitcodes")  # hydra's: names a rank that dies without Python
    cmd = [
        *launch,
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--impl",
        opts.impl,
        "--grader-log",
        str(log),
        "--tasks=" + ",".join(opts.tasks),
    ]
    if opts.assignments:
        cmd += ["--assignments", str(opts.assignments)]
    return cmd + (nodeids if nodeids else [opts.tests])


_EXIT_CODES = re.compile(r"Exit codes: \[[^\]]*\] ([\d,]+)")
# Open MPI's prterun names the first rank that ended badly, by one of two banners.
_OMPI_EXITED = re.compile(r"Process name: \[[^\]]*,(\d+)\]\s+Exit code:\s+(\d+)")
_OMPI_SIGNALED = re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on\s+signal (\d+)")


def dead_ranks(output: str) -> str:
    """Which rank ended without Python (os._exit, a signal), from what the launcher reports: hydra's
    (MPICH, Intel MPI) exit codes in rank order (a wait status: 768 = exited with 3; a signal number:
    11 = SIGSEGV; 9 for the ranks that hydra itself killed once one was gone), or Open MPI's banner
    on the first rank that ended. '' when the output does not tell."""
    m = _EXIT_CODES.search(output)
    if m is None:
        exited, signaled = _OMPI_EXITED.search(output), _OMPI_SIGNALED.search(output)
        if exited:
            return f"rank {exited.group(1)} {_how(int(exited.group(2)) << 8)}"
        return f"rank {signaled.group(1)} {_how(int(signaled.group(2)))}" if signaled else ""
    codes = [int(c) for c in m.group(1).split(",")]
    culprits = [(r, c) for r, c in enumerate(codes) if c not in (0, 9)] or [(r, c) for r, c in enumerate(codes) if c]
    return "; ".join(f"rank {r} {_how(c)}" for r, c in culprits)


def _how(code: int) -> str:
    """A wait status in words: 768 exited with 3; 11 killed by SIGSEGV."""
    if code >= 256:
        return f"exited with status {code >> 8} (os._exit, or exit() in C code)"
    try:
        return f"was killed by signal {code} ({signal.Signals(code).name})"
    except ValueError:
        return f"ended with code {code}"


def _read(log: Path, pos: int) -> tuple[list[dict], int]:
    """New complete JSON lines of the log since byte ``pos``."""
    try:
        with open(log) as f:
            f.seek(pos)
            chunk = f.read()
    except FileNotFoundError:
        return [], pos
    lines = chunk.split("\n")
    complete = lines[:-1]  # the last piece may be a line still being written
    return [json.loads(x) for x in complete if x.strip()], pos + len(chunk) - len(lines[-1])


def _one_run(opts: RunOptions, nodeids: list[str] | None, workdir: Path, on_event) -> tuple[str, str]:
    """One mpirun; calls ``on_event`` per log line. Returns (how it ended, output tail)."""
    log = workdir / f"log{time.monotonic_ns()}.jsonl"
    out = open(workdir / "output.txt", "w+")
    env = mpi_environment()
    env["TINYTRAIN_TIMEOUT"] = str(opts.comm_timeout)
    env["TINYTRAIN_TEST_TIMEOUT"] = f"{harness_deadline(opts.timeout):.3g}"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    proc = subprocess.Popen(
        _command(opts, log, nodeids), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )
    pos, last = 0, time.monotonic()
    ended, logged_end = "finished", []

    def seen(ev):
        if ev["event"] == "finished":
            logged_end.append(ev)
        on_event(ev)

    while True:
        rc = proc.poll()
        events, pos = _read(log, pos)
        for ev in events:
            last = time.monotonic()
            seen(ev)
        if rc is not None:
            break
        budget = opts.timeout if pos else max(opts.timeout, STARTUP_BUDGET)  # pos: some event was logged
        if time.monotonic() - last > budget and _harness_is_ending_it(out):
            budget += HARNESS_GRACE  # its stacks are being printed: let it finish and abort by itself
        if time.monotonic() - last > budget:
            ended = (
                f"hung: no progress for {budget:g} s (the grader's budget) and the harness did not end the "
                "test (code holding the interpreter in C?), so the run was killed"
            )
            _kill(proc)
            break
        time.sleep(0.05)
    events, pos = _read(log, pos)
    for ev in events:
        seen(ev)
    if ended == "finished":
        ended = _how_it_ended(proc.returncode, bool(logged_end), opts.timeout)
    out.seek(0)
    text = out.read()
    dead = dead_ranks(text) if ended.startswith("crashed") else ""
    if dead:
        ended = f"crashed: {dead}, before the tests finished (mpirun exited with status {proc.returncode})"
    return ended, text[-OUTPUT_TAIL:]


STARTUP_BUDGET = 120.0  # seconds mpirun may take to start and collect the tests (imports on a busy machine)
# Seconds the grader waits past its budget once the harness has begun ending the test itself: printing
# every rank's stacks and aborting takes a moment on a busy machine, and killing the run meanwhile would
# lose the stacks and report "the harness did not end the test" when it did.
HARNESS_GRACE = 10.0


def _harness_is_ending_it(out) -> bool:
    """Has a rank printed the harness's deadline banner (so the harness is ending the test)?"""
    with open(out.name, errors="replace") as f:
        return DEADLINE_BANNER in f.read()


OUTPUT_TAIL = 24000  # characters of mpirun's output kept: enough for every rank's stacks


def harness_deadline(budget: float) -> float:
    """The harness's per-test deadline for a grader budget: well inside it (stacks take ~2 s)."""
    return HARNESS_SHARE * budget


def _how_it_ended(status: int, logged_end: bool, budget: float) -> str:
    if status == EXIT_DEADLINE:
        return (
            f"hung: the test ran past its deadline of {harness_deadline(budget):.3g} s (an endless loop, or a "
            "rank waiting for something that never comes); every rank's Python stack is in the output"
        )
    if status == EXIT_ERROR:
        return "aborted: the test harness ended the job (its message is in the output)"
    if status in PYTEST_STATUSES and logged_end:
        return "finished"
    return (
        f"crashed: mpirun exited with status {status} before the tests finished (a crash, an MPI_Abort or "
        "sys.exit in the code under test?)"
    )


_RAISED = re.compile(re.escape(RAISED_BEFORE_HANG).replace(r"\{rank\}", r"(?P<rank>\d+)") + r"(?P<what>.*)")


def raised_before_the_end(output: str) -> str:
    """What the ranks that had raised in the test said before a hang ended it ('' if none had):
    'rank 1 raised ValueError: ... (assignments/a1_collectives.py:70, in ...)'. That exception, not
    the hang it left behind on another rank, is what a student must mend first."""
    said = {m["rank"]: m["what"].strip() for m in _RAISED.finditer(output)}
    return "; ".join(f"rank {r} raised {what}" for r, what in sorted(said.items(), key=lambda kv: int(kv[0])))


def _kill(proc) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=3)
            return
        except subprocess.TimeoutExpired:
            continue


def run_tests(opts: RunOptions) -> tuple[list[TestResult], list[str]]:
    """Run the selected graded tests, restarting after crashes. Returns (results, problems)."""
    results: dict[str, TestResult] = {}
    planned: list[dict] = []
    problems: list[str] = []
    failed_tasks: set[str] = set()
    state = {"current": None, "started": 0.0}

    def on_event(ev):
        if ev["event"] == "collected" and not planned:
            planned.extend(ev["tests"])
        elif ev["event"] == "start":
            state["current"], state["started"] = ev["nodeid"], time.monotonic()
        elif ev["event"] == "done":
            task = next((t["task"] for t in planned if t["nodeid"] == ev["nodeid"]), None) or "?"
            r = TestResult(
                ev["nodeid"], task, ev["outcome"], ev["message"], ev["output"], time.monotonic() - state["started"]
            )
            results[r.nodeid] = r
            state["current"] = None
            if opts.progress:
                opts.progress(len(results), len(planned), r)

    with tempfile.TemporaryDirectory(prefix="tinytrain-grader-") as tmp:
        remaining = None
        for _attempt in range(len(opts.tasks) + 2):
            ended, tail = _one_run(opts, remaining, Path(tmp), on_event)
            if ended == "finished":
                if not planned:  # nothing collected: the tests could not even start
                    problems.append(f"the graded tests did not start:\n{tail}")
                break
            current = state["current"]
            if current is None:
                problems.append(f"the run {ended}, between tests:\n{tail}")
            else:
                task = next((t["task"] for t in planned if t["nodeid"] == current), "?")
                raised = raised_before_the_end(tail)
                message = f"{raised}, and then the run {ended}" if raised else ended
                results[current] = TestResult(current, task, "failed", message, f"{message}\n\nlast output:\n{tail}")
                failed_tasks.add(task)
                state["current"] = None
            remaining = [t["nodeid"] for t in planned if t["nodeid"] not in results and t["task"] not in failed_tasks]
            if not remaining:
                break
    for t in planned:  # a test that never ran earns nothing, and says why
        if t["nodeid"] not in results:
            why = "its task already failed" if t["task"] in failed_tasks else "the run ended before it"
            results[t["nodeid"]] = TestResult(t["nodeid"], t["task"] or "?", "not run", why)
    return [results[t["nodeid"]] for t in planned], problems
