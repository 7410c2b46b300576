"""The public collectives: each checks its arguments (``checks.py``), picks an algorithm
(``choice.py``) and drives one call to its end (``work.py``).

Conventions (like ``torch.distributed`` where it has an equivalent):

* ``all_reduce(x)``, ``broadcast(x)``, ``reduce(x)`` and ``scatter(x, full)`` work **in place** on
  ``x`` and return it. ``all_gather``, ``reduce_scatter``, ``all_to_all`` and ``gather`` **return a
  new array** (or fill ``out=`` if given). Pieces are always split/joined along axis 0.
* Ranks (``src``, ``dst``) are ranks of ``group`` (default: the world).
* ``op`` is one of ``"sum"``, ``"avg"`` (floating dtypes only), ``"max"``, ``"min"``, ``"prod"``.
* ``async_op=True`` returns a :class:`~work.Work` handle: ``h.wait()`` returns what the call would
  have returned (polling: see ``work.py``).
* ``algo=`` forces an algorithm; by default one is chosen by message size.

The functions are the methods of one :class:`Collectives` made over a module of algorithms: the
framework's ``algorithms.py``, whose ``all_reduce = Collectives(__name__).all_reduce`` (and so on)
``tinytrain.distributed`` exports, or an assignment copy of that file, which binds the same methods
over the student's algorithms. So graded tests and benchmarks run a student's algorithms behind
exactly the framework's checks, tags, byte accounting, tracing and deadlines. The algorithms are
looked up in that module at every call (a test may replace one; see ``choice.py``).
"""

from __future__ import annotations

import numpy

from . import doubling, hierarchical, rooted, topology, work
from .checks import (
    all_to_all_sizes,
    check_algo,
    check_op,
    check_out,
    check_root,
    check_scatter_full,
    gather_sizes,
    new_out,
    rows_of,
    signature,
    split_sizes,
)
from .choice import ALL_REDUCE_ALGOS, AlgorithmSource, choose_all_reduce_algo
from .chunks import OPS, chunk_bounds, row_bounds, split_counts
from .group import on_uninstall, resolve
from .p2p import check_buffer
from .work import Call, run, signature_bits

__all__ = ["ALL_REDUCE_ALGOS", "OPS", "Collectives", "choose_all_reduce_algo", "split_counts"]

# --- what a call works out from its arguments, once per distinct arguments ------------------------
#
# Checking the arguments and working out row counts, chunk bounds and the tag's signature cost more
# than a small collective's own messages (an all_to_all of 1 KiB spent 21 us there on one rank, its
# two messages 5 us). A training step calls the same collectives with the same shapes every time,
# so a call keeps what its arguments gave, under a key made of everything the checks read (group,
# shape, dtype, op, sizes, ...): the same key passes the same checks and gives the same plan. Only
# what depends on the buffers themselves (contiguous, writable, the out= array) is checked at every
# call. A call whose checks raise keeps nothing.
_plans: dict = {}
_PLANS_MAX = 512  # distinct argument sets kept (then forgotten all at once: a program's set is small)


def _planned(key, make):
    """The plan of a call with arguments ``key``: made by ``make()`` the first time."""
    key += (work._SIG_BITS,)  # the signature bits a plan holds depend on it (a bench switches it off)
    try:
        plan = _plans.get(key)
    except TypeError:  # an argument that cannot be a key (sizes given as lists of lists): its checks say why
        return make()
    if plan is None:
        plan = make()
        if len(_plans) >= _PLANS_MAX:
            _plans.clear()
        _plans[key] = plan
    return plan


on_uninstall(_plans.clear)  # the groups in the keys are gone

# --- the public functions, over one module of algorithms --------------------------------------------


