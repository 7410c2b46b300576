"""Point-to-point messages: the only way data moves between ranks in tinytrain.

Everything here is built from mpi4py's *buffer* calls ``Isend``/``Irecv`` (upper case: they send
the bytes of an array, no pickling). Every message is non-blocking; completion is found by polling
in :func:`watchdog.wait_until`, so every wait has a deadline.

Public calls (peers are ranks *of the group*, the world by default)::

    send(x, dst)        recv(x, src)          # blocking; recv fills x in place
    h = isend(x, dst)   h = irecv(x, src)     # h.wait(), h.test(), h.is_completed()
    sendrecv(x, dst, y, src)                  # send x to dst while receiving y from src

:class:`Exchange` is the building block the collectives use: a few sends and receives posted
together that complete together (one "step" of an algorithm).

GPU arrays (CuPy, or the strict stand-in of ``tinytrain.backend.strict``): MPI reads and writes
memory directly, outside any CUDA stream, so we ``synchronize()`` before handing it a device
buffer. If MPI is CUDA-aware we pass the device buffer itself (``backend.device_buffer``);
otherwise we stage through host memory: one copy to the host before a send, one copy back to the
device after a receive completes. Detection: ``TINYTRAIN_CUDA_AWARE_MPI=0|1`` if set, else
``MPIX_Query_cuda_support`` when the MPI library has it, else no.

Every receive checks what arrived: MPI tells how many bytes a message carried, and a step knows
how many it expects (the buffer it posted). A difference means the ranks called the operation with
different sizes or dtypes; MPI leaves that undefined (garbage on some ranks, silence on others), so
we raise :class:`MessageSizeMismatch` on the rank that saw it, naming both ranks, the operation, the
step and the sizes. It costs one ``MPI_Get_count`` per message (``tinytrain bench collectives
--receive-check`` measures it). An MPI error inside a step ("Message truncated": the peer sent
more than the buffer holds) is re-raised the same way, as :class:`CommError`.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy

from tinytrain import backend, trace

from . import stats, topology, watchdog
from ._mpi import MPI
from .group import on_uninstall, resolve

MAX_USER_TAG = 1023  # collectives use tags above this, so user p2p can never match them


# --- buffers -------------------------------------------------------------------------------------


def check_buffer(tensor, what: str, writable: bool = False):
    """Validate an array handed to a communication call; return it unchanged."""
    if not backend.is_array(tensor):
        raise TypeError(
            f"{what} expects a NumPy/CuPy array, got {type(tensor).__name__}; for a tinytrain Tensor pass tensor.data"
        )
    if not tensor.flags.c_contiguous:
        raise ValueError(
            f"{what} needs a C-contiguous buffer, but this array (shape {tuple(tensor.shape)}, "
            f"strides {tuple(tensor.strides)}) is a strided view, e.g. a transpose or a slice; "
            "pass xp.ascontiguousarray(x) (and copy the result back if the call writes into it)"
        )
    if writable and not getattr(tensor.flags, "writeable", True):  # CuPy arrays have no such flag
        raise ValueError(f"{what} writes into its buffer, but this array is read-only")
    return tensor


_cuda_aware: bool | None = None


def cuda_aware() -> bool:
    """Can MPI read and write GPU memory directly? (cached; see the module docstring)"""
    global _cuda_aware
    if _cuda_aware is None:
        _cuda_aware = cuda_aware_reason()[0]
    return _cuda_aware


def cuda_aware_reason() -> tuple[bool, str]:
    """(is MPI CUDA-aware, how we know), from the setting or the MPI library (``tinytrain doctor``)."""
    env = os.environ.get("TINYTRAIN_CUDA_AWARE_MPI")
    if env in ("0", "1"):
        return env == "1", f"TINYTRAIN_CUDA_AWARE_MPI={env}"
    query = getattr(MPI, "Query_cuda_support", None)  # mpi4py >= 4 wraps MPIX_Query_cuda_support
    if query is None:
        return False, "this MPI has no MPIX_Query_cuda_support, so assumed not (TINYTRAIN_CUDA_AWARE_MPI=1 overrides)"
    try:
        answer = bool(query())
    except Exception as exc:  # an MPI without the extension raises MPI.Exception
        return False, f"MPIX_Query_cuda_support failed ({exc}), so assumed not"
    return answer, f"MPIX_Query_cuda_support() says {'yes' if answer else 'no'}"


class CommError(watchdog.DistributedError):
    """MPI reported an error inside a step (e.g. "Message truncated"); the message says where."""


class MessageSizeMismatch(CommError, watchdog.CollectiveMismatch):
    """A message carried a different number of bytes than the receiving step expected."""


# Switched off only by ``tinytrain bench collectives --receive-check``, to measure what it costs.
check_receives = True


def _get_status_all():
    """MPI_Request_get_status_all (MPI 4.1, wrapped by mpi4py >= 4), or None where MPI lacks it."""
    fn = getattr(MPI.Request, "Get_status_all", None)
    try:
        fn([])  # mpi4py has it, but does the MPI library?
    except (TypeError, NotImplementedError):
        return None
    return fn


_all_complete = _get_status_all()  # are all these requests complete? (see Exchange.test)
_BYTE = MPI.BYTE  # every message travels as bytes (see Exchange.recv)


# --- one step: some sends and receives that complete together -------------------------------------


class Exchange:
    """Messages posted together; :meth:`test` is True once all of them have completed.

    ``peer`` arguments are group ranks; ``group``/``op`` are only used for accounting, tracing and
    error messages. ``what`` names the algorithm step ("ring all-gather step 2/3").
    """

    __slots__ = ("group", "op", "what", "reqs", "posted", "after", "start", "nbytes", "statuses", "done", "held")

    # Every collective step goes through here, so it is written for speed: a 1 KiB all-reduce on
    # 4 ranks is two steps, and each microsecond of Python here is paid by every rank, every step
    # (twice over when ranks share cores: the interpreter of the rank we wait for runs on ours).
    def __init__(self, group, op: str, what: str):
        self.group, self.op, self.what = group, op, what
        self.reqs = []  # MPI requests, in posting order
        self.posted = []  # per request: (label, peer's world rank, the receive buffer or None for a send)
        self.after = None  # device receives staged through the host: copies to run on completion
        self.start = trace.now() if trace.enabled else 0.0
        self.nbytes = 0  # bytes sent
        self.statuses = None  # one MPI.Status per request once all completed (None: receives go unchecked)
        self.done = False
        self.held = None  # sends on an emulated inter-node link, not yet due: [(arrival, buf, peer, tag)]

    def send(self, buf, peer: int, tag: int) -> None:
        if backend.on_device and not isinstance(buf, numpy.ndarray):
            backend.synchronize()  # the kernel writing buf must finish before MPI reads it
            # A host copy (kept alive by the request below), or the device memory itself.
            buf = backend.device_buffer(buf) if cuda_aware() else backend.to_host(buf)
        links = topology.active
        if links is not None and links.node[self.group.world_ranks[peer]] != links.node[self._me()]:
            world_peer = self._hold(links, buf, peer, tag)
        else:
            world_peer = self._post(self.group.comm.Isend, buf, peer, tag, "send to", None)
        nbytes = buf.nbytes
        stats.count_send(self.group.name, self.op, nbytes, world_peer)
        self.nbytes += nbytes

    def recv(self, buf, peer: int, tag: int) -> None:
        target = buf
        if backend.on_device and not isinstance(buf, numpy.ndarray):
            backend.synchronize()  # nothing may still be writing the buffer MPI is about to fill
            if cuda_aware():
                target = backend.device_buffer(buf)
            else:
                target = numpy.empty(buf.shape, dtype=buf.dtype)
                if self.after is None:
                    self.after = []
                self.after.append(lambda: buf.__setitem__(Ellipsis, backend.asarray(target)))
        # As bytes on both sides: a message of another dtype is then only a byte count to compare (below)
        # and never reaches MPI's typed unpacking, which asserts and can abort before we can say why.
        world_peer = self._post(self.group.comm.Irecv, target, peer, tag, "recv from", buf)
        stats.count_recv(self.group.name, self.op, buf.nbytes, world_peer)
        if check_receives and self.statuses is None:
            self.statuses = []  # filled by Waitall, one Status per request

    def __del__(self):
        if not self.done and self.reqs:  # a step given up on (deadline, peer failure, error): MPI may
            watchdog.abandon(self.reqs)  # still complete it, into these buffers

    def _me(self) -> int:
        return self.group.world_ranks[self.group.rank]

    def _hold(self, links, buf, peer: int, tag: int) -> int:
        """Hold a send to another node back until the emulated link delivers it (``topology.py``);
        :meth:`test` posts it then. Returns the peer's world rank."""
        arrival = links.arrival(buf.nbytes)
        with _holding_lock:
            if self.held is None:
                self.held = []
                _holding.append(self)
            self.held.append((arrival, buf, peer, tag))
        world_peer = self.group.world_ranks[peer]
        if trace.enabled:  # the message's time on the link, from entering the port to arriving
            end = trace.now() + (arrival - time.perf_counter()) * 1e6
            start = end - (links.inter_latency + buf.nbytes / links.inter_bw) * 1e6
            link = links.link(self._me(), world_peer)
            trace.record(link, "link", start, end, op=self.op, peer=world_peer, bytes=buf.nbytes, link=link)
        return world_peer

    def _post_due(self) -> bool:
        """Post the held sends whose emulated arrival has come; True once none is held."""
        now = time.perf_counter()
        keep = []
        for item in self.held:
            arrival, buf, peer, tag = item
            if arrival <= now:
                self._post(self.group.comm.Isend, buf, peer, tag, "send to", None)
            else:
                keep.append(item)
        self.held = keep or None
        return not keep

    def _post(self, start, buf, peer: int, tag: int, label: str, expect) -> int:
        """Post ``start`` (the comm's ``Isend`` or ``Irecv``) of ``buf`` as bytes; the peer's world rank."""
        try:
            self.reqs.append(start([buf, _BYTE], peer, tag))
        except MPI.Exception as exc:
            raise self._mpi_error(exc, label, peer, buf) from exc
        world_peer = self.group.world_ranks[peer]
        self.posted.append((label, world_peer, expect))
        return world_peer

    def test(self) -> bool:
        """Poll MPI; True once every message has completed, every receive carried the bytes it
        expected, and staged data is copied back.

        A poll asks whether *all* requests have completed, without freeing them or filling statuses
        (``MPI_Request_get_status_all``): most polls find nothing, and every microsecond of a poll is
        paid many times while ranks share cores. Once all have, ``Waitall`` returns at once and
        fills the statuses that the byte-count check reads. (An MPI older than 4.1: ``Testall``.)"""
        if self.done:
            return True
        if _holding:  # any poll hands over every due held send, this step's or another's
            post_held()
            if self.held is not None:
                self.group.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)  # MPI still progresses the rest meanwhile
                return False
        statuses = self.statuses
        try:
            if _all_complete is None:
                if not MPI.Request.Testall(self.reqs, statuses):
                    return False
            elif not _all_complete(self.reqs):
                return False
            else:
                MPI.Request.Waitall(self.reqs, statuses)  # all have completed: frees them at once
        except MPI.Exception as exc:
            error = self._failed(exc)  # a size mismatch says all MPI said: no second traceback
            raise error from (None if isinstance(error, MessageSizeMismatch) else exc)
        self.done = True
        if statuses is not None:  # every receive's byte count against the buffer it was posted with
            for status, (label, peer, expect) in zip(statuses, self.posted):
                if expect is not None and status.Get_count(MPI.BYTE) != expect.nbytes:
                    raise self._mismatch(label, peer, expect, status.Get_count(MPI.BYTE))
        if self.after:
            for fn in self.after:
                fn()
        if trace.enabled and self.posted:
            peers = [p for _, p, _ in self.posted]
            links = topology.active
            trace.record(
                self.op,
                "comm.step",
                self.start,
                trace.now(),
                group=self.group.name,
                step=self.what,
                peer=peers,
                bytes=self.nbytes,
                **({} if links is None else {"link": [links.link(self._me(), p) for p in peers]}),
            )
        return True

    def _where(self, label: str, peer_world: int) -> str:
        me = self.group.world_rank(self.group.rank)
        return f"{self.op} on {self.group.describe()}, {self.what}: rank {me} {label} rank {peer_world}{_caller()}"

    def _mismatch(self, label: str, peer: int, buf, got: int) -> MessageSizeMismatch:
        self.group.broken = f"MessageSizeMismatch in {self.op}"
        return MessageSizeMismatch(
            f"{self._where(label, peer)}: {got} bytes arrived, but this rank expected {buf.nbytes} bytes "
            f"({_describe(buf)}). Either rank {peer} called {self.op} with a different size or dtype than this "
            "rank (every rank of the group must pass matching shapes and dtypes; TINYTRAIN_DEBUG=1 names both "
            "calls), or the two ranks cut the buffer differently in this step: check which chunk each step "
            "sends and receives, and its offsets."
        )

    def _failed(self, exc) -> CommError:
        """The error of a step whose poll raised, naming the message that failed. MPI's call on the
        whole step only says "error in status": ``Testall`` marks the failing request's status;
        after ``MPI_Request_get_status_all`` the requests are still alive, and testing them one by
        one, the failing one raises again with its own error class."""
        index, failed = 0, exc.Get_error_class()
        marked = [i for i, s in enumerate(self.statuses or ()) if s.Get_error() not in (MPI.SUCCESS, MPI.ERR_PENDING)]
        if marked:
            index, failed = marked[0], MPI.Get_error_class(self.statuses[marked[0]].Get_error())
        else:
            for i, req in enumerate(self.reqs):
                try:
                    req.Test()
                except MPI.Exception as own:
                    index, failed = i, own.Get_error_class()
                    break
        label, peer, buf = self.posted[index]
        reason = MPI.Get_error_string(failed)  # one line ("Message truncated"), not MPICH's stack
        if buf is None:
            error = CommError(f"{self._where(label, peer)}: MPI failed: {reason}")
        elif failed == MPI.ERR_TRUNCATE:
            error = MessageSizeMismatch(
                f"{self._where(label, peer)}: MPI failed: {reason}. Rank {peer} sent more than the {buf.nbytes} "
                f"bytes this rank expected ({_describe(buf)}): it called {self.op} with a larger size or dtype; "
                "every rank of the group must pass matching shapes and dtypes (TINYTRAIN_DEBUG=1 names both calls)."
            )
        else:
            error = CommError(f"{self._where(label, peer)}, expecting {_describe(buf)}: MPI failed: {reason}")
        self.group.broken = f"{type(error).__name__} in {self.op}"
        return error

    def _mpi_error(self, exc, label: str, peer: int, buf) -> CommError:  # posting failed; peer is a group rank
        return CommError(
            f"{self.op} on {self.group.describe()}, {self.what}: MPI failed posting {label} rank "
            f"{self.group.world_rank(peer)} ({_describe(buf)}): {exc}{_caller()}"
        )

    def pending(self) -> list[tuple[str, int]]:
        """The messages not yet completed, as ``(label, peer world rank)`` (asked only for error messages)."""
        if self.done:
            return []
        out = [(label, peer) for req, (label, peer, _) in zip(self.reqs, self.posted) if not req.Get_status()]
        for _, _, peer, _ in self.held or ():
            out.append(("send (held on the emulated inter-node link) to", self.group.world_ranks[peer]))
        return out


