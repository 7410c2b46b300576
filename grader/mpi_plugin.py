"""pytest plugin that makes ``mpirun -n N python -m pytest`` behave like one test run.

Loaded by the root ``conftest.py`` (``pytest_plugins = ["grader.mpi_plugin"]``). Every rank runs
pytest over the same tests in the same order; this plugin coordinates them:

* **One report.** Only rank 0 prints. After each test the ranks send rank 0 their outcome; a test
  passes only if it passed on every rank that ran it, and a failure on any rank is shown under
  ``rank k``. All ranks then agree on the outcome, so every rank's exit status is the same.
* **Fresh communicator per test.** Before each test the plugin splits a new communicator off the
  harness's own and installs it as ``tinytrain.distributed``'s world; after the test it is freed.
  A message one test left behind can never be received by the next one. (After a *failed* test
  the communicators are not freed: MPI may recycle a freed communicator's id, and a stray message
  of the failed test could then match a receive of a later test. That leaks a few ids per failure.)
* **World size.** ``@pytest.mark.world_size(n)`` runs the test on ranks ``0..n-1`` with a world of
  ``n`` ranks; extra ranks sit out (they wait, asleep, for the outcome). With fewer than ``n`` ranks
  the test is skipped with "run with mpirun -n n". A test without the marker is a single-process
  test: it runs on rank 0 only, with a one-rank world, so ``python -m pytest`` and ``mpirun -n 4
  python -m pytest`` both run it exactly once.
* **Failures travel fast.** When a test fails on one rank, that rank posts a failure notice (see
  ``tinytrain/distributed/watchdog.py``), so ranks blocked in a collective with it raise
  ``PeerFailure`` at once instead of waiting for their deadline.
* **Test settings.** Unless already set: ``TINYTRAIN_TIMEOUT=20`` (seconds per communication wait)
  and ``TINYTRAIN_DEBUG=1`` (collective signatures cross-checked).
* **No hang, anywhere.** Every wait of the harness itself polls with a deadline. A watchdog thread
  on every rank bounds each whole test (setup, call, teardown and the outcome agreement) by
  ``TINYTRAIN_TEST_TIMEOUT`` seconds (default: the grader's 42 for a graded test, 180 for any
  other): past it -- a rank stuck in pure Python, in a
  blocking MPI call, in a collective the others never reach -- every rank prints its Python stacks
  (``faulthandler``) with the test's replay seed, and the job is aborted with exit status 87
  (``EXIT_DEADLINE``). Every rank arms it when the test starts, so all ranks print.
* **An error escapes: the job ends.** An exception that escapes the harness on one rank (not a
  test failure: pytest reports those), an internal pytest error, or ranks that collected different
  tests (an import failing on one rank only) is printed once, by that rank with its number, and
  the job is aborted with exit status 86 (``EXIT_ERROR``), within seconds.
"""

from __future__ import annotations

import faulthandler
import os
import re
import sys
import tempfile
import threading
import time
import zlib

os.environ.setdefault("TINYTRAIN_TIMEOUT", "20")
os.environ.setdefault("TINYTRAIN_DEBUG", "1")

import pytest  # noqa: E402
from _pytest.runner import runtestprotocol  # noqa: E402

from .exits import DEADLINE_BANNER, EXIT_DEADLINE, EXIT_ERROR, GRADED_DEADLINE, RAISED_BEFORE_HANG  # noqa: E402

_TAG = 11
_GRACE = 2.0  # seconds an expiring rank waits after printing its stacks, so the others print theirs
_ctl = None  # the harness's own communicator (a dup of COMM_WORLD)
_rank, _size = 0, 1


def _mpi():
    from tinytrain.distributed._mpi import MPI  # sets MPICH defaults before MPI_Init

    return MPI


