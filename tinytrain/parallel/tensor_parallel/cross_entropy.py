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
        # BEGIN SOLUTION 4.4 "The serial mean loss over the non-ignored positions, exact and stable, without any rank building the full scores; keep what backward needs." full="all_reduce max of row maxes, all_reduce sum of exp, all_reduce the target logit; keep probs for backward."
        flat = logits.reshape(-1, logits.shape[-1])
        tgt = targets.reshape(-1)
        valid = tgt != ignore_index
        row_max = flat.max(axis=-1)
        dist.all_reduce(row_max, op="max", group=group, algo="ring")
        probs = xp.exp(flat - row_max[:, None])
        total = dist.all_reduce(probs.sum(axis=-1), group=group, algo="ring")
        probs /= total[:, None]
        local = tgt - vocab_start
        mine = valid & (local >= 0) & (local < flat.shape[-1])
        local = xp.where(mine, local, 0)
        rows = xp.arange(flat.shape[0])
        picked = xp.where(mine, flat[rows, local], 0).astype(flat.dtype)
        target_logit = dist.all_reduce(picked, group=group, algo="ring")
        nll = (xp.log(total) + row_max - target_logit) * valid
        ctx.denom = float(valid.sum()) if denominator is None else float(denominator)
        ctx.save_for_backward(probs, local, mine, valid)
        ctx.logits_shape = logits.shape
        return xp.asarray(nll.sum() / ctx.denom, dtype=logits.dtype)
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION 4.4 "This rank's columns of the serial loss's gradient, with no communication." full="ops.nll_grad(probs, local target column, mine, valid · grad / denom); no talk."
        probs, local, mine, valid = ctx.saved
        g = ops.nll_grad(probs, local, mine, valid * (grad / ctx.denom))
        return g.reshape(ctx.logits_shape), None, None, None, None, None
        # END SOLUTION


def vocab_parallel_cross_entropy(logits, targets, group, vocab_start, ignore_index=-100, denominator=None):
    """Mean NLL of ``targets`` (over the non-ignored ones, or divided by ``denominator``)."""
    targets = xp.asarray(targets.data if isinstance(targets, Tensor) else targets)
    if is_low_precision(logits.dtype):  # --precision bf16|fp16: the loss is a statistic, taken in float32
        logits = logits.astype(xp.float32)
    return VocabParallelCrossEntropy.apply(
        logits, targets, group=group, vocab_start=vocab_start, ignore_index=ignore_index, denominator=denominator
    )
