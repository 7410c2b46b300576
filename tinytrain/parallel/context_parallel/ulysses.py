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
from tinytrain.parallel.context_parallel.split import positions


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
    # BEGIN SOLUTION 7.5 "From this rank's positions of all heads to all positions (sorted along the sequence) of its share of the heads." full="Send head group p to rank p: (N, B, H/N, T/N, D) contiguous, all_to_all, then put the N position pieces side by side and sort them by position."
    h = H // n
    send = x.reshape(B, n, h, Tl, D).swapaxes(0, 1).copy()  # row block p: head group p
    got = dist.all_to_all(send, group=group)  # row block p: rank p's positions of my heads
    got = got.reshape(n, B, h, Tl, D).transpose(1, 2, 0, 3, 4).reshape(B, h, n * Tl, D)
    order = numpy.argsort(gathered_positions(n * Tl, n, split))
    return got[..., order, :]
    # END SOLUTION


def head_to_seq(y, group, split):
    """(B, H/N, T, D) all positions, my heads -> (B, H, T/N, D) my positions, all heads."""
    n = dist.get_world_size(group)
    B, h, T, D = y.shape
    # BEGIN SOLUTION 7.5 "Exactly undo the sequence-to-head exchange: from all positions of my heads back to my positions of all heads." full="The inverse of seq_to_head: columns in gathered order (rank by rank), (N, B, H/N, T/N, D) contiguous, all_to_all, head groups side by side."
    Tl = T // n
    send = y[..., gathered_positions(T, n, split), :].reshape(B, h, n, Tl, D).transpose(2, 0, 1, 3, 4).copy()
    got = dist.all_to_all(send, group=group)  # row block p: my positions of rank p's heads
    return got.reshape(n, B, h, Tl, D).swapaxes(0, 1).reshape(B, n * h, Tl, D)
    # END SOLUTION


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
    # BEGIN SOLUTION 7.5 "Attention on the whole sequence for this rank's share of the heads, sequence shards traded for head shards and back." full="SeqToHead each of q, k, v; F.scaled_dot_product_attention(causal=True, scale=scale); HeadToSeq."
    q, k, v = (SeqToHead.apply(t, group=group, split=split) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, causal=True, scale=scale)
    return HeadToSeq.apply(y, group=group, split=split)
    # END SOLUTION


def alltoall_bytes(q_shape, itemsize: int, n: int) -> tuple[int, int]:
    """Bytes each rank sends in one attention layer, (forward, backward): 4 all-to-alls each way."""
    size = itemsize
    for d in q_shape:
        size *= d
    one = (n - 1) * size // n
    return 4 * one, 4 * one
