"""The machinery every collective shares: a *call* that posts steps, a :class:`Work` handle that drives them.

How a collective is written (see ``algorithms.py``): a generator that ``yield``s one
:class:`~p2p.Exchange` per step and ``return``s the result. The generator never waits; whoever
drives it does:

* :func:`run` starts it (behind the debug-mode signature check); a blocking call is then driven to
  its end right there (post a step, wait for it, post the next: ``_drive``);
* an ``async_op`` call returns a :class:`Work` handle: ``Work.test()`` / ``Work.wait()`` advance it
  whenever the step in flight has completed;
* :func:`progress_all` (call it between chunks of compute) or a helper thread started by
  :func:`start_progress_thread` advance every pending async handle. Without polling, only the
  first step's messages move.

Every call's messages carry a tag made of the group's collective counter and the call's
*signature* (operation, reduce op, dtype, element count and root, in 19 bits), so two collectives
in flight on one group never confuse their messages, and ranks that call different things never
match each other's messages: a waiting rank that finds a message of its call's number but another
signature raises :class:`~watchdog.CollectiveMismatch` naming both calls (``_check_signatures``).
That costs nothing on the way (a tag is sent anyway) and is always on. In debug mode
(``TINYTRAIN_DEBUG=1``) every rank first tells every other what it is calling in full (shapes,
sizes, algorithm), and a mismatch raises the same error with every detail.
"""

from __future__ import annotations

import json
import threading
import zlib
from collections import OrderedDict

import numpy

from tinytrain import trace

from . import group, watchdog
from ._mpi import MPI
from .chunks import OPS, xp_of
from .p2p import Exchange

# Collective tags: _TAG_BASE + (seq % _SEQ_SPAN) << _SIG_BITS | signature. MPICH allows tags up to
# 2**29 - 1; an MPI with fewer tag bits (the standard guarantees only 32767) gets no signature bits.
_TAG_BASE, _SIG_BITS = 1024, 19
if MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) < _TAG_BASE + ((1000 + 1) << _SIG_BITS):
    _SIG_BITS = 0
_SEQ_SPAN = 1000 if _SIG_BITS else 30000  # collectives of one group that may be in flight at once
_TAG_SPAN = _SEQ_SPAN << _SIG_BITS  # tags _TAG_BASE .. _TAG_BASE + _TAG_SPAN - 1 are collectives'
_SIG_TAG, _SIG_BYTES = _TAG_BASE + _TAG_SPAN + 1, 512  # debug-mode signature exchange (+0: bench floor)

# The signature's fields: operation (4 bits), reduce op (3), dtype (5), then 7 bits of a hash of the
# element count and the root. Codes start at 1; 0 means "not part of this call".
_OP_CODES = {name: i + 1 for i, name in enumerate(
    ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter",
     "barrier")
)}  # fmt: skip
_REDUCE_CODES = {name: i + 1 for i, name in enumerate(OPS)}
_DTYPE_CODES = {char: i + 1 for i, char in enumerate("?bBhHiIlLqQefdgFDG")}  # numpy's type characters
_NO_DTYPE = 31  # any other dtype (ml_dtypes' bfloat16, ...)


def signature_bits(op: str, tensor=None, reduce: str | None = None, root: int = 0, count: bool = True) -> int:
    """The call's signature as it travels in the tags of its messages (what every rank must agree on).

    ``count=False`` where ranks may legally pass different sizes (all_gather with ``sizes``,
    all_to_all)."""
    if not _SIG_BITS:
        return 0
    dtype = 0 if tensor is None else _DTYPE_CODES.get(tensor.dtype.char, _NO_DTYPE)
    extra = hash((tensor.size if count and tensor is not None else -1, root)) & 0x7F  # ints hash alike everywhere
    return _OP_CODES[op] << 15 | _REDUCE_CODES.get(reduce, 0) << 12 | dtype << 7 | extra


