"""Gradient checks for matmul, reductions, and shape/indexing operations."""

import numpy as np
import pytest

import tinytrain.functional as F
from tinytrain.autograd import Tensor
from tinytrain.testing import assert_close, gradcheck


def T(a, grad=True):
    return Tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


def rand_shape(rng, ndim, lo=1, hi=4):
    return tuple(int(n) for n in rng.integers(lo, hi + 1, size=ndim))


# --- matmul ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["2d", "batched", "broadcast_batch", "nd_at_2d", "2d_at_nd"])
def test_matmul(rng, kind):
    n, k, m, b, c = (int(v) for v in rng.integers(1, 4, size=5))
    sa, sb = {
        "2d": ((n, k), (k, m)),
        "batched": ((b, n, k), (b, k, m)),
        "broadcast_batch": ((b, 1, n, k), (c, k, m)),  # batch axes (b, 1) with (c,) -> (b, c)
        "nd_at_2d": ((b, c, n, k), (k, m)),
        "2d_at_nd": ((n, k), (b, k, m)),
    }[kind]
    a, w = T(rng.standard_normal(sa)), T(rng.standard_normal(sb))
    assert_close(a @ w, np.matmul(a.data, w.data), what="matmul forward")
    gradcheck(lambda x, y: x @ y, [a, w], what=f"{sa} @ {sb}")
    gradcheck(F.matmul, [a, w], what=f"F.matmul {sa} @ {sb}")


def test_matmul_rejects_vectors():
    with pytest.raises(ValueError, match="at least 2 axes"):
        T(np.ones(3)) @ T(np.ones((3, 2)))


# --- reductions -----------------------------------------------------------------------------

AXES = [None, 0, -1, 1, (0, 2), (-1, 0), (0, 1, 2)]


@pytest.mark.parametrize("reduction", ["sum", "mean", "max", "var", "var1"])
@pytest.mark.parametrize("axis", AXES, ids=str)
@pytest.mark.parametrize("keepdims", [False, True])
def test_reductions(rng, reduction, axis, keepdims):
    shape = rand_shape(rng, 3, lo=2, hi=3)
    x = T(rng.standard_normal(shape))  # distinct values, so max has no ties
    if reduction == "var1":
        fn = lambda t: t.var(axis=axis, keepdims=keepdims, correction=1)  # noqa: E731
        expected = np.var(x.data, axis=axis, keepdims=keepdims, ddof=1)
    else:
        fn = lambda t: getattr(t, reduction)(axis=axis, keepdims=keepdims)  # noqa: E731
        expected = getattr(np, reduction)(x.data, axis=axis, keepdims=keepdims)
    out = fn(x)
    assert out.shape == np.shape(expected) and out.dtype == np.float64
    assert_close(out, expected, atol=1e-12, what=f"{reduction} forward")
    gradcheck(fn, [x], what=f"{reduction}(axis={axis}, keepdims={keepdims})")


def test_max_ties_share_the_gradient():
    x = T([[1.0, 3.0, 3.0], [2.0, 0.0, 2.0]])
    x.max(axis=1).sum().backward()
    assert_close(x.grad, [[0, 0.5, 0.5], [0.5, 0, 0.5]], atol=0, what="tied max gradient")


def test_var_too_few_elements():
    with pytest.raises(ValueError, match="correction"):
        T(np.ones((3, 1))).var(axis=1, correction=1)


# --- shape ----------------------------------------------------------------------------------


def test_reshape(rng):
    shape = rand_shape(rng, 3)
    n = int(np.prod(shape))
    x = T(rng.standard_normal(shape))
    gradcheck(lambda t: t.reshape(n), [x], what="flatten")
    gradcheck(lambda t: t.reshape(-1, shape[-1]) * np.arange(shape[-1]), [x], what="reshape -1")
    gradcheck(lambda t: t.reshape((shape[2], shape[0] * shape[1])), [x], what="reshape tuple")


def test_transpose_and_permute(rng):
    x = T(rng.standard_normal(rand_shape(rng, 3, lo=2)))
    order = tuple(int(i) for i in rng.permutation(3))
    assert_close(x.permute(*order), np.transpose(x.data, order), atol=0, what="permute forward")
    gradcheck(lambda t: t.permute(*order), [x], what=f"permute {order}")
    gradcheck(lambda t: t.permute(order), [x], what="permute tuple")
    gradcheck(lambda t: t.transpose(), [x], what="transpose last two")
    gradcheck(lambda t: t.transpose(0, 2), [x], what="transpose(0, 2)")
    gradcheck(lambda t: t.T, [x], what=".T")
    gradcheck(lambda t: t.permute(-1, 0, 1), [x], what="negative axes")


def test_getitem_slices(rng):
    x = T(rng.standard_normal(rand_shape(rng, 3, lo=3, hi=5)))
    for index in [
        1,
        -1,
        (slice(None), 0),
        (slice(1, None), slice(None, None, 2)),
        (Ellipsis, slice(None, None, -1)),
        (None, 0, slice(0, 2)),
        np.int64(1),
    ]:
        assert_close(x[index], x.data[index], atol=0, what=f"x[{index}] forward")
        gradcheck(lambda t: t[index], [x], what=f"x[{index}]")


