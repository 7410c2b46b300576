"""pytest plugin for graded tests: the ``impl`` fixture, TODO-as-skip, task markers, results log.

Loaded by the root ``conftest.py`` next to the MPI harness (``grader/mpi_plugin.py``).

* ``impl`` -- a graded test asks for it and gets the code under test from it::

      @pytest.mark.task("1.1")
      def test_reduce_scatter(impl):
          out = impl.collectives.reduce_scatter(x)

  ``impl.collectives`` is the reference module (``tinytrain.distributed.collectives``) or the
  student's assignment file (``assignments/a1_collectives.py``); for an assignment of several
  files, the reference package (``tinytrain.parallel.tensor_parallel``) or the assignment package
  (``assignments/a4_tensor_parallel/``), whose ``__init__.py`` exposes the same names. The test
  runs once for each, as ``--impl reference|assignments|all`` says (default ``all``;
  ``assignments`` in a student release). Names come from ``grader/rubric.toml`` (``name = "collectives"``).
* **TODO is a skip.** A stub raises ``NotImplementedError("TODO 1.1: ...")``; the test is then
  reported as skipped with that reason (0 points), not as a crash, and without the cost of
  formatting a failure first. Every rank runs the same stub, so every rank skips, and the
  harness (which only forwards failures) agrees.
* ``@pytest.mark.task("1.3")`` names the task a test grades; an id missing from the rubric is a
  usage error. ``--tasks 1.*`` keeps only the graded tests of matching tasks.
* ``--grader-log FILE`` -- rank 0 appends one JSON line per event (collected, start, done with the
  agreed outcome): how ``python -m grader`` follows a run and survives a crash in it.
* ``--assignments DIR`` -- load assignment files from DIR instead of ``assignments/`` (the
  grader's own tests grade planted-bug copies this way): ``DIR/a1_collectives.py``, and an
  assignment package as a folder, ``DIR/a4_tensor_parallel/``.
* In a student release, the tests of reference solutions that were removed
  (``reference_tests`` in the rubric) are skipped.
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib
import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import ClassVar

import pytest

from . import guard, seeds
from .config import ROOT, is_release, load_rubric, release_skips

_rubric = load_rubric()


def pytest_addoption(parser):
    g = parser.getgroup("tinytrain grader")
    g.addoption(
        "--impl",
        choices=("assignments",) if is_release() else ("reference", "assignments", "all"),
        default=None,
        help="code graded tests run against (default: all; a student copy has only assignments)",
    )
    g.addoption(
        "--assignments",
        metavar="DIR",
        default=None,
        help="load assignment files from DIR instead of the repository's assignments/",
    )
    g.addoption(
        "--tasks",
        metavar="PATTERNS",
        default=None,
        help="run only graded tests of these tasks, comma-separated globs: 1.*,2.3",
    )
    g.addoption(
        "--grader-log",
        metavar="FILE",
        default=None,
        help="rank 0 appends JSON lines with each test's agreed outcome (used by python -m grader)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "task(id): the assignment task a graded test belongs to")


def impl_kinds(config) -> list[str]:
    choice = config.getoption("--impl") or ("assignments" if is_release() else "all")
    return ["reference", "assignments"] if choice == "all" else [choice]


# --- the impl fixture ------------------------------------------------------------------------------


class Impl:
    """The implementations a graded test runs against: ``impl.collectives`` is a module."""

    _cache: ClassVar[dict[tuple[str, str], object]] = {}
    _refused: ClassVar[dict[tuple[str, str], dict[str, list[str]]]] = {}

    def __init__(self, kind: str, assignments_dir: str | None, task: str | None = None):
        self.kind, self._dir, self._task = kind, assignments_dir, task

    def __repr__(self) -> str:
        return f"<impl {self.kind}>"

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        a = _rubric.by_name(name)
        key = (self.kind, self._dir or "")
        if self.kind != "reference":
            self._refuse(a, key)
        if (key, name) not in self._cache:
            self._cache[(key, name)] = self._load(a)
        return self._cache[(key, name)]

    def _refuse(self, a, key) -> None:
        """Fail this test if the assignment borrows the solution in code its task needs (a problem
        in another task's function costs only that task; see guard.refused_tasks)."""
        path = Path(self._dir) / Path(a.file).name if self._dir else ROOT / a.file
        if (key, a.name) not in self._refused:
            self._refused[(key, a.name)] = guard.refused_tasks(a, path=path) if path.exists() else {}
        refused = self._refused[(key, a.name)]
        mine = refused.get(self._task) if self._task else sorted({p for ps in refused.values() for p in ps})
        if mine:
            pytest.fail(guard.refusal(a, mine), pytrace=False)

    def _load(self, a):
        if self.kind == "reference":
            return importlib.import_module(a.reference_module)
        path = Path(self._dir) / Path(a.file).name if self._dir else ROOT / a.file
        if not path.exists():
            pytest.fail(f"{path} does not exist; run `python -m grader stubs` to generate it", pytrace=False)
        if not self._dir:
            return importlib.import_module(a.module)
        if len(a.files) > 1:
            return _load_package(a, path)
        name = f"_graded_{a.name}_{abs(hash(str(path)))}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module


def _load_package(a, folder: Path):
    """An assignment package from ``folder``, imported under its own name (``a.module``): its files
    import each other absolutely (``assignments.a4_tensor_parallel.layers``), and those imports
    must find this copy, so it replaces any other copy of the package in ``sys.modules``."""
    for loaded in [m for m in sys.modules if m == a.module or m.startswith(a.module + ".")]:
        del sys.modules[loaded]
    spec = importlib.util.spec_from_file_location(
        a.module, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[a.module] = module
    spec.loader.exec_module(module)
    return module


def pytest_generate_tests(metafunc):
    if "impl" in metafunc.fixturenames:
        metafunc.parametrize("impl", impl_kinds(metafunc.config), indirect=True)


@pytest.fixture
def impl(request):
    task = task_of(request.node)
    with _required_elsewhere(request.param, task):
        yield Impl(request.param, request.config.getoption("--assignments"), task)


def _required_elsewhere(kind: str, task: str | None):
    """In a student copy, a test of ``task`` that runs framework code calling another assignment's
    reference (ZeRO-3's layers recompute with 8.1's ``checkpoint``) finds a stub there: for the test,
    tinytrain runs the student's code of the tasks it requires from other assignments instead
    (``assignments/``, also under ``--assignments``). Elsewhere the reference is whole: nothing."""
    if not (is_release() and kind == "assignments" and task in _rubric.tasks):
        return contextlib.nullcontext()
    own = _rubric.tasks[task].assignment
    others = [t for t in _rubric.closure([task]) if _rubric.tasks[t].assignment != own]
    if not others:
        return contextlib.nullcontext()
    from assignments.use import tasks_in_use

    return tasks_in_use(others)


# --- selection: task markers, --tasks, reference tests in a release --------------------------------


def task_of(item) -> str | None:
    marker = item.get_closest_marker("task")
    return str(marker.args[0]) if marker and marker.args else None


def pytest_collection_modifyitems(config, items):
    for item in items:
        task = task_of(item)
        if item.get_closest_marker("task") and task not in _rubric.tasks:
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.task({task!r}) is not a task in grader/rubric.toml")
    patterns = [p for p in (config.getoption("--tasks") or "").split(",") if p]
    if patterns:
        keep = [i for i in items if task_of(i) and any(fnmatch.fnmatchcase(task_of(i), p) for p in patterns)]
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep
    if is_release():
        removed = {p: a for a in _rubric.assignments.values() for p in a.reference_tests}
        skips = release_skips()
        for item in items:
            reason = next((why for prefix, why in skips.items() if item.nodeid.startswith(prefix)), None)
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"student copy: this test {reason}"))
            for prefix, a in removed.items():
                if item.nodeid.startswith(prefix):
                    item.add_marker(
                        pytest.mark.skip(
                            reason=f"tests the reference solution of assignment {a.id}, which this student "
                            f"copy does not contain; grade your {a.file} with python -m grader"
                        )
                    )