def _describe_signature(sig: int, seq: int) -> tuple[str, dict]:
    """What a signature says, in words, and its fields (to say which differ)."""
    ops = {v: k for k, v in _OP_CODES.items()}
    reduces = {v: k for k, v in _REDUCE_CODES.items()}
    dtypes = {v: numpy.dtype(k).name for k, v in _DTYPE_CODES.items()}
    fields = {
        "operation": ops.get(sig >> 15, "an unknown operation"),
        "reduce op": reduces.get(sig >> 12 & 7),
        "dtype": dtypes.get(sig >> 7 & 31, "another dtype" if sig >> 7 & 31 else None),
        "element count or root": sig & 0x7F,
    }
    if fields["operation"] in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier"):
        fields["element count"] = fields.pop("element count or root")  # no root to differ in
    args = [f"op={fields['reduce op']}"] if fields["reduce op"] else []
    args += [fields["dtype"]] if fields["dtype"] else []
    return f"{fields['operation']}({', '.join(args)}) [collective #{seq}]", fields


class Call:
    """One collective call on one rank: group, name, tag, and the step now in flight."""

    __slots__ = (
        "group", "op", "algo", "rank", "size", "seq", "tag", "step", "start", "bytes_sent", "bytes_recv", "peers",
        "borrowed",
    )  # fmt: skip

    def __init__(self, group, op: str, algo: str, signature: int = 0):
        self.group, self.op, self.algo = group, op, algo
        self.rank, self.size = group.rank, group.size
        self.seq = group.seq
        group.seq += 1
        self.tag = _TAG_BASE + ((self.seq % _SEQ_SPAN) << _SIG_BITS | signature)
        self.step = None  # the Exchange in flight
        self.start = trace.now() if trace.enabled else 0.0
        self.bytes_sent = self.bytes_recv = 0  # for the trace span of the whole call
        self.peers: set[int] = set()
        self.borrowed: list = []  # scratch buffers, given back to the pool when the call succeeds

    def scratch(self, count: int, like):
        """A 1-D buffer of ``count`` elements of ``like``'s dtype, on ``like``'s device, for the
        algorithm's partial results. Reused across calls (see ``_scratch``): allocating a big one
        afresh each call costs more than the arithmetic done in it (new pages fault in one by one)."""
        xp = xp_of(like)
        if count * like.itemsize < _SCRATCH_MIN_BYTES:  # small: malloc's free lists beat any pool of ours
            return xp.empty(int(count), dtype=like.dtype)
        key = (xp.__name__, like.dtype.str, int(count))
        free = _scratch.get(key)
        buf = free.pop() if free else xp.empty(int(count), dtype=like.dtype)
        self.borrowed.append((key, buf))
        return buf

    def exchange(self, what: str, sends=(), recvs=()) -> Exchange:
        """Post one step: ``sends``/``recvs`` are ``(buffer, group_rank)`` pairs."""
        ex = Exchange(self.group, self.op, what)
        tag = self.tag
        for buf, peer in recvs:  # receives first: a matching send then never waits for a buffer
            ex.recv(buf, peer, tag)
        for buf, peer in sends:
            ex.send(buf, peer, tag)
        if trace.enabled:  # totals for the trace span of the whole call
            self.bytes_recv += sum(buf.nbytes for buf, _ in recvs)
            self.bytes_sent += ex.nbytes
            self.peers.update(peer for _, peer in (*sends, *recvs))
        self.step = ex
        return ex

    def describe(self) -> str:
        where = f", {self.step.what}" if self.step is not None else ""
        return f"{self.op}(algo={self.algo}) #{self.seq} on {self.group.describe()}{where}"

    def pending(self):
        return self.step.pending() if self.step is not None else []

    def wait(self, done, pending, timeout: float | None = None) -> None:
        """Poll ``done()`` until True (``watchdog.wait_until``); a timeout or a failed peer leaves
        the group unusable, since this call's messages may still be in flight."""
        __tracebackhide__ = True  # pytest: show the caller's line, not this machinery
        try:
            watchdog.wait_until(done, self.describe, pending, timeout, self._check_signatures)
        except (watchdog.CommTimeout, watchdog.PeerFailure, watchdog.CollectiveMismatch) as exc:
            self.group.broken = f"{type(exc).__name__} in {self.op} #{self.seq}"
            raise

    def _check_signatures(self) -> None:
        """Raise CollectiveMismatch if a rank we wait for sent a message of this call's number under
        another signature (it called something else: another op, dtype, size or root).

        Called by a wait that did not end at once, every few polls: a probe per awaited peer."""
        __tracebackhide__ = True
        step = self.step
        if step is None or not _SIG_BITS:
            return
        status, mine = MPI.Status(), self.tag - _TAG_BASE
        for label, world_peer, _ in step.posted:
            if label != "recv from":
                continue
            peer = self.group.world_ranks.index(world_peer)
            if not self.group.comm.Iprobe(source=peer, tag=MPI.ANY_TAG, status=status):
                continue
            theirs = status.Get_tag() - _TAG_BASE
            if 0 <= theirs < _TAG_SPAN and theirs >> _SIG_BITS == mine >> _SIG_BITS and theirs != mine:
                raise self._mismatch(world_peer, theirs)

    def _mismatch(self, world_peer: int, theirs: int) -> watchdog.CollectiveMismatch:
        mask = (1 << _SIG_BITS) - 1
        mine_text, mine = _describe_signature((self.tag - _TAG_BASE) & mask, self.seq)
        their_text, their = _describe_signature(theirs & mask, self.seq)
        differ = [k for k in mine if mine[k] != their.get(k)]
        differ = ["operation"] if "operation" in differ else differ  # the rest follows from it
        me = self.group.world_rank(self.rank)
        return watchdog.CollectiveMismatch(
            f"collective mismatch on {self.group.describe()}: rank {world_peer} called {their_text} while "
            f"rank {me} called {mine_text} (they differ in {' and '.join(differ)}). Every rank of a group "
            "must call the same collectives in the same order, with the same op, dtype and element count "
            "(and root); TINYTRAIN_DEBUG=1 shows both calls in full."
        )


