# Assignment 7: Context parallel (handout: assignments/a7_context_parallel.md).
# Generated from tinytrain/parallel/context_parallel/ulysses.py by `python -m grader stubs`. Replace each
# `raise NotImplementedError("TODO ...")` with your code; grade it with `python -m grader`.

"""All-to-all attention (DeepSpeed-Ulysses): trade sequence shards for head shards and back.

Attention mixes positions but never heads. So instead of passing K/V around a ring, one
all-to-all gives every rank *all* positions of *some* heads, attention runs locally (the ordinary
causal kernel on the whole sequence), and a second all-to-all returns to sequence shards::

    rank r: q, k, v (B, H, T/N, D)  my positions, all heads
        │  all-to-all ×3: head group p of my positions → rank p          (SeqToHead)
        ▼
    rank r: q, k, v (B, H/N, T, D)  all positions (put back in sequence order), my heads
        │  causal softmax attention, local
        ▼
    rank r: y (B, H/N, T, D)
        │  all-to-all: positions of rank p → rank p                       (HeadToSeq)
        ▼
    rank r: y (B, H, T/N, D)        my positions, all heads

Backward is the same two exchanges the other way round (the gradient of an all-to-all is the
inverse all-to-all). Each exchange sends (N − 1)/N of a (B, H, T/N, D) tensor: per layer 4 of them
forward (q, k, v, y) and 4 backward. The catch: N must divide the number of heads (per TP rank).

Under the zigzag split the gathered sequence arrives rank by rank (rank 0's positions, then rank
1's, ...), not in order: ``SeqToHead`` sorts it by position, ``HeadToSeq`` undoes that.
"""

from __future__ import annotations

import numpy

from tinytrain import distributed as dist
from tinytrain import functional as F
from tinytrain.autograd import Function
from assignments.a7_context_parallel.split import positions


def check_heads(heads: int, n: int) -> None:
    """All-to-all attention gives each rank heads/N heads: N must divide the (local) head count."""
    if heads % n:
        raise ValueError(
            f"all-to-all (Ulysses) attention splits the {heads} attention heads (per tensor-parallel "
            f"rank) over a context-parallel group of {n} ranks, and {n} does not divide {heads}: "
            f"choose a CP size that divides {heads}, change n_head, or use algo='ring'"
        )


def gathered_positions(T: int, n: int, split: str) -> numpy.ndarray:
    """The global position of each column after gathering: rank 0's positions, then rank 1's, ..."""
    return numpy.concatenate([positions(T, p, n, split) for p in range(n)])


def seq_to_head(x, group, split):
    """(B, H, T/N, D) my positions, all heads -> (B, H/N, T, D) all positions in order, my heads."""
    n = dist.get_world_size(group)
    B, H, Tl, D = x.shape
    check_heads(H, n)
    raise NotImplementedError("TODO 7.5: From this rank's positions of all heads to all positions (sorted along the sequence) of its share of the heads.")


def head_to_seq(y, group, split):
    """(B, H/N, T, D) all positions, my heads -> (B, H, T/N, D) my positions, all heads."""
    n = dist.get_world_size(group)
    B, h, T, D = y.shape
    raise NotImplementedError("TODO 7.5: Exactly undo the sequence-to-head exchange: from all positions of my heads back to my positions of all heads.")


class SeqToHead(Function):
    """``seq_to_head`` forward; its inverse on the gradient backward."""

    @staticmethod
    def forward(ctx, x, group=None, split="zigzag"):
        ctx.group, ctx.split = group, split
        return seq_to_head(x, group, split)

    @staticmethod
    def backward(ctx, grad):
        return (head_to_seq(grad, ctx.group, ctx.split),)


class HeadToSeq(Function):
    """``head_to_seq`` forward; its inverse on the gradient backward."""

    @staticmethod
    def forward(ctx, y, group=None, split="zigzag"):
        ctx.group, ctx.split = group, split
        return head_to_seq(y, group, split)

    @staticmethod
    def backward(ctx, grad):
        return (seq_to_head(grad, ctx.group, ctx.split),)


def alltoall_attention(q, k, v, group=None, split="zigzag", scale=None):
    """Causal attention of my positions' q, k, v (B, H, T/N, D) by two all-to-alls (see top)."""
    check_heads(q.shape[1], dist.get_world_size(group))
    raise NotImplementedError("TODO 7.5: Attention on the whole sequence for this rank's share of the heads, sequence shards traded for head shards and back.")


def alltoall_bytes(q_shape, itemsize: int, n: int) -> tuple[int, int]:
    """Bytes each rank sends in one attention layer, (forward, backward): 4 all-to-alls each way."""
    size = itemsize
    for d in q_shape:
        size *= d
    one = (n - 1) * size // n
    return 4 * one, 4 * one
