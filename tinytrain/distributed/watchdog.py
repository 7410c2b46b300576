"""No hangs: every wait in tinytrain.distributed goes through :func:`wait_until`.

Three things can stop a distributed program forever, and this module turns each into an error
that names what was being waited for:

1. A peer never answers (it crashed, froze, called a different operation, or forgot a ``recv``).
   Every wait has a deadline, ``TINYTRAIN_TIMEOUT`` seconds (default 20, so that a skipped
   collective ends a job well within 30 s; the test harness uses 20 too). Past it we raise
   :class:`CommTimeout` naming the operation, group, algorithm step, the peer and the time waited.

   An honest long wait (a slow pipeline stage, rank 0 writing a big checkpoint) is told apart
   from a failure by *heartbeats* (``start_heartbeat``, started by ``tinytrain train``): every
   second each rank posts on the side channel whether it is computing ("busy") or which ranks it
   is waiting for. At the deadline a waiting rank follows these waits from rank to rank: if they
   lead to a rank that is alive and busy, the wait is honest and goes on (up to
   ``TINYTRAIN_BUSY_TIMEOUT`` seconds, default 600, for a rank that computes forever); if they
   only lead to waiting ranks (a cycle: a skipped collective, a send-send deadlock), to a
   finished rank, or to a rank that has stopped beating (frozen by ``kill -STOP``), it is a failure.
2. A peer raised an exception. Waiting for the deadline would be slow, so a failing rank posts a
   short *failure notice* to every other rank on a side-channel communicator (a duplicate of the
   world communicator, used for nothing else). Waiting ranks look for notices with ``Iprobe`` while
   they poll, and raise :class:`PeerFailure` within milliseconds. A peer killed outright (SIGKILL,
   the OOM killer, a crash in C) posts nothing: a wait looks every ``_DEAD_EVERY`` seconds whether
   the process of each rank it waits for, on this machine, still runs, and raises ``PeerDied``
   naming it when not (the pids come from ``learn_places`` and the heartbeats).
3. Ranks call different collectives. Each call's messages carry its signature in their tag, so
   a rank that waits for a message finds the peer's message of another signature instead and
   raises :class:`CollectiveMismatch` naming both calls; in debug mode (``TINYTRAIN_DEBUG=1``, on
   in the test harness) each collective first exchanges its full signature (see ``work.py``).

Why we poll instead of calling ``MPI_Wait``: a blocking MPI wait cannot be interrupted by a
deadline, and MPICH busy-polls inside it, which is ruinous when 4 ranks share 2 cores. So we call
``MPI_Test`` in a loop, in three phases (see ``_poll_until``): spin (a small message arrives in
microseconds, on a core of its own), then give the core away with ``sched_yield`` between polls
for ``TINYTRAIN_YIELD_FOR`` seconds (the peer we wait for may need *our* core, and MPI moves a
large message only while both ranks poll), then sleep in growing steps (a long wait: a pipeline
bubble, a slow rank) so that a waiting rank costs nothing.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

from tinytrain import backend, launcher
from tinytrain.env import positive_seconds

from ._mpi import MPI


class DistributedError(RuntimeError):
    """Base class of the errors raised by tinytrain.distributed."""


class CommTimeout(DistributedError):
    """A wait passed its deadline."""


class PeerFailure(DistributedError):
    """Another rank reported that it failed while this rank waited for it (``failed_rank``, during
    ``where``: the operation this rank was in)."""

    failed_rank: int | None = None
    where: str = ""
    echoes_a_report = True  # the failed rank printed its own error: this rank's is only its echo


class PeerDied(PeerFailure):
    """A rank this one waited for has ended without a word (its process is gone: killed outright).
    No other rank can say why, so unlike a ``PeerFailure`` that echoes a peer's own report, this
    one is printed."""

    echoes_a_report = False


class CollectiveMismatch(DistributedError, ValueError):
    """Ranks of one group called collectives that do not match."""


def timeout() -> float:
    """Seconds a wait may take before we ask whether it is stuck: ``TINYTRAIN_TIMEOUT`` (default 20)."""
    return positive_seconds("TINYTRAIN_TIMEOUT", 20.0)


def busy_timeout() -> float:
    """Seconds a wait may go on while the rank it waits for is alive and computing:
    ``TINYTRAIN_BUSY_TIMEOUT`` (default 600)."""
    return positive_seconds("TINYTRAIN_BUSY_TIMEOUT", 600.0)


def check_settings() -> None:
    """Read every seconds setting once, so that a bad value fails at ``init()``, not in a wait."""
    timeout(), busy_timeout(), beat_every()


def debug() -> bool:
    """True when ``TINYTRAIN_DEBUG`` is set to something other than 0 (asked by every collective call)."""
    # Read where os.environ keeps its bytes: ``os.environ.get`` of a variable that is not set raises
    # and catches a KeyError inside, which cost a 1 KiB all-reduce a tenth of its time on 4 ranks
    # sharing 2 cores (measured: 230 -> 190 us). Setting it at run time (monkeypatch.setenv) works.
    data = getattr(os.environ, "_data", None)
    if data is None:  # not CPython's os.environ
        return os.environ.get("TINYTRAIN_DEBUG", "0") not in ("", "0")
    return data.get(b"TINYTRAIN_DEBUG", b"0") not in (b"", b"0")


# --- polling policy ------------------------------------------------------------------------------


def _oversubscribed() -> bool:
    """More ranks on this node than cores we may run on?"""
    return backend.launcher_ranks_here() > backend.usable_cores()


# The three phases of a wait. Spinning wins on a dedicated core: the reply to a small message
# arrives in microseconds. When ranks outnumber cores the rank we wait for may be waiting for *our*
# core, so we yield it at once: on 4 ranks sharing 2 cores a 1 KiB all-reduce took 57 us yielding
# from the first poll, 69 us after 20 polls, 165 us after 100 and 957 us after 1000 (raw mpi4py).
# Yielding costs a computing rank on our core almost nothing (the scheduler hands it the core back
# at once), and it keeps MPI moving: MPICH copies a large message through shared memory in pieces,
# and only while both ranks poll. A sleep instead costs far more than asked (20 us asked, 60-120 us
# slept: timer slack and scheduling), so an early sleep made every mid-sized collective wait for
# it. So we yield for TINYTRAIN_YIELD_FOR seconds, by the clock; only a longer wait (a pipeline
# bubble, a rank computing) sleeps, so that waiting ranks leave the cores to the ones that compute.
# TINYTRAIN_SPIN / TINYTRAIN_YIELD_FOR / TINYTRAIN_MAX_SLEEP override.
_SPIN = int(os.environ.get("TINYTRAIN_SPIN", "0" if _oversubscribed() else "2000"))
_YIELD_FOR = float(os.environ.get("TINYTRAIN_YIELD_FOR", "2e-3"))  # then polls with sched_yield() between
_MAX_SLEEP = float(os.environ.get("TINYTRAIN_MAX_SLEEP", "1e-4"))  # then sleeps doubling from 20 us up to this
_ALERT_EVERY = 64  # check the failure side channel every this many polls (always when sleeping)
_DEAD_EVERY = 0.2  # seconds between looks, in a wait, at whether the ranks it waits for still run
_DEAD_FOR = 0.5  # seconds a rank's process must have been gone before a wait raises PeerDied
_found_dead: dict[int, float] = {}  # pid -> when a wait first found it gone


# --- requests given up on ------------------------------------------------------------------------

# A request MPI may still complete, with its buffer, kept for as long as it may. mpi4py's Request
# holds its buffer, and dropping an active one lets MPI write (a receive) or read (a send) memory
# that Python has freed and handed out again: a step abandoned at a deadline or a peer's failure,
# whose message lands later. Seen once in CI as glibc's "malloc(): unaligned tcache chunk detected"
# a few tests after a test of failures. Kept here until a test finds them complete (``uninstall``).
_abandoned: list = []


def abandon(requests) -> None:
    """Keep ``requests`` (mpi4py Requests, any of them perhaps still active) and their buffers alive
    until MPI has completed them. Never blocks and calls no MPI (safe from ``__del__``)."""
    _abandoned.extend(requests)


def _forget_completed() -> None:
    """Drop the abandoned requests that have completed (a request that failed has completed too)."""
    alive = []
    for req in _abandoned:
        try:
            if not req.Test():
                alive.append(req)
        except MPI.Exception:
            pass
    _abandoned[:] = alive


# --- the failure side channel --------------------------------------------------------------------

_ALERT_TAG = 7
_alert_comm = None  # a duplicate of the world communicator, used only for failure notices
_alert_sends: list = []  # posted notices and their buffers (a Request holds its buffer too)
failures: dict[int, str] = {}  # world rank -> its failure notice, once received


def install(alert_comm) -> None:
    """Use ``alert_comm`` (a dup of the world communicator) as the side channel."""
    global _alert_comm
    _alert_comm = alert_comm
    abandon(req for req, _ in _alert_sends)
    _alert_sends.clear()
    failures.clear()
    local_pids.clear()


def uninstall() -> None:
    global _alert_comm
    stop_heartbeat()
    _alert_comm = None
    abandon(req for req, _ in _alert_sends)  # a notice nobody read is still a send in flight
    _alert_sends.clear()
    failures.clear()
    _forget_completed()


def report_failure(message: str) -> None:
    """Tell every other rank that this rank failed (never blocks; safe to call twice)."""
    comm = _alert_comm
    if comm is None or comm.Get_size() == 1:
        return
    data = bytearray(message.encode()[:4000])
    for peer in range(comm.Get_size()):
        if peer != comm.Get_rank():
            _alert_sends.append((comm.Isend(data, dest=peer, tag=_ALERT_TAG), data))


def poll_failures() -> dict[int, str]:
    """Receive any failure notices that have arrived; return all known failures."""
    comm = _alert_comm
    if comm is None:
        return failures
    status = MPI.Status()
    while comm.Iprobe(source=MPI.ANY_SOURCE, tag=_ALERT_TAG, status=status):
        buf = bytearray(status.Get_count(MPI.BYTE))
        comm.Recv(buf, source=status.Get_source(), tag=_ALERT_TAG)  # already arrived: no wait
        failures[status.Get_source()] = buf.decode(errors="replace")
    if _heartbeat is not None:
        _poll_beats(comm)
    return failures


# --- heartbeats: who is busy, who waits for whom -------------------------------------------------

_BEAT_TAG = 8
_UNANSWERED = 8  # beats sent to a peer we have not heard from since: then we wait for its news


def beat_every() -> float:
    """Seconds between heartbeats, ``TINYTRAIN_HEARTBEAT`` (default 1); a rank silent for 4 of these
    (at least 1 s) is taken as stopped. (Tests shorten it, so that a minute of beats fits in seconds.)"""
    return positive_seconds("TINYTRAIN_HEARTBEAT", 1.0)


_BEAT_EVERY = 1.0  # read from TINYTRAIN_HEARTBEAT when the heartbeat starts
_HOST = socket.gethostname()
_waiting_for: list[int] | None = None  # world ranks this rank waits for now (None: computing)
_finished = False  # this rank is done (it will never answer again)
_heartbeat: tuple[threading.Thread, threading.Event] | None = None
_heartbeat_since = 0.0  # when this rank started beating: a peer not heard from since is given as long
_beat_sends: list = []
_beat_lock = threading.Lock()  # the heartbeat thread and a waiting rank both receive beats
_unanswered: dict[int, int] = {}  # world rank -> beats sent to it since we last heard from it
beats: dict[int, tuple[float, dict]] = {}  # world rank -> (when heard, its last state)


def start_heartbeat() -> None:
    """Post this rank's state to every other rank every second, from a daemon thread.

    Started by programs (``tinytrain train``), not by the test harness: a rank that waits in the
    harness's own loop would look busy there."""
    global _heartbeat, _finished
    comm = _alert_comm
    if comm is None or comm.Get_size() == 1 or _heartbeat is not None:
        return
    global _heartbeat_since, _BEAT_EVERY
    _finished, _heartbeat_since, _BEAT_EVERY = False, time.monotonic(), beat_every()
    _unanswered.clear()
    stop = threading.Event()

    # The thread also *receives* the others' beats. A rank that computes (or sleeps) for minutes
    # polls nothing, and every beat sent to it would sit in the sender's MPICH shared-memory cells
    # (64 by default): after a minute the sender could send nothing at all, its own heartbeats
    # stopped, and the waiting ranks took it for frozen. Read here, beats never pile up.
    def beat():
        _post_beat(comm)
        _poll_beats(comm)
        while not stop.wait(_BEAT_EVERY):
            _post_beat(comm)
            _poll_beats(comm)

    thread = threading.Thread(target=beat, name="tinytrain-heartbeat", daemon=True)
    _heartbeat = (thread, stop)
    thread.start()