# --- NotImplementedError("TODO ...") is a skip -----------------------------------------------------


def todo_message(excinfo) -> str | None:
    """The TODO message if the test stopped at a stub, else None."""
    if excinfo is None or not excinfo.errisinstance(NotImplementedError):
        return None
    message = str(excinfo.value)
    return message if message.startswith("TODO") else None


@pytest.hookimpl(tryfirst=True, specname="pytest_runtest_makereport")
def pytest_runtest_makereport_todo(item, call):  # the name must start with pytest_
    """A stub's NotImplementedError is reported as a skip, before the harness sees a failure. The
    report is made here, not by pytest: pytest would first format the failure it is not, with the
    source of every frame (a tenth of a second per test on a busy machine, and a student copy's
    suite or a grader run of the stubs has hundreds of TODOs)."""
    todo = todo_message(call.excinfo)
    if todo is None:
        return None
    task = task_of(item)
    reason = todo if not task or todo.startswith(f"TODO {task}:") else f"{todo} (needed by task {task})"
    return pytest.TestReport(
        item.nodeid,
        item.location,
        dict.fromkeys(item.keywords, 1),
        "skipped",
        (str(item.path), item.location[1] or 0, reason),
        call.when,
        [(f"Captured {key} {when}", content) for when, key, content in item._report_sections],
        call.duration,
        start=call.start,
        stop=call.stop,
        user_properties=item.user_properties,
    )


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_makereport(item, call):
    """What a failed test's report says: a TODO of a framework chapter in a student copy is a skip
    too; else numpy's message first, and the replay seed."""
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and is_release() and task_of(item) is None and (todo := todo_in_output(rep)):
        # A framework test that runs a program (tinytrain train --dp 2, a notebook) stopped at one of
        # the framework's own chapters, which a student copy cuts out: unfinished there, not failed.
        rep.outcome = "skipped"
        rep.longrepr = (
            str(item.path),
            item.location[1] or 0,
            f"{todo} -- this test runs tinytrain's own chapter, which this student copy cuts out "
            "(your assignments/ are graded by python -m grader)",
        )
    elif rep.failed:
        crash = getattr(rep.longrepr, "reprcrash", None)
        if crash is not None:
            crash.message = numpy_message_first(crash.message)
        _add_replay_hint(rep)


