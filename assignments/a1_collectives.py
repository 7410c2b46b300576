# Assignment 1: Collectives (handout: assignments/a1_collectives.md).
# Generated from tinytrain/distributed/algorithms.py by `python -m grader stubs`. Replace each
# `raise NotImplementedError("TODO ...")` with your code; grade it with `python -m grader`.

"""The collective algorithms of assignment 1: ring reduce-scatter, all-gather and all-reduce,
pairwise all-to-all, binomial-tree broadcast. Read it top to bottom.

An algorithm is a generator: each step is one ``yield c.exchange(what, sends=[(buffer, peer)],
recvs=[(buffer, peer)])``, which posts the step's receives and sends together; the generator
resumes once they all completed (``work.py`` drives it, with a deadline on every wait). ``c`` is
the call (``work.Call``): ``c.rank`` and ``c.size`` are this rank's place in the group. Buffers
are slices of one flat array, cut into chunks by ``chunks.chunk_bounds``.

The other algorithms (recursive doubling and halving-doubling in ``doubling.py``; naive, tree
reduce, gather, scatter and the student-release stand-ins in ``rooted.py``) and the public
functions with their argument checks (``collectives.py``) live next door; none of them is one
of the algorithms here. The last lines of this
file make the public functions (``all_reduce``, ``reduce_scatter``, ...) run the algorithms of
*this* module: ``tinytrain.distributed`` exports those, and an assignment copy of this file gets
its own, running the student's algorithms.
"""

from __future__ import annotations

from tinytrain.distributed.chunks import chunk_bounds, combine, ring_neighbours, split_counts
from tinytrain.distributed.collectives import Collectives
from tinytrain.distributed.work import Call

# =================================================================================================
# Ring algorithms (bandwidth-optimal): reduce-scatter, all-gather, and all-reduce = both
# =================================================================================================
#
# n ranks stand in a ring; each sends only to its right neighbour and receives from its left.
# The buffer is cut into n chunks. Reduce-scatter, n=4: what each rank holds of the chunks'
# partial sums after each step (x_i: chunk i summed over the ranks listed, "a" = rank 0, ...):
#
#              rank 0          rank 1          rank 2          rank 3
#   start      a               b               c               d
#   step 1     d3+a3           a0+b0           b1+c1           c2+d2
#   step 2     c2+d2+a2        d3+a3+b3        a0+b0+c0        b1+c1+d1
#   step 3     Σ1              Σ2              Σ3              Σ0        (each sum over all ranks)
#
# Out of place: a rank never writes into its input. Partial sums live in chunk-sized buffers;
# the last one lands in ``out``. So the public reduce-scatter reads the caller's buffer as it is
# (no copy of it) and writes only its own piece. Where a rank's bytes go per step: MPI copies one
# chunk in (N/n), ``combine`` reads it and the rank's own chunk and writes the sum (3 N/n): the
# reduction costs memory traffic that an all-gather does not have, so a reduce-scatter's busbw
# stays below the all-gather's when ranks share cores.
#
# All-gather then circulates the finished chunks n-1 more steps, overwriting instead of adding.
# Each rank sends n-1 chunks per phase, so all-reduce sends 2(n-1)/n of the buffer per rank,
# independent of n: the bandwidth-optimal volume.
#
# ``shift`` chooses which chunk each rank ends with: rank r ends with chunk (r + 1 + shift) % n.
# All-reduce uses shift=0 (the picture above); standalone reduce-scatter / all-gather use
# shift=-1 so rank r owns chunk r (the natural layout for sharding).


def _ring_reduce_scatter(c: Call, flat, bounds, op: str, shift: int, out):
    """Ring reduce-scatter of ``flat`` in n-1 steps, out of place (assignment task 1.1).

    ``bounds[i]`` is the (start, stop) of chunk i in ``flat``, which is only read. Every step sends
    one chunk to the right neighbour and receives one from the left, posted together in one
    ``c.exchange``. After the last step ``out`` holds chunk (r + 1 + shift) % n reduced over all
    ranks (``op``); ``out`` may be that chunk of ``flat`` itself.
    """
    raise NotImplementedError("TODO 1.1: On return, out holds this rank's chunk of the reduction over all ranks (which chunk: the docstring says); flat is only read, and a rank talks only to its ring neighbours.")


def _ring_all_gather(c: Call, flat, bounds, shift: int, label: str = "ring all-gather"):
    """Ring all-gather in place, in n-1 steps (assignment task 1.2).

    On entry rank r's chunk (r + 1 + shift) % n of ``flat`` is final; on exit every chunk is, on
    every rank. Every step sends one chunk to the right neighbour and receives one from the left.
    """
    raise NotImplementedError("TODO 1.2: On return, every rank's flat holds every rank's finished chunk; a rank talks only to its ring neighbours.")


def _all_reduce_ring(c: Call, flat, op: str):
    """Ring all-reduce = reduce-scatter + all-gather (assignment task 1.3), in place on ``flat``.

    Any length of ``flat``; every rank sends every chunk but one in each phase, 2(n-1)/n of the
    buffer when n divides its length."""
    raise NotImplementedError("TODO 1.3: On return, flat holds the reduction over all ranks, on every rank, in place, by the two ring phases of this file.")


# =================================================================================================
# All-to-all by pairwise exchange
# =================================================================================================
#
# n-1 steps; every pair talks exactly once in each direction, and no rank ever has more than one
# message in and one out. Who holds which blocks when (rank r's block for rank p written r>p):
#
#   rank 1 of 4    start: 1>0 1>1 1>2 1>3    after the steps: 0>1 1>1 2>1 3>1 (in rank order)


def _all_to_all_pairwise(c: Call, flat, send_bounds, out, recv_bounds):
    """All-to-all by pairwise exchange in n-1 steps (assignment task 1.4).

    ``flat[send_bounds[p]]`` goes to rank p (p = this rank included); what rank p sends lands in
    ``out[recv_bounds[p]]``. Pieces may be empty.
    """
    raise NotImplementedError("TODO 1.4: On return, block p of out holds the block rank p addressed to this rank; every pair of ranks exchanges exactly once each way, one peer each way per step.")


# =================================================================================================
# Binomial-tree broadcast
# =================================================================================================
#
# The binomial tree: the number of ranks that hold the data doubles in every round, so
# ceil(log2 n) rounds instead of the root sending n-1 times. Who holds the data, n=8, root 0:
#
#   start: 0    round 1: 0 1    round 2: 0 1 2 3    round 3: all eight
#
# Works for any n and any root.


def _broadcast_tree(c: Call, flat, root: int):
    """Binomial-tree broadcast of ``flat`` from ``root``, in place (assignment task 1.5).

    Every rank but the root receives the buffer exactly once; the root sends ceil(log2 n) times.
    """
    raise NotImplementedError("TODO 1.5: On return, every rank holds the root's buffer; every rank but the root received it exactly once, and the whole broadcast takes about log2(n) rounds.")


# =================================================================================================
# The public functions, running the algorithms of this module
# =================================================================================================
#
# collectives.Collectives checks the arguments, picks an algorithm, tags the messages, counts the
# bytes and drives the steps; these names make it call the algorithms defined above.

_public = Collectives(__name__)
all_reduce = _public.all_reduce
reduce_scatter = _public.reduce_scatter
all_gather = _public.all_gather
all_to_all = _public.all_to_all
broadcast = _public.broadcast
reduce = _public.reduce
gather = _public.gather
scatter = _public.scatter
barrier = _public.barrier
bytes_sent = _public.bytes_sent
