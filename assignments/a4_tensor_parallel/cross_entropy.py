# Assignment 4: Tensor and sequence parallel (handout: assignments/a4_tensor_parallel.md).
# Generated from tinytrain/parallel/tensor_parallel/cross_entropy.py by `python -m grader stubs`. Replace each
# `raise NotImplementedError("TODO ...")` with your code; grade it with `python -m grader`.

"""Vocab-parallel cross-entropy: the loss of logits split along the vocabulary, never gathered.

The tied head is column-parallel, so rank r holds the logits of its vocabulary slice only::

    rank r:  logits_r (N, V/t) = columns [r·V/t, (r+1)·V/t) of the full (N, V) logits

    loss_i = log Σ_v exp(z_iv) − z_i,target      (over all V columns, which no rank holds)

The forward talks in all-reduces of N numbers (one number per row), never in N·V logits; the
backward is the serial loss's gradient (``ops.nll_grad``) on this rank's columns, with no talk.
Which N numbers, and why they are enough: assignment 4's handout, section 4. Not gathering the
logits is why Megatron fuses the loss into the vocabulary split: with a real vocabulary (50k)
they are the largest tensor of the step.
"""

from __future__ import annotations

from tinytrain import distributed as dist
from tinytrain.autograd import Function, Tensor, ops
from tinytrain.backend import is_low_precision, xp

# --- 4.4 vocab-parallel cross-entropy --------------------------------------------------------------


class VocabParallelCrossEntropy(Function):
    """Cross-entropy of logits split along the vocabulary, without building the full logits.

    logits_r (N, V/t) on rank r, targets (N,) global ids; the mean over non-ignored positions (or
    the sum over ``denominator``), the same scalar on every rank of ``group``.
    """

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, ignore_index=-100, denominator=None):
        raise NotImplementedError("TODO 4.4: The serial mean loss over the non-ignored positions, exact and stable, without any rank building the full scores; keep what backward needs.")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("TODO 4.4: This rank's columns of the serial loss's gradient, with no communication.")


def vocab_parallel_cross_entropy(logits, targets, group, vocab_start, ignore_index=-100, denominator=None):
    """Mean NLL of ``targets`` (over the non-ignored ones, or divided by ``denominator``)."""
    targets = xp.asarray(targets.data if isinstance(targets, Tensor) else targets)
    if is_low_precision(logits.dtype):  # --precision bf16|fp16: the loss is a statistic, taken in float32
        logits = logits.astype(xp.float32)
    return VocabParallelCrossEntropy.apply(
        logits, targets, group=group, vocab_start=vocab_start, ignore_index=ignore_index, denominator=denominator
    )
