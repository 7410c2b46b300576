"""Gradient checks for arithmetic (with broadcasting), pow, elementwise functions and astype."""

import warnings

import numpy as np
import pytest

import tinytrain.functional as F
from tinytrain.autograd import Tensor
from tinytrain.testing import assert_close, gradcheck


def T(a, grad=True):
    return Tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


def rand_shape(rng, ndim, lo=1, hi=4):
    return tuple(int(n) for n in rng.integers(lo, hi + 1, size=ndim))


def broadcast_pair(rng, mode):
    """Two shapes that broadcast together: equal, b inside a, a inside b, or each stretching the other."""
    full = rand_shape(rng, int(rng.integers(2, 4)), lo=2, hi=4)
    if mode == "same":
        return full, full
    if mode == "mutual":  # a is 1 on one axis, b on another: both are stretched
        i, j = rng.choice(len(full), size=2, replace=False)
        a, b = list(full), list(full)
        a[i], b[j] = 1, 1
        return tuple(a), tuple(b)
    drop = int(rng.integers(0, len(full)))  # fewer leading axes, and some axes of size 1
    small = [1 if rng.random() < 0.4 else n for n in full[drop:]]
    return (full, tuple(small)) if mode == "b_inside_a" else (tuple(small), full)


def nonzero(rng, shape):
    return rng.choice([-1.0, 1.0], size=shape) * rng.uniform(0.5, 2.0, size=shape)


ARITH = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
}


@pytest.mark.parametrize("op", list(ARITH))
@pytest.mark.parametrize("mode", ["same", "b_inside_a", "a_inside_b", "mutual"])
def test_arithmetic_broadcasting(rng, op, mode):
    sa, sb = broadcast_pair(rng, mode)
    a, b = T(rng.standard_normal(sa)), T(nonzero(rng, sb))
    out = ARITH[op](a, b)
    assert out.shape == np.broadcast_shapes(sa, sb)
    assert_close(out, ARITH[op](a.data, b.data), what=f"{op} forward")
    gradcheck(ARITH[op], [a, b], what=f"{op} {sa} with {sb}")


@pytest.mark.parametrize("op", list(ARITH))
def test_arithmetic_with_constants(rng, op):
    shape = rand_shape(rng, 2)
    x = T(nonzero(rng, shape))
    c = float(rng.uniform(0.5, 2.0))
    const = nonzero(rng, shape[-1:])  # a plain array, broadcast, not differentiated
    fn = ARITH[op]
    gradcheck(lambda x: fn(x, c), [x], what=f"tensor {op} scalar")
    gradcheck(lambda x: fn(c, x), [x], what=f"scalar {op} tensor")
    gradcheck(lambda x: fn(x, const), [x], what=f"tensor {op} array")
    zero_d = T(c)  # a 0-d tensor broadcasts like a scalar and gets a 0-d gradient
    gradcheck(fn, [x, zero_d], what=f"tensor {op} 0-d tensor")
    gradcheck(fn, [zero_d, x], what=f"0-d tensor {op} tensor")


def test_numpy_operand_on_the_left(rng):
    # NumPy defers to the Tensor (no object arrays of Tensors): array op tensor is a Tensor op
    x = T(nonzero(rng, rand_shape(rng, 2)))
    const = nonzero(rng, x.shape[-1:])
    for op, fn in ARITH.items():
        out = fn(const, x)
        assert isinstance(out, Tensor) and out.dtype == np.float64, op
        gradcheck(lambda t: fn(const, t), [x], what=f"array {op} tensor")
        gradcheck(lambda t: fn(np.float64(1.5), t), [x], what=f"NumPy scalar {op} tensor")


def test_neg(rng):
    gradcheck(lambda x: -x, [T(rng.standard_normal(rand_shape(rng, 3)))])


def test_pow(rng):
    shape = rand_shape(rng, 2)
    base = T(rng.uniform(0.5, 2.0, size=shape))
    gradcheck(lambda x: x**2, [T(rng.standard_normal(shape))], what="x**2, negative bases")
    gradcheck(lambda x: x**3, [T(rng.standard_normal(shape))], what="x**3")
    gradcheck(lambda x: x**0.5, [base], what="x**0.5")
    gradcheck(lambda x: x**-1.5, [base], what="x**-1.5")
    exponent = T(rng.standard_normal(shape[-1:]))  # tensor exponent, broadcast
    gradcheck(lambda a, b: a**b, [base, exponent], what="tensor ** tensor")
    gradcheck(lambda b: 2.5**b, [exponent], what="constant ** tensor")