# Scratch buffers of finished calls, by (array module, dtype, length), most recently used last. Only a
# call that *succeeded* gives its buffers back: after a timeout a receive may still land in one.
# At most _SCRATCH_KEYS sizes and _SCRATCH_PER_KEY buffers each are kept. Buffers under
# _SCRATCH_MIN_BYTES are not pooled: the bookkeeping cost a 1 KiB all-reduce on 4 ranks sharing 2
# cores about a tenth of its time, and so small an allocation faults in no fresh pages.
_scratch: OrderedDict = OrderedDict()
_SCRATCH_KEYS, _SCRATCH_PER_KEY, _SCRATCH_MIN_BYTES = 16, 4, 16 << 10


def _give_back(borrowed: list) -> None:
    for key, buf in borrowed:
        free = _scratch.setdefault(key, [])
        _scratch.move_to_end(key)
        if len(free) < _SCRATCH_PER_KEY:
            free.append(buf)
    while len(_scratch) > _SCRATCH_KEYS:
        _scratch.popitem(last=False)


_lock = threading.RLock()  # one driver at a time (the caller or the progress thread)
_pending: set[Work] = set()  # async handles not yet complete, advanced by progress_all()


class Work:
    """Drives a collective's generator; returned by ``async_op=True`` calls."""

    def __init__(self, call: Call, gen):
        __tracebackhide__ = True
        self._call, self._gen = call, gen
        self._done, self._result, self._error = False, None, None
        with _lock:
            self._advance()  # post the first step now, so all ranks post in call order

    def _advance(self) -> bool:
        """Run the generator as far as it goes without waiting. True when finished."""
        __tracebackhide__ = True  # pytest: show the caller's line, not this machinery
        step = self._call.step
        while step is None or step.test():
            try:
                step = self._gen.send(None)
            except StopIteration as stop:
                self._done, self._result = True, stop.value
                _pending.discard(self)
                _finish(self._call)
                return True
        return False

    def test(self) -> bool:
        """Advance the algorithm if its current step completed; True once it is finished."""
        __tracebackhide__ = True  # pytest: show the caller's line, not this machinery
        if self._done or self._error:
            return True
        with _lock:
            try:
                return self._done or self._advance()
            except BaseException as exc:  # noqa: BLE001 - kept for wait(); never lose an error in a thread
                self._error = exc
                _pending.discard(self)
                return True

    def is_completed(self) -> bool:
        return self.test()

    def wait(self, timeout: float | None = None):
        """Drive the algorithm to the end (deadline: TINYTRAIN_TIMEOUT) and return its result."""
        __tracebackhide__ = True  # pytest: show the caller's line, not this machinery
        self._call.wait(self.test, self._call.pending, timeout)
        if self._error is not None:
            raise self._error
        return self._result