def stop_heartbeat(finished: bool = False) -> None:
    """Stop beating; with ``finished``, first tell every rank that this one is done."""
    global _heartbeat, _finished
    if _heartbeat is None:
        return
    thread, stop = _heartbeat
    _heartbeat = None
    stop.set()
    thread.join()
    if finished and _alert_comm is not None:
        _finished = True
        _post_beat(_alert_comm)
    abandon(req for req, _ in _beat_sends)
    _beat_sends.clear()


def _silent_after() -> float:
    """Seconds without a beat after which a rank is taken as stopped: 4 beats, and never under a
    second (a loaded machine delays a thread by tenths of a second; short beats are for tests)."""
    return max(4 * _BEAT_EVERY, 1.0)


def _post_beat(comm) -> None:
    """Send this rank's state to every peer that still listens: not to a finished rank, and at
    most ``_UNANSWERED`` beats to a rank we have not heard from since (one that holds Python's lock
    in a long C call can read none: what it has not read would only pile up)."""
    state = {"finished": True} if _finished else {"waiting_for": _waiting_for}
    state.update(host=_HOST, pid=os.getpid())  # who to name if this rank goes silent
    data = bytearray(json.dumps(state).encode())
    _beat_sends[:] = [(req, buf) for req, buf in _beat_sends if not req.Test()]
    for peer in range(comm.Get_size()):
        if peer == comm.Get_rank() or beats.get(peer, (0, {}))[1].get("finished"):
            continue
        if _unanswered.get(peer, 0) >= _UNANSWERED and not _finished:
            continue
        _unanswered[peer] = _unanswered.get(peer, 0) + 1
        _beat_sends.append((comm.Isend(data, dest=peer, tag=_BEAT_TAG), data))