def test_getitem_integer_arrays_with_repeats(rng):
    rows, cols = int(rng.integers(2, 5)), int(rng.integers(2, 5))
    x = T(rng.standard_normal((rows, cols)))
    idx = rng.integers(0, rows, size=6)
    idx[1] = idx[0]  # at least one repeat: its gradient must be added twice
    gradcheck(lambda t: t[idx], [x], what=f"x[{idx}]")
    gradcheck(lambda t: t[list(idx)], [x], what="list index")
    gradcheck(lambda t: t[Tensor(idx)], [x], what="Tensor index")
    col = rng.integers(0, cols, size=6)
    gradcheck(lambda t: t[idx, col], [x], what="x[rows, cols] pairs")
    gradcheck(lambda t: t[1:, col], [x], what="slice and array")
    # repeated index: the gradient there is the sum of both uses
    y = T(np.arange(3.0))
    y[np.array([0, 0, 2])].sum().backward()
    assert_close(y.grad, [2.0, 0.0, 1.0], atol=0, what="repeated-index gradient")


def test_getitem_boolean_mask(rng):
    x = T(rng.standard_normal(rand_shape(rng, 2, lo=2)))
    mask = rng.random(x.shape) < 0.5
    mask.flat[0] = True
    assert_close(x[mask], x.data[mask], atol=0, what="x[mask] forward")
    gradcheck(lambda t: t[mask], [x], what="x[mask]")
    rows = rng.random(x.shape[0]) < 0.5
    rows[0] = True
    gradcheck(lambda t: t[rows], [x], what="x[row mask]")


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concatenate(rng, axis):
    base = rand_shape(rng, 3)
    parts = []
    for _ in range(int(rng.integers(2, 4))):
        shape = list(base)
        shape[axis] = int(rng.integers(1, 4))
        parts.append(T(rng.standard_normal(shape)))
    out = F.concatenate(parts, axis=axis)
    assert_close(out, np.concatenate([p.data for p in parts], axis=axis), atol=0, what="concat forward")
    gradcheck(lambda *ps: F.concatenate(ps, axis=axis), parts, what=f"concatenate axis={axis}")
    # a part that does not require grad is passed over
    frozen = [parts[0], Tensor(parts[1].data)] + parts[2:]
    gradcheck(lambda *ps: F.concatenate(ps, axis=axis), frozen, what="concatenate with a constant")


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_stack(rng, axis):
    shape = rand_shape(rng, 2)
    parts = [T(rng.standard_normal(shape)) for _ in range(int(rng.integers(2, 4)))]
    out = F.stack(parts, axis=axis)
    assert_close(out, np.stack([p.data for p in parts], axis=axis), atol=0, what="stack forward")
    gradcheck(lambda *ps: F.stack(ps, axis=axis), parts, what=f"stack axis={axis}")


def test_split_and_chunk(rng):
    shape = (int(rng.integers(3, 7)), int(rng.integers(2, 4)))
    x = T(rng.standard_normal(shape))
    n = shape[0]
    pieces = F.split(x, 2)
    assert [p.shape[0] for p in pieces] == [min(2, n - s) for s in range(0, n, 2)]
    gradcheck(lambda t: F.split(t, 2), [x], what="split size 2")
    sizes = [1, n - 1]
    gradcheck(lambda t: t.split(sizes), [x], what=f"split sizes {sizes}")
    gradcheck(lambda t: t.split(1, axis=1), [x], what="split axis 1")
    gradcheck(lambda t: t.chunk(2), [x], what="chunk 2")
    gradcheck(lambda t: F.chunk(t, 3, axis=-1), [x], what="chunk 3 axis -1")
    gradcheck(lambda t: t.split(2)[0] * 2, [x], what="only the first piece used")
    with pytest.raises(ValueError, match="add up"):
        x.split([1, 1, n])


def test_where_and_masked_fill(rng):
    shape = rand_shape(rng, 2, lo=2)
    a, b = T(rng.standard_normal(shape)), T(rng.standard_normal(shape[-1:]))  # b broadcast
    cond = rng.random(shape) < 0.5
    assert_close(F.where(cond, a, b), np.where(cond, a.numpy(), b.numpy()), atol=0, what="where forward")
    gradcheck(lambda x, y: F.where(cond, x, y), [a, b], what="where(cond, a, b broadcast)")
    gradcheck(lambda x, y: F.where(Tensor(cond), y, x), [a, b], what="where with a Tensor condition")
    gradcheck(lambda x: F.where(cond, x, 0.0), [a], what="where with a constant")
    row_mask = rng.random(shape[-1]) < 0.5  # broadcast mask
    out = a.masked_fill(row_mask, -1e9)
    assert_close(out, np.where(row_mask, -1e9, a.numpy()), atol=0, what="masked_fill forward")
    # (a fill of -1e9 would swamp the numeric derivative's float64 sum, so check with -5)
    gradcheck(lambda x: x.masked_fill(row_mask, -5.0), [a], what="masked_fill")
    gradcheck(lambda x: F.masked_fill(x, cond, 0.0), [a], what="F.masked_fill")