def _finish(c: Call) -> None:
    """A call has finished: give its scratch buffers back, record its trace span."""
    c.step = None
    if c.borrowed:
        _give_back(c.borrowed)
        c.borrowed = []
    if trace.enabled:
        trace.record(
            c.op,
            "comm",
            c.start,
            trace.now(),
            group=c.group.name,
            algo=c.algo,
            seq=c.seq,
            peer=sorted(c.group.world_rank(p) for p in c.peers),
            bytes=c.bytes_sent,
            bytes_recv=c.bytes_recv,
        )


def run(call: Call, body, async_op: bool, signature):
    """Start ``body`` (a generator) behind the debug signature check; wait unless async.

    ``signature()`` returns what this rank calls, as a dict (shape, dtype, ...); it is only
    called in debug mode (building it costs more than a small collective's own work)."""
    __tracebackhide__ = True  # pytest: show the caller's line, not this machinery
    gen = _checked(call, signature(), body) if watchdog.debug() else body
    if not async_op:
        return _drive(call, gen)
    work = Work(call, gen)
    if not work._done:
        _pending.add(work)
    return work


def _drive(c: Call, gen):
    """Run a blocking call to its end: post a step, wait for it, post the next, ...

    What ``Work(...).wait()`` does, without the handle: most small collectives are nothing but this
    loop. The lock is taken only while a progress thread runs (it advances other calls meanwhile),
    and then only while this call touches MPI."""
    __tracebackhide__ = True  # pytest: show the caller's line, not this machinery
    try:
        while True:
            if _thread is None:  # no other thread drives calls: nothing to lock out
                step = gen.send(None)  # runs the algorithm on to its next step, which it posts
                c.wait(step.test, step.pending)
            else:
                with _lock:
                    step = gen.send(None)
                c.wait(_locked(step.test), step.pending)
    except StopIteration as stop:
        _finish(c)
        return stop.value


def _locked(test):
    def locked_test() -> bool:
        with _lock:
            return test()

    return locked_test


# --- progress: polling pending async handles ------------------------------------------------------


def progress_all() -> None:
    """Advance every pending async collective by whatever steps have completed. Cheap; call often."""
    for work in list(_pending):
        work.test()


def forget_pending() -> None:
    """Drop all pending handles and pooled scratch buffers (whenever the world is replaced, e.g.
    between tests)."""
    _pending.clear()
    _scratch.clear()


group.on_uninstall(forget_pending)


class _ProgressThread(threading.Thread):
    def __init__(self, interval: float):
        super().__init__(name="tinytrain-progress", daemon=True)
        self.interval, self.stop_event = interval, threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            if _pending:
                progress_all()
            # NumPy releases the GIL in big kernels, so this thread runs while the caller computes.
            self.stop_event.wait(self.interval if _pending else 10 * self.interval)


