"""Collectives, written by hand on point-to-point messages.

Read this file top to bottom: first the machinery every collective shares (a *call* that posts
steps and a :class:`Work` handle that drives them), then one algorithm per section, then the public
functions with their argument checks.

Conventions (like ``torch.distributed`` where it has an equivalent):

* ``all_reduce(x)``, ``broadcast(x)``, ``reduce(x)`` and ``scatter(x, full)`` work **in place** on
  ``x`` and return it. ``all_gather``, ``reduce_scatter``, ``all_to_all`` and ``gather`` **return a
  new array** (or fill ``out=`` if given). Pieces are always split/joined along axis 0.
* Ranks (``src``, ``dst``) are ranks of ``group`` (default: the world).
* ``op`` is one of ``"sum"``, ``"avg"`` (floating dtypes only), ``"max"``, ``"min"``, ``"prod"``.
* ``async_op=True`` returns a :class:`Work` handle: ``h.wait()`` returns what the call would
  have returned. The algorithm is a sequence of steps; a step's messages are posted, and the next
  step (with its local reduction) runs when a poll finds the step complete. Polling happens in
  ``h.test()``, ``h.wait()``, :func:`progress_all` (call it between chunks of compute), or in a
  helper thread started by :func:`start_progress_thread`. Without polling, only the first step's
  messages move.
* ``algo=`` forces an algorithm; by default one is chosen by message size.
* Every call's messages carry a tag derived from the group's collective counter, so two
  collectives in flight on one group never confuse their messages.

How a collective is written: a generator that ``yield``s one :class:`~p2p.Exchange` per step and
``return``s the result. The generator never waits; whoever drives it does.
"""

from __future__ import annotations

import json
import threading

import numpy

from tinytrain import backend, trace

from . import watchdog
from .group import resolve
from .p2p import Exchange, check_buffer

OPS = ("sum", "avg", "max", "min", "prod")
_UFUNC = {"sum": "add", "avg": "add", "max": "maximum", "min": "minimum", "prod": "multiply"}

# all_reduce picks its algorithm by buffer size (measured with `tinytrain bench collectives` on 4
# ranks sharing 2 cores, where every step costs a scheduling delay):
#   < SMALL_MESSAGE_BYTES   recursive doubling: log2(n) steps, but each sends the whole buffer
#   < LARGE_MESSAGE_BYTES   halving-doubling: the ring's volume in 2 log2(n) steps
#   otherwise               ring: 2(n-1) steps of 1/n of the buffer, bandwidth-optimal on any n
SMALL_MESSAGE_BYTES = 256 * 1024
LARGE_MESSAGE_BYTES = 4 * 1024 * 1024


def choose_all_reduce_algo(nbytes: int) -> str:
    """The all_reduce algorithm used for a buffer of ``nbytes`` when ``algo`` is not given."""
    if nbytes < SMALL_MESSAGE_BYTES:
        return "recursive_doubling"
    return "halving_doubling" if nbytes < LARGE_MESSAGE_BYTES else "ring"

_TAG_BASE, _TAG_SPAN = 1024, 30000  # collective tags: 1024 + seq % 30000
_SIG_TAG, _SIG_BYTES = 32000, 512  # debug-mode signature exchange


# =================================================================================================
# Machinery: a call, its steps, the handle that drives it
# =================================================================================================


class _Call:
    """One collective call on one rank: group, name, tag, and the step now in flight."""

    def __init__(self, group, op: str, algo: str):
        self.group, self.op, self.algo = group, op, algo
        self.rank, self.size = group.rank, group.size
        self.seq = group.seq
        group.seq += 1
        self.tag = _TAG_BASE + self.seq % _TAG_SPAN
        self.step = None  # the Exchange in flight
        self.start = trace.now() if trace.enabled else 0.0
        self.bytes_sent = self.bytes_recv = 0  # for the trace span of the whole call
        self.peers: set[int] = set()

    def exchange(self, what: str, sends=(), recvs=()) -> Exchange:
        """Post one step: ``sends``/``recvs`` are ``(buffer, group_rank)`` pairs."""
        ex = Exchange(self.group, self.op, what)
        for buf, peer in recvs:  # receives first: a matching send then never waits for a buffer
            ex.recv(buf, peer, self.tag)
            self.bytes_recv += buf.nbytes
            self.peers.add(peer)
        for buf, peer in sends:
            ex.send(buf, peer, self.tag)
            self.bytes_sent += buf.nbytes
            self.peers.add(peer)
        self.step = ex
        return ex

    def describe(self) -> str:
        where = f", {self.step.what}" if self.step is not None else ""
        return f"{self.op}(algo={self.algo}) #{self.seq} on {self.group.describe()}{where}"

    def pending(self):
        return self.step.pending() if self.step is not None else []


_lock = threading.RLock()  # one driver at a time (the caller or the progress thread)
_pending: set["Work"] = set()  # async handles not yet complete, advanced by progress_all()