# Exchanges with sends held on an emulated link (topology.py). Any poll of any step posts the due
# ones: a rank that waits for a receive must still hand over what it isent before (a pipeline
# stage sends an activation, then waits for a gradient, and never polls the send's handle).
_holding: list[Exchange] = []
on_uninstall(_holding.clear)  # their communicators are gone


_holding_lock = threading.Lock()  # the progress thread polls too: a held send is posted once


def post_held() -> None:
    """Post every held send whose emulated arrival has come."""
    with _holding_lock:
        for ex in list(_holding):
            if ex._post_due():
                _holding.remove(ex)


def _describe(buf) -> str:
    return f"{buf.size} x {buf.dtype}, {buf.nbytes} bytes"


def _caller() -> str:
    """', called from FILE:LINE' for the innermost frame outside tinytrain.distributed (only on errors)."""
    frame = sys._getframe(1)
    inside = os.path.dirname(__file__)
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame = frame.f_back
    if frame is None:  # driven by the progress thread: the caller's stack is not ours to see
        return ""
    return f" (called from {frame.f_code.co_filename}:{frame.f_lineno})"


# --- the public point-to-point calls ---------------------------------------------------------------


class P2PWork:
    """Handle of an ``isend``/``irecv``: ``wait()`` (with deadline), ``test()``, ``is_completed()``."""

    def __init__(self, exchange: Exchange, result):
        self._ex, self._result, self._done = exchange, result, False

    def test(self) -> bool:
        if not self._done:
            self._done = self._ex.test()
        return self._done

    is_completed = test

    def wait(self, timeout: float | None = None):
        __tracebackhide__ = True
        ex = self._ex
        try:
            wait_until(self.test, lambda: f"{ex.op} on {ex.group.describe()}", ex.pending, timeout)
        except (watchdog.CommTimeout, watchdog.PeerFailure) as exc:
            ex.group.broken = f"{type(exc).__name__} in {ex.op}"
            raise
        return self._result