# --- startup ---------------------------------------------------------------------------------------


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    global _ctl, _rank, _size
    MPI = _mpi()
    _ctl = MPI.COMM_WORLD.Dup()
    _rank, _size = _ctl.Get_rank(), _ctl.Get_size()
    # Declared in pyproject.toml too; repeated here so test files outside the repo can use them.
    config.addinivalue_line(
        "markers", "world_size(n, at_least=False): the test needs exactly n MPI ranks (at least n: all of them)"
    )
    config.addinivalue_line("markers", "deadline(seconds): this test may take longer than TINYTRAIN_TEST_TIMEOUT")
    test_deadline()  # a bad TINYTRAIN_TEST_TIMEOUT is a usage error now, not an internal error later
    if _size > 1 and not config.option.basetemp:
        _temp_root_of_this_rank()
    if _size > 1:
        from tinytrain import launcher

        launcher.watch()  # a killed launcher that left its ranks (Intel MPI's script mpirun) ends them too
    if _rank != 0:
        _silence(config)
    _watchdog.config = config
    _watchdog.start()


def _temp_root_of_this_rank() -> None:
    """Each rank its own root for ``tmp_path`` (``pytest-of-<user>/pytest-N`` under it). pytest tidies
    its root as the session ends (old numbered folders, the ``pytest-current`` link), and four ranks
    tidying one root raced: a rank's unlink of a link another rank had just removed failed a run whose
    every test had passed. (A test shares a folder across ranks with rank 0's path, broadcast.) Read
    lazily by pytest, at the first ``tmp_path``; a nested run under a rank's root gets its own below."""
    base = os.environ.get("PYTEST_DEBUG_TEMPROOT") or tempfile.gettempdir()
    root = os.path.join(base, f"tinytrain-{os.getuid()}-rank{_rank}")
    os.makedirs(root, exist_ok=True)
    os.environ["PYTEST_DEBUG_TEMPROOT"] = root


def test_deadline(item=None) -> float:
    """Seconds one test may take on any rank, agreement included: ``@pytest.mark.deadline(s)`` for
    a test known to be long (one that runs the grader), else ``TINYTRAIN_TEST_TIMEOUT``, by default
    the grader's deadline for a graded test (42 s: a student's endless loop ends as soon under
    pytest as under ``python -m grader``) and 180 s for any other."""
    marker = item.get_closest_marker("deadline") if item is not None else None
    if marker is not None:
        return float(marker.args[0])
    graded = item is not None and item.get_closest_marker("task") is not None
    setting = os.environ.get("TINYTRAIN_TEST_TIMEOUT", "").strip()
    if not setting:
        return float(GRADED_DEADLINE if graded else 180)
    try:
        seconds = float(setting)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):  # checked once at startup (pytest_configure): a usage error there
        raise pytest.UsageError(
            f"TINYTRAIN_TEST_TIMEOUT={setting!r} is not a setting it takes: seconds per test, a positive number, "
            "or leave it unset"
        )
    return seconds


_ABORT_GRACE = 0.3  # seconds


def _abort(code: int) -> None:
    """End every rank of the job now with exit status ``code``."""
    sys.stderr.flush()
    sys.__stderr__.flush()
    # The launcher forwards our output through a pipe; MPI_Abort tears the job down at once and can
    # drop what is still in flight (seen once: exit 86 with no message), so give it a moment.
    time.sleep(_ABORT_GRACE)
    try:
        _mpi().COMM_WORLD.Abort(code)
    finally:
        os._exit(code)


def _stderr(config):
    """The real standard error (pytest may be capturing fd 2 for the running test)."""
    capman = config.pluginmanager.getplugin("capturemanager") if config else None
    if capman is not None:
        try:
            capman.suspend_global_capture(in_=False)
        except Exception:  # noqa: BLE001 - best effort: we are about to abort anyway
            pass
    return sys.__stderr__


def fatal(message: str, config=None) -> None:
    """Print ``message`` once, from this rank, with its number; abort the whole job (EXIT_ERROR)."""
    err = _stderr(config)
    err.write(f"\ntinytrain harness, rank {_rank} of {_size}: {message}\naborting all ranks.\n")
    _abort(EXIT_ERROR)


