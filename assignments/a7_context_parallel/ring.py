# Assignment 7: Context parallel (handout: assignments/a7_context_parallel.md).
# Generated from tinytrain/parallel/context_parallel/ring.py by `python -m grader stubs`. Replace each
# `raise NotImplementedError("TODO ...")` with your code; grade it with `python -m grader`.

"""Ring attention: K/V blocks travel around the context-parallel ring, queries stay home.

Each of the N ranks holds q, k, v of its own sequence positions (B, H, T/N, D). In N steps every
rank's K/V block visits every rank; each rank merges its queries' partial results (``merge.py``)::

    N = 4, contiguous         step 0   step 1   step 2   step 3       (K/V of rank ...)
        rank 0                  0 ◣      3 ·      2 ·      1 ·        ◣ diagonal (causal mask)
        rank 1                  1 ◣      0 ■      3 ·      2 ·        ■ full block
        rank 2                  2 ◣      1 ■      0 ■      3 ·        · skipped (all in the future)
        rank 3                  3 ◣      2 ■      1 ■      0 ■

Each step's transfer of the next block runs while this step's blocks are computed (comm ∥
compute); with compute ≥ transfer the N − 1 transfers hide behind it. Each rank sends
(N − 1)·|K, V| bytes forward, |K, V| = 2·B·H·(T/N)·D·itemsize.

Backward (hand-written, nothing saved from the ring but q, k, v, out and the log-sum-exp): K/V go
around once more, and with each block an accumulator of its dK/dV, which every rank it visits adds
to; after N hops every accumulator is back at its owner, complete. dq stays local. Bytes sent backward:
(N − 1)·|K, V| (the blocks) + N·|K, V| (the accumulators; the last hop takes them home).

Each step's compute (all its blocks) is one ``trace`` span ("ring attention", cat compute, args step/src/pass); the
sends and receives record their own ``comm.step`` spans from post to completion, so a trace shows
whether a transfer ran under a compute span.
"""

from __future__ import annotations

import math

from tinytrain import distributed as dist
from tinytrain import trace
from tinytrain.autograd import Function
from tinytrain.backend import is_low_precision, xp
from tinytrain.distributed.chunks import ring_neighbours
from assignments.a7_context_parallel.merge import block_attention, block_gradients, merge_partials
from assignments.a7_context_parallel.split import block_pairs, chunk_ids

TAG_KV, TAG_DKV = 71, 72  # user p2p tags: the blocks, and the dK/dV accumulators (both in flight at once)


def pass_on(buf, group, tag: int):
    """Post: send ``buf`` to the next rank of the ring, receive its twin from the previous one.

    Returns ``(incoming, works)``: the buffer being filled and the two handles (``wait_all``)."""
    right, left = ring_neighbours(dist.get_rank(group), dist.get_world_size(group))
    incoming = xp.empty_like(buf)
    works = [
        dist.irecv(incoming, left, group=group, tag=tag),
        dist.isend(buf, right, group=group, tag=tag),
    ]
    return incoming, works


def wait_all(works) -> None:
    for w in works:
        w.wait()


def chunks(x, count: int) -> list:
    """``count`` equal views of ``x`` along the sequence axis (-2)."""
    c = x.shape[-2] // count
    return [x[..., i * c : (i + 1) * c, :] for i in range(count)]


def compute_span(step: int, src: int, which: str):
    return trace.span("ring attention", cat="compute", step=step, src=src, **{"pass": which})


class RingAttention(Function):
    """Causal attention of my queries over the whole sequence's keys, K/V passed around ``group``.

    q, k, v: (B, H, T/N, D) at my positions of ``split``; returns (B, H, T/N, D).
    """

    @staticmethod
    def forward(ctx, q, k, v, group=None, split="zigzag", scale=None):
        scale = q.dtype.type(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
        out, lse = ring_forward(q, k, v, group, split, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.split, ctx.scale = group, split, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved
        return ring_backward(q, k, v, out, lse, grad, ctx.group, ctx.split, ctx.scale)


def ring_forward(q, k, v, group, split, scale):
    """``(out, lse)`` of my queries over every rank's keys: N steps around the ring."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    m = len(chunk_ids(r, n, split))  # chunks I hold (and every rank holds)
    raise NotImplementedError("TODO 7.2: Every query piece's exact attention over the keys it may see; the next key/value block is already in flight while the current one is computed, and causally useless blocks are skipped.")


def ring_backward(q, k, v, out, lse, grad, group, split, scale):
    """``(dq, dk, dv)``: K/V around the ring again, dK/dV accumulators with them, home after N hops."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    m = len(chunk_ids(r, n, split))
    raise NotImplementedError("TODO 7.3: Every rank ends with the exact gradients of its own queries, keys and values; key/value gradients travel the ring with their blocks, and the messages overlap the compute.")


def ring_attention(q, k, v, group=None, split="zigzag", scale=None):
    """Ring attention over the context-parallel ``group`` (Tensors (B, H, T/N, D) at my positions).

    ``--precision bf16|fp16``: K/V (and their gradients) travel in the low precision, the blocks are
    computed in float32 (scores, softmax and the merge are where fp16 overflows): q is cast up, so
    every product with it is a float32 one, and the output is rounded back once."""
    if not is_low_precision(q.dtype):
        return RingAttention.apply(q, k, v, group=group, split=split, scale=scale)
    out = RingAttention.apply(q.astype(xp.float32), k, v, group=group, split=split, scale=scale)
    return out.astype(q.dtype)


def ring_bytes(q_shape, itemsize: int, n: int) -> tuple[int, int]:
    """Bytes each rank sends in one attention layer, (forward, backward): see the module docstring."""
    kv = 2 * math.prod(q_shape) * itemsize
    return (n - 1) * kv, (2 * n - 1) * kv
