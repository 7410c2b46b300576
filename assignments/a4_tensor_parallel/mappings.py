# Assignment 4: Tensor and sequence parallel (handout: assignments/a4_tensor_parallel.md).
# Generated from tinytrain/parallel/tensor_parallel/mappings.py by `python -m grader stubs`. Replace each
# `raise NotImplementedError("TODO ...")` with your code; grade it with `python -m grader`.

"""Region mappings: where activations enter and leave a tensor-parallel region, as autograd Functions.

A parallel region is code where each of the t ranks of the TP group works on its own shard of the
weights. Its edges are the only places ranks talk, and each edge is a pair of collectives: one in
the forward pass and its transpose in the backward pass. (x: (B, T, C); t ranks; r: my rank.)

Tensor parallel (activations between regions are whole and the same on every rank); what each
rank holds after the forward (the backwards are tasks 4.1 and 4.5: derive them)::

    CopyToRegion       x ─► x                  the same tensor, entering the region
    ReduceFromRegion   y_r ─► Σ_r y_r          the sum of the t partial outputs
    GatherFromRegion   (..,C/t) ─► (..,C)      every rank's columns, in rank order
    ScatterToRegion    (..,C) ─► (..,C/t)      my columns only

Sequence parallel (between regions each rank holds a sequence shard x_r: (B, T/t, C))::

    GatherFromSequenceRegion       (B,T/t,C) ─► (B,T,C)            every rank's positions, in order
    ReduceScatterToSequenceRegion  (B,T,C) partial ─► (B,T/t,C)    my positions of the sum
    ScatterToSequenceRegion        (B,T,C) ─► (B,T/t,C)            my positions only

Why an all-reduce splits into these two: an all-reduce *is* a reduce-scatter followed by an
all-gather, so SP moves the same bytes, 2·(t-1)/t·B·T·C·4 per all-reduce (ring), and keeps the
work between regions (LayerNorm, dropout, residual add) on 1/t of the tokens.

Our collectives (``tinytrain.distributed``) work along axis 0; the helpers below move the split
axis to the front and back, and never change an array that autograd still holds.
"""

from __future__ import annotations

from tinytrain import distributed as dist
from tinytrain.autograd import Function
from tinytrain.backend import xp

# --- collectives along an axis -------------------------------------------------------------------


def all_reduce_copy(arr, group):
    """The sum over the group of ``arr``, in a new array (ring: the textbook 2(t-1)/t bytes)."""
    out = xp.ascontiguousarray(arr).copy()  # never change an array autograd still holds
    return dist.all_reduce(out, group=group, algo="ring")


def all_gather_along(arr, axis, group):
    """The group's pieces concatenated along ``axis`` (in rank order)."""
    front = xp.ascontiguousarray(xp.moveaxis(arr, axis, 0))
    return xp.moveaxis(dist.all_gather(front, group=group), 0, axis)


def reduce_scatter_along(arr, axis, group):
    """My piece along ``axis`` of the sum over the group."""
    front = xp.ascontiguousarray(xp.moveaxis(arr, axis, 0))
    return xp.moveaxis(dist.reduce_scatter(front, group=group), 0, axis)


def my_piece(arr, axis, group):
    """My rank's 1/t of ``arr`` along ``axis``, contiguous."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    size = arr.shape[axis] // n
    index = [slice(None)] * arr.ndim
    index[axis] = slice(r * size, (r + 1) * size)
    return xp.ascontiguousarray(arr[tuple(index)])


# --- 4.1 tensor-parallel regions -----------------------------------------------------------------


class CopyToRegion(Function):
    """Enter a tensor-parallel region (Megatron's f): the same tensor on every rank goes in as it is."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("TODO 4.1: Entering the region changes nothing on the way in; keep what the way back needs.")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("TODO 4.1: The gradient of this function's input from the gradient of its output, derived from what the forward did (the handout asks), sending no more than that needs.")


class ReduceFromRegion(Function):
    """Leave a row-parallel region (Megatron's g): every rank leaves with the sum of the t partial outputs."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("TODO 4.1: Every rank leaves the region with the total of the t partial outputs, without touching an array autograd still holds.")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("TODO 4.1: The gradient of this function's input from the gradient of its output, derived from what the forward did (the handout asks), sending no more than that needs.")


class GatherFromRegion(Function):
    """Column outputs to a whole tensor: every rank's columns side by side, in rank order."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("TODO 4.1: Assemble the full feature dimension from every rank's columns, in rank order, and keep what the way back needs.")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("TODO 4.1: The gradient of this function's input from the gradient of its output, derived from what the forward did (the handout asks), sending no more than that needs.")


class ScatterToRegion(Function):
    """Whole tensor (the same on every rank) to my piece of the last axis."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("TODO 4.1: Each rank goes on with only its own block of the features; keep what the way back needs.")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("TODO 4.1: The gradient of this function's input from the gradient of its output, derived from what the forward did (the handout asks), sending no more than that needs.")


# --- 4.5 sequence-parallel regions -----------------------------------------------------------------


class GatherFromSequenceRegion(Function):
    """SP: sequence shards (B, T/t, C) to the whole sequence (B, T, C), positions in order."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("TODO 4.5: From sequence shards to the whole sequence on every rank, in position order; keep what the way back needs.")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("TODO 4.5: The gradient of this function's input from the gradient of its output, derived from what the forward did (the handout asks), sending no more than that needs.")


class ReduceScatterToSequenceRegion(Function):
    """SP: partial sums (B, T, C) to my positions of their total (B, T/t, C)."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("TODO 4.5: The partial outputs are summed and each rank keeps only its own positions of the total; keep what the way back needs.")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("TODO 4.5: The gradient of this function's input from the gradient of its output, derived from what the forward did (the handout asks), sending no more than that needs.")


class ScatterToSequenceRegion(Function):
    """SP, after the embedding (the same on every rank): keep my sequence shard (B, T/t, C)."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("TODO 4.5: Each rank goes on with only its own positions of the sequence; keep what the way back needs.")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("TODO 4.5: The gradient of this function's input from the gradient of its output, derived from what the forward did (the handout asks), sending no more than that needs.")