def wait_until(done, describe, pending, timeout=None):
    __tracebackhide__ = True
    watchdog.wait_until(done, describe, pending, timeout)


def _check_peer(g, peer: int, role: str) -> int:
    peer = int(peer)
    if not 0 <= peer < g.size:
        raise ValueError(f"{role}={peer} is not a rank of {g.describe()} (valid: 0..{g.size - 1})")
    return peer


def _check_tag(tag: int) -> int:
    if not 0 <= tag <= MAX_USER_TAG:
        raise ValueError(f"tag={tag} must be in 0..{MAX_USER_TAG} (higher tags are reserved for collectives)")
    return tag


def isend(tensor, dst: int, group=None, tag: int = 0) -> P2PWork:
    """Start sending ``tensor`` to rank ``dst`` of ``group``. Do not modify it until ``wait()``."""
    __tracebackhide__ = True  # in pytest, errors point at the caller's line
    g = resolve(group)
    check_buffer(tensor, "isend")
    ex = Exchange(g, "send", f"send to rank {dst}")
    ex.send(tensor, _check_peer(g, dst, "dst"), _check_tag(tag))
    return P2PWork(ex, tensor)


def irecv(tensor, src: int, group=None, tag: int = 0) -> P2PWork:
    """Start receiving into ``tensor`` from rank ``src`` of ``group``; ``wait()`` returns it."""
    __tracebackhide__ = True  # in pytest, errors point at the caller's line
    g = resolve(group)
    check_buffer(tensor, "irecv", writable=True)
    ex = Exchange(g, "recv", f"recv from rank {src}")
    ex.recv(tensor, _check_peer(g, src, "src"), _check_tag(tag))
    return P2PWork(ex, tensor)