class _Watchdog(threading.Thread):
    """Bounds every test by ``test_deadline()`` on this rank; see the module docstring."""

    def __init__(self):
        super().__init__(name="tinytrain-test-watchdog", daemon=True)
        self.config, self.nodeid, self.since, self.limit = None, None, 0.0, 0.0
        self.failure = ""  # this rank's exception in the running test, if it raised one: shown at a hang

    def arm(self, item) -> None:
        self.since, self.limit, self.nodeid = time.monotonic(), test_deadline(item), item.nodeid
        self.failure = ""

    def disarm(self) -> None:
        self.nodeid = None

    def run(self) -> None:
        while True:
            time.sleep(0.25)
            nodeid, since, limit = self.nodeid, self.since, self.limit
            if nodeid is not None and time.monotonic() - since > limit:
                self.expire(nodeid, limit)

    def expire(self, nodeid: str, limit: float) -> None:
        from .seeds import replay_hint

        err = _stderr(self.config)
        hint = replay_hint() or "the test drew no seed"
        err.write(
            f"\n=== tinytrain harness, rank {_rank}: {nodeid} is still running after {limit:g} s "
            f"{DEADLINE_BANNER}; {hint}. Python stacks of rank "
            f"{_rank} (its main thread's innermost frame is where it is stuck):\n"
        )
        if self.failure:  # another rank hung, but this one's exception is the likely cause: say it first
            err.write(f"{RAISED_BEFORE_HANG.format(rank=_rank)}{self.failure}\n")
        err.flush()
        faulthandler.dump_traceback(file=err, all_threads=True)
        err.write(f"=== end of rank {_rank}'s stacks; aborting all ranks\n")
        err.flush()
        time.sleep(_GRACE)  # the other ranks' deadlines end now too: let them print their stacks
        _abort(EXIT_DEADLINE)


_watchdog = _Watchdog()


def pytest_internalerror(excrepr, excinfo):
    if _size > 1:
        fatal(f"internal pytest error: {excinfo.exconly() if excinfo else excrepr}")


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """All ranks must run the same tests in the same order; else the job ends, saying why."""
    if _size == 1:
        return
    ids = "\n".join(item.nodeid for item in session.items)
    reporter = session.config.pluginmanager.getplugin("terminalreporter")
    errors = [getattr(r, "longreprtext", str(r))[-1500:] for r in (reporter.stats.get("error", []) if reporter else [])]
    mine = (len(session.items), zlib.crc32(ids.encode()), errors)
    everyone = _gather_to_all(mine, "the other ranks to collect the tests", test_deadline())
    if len({(n, crc) for n, crc, _ in everyone}) == 1:
        return
    # Every rank sees the mismatch: gather the ids too, so the message can name the first difference
    # (same counts, different ids: a test parametrized with values drawn differently on each rank).
    all_ids = _gather_to_all([item.nodeid for item in session.items], "the other ranks' test ids", test_deadline())
    if _rank == 0:
        lines = [
            f"rank {r}: {n} tests" + (f", collection error:\n{e[0]}" if e else _first_difference(all_ids[0], theirs))
            for r, ((n, _, e), theirs) in enumerate(zip(everyone, all_ids))
        ]
        fatal(
            "the ranks collected different tests (an import that fails on some ranks only, or test ids "
            "drawn at random?):\n" + "\n".join(lines)
        )


def _first_difference(mine: list[str], theirs: list[str]) -> str:
    """Where another rank's test ids first differ from rank 0's ('' when they do not)."""
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            return f"; test {i + 1} is {b} (rank 0 has {a})"
    return ""