class Work:
    """Drives a collective's generator; returned by ``async_op=True`` calls."""

    def __init__(self, call: _Call, gen):
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
                self._finish(stop.value)
                return True
        return False

    def _finish(self, result) -> None:
        self._done, self._result = True, result
        self._call.step = None
        _pending.discard(self)
        if trace.enabled:
            c = self._call
            trace.record(
                c.op, "comm", c.start, trace.now(), group=c.group.name, algo=c.algo, seq=c.seq,
                peer=sorted(c.group.world_rank(p) for p in c.peers), bytes=c.bytes_sent,
                bytes_recv=c.bytes_recv,
            )

    def test(self) -> bool:
        """Advance the algorithm if its current step completed; True once it is finished."""
        __tracebackhide__ = True  # pytest: show the caller's line, not this machinery
        if self._done or self._error:
            return True
        with _lock:
            try:
                return self._done or self._advance()
            except BaseException as exc:  # keep it for wait(); never lose an error in a thread
                self._error = exc
                _pending.discard(self)
                return True

    def is_completed(self) -> bool:
        return self.test()

    def wait(self, timeout: float | None = None):
        """Drive the algorithm to the end (deadline: TINYTRAIN_TIMEOUT) and return its result."""
        __tracebackhide__ = True  # pytest: show the caller's line, not this machinery
        c = self._call
        try:
            watchdog.wait_until(self.test, c.describe, c.pending, timeout)
        except (watchdog.CommTimeout, watchdog.PeerFailure) as exc:
            c.group.broken = f"{type(exc).__name__} in {c.op} #{c.seq}"
            raise
        if self._error is not None:
            raise self._error
        return self._result


def progress_all() -> None:
    """Advance every pending async collective by whatever steps have completed. Cheap; call often."""
    for work in list(_pending):
        work.test()


def _forget_pending() -> None:
    """Drop all pending handles (the harness calls this between tests)."""
    _pending.clear()


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


def _run(call: _Call, body, async_op: bool, signature: dict):
    """Start ``body`` (a generator) behind the debug signature check; wait unless async."""
    __tracebackhide__ = True  # pytest: show the caller's line, not this machinery
    gen = _checked(call, signature, body) if watchdog.debug() else body
    work = Work(call, gen)
    if async_op:
        if not work._done:
            _pending.add(work)
        return work
    return work.wait()


# =================================================================================================
# Debug mode: every rank tells every other what it is calling
# =================================================================================================


def _checked(c: _Call, sig: dict, body):
    """Exchange signatures with every rank of the group, compare, then run ``body``."""
    __tracebackhide__ = True  # pytest: show the caller's line, not this machinery
    mine = dict(sig, op=c.op, seq=c.seq)
    blob = json.dumps(mine).encode()[:_SIG_BYTES].ljust(_SIG_BYTES)
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


def _fmt_sig(s: dict) -> str:
    args = [f"shape={tuple(s['shape'])}", s["dtype"]]
    args += [f"{k}={s[k]}" for k in ("reduce", "root", "algo", "sizes") if s.get(k) is not None]
    return f"{s['op']}({', '.join(args)}) [collective #{s['seq']}]"


def _compare_signatures(c: _Call, sigs: dict[int, dict]) -> None:
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


# =================================================================================================
# Helpers
# =================================================================================================


def _xp_of(arr):
    """The array module of ``arr`` (NumPy, or CuPy for device arrays)."""
    return numpy if isinstance(arr, numpy.ndarray) else backend.xp


def _combine(acc, incoming, op: str) -> None:
    """acc <- acc (op) incoming, elementwise, in place."""
    getattr(_xp_of(acc), _UFUNC[op])(acc, incoming, out=acc)


def _bounds(counts: list[int]) -> list[tuple[int, int]]:
    """(start, stop) of consecutive pieces with the given lengths."""
    out, start = [], 0
    for n in counts:
        out.append((start, start + n))
        start += n
    return out


def split_counts(length: int, parts: int) -> list[int]:
    """Split ``length`` into ``parts`` nearly equal counts, larger ones first.

    This is how every ring algorithm here chunks a buffer whose length is not divisible by the
    number of ranks: the first ``length % parts`` chunks get one extra element (like
    ``numpy.array_split``). Textbook volumes hold exactly when the length divides evenly; otherwise
    a rank's volume depends on which chunks it happens to send (see the per-algorithm notes).
    """
    q, r = divmod(length, parts)
    return [q + 1 if i < r else q for i in range(parts)]


# =================================================================================================
# Ring algorithms (bandwidth-optimal): reduce-scatter, all-gather, and all-reduce = both
# =================================================================================================
#
# n ranks stand in a ring; each sends only to its right neighbour and receives from its left.
# The buffer is cut into n chunks. Reduce-scatter, n=4, chunk c of rank r written r.c:
#
#   step 0:  rank 0 sends chunk 0 ->, rank 1 sends chunk 1 ->, ...   each adds what it receives
#   step 1:  rank 0 sends chunk 3 (now 3.3+3.0) ->, rank 1 sends chunk 0 (0.0+0.1) -> ...
#   step 2:  ...after n-1 steps rank r holds chunk r+1 summed over all ranks:
#
#      rank 0        rank 1        rank 2        rank 3
#    [ . Σ . . ]   [ . . Σ . ]   [ . . . Σ ]   [ Σ . . . ]
#
# All-gather then circulates the finished chunks n-1 more steps, overwriting instead of adding.
# Each rank sends n-1 chunks per phase, so all-reduce sends 2(n-1)/n of the buffer per rank,
# independent of n: the bandwidth-optimal volume.
#
# ``shift`` chooses which chunk each rank ends with: rank r ends with chunk (r + 1 + shift) % n.
# All-reduce uses shift=0; standalone reduce-scatter / all-gather use shift=-1 so rank r owns
# chunk r (the natural layout for sharding).


