"""No hangs: every wait in tinytrain.distributed goes through :func:`wait_until`.

Three things can stop a distributed program forever, and this module turns each into an error
that names what was being waited for:

1. A peer never answers (it crashed, or called a different operation, or forgot a ``recv``).
   Every wait has a deadline, ``TINYTRAIN_TIMEOUT`` seconds (default 60; the test harness uses
   20). Past it we raise :class:`CommTimeout` naming the operation, group, algorithm step, the
   peer and the time waited.
2. A peer raised an exception. Waiting for the deadline would be slow, so a failing rank posts a
   short *failure notice* to every other rank on a side-channel communicator (a duplicate of the
   world communicator, used for nothing else). Waiting ranks look for notices with ``Iprobe`` while
   they poll, and raise :class:`PeerFailure` within milliseconds.
3. Ranks call different collectives. In debug mode (``TINYTRAIN_DEBUG=1``, on in the test harness)
   each collective first exchanges a small signature; a mismatch raises
   :class:`CollectiveMismatch` in words (see ``work.py``).

Why we poll instead of calling ``MPI_Wait``: a blocking MPI wait cannot be interrupted by a
deadline, and MPICH busy-polls inside it, which is ruinous when 4 ranks share 2 cores. So we call
``MPI_Test`` in a loop: spin briefly (fast for small messages), then yield the core, then sleep in
growing steps (at most ``_MAX_SLEEP``). When ranks outnumber cores we stop spinning much sooner.
"""

from __future__ import annotations

import os
import time

from ._mpi import MPI


class DistributedError(RuntimeError):
    """Base class of the errors raised by tinytrain.distributed."""


class CommTimeout(DistributedError):
    """A wait passed its deadline."""


class PeerFailure(DistributedError):
    """Another rank reported that it failed while this rank waited for it."""


class CollectiveMismatch(DistributedError, ValueError):
    """Ranks of one group called collectives that do not match (debug mode)."""


def timeout() -> float:
    """Seconds any single wait may take: ``TINYTRAIN_TIMEOUT`` (default 60)."""
    return float(os.environ.get("TINYTRAIN_TIMEOUT", "60"))


def debug() -> bool:
    """True when ``TINYTRAIN_DEBUG`` is set to something other than 0."""
    return os.environ.get("TINYTRAIN_DEBUG", "0") not in ("", "0")


# --- polling policy ------------------------------------------------------------------------------


def _oversubscribed() -> bool:
    """More ranks on this node than cores we may run on? (MPICH's mpirun sets MPI_LOCALNRANKS.)"""
    local_ranks = int(os.environ.get("MPI_LOCALNRANKS", os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1")))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return local_ranks > cores


# How many pure polls before we start giving the core away. Spinning wins on a dedicated core
# (a small message arrives in microseconds); when oversubscribed, the peer we wait for may need
# *our* core to make progress, so we yield almost at once. TINYTRAIN_SPIN overrides.
_SPIN = int(os.environ.get("TINYTRAIN_SPIN", "20" if _oversubscribed() else "2000"))
_YIELDS = int(os.environ.get("TINYTRAIN_YIELDS", "50"))  # then this many sched_yield()s
_MAX_SLEEP = float(os.environ.get("TINYTRAIN_MAX_SLEEP", "1e-4"))  # then sleeps doubling from 20 us up to this
_ALERT_EVERY = 64  # check the failure side channel every this many polls (always when sleeping)


# --- the failure side channel --------------------------------------------------------------------

_ALERT_TAG = 7
_alert_comm = None  # a duplicate of the world communicator, used only for failure notices
_alert_sends: list = []  # keep posted notices (and their buffers) alive until the comm is dropped
failures: dict[int, str] = {}  # world rank -> its failure notice, once received


def install(alert_comm) -> None:
    """Use ``alert_comm`` (a dup of the world communicator) as the side channel."""
    global _alert_comm
    _alert_comm = alert_comm
    _alert_sends.clear()
    failures.clear()


def uninstall() -> None:
    global _alert_comm
    _alert_comm = None
    _alert_sends.clear()
    failures.clear()


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
    return failures


# --- the one wait loop ---------------------------------------------------------------------------


def wait_until(done, describe, pending, deadline: float | None = None) -> None:
    """Poll ``done()`` until it returns True, or raise.

    ``describe()`` says what we are doing ("all_reduce(algo=ring) on group world, ring step 2/6"),
    ``pending()`` lists what is still outstanding as ``[("recv from", world_rank), ...]``; both are
    called only when an error is raised. ``deadline`` (seconds) defaults to :func:`timeout`.
    """
    __tracebackhide__ = True  # pytest: show the caller's line, not this loop
    if done():
        return
    limit = timeout() if deadline is None else deadline
    start = time.perf_counter()
    polls, sleep = 0, 20e-6
    while True:
        polls += 1
        if polls > _SPIN:
            if polls <= _SPIN + _YIELDS:
                os.sched_yield()
            else:
                time.sleep(sleep)
                sleep = min(sleep * 2, _MAX_SLEEP)
        if done():
            return
        if polls > _SPIN or polls % _ALERT_EVERY == 0:
            waited = time.perf_counter() - start
            _check_failures(describe, pending, waited)
            if waited > limit:
                raise CommTimeout(
                    f"{describe()}: timed out after {waited:.1f} s waiting for "
                    f"{_fmt_pending(pending())} (TINYTRAIN_TIMEOUT={limit:g}). "
                    "Did every rank of the group call the same operation?"
                )


def _fmt_pending(items) -> str:
    return ", ".join(f"{what} rank {peer}" for what, peer in items) or "nothing (?)"


def _check_failures(describe, pending, waited: float) -> None:
    __tracebackhide__ = True  # pytest: show the caller's line, not this loop
    known = poll_failures()
    if not known:
        return
    waiting_on = {peer for _, peer in pending()}
    # Prefer naming a failed rank we are actually waiting for; any failure dooms the group anyway.
    rank = next((r for r in sorted(known) if r in waiting_on), min(known))
    raise PeerFailure(
        f"{describe()}: rank {rank} failed while this rank waited {waited:.1f} s for "
        f"{_fmt_pending(pending())}. Rank {rank} reported: {known[rank]}"
    )
