"""The floor under our collectives: each algorithm's messages as a bare mpi4py loop (``bench collectives --floor``).

Each function here sends what one of our algorithms sends (as many steps, messages of the same
sizes to as many peers, the same additions) with nothing but what that cannot do without: post
the step's ``Isend``/``Irecv``, poll ``Testall`` with ``sched_yield`` between polls (our wait's
policy when ranks share cores), combine. No argument checks, no byte accounting, no receive check,
no deadline, no generator. Whatever a Python implementation of the algorithm does, it pays at
least this; the gap between this column and ours is what tinytrain's machinery costs, and the gap
between this column and MPI's is what Python and the algorithm's steps cost.

Where another algorithm has the same messages, the floor uses it rather than the one assignment 1
asks for: all-to-all pairs ranks by XOR (n a power of two) and broadcast runs down a binary tree
(on the bench's 4 ranks the same messages per rank as the binomial tree). Not a product: no
errors are caught, and a rank that never answers hangs it (the benchmark runs it on healthy ranks
only).
"""

from __future__ import annotations

import os

import numpy

from tinytrain.distributed import work
from tinytrain.distributed._mpi import MPI
from tinytrain.distributed.chunks import chunk_bounds, split_counts

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
    """Ring reduce-scatter: step s sends the partial sum of chunk r-s right and adds chunk r-s-1 from the left."""
    r, n = comm.Get_rank(), comm.Get_size()
    chunks = _pieces(full, n)
    right, left = (r + 1) % n, (r - 1) % n
    outgoing = chunks[(r - 1) % n]
    for s in range(n - 1):
        i = (r - s - 2) % n
        incoming = tmps[s % 2][: chunks[i].size]
        _step(comm, [(outgoing, right)], [(incoming, left)])
        numpy.add(incoming, chunks[i], out=out if s == n - 2 else incoming)
        outgoing = incoming


def ring_all_gather(comm, x, out) -> None:
    """Ring all-gather: place this rank's piece, then pass pieces to the right n-1 times."""
    r, n = comm.Get_rank(), comm.Get_size()
    chunks = _pieces(out, n)
    chunks[r][...] = x
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        _step(comm, [(chunks[(r - s) % n], right)], [(chunks[(r - s - 1) % n], left)])


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