def _ring_reduce_scatter(c: _Call, flat, bounds, op: str, shift: int):
    """Ring reduce-scatter of ``flat``, in place, in n-1 steps (assignment task 1.1).

    ``bounds[i]`` is the (start, stop) of chunk i in ``flat``. Each step is one
    ``yield c.exchange(what, sends=[(chunk, right)], recvs=[(tmp, left)])``: a step's send and
    receive are posted together, so no rank waits for another to receive first. After the last
    step, chunk (r + 1 + shift) % n of rank r holds the reduction (``_combine``) over all ranks.
    """
    # BEGIN SOLUTION 1.1 "Step s sends chunk (r-s+shift)%n right, receives chunk (r-s-1+shift)%n from the left, combines it in."
    n, r = c.size, c.rank
    right, left = (r + 1) % n, (r - 1) % n
    tmp = _xp_of(flat).empty(max((b - a for a, b in bounds), default=0), dtype=flat.dtype)
    for s in range(n - 1):
        send_i, recv_i = (r - s + shift) % n, (r - s - 1 + shift) % n
        (sa, sb), (ra, rb) = bounds[send_i], bounds[recv_i]
        incoming = tmp[: rb - ra]
        yield c.exchange(
            f"ring reduce-scatter step {s + 1}/{n - 1} (chunk {send_i} to rank {right}, "
            f"chunk {recv_i} from rank {left})",
            sends=[(flat[sa:sb], right)],
            recvs=[(incoming, left)],
        )
        _combine(flat[ra:rb], incoming, op)
    # END SOLUTION


def _ring_all_gather(c: _Call, flat, bounds, shift: int, label: str = "ring all-gather"):
    """Ring all-gather in place, in n-1 steps (assignment task 1.2).

    On entry rank r's chunk (r + 1 + shift) % n of ``flat`` is final; on exit every chunk is. Like
    reduce-scatter, but a received chunk overwrites (it is already finished) instead of adding.
    """
    # BEGIN SOLUTION 1.2 "Step s sends chunk (r+1+shift-s)%n right and receives chunk (r+shift-s)%n from the left into flat."
    n, r = c.size, c.rank
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        send_i, recv_i = (r + 1 + shift - s) % n, (r + shift - s) % n
        (sa, sb), (ra, rb) = bounds[send_i], bounds[recv_i]
        yield c.exchange(
            f"{label} step {s + 1}/{n - 1} (chunk {send_i} to rank {right}, chunk {recv_i} from rank {left})",
            sends=[(flat[sa:sb], right)],
            recvs=[(flat[ra:rb], left)],
        )
    # END SOLUTION


def _all_reduce_ring(c: _Call, flat, op: str):
    """Ring all-reduce = reduce-scatter + all-gather (assignment task 1.3).

    Volume sent by rank r with chunk lengths len_i (split_counts):
    2*N - len_{(r+1)%n} - len_{(r+2)%n} elements, i.e. 2(n-1)/n * N when n divides N."""
    # BEGIN SOLUTION 1.3 "Cut flat into n chunks (split_counts, _bounds); reduce-scatter, then all-gather, both with shift=0."
    bounds = _bounds(split_counts(flat.size, c.size))
    yield from _ring_reduce_scatter(c, flat, bounds, op, shift=0)
    yield from _ring_all_gather(c, flat, bounds, shift=0)
    # END SOLUTION


# =================================================================================================
# Recursive doubling all-reduce (latency-optimal for small buffers)
# =================================================================================================
#
# With n a power of two: in round k each rank swaps its whole buffer with the rank whose number
# differs in bit k, and both add. After log2(n) rounds everyone has the sum:
#
#   round 0:  0<->1   2<->3        (each holds a pair sum)
#   round 1:  0<->2   1<->3        (each holds the total)
#
# Otherwise let p be the largest power of two <= n. The n-p "extra" ranks p.. first hand their
# buffer to rank r-p and sit out; the p remaining ranks do the rounds; the extras get the result
# back. Volume: log2(p) whole buffers per rank (+1 for the folded pairs); few steps, more bytes.


def _all_reduce_recursive_doubling(c: _Call, flat, op: str):
    n, r = c.size, c.rank
    p = 1 << (n.bit_length() - 1)
    tmp = _xp_of(flat).empty_like(flat)
    if r >= p:  # an extra rank: fold into r - p, get the answer back later
        yield c.exchange(f"recursive doubling: fold into rank {r - p}", sends=[(flat, r - p)])
        yield c.exchange(f"recursive doubling: result from rank {r - p}", recvs=[(flat, r - p)])
        return
    if r + p < n:
        yield c.exchange(f"recursive doubling: fold from rank {r + p}", recvs=[(tmp, r + p)])
        _combine(flat, tmp, op)
    rounds = p.bit_length() - 1
    for k in range(rounds):
        partner = r ^ (1 << k)
        yield c.exchange(
            f"recursive doubling round {k + 1}/{rounds} with rank {partner}",
            sends=[(flat, partner)],
            recvs=[(tmp, partner)],
        )
        _combine(flat, tmp, op)  # a+b == b+a exactly, so both partners hold identical bits
    if r + p < n:
        yield c.exchange(f"recursive doubling: result to rank {r + p}", sends=[(flat, r + p)])


# =================================================================================================
# Halving-doubling all-reduce (Rabenseifner): the ring's volume in 2 log2(n) steps
# =================================================================================================
#
# Reduce-scatter by recursive *halving*: in round k, rank r and its partner r ^ (p/2^(k+1)) split
# the part they are responsible for in two; each sends the half the other keeps, and adds the
# half it receives. Then all-gather by recursive *doubling* (the same rounds backwards, sending
# whole finished parts). n=4, buffer in chunks 0-3:
#
#   halving 1: 0<->2, 1<->3 swap halves  -> ranks 0,1 own chunks 0-1, ranks 2,3 own chunks 2-3
#   halving 2: 0<->1, 2<->3 swap halves  -> rank r owns chunk r, fully reduced
#   doubling 1: 0<->1, 2<->3             -> chunks 0-1 on ranks 0,1; chunks 2-3 on ranks 2,3
#   doubling 2: 0<->2, 1<->3             -> everyone has everything
#
# Each rank sends N/2 + N/4 + ... = (p-1)/p N per phase: exactly the ring's 2(n-1)/n N when n is a
# power of two, but in 2 log2(n) steps instead of 2(n-1) -- fewer latencies, the same bandwidth.
# Other n fold the extra ranks in and out as recursive doubling does.