local_pids: dict[int, int] = {}  # world rank -> process id, of the ranks on this machine (``learn_places``)


def learn_places(pids, hosts) -> None:
    """Where each rank runs: ``pids[r]`` and a host id ``hosts[r]`` per world rank (equal ids: one
    machine), gathered at a program's start (``tinytrain train``'s start line). Heartbeats say it
    too, but a rank killed before its first beat would go unnamed."""
    mine = hosts[_alert_comm.Get_rank()] if _alert_comm is not None else None
    local_pids.update(
        {rank: int(pid) for rank, (pid, host) in enumerate(zip(pids, hosts, strict=True)) if host == mine}
    )


def _pids_here() -> dict[int, int]:
    """World rank -> process id of every rank known to run on this machine (start line, heartbeats)."""
    pids = {r: state["pid"] for r, (_, state) in beats.items() if state.get("host") == _HOST and "pid" in state}
    pids.update(local_pids)
    return pids


def where(rank: int) -> str:
    """ " (pid 123 on node7)": where ``rank`` runs, as it told ("" if it never did)."""
    if rank in local_pids:
        return f" (pid {local_pids[rank]} on {_HOST})"
    state = beats.get(rank, (0, {}))[1]
    return f" (pid {state['pid']} on {state['host']})" if "pid" in state else ""