_thread: _ProgressThread | None = None


def start_progress_thread(interval: float = 1e-4) -> None:
    """Poll pending async collectives from a background thread every ``interval`` seconds."""
    global _thread
    if _thread is None or not _thread.is_alive():
        _thread = _ProgressThread(interval)
        _thread.start()


def stop_progress_thread() -> None:
    global _thread
    if _thread is not None:
        _thread.stop_event.set()
        _thread.join()
        _thread = None


# --- debug mode: every rank tells every other what it is calling ----------------------------------


def _checked(c: Call, sig: dict, body):
    """Exchange signatures with every rank of the group, compare, then run ``body``."""
    __tracebackhide__ = True  # pytest: show the caller's line, not this machinery
    mine = _fitting(dict(sig, op=c.op, seq=c.seq))
    blob = json.dumps(mine).encode().ljust(_SIG_BYTES)
    send = numpy.frombuffer(blob, dtype=numpy.uint8).copy()
    theirs = {p: numpy.empty(_SIG_BYTES, dtype=numpy.uint8) for p in range(c.size) if p != c.rank}
    # Counted under its own name, so byte accounting of the real operation stays textbook-exact.
    ex = Exchange(c.group, "debug_check", f"debug signature check of {c.op}")
    for p, buf in theirs.items():
        ex.recv(buf, p, _SIG_TAG)
        ex.send(send, p, _SIG_TAG)
    c.step = ex
    yield ex
    sigs = {p: json.loads(buf.tobytes().decode().strip() or "{}") for p, buf in theirs.items()}
    sigs[c.rank] = mine
    _compare_signatures(c, sigs)
    return (yield from body)


def _fitting(sig: dict) -> dict:
    """``sig`` with its long lists (``sizes`` on 64 ranks, a long shape) replaced by a digest, so that
    it fits in ``_SIG_BYTES``: ranks still compare equal exactly when their lists are equal."""
    if len(json.dumps(sig)) <= _SIG_BYTES:
        return sig
    short = dict(sig)
    for key in ("sizes", "shape", "tail"):
        value = short.get(key)
        if isinstance(value, list) and len(value) > 4:
            short[key] = f"{len(value)} values, crc32 {zlib.crc32(json.dumps(value).encode()):08x}"
    if len(json.dumps(short)) > _SIG_BYTES:
        raise ValueError(
            f"{sig['op']}: the call's signature does not fit the debug check ({len(json.dumps(short))} bytes)"
        )
    return short


def _fmt_sig(s: dict) -> str:
    shape = tuple(s["shape"]) if isinstance(s["shape"], list) else s["shape"]  # or its digest (_fitting)
    args = [f"shape={shape}", s["dtype"]]
    args += [f"{k}={s[k]}" for k in ("reduce", "root", "algo", "sizes") if s.get(k) is not None]
    return f"{s['op']}({', '.join(args)}) [collective #{s['seq']}]"


def _compare_signatures(c: Call, sigs: dict[int, dict]) -> None:
    """Raise CollectiveMismatch, in words, unless all ranks called the same thing."""
    __tracebackhide__ = True  # pytest: show the caller's line, not this machinery
    ref = sigs[0]
    keys = ["op", "seq", "dtype", "reduce", "root", "algo", "sizes", "tail"]
    keys += ["shape"] if ref.get("same_shape") else []
    for rank in sorted(sigs):
        s = sigs[rank]
        diff = [k for k in keys if s.get(k) != ref.get(k)]
        if diff:
            world = c.group.world_ranks
            raise watchdog.CollectiveMismatch(
                f"collective mismatch on {c.group.describe()}: rank {world[rank]} called "
                f"{_fmt_sig(s)} while rank {world[0]} called {_fmt_sig(ref)} "
                f"(they differ in {', '.join(diff)}). Every rank of a group must call the same "
                "collectives in the same order with matching shapes and dtypes."
            )