_TODO_IN_OUTPUT = re.compile(r"NotImplementedError: (TODO \d+\.\d+)\b")


def todo_in_output(rep) -> str | None:
    """The first ``TODO x.y`` (with its task's title) a failed test's output shows a program raising."""
    text = str(rep.longrepr) + "".join(text for _, text in rep.sections)
    m = _TODO_IN_OUTPUT.search(re.sub(r"\x1b\[[0-9;]*m", "", text))  # a notebook's traceback has colours
    if m is None:
        return None
    task = _rubric.tasks.get(m.group(1).removeprefix("TODO "))
    return f"{m.group(1)} ({task.title})" if task else m.group(1)


_NUMPY_HEADS = ("Not equal to tolerance", "Arrays are not equal", "Arrays are not almost equal")


def numpy_message_first(message: str) -> str:
    """numpy's assertions start with an empty line and bury the test's ``err_msg`` (what was
    compared) under the tolerance: put what, the tolerance and the worst difference on line one."""
    lines = message.strip().splitlines()
    if len(lines) < 3 or lines[0].strip() != "AssertionError:" or not lines[1].startswith(_NUMPY_HEADS):
        return message
    facts = [ln.strip() for ln in lines[3:] if ln.startswith(("Mismatched elements", "Max absolute difference"))]
    first = f"AssertionError: {lines[2].strip()}: {'; '.join([lines[1].strip(), *facts])}"
    return "\n".join([first, *lines[1:]])


def _add_replay_hint(rep) -> None:
    """Every failure of a test that drew a seed says how to replay it -- an exception raised in
    the student's code (an MPI error, an IndexError) as much as an assertion that names it."""
    hint = seeds.replay_hint()
    crash = getattr(rep.longrepr, "reprcrash", None)
    if not hint or crash is None or f"TINYTRAIN_GRADER_SEED={seeds.base_seed()}" in crash.message:
        return
    first, newline, rest = crash.message.strip().partition("\n")  # the first line is what is shown
    crash.message = f"{first} [{hint}]{newline}{rest}"
    rep.sections.append(("replay", hint))


# --- the results log for python -m grader ----------------------------------------------------------


class _Log:
    def __init__(self, path: str):
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the whole session
        self.reports: dict[str, list] = {}

    def write(self, **event) -> None:
        self.file.write(json.dumps(event) + "\n")
        self.file.flush()


_log: _Log | None = None


def _rank() -> int:
    from tinytrain.distributed._mpi import MPI

    return MPI.COMM_WORLD.Get_rank()


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    global _log
    path = session.config.getoption("--grader-log")
    if path and _rank() == 0:
        _log = _Log(path)
        _log.write(event="collected", tests=[{"nodeid": i.nodeid, "task": task_of(i)} for i in session.items])


def pytest_runtest_logstart(nodeid, location):
    if _log:
        _log.reports[nodeid] = []
        _log.write(event="start", nodeid=nodeid)


def pytest_runtest_logreport(report):
    if _log and report.nodeid in _log.reports:
        _log.reports[report.nodeid].append(report)


def pytest_runtest_logfinish(nodeid, location):
    if _log:
        outcome, message, text = summarize(_log.reports.pop(nodeid, []))
        _log.write(event="done", nodeid=nodeid, outcome=outcome, message=message, output=text)


def pytest_sessionfinish(session, exitstatus):
    if _log:  # the run ended normally: python -m grader counts only such runs as finished
        _log.write(event="finished", status=int(exitstatus))


def summarize(reports) -> tuple[str, str, str]:
    """(passed|failed|todo|skipped, first line of what went wrong, full text) of one test."""
    for rep in reports:
        if rep.failed:
            crash = getattr(rep.longrepr, "reprcrash", None)
            message = crash.message if crash is not None else str(rep.longrepr).strip().splitlines()[-1:]
            if isinstance(message, list):
                message = message[0] if message else "failed"
            when = "" if rep.when == "call" else f" (in {rep.when})"
            return "failed", message + when, str(rep.longrepr)[-8000:]
    for rep in reports:
        if rep.skipped:
            reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
            reason = reason.removeprefix("Skipped: ")
            return ("todo" if reason.startswith("TODO") else "skipped"), reason, reason
    return "passed", "", ""