def dead_peers() -> list[int]:
    """The ranks on this machine whose process has ended, by the process ids they gave. What a rank
    can still tell when its launcher, having seen one rank die, is stopping the rest (Open MPI sends
    them SIGTERM first; MPICH's hydra kills them before any can)."""
    return sorted(rank for rank, pid in _pids_here().items() if not launcher.alive(pid))


def who_died_here(wait: float = 0.3) -> str | None:
    """ "rank 1 (pid 123 on node7) has died": the ranks on this machine that have ended, said by the
    lowest-numbered rank still alive here (None on the others, and when none has ended). A launcher
    may tell the survivors as soon as the dead rank's pipes close, a moment before its process is
    gone: so look for ``wait`` seconds."""
    end = time.monotonic() + wait
    dead = dead_peers()
    while not dead and time.monotonic() < end:
        time.sleep(0.01)
        dead = dead_peers()
    if not dead or _alert_comm is None:
        return None
    me = _alert_comm.Get_rank()
    here = set(_pids_here()) | {me}
    if me != min(here - set(dead)):
        return None
    named = ", ".join(f"rank {rank}{where(rank)}" for rank in dead)
    return f"{named} {'has' if len(dead) == 1 else 'have'} died"


def _poll_beats(comm) -> None:
    status = MPI.Status()
    with _beat_lock:  # probe and receive as one: another thread must not take the probed message
        while comm.Iprobe(source=MPI.ANY_SOURCE, tag=_BEAT_TAG, status=status):
            buf = bytearray(status.Get_count(MPI.BYTE))
            source = status.Get_source()
            comm.Recv(buf, source=source, tag=_BEAT_TAG)
            beats[source] = (time.monotonic(), json.loads(buf.decode()))
            _unanswered[source] = 0


