"""Differentiable functions on Tensors, named like ``torch.nn.functional``.

Each is one line over a Function in ``tinytrain.autograd.ops``; read that file for the maths.
"""

from __future__ import annotations

from tinytrain import random as _random
from tinytrain.autograd import ops
from tinytrain.autograd.tensor import Tensor
from tinytrain.backend import xp


def relu(x):
    return ops.ReLU.apply(x)


def gelu(x, approximate="tanh"):
    """GELU, x·Φ(x) with Φ the standard normal CDF: ``approximate="tanh"``, GPT-2's tanh
    approximation, or ``"none"``, the exact form 0.5·x·(1 + erf(x/√2)); another value is a
    ValueError. PyTorch's ``torch.nn.functional.gelu`` defaults to "none"; ours defaults to "tanh",
    what GPT-2 (and so our GPT) uses, so that every existing caller, run and checkpoint keeps its
    numbers and curves."""
    return ops.GELU.apply(x, approximate=approximate)


def tanh(x):
    return ops.Tanh.apply(x)


def exp(x):
    return ops.Exp.apply(x)


def log(x):
    return ops.Log.apply(x)


def sqrt(x):
    return ops.Sqrt.apply(x)


def softmax(x, axis=-1):
    return ops.Softmax.apply(x, axis=axis)


def log_softmax(x, axis=-1):
    return ops.LogSoftmax.apply(x, axis=axis)


def cross_entropy(logits, targets, ignore_index=-100, reduction="mean"):
    """Softmax cross-entropy of integer targets; ``ignore_index`` entries are left out."""
    targets = targets.data if isinstance(targets, Tensor) else xp.asarray(targets)
    return ops.CrossEntropy.apply(logits, targets, ignore_index=ignore_index, reduction=reduction)


def linear(x, weight, bias=None):
    """``x @ weight + bias`` with ``weight`` of shape (in_features, out_features)."""
    return ops.Linear.apply(x, weight, bias)


def matmul(a, b):
    return ops.MatMul.apply(a, b)


def embedding(ids, weight):
    """Rows of ``weight`` (num_embeddings, dim) picked by the integer array ``ids``."""
    ids = ids.data if isinstance(ids, Tensor) else xp.asarray(ids)
    return ops.Embedding.apply(weight, ids)


def layer_norm(x, weight=None, bias=None, eps=1e-5):
    """Normalize over the last axis, then scale by ``weight`` and shift by ``bias``."""
    return ops.LayerNorm.apply(x, weight, bias, eps=eps)


def dropout(x, p=0.5, training=True, generator=None, site=None, seq_shard=None):
    """Zero entries with probability ``p`` (scaling the rest by 1/(1-p)) when ``training``.

    The mask is drawn from ``generator``; else from the site's own generator when ``site`` (the
    dropout module's name) is given; else from ``tinytrain.random``'s global generator. So a run
    with the same seed draws the same masks.

    A rank that holds a piece of the serial tensor draws the serial tensor's mask and keeps its
    piece: its rows of the global batch (``random.batch_rows``), and along the sequence axis piece r
    of n with ``seq_shard=(r, n)`` (sequence parallel) or its positions (``random.sequence_positions``,
    context parallel). Every layout sees the serial masks.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return x
    if (generator is not None or not site) and _random.in_segment():
        raise ValueError(
            "dropout inside a recomputed segment (activation recomputation) must draw from its site's "
            "generator, which gives the same mask again in backward: give the Dropout a site (a GPT names "
            "its dropouts; a module of your own: set .site), or move the dropout out of the segment "
            "(--recompute none)"
        )
    if generator is None:
        generator = _random.dropout_generator(site) if site else _random.default_generator()
    full_shape, index = list(x.shape), [slice(None)] * x.ndim
    rows = _random.current_batch_rows()
    if rows is not None:
        first, full_shape[0] = rows
        index[0] = slice(first, first + x.shape[0])
    positions = _random.current_sequence_positions()
    if seq_shard is not None and positions is not None:
        raise ValueError(
            "dropout: a tensor is cut along the sequence by sequence parallel or context parallel, not both"
        )
    if seq_shard is not None:
        r, n = seq_shard
        full_shape[1], index[1] = x.shape[1] * n, slice(r * x.shape[1], (r + 1) * x.shape[1])
    if positions is not None:
        index[1], full_shape[1] = positions
    if rows is None and seq_shard is None and positions is None:
        return ops.Dropout.apply(x, p, generator)
    return ops.Dropout.apply(x, p, generator, full_shape=tuple(full_shape), index=tuple(index))


def scaled_dot_product_attention(q, k, v, causal=True, scale=None):
    """softmax(q·kᵀ/√d [+ causal mask])·v over the last two axes, shapes (..., T, d)."""
    return ops.ScaledDotProductAttention.apply(q, k, v, causal=causal, scale=scale)


def concatenate(tensors, axis=0):
    return ops.Concatenate.apply(*tensors, axis=axis)


def stack(tensors, axis=0):
    return ops.Stack.apply(*tensors, axis=axis)


def split(x, size_or_sizes, axis=0):
    """Pieces along ``axis``: equal pieces of ``size`` (the last may be shorter) or given sizes."""
    return _tensor(x).split(size_or_sizes, axis=axis)


def chunk(x, chunks, axis=0):
    """``chunks`` pieces along ``axis`` of size ceil(n/chunks) (the last ones may be smaller)."""
    return _tensor(x).chunk(chunks, axis=axis)


def _tensor(x):
    return x if isinstance(x, Tensor) else Tensor(xp.asarray(x))


def where(condition, a, b):
    """Elementwise ``a`` where ``condition`` else ``b`` (the condition is a boolean array)."""
    condition = condition.data if isinstance(condition, Tensor) else xp.asarray(condition)
    return ops.Where.apply(condition, a, b)


def masked_fill(x, mask, value):
    """``x`` with ``value`` wherever ``mask`` is True."""
    return _tensor(x).masked_fill(mask, value)
