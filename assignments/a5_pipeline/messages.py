# Assignment 5: Pipeline parallel (handout: assignments/a5_pipeline.md).
# Generated from tinytrain/parallel/pipeline/messages.py by `python -m grader stubs`. Replace each
# `raise NotImplementedError("TODO ...")` with your code; grade it with `python -m grader`.

"""Messages between stages, with autograd: activations go forward, their gradients come back.

Chunk c of stage s is *virtual stage* ``k = c·p + s``; virtual stage k receives its input from
k-1 and sends its output to k+1 (ranks ``(k±1) mod p`` of the pipeline group):

    stage s-1                      stage s                          stage s+1
       F: ── activation ──► recv, make it a leaf ─ blocks ─ send ──► ...
       B: ◄── leaf.grad ─── send     backward(received grad) ◄── recv ◄── ...

The received activation is a fresh autograd *leaf*: backward inside the stage stops there, and
its ``.grad`` is exactly the gradient the previous stage needs. That one idea is all the autograd
a pipeline needs. Sends are non-blocking (the executor waits for their handles at the end of the
step), so two stages sending to each other at once cannot deadlock; receives block.

Every message has its own tag, so messages can never be confused: ``TIED_TAG`` for the gradient
of a weight tied between the first and last stage (``stage.py``), and one tag per (micro-batch,
stage boundary, direction) for activations and their gradients (``message_tag``).

With tensor parallelism inside each stage (``--pp P --tp T``) every TP rank of a stage runs the
same actions on its shards, and the activation between stages is the whole (B, T, C) tensor, the
same on every TP rank of the stage (under SP each TP rank's own (B, T/t, C) sequence shard). So
TP rank r of stage s talks to TP rank r of stage s±1 only: the pipeline group is the mesh's pp axis.
"""

from __future__ import annotations

from tinytrain import distributed as dist
from tinytrain.autograd import Tensor
from tinytrain.backend import xp

TIED_TAG = 1


def message_tag(microbatch: int, boundary: int, n_virtual: int, backward: bool) -> int:
    """A tag per (micro-batch, stage boundary, direction): messages can never be confused."""
    return 2 + 2 * (microbatch * n_virtual + boundary) + int(backward)


def send_activation(output: Tensor, dst: int, tag: int, group=None):
    """Forward: hand this stage's output to the next stage (non-blocking; keep the handle)."""
    raise NotImplementedError("TODO 5.1: Start handing this stage's activation to the next stage without blocking; the caller waits later on what you return.")


def recv_activation(shape, dtype, src: int, tag: int, group=None) -> Tensor:
    """Forward: receive the previous stage's output as a new autograd leaf that wants a gradient."""
    raise NotImplementedError("TODO 5.1: The previous stage's activation arrives into new memory and becomes a fresh leaf of this stage's graph, one that collects a gradient.")


def send_gradient(received: Tensor, dst: int, tag: int, group=None):
    """Backward: after backward reached the received leaf, its .grad goes to the previous stage."""
    raise NotImplementedError("TODO 5.1: Once backward has reached the leaf, start handing its gradient, d(loss)/d(previous stage's activation), back upstream without blocking.")


def recv_gradient(output: Tensor, src: int, tag: int, group=None):
    """Backward: receive d(loss)/d(output) from the next stage, shaped like this stage's output."""
    raise NotImplementedError("TODO 5.1: Wait for the next stage's gradient of this stage's activation, in an array of the same shape and type.")