def send(tensor, dst: int, group=None, tag: int = 0) -> None:
    """Send ``tensor`` to rank ``dst`` and wait until the buffer may be reused."""
    __tracebackhide__ = True  # in pytest, errors point at the caller's line
    isend(tensor, dst, group, tag).wait()


def recv(tensor, src: int, group=None, tag: int = 0):
    """Receive into ``tensor`` (in place) from rank ``src``; returns ``tensor``."""
    __tracebackhide__ = True  # in pytest, errors point at the caller's line
    return irecv(tensor, src, group, tag).wait()


def sendrecv(send_tensor, dst: int, recv_tensor, src: int, group=None, tag: int = 0):
    """Send ``send_tensor`` to ``dst`` while receiving ``recv_tensor`` from ``src``.

    Both are posted before either is waited on, so a ring of ranks each calling
    ``sendrecv(x, right, y, left)`` cannot deadlock. Returns ``recv_tensor``.
    """
    __tracebackhide__ = True  # in pytest, errors point at the caller's line
    g = resolve(group)
    check_buffer(send_tensor, "sendrecv (send buffer)")
    check_buffer(recv_tensor, "sendrecv (receive buffer)", writable=True)
    ex = Exchange(g, "sendrecv", f"sendrecv to rank {dst} / from rank {src}")
    ex.recv(recv_tensor, _check_peer(g, src, "src"), _check_tag(tag))
    ex.send(send_tensor, _check_peer(g, dst, "dst"), _check_tag(tag))
    return P2PWork(ex, recv_tensor).wait()
