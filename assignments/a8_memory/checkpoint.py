# Assignment 8: Memory (handout: assignments/a8_memory.md).
# Generated from tinytrain/autograd/checkpoint.py by `python -m grader stubs`. Replace each
# `raise NotImplementedError("TODO ...")` with your code; grade it with `python -m grader`.

"""Activation recomputation: keep a segment's inputs, drop its graph, run it again in backward.

``y = checkpoint(fn, x)`` computes ``fn(x)`` like a plain call, but as one step of the graph that
keeps only what it needs to run ``fn`` again::

    forward                                         between forward and backward
      x ──► [ fn(x) without a graph ] ──► y           kept:    x, and the random settings in effect
            (its ops save nothing)                             (seed, batch rows, sequence positions)
                                                      dropped: every array fn's ops would have
                                                               saved (activations of the segment)
    backward, when d(loss)/dy arrives
      x ──► [ fn(x) again, with a graph ] ──► y'      the same numbers as y: same inputs, same
              (the same dropout masks)                parameters, the same masks (below)
      dy ──► backward through y' ──► dx               returned to the outer graph
                                 └─► dW               into each parameter's .grad, its hooks firing
                                                      (data-parallel overlap starts here); then the
                                                      recomputed graph is freed: one segment's graph
                                                      exists at a time

The cost is one more forward of ``fn``; the saving is everything ``fn``'s ops keep for backward
but ``x`` (``saved_bytes()`` counts both, the engine's own measure). A transformer block kept this
way holds one (B, T, C) array instead of all of its activations (``--recompute full``); the
attention core alone (``--recompute selective``) drops the (B, H, T, T) probabilities, which grow
with the square of the sequence, for a recompute of a few matrix products.

Same numbers, bit for bit: the recompute runs the same ops on the same arrays, and its backward
is the backward the segment would have had in the whole graph (the same order of every sum inside
it). Dropout gives the same masks because a site's mask is a pure function of (seed, site, batch
rows, sequence positions) (``tinytrain.random``); the segment keeps those settings from its forward
and restores them for the recompute (a pipeline runs a micro-batch's backward outside its
forward's ``batch_rows``). A dropout without a site, or with a generator of its own, would draw
from a generator that has moved on: it is refused inside a segment (``random.in_segment``).

- ``fn`` returns a Tensor or a tuple of Tensors (``checkpoint`` returns the same); its arguments
  are ``inputs``: Tensors (a recompute gets fresh leaves holding the same arrays, and hands their
  gradients back) and constants (token ids, options), kept as they are.
- ``context(phase)``, if given, is a context manager entered around the forward (``"forward"``)
  and around the recompute and its backward (``"backward"``): ZeRO-3 gathers a layer's parameters
  there (``parallel/zero_parts.ShardedUnit`` is this function with that context).
- Without grad mode (evaluation) ``fn`` simply runs: there is no backward to prepare for.

The limit: a parameter used inside a segment gets its gradient, and its hooks fire, in the
recompute's own backward. Used outside the segment too, it is finished once there and once in the
outer graph: the sum in ``.grad`` is right, but its post-accumulate hooks fire twice per backward.
Code that counts uses allows it (ZeRO-3 counts the units of a tied weight); a data-parallel
bucket refuses it (a gradient "ready twice"). So keep a segment's parameters its own: a
transformer block's are.
"""

from __future__ import annotations

import contextlib

from tinytrain import random as _random
from tinytrain.autograd.engine import Function, backward, enable_grad, is_grad_enabled, no_grad
from tinytrain.autograd.tensor import Tensor
from tinytrain.backend import xp

# Requires grad, so that the engine records every checkpoint, also one whose only inputs are token
# ids (an embedding's parameters still need the recompute's backward).
_ANCHOR = Tensor(xp.zeros(0, dtype=xp.float32), requires_grad=True)
_NO_GRAD = xp.zeros(0, dtype=xp.float32)  # what an output hands the segment: "a gradient came"


def checkpoint(fn, *inputs, context=None):
    """``fn(*inputs)``, with its activations recomputed in backward instead of kept (module doc)."""
    enter = context if context is not None else _no_context
    if not is_grad_enabled():
        with enter("forward"):
            return fn(*inputs)
    segment = _Segment(fn, enter)
    handle = _Recompute.apply(_ANCHOR, *inputs, segment=segment)
    outputs = tuple(
        _Output.apply(handle, value=value, segment=segment, index=i) for i, value in enumerate(segment.values)
    )
    segment.values = None  # the outputs hold them now, for as long as the caller does
    return outputs if segment.is_tuple else outputs[0]


def _no_context(phase: str):
    return contextlib.nullcontext()


class _Segment:
    """What a checkpoint remembers between its forward and its backward, besides its inputs."""

    def __init__(self, fn, enter):
        self.fn, self.enter = fn, enter
        self.random = _random.snapshot()  # the settings this forward's dropout masks follow
        self.values = ()  # the forward's output arrays, until the outputs take them
        self.is_tuple = False
        self.grads: dict = {}  # output index -> d(loss)/d(output), as the outputs' backward hands them

    def run(self, ctx, arrays, grad: bool):
        """``fn`` on ``arrays``: a Tensor argument as a new Tensor (a leaf that requires grad where the
        argument did, in the recompute), a constant as it is."""
        raise NotImplementedError("TODO 8.1: The segment's result from tensors over the same arrays that ask for gradients exactly where the originals do; returns (arguments used, result, outputs), and refuses an output that is not a tensor.")


class _Recompute(Function):
    """The segment as one step of the graph; its output is an empty handle the real outputs hang on."""

    # Its backward is the whole segment's (weights included) in one inner backward: a split
    # backward (engine.backward_inputs) runs it whole in B, so its weight gradients come with B.
    split_backward = False

    @staticmethod
    def forward(ctx, anchor, *arrays, segment):
        raise NotImplementedError("TODO 8.1: The outputs' values, with nothing kept but the inputs: no graph of the segment outlives the forward.")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("TODO 8.1: One gradient per forward input, the same as the segment's own graph would give, from a recomputation that draws the same random numbers.")


class _Output(Function):
    """Output ``index`` of a segment, made from the segment's handle: the engine runs its backward
    before the segment's (a tensor's backward comes before those of the tensors it was made from),
    so it hands its gradient over first. The handle's gradient is empty: it only says "one came"."""

    @staticmethod
    def forward(ctx, handle, *, value, segment, index):
        ctx.segment, ctx.index = segment, index
        return value

    @staticmethod
    def backward(ctx, grad):
        ctx.segment.grads[ctx.index] = grad
        return _NO_GRAD


class _Join(Function):
    """A scalar made from several outputs, whose backward hands each its given gradient: one
    backward through all of a recompute's outputs at once."""

    @staticmethod
    def forward(ctx, *arrays, grads):
        ctx.grads = tuple(grads)
        return xp.zeros((), dtype=xp.float32)

    @staticmethod
    def backward(ctx, grad):
        return ctx.grads
