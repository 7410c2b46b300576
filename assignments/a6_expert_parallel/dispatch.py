# Assignment 6: Expert parallel (handout: assignments/a6_expert_parallel.md).
# Generated from tinytrain/parallel/expert_parallel/dispatch.py by `python -m grader stubs`. Replace each
# `raise NotImplementedError("TODO ...")` with your code; grade it with `python -m grader`.

"""Dispatch and combine: an expert's tokens travel to the rank that owns it and back, by all-to-all.

Rank r of the EP group (P ranks) owns experts [r·E/P, (r+1)·E/P). After routing, its kept
assignments are sorted by expert, so the rows for rank p's experts are one contiguous block::

    rank 0  [e0 e0 e0 | e1 | e2 e2 | e3 e3 e3 e3]        rank 1  [e0 | e1 e1 | e2 | e3 e3]
             └─ to 0 (4 rows) ┘└─ to 1 (6 rows) ┘                  └─to 0 (3)┘└─ to 1 (3)┘
        counts all-to-all (E/P integers to each rank) so every rank knows what it will receive
        dispatch all-to-all, uneven splits:   rank 0 gets 4 + 3 rows (e0, e1), rank 1 gets 6 + 3
        owner: group the received rows by expert, run each expert, put them back in received order
        combine all-to-all: the exact reverse (send what was received, receive what was sent)

Backward is the same two exchanges the other way round: the gradient of an all-to-all is the
reverse all-to-all (``AllToAll``). Two variants:

    dropless (uneven splits)  sends exactly the kept rows; needs the counts exchange first, and
                              every step has other shapes
    padded (equal splits)     every (rank, expert) block is padded to ``slots`` rows: static
                              shapes and no counts exchange, but the padding travels and is
                              computed on (bytes and FLOPs wasted: 1 − kept rows / sent rows)

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
        raise NotImplementedError("TODO 6.3: Each rank's row blocks go to their destinations in the given, possibly uneven, split; remember the split for the way back.")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("TODO 6.3: The gradient of an exchange is the reverse exchange: what each rank received goes back to where it came from.")


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


def dropless(moe, rows, counts, group):
    """Run ``rows`` (grouped by expert, ``counts[e]`` each) on their experts' owners and bring the
    outputs back, uneven splits. Returns (outputs in the order of ``rows``, send sizes, recv sizes)."""
    P, r = dist.get_world_size(group), dist.get_rank(group)
    per = moe.n_experts // P
    raise NotImplementedError("TODO 6.3: First tell each owner how many assignments for each of its experts are coming, then ship them with uneven splits, have each owner run every local expert once on its arrivals, and return the results home in their original order.")


def padded(moe, rows, counts, slots: int, group):
    """Like ``dropless``, but every (rank, expert) block is padded to ``slots`` rows: equal splits, no
    counts exchange; each expert runs on all P·slots rows it receives, padding included."""
    P, r = dist.get_world_size(group), dist.get_rank(group)
    E, per, width = moe.n_experts, moe.n_experts // P, rows.shape[-1]
    starts = numpy.cumsum(counts) - counts
    real = numpy.concatenate([e * slots + numpy.arange(counts[e]) for e in range(E)]).astype(numpy.int64)
    index = numpy.full(E * slots, rows.shape[0], dtype=numpy.int64)  # pad: the zero row appended below
    index[real] = numpy.concatenate([starts[e] + numpy.arange(counts[e]) for e in range(E)]).astype(numpy.int64)
    buffer = F.concatenate([rows, Tensor(xp.zeros((1, width), dtype=rows.dtype))], axis=0)[xp.asarray(index)]
    got = AllToAll.apply(buffer, group=group)  # [p][j][slot]
    perm = by_expert(numpy.full((P, per), slots, dtype=numpy.int64))
    out = moe.run_experts(got[xp.asarray(perm)], [P * slots] * per, owned(r, E, P))
    back = AllToAll.apply(out[xp.asarray(inverse(perm))], group=group)
    return back[xp.asarray(real)]


def wire_bytes(variant: str, rank: int, size: int, n_experts: int, row_bytes: int, send=None, recv=None, slots=0):
    """(forward, backward) bytes a rank sends in one MoE layer, from the formulas at the top."""
    per = n_experts // size
    if variant == "padded":
        one = row_bytes * (size - 1) * per * slots
        return 2 * one, 2 * one
    rows = sum(s for p, s in enumerate(send) if p != rank) + sum(s for p, s in enumerate(recv) if p != rank)
    return 8 * (size - 1) * per + row_bytes * rows, row_bytes * rows
