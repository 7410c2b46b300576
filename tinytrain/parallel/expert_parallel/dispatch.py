"""Dispatch and combine: an expert's tokens travel to the rank that owns it and back, by all-to-all.

Rank r of the EP group (P ranks) owns experts [r·E/P, (r+1)·E/P). Before and after, for P = 2,
E = 4 (rank 0 owns e0, e1; rank 1 owns e2, e3), rows grouped by expert::

    before   rank 0 holds [e0 e0 e0 | e1 | e2 e2 | e3 e3 e3 e3]     rank 1 holds [e0 | e1 e1 | e2 | e3 e3]
    middle   rank 0 holds the 4 + 3 rows for e0, e1 and their outputs; rank 1 the 6 + 3 for e2, e3
    after    each rank holds one output row per row it started with, in its own order

Backward: the gradient of an all-to-all is an all-to-all too (``AllToAll``). Two variants:

    dropless (uneven splits)  sends exactly the kept rows; every step has other sizes, which
                              the receiving side must learn first
    padded (equal splits)     every (rank, expert) block is padded to ``slots`` rows: static
                              shapes and no sizes to learn, but the padding travels and is
                              computed on (bytes and FLOPs wasted: 1 − kept rows / sent rows);
                              it is ``dropless`` on a padded buffer whose sizes are known

Bytes each rank sends per MoE layer (row = C · itemsize bytes), ``wire_bytes``:
    dropless  forward: 8·(P−1)·E/P (counts) + row·(Σ_{p≠r} send_p + Σ_{p≠r} recv_p); backward the same
              without the counts
    padded    forward = backward = 2 · row · (P−1) · E/P · slots
"""

from __future__ import annotations

import numpy

from tinytrain import distributed as dist
from tinytrain import functional as F
from tinytrain.autograd import Function, Tensor
from tinytrain.backend import xp


class AllToAll(Function):
    """``dist.all_to_all`` of rows (``send_sizes`` to each rank, ``recv_sizes`` from each; None for
    equal splits) forward; the reverse all-to-all of the gradient backward."""

    @staticmethod
    def forward(ctx, x, send_sizes=None, recv_sizes=None, group=None):
        # BEGIN SOLUTION 6.3 "Each rank's row blocks go to their destinations in the given, possibly uneven, split; remember the split for the way back." full="Remember the sizes and the group on ctx (backward needs them); dist.all_to_all of the contiguous x with send_sizes and recv_sizes over group."
        ctx.sizes, ctx.group = (send_sizes, recv_sizes), group
        return dist.all_to_all(xp.ascontiguousarray(x), send_sizes, recv_sizes, group=group)
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION 6.3 "The gradient of an exchange is the reverse exchange: what each rank received goes back to where it came from." full="The reverse exchange: all_to_all the gradient with the sizes swapped (what was sent comes home)."
        send_sizes, recv_sizes = ctx.sizes
        return (dist.all_to_all(xp.ascontiguousarray(grad), recv_sizes, send_sizes, group=ctx.group),)
        # END SOLUTION


def owned(rank: int, n_experts: int, size: int) -> range:
    """The experts rank ``rank`` of an EP group of ``size`` owns."""
    per = n_experts // size
    return range(rank * per, (rank + 1) * per)


def by_expert(blocks: numpy.ndarray) -> numpy.ndarray:
    """Rows laid out [source p][local expert j] (``blocks[p, j]`` rows each) -> the permutation that
    lays them out [j][p]: each local expert's rows contiguous, sources in rank order."""
    starts = (numpy.cumsum(blocks.reshape(-1)) - blocks.reshape(-1)).reshape(blocks.shape)
    parts = [
        numpy.arange(starts[p, j], starts[p, j] + blocks[p, j])
        for j in range(blocks.shape[1])
        for p in range(blocks.shape[0])
    ]
    return numpy.concatenate(parts).astype(numpy.int64) if parts else numpy.zeros(0, dtype=numpy.int64)


def inverse(perm: numpy.ndarray) -> numpy.ndarray:
    inv = numpy.empty_like(perm)
    inv[perm] = numpy.arange(perm.shape[0])
    return inv


def dropless(moe, rows, counts, group, arriving=None):
    """Run ``rows`` (grouped by expert, ``counts[e]`` each) on their experts' owners and bring the
    outputs back, uneven splits. Returns (outputs in the order of ``rows``, send sizes, recv sizes).
    ``arriving`` (P, E/P): how many rows each rank sends each of my experts, where every rank
    knows it without asking (``padded``'s equal blocks); None: the ranks tell each other."""
    P, r = dist.get_world_size(group), dist.get_rank(group)
    per = moe.n_experts // P
    # BEGIN SOLUTION 6.3 "Each assignment is computed by the owner of its expert and its result comes back to where it started, in its original order; splits may be uneven or empty." full="counts.reshape(P, E/P): one block per destination; unless arriving is given, all_to_all it (equal splits) to learn what arrives; AllToAll the rows with uneven sizes, regroup by local expert (by_expert), run moe.run_experts on owned(r, E, P), undo the regrouping, AllToAll back with the sizes swapped."
    mine = numpy.ascontiguousarray(counts.reshape(P, per).astype(numpy.int64))
    if arriving is None:
        arriving = dist.all_to_all(mine, group=group)  # (P, E/P): rank p's rows for each of my experts
    send, recv = mine.sum(axis=1).tolist(), arriving.sum(axis=1).tolist()
    got = AllToAll.apply(rows, send_sizes=send, recv_sizes=recv, group=group)
    perm = by_expert(arriving)
    out = moe.run_experts(got[xp.asarray(perm)], arriving.sum(axis=0), owned(r, moe.n_experts, P))
    back = out[xp.asarray(inverse(perm))]
    return AllToAll.apply(back, send_sizes=recv, recv_sizes=send, group=group), send, recv
    # END SOLUTION


def padded(moe, rows, counts, slots: int, group):
    """Like ``dropless``, but every (rank, expert) block is padded to ``slots`` rows: equal splits, no
    counts exchange; each expert runs on all P·slots rows it receives, padding included."""
    P, E, width = dist.get_world_size(group), moe.n_experts, rows.shape[-1]
    starts = numpy.cumsum(counts) - counts
    real = numpy.concatenate([e * slots + numpy.arange(counts[e]) for e in range(E)]).astype(numpy.int64)
    index = numpy.full(E * slots, rows.shape[0], dtype=numpy.int64)  # pad: the zero row appended below
    index[real] = numpy.concatenate([starts[e] + numpy.arange(counts[e]) for e in range(E)]).astype(numpy.int64)
    buffer = F.concatenate([rows, Tensor(xp.zeros((1, width), dtype=rows.dtype))], axis=0)[xp.asarray(index)]
    blocks = numpy.full((P, E // P), slots, dtype=numpy.int64)  # every rank sends every expert `slots` rows
    out, _, _ = dropless(moe, buffer, numpy.full(E, slots, dtype=numpy.int64), group, arriving=blocks)
    return out[xp.asarray(real)]


def wire_bytes(variant: str, rank: int, size: int, n_experts: int, row_bytes: int, send=None, recv=None, slots=0):
    """(forward, backward) bytes a rank sends in one MoE layer, from the formulas at the top."""
    per = n_experts // size
    if variant == "padded":
        one = row_bytes * (size - 1) * per * slots
        return 2 * one, 2 * one
    rows = sum(s for p, s in enumerate(send) if p != rank) + sum(s for p, s in enumerate(recv) if p != rank)
    return 8 * (size - 1) * per + row_bytes * rows, row_bytes * rows