def _silence(config) -> None:
    """Ranks > 0 print nothing and write no report files (their outcomes reach rank 0 anyway)."""
    from _pytest.config import create_terminal_writer

    reporter = config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None:
        reporter._tw = create_terminal_writer(config, file=open(os.devnull, "w"))
    try:  # --junitxml: only rank 0 writes the file (all ranks would race on one path)
        from _pytest.junitxml import xml_key

        xml = config.stash.get(xml_key, None)
        if xml is not None:
            config.pluginmanager.unregister(xml)
            del config.stash[xml_key]
    except ImportError:
        pass


def pytest_report_header(config):
    return (
        f"tinytrain MPI harness: {_size} rank(s), TINYTRAIN_TIMEOUT={os.environ['TINYTRAIN_TIMEOUT']}s per wait, "
        f"TINYTRAIN_TEST_TIMEOUT={test_deadline():g}s per test, TINYTRAIN_DEBUG={os.environ['TINYTRAIN_DEBUG']}"
    )


# --- one test --------------------------------------------------------------------------------------


def _needed_ranks(item) -> int | None:
    """Ranks the test runs on: ``world_size(n)`` exactly n; ``world_size(n, at_least=True)`` every
    rank when there are at least n (so ``mpirun -n 3`` grades what 3 ranks can)."""
    marker = item.get_closest_marker("world_size")
    if marker is None:
        return None
    if not marker.args or int(marker.args[0]) < 1:
        raise pytest.UsageError(f"{item.nodeid}: use @pytest.mark.world_size(n) with n >= 1")
    n = int(marker.args[0])
    return max(n, _size) if marker.kwargs.get("at_least") else n


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    _watchdog.arm(item)
    try:
        return _protocol(item, nextitem)
    except Exception as exc:  # noqa: BLE001 - the harness itself failed: end the job, saying why
        fatal(f"{item.nodeid}: the harness raised {type(exc).__name__}: {exc}", item.config)
    finally:
        _watchdog.disarm()


def _protocol(item, nextitem):
    from tinytrain.distributed import group as dist_group

    from . import seeds

    MPI = _mpi()
    n = _needed_ranks(item)
    seeds.reset()  # the seeds this test draws, for its failure messages and its replay
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)

    if n is not None and n > _size:
        item.add_marker(pytest.mark.skip(reason=f"needs {n} MPI ranks: run with mpirun -n {n}"))
        _log(item, runtestprotocol(item, nextitem=nextitem, log=False))
        return True

    # A fresh communicator for the ranks taking part (collective over all ranks when n is given).
    takes_part = _rank < (n or 1)
    if n is None:
        comm = MPI.COMM_SELF.Dup() if takes_part else None
    else:
        comm = _ctl.Split(0 if takes_part else MPI.UNDEFINED, _rank)
    if takes_part:
        dist_group._install_world(comm, dup=False)  # takes comm over; freed with the world
    else:
        item.add_marker(pytest.mark.skip(reason=f"rank {_rank} sits out (test uses {n or 1} rank(s))"))

    reports = runtestprotocol(item, nextitem=nextitem, log=False)
    if _size > 1:
        _agree(item, reports, takes_part)
    if takes_part:
        clean = all(not r.failed for r in reports)
        dist_group._uninstall_world(free=clean)
    _log(item, reports)
    return True


def _log(item, reports) -> None:
    for rep in reports:
        item.ihook.pytest_runtest_logreport(report=rep)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """When a phase ends in an exception on this rank, tell the other ranks now: they may be
    waiting for this rank in a collective. Also for skips (``pytest.skip``, a TODO stub raising
    NotImplementedError): the peers must not wait for their deadline either."""
    yield
    if call.excinfo is not None and call.when != "teardown":
        from tinytrain.distributed import watchdog

        if not call.excinfo.errisinstance(watchdog.PeerFailure):
            watchdog.report_failure(f"{item.name} ({call.when}): {call.excinfo.exconly()[:800]}")
            if not call.excinfo.errisinstance((NotImplementedError, pytest.skip.Exception)):
                first = (call.excinfo.exconly().strip().splitlines() or [""])[0][:400]
                _watchdog.failure = f"{first} ({_where(call.excinfo, item.config)})"