# _why_stuck: a rank on the way has not been heard from lately, or nothing is pending any more (the
# step completed between two polls): ask again soon. (Also what an empty list of reasons reads as.)
_UNSURE = ""


def _why_stuck(peers: list[int]) -> int | str:
    """Follow the waits starting at ``peers``: the rank they lead to that is alive and computing (an
    int: the wait is honest); ``_UNSURE`` if a rank on the way was last heard from too long ago to
    tell; else why not, in words. Only meaningful while heartbeats run."""
    me = _alert_comm.Get_rank()
    now, seen, todo, reasons = time.monotonic(), {me}, list(peers), []
    while todo:
        rank = todo.pop()
        if rank in seen:
            continue
        seen.add(rank)
        heard, state = beats.get(rank, (_heartbeat_since, {}))
        if now - heard > _silent_after():
            reasons.append(
                f"rank {rank}{where(rank)} has sent no heartbeat for over {_silent_after():g} s "
                "(stopped, frozen or killed?)"
            )
        elif state.get("finished"):
            reasons.append(f"rank {rank} has finished")
        elif now - heard > _silent_after() / 2:
            # Its last word is stale: a rank stopped while it waited would still look like half of a
            # deadlock. Not evidence either way yet: wait for a fresh beat, or for its silence.
            return _UNSURE
        elif state.get("waiting_for") is None:
            return rank  # alive and computing: the wait is honest
        else:
            todo.extend(state["waiting_for"])
    waiting = sorted(r for r in seen if r == me or beats.get(r, (0, {}))[1].get("waiting_for") is not None)
    if len(waiting) > 1:
        reasons.append(f"ranks {waiting} are all waiting, for each other (a deadlock or a skipped call)")
    return "; ".join(reasons)


# --- the one wait loop ---------------------------------------------------------------------------


def wait_until(done, describe, pending, deadline: float | None = None, check=None) -> None:
    """Poll ``done()`` until it returns True, or raise.

    ``describe()`` says what we are doing ("all_reduce(algo=ring) on group world, ring step 2/6"),
    ``pending()`` lists what is still outstanding as ``[("recv from", world_rank), ...]``; both are
    called only when an error is raised. ``deadline`` (seconds) defaults to :func:`timeout`.
    ``check()``, if given, is called every few polls and may raise (the collectives' signature check).
    """
    global _waiting_for
    __tracebackhide__ = True  # pytest: show the caller's line, not this loop
    if done():
        return
    try:
        _poll_until(done, describe, pending, deadline, check)
    finally:
        _waiting_for = None  # computing again (what the next heartbeat says)