def _all_reduce_halving_doubling(c: _Call, flat, op: str):
    n, r = c.size, c.rank
    p = 1 << (n.bit_length() - 1)
    if r >= p:  # an extra rank: fold into r - p, get the answer back later
        yield c.exchange(f"halving-doubling: fold into rank {r - p}", sends=[(flat, r - p)])
        yield c.exchange(f"halving-doubling: result from rank {r - p}", recvs=[(flat, r - p)])
        return
    tmp = _xp_of(flat).empty_like(flat)
    if r + p < n:
        yield c.exchange(f"halving-doubling: fold from rank {r + p}", recvs=[(tmp, r + p)])
        _combine(flat, tmp, op)
    bounds = _bounds(split_counts(flat.size, p))
    span = lambda lo, hi: (bounds[lo][0], bounds[hi - 1][1])  # noqa: E731  (chunks -> elements)
    lo, hi, windows = 0, p, []
    mask = p >> 1
    while mask:  # reduce-scatter by halving
        partner, mid = r ^ mask, (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if r & mask == 0 else ((mid, hi), (lo, mid))
        (ka, kb), (ga, gb) = span(*keep), span(*give)
        yield c.exchange(
            f"halving step with rank {partner} (keep chunks {keep[0]}..{keep[1] - 1})",
            sends=[(flat[ga:gb], partner)], recvs=[(tmp[ka:kb], partner)],
        )
        _combine(flat[ka:kb], tmp[ka:kb], op)
        windows.append((lo, hi))
        lo, hi = keep
        mask >>= 1
    mask = 1
    while mask < p:  # all-gather by doubling, retracing the windows
        partner = r ^ mask
        parent_lo, parent_hi = windows.pop()
        other = (parent_lo, lo) if lo > parent_lo else (hi, parent_hi)
        (ma, mb), (oa, ob) = span(lo, hi), span(*other)
        yield c.exchange(
            f"doubling step with rank {partner} (send chunks {lo}..{hi - 1})",
            sends=[(flat[ma:mb], partner)], recvs=[(flat[oa:ob], partner)],
        )
        lo, hi = parent_lo, parent_hi
        mask <<= 1
    if r + p < n:
        yield c.exchange(f"halving-doubling: result to rank {r + p}", sends=[(flat, r + p)])


# =================================================================================================
# Naive all-reduce: the parameter-server shape
# =================================================================================================
#
#        rank 0  <- every other rank sends its whole buffer (n-1 buffers arrive at one rank)
#        rank 0  -> sends the sum back to every rank
#
# Rank 0's link carries 2(n-1) buffers while the others idle: the bottleneck the ring removes.


def _all_reduce_naive(c: _Call, flat, op: str):
    n, r = c.size, c.rank
    if r == 0:
        parts = [_xp_of(flat).empty_like(flat) for _ in range(n - 1)]
        yield c.exchange("naive: gather to rank 0", recvs=[(parts[i - 1], i) for i in range(1, n)])
        for part in parts:  # in rank order, so the result does not depend on arrival order
            _combine(flat, part, op)
        yield c.exchange("naive: broadcast from rank 0", sends=[(flat, i) for i in range(1, n)])
    else:
        yield c.exchange("naive: send to rank 0", sends=[(flat, 0)])
        yield c.exchange("naive: result from rank 0", recvs=[(flat, 0)])


# =================================================================================================
# Binomial trees: broadcast and reduce
# =================================================================================================
#
# Number ranks relative to the root (v = (r - root) mod n). Broadcast, n=8: in round k every rank
# that already has the data sends it 2^k further:
#
#   round 0: 0->1        round 1: 0->2, 1->3        round 2: 0->4, 1->5, 2->6, 3->7
#
# log2(n) rounds instead of the root sending n-1 times. Reduce runs the same tree backwards,
# combining on the way up. Works for any n (children past n simply do not exist).


def _tree_children(v: int, n: int) -> list[int]:
    """Relative ranks that relative rank v sends to in a binomial broadcast."""
    low = v & -v if v else 1 << n.bit_length()  # the root may send at every distance
    kids, mask = [], 1
    while mask < low and v + mask < n:
        kids.append(v + mask)
        mask <<= 1
    return kids


def _broadcast_tree(c: _Call, flat, root: int):
    """Binomial-tree broadcast of ``flat`` from ``root``, in place (assignment task 1.5).

    Work with ranks relative to the root, v = (rank - root) % n: every rank but the root first
    receives from its parent, then sends to its children (``_tree_children``) in one step.
    """
    # BEGIN SOLUTION 1.5 "Unless v == 0, receive from parent v - (v & -v); then send to every child in _tree_children(v, n)."
    n = c.size
    v = (c.rank - root) % n
    absolute = lambda u: (u + root) % n  # noqa: E731
    if v:
        parent = v - (v & -v)  # clear the lowest set bit
        yield c.exchange(f"tree broadcast: receive from rank {absolute(parent)}", recvs=[(flat, absolute(parent))])
    kids = _tree_children(v, n)
    if kids:
        # All children at once (largest subtree first): they all get the same buffer.
        yield c.exchange(
            f"tree broadcast: send to ranks {[absolute(k) for k in reversed(kids)]}",
            sends=[(flat, absolute(k)) for k in reversed(kids)],
        )
    # END SOLUTION


def _broadcast_naive(c: _Call, flat, root: int):
    if c.rank == root:
        yield c.exchange("naive broadcast: root sends to all", sends=[(flat, p) for p in range(c.size) if p != root])
    else:
        yield c.exchange(f"naive broadcast: receive from rank {root}", recvs=[(flat, root)])


def _reduce_tree(c: _Call, flat, root: int, op: str):
    """Binomial-tree reduce; the result lands in ``flat`` on the root (others' buffers untouched)."""
    n = c.size
    v = (c.rank - root) % n
    absolute = lambda u: (u + root) % n  # noqa: E731
    acc = flat if v == 0 else flat.copy()
    tmp = _xp_of(flat).empty_like(flat)
    for kid in _tree_children(v, n):  # smallest subtree first: it finishes first
        yield c.exchange(f"tree reduce: receive from rank {absolute(kid)}", recvs=[(tmp, absolute(kid))])
        _combine(acc, tmp, op)
    if v:
        parent = v - (v & -v)
        yield c.exchange(f"tree reduce: send to rank {absolute(parent)}", sends=[(acc, absolute(parent))])


def _reduce_naive(c: _Call, flat, root: int, op: str):
    if c.rank == root:
        others = [p for p in range(c.size) if p != root]
        parts = [_xp_of(flat).empty_like(flat) for _ in others]
        yield c.exchange("naive reduce: receive from all", recvs=list(zip(parts, others)))
        for part in parts:
            _combine(flat, part, op)
    else:
        yield c.exchange(f"naive reduce: send to rank {root}", sends=[(flat, root)])


# =================================================================================================
# Gather, scatter (linear: the root talks to everyone), all-to-all (pairwise exchange)
# =================================================================================================


def _gather_linear(c: _Call, flat, out, root: int, bounds):
    if c.rank == root:
        a, b = bounds[root]
        out[a:b] = flat
        others = [p for p in range(c.size) if p != root]
        yield c.exchange("gather: receive from all", recvs=[(out[bounds[p][0] : bounds[p][1]], p) for p in others])
    else:
        yield c.exchange(f"gather: send to rank {root}", sends=[(flat, root)])


def _scatter_linear(c: _Call, flat, full, root: int, bounds):
    if c.rank == root:
        a, b = bounds[root]
        flat[...] = full[a:b]
        others = [p for p in range(c.size) if p != root]
        yield c.exchange("scatter: send to all", sends=[(full[bounds[p][0] : bounds[p][1]], p) for p in others])
    else:
        yield c.exchange(f"scatter: receive from rank {root}", recvs=[(flat, root)])


# Pairwise exchange, n=4: in step s rank r sends its piece for rank r+s and receives the piece
# from rank r-s. Every pair talks exactly once in each direction, and no rank ever has more than
# one message in and one out:
#
#   step 1: 0->1 1->2 2->3 3->0     step 2: 0->2 1->3 2->0 3->1     step 3: 0->3 1->0 2->1 3->2


def _all_to_all_pairwise(c: _Call, flat, send_bounds, out, recv_bounds):
    """All-to-all by pairwise exchange in n-1 steps (assignment task 1.4).

    ``flat[send_bounds[p]]`` goes to rank p; what rank p sends lands in ``out[recv_bounds[p]]``.
    """
    # BEGIN SOLUTION 1.4 "Copy your own piece; step s=1..n-1 sends to rank (r+s)%n and receives from (r-s)%n in one exchange."
    n, r = c.size, c.rank
    (sa, sb), (ra, rb) = send_bounds[r], recv_bounds[r]
    out[ra:rb] = flat[sa:sb]  # my piece for myself never leaves
    for s in range(1, n):
        dst, src = (r + s) % n, (r - s) % n
        (sa, sb), (ra, rb) = send_bounds[dst], recv_bounds[src]
        yield c.exchange(
            f"pairwise step {s}/{n - 1} (to rank {dst}, from rank {src})",
            sends=[(flat[sa:sb], dst)],
            recvs=[(out[ra:rb], src)],
        )
    # END SOLUTION


def _exchange_counts(c: _Call, send_counts: list[int]):
    """Pairwise-exchange how many rows each rank sends to each other; returns the counts I get."""
    mine = numpy.array(send_counts, dtype=numpy.int64)
    got = numpy.zeros(c.size, dtype=numpy.int64)
    yield from _all_to_all_algorithm()(c, mine, _bounds([1] * c.size), got, _bounds([1] * c.size))
    return [int(x) for x in got]


# Dissemination barrier: in round k rank r signals rank r+2^k and waits for rank r-2^k. After
# ceil(log2 n) rounds every rank has (transitively) heard from every other.


def _barrier_dissemination(c: _Call):
    n, r = c.size, c.rank
    token = numpy.zeros(0, dtype=numpy.uint8)
    dist, k = 1, 0
    while dist < n:
        k += 1
        yield c.exchange(
            f"dissemination round {k} (signal rank {(r + dist) % n}, wait for rank {(r - dist) % n})",
            sends=[(token, (r + dist) % n)],
            recvs=[(numpy.zeros(0, dtype=numpy.uint8), (r - dist) % n)],
        )
        dist *= 2


# =================================================================================================
# Stand-ins, for a student release
# =================================================================================================
#
# `python -m grader release` gives students a copy of tinytrain in which the solution regions
# above (assignment 1) are cut out: each raises a NotImplementedError with a TODO. The rest of
# the framework still needs its collectives (data parallel all-reduces, MoE all-to-alls), and a
# student may do a later assignment first. So where an algorithm is cut out, the public functions
# below use a simpler algorithm of this file instead: correct, just not bandwidth-optimal. In the
# full repository nothing is cut out and the stand-ins never run.
#
# Only this module falls back. The assignment file is a copy of it (assignments/a1_collectives.py)
# and must raise its TODOs, so that the grader reports them instead of grading a stand-in.

_FRAMEWORK_COPY = __name__ == "tinytrain.distributed.collectives"


def _cut_out(*fns) -> bool:
    """True when a student release replaced one of ``fns`` by a TODO stub (never in an assignment)."""
    def stub(fn):
        return any(isinstance(k, str) and k.startswith("TODO ") for k in fn.__code__.co_consts)

    return _FRAMEWORK_COPY and any(stub(fn) for fn in fns)


def _reduce_scatter_standin(c: _Call, flat, bounds, op: str):
    """Reduce onto rank 0 (binomial tree), then scatter: rank r's chunk r ends up reduced."""
    yield from _reduce_tree(c, flat, 0, op)
    a, b = bounds[c.rank]
    yield from _scatter_linear(c, flat[a:b], flat if c.rank == 0 else None, 0, bounds)


def _all_gather_standin(c: _Call, flat, bounds):
    """Gather every piece on rank 0, then send the whole buffer to everyone."""
    a, b = bounds[c.rank]
    yield from _gather_linear(c, flat[a:b], flat if c.rank == 0 else None, 0, bounds)
    yield from _broadcast_naive(c, flat, 0)


def _all_to_all_standin(c: _Call, flat, send_bounds, out, recv_bounds):
    """Every message of the all-to-all posted in one step (same volume as pairwise, more at once)."""
    n, r = c.size, c.rank
    (sa, sb), (ra, rb) = send_bounds[r], recv_bounds[r]
    out[ra:rb] = flat[sa:sb]
    others = [p for p in range(n) if p != r]
    yield c.exchange(
        "all-to-all stand-in: all messages at once",
        sends=[(flat[send_bounds[p][0] : send_bounds[p][1]], p) for p in others],
        recvs=[(out[recv_bounds[p][0] : recv_bounds[p][1]], p) for p in others],
    )


def _all_to_all_algorithm():
    return _all_to_all_standin if _cut_out(_all_to_all_pairwise) else _all_to_all_pairwise


# =================================================================================================
# Public API
# =================================================================================================


def _check_op(op: str, dtype) -> str:
    if op not in OPS:
        raise ValueError(f"op={op!r} is not one of {', '.join(OPS)}")
    if op == "avg" and not numpy.issubdtype(numpy.dtype(dtype), numpy.floating):
        raise ValueError(f"op='avg' needs a floating dtype, got {dtype}; use op='sum' and divide yourself")
    return op


def _check_algo(op: str, algo, choices: tuple[str, ...], default: str) -> str:
    if algo is None:
        return default
    if algo not in choices:
        raise ValueError(f"{op}: algo={algo!r} is not one of {', '.join(choices)}")
    return algo


def _check_root(g, root: int, role: str) -> int:
    if not 0 <= int(root) < g.size:
        raise ValueError(f"{role}={root} is not a rank of {g.describe()} (valid: 0..{g.size - 1})")
    return int(root)


def _rows(x) -> tuple[int, tuple]:
    """(length of axis 0, shape of one row); a 0-d array counts as one row."""
    shape = tuple(x.shape) or (1,)
    return shape[0], shape[1:]


def _sig(x, **extra) -> dict:
    return dict(shape=list(x.shape), dtype=str(x.dtype), **extra)


def _check_sizes(g, sizes, what: str) -> list[int]:
    sizes = [int(s) for s in sizes]
    if len(sizes) != g.size or min(sizes, default=0) < 0:
        raise ValueError(f"{what}: sizes needs one non-negative row count per rank of {g.describe()}, got {sizes}")
    return sizes


def _check_out(out, shape, dtype, what: str):
    if out is None:
        return None
    check_buffer(out, f"{what} (out)", writable=True)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise ValueError(f"{what}: out must have shape {tuple(shape)} and dtype {dtype}, got {tuple(out.shape)} {out.dtype}")
    return out


ALL_REDUCE_ALGOS = ("ring", "recursive_doubling", "halving_doubling", "naive")


def all_reduce(tensor, op: str = "sum", group=None, async_op: bool = False, algo: str | None = None):
    """Reduce ``tensor`` across the group, **in place**; every rank ends with the result.

    algo: ``"ring"``, ``"recursive_doubling"``, ``"halving_doubling"`` (default: chosen by size,
    see :func:`choose_all_reduce_algo`), ``"naive"`` (gather to rank 0 + send back: the
    parameter-server shape).
    """
    __tracebackhide__ = True  # in pytest, errors point at the caller's line
    g = resolve(group)
    check_buffer(tensor, "all_reduce", writable=True)
    _check_op(op, tensor.dtype)
    algo = _check_algo("all_reduce", algo, ALL_REDUCE_ALGOS, choose_all_reduce_algo(tensor.nbytes))
    if algo == "ring" and _cut_out(_all_reduce_ring, _ring_reduce_scatter, _ring_all_gather):
        algo = "halving_doubling"  # student release: the ring is an assignment (see "Stand-ins")
    flat = tensor.reshape(-1)
    body = {"ring": _all_reduce_ring, "recursive_doubling": _all_reduce_recursive_doubling,
            "halving_doubling": _all_reduce_halving_doubling, "naive": _all_reduce_naive}[algo]

    def run():
        yield from body(c, flat, op)
        if op == "avg":
            flat[...] /= g.size
        return tensor

    c = _Call(g, "all_reduce", algo)
    return _run(c, run(), async_op, _sig(tensor, same_shape=True, reduce=op, algo=algo))


def broadcast(tensor, src: int = 0, group=None, async_op: bool = False, algo: str | None = None):
    """Copy ``tensor`` from rank ``src`` to every rank, **in place**. algo: ``"tree"``, ``"naive"``."""
    __tracebackhide__ = True  # in pytest, errors point at the caller's line
    g = resolve(group)
    check_buffer(tensor, "broadcast", writable=True)
    root = _check_root(g, src, "src")
    algo = _check_algo("broadcast", algo, ("tree", "naive"), "tree")
    flat = tensor.reshape(-1)
    if algo == "tree" and _cut_out(_broadcast_tree):
        algo = "naive"  # student release: the tree is an assignment (see "Stand-ins")
    body = _broadcast_tree if algo == "tree" else _broadcast_naive

    def run():
        yield from body(c, flat, root)
        return tensor

    c = _Call(g, "broadcast", algo)
    return _run(c, run(), async_op, _sig(tensor, same_shape=True, root=root, algo=algo))


def reduce(tensor, dst: int = 0, op: str = "sum", group=None, async_op: bool = False, algo: str | None = None):
    """Reduce ``tensor`` onto rank ``dst``, in place there; other ranks' buffers are unchanged.

    algo: ``"tree"`` (binomial), ``"naive"`` (everyone sends to ``dst``).
    """
    __tracebackhide__ = True  # in pytest, errors point at the caller's line
    g = resolve(group)
    check_buffer(tensor, "reduce", writable=True)
    _check_op(op, tensor.dtype)
    root = _check_root(g, dst, "dst")
    algo = _check_algo("reduce", algo, ("tree", "naive"), "tree")
    flat = tensor.reshape(-1)
    body = _reduce_tree if algo == "tree" else _reduce_naive

    def run():
        yield from body(c, flat, root, op)
        if op == "avg" and g.rank == root:
            flat[...] /= g.size
        return tensor

    c = _Call(g, "reduce", algo)
    return _run(c, run(), async_op, _sig(tensor, same_shape=True, root=root, reduce=op, algo=algo))


def all_gather(tensor, group=None, async_op: bool = False, algo: str | None = None, sizes=None, out=None):
    """Concatenate every rank's ``tensor`` along axis 0, in rank order; returns a new array.

    Pieces may differ in length along axis 0 if ``sizes`` (rows per rank, same list on every rank)
    is given; the other dimensions must match. Ring algorithm: rank r sends every piece but
    piece (r+1) % n, so with equal pieces it sends (n-1)/n of the gathered buffer.
    """
    __tracebackhide__ = True  # in pytest, errors point at the caller's line
    g = resolve(group)
    check_buffer(tensor, "all_gather")
    _check_algo("all_gather", algo, ("ring",), "ring")
    rows, tail = _rows(tensor)
    signature = _sig(tensor, same_shape=sizes is None, algo="ring", tail=list(tail),
                     sizes=None if sizes is None else [int(x) for x in sizes])
    sizes = [rows] * g.size if sizes is None else _check_sizes(g, sizes, "all_gather")
    if sizes[g.rank] != rows:
        raise ValueError(f"all_gather: sizes[{g.rank}]={sizes[g.rank]} but this rank's tensor has {rows} rows")
    row_len = int(numpy.prod(tail, dtype=numpy.int64))
    shape = (sum(sizes),) + tail
    out = _check_out(out, shape, tensor.dtype, "all_gather")
    if out is None:
        out = _xp_of(tensor).empty(shape, dtype=tensor.dtype)
    bounds = _bounds([s * row_len for s in sizes])

    def run():
        flat = out.reshape(-1)
        a, b = bounds[g.rank]
        flat[a:b] = tensor.reshape(-1)
        if _cut_out(_ring_all_gather):  # student release (see "Stand-ins")
            yield from _all_gather_standin(c, flat, bounds)
        else:
            yield from _ring_all_gather(c, flat, bounds, shift=-1)
        return out

    c = _Call(g, "all_gather", "ring")
    return _run(c, run(), async_op, signature)


def reduce_scatter(tensor, op: str = "sum", group=None, async_op: bool = False, algo: str | None = None,
                   sizes=None, out=None):
    """Reduce ``tensor`` across ranks and give rank r the r-th piece (along axis 0) of the result.

    ``tensor`` is the full buffer on every rank and is left unchanged. Pieces are equal unless
    ``sizes`` (rows per rank) is given. Ring algorithm: rank r sends every chunk but its own,
    (n-1)/n of the buffer when pieces are equal.
    """
    __tracebackhide__ = True  # in pytest, errors point at the caller's line
    g = resolve(group)
    check_buffer(tensor, "reduce_scatter")
    _check_op(op, tensor.dtype)
    _check_algo("reduce_scatter", algo, ("ring",), "ring")
    rows, tail = _rows(tensor)
    if sizes is None:
        if rows % g.size:
            raise ValueError(
                f"reduce_scatter: {rows} rows do not split evenly over {g.size} ranks; "
                "pass sizes=[rows for each rank] (e.g. split_counts(rows, n))"
            )
        sizes = [rows // g.size] * g.size
    else:
        sizes = _check_sizes(g, sizes, "reduce_scatter")
        if sum(sizes) != rows:
            raise ValueError(f"reduce_scatter: sizes {sizes} add up to {sum(sizes)}, but the tensor has {rows} rows")
    row_len = int(numpy.prod(tail, dtype=numpy.int64))
    bounds = _bounds([s * row_len for s in sizes])
    shape = (sizes[g.rank],) + tail
    out = _check_out(out, shape, tensor.dtype, "reduce_scatter")
    if out is None:
        out = _xp_of(tensor).empty(shape, dtype=tensor.dtype)

    def run():
        work = tensor.reshape(-1).copy()  # the ring reduces in place; keep the caller's input intact
        if _cut_out(_ring_reduce_scatter):  # student release (see "Stand-ins")
            yield from _reduce_scatter_standin(c, work, bounds, op)
        else:
            yield from _ring_reduce_scatter(c, work, bounds, op, shift=-1)
        a, b = bounds[g.rank]
        flat = out.reshape(-1)
        flat[...] = work[a:b]
        if op == "avg":
            flat[...] /= g.size
        return out

    c = _Call(g, "reduce_scatter", "ring")
    return _run(c, run(), async_op, _sig(tensor, same_shape=True, reduce=op, sizes=sizes, algo="ring"))


def all_to_all(tensor, send_sizes=None, recv_sizes=None, group=None, async_op: bool = False,
               algo: str | None = None, out=None):
    """Rank r sends rows ``send_sizes[p]`` of ``tensor`` (in order, along axis 0) to each rank p and
    returns the rows it receives, concatenated in rank order.

    Equal split (default): ``tensor`` has n equal pieces. Uneven (MoE dispatch): pass
    ``send_sizes``; ``recv_sizes`` is exchanged automatically when not given (one extra pairwise
    round of n integers). Pairwise-exchange algorithm: n-1 steps, one partner each.
    """
    __tracebackhide__ = True  # in pytest, errors point at the caller's line
    g = resolve(group)
    check_buffer(tensor, "all_to_all")
    _check_algo("all_to_all", algo, ("pairwise",), "pairwise")
    rows, tail = _rows(tensor)
    n = g.size
    if send_sizes is None:
        if rows % n:
            raise ValueError(f"all_to_all: {rows} rows do not split evenly over {n} ranks; pass send_sizes")
        send_sizes = [rows // n] * n
        recv_sizes = send_sizes if recv_sizes is None else recv_sizes
    send_sizes = _check_sizes(g, send_sizes, "all_to_all (send_sizes)")
    if sum(send_sizes) != rows:
        raise ValueError(f"all_to_all: send_sizes {send_sizes} add up to {sum(send_sizes)}, but the tensor has {rows} rows")
    if recv_sizes is not None:
        recv_sizes = _check_sizes(g, recv_sizes, "all_to_all (recv_sizes)")
    row_len = int(numpy.prod(tail, dtype=numpy.int64))

    def run():
        nonlocal out
        got = recv_sizes
        if got is None:
            got = yield from _exchange_counts(c, send_sizes)
        shape = (sum(got),) + tail
        out = _check_out(out, shape, tensor.dtype, "all_to_all")
        if out is None:
            out = _xp_of(tensor).empty(shape, dtype=tensor.dtype)
        send_bounds = _bounds([s * row_len for s in send_sizes])
        recv_bounds = _bounds([s * row_len for s in got])
        yield from _all_to_all_algorithm()(c, tensor.reshape(-1), send_bounds, out.reshape(-1), recv_bounds)
        return out

    c = _Call(g, "all_to_all", "pairwise")
    return _run(c, run(), async_op, _sig(tensor, same_shape=False, tail=list(tail), algo="pairwise"))


def gather(tensor, dst: int = 0, group=None, async_op: bool = False, algo: str | None = None, out=None):
    """Concatenate every rank's ``tensor`` (equal shapes) along axis 0 on rank ``dst``.

    Returns the new array on ``dst`` and None elsewhere. Linear: each rank sends once to ``dst``.
    """
    __tracebackhide__ = True  # in pytest, errors point at the caller's line
    g = resolve(group)
    check_buffer(tensor, "gather")
    root = _check_root(g, dst, "dst")
    _check_algo("gather", algo, ("linear",), "linear")
    rows, tail = _rows(tensor)
    shape = (rows * g.size,) + tail
    if g.rank == root:
        out = _check_out(out, shape, tensor.dtype, "gather")
        if out is None:
            out = _xp_of(tensor).empty(shape, dtype=tensor.dtype)
    bounds = _bounds([tensor.size] * g.size)

    def run():
        yield from _gather_linear(c, tensor.reshape(-1), out.reshape(-1) if g.rank == root else None, root, bounds)
        return out if g.rank == root else None

    c = _Call(g, "gather", "linear")
    return _run(c, run(), async_op, _sig(tensor, same_shape=True, root=root, algo="linear"))


def scatter(tensor, full=None, src: int = 0, group=None, async_op: bool = False, algo: str | None = None):
    """Fill ``tensor`` (in place, every rank) with piece r of ``full`` from rank ``src``.

    ``full`` is needed on ``src`` only: ``n`` pieces of ``tensor``'s shape stacked along axis 0.
    """
    __tracebackhide__ = True  # in pytest, errors point at the caller's line
    g = resolve(group)
    check_buffer(tensor, "scatter", writable=True)
    root = _check_root(g, src, "src")
    _check_algo("scatter", algo, ("linear",), "linear")
    rows, tail = _rows(tensor)
    if g.rank == root:
        if full is None:
            raise ValueError(f"scatter: rank {root} is the source and must pass full=")
        check_buffer(full, "scatter (full)")
        want = (rows * g.size,) + tail
        if tuple(full.shape) != want or full.dtype != tensor.dtype:
            raise ValueError(f"scatter: full must have shape {want} and dtype {tensor.dtype} "
                             f"(n pieces of tensor's shape), got {tuple(full.shape)} {full.dtype}")
    bounds = _bounds([tensor.size] * g.size)

    def run():
        yield from _scatter_linear(c, tensor.reshape(-1), full.reshape(-1) if g.rank == root else None, root, bounds)
        return tensor

    c = _Call(g, "scatter", "linear")
    return _run(c, run(), async_op, _sig(tensor, same_shape=True, root=root, algo="linear"))


def barrier(group=None, async_op: bool = False):
    """Return once every rank of the group has entered (dissemination algorithm, zero-byte messages)."""
    __tracebackhide__ = True  # in pytest, errors point at the caller's line
    g = resolve(group)
    c = _Call(g, "barrier", "dissemination")
    return _run(c, _barrier_dissemination(c), async_op, dict(shape=[], dtype="none", same_shape=True))