def _where(excinfo, config) -> str:
    """Where an exception was raised, as a student looks for it: the innermost frame in the graded
    assignment files (``--assignments DIR`` or ``assignments/``), else in the framework, else the
    innermost frame."""
    entries = list(excinfo.traceback)
    chosen = getattr(config.option, "assignments", None) if config else None
    places = [os.path.abspath(chosen)] if chosen else []
    places += [
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), p)
        for p in ("assignments", "tinytrain")
    ]
    for place in places:
        for entry in reversed(entries):
            path = os.path.abspath(str(entry.path))
            if path.startswith(place + os.sep):
                shown = os.path.relpath(path) if not chosen or place != places[0] else path
                return f"{shown}:{entry.lineno + 1}, in {entry.name}"
    last = entries[-1] if entries else None
    return f"{last.path}:{last.lineno + 1}, in {last.name}" if last else "no traceback"


# --- agreeing on the outcome -----------------------------------------------------------------------


def _summary(reports, takes_part: bool) -> tuple[list[tuple], tuple | None]:
    """What this rank tells rank 0: its failed phases as (when, crash message, full text), and its
    skip (pytest's (path, line, reason)) if it skipped the test itself."""
    if not takes_part:
        return [], None
    out = []
    for rep in reports:
        if rep.failed:
            out.append((rep.when, _crash_message_of(rep.longrepr), str(rep.longrepr)[-6000:]))
    skip = next((tuple(r.longrepr) for r in reports if r.skipped and isinstance(r.longrepr, tuple)), None)
    return out, skip


def _agree(item, reports, takes_part: bool) -> None:
    """Gather every rank's failures on rank 0, send the list to all, and fold them into ``reports``."""
    mine = _summary(reports, takes_part)
    everyone = _gather_to_all(mine, f"the other ranks to finish {item.nodeid}")
    failures = [(r,) + f for r, (fails, _) in enumerate(everyone) for f in fails]
    skip = next((skip for _, skip in everyone if skip), None)
    if failures and skip is not None and all(_is_echo(f[2]) for f in failures):
        # Only PeerFailures, and a rank skipped (e.g. a TODO stub): the test is skipped, not failed,
        # and with that rank's reason: a rank that was still in a collective with it when the
        # notice came never reached the stub itself. With no rank skipping, a PeerFailure is a real
        # failure (a rank that raised inside the test, or told of a failure and went on).
        _skip_echoes(reports, skip)
        return
    others = [f for f in failures if f[0] != _rank]
    if others:
        _fold(reports, others)
    for rep in reports:  # label this rank's own failures with its rank too
        if rep.failed and not isinstance(rep.longrepr, RankFailures):
            rep.longrepr = RankFailures(rep.longrepr, [])


def _skip_echoes(reports, skip: tuple) -> None:
    for rep in reports:
        if rep.failed:
            rep.outcome = "skipped"
            rep.longrepr = skip


def _gather_to_all(mine, what: str, limit: float | None = None) -> list:
    """Every rank's ``mine``, in rank order, on every rank; each wait polls (see ``_poll``)."""
    if _rank == 0:
        everyone = [mine] + [_recv(peer, what, limit) for peer in range(1, _size)]
        sends = [_ctl.isend(everyone, dest=peer, tag=_TAG) for peer in range(1, _size)]
    else:
        sends = [_ctl.isend(mine, dest=0, tag=_TAG)]
        everyone = _recv(0, what, limit)
    _poll(lambda: all(req.Test() for req in sends), what, limit)
    return everyone


def _recv(peer: int, what: str, limit: float | None = None):
    box = []

    def arrived():
        msg = _ctl.improbe(source=peer, tag=_TAG)
        if msg is not None:
            box.append(msg.recv())
        return bool(box)

    _poll(arrived, f"{what} (rank {peer})", limit)
    return box[0]