def _poll_until(done, describe, pending, limit: float | None, check=None) -> None:
    __tracebackhide__ = True
    start = time.perf_counter()
    polls, sleep, sleeping, announced, look_for_dead = 0, 20e-6, False, 0.0, _DEAD_EVERY
    while True:
        polls += 1
        if sleeping:
            time.sleep(sleep)
            sleep = min(sleep * 2, _MAX_SLEEP)
        elif polls > _SPIN:
            os.sched_yield()
        if done():
            return
        if polls % _ALERT_EVERY == 0 or sleeping:  # the side channel: cheap, but not every poll
            waited = time.perf_counter() - start
            sleeping = sleeping or (polls > _SPIN and waited > _YIELD_FOR)
            _check_failures(describe, pending, waited)
            if waited > look_for_dead:
                _check_dead(describe, pending, waited)
                look_for_dead = waited + _DEAD_EVERY
            if check is not None:
                check()
            if _heartbeat is not None and waited > announced + 0.2 * _BEAT_EVERY:
                _set_waiting_for(pending)  # what the next heartbeat says
                announced = waited
            if limit is None:  # read the setting only now: most waits end within a few polls
                limit = timeout()
            if waited > limit:
                _past_deadline(describe, pending, waited, limit)


def _set_waiting_for(pending) -> None:
    global _waiting_for
    _waiting_for = sorted({peer for _, peer in pending()})


def _past_deadline(describe, pending, waited: float, limit: float) -> None:
    """Raise :class:`CommTimeout`, unless heartbeats show that the wait is an honest one."""
    __tracebackhide__ = True
    why = None
    if _heartbeat is not None:
        why = _why_stuck([peer for _, peer in pending()])
        if isinstance(why, int):
            if waited < busy_timeout():
                return  # the ranks we wait for wait, in the end, for a rank that computes: keep waiting
            why = (
                f"rank {why} is alive but still computing after TINYTRAIN_BUSY_TIMEOUT={busy_timeout():g} s "
                "(an endless loop? raise TINYTRAIN_BUSY_TIMEOUT if its work is honest)"
            )
        elif why == _UNSURE:
            if waited < busy_timeout() + _silent_after():
                return  # within 4 beats it sends fresh news, or its silence says it is stopped
            why = f"still unsure after TINYTRAIN_BUSY_TIMEOUT={busy_timeout():g} s"
    raise CommTimeout(
        f"{describe()}: timed out after {waited:.1f} s waiting for "
        f"{_fmt_pending(pending())} (TINYTRAIN_TIMEOUT={limit:g}). "
        + (f"{why[0].upper()}{why[1:]}." if why else "Did every rank of the group call the same operation?")
    )


def _fmt_pending(items) -> str:
    return ", ".join(f"{what} rank {peer}" for what, peer in items) or "nothing (?)"


def _check_dead(describe, pending, waited: float) -> None:
    """Raise :class:`PeerDied` if a rank this wait needs has ended: its process, on this machine,
    is gone. A rank killed outright (SIGKILL, the machine's OOM killer, a crash in C) posts no failure
    notice, and a launcher told to leave the others running (``tinytrain launch``) would leave them
    waiting until their deadline; the process table says it in a fraction of a second."""
    __tracebackhide__ = True
    pids, now, waited_for = _pids_here(), time.monotonic(), {peer for _, peer in pending()}
    dead = [peer for peer in dead_peers() if peer in waited_for]
    for peer in dead:
        _found_dead.setdefault(pids[peer], now)
    # Raise only once it has been gone a while: a launcher that watches the ranks (``tinytrain
    # launch``) tells the lost one by which ended first, and this rank ending a moment after it
    # would look like a tie on a loaded machine.
    dead = [peer for peer in dead if now - _found_dead[pids[peer]] >= _DEAD_FOR]
    if dead:
        rank = dead[0]
        error = PeerDied(
            f"{describe()}: rank {rank}{where(rank)} has died (its process is gone) while this rank waited "
            f"{waited:.1f} s for {_fmt_pending(pending())}"
        )
        error.failed_rank, error.where = rank, describe()
        raise error


def _check_failures(describe, pending, waited: float) -> None:
    __tracebackhide__ = True  # pytest: show the caller's line, not this loop
    known = poll_failures()
    if not known:
        return
    waiting_on = {peer for _, peer in pending()}
    # Prefer naming a failed rank we are actually waiting for; any failure dooms the group anyway.
    rank = next((r for r in sorted(known) if r in waiting_on), min(known))
    error = PeerFailure(
        f"{describe()}: rank {rank} failed while this rank waited {waited:.1f} s for "
        f"{_fmt_pending(pending())}. Rank {rank} reported: {known[rank]}"
    )
    error.failed_rank, error.where = rank, describe()
    raise error
