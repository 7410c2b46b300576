"""All-reduce in few steps (recursive doubling, halving-doubling) and the dissemination barrier.

In all three the distance between partners doubles (or halves) every round, so they take about
log2(n) steps where the ring takes n-1: cheaper in latency, which is what small messages pay for.
``collectives.choose_all_reduce_algo`` picks between them and the ring by message size.
"""

from __future__ import annotations

import functools

import numpy

from .chunks import chunk_bounds, combine, split_counts
from .work import Call

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


def all_reduce_recursive_doubling(c: Call, flat, op: str):
    n, r = c.size, c.rank
    p = 1 << (n.bit_length() - 1)
    tmp = c.scratch(flat.size, flat)
    if r >= p:  # an extra rank: fold into r - p, get the answer back later
        yield c.exchange(f"recursive doubling: fold into rank {r - p}", sends=[(flat, r - p)])
        yield c.exchange(f"recursive doubling: result from rank {r - p}", recvs=[(flat, r - p)])
        return
    if r + p < n:
        yield c.exchange(f"recursive doubling: fold from rank {r + p}", recvs=[(tmp, r + p)])
        combine(flat, tmp, op)
    for k, name in enumerate(_round_names(p, r)):
        partner = r ^ (1 << k)
        yield c.exchange(name, sends=[(flat, partner)], recvs=[(tmp, partner)])
        combine(flat, tmp, op)  # a+b == b+a exactly, so both partners hold identical bits
    if r + p < n:
        yield c.exchange(f"recursive doubling: result to rank {r + p}", sends=[(flat, r + p)])


@functools.cache
def _round_names(p: int, r: int) -> tuple[str, ...]:
    """The rounds' step names for rank r of p, made once: this algorithm serves the smallest
    messages, where formatting the names every call cost a tenth of a 1 KiB all-reduce."""
    rounds = p.bit_length() - 1
    return tuple(f"recursive doubling round {k + 1}/{rounds} with rank {r ^ (1 << k)}" for k in range(rounds))


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


def all_reduce_halving_doubling(c: Call, flat, op: str):
    n, r = c.size, c.rank
    p = 1 << (n.bit_length() - 1)
    if r >= p:  # an extra rank: fold into r - p, get the answer back later
        yield c.exchange(f"halving-doubling: fold into rank {r - p}", sends=[(flat, r - p)])
        yield c.exchange(f"halving-doubling: result from rank {r - p}", recvs=[(flat, r - p)])
        return
    tmp = c.scratch(flat.size, flat)
    if r + p < n:
        yield c.exchange(f"halving-doubling: fold from rank {r + p}", recvs=[(tmp, r + p)])
        combine(flat, tmp, op)
    bounds = chunk_bounds(split_counts(flat.size, p))

    def span(lo, hi):
        return (bounds[lo][0], bounds[hi - 1][1])  # (chunks -> elements)

    lo, hi, windows = 0, p, []
    mask = p >> 1
    while mask:  # reduce-scatter by halving
        partner, mid = r ^ mask, (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if r & mask == 0 else ((mid, hi), (lo, mid))
        (ka, kb), (ga, gb) = span(*keep), span(*give)
        yield c.exchange(
            f"halving step with rank {partner} (keep chunks {keep[0]}..{keep[1] - 1})",
            sends=[(flat[ga:gb], partner)],
            recvs=[(tmp[ka:kb], partner)],
        )
        combine(flat[ka:kb], tmp[ka:kb], op)
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
            sends=[(flat[ma:mb], partner)],
            recvs=[(flat[oa:ob], partner)],
        )
        lo, hi = parent_lo, parent_hi
        mask <<= 1
    if r + p < n:
        yield c.exchange(f"halving-doubling: result to rank {r + p}", sends=[(flat, r + p)])


# =================================================================================================
# Dissemination barrier
# =================================================================================================
#
# In round k rank r signals rank r+2^k and waits for rank r-2^k. After
# ceil(log2 n) rounds every rank has (transitively) heard from every other.


def barrier_dissemination(c: Call):
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
