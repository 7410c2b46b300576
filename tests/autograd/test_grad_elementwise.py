"""Gradient checks for arithmetic (with broadcasting), pow, elementwise functions and astype."""

import math
import warnings

import numpy as np
import pytest

import tinytrain.functional as F
from tinytrain.autograd import Tensor, ops
from tinytrain.backend import to_host, xp
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
    "gelu exact": (lambda x: F.gelu(x, approximate="none"), None, "normal"),
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
    assert_close(F.gelu(T(x), approximate="tanh"), expected, atol=1e-12, rtol=1e-12, what="tanh: the default")
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


def test_erf_matches_math_erf_to_float64_rounding():
    """ops._erf (Cody's rational approximations) against the C library's erf and erfc: on a dense
    grid of [-30, 30], tiny values down to 1e-300, and both sides of each boundary between its
    pieces (|x| = 0.5, 4). erf within 1e-15 relative (measured: 4.5e-16), erfc within 2e-15 (its
    tail too, down to where it underflows; measured: 8.9e-16), float32 to float32's rounding."""
    tiny = np.geomspace(1e-300, 30, 2001)
    edges = [b for edge in (0.5, 4.0) for b in (np.nextafter(edge, 0), edge, np.nextafter(edge, 9))]
    x = np.concatenate([np.linspace(-30, 30, 120001), tiny, -tiny, edges, np.negative(edges)])
    expected_erf = np.array([math.erf(v) for v in x])
    expected_erfc = np.array([math.erfc(v) for v in x])
    assert_close(ops._erf(xp.asarray(x)), expected_erf, atol=0, rtol=1e-15, what="erf float64")
    # erfc's denormal tail (x > 26.5) has only a few bits: there an absolute 1e-320
    assert_close(ops._erf(xp.asarray(x), complement=True), expected_erfc, atol=1e-320, rtol=2e-15, what="erfc float64")
    x32 = x.astype(np.float32)
    erf32, erfc32 = (ops._erf(xp.asarray(x32), complement=c) for c in (False, True))
    assert erf32.dtype == erfc32.dtype == np.float32
    exact = x32.astype(np.float64)
    assert_close(erf32, [math.erf(v) for v in exact], atol=1e-44, rtol=1e-6, what="erf float32")
    assert_close(erfc32, [math.erfc(v) for v in exact], atol=1e-44, rtol=2e-6, what="erfc float32")
    special = xp.asarray([-0.0, np.inf, -np.inf, np.nan])
    erf, erfc = to_host(ops._erf(special)), to_host(ops._erf(special, complement=True))
    assert np.signbit(erf[0]) and erfc[0] == 1, "erf(-0) = -0"
    assert list(erf[1:3]) == [1, -1] and list(erfc[1:3]) == [0, 2]
    assert np.isnan(erf[3]) and np.isnan(erfc[3])


def gelu_exact_reference(x):
    """x·Φ(x) and its derivative Φ(x) + x·φ(x), one element at a time with the C library's erfc
    (0.5·erfc(-x/√2) keeps the left tail's digits, as the op does)."""
    cdf = np.array([0.5 * math.erfc(-v / math.sqrt(2)) for v in x])
    pdf = np.array([math.exp(-v * v / 2) / math.sqrt(2 * math.pi) for v in x])
    return x * cdf, cdf + x * pdf


GELU_HARD_POINTS = np.array(
    # 0 and -0, tiny, erf's piece boundaries (|x|/√2 = 0.5, 4) and PyTorch's 0.5, 4, a far tail
    # that stays above the underflow (-30: 1e-196), and where x·Φ(x) and φ are 0 in float64
    [0.0, -0.0, 1e-300, -1e-300, 0.5, -0.5, 4.0, -4.0, 30.0, -30.0, -40.0, 40.0]
    + [s * b * math.sqrt(2) for s in (1, -1) for b in (0.5, 4.0)]
)


def test_gelu_exact_matches_the_erfc_form_at_hard_points(rng):
    x = np.concatenate([GELU_HARD_POINTS, rng.standard_normal(200) * 4])
    expected, slope = gelu_exact_reference(x)
    xt = T(x)
    y = F.gelu(xt, approximate="none")
    y.sum().backward()
    # relative, to the left tail too (the rounding of x/√2 costs x²·1e-16 there); the slope also
    # absolutely, as it crosses 0 at x = -0.75
    hard = len(GELU_HARD_POINTS)
    assert_close(y, expected, atol=0, rtol=1e-12, what="exact gelu float64")
    assert_close(xt.grad[:hard], slope[:hard], atol=0, rtol=1e-12, what="exact gelu backward at hard points")
    assert_close(xt.grad, slope, atol=1e-15, rtol=1e-12, what="exact gelu backward float64")
    assert np.signbit(y.numpy()[1]), "gelu(-0) = -0"
    x32 = Tensor(x.astype(np.float32), requires_grad=True)
    y32 = F.gelu(x32, approximate="none")
    y32.sum().backward()
    assert y32.dtype == np.float32 and x32.grad.dtype == np.float32
    expected32, slope32 = gelu_exact_reference(x.astype(np.float32).astype(np.float64))
    assert_close(y32, expected32, atol=1e-6, rtol=1e-5, what="exact gelu float32")
    assert_close(x32.grad, slope32, atol=1e-6, rtol=1e-5, what="exact gelu backward float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow in x² or exp, no 0/0, at the ends of each dtype
        for dtype, big in ((np.float64, 1e300), (np.float32, 1e30)):
            xb = Tensor(np.array([-big, big, -60.0, 60.0], dtype=dtype), requires_grad=True)
            yb = F.gelu(xb, approximate="none")
            yb.sum().backward()
            assert list(yb.numpy()) == [0, big, 0, 60] and list(xb.grad) == [0, 1, 0, 1], dtype


def test_gelu_rejects_an_unknown_approximate():
    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh', not 'exact'"):
        F.gelu(T(np.ones(3)), approximate="exact")


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