class Collectives(AlgorithmSource):
    """The public collectives, running the algorithms of module ``algorithms`` (a name in sys.modules;
    :class:`~choice.AlgorithmSource` looks them up, or their stand-ins in a student release)."""

    def all_reduce(self, tensor, op: str = "sum", group=None, async_op: bool = False, algo: str | None = None):
        """Reduce ``tensor`` across the group, **in place**; every rank ends with the result.

        algo: ``"ring"``, ``"recursive_doubling"``, ``"halving_doubling"`` (default: chosen by size,
        see :func:`choose_all_reduce_algo`), ``"naive"`` (gather to rank 0 + send back: the
        parameter-server shape), ``"hierarchical"`` (inside the nodes, then across: the default
        when an emulated topology puts the group on several nodes, see ``hierarchical.py``).
        """
        __tracebackhide__ = True  # in pytest, errors point at the caller's line
        g = resolve(group)
        check_buffer(tensor, "all_reduce", writable=True)

        links = topology.active  # part of the plan's key: the choice depends on it

        def plan():
            check_op(op, tensor.dtype)
            nodes = None if links is None else links.nodes_of(g.world_ranks)
            chosen = check_algo("all_reduce", algo, ALL_REDUCE_ALGOS, choose_all_reduce_algo(tensor.nbytes, nodes))
            return chosen, signature_bits("all_reduce", tensor, op)

        algo, sig_bits = _planned(("all_reduce", g, tensor.size, tensor.dtype, op, algo, links), plan)
        if algo in ("ring", "hierarchical") and self._cut_out(
            "_all_reduce_ring", "_ring_reduce_scatter", "_ring_all_gather"
        ):
            algo = "halving_doubling"  # student release: the ring is an assignment (see rooted.py)
        flat = tensor.reshape(-1)
        if algo == "recursive_doubling":
            body = doubling.all_reduce_recursive_doubling
        elif algo == "halving_doubling":
            body = doubling.all_reduce_halving_doubling
        elif algo == "hierarchical":
            body = self._all_reduce_hierarchical(g, links)
        else:
            body = self._alg("_all_reduce_ring") if algo == "ring" else rooted.all_reduce_naive

        def steps():
            yield from body(c, flat, op)
            if op == "avg":
                flat[...] /= g.size
            return tensor

        c = Call(g, "all_reduce", algo, sig_bits)
        return run(c, steps(), async_op, lambda: signature(tensor, same_shape=True, reduce=op, algo=algo))

    def _all_reduce_hierarchical(self, g, links):
        """The hierarchical all-reduce over ``g``'s nodes (one node without a topology), on this
        module's ring algorithms, the inter-node phase by the piece's size (``hierarchical.py``)."""
        nodes = [list(range(g.size))] if links is None else links.nodes_of(g.world_ranks)
        reduce_scatter, all_gather = self._alg("_ring_reduce_scatter"), self._alg("_ring_all_gather")

        def across(view, piece, op):
            algo = choose_all_reduce_algo(piece.nbytes)
            if algo == "ring":
                return self._alg("_all_reduce_ring")(view, piece, op)
            if algo == "halving_doubling":
                return doubling.all_reduce_halving_doubling(view, piece, op)
            return doubling.all_reduce_recursive_doubling(view, piece, op)

        def body(c, flat, op):
            return hierarchical.all_reduce_hierarchical(c, flat, op, nodes, reduce_scatter, all_gather, across)

        return body

    def broadcast(self, tensor, src: int = 0, group=None, async_op: bool = False, algo: str | None = None):
        """Copy ``tensor`` from rank ``src`` to every rank, **in place**. algo: ``"tree"``, ``"naive"``."""
        __tracebackhide__ = True  # in pytest, errors point at the caller's line
        g = resolve(group)
        check_buffer(tensor, "broadcast", writable=True)

        def plan():
            root = check_root(g, src, "src")
            chosen = check_algo("broadcast", algo, ("tree", "naive"), "tree")
            return root, chosen, signature_bits("broadcast", tensor, root=root)

        root, algo, sig_bits = _planned(("broadcast", g, tensor.size, tensor.dtype, src, algo), plan)
        flat = tensor.reshape(-1)
        if algo == "tree" and self._cut_out("_broadcast_tree"):
            algo = "naive"  # student release: the tree is an assignment (see rooted.py)
        body = self._alg("_broadcast_tree") if algo == "tree" else rooted.broadcast_naive

        def steps():
            yield from body(c, flat, root)
            return tensor

        c = Call(g, "broadcast", algo, sig_bits)
        return run(c, steps(), async_op, lambda: signature(tensor, same_shape=True, root=root, algo=algo))

    def reduce(
        self, tensor, dst: int = 0, op: str = "sum", group=None, async_op: bool = False, algo: str | None = None
    ):
        """Reduce ``tensor`` onto rank ``dst``, in place there; other ranks' buffers are unchanged.

        algo: ``"tree"`` (a binary tree, see rooted.py), ``"naive"`` (everyone sends to ``dst``).
        """
        __tracebackhide__ = True  # in pytest, errors point at the caller's line
        g = resolve(group)
        check_buffer(tensor, "reduce", writable=True)
        check_op(op, tensor.dtype)
        root = check_root(g, dst, "dst")
        algo = check_algo("reduce", algo, ("tree", "naive"), "tree")
        flat = tensor.reshape(-1)
        body = rooted.reduce_tree if algo == "tree" else rooted.reduce_naive

        def steps():
            yield from body(c, flat, root, op)
            if op == "avg" and g.rank == root:
                flat[...] /= g.size
            return tensor

        c = Call(g, "reduce", algo, signature_bits("reduce", tensor, op, root))
        return run(c, steps(), async_op, lambda: signature(tensor, same_shape=True, root=root, reduce=op, algo=algo))

    def bytes_sent(self, op: str, sizes, itemsize: int, group=None) -> int:
        """Bytes this rank sends in one ``all_gather`` or ``reduce_scatter`` whose pieces hold
        ``sizes[p]`` elements (rank p's piece), by the algorithm that will run.

        The ring: rank r sends every piece but piece r+1 gathering, every piece but its own reducing.
        A student copy whose ring is still a TODO runs the direct stand-ins (see rooted.py): the same
        for reduce-scatter; gathering, rank r sends its own piece to each of the n-1 others. Volume
        checks compare a measured count with this, so they hold under either.
        """
        g = resolve(group)
        n, r, sizes = g.size, g.rank, [int(x) for x in sizes]
        if len(sizes) != n:
            raise ValueError(f"bytes_sent: {len(sizes)} sizes for a group of {n} ranks; give one per rank")
        if n == 1:
            return 0
        if op == "reduce_scatter":
            return itemsize * (sum(sizes) - sizes[r])
        if op != "all_gather":
            raise ValueError(f"bytes_sent: op must be 'all_gather' or 'reduce_scatter', got {op!r}")
        if self._cut_out("_ring_all_gather"):
            return itemsize * (n - 1) * sizes[r]
        return itemsize * (sum(sizes) - sizes[(r + 1) % n])

    def all_gather(self, tensor, group=None, async_op: bool = False, algo: str | None = None, sizes=None, out=None):
        """Concatenate every rank's ``tensor`` along axis 0, in rank order; returns a new array.

        Pieces may differ in length along axis 0 if ``sizes`` (rows per rank, same list on every rank)
        is given; the other dimensions must match. Ring algorithm: rank r sends every piece but
        piece (r+1) % n, so with equal pieces it sends (n-1)/n of the gathered buffer.
        """
        __tracebackhide__ = True  # in pytest, errors point at the caller's line
        g = resolve(group)
        check_buffer(tensor, "all_gather")
        asked = sizes

        def plan():
            check_algo("all_gather", algo, ("ring",), "ring")
            rows, tail = rows_of(tensor)
            sizes = gather_sizes(g, asked, rows, "all_gather")
            shape = (sum(sizes),) + tail
            return shape, row_bounds(sizes, tail), signature_bits("all_gather", tensor, count=asked is None)

        given = None if asked is None else tuple(asked)
        shape, bounds, sig_bits = _planned(("all_gather", g, tensor.shape, tensor.dtype, given, algo), plan)

        def sig():
            sizes = None if asked is None else [int(x) for x in asked]
            tail = list(rows_of(tensor)[1])
            return signature(tensor, same_shape=asked is None, algo="ring", tail=tail, sizes=sizes)

        out = new_out(check_out(out, shape, tensor.dtype, "all_gather"), tensor, shape)

        def steps():
            flat = out.reshape(-1)
            a, b = bounds[g.rank]
            flat[a:b] = tensor.reshape(-1)
            if self._cut_out("_ring_all_gather"):  # student release (see rooted.py)
                yield from rooted.all_gather_standin(c, flat, bounds)
            else:
                yield from self._alg("_ring_all_gather")(c, flat, bounds, shift=-1)
            return out

        c = Call(g, "all_gather", "ring", sig_bits)
        return run(c, steps(), async_op, sig)

    def reduce_scatter(
        self, tensor, op: str = "sum", group=None, async_op: bool = False, algo: str | None = None, sizes=None, out=None
    ):
        """Reduce ``tensor`` across ranks and give rank r the r-th piece (along axis 0) of the result.

        ``tensor`` is the full buffer on every rank and is left unchanged. Pieces are equal unless
        ``sizes`` (rows per rank) is given. Ring algorithm: rank r sends every chunk but its own,
        (n-1)/n of the buffer when pieces are equal.
        """
        __tracebackhide__ = True  # in pytest, errors point at the caller's line
        g = resolve(group)
        check_buffer(tensor, "reduce_scatter")
        asked = sizes

        def plan():
            check_op(op, tensor.dtype)
            check_algo("reduce_scatter", algo, ("ring",), "ring")
            rows, tail = rows_of(tensor)
            sizes = split_sizes(g, asked, rows, "reduce_scatter")
            sig_bits = signature_bits("reduce_scatter", tensor, op)
            return sizes, row_bounds(sizes, tail), (sizes[g.rank],) + tail, sig_bits

        given = None if asked is None else tuple(asked)
        key = ("reduce_scatter", g, tensor.shape, tensor.dtype, op, given, algo)
        sizes, bounds, shape, sig_bits = _planned(key, plan)
        out = new_out(check_out(out, shape, tensor.dtype, "reduce_scatter"), tensor, shape)

        def steps():
            flat = out.reshape(-1)
            if g.size == 1:  # nothing to reduce: the one piece is the whole buffer
                flat[...] = tensor.reshape(-1)
            elif self._cut_out("_ring_reduce_scatter"):  # student release (see rooted.py)
                yield from rooted.reduce_scatter_standin(c, tensor.reshape(-1), bounds, op, flat)
            else:  # the ring only reads the caller's buffer and writes this rank's piece into out
                yield from self._alg("_ring_reduce_scatter")(c, tensor.reshape(-1), bounds, op, shift=-1, out=flat)
            if op == "avg":
                flat[...] /= g.size
            return out

        c = Call(g, "reduce_scatter", "ring", sig_bits)
        return run(
            c, steps(), async_op, lambda: signature(tensor, same_shape=True, reduce=op, sizes=sizes, algo="ring")
        )

    def all_to_all(
        self,
        tensor,
        send_sizes=None,
        recv_sizes=None,
        group=None,
        async_op: bool = False,
        algo: str | None = None,
        out=None,
    ):
        """Rank r sends rows ``send_sizes[p]`` of ``tensor`` (in order, along axis 0) to each rank p and
        returns the rows it receives, concatenated in rank order.

        Equal split (default): ``tensor`` has n equal pieces. Uneven (MoE dispatch): pass
        ``send_sizes``; ``recv_sizes`` is exchanged automatically when not given (one extra pairwise
        round of n integers). Pairwise-exchange algorithm: n-1 steps, one partner each.
        """
        __tracebackhide__ = True  # in pytest, errors point at the caller's line
        g = resolve(group)
        check_buffer(tensor, "all_to_all")
        n = g.size
        asked_send, asked_recv = send_sizes, recv_sizes

        def plan():
            check_algo("all_to_all", algo, ("pairwise",), "pairwise")
            rows, tail = rows_of(tensor)
            send, recv = all_to_all_sizes(g, rows, asked_send, asked_recv)
            recv_bounds = None if recv is None else row_bounds(recv, tail)
            sig_bits = signature_bits("all_to_all", tensor, count=False)
            return send, recv, tail, row_bounds(send, tail), recv_bounds, sig_bits

        key = ("all_to_all", g, tensor.shape, tensor.dtype, algo)
        key += (None if send_sizes is None else tuple(send_sizes), None if recv_sizes is None else tuple(recv_sizes))
        send_sizes, recv_sizes, tail, send_bounds, recv_bounds, sig_bits = _planned(key, plan)

        def steps():
            nonlocal out, recv_bounds
            got = recv_sizes
            if got is None:  # pairwise-exchange the row counts first: n integers
                mine, theirs = numpy.array(send_sizes, dtype=numpy.int64), numpy.zeros(n, dtype=numpy.int64)
                ones = chunk_bounds([1] * n)
                yield from self._all_to_all()(c, mine, ones, theirs, ones)
                got = [int(x) for x in theirs]
                recv_bounds = row_bounds(got, tail)
            shape = (sum(got),) + tail
            out = new_out(check_out(out, shape, tensor.dtype, "all_to_all"), tensor, shape)
            yield from self._all_to_all()(c, tensor.reshape(-1), send_bounds, out.reshape(-1), recv_bounds)
            return out

        c = Call(g, "all_to_all", "pairwise", sig_bits)
        return run(c, steps(), async_op, lambda: signature(tensor, same_shape=False, tail=list(tail), algo="pairwise"))

    def gather(self, tensor, dst: int = 0, group=None, async_op: bool = False, algo: str | None = None, out=None):
        """Concatenate every rank's ``tensor`` (equal shapes) along axis 0 on rank ``dst``.

        Returns the new array on ``dst`` and None elsewhere. Linear: each rank sends once to ``dst``.
        """
        __tracebackhide__ = True  # in pytest, errors point at the caller's line
        g = resolve(group)
        check_buffer(tensor, "gather")
        root = check_root(g, dst, "dst")
        check_algo("gather", algo, ("linear",), "linear")
        rows, tail = rows_of(tensor)
        shape = (rows * g.size,) + tail
        if g.rank == root:
            out = new_out(check_out(out, shape, tensor.dtype, "gather"), tensor, shape)
        bounds = chunk_bounds([tensor.size] * g.size)

        def steps():
            whole = out.reshape(-1) if g.rank == root else None
            yield from rooted.gather_linear(c, tensor.reshape(-1), whole, root, bounds)
            return out if g.rank == root else None

        c = Call(g, "gather", "linear", signature_bits("gather", tensor, root=root))
        return run(c, steps(), async_op, lambda: signature(tensor, same_shape=True, root=root, algo="linear"))

    def scatter(self, tensor, full=None, src: int = 0, group=None, async_op: bool = False, algo: str | None = None):
        """Fill ``tensor`` (in place, every rank) with piece r of ``full`` from rank ``src``.

        ``full`` is needed on ``src`` only: ``n`` pieces of ``tensor``'s shape stacked along axis 0.
        """
        __tracebackhide__ = True  # in pytest, errors point at the caller's line
        g = resolve(group)
        check_buffer(tensor, "scatter", writable=True)
        root = check_root(g, src, "src")
        check_algo("scatter", algo, ("linear",), "linear")
        check_scatter_full(g, root, full, tensor)
        bounds = chunk_bounds([tensor.size] * g.size)

        def steps():
            whole = full.reshape(-1) if g.rank == root else None
            yield from rooted.scatter_linear(c, tensor.reshape(-1), whole, root, bounds)
            return tensor

        c = Call(g, "scatter", "linear", signature_bits("scatter", tensor, root=root))
        return run(c, steps(), async_op, lambda: signature(tensor, same_shape=True, root=root, algo="linear"))

    def barrier(self, group=None, async_op: bool = False):
        """Return once every rank of the group has entered (dissemination algorithm, zero-byte messages)."""
        __tracebackhide__ = True  # in pytest, errors point at the caller's line
        g = resolve(group)
        c = Call(g, "barrier", "dissemination", signature_bits("barrier"))
        sig = {"shape": [], "dtype": "none", "same_shape": True}
        return run(c, doubling.barrier_dissemination(c), async_op, lambda: sig)