UNARY = {
    "exp": (lambda x: x.exp(), np.exp, "normal"),
    "log": (lambda x: x.log(), np.log, "positive"),
    "sqrt": (lambda x: x.sqrt(), np.sqrt, "positive"),
    "tanh": (lambda x: x.tanh(), np.tanh, "normal"),
    "relu": (lambda x: x.relu(), lambda a: np.maximum(a, 0), "away_from_0"),
    "gelu": (F.gelu, None, "normal"),
    "F.exp": (F.exp, np.exp, "normal"),
    "F.log": (F.log, np.log, "positive"),
    "F.sqrt": (F.sqrt, np.sqrt, "positive"),
    "F.tanh": (F.tanh, np.tanh, "normal"),
    "F.relu": (F.relu, lambda a: np.maximum(a, 0), "away_from_0"),
}


@pytest.mark.parametrize("name", list(UNARY))
def test_unary(rng, name):
    fn, reference, kind = UNARY[name]
    shape = rand_shape(rng, int(rng.integers(1, 4)))
    if kind == "positive":
        data = rng.uniform(0.3, 3.0, size=shape)
    elif kind == "away_from_0":  # relu's kink at 0 has no derivative
        data = nonzero(rng, shape) * rng.uniform(0.05, 1.0, size=shape)
    else:
        data = rng.standard_normal(shape) * 2
    x = T(data)
    if reference is not None:
        assert_close(fn(x), reference(data), what=f"{name} forward")
    gradcheck(fn, [x], what=name)


def test_gelu_matches_formula(rng):
    x = rng.standard_normal(50) * 4
    expected = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
    assert_close(F.gelu(T(x)), expected, atol=1e-12, rtol=1e-12, what="gelu float64")
    assert_close(F.gelu(Tensor(x.astype(np.float32))), expected, atol=1e-5, what="gelu float32")


def test_gelu_backward_matches_the_tanh_form_and_survives_large_inputs(rng):
    """GELU is computed as x·sigmoid(2u); its backward must equal the derivative of the tanh form
    0.5·x·(1 + tanh(u)) (written out here by hand), and very negative inputs, where exp(-2u)
    would overflow float32, must give finite values without a warning."""
    x = np.concatenate([rng.standard_normal(40) * 4, [-60.0, -20.0, 0.0, 20.0, 60.0]])
    c, a = np.sqrt(2 / np.pi), 0.044715
    t = np.tanh(c * (x + a * x**3))
    expected = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * a * x * x)
    xt = T(x)
    F.gelu(xt).sum().backward()
    assert_close(xt.grad, expected, atol=1e-12, rtol=1e-10, what="gelu backward float64")
    x32 = Tensor(x.astype(np.float32), requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an overflow in exp would be a RuntimeWarning
        y = F.gelu(x32)
        y.sum().backward()
    assert np.isfinite(y.numpy()).all() and np.isfinite(x32.grad).all()
    assert_close(y, 0.5 * x * (1 + t), atol=1e-5, what="gelu float32 at large |x|")
    assert_close(x32.grad, expected, atol=1e-5, what="gelu backward float32 at large |x|")


def test_astype(rng):
    data = rng.standard_normal(rand_shape(rng, 2))
    gradcheck(lambda x: x.astype(np.float64) * 3, [T(data)], what="astype float64")
    # float32 -> float64 -> back: the gradient comes back in the input's dtype
    x = Tensor(data.astype(np.float32), requires_grad=True)
    y = x.astype("float64")
    assert y.dtype == np.float64
    w = rng.standard_normal(data.shape)
    y.backward(w)
    assert x.grad.dtype == np.float32
    assert_close(x.grad, w.astype(np.float32), atol=0, rtol=0, what="astype gradient")
    # float64 -> float32 (lower precision: a coarse numeric step and tolerance)
    gradcheck(lambda x: x.astype(np.float32), [T(data)], eps=1e-2, atol=1e-3, rtol=1e-3, what="astype float32")
