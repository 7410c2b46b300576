"""Run the graded tests under ``mpirun`` and collect each test's agreed outcome.

One ``mpirun -n R python -m pytest tests/graded ...`` runs all selected tasks; rank 0 writes a
JSON line per finished test (``--grader-log``, see ``impl_plugin.py``). Student code can still take
that run down: a hang outside tinytrain's deadlines, a segfault, an ``MPI_Abort``. So:

* the log is followed while the run goes on; when no test finishes for ``timeout`` seconds the
  whole process group is killed (a hang);
* after a crash or a kill, the test that was running fails with what happened, its task is
  done (it has failed), and a fresh ``mpirun`` runs the tests that had not run yet.

A crash therefore costs only the task whose test was running.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .config import ROOT


@dataclass
class TestResult:
    nodeid: str
    task: str
    outcome: str  # passed | failed | todo | skipped
    message: str = ""
    output: str = ""
    seconds: float = 0.0


@dataclass
class RunOptions:
    ranks: int = 4
    impl: str = "assignments"
    tasks: list[str] = field(default_factory=list)  # task ids to run
    assignments: str | None = None  # --assignments DIR
    timeout: float = 60.0  # seconds without a finished test before the run is called hung
    comm_timeout: float = 10.0  # TINYTRAIN_TIMEOUT for the graded run
    tests: str = "tests/graded"
    progress: object = None  # callable(done, total, result) or None


def mpi_environment() -> dict:
    """This environment minus any MPI launcher's variables, so mpirun can run from inside an MPI rank."""
    prefixes = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "OMPI_", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}


def _command(opts: RunOptions, log: Path, nodeids: list[str] | None) -> list[str]:
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        raise RuntimeError(
            "mpirun not found: pip install mpich (it is in the [dev] extra), or put your MPI's mpirun on PATH"
        )
    cmd = [
        mpirun,
        "-n",
        str(opts.ranks),
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
    env["TINYTRAIN_TEST_TIMEOUT"] = str(opts.timeout)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    proc = subprocess.Popen(
        _command(opts, log, nodeids), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )
    pos, last = 0, time.monotonic()
    ended = "finished"
    while True:
        rc = proc.poll()
        events, pos = _read(log, pos)
        for ev in events:
            last = time.monotonic()
            on_event(ev)
        if rc is not None:
            break
        if time.monotonic() - last > opts.timeout:
            ended = f"hung: no test finished for {opts.timeout:.0f} s, so the run was killed"
            _kill(proc)
            break
        time.sleep(0.05)
    events, pos = _read(log, pos)
    for ev in events:
        on_event(ev)
    if ended == "finished" and proc.returncode not in (0, 1, 5):  # pytest: ok, tests failed, none ran
        ended = f"crashed: mpirun exited with status {proc.returncode} (a crash or MPI_Abort in the code under test?)"
    out.seek(0)
    return ended, out.read()[-3000:]


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
                results[current] = TestResult(current, task, "failed", ended, f"{ended}\n\nlast output:\n{tail}")
                failed_tasks.add(task)
                state["current"] = None
            remaining = [t["nodeid"] for t in planned if t["nodeid"] not in results and t["task"] not in failed_tasks]
            if not remaining:
                break
    return [results[t["nodeid"]] for t in planned if t["nodeid"] in results], problems
