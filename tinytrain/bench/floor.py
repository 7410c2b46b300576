"""The floor under our collectives: each algorithm's messages as a bare mpi4py loop (``bench collectives --floor``).

Each function here sends what one of our algorithms sends (as many steps, messages of the same
sizes to as many peers, the same additions) with nothing but what that cannot do without: post
the step's ``Isend``/``Irecv``, poll ``Testall`` with ``sched_yield`` between polls (our wait's
policy when ranks share cores), combine. No argument checks, no byte accounting, no receive check,
no deadline, no generator. Whatever a Python implementation of the algorithm does, it pays at
least this; the gap between this column and ours is what tinytrain's machinery costs, and the gap
between this column and MPI's is what Python and the algorithm's steps cost.

The floor reproduces the traffic, not the result: which chunk travels in which step is the
assignment's to work out (assignment 1), so here every rank walks the chunks in one fixed order,
all-to-all pairs ranks by XOR and broadcast runs down a binary tree (on the bench's 4 ranks the
same messages per rank as the binomial tree). The buffers are the bench's zeros. Not a product: no
errors are caught, and a rank that never answers hangs it (the benchmark runs it on healthy ranks
only).
"""

from __future__ import annotations

import os

import numpy

from tinytrain.distributed import work
from tinytrain.distributed._mpi import MPI
from tinytrain.distributed.chunks import chunk_bounds, ring_neighbours, split_counts

# Just above the tags our collectives use (work: 1024 + seq % 30000) and below the debug signature
# tag (32000): a floor run never matches a message of ours.
_TAG = work._TAG_BASE + work._TAG_SPAN


def _step(comm, sends, recvs) -> None:
    """One step: post receives then sends, poll until all completed, yielding the core between polls."""
    reqs = [comm.Irecv([buf, MPI.BYTE], peer, _TAG) for buf, peer in recvs]
    reqs += [comm.Isend([buf, MPI.BYTE], peer, _TAG) for buf, peer in sends]
    while not MPI.Request.Testall(reqs):
        os.sched_yield()


def _pieces(flat, n: int) -> list:
    """``flat`` cut in ``n`` nearly equal consecutive views, where our algorithms cut it."""
    return [flat[a:b] for a, b in chunk_bounds(split_counts(flat.size, n))]


def all_reduce_recursive_doubling(comm, flat, tmp) -> None:
    """Recursive doubling, n a power of two (the bench's 4 ranks): swap whole buffers, add."""
    r, n = comm.Get_rank(), comm.Get_size()
    k = 1
    while k < n:
        _step(comm, [(flat, r ^ k)], [(tmp, r ^ k)])
        numpy.add(flat, tmp, out=flat)
        k <<= 1


def ring_reduce_scatter(comm, full, out, tmps) -> None:
    """The ring reduce-scatter's traffic: n-1 steps of one chunk to the right neighbour and one from
    the left, each received chunk added to a chunk of ``full`` (every chunk read once)."""
    r, n = comm.Get_rank(), comm.Get_size()
    chunks = _pieces(full, n)
    right, left = ring_neighbours(r, n)
    outgoing = chunks[0]
    for s in range(n - 1):
        incoming = tmps[s % 2][: chunks[s + 1].size]
        _step(comm, [(outgoing, right)], [(incoming, left)])
        numpy.add(incoming, chunks[s + 1], out=out if s == n - 2 else incoming)
        outgoing = incoming


def ring_all_gather(comm, x, out) -> None:
    """The ring all-gather's traffic: place this rank's piece, then n-1 steps of one chunk to the
    right neighbour and one from the left, received in place."""
    r, n = comm.Get_rank(), comm.Get_size()
    chunks = _pieces(out, n)
    chunks[0][...] = x
    right, left = ring_neighbours(r, n)
    for s in range(n - 1):
        _step(comm, [(chunks[s], right)], [(chunks[s + 1], left)])


def pairwise_all_to_all(comm, x, out) -> None:
    """Pairwise exchange's traffic, n a power of two: keep the own block, then in step s trade
    blocks with rank r XOR s (one peer each way per step, every peer once)."""
    r, n = comm.Get_rank(), comm.Get_size()
    send, recv = _pieces(x, n), _pieces(out, n)
    recv[r][...] = send[r]
    for s in range(1, n):
        peer = r ^ s
        _step(comm, [(send[peer], peer)], [(recv[peer], peer)])


def binomial_broadcast(comm, flat) -> None:
    """A tree broadcast from rank 0 down a binary heap (rank i's children 2i+1, 2i+2): on 4 ranks
    the binomial tree's messages (the root sends two, one other rank one)."""
    r, n = comm.Get_rank(), comm.Get_size()
    if r:
        _step(comm, [], [(flat, (r - 1) // 2)])
    kids = [k for k in (2 * r + 1, 2 * r + 2) if k < n]
    if kids:
        _step(comm, [(flat, k) for k in kids], [])


def setup(name: str, algo: str, count: int, piece: int, comm, zeros):
    """A zero-argument floor call on buffers from ``zeros`` (the bench's own sizes), or None where
    there is no bare version."""
    n = comm.Get_size()
    if name == "all_reduce" and algo == "recursive_doubling" and n & (n - 1) == 0:
        a, tmp = zeros(count), zeros(count)
        return lambda: all_reduce_recursive_doubling(comm, a, tmp)
    if name == "all_gather":
        x, out = zeros(piece), zeros(piece * n)
        return lambda: ring_all_gather(comm, x, out)
    if name == "reduce_scatter":
        full, out = zeros(piece * n), zeros(piece)
        tmps = [zeros(piece), zeros(piece)]
        return lambda: ring_reduce_scatter(comm, full, out, tmps)
    if name == "all_to_all" and n & (n - 1) == 0:
        x, out = zeros(piece * n), zeros(piece * n)
        return lambda: pairwise_all_to_all(comm, x, out)
    if name == "broadcast":
        a = zeros(count)
        return lambda: binomial_broadcast(comm, a)
    return None
