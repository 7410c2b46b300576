"""Algorithms around one root rank: the naive (parameter-server) shapes, binary-tree reduce,
linear gather and scatter, and the stand-ins a student release falls back to.

The naive shapes are here to be measured against (``algo="naive"``): one rank's link carries
everything while the others idle, the bottleneck the ring and the trees remove.
"""

from __future__ import annotations

from .chunks import combine, xp_of
from .work import Call

# =================================================================================================
# Naive all-reduce, broadcast and reduce: the parameter-server shape
# =================================================================================================
#
#        rank 0  <- every other rank sends its whole buffer (n-1 buffers arrive at one rank)
#        rank 0  -> sends the sum back to every rank
#
# Rank 0's link carries 2(n-1) buffers while the others idle: the bottleneck the ring removes.


def all_reduce_naive(c: Call, flat, op: str):
    n, r = c.size, c.rank
    if r == 0:
        parts = [xp_of(flat).empty_like(flat) for _ in range(n - 1)]
        yield c.exchange("naive: gather to rank 0", recvs=[(parts[i - 1], i) for i in range(1, n)])
        for part in parts:  # in rank order, so the result does not depend on arrival order
            combine(flat, part, op)
        yield c.exchange("naive: broadcast from rank 0", sends=[(flat, i) for i in range(1, n)])
    else:
        yield c.exchange("naive: send to rank 0", sends=[(flat, 0)])
        yield c.exchange("naive: result from rank 0", recvs=[(flat, 0)])


def broadcast_naive(c: Call, flat, root: int):
    if c.rank == root:
        yield c.exchange("naive broadcast: root sends to all", sends=[(flat, p) for p in range(c.size) if p != root])
    else:
        yield c.exchange(f"naive broadcast: receive from rank {root}", recvs=[(flat, root)])


def reduce_naive(c: Call, flat, root: int, op: str):
    if c.rank == root:
        others = [p for p in range(c.size) if p != root]
        parts = [xp_of(flat).empty_like(flat) for _ in others]
        yield c.exchange("naive reduce: receive from all", recvs=list(zip(parts, others)))
        for part in parts:
            combine(flat, part, op)
    else:
        yield c.exchange(f"naive reduce: send to rank {root}", sends=[(flat, root)])


# =================================================================================================
# Tree reduce: a binary tree in heap order
# =================================================================================================
#
# The ranks in heap order, the root first and the others after it in rank order: the rank at
# place i of that list has the ranks at places 2i+1 and 2i+2 as its children. Every rank combines
# what its (at most two) children send, then sends the sum to its parent. About log2(n) levels
# instead of the root receiving n-1 times, and no rank receives more than two buffers (the tree
# NCCL builds its tree algorithms from). Root 0, n = 7:
#
#            0
#          /   \
#         1     2
#        / \   / \
#       3   4 5   6


def reduce_tree(c: Call, flat, root: int, op: str):
    """Binary-tree reduce; the result lands in ``flat`` on the root (others' buffers untouched)."""
    order = [root] + [p for p in range(c.size) if p != root]  # heap order
    i = order.index(c.rank)
    acc = flat if i == 0 else flat.copy()
    tmp = xp_of(flat).empty_like(flat)
    for kid in order[2 * i + 1 : 2 * i + 3]:
        yield c.exchange(f"tree reduce: receive from rank {kid}", recvs=[(tmp, kid)])
        combine(acc, tmp, op)
    if i:
        parent = order[(i - 1) // 2]
        yield c.exchange(f"tree reduce: send to rank {parent}", sends=[(acc, parent)])


# =================================================================================================
# Gather, scatter (linear: the root talks to everyone)
# =================================================================================================


def gather_linear(c: Call, flat, out, root: int, bounds):
    if c.rank == root:
        a, b = bounds[root]
        out[a:b] = flat
        others = [p for p in range(c.size) if p != root]
        yield c.exchange("gather: receive from all", recvs=[(out[bounds[p][0] : bounds[p][1]], p) for p in others])
    else:
        yield c.exchange(f"gather: send to rank {root}", sends=[(flat, root)])


def scatter_linear(c: Call, flat, full, root: int, bounds):
    if c.rank == root:
        a, b = bounds[root]
        flat[...] = full[a:b]
        others = [p for p in range(c.size) if p != root]
        yield c.exchange("scatter: send to all", sends=[(full[bounds[p][0] : bounds[p][1]], p) for p in others])
    else:
        yield c.exchange(f"scatter: receive from rank {root}", recvs=[(flat, root)])


# =================================================================================================
# Stand-ins, for a student release
# =================================================================================================
#
# `python -m grader release` gives students a copy of tinytrain in which the solution regions of
# algorithms.py (assignment 1) are cut out: each raises a NotImplementedError with a TODO. The rest
# of the framework still needs its collectives (data parallel all-reduces, MoE all-to-alls), and a
# student may do a later assignment first. So where an algorithm is cut out, the framework's
# public functions (collectives.py) use one of these instead: correct and simple (each rank talks
# to every other rank directly, in one step), moving the same bytes in all as the ring and the
# tree, but with every message at once. ``Collectives.bytes_sent`` gives the bytes a rank sends by
# whichever algorithm runs, so volume checks hold in a student copy too.
# In the full repository nothing is cut out and the stand-ins never run.
#
# Only the framework falls back. The assignment file (assignments/a1_collectives.py) must raise
# its TODOs, so that the grader reports them instead of grading a stand-in.


def _piece(buf, bounds, p):
    """Piece ``p`` of ``buf``: ``bounds[p]`` is its (start, stop)."""
    a, b = bounds[p]
    return buf[a:b]


def reduce_scatter_standin(c: Call, flat, bounds, op: str, out):
    """Direct reduce-scatter: every rank sends chunk p of ``flat`` (only read) straight to rank p and
    combines the n-1 chunks it receives with its own, in rank order, into ``out``. One step, the
    ring's bytes on every rank (every chunk but its own), but all n-1 messages at once."""
    mine = _piece(flat, bounds, c.rank)
    others = [p for p in range(c.size) if p != c.rank]
    parts = [c.scratch(mine.size, flat) for _ in others]
    yield c.exchange(
        "direct reduce-scatter stand-in: chunk p to rank p",
        sends=[(_piece(flat, bounds, p), p) for p in others],
        recvs=list(zip(parts, others)),
    )
    out[...] = mine
    for part in parts:  # in rank order, so the result does not depend on arrival order
        combine(out, part, op)


def all_gather_standin(c: Call, flat, bounds):
    """Direct all-gather: every rank sends its own chunk (already in place) straight to every other
    rank. One step; the same bytes in all as the ring's, though rank r sends (n-1) times its own
    chunk where the ring sends every chunk but chunk r+1 (the same when chunks are equal)."""
    others = [p for p in range(c.size) if p != c.rank]
    yield c.exchange(
        "direct all-gather stand-in: my chunk to every rank",
        sends=[(_piece(flat, bounds, c.rank), p) for p in others],
        recvs=[(_piece(flat, bounds, p), p) for p in others],
    )


def all_to_all_standin(c: Call, flat, send_bounds, out, recv_bounds):
    """Every message of the all-to-all posted in one step (same volume as pairwise, more at once)."""
    _piece(out, recv_bounds, c.rank)[...] = _piece(flat, send_bounds, c.rank)
    others = [p for p in range(c.size) if p != c.rank]
    yield c.exchange(
        "all-to-all stand-in: all messages at once",
        sends=[(_piece(flat, send_bounds, p), p) for p in others],
        recvs=[(_piece(out, recv_bounds, p), p) for p in others],
    )