_SHORT_WAIT = 0.05  # seconds a wait sleeps at most _SHORT_SLEEP between polls, then _LONG_SLEEP
_SHORT_SLEEP, _LONG_SLEEP = 2e-4, 2e-3


def _poll(done, what: str, limit: float | None = None) -> None:
    """Wait, sleeping, so an idle rank leaves the core to busy ones. Within a test the watchdog
    bounds the wait; outside one (``limit`` given) it ends the job itself.

    Most waits are the outcome agreement after a short test: the answer comes within a few
    milliseconds, and a rank asleep for 2 ms would add that to every test (300 one-rank tests took
    2.5 s under ``mpirun -n 4``, 1.1 s with sleeps of at most 0.2 ms). A long wait (the ranks that sit
    out a one-rank test that trains a model) sleeps 2 ms: a rank that polls costs the busy ones nothing."""
    start, sleep = time.monotonic(), 1e-5
    while not done():
        waited = time.monotonic() - start
        if limit is not None and waited > limit:
            fatal(f"waited {limit:g} s for {what} (TINYTRAIN_TEST_TIMEOUT)")
        time.sleep(sleep)
        sleep = min(sleep * 2, _SHORT_SLEEP if waited < _SHORT_WAIT else _LONG_SLEEP)


_ECHO = re.compile(r"^(\w+\.)*PeerFailure\b")


def _is_echo(message: str) -> bool:
    """A PeerFailure only repeats another rank's failure: show it as one line, after the cause.
    Only the exception's own type counts (a message that merely mentions PeerFailure is a cause)."""
    return bool(_ECHO.match(message))


class RankFailures:
    """A failure report combining this rank's own failure (if any) with other ranks' failures.

    Entries are (rank, when, crash message, text); root causes come first, then the one-line
    echoes of ranks that failed only because a peer did.
    """

    def __init__(self, own, others: list[tuple]):
        self.own = own  # this rank's original longrepr (rendered with pytest's formatting), or None
        self.others = list(others)

    def _entries(self):
        entries = list(self.others)
        if self.own is not None:
            entries.append((_rank, None, _crash_message_of(self.own), self.own))
        return sorted(entries, key=lambda e: (_is_echo(e[2]), e[0]))

    @property
    def reprcrash(self):
        rank, _when, message, _text = self._entries()[0]
        return _Crash(f"[rank {rank}] {message}")

    def toterminal(self, tw) -> None:
        first_with = {}
        for rank, _when, message, text in self._entries():
            tw.sep("-", f"rank {rank}")
            if message in first_with:  # e.g. a mismatch every rank detects alike
                tw.line(f"(same error as rank {first_with[message]})")
                continue
            first_with[message] = rank
            if _is_echo(message):
                tw.line(message)
            elif hasattr(text, "toterminal"):
                text.toterminal(tw)
            else:
                tw.line(str(text))

    def __str__(self) -> str:
        return "\n".join(f"---- rank {r} ----\n{m if _is_echo(m) else t}" for r, _w, m, t in self._entries())


class _Crash:
    def __init__(self, message: str):
        self.message, self.path, self.lineno = message, "", 0


def _crash_message_of(longrepr) -> str:
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message
    lines = str(longrepr).strip().splitlines() if longrepr else []
    return lines[-1] if lines else "failed"


def _fold(reports, others: list[tuple]) -> None:
    """Mark this rank's report of each failed phase as failed, carrying the other ranks' messages."""
    by_when = {}
    for f in others:
        by_when.setdefault(f[1], []).append(f)
    for when, fails in by_when.items():
        target = next((r for r in reports if r.when == when), None)
        if target is None:  # e.g. another rank failed in "call" but this rank skipped/sat out
            target = next((r for r in reports if r.failed), reports[-1])
        own = target.longrepr if target.failed else None
        if isinstance(own, RankFailures):
            own.others += fails
            continue
        target.outcome = "failed"
        target.longrepr = RankFailures(own, fails)
        if hasattr(target, "wasxfail"):
            del target.wasxfail
