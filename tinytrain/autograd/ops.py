"""Every differentiable operation, as a ``Function`` with a hand-written backward.

Forward and backward take and return plain ``xp`` arrays; ``Tensor`` methods and
``tinytrain.functional`` are thin wrappers that call ``SomeOp.apply``. Each backward returns one
gradient per positional argument of forward (``None`` for arguments that are not differentiable).

Some operations are *fused* (layer_norm, gelu, cross_entropy, scaled_dot_product_attention,
linear): one Function instead of a chain of small ones, because each Function costs Python
overhead and a temporary array, and because the fused backward is short enough to read.

Low precision (``--precision bf16|fp16``: float16, or bfloat16 from ``ml_dtypes``). Every op returns
its inputs' dtype, and a gradient has its tensor's dtype (the engine casts one that does not). What
each op computes in:

    elementwise ops (add, mul, exp, ...)   the low dtype itself: NumPy converts each element to
                                           float32, computes and rounds the result once, as a GPU
                                           kernel that writes fp16 does
    matmul, linear                         NumPy: float32 GEMM on upcast operands, rounded once
                                           (its float16 matmul is a loop ~50x slower than BLAS;
                                           ml_dtypes' bfloat16 matmul returns float32); CuPy: the
                                           native fp16 GEMM, which accumulates in float32 too
    sums, means (bias gradients, ...)      accumulated in float32, rounded once: along an axis NumPy
                                           adds float16 in float16 (column sums of 1000 values near
                                           0.1: 0.6% off), ml_dtypes adds bfloat16 in bfloat16 (100k
                                           such values sum to 64)
    fused ops (layer_norm, gelu, softmax,  float32 inside, as a GPU's fused kernel computes in
    attention, cross_entropy), the         registers; outputs and what backward keeps in the low
    embedding's scatter-add                dtype, but cross_entropy returns a float32 loss (a
                                           statistic; fp16's exp overflows at 11) and keeps float32
                                           probabilities (p - 1 of a confident target is lost in bf16)
"""

from __future__ import annotations

import functools
import math

import numpy

from tinytrain.autograd import threads
from tinytrain.autograd.engine import Function
from tinytrain.autograd.threads import in_pieces
from tinytrain.backend import index_add, is_low_precision, on_gpu, xp


def _up(a):
    """``a`` in float32 if it is a low-precision array, else ``a`` itself (no copy): where an op
    computes in float32 (see the module docstring)."""
    return threads.cast(a, xp.float32) if is_low_precision(a.dtype) else a


def _low(a, dtype):
    """``a`` rounded to ``dtype`` when that is a low precision (what an op computed in float32)."""
    return threads.cast(a, dtype) if is_low_precision(dtype) and a.dtype != dtype else a


def _sum(a, axis=None, keepdims=False):
    """``a.sum(...)``; a low-precision array is accumulated in float32 and rounded once."""
    if is_low_precision(a.dtype):
        return xp.sum(a, axis=axis, keepdims=keepdims, dtype=xp.float32).astype(a.dtype)
    return xp.sum(a, axis=axis, keepdims=keepdims)


_NATIVE_LOW_MATMUL = on_gpu  # CuPy's fp16 GEMM accumulates in float32; NumPy has no fast one


def _matmul(a, b, bias=None):
    """``a @ b (+ bias)``; low-precision operands are multiplied in float32 on NumPy, rounded once.
    A product of two 2-D arrays runs on every core (:func:`~tinytrain.autograd.threads.matmul`)."""
    low = a.dtype if is_low_precision(a.dtype) else b.dtype
    if is_low_precision(low) and not (_NATIVE_LOW_MATMUL and a.dtype == b.dtype):
        return _low(_matmul(_up(a), _up(b), None if bias is None else _up(bias)), low)
    if a.ndim == 2 and b.ndim == 2:
        return threads.matmul(a, b, bias)
    return a @ b if bias is None else a @ b + bias


def _gemm_operand(a):
    """``a`` as :func:`_matmul` multiplies it: in float32 where a low precision is multiplied in
    float32 (NumPy), converted here once for an operand of two products (a gradient in backward),
    instead of once in each; the products still round to the other operand's low dtype."""
    return a if _NATIVE_LOW_MATMUL else _up(a)


def unbroadcast(grad, shape):
    """Sum ``grad`` over the axes that broadcasting added or stretched, to get back ``shape``."""
    if grad.shape == tuple(shape):
        return grad
    extra = grad.ndim - len(shape)
    if extra > 0:
        grad = _sum(grad, axis=tuple(range(extra)))
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    if stretched:
        grad = _sum(grad, axis=stretched, keepdims=True)
    return grad


def _shape(a):
    return getattr(a, "shape", ())


def _normalize_axis(axis, ndim):
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, int):
        axis = (axis,)
    return tuple(a % ndim for a in axis) if ndim else ()


def _expand_reduced(grad, shape, axis, keepdims):
    """Give a reduced gradient back its reduced axes (size 1) so it broadcasts against the input."""
    if not keepdims:
        for a in sorted(_normalize_axis(axis, len(shape))):
            grad = xp.expand_dims(grad, a)
    return grad


# --------------------------------------------------------------------------------------------
# Elementwise arithmetic (broadcasting)


class Add(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.shapes = (_shape(a), _shape(b))
        return a + b

    @staticmethod
    def backward(ctx, grad):
        sa, sb = ctx.shapes
        return unbroadcast(grad, sa), unbroadcast(grad, sb)


class Sub(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.shapes = (_shape(a), _shape(b))
        return a - b

    @staticmethod
    def backward(ctx, grad):
        sa, sb = ctx.shapes
        return unbroadcast(grad, sa), unbroadcast(-grad, sb)


class Mul(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a if ctx.needs_input_grad[1] else None, b if ctx.needs_input_grad[0] else None)
        ctx.shapes = (_shape(a), _shape(b))
        return a * b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved
        sa, sb = ctx.shapes
        ga = unbroadcast(grad * b, sa) if ctx.needs_input_grad[0] else None
        gb = unbroadcast(grad * a, sb) if ctx.needs_input_grad[1] else None
        return ga, gb


class Div(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        ctx.shapes = (_shape(a), _shape(b))
        return a / b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved
        sa, sb = ctx.shapes
        ga = unbroadcast(grad / b, sa) if ctx.needs_input_grad[0] else None
        gb = unbroadcast(-grad * a / (b * b), sb) if ctx.needs_input_grad[1] else None
        return ga, gb


class Neg(Function):
    @staticmethod
    def forward(ctx, a):
        return -a

    @staticmethod
    def backward(ctx, grad):
        return (-grad,)


class Pow(Function):
    """``a ** b`` for a tensor or a constant exponent (a tensor exponent needs a > 0)."""

    @staticmethod
    def forward(ctx, a, b):
        out = a**b
        ctx.save_for_backward(a, b, out)
        ctx.shapes = (_shape(a), _shape(b))
        return out

    @staticmethod
    def backward(ctx, grad):
        a, b, out = ctx.saved
        sa, sb = ctx.shapes
        ga = unbroadcast(grad * b * a ** (b - 1), sa) if ctx.needs_input_grad[0] else None
        gb = unbroadcast(grad * out * xp.log(xp.asarray(a, dtype=out.dtype)), sb) if ctx.needs_input_grad[1] else None
        return ga, gb


class MatMul(Function):
    """Batched matrix product with broadcast batch axes (both operands at least 2-D)."""

    @staticmethod
    def forward(ctx, a, b):
        if a.ndim < 2 or b.ndim < 2:
            raise ValueError(
                f"matmul needs operands with at least 2 axes, got shapes {a.shape} and {b.shape}; "
                "reshape a vector to (1, n) or (n, 1) first."
            )
        ctx.save_for_backward(a, b)
        return _matmul(a, b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved
        ga = gb = None
        grad = _gemm_operand(grad) if a.dtype == b.dtype else grad  # (the products' dtype is theirs)
        if ctx.needs_input_grad[0]:
            ga = unbroadcast(_matmul(grad, xp.swapaxes(b, -1, -2)), a.shape)
        if ctx.needs_input_grad[1]:
            if b.ndim == 2:
                # (..., n, k) @ (k, m): fold the batch into one GEMM instead of a batch of them
                # followed by a sum over the batch.
                gb = _matmul(a.reshape(-1, a.shape[-1]).T, grad.reshape(-1, grad.shape[-1]))
            else:
                gb = unbroadcast(_matmul(xp.swapaxes(a, -1, -2), grad), b.shape)
        return ga, gb


class Linear(Function):
    """``x @ weight + bias`` with weight of shape (in, out): one GEMM each way, any batch axes."""

    @staticmethod
    def forward(ctx, x, weight, bias=None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        # Fold the batch axes into rows: one (rows, in) @ (in, out) GEMM. A (B, T, in) @ (in, out)
        # product is a batch of B small GEMMs in NumPy, about 3x slower for a GPT's shapes.
        out = _matmul(x.reshape(-1, x.shape[-1]), weight, bias)  # low precision: float32 GEMM + bias, rounded once
        return out.reshape(x.shape[:-1] + (weight.shape[1],))

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved
        dtype, g2 = grad.dtype, _gemm_operand(grad.reshape(-1, grad.shape[-1]))
        gx = _matmul(g2, weight.T).reshape(x.shape) if ctx.needs_input_grad[0] else None
        gw = _matmul(x.reshape(-1, x.shape[-1]).T, g2) if ctx.needs_input_grad[1] else None
        gb = _low(_sum(g2, axis=0), dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


# --------------------------------------------------------------------------------------------
# Reductions


class Sum(Function):
    @staticmethod
    def forward(ctx, a, axis=None, keepdims=False):
        ctx.args = (a.shape, axis, keepdims)
        return _sum(a, axis=axis, keepdims=keepdims)

    @staticmethod
    def backward(ctx, grad):
        shape, axis, keepdims = ctx.args
        return (xp.broadcast_to(_expand_reduced(grad, shape, axis, keepdims), shape),)


class Mean(Function):
    @staticmethod
    def forward(ctx, a, axis=None, keepdims=False):
        ctx.args = (a.shape, axis, keepdims)
        ctx.count = math.prod(a.shape[i] for i in _normalize_axis(axis, a.ndim))
        return _low(xp.mean(_up(a), axis=axis, keepdims=keepdims), a.dtype)

    @staticmethod
    def backward(ctx, grad):
        shape, axis, keepdims = ctx.args
        g = _expand_reduced(grad, shape, axis, keepdims) / ctx.count
        return (xp.broadcast_to(g, shape),)


class Max(Function):
    """Maximum over axes; where several entries tie for the maximum, they share the gradient."""

    @staticmethod
    def forward(ctx, a, axis=None, keepdims=False):
        out = xp.max(a, axis=axis, keepdims=True)
        ctx.save_for_backward(a == out)
        ctx.args = (a.shape, axis, keepdims)
        return out if keepdims else xp.squeeze(out, axis=_normalize_axis(axis, a.ndim))

    @staticmethod
    def backward(ctx, grad):
        (is_max,) = ctx.saved
        shape, axis, keepdims = ctx.args
        share = (is_max / is_max.sum(axis=axis, keepdims=True)).astype(grad.dtype)
        return (_expand_reduced(grad, shape, axis, keepdims) * share,)


class Var(Function):
    """Variance over axes: mean of squared deviations divided by (count - correction)."""

    @staticmethod
    def forward(ctx, a, axis=None, keepdims=False, correction=0):
        count = math.prod(a.shape[i] for i in _normalize_axis(axis, a.ndim))
        if count - correction <= 0:
            raise ValueError(f"var over {count} element(s) with correction={correction} is undefined")
        low, a = a.dtype, _up(a)  # in float32 (a statistic), the result rounded once
        centered = a - xp.mean(a, axis=axis, keepdims=True)
        ctx.save_for_backward(_low(centered, low))
        ctx.args = (a.shape, axis, keepdims, count - correction)
        return _low(xp.sum(centered * centered, axis=axis, keepdims=keepdims) / (count - correction), low)

    @staticmethod
    def backward(ctx, grad):
        (centered,) = ctx.saved
        shape, axis, keepdims, denom = ctx.args
        return (_expand_reduced(grad, shape, axis, keepdims) * (2.0 / denom) * centered,)


# --------------------------------------------------------------------------------------------
# Elementwise functions


class Exp(Function):
    @staticmethod
    def forward(ctx, a):
        out = xp.exp(a)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return (grad * ctx.saved[0],)


class Log(Function):
    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return xp.log(a)

    @staticmethod
    def backward(ctx, grad):
        return (grad / ctx.saved[0],)


class Sqrt(Function):
    @staticmethod
    def forward(ctx, a):
        out = xp.sqrt(a)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return (grad / (2 * ctx.saved[0]),)


class Tanh(Function):
    @staticmethod
    def forward(ctx, a):
        out = xp.tanh(a)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = ctx.saved[0]
        return (grad * (1 - out * out),)


class ReLU(Function):
    @staticmethod
    def forward(ctx, a):
        positive = a > 0
        ctx.save_for_backward(positive)
        return a * positive

    @staticmethod
    def backward(ctx, grad):
        return (grad * ctx.saved[0],)


_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715


class GELU(Function):
    """GELU(x) = x·Φ(x), Φ the standard normal CDF: exact (``approximate="none"``) or with GPT-2's
    tanh approximation (``"tanh"``), as ``torch.nn.functional.gelu``. Both compute a gate s ≈ Φ(x)
    and out = x·s, and keep x and s for backward (the same arrays either way). Fused: the kernels
    below run on every core (:func:`~tinytrain.autograd.threads.in_pieces`).

    tanh: 0.5·x·(1 + tanh(u)),  u = √(2/π)·(x + 0.044715·x³). Computed as x·σ(2u), σ the logistic
    sigmoid: the same function, since 0.5·(1 + tanh(u)) = 1/(1 + exp(-2u)), and NumPy's exp is
    about twice as fast as its tanh. Every line of its kernels is one pass over the array into an
    existing buffer (``out=``, in place), so no temporaries beyond the output and σ. Backward,
    with s = σ(2u):

        d/dx [x·s] = s + x·s·(1 - s)·2u',   2u' = 2√(2/π)·(1 + 3·0.044715·x²)

    none: s = Φ(x) = 0.5·(1 + erf(x/√2)) = 0.5·erfc(-x/√2), through erfc (:func:`_erf`) so that the
    left tail keeps its digits (1 + erf(x/√2), PyTorch's form, rounds to 0 in float64 below
    x ≈ -8.3). Its kernel is not written for speed as the tanh one is (the model uses tanh): erfc
    makes some temporaries of the piece's size. Backward, by the product rule, with Φ' = φ the
    normal density (erf'(z) = 2/√π·exp(-z²), and z = x/√2 gives Φ'(x) = ½·2/√π·exp(-x²/2)/√2):

        d/dx [x·Φ(x)] = Φ(x) + x·φ(x),   φ(x) = exp(-x²/2)/√(2π)
    """

    @staticmethod
    def forward(ctx, x, approximate="tanh"):
        if approximate not in _GELU_KERNELS:
            accepted = " or ".join(repr(name) for name in _GELU_KERNELS)
            raise ValueError(f"gelu: approximate must be {accepted}, not {approximate!r}")
        dtype = x.dtype  # a low precision: computed in float32, out and s kept rounded to it
        x = xp.ascontiguousarray(x)
        x32 = _up(x)
        s, out = xp.empty_like(x32), xp.empty_like(x32)
        kernel, _ = _GELU_KERNELS[approximate]
        in_pieces(kernel, x32.reshape(-1), s.reshape(-1), out.reshape(-1))
        ctx.save_for_backward(x, _low(s, dtype))
        ctx.approximate = approximate
        return _low(out, dtype)

    @staticmethod
    def backward(ctx, grad):
        x, s = ctx.saved
        x32, s32 = _up(x), _up(s)
        d = xp.empty_like(x32)
        _, kernel = _GELU_KERNELS[ctx.approximate]
        in_pieces(kernel, x32.reshape(-1), s32.reshape(-1), _up(xp.ascontiguousarray(grad)).reshape(-1), d.reshape(-1))
        return (_low(d, x.dtype),)


def _gelu_tanh_forward(x, s, out):
    """s = σ(2u) and out = x·s on one piece of x."""
    dt = x.dtype.type
    xp.multiply(x, x, out=s)  # s = x²                 (then, in place:)
    s *= dt(-2 * _GELU_C * _GELU_A)  # -2·c·a·x²
    s -= dt(2 * _GELU_C)  # -2·c·(1 + a·x²)
    s *= x  # -2u
    xp.minimum(s, dt(80), out=s)  # exp(80) is finite in float32; σ there is 0 to float32 anyway
    xp.exp(s, out=s)  # exp(-2u)
    s += dt(1)
    xp.reciprocal(s, out=s)  # σ(2u) = 1/(1 + exp(-2u))
    xp.multiply(x, s, out=out)


def _gelu_tanh_backward(x, s, grad, d):
    """d = grad · d/dx [x·s] on one piece."""
    dt = x.dtype.type
    xp.multiply(x, x, out=d)  # d = x²                 (then, in place:)
    d *= dt(6 * _GELU_C * _GELU_A)
    d += dt(2 * _GELU_C)  # 2u'
    d *= x
    d *= s  # x·s·2u'
    d *= xp.subtract(dt(1), s)  # x·s·(1 - s)·2u'
    d += s
    d *= grad


def _gelu_exact_forward(x, s, out):
    """s = Φ(x) = 0.5·erfc(-x/√2) and out = x·s on one piece of x."""
    dt = x.dtype.type
    xp.multiply(_erf(x * dt(-math.sqrt(0.5)), complement=True), dt(0.5), out=s)
    xp.multiply(x, s, out=out)


def _gelu_exact_backward(x, s, grad, d):
    """d = grad · (Φ(x) + x·φ(x)) on one piece, s = Φ(x)."""
    dt = x.dtype.type
    xp.clip(x, dt(-40), dt(40), out=d)  # φ is 0 past ±38.6 in float64 already, and x² stays finite
    d *= d
    d *= dt(-0.5)
    xp.exp(d, out=d)  # exp(-x²/2)
    d *= dt(1 / math.sqrt(2 * math.pi))  # φ(x)
    d *= x
    d += s
    d *= grad


_GELU_KERNELS = {  # approximate= → (forward, backward) kernels
    "none": (_gelu_exact_forward, _gelu_exact_backward),
    "tanh": (_gelu_tanh_forward, _gelu_tanh_backward),
}


# erf and erfc: NumPy has none (SciPy's is no dependency), so W. J. Cody's rational Chebyshev
# approximations, "Rational Chebyshev approximations for the error function", Math. Comp. 23 (1969),
# 631-637: the coefficients of his tables (the set his Fortran CALERF uses), as (numerator,
# denominator) polynomials, highest power first. The first piece is used below 0.5 (CALERF switches
# at 0.46875; both give float64's rounding, tests/autograd/test_grad_elementwise.py measures it).
_ERF_SMALL = (  # erf(x) = x·P(x²)/Q(x²),  |x| < 0.5
    (
        1.85777706184603153e-1,
        3.16112374387056560e0,
        1.13864154151050156e2,
        3.77485237685302021e2,
        3.20937758913846947e3,
    ),
    (1.0, 2.36012909523441209e1, 2.44024637934444173e2, 1.28261652607737228e3, 2.84423683343917062e3),
)
_ERFC_MIDDLE = (  # erfc(x) = exp(-x²)·P(x)/Q(x),  0.5 ≤ x < 4
    (
        2.15311535474403846e-8,
        5.64188496988670089e-1,
        8.88314979438837594e0,
        6.61191906371416295e1,
        2.98635138197400131e2,
        8.81952221241769090e2,
        1.71204761263407058e3,
        2.05107837782607147e3,
        1.23033935479799725e3,
    ),
    (
        1.0,
        1.57449261107098347e1,
        1.17693950891312499e2,
        5.37181101862009858e2,
        1.62138957456669019e3,
        3.29079923573345963e3,
        4.36261909014324716e3,
        3.43936767414372164e3,
        1.23033935480374942e3,
    ),
)
_ERFC_LARGE = (  # erfc(x) = exp(-x²)/x·(1/√π - z·P(z)/Q(z)),  z = 1/x²,  x ≥ 4
    (
        1.63153871373020978e-2,
        3.05326634961232344e-1,
        3.60344899949804439e-1,
        1.25781726111229246e-1,
        1.60837851487422766e-2,
        6.58749161529837803e-4,
    ),
    (
        1.0,
        2.56852019228982242e0,
        1.87295284992346725e0,
        5.27905102951428412e-1,
        6.05183413124413191e-2,
        2.33520497626869185e-3,
    ),
)
_ERFC_ZERO = 28.0  # erfc(28) < 1e-340 is 0 in float64 (and erfc(x) for every x past it)


def _erf(x, complement=False):
    """erf(x), or erfc(x) = 1 - erf(x) with ``complement``, elementwise in x's dtype, to its
    rounding (float64: within 1e-15 relative on the whole line, erfc's tail too until it underflows
    past x ≈ 26.5). Cody's three pieces (above) give erf(|x|) near 0 and erfc(|x|) beyond; then
    erf(-x) = -erf(x) and erfc(-x) = 2 - erfc(x). Each piece is computed on the whole array with
    |x| clamped into its interval (no division by 0, no overflow; erfc is 0 past ``_ERFC_ZERO``)
    and ``where`` picks, so the same array ops run on NumPy and CuPy."""
    dt = x.dtype.type
    y = xp.abs(x)
    t = xp.clip(x, dt(-0.5), dt(0.5))
    small = t * _ratio(_ERF_SMALL, t * t)  # erf(x), |x| < 0.5
    t = xp.clip(y, dt(0.5), dt(4))
    tail = _ratio(_ERFC_MIDDLE, t) * _exp_minus_square(t)  # erfc(|x|), 0.5 ≤ |x| < 4
    t = xp.clip(y, dt(4), dt(_ERFC_ZERO))
    z = xp.reciprocal(t * t)
    large = (dt(1 / math.sqrt(math.pi)) - z * _ratio(_ERFC_LARGE, z)) / t * _exp_minus_square(t)
    tail = xp.where(y < dt(4), tail, large)  # erfc(|x|), |x| ≥ 0.5
    if complement:
        return xp.where(y < dt(0.5), 1 - small, xp.where(x < 0, 2 - tail, tail))
    return xp.where(y < dt(0.5), small, xp.copysign(1 - tail, x))


def _ratio(polynomials, t):
    """P(t)/Q(t) for ``polynomials`` = (P, Q), coefficients highest power first (Horner's rule)."""
    dt = t.dtype.type
    p, q = polynomials
    numerator, denominator = xp.full_like(t, dt(p[0])), xp.full_like(t, dt(q[0]))
    for a, b in zip(p[1:], q[1:]):
        numerator *= t
        numerator += dt(a)
        denominator *= t
        denominator += dt(b)
    return numerator / denominator


def _exp_minus_square(y):
    """exp(-y²) for y ≥ 0, as exp(-h²)·exp(-(y - h)·(y + h)) with h = y rounded down to 1/16 (Cody's
    split): h² is exact, so only the small (y - h)·(y + h) is rounded, where exp of a rounded y²
    would be off by y² times the dtype's rounding, relative."""
    h = xp.floor(y * 16) / 16
    return xp.exp(-h * h) * xp.exp(-(y - h) * (y + h))


class Softmax(Function):
    @staticmethod
    def forward(ctx, x, axis=-1):
        out = _low(_softmax_inplace(_up(x).copy(), axis), x.dtype)  # in float32
        ctx.save_for_backward(out)
        ctx.axis = axis
        return out

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved
        y32 = _up(y)
        gy = _up(grad) * y32
        return (_low(gy - y32 * xp.sum(gy, axis=ctx.axis, keepdims=True), y.dtype),)


class LogSoftmax(Function):
    @staticmethod
    def forward(ctx, x, axis=-1):
        x32 = _up(x)  # in float32
        shifted = x32 - xp.max(x32, axis=axis, keepdims=True)
        out = _low(shifted - xp.log(xp.sum(xp.exp(shifted), axis=axis, keepdims=True)), x.dtype)
        ctx.save_for_backward(out)
        ctx.axis = axis
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved
        grad32 = _up(grad)
        return (_low(grad32 - xp.exp(_up(out)) * xp.sum(grad32, axis=ctx.axis, keepdims=True), out.dtype),)


class CrossEntropy(Function):
    """Mean (or summed) negative log-likelihood of integer targets under softmax(logits).

    logits (..., C), targets (...) integers; entries equal to ``ignore_index`` count neither in
    the loss nor in the mean's denominator. Computed from the log-sum-exp, so it never overflows.
    Low-precision logits are upcast: the loss is float32, and so are the probabilities kept.
    """

    @staticmethod
    def forward(ctx, logits, targets, ignore_index=-100, reduction="mean"):
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        if targets.shape != logits.shape[:-1]:
            raise ValueError(
                f"cross_entropy: targets have shape {targets.shape} but logits {logits.shape}; "
                "targets need the logits' shape without the last (class) axis."
            )
        n_classes = logits.shape[-1]
        flat = _up(logits.reshape(-1, n_classes))
        tgt = targets.reshape(-1)
        valid = tgt != ignore_index
        safe_tgt = xp.where(valid, tgt, 0)
        if bool(((safe_tgt < 0) | (safe_tgt >= n_classes)).any()):
            raise ValueError(f"cross_entropy: a target is outside [0, {n_classes}) and not ignore_index")
        shifted = flat - xp.max(flat, axis=-1, keepdims=True)
        probs = xp.exp(shifted)
        total = _row_sums(probs)
        probs *= 1 / total  # kept for backward: d(loss)/d(logits) = probs - onehot(target)
        rows = xp.arange(flat.shape[0])
        # -log p[target] = log-sum-exp - logit[target], exact even where p[target] underflows
        nll = (xp.log(total[:, 0]) - shifted[rows, safe_tgt]) * valid
        denom = valid.sum() if reduction == "mean" else 1
        ctx.save_for_backward(probs, safe_tgt, valid)
        ctx.denom = denom
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype
        if not denom:  # every target ignored: the mean of nothing is NaN (as PyTorch's), without 0/0's warning
            return xp.asarray(xp.nan, dtype=flat.dtype)
        return xp.asarray(nll.sum() / denom, dtype=flat.dtype)

    @staticmethod
    def backward(ctx, grad):
        probs, tgt, valid = ctx.saved
        # every target ignored: no target pulls on any logit, so the gradient is zero (PyTorch's too)
        g = nll_grad(probs, tgt, 1, valid * (grad / ctx.denom) if ctx.denom else xp.zeros(valid.shape))
        return _low(g, ctx.logits_dtype).reshape(ctx.logits_shape), None


def nll_grad(probs, columns, hit, weight):
    """Cross-entropy's gradient with respect to the scores, for rows of softmax ``probs`` (N, C).

    ``columns`` (N,): each row's target column; ``hit``: 1, or a per-row mask of the rows whose
    target lies among these C columns (no one-hot on the others); ``weight`` (N,): each row's
    factor (0 on ignored rows). Row i: weight_i · (probs_i − onehot(columns_i) · hit_i). The
    serial loss and the vocabulary-parallel one (on its own columns) share it.
    """
    g = probs.copy()
    g[xp.arange(g.shape[0]), columns] -= xp.asarray(hit, dtype=g.dtype)
    g *= weight[:, None].astype(g.dtype)
    return g


# --------------------------------------------------------------------------------------------
# Shape and indexing


class Reshape(Function):
    @staticmethod
    def forward(ctx, a, shape):
        ctx.in_shape = a.shape
        return a.reshape(shape)

    @staticmethod
    def backward(ctx, grad):
        return (grad.reshape(ctx.in_shape),)


class Permute(Function):
    """Reorder axes (``transpose`` swaps two of them, ``permute`` gives a full order)."""

    @staticmethod
    def forward(ctx, a, axes):
        ctx.axes = tuple(ax % a.ndim for ax in axes)
        return xp.transpose(a, ctx.axes)

    @staticmethod
    def backward(ctx, grad):
        inverse = [0] * len(ctx.axes)
        for i, ax in enumerate(ctx.axes):
            inverse[ax] = i
        return (xp.transpose(grad, inverse),)


def _is_advanced(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(not (isinstance(i, (slice, int)) or i is None or i is Ellipsis) for i in items)


class GetItem(Function):
    """``a[index]`` with slices, integers and integer/boolean arrays.

    Backward scatters the gradient back into zeros of the input's shape; with integer arrays an
    entry can be picked twice, so the scatter adds (``index_add``) instead of assigning.
    """

    @staticmethod
    def forward(ctx, a, index):
        ctx.args = (a.shape, a.dtype, index)
        return a[index]

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, index = ctx.args
        out = xp.zeros(shape, dtype=dtype)
        if _is_advanced(index):
            index_add(out, index, grad)
        else:
            out[index] = grad
        return (out,)


class Concatenate(Function):
    @staticmethod
    def forward(ctx, *arrays, axis=0):
        ctx.axis = axis
        ctx.bounds = _split_bounds([a.shape[axis] for a in arrays])
        return xp.concatenate(arrays, axis=axis)

    @staticmethod
    def backward(ctx, grad):
        return tuple(grad[(slice(None),) * (ctx.axis % grad.ndim) + (slice(lo, hi),)] for lo, hi in ctx.bounds)


def _split_bounds(sizes):
    bounds, start = [], 0
    for n in sizes:
        bounds.append((start, start + n))
        start += n
    return bounds


class Stack(Function):
    @staticmethod
    def forward(ctx, *arrays, axis=0):
        ctx.axis = axis
        return xp.stack(arrays, axis=axis)

    @staticmethod
    def backward(ctx, grad):
        return tuple(xp.moveaxis(grad, ctx.axis, 0))


class Where(Function):
    """``condition ? a : b`` elementwise, with broadcasting; the condition is not differentiable."""

    @staticmethod
    def forward(ctx, condition, a, b):
        ctx.save_for_backward(condition)
        ctx.shapes = (_shape(a), _shape(b))
        return xp.where(condition, a, b)

    @staticmethod
    def backward(ctx, grad):
        (condition,) = ctx.saved
        sa, sb = ctx.shapes
        ga = unbroadcast(xp.where(condition, grad, 0), sa) if ctx.needs_input_grad[1] else None
        gb = unbroadcast(xp.where(condition, 0, grad), sb) if ctx.needs_input_grad[2] else None
        return None, ga, gb


class Cast(Function):
    @staticmethod
    def forward(ctx, a, dtype):
        ctx.dtype = a.dtype
        return a.astype(dtype)

    @staticmethod
    def backward(ctx, grad):
        return (grad.astype(ctx.dtype),)


# --------------------------------------------------------------------------------------------
# Layers as fused functions


class Embedding(Function):
    """Rows of ``weight`` picked by integer ``ids``; backward adds each row's gradients back."""

    @staticmethod
    def forward(ctx, weight, ids):
        if ids.dtype.kind not in "iu":
            raise TypeError(f"embedding ids must be integers, got {ids.dtype}")
        ctx.save_for_backward(ids)
        ctx.weight_meta = (weight.shape, weight.dtype)
        return weight[ids]

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved
        (rows, dim), dtype = ctx.weight_meta
        # A low precision adds in float32 (a row may sum many tokens' gradients), rounded once.
        gw = xp.zeros(rows * dim, dtype=xp.float32 if is_low_precision(dtype) else dtype)
        # Each id's gradient row adds into gw[id, :]. Written as a scatter of single entries into
        # the flattened weight (entry id·dim + j), which NumPy's add.at does about 5x faster than
        # a scatter of whole rows.
        entries = ids.reshape(-1, 1) * dim + xp.arange(dim)
        index_add(gw, entries.reshape(-1), _up(grad).reshape(-1))
        return _low(gw, dtype).reshape(rows, dim), None


class LayerNorm(Function):
    """Normalize over the last axis, then scale and shift: (x - mean)/sqrt(var + eps)·w + b.

    Fused, and written for few passes over the (rows, C) activations: the per-row sums go through
    :func:`_row_sums` (one matrix-vector product), each other line is one pass into an existing
    buffer, and the rows are split among the cores (:func:`~tinytrain.autograd.threads.in_pieces`).
    Forward keeps xhat (normalized x) and rstd = 1/sqrt(var + eps) per row for backward:

        dx = rstd · (gxhat - mean(gxhat) - xhat · mean(gxhat · xhat)),   gxhat = grad · w
    """

    @staticmethod
    def forward(ctx, x, weight=None, bias=None, eps=1e-5):
        # A low precision is normalized in float32 (mean and variance are statistics over the row);
        # the output and the xhat kept for backward are rounded to it.
        rows = _up(xp.ascontiguousarray(x).reshape(-1, x.shape[-1]))
        w32, b32 = (None if a is None else _up(a) for a in (weight, bias))
        xhat, out = xp.empty_like(rows), xp.empty_like(rows)
        rstd = xp.empty((rows.shape[0], 1), dtype=rows.dtype)
        kernel = functools.partial(_layer_norm_forward, weight=w32, bias=b32, eps=eps)
        in_pieces(kernel, rows, xhat, rstd, out, pieces=_layer_norm_pieces(rows))
        ctx.save_for_backward(_low(xhat, x.dtype), rstd, weight)
        return _low(out, x.dtype).reshape(x.shape)

    @staticmethod
    def backward(ctx, grad):
        xhat, rstd, weight = ctx.saved
        dtype, xhat, w32 = xhat.dtype, _up(xhat), None if weight is None else _up(weight)
        rows = _up(xp.ascontiguousarray(grad).reshape(xhat.shape))
        gw = xp.einsum("ij,ij->j", rows, xhat) if weight is not None and ctx.needs_input_grad[1] else None
        gb = _column_sums(rows) if len(ctx.needs_input_grad) > 2 and ctx.needs_input_grad[2] else None
        gx = xp.empty_like(rows)
        in_pieces(
            functools.partial(_layer_norm_backward, weight=w32), rows, xhat, rstd, gx, pieces=_layer_norm_pieces(rows)
        )
        gw, gb = (None if g is None else _low(g, dtype) for g in (gw, gb))
        return _low(gx, dtype).reshape(grad.shape), gw, gb


def _layer_norm_pieces(rows) -> int:
    """Pieces for a layer norm's kernel: one per ``LAYER_NORM_PIECE`` entries. Why more than a
    thread's ``MIN_PIECE``: the kernel is a dozen short NumPy passes, and in two threads each return
    from NumPy waits for the interpreter lock the other holds (2048 x 64 rows: 133-196 us in one
    piece, 165-259 us in two; the long model's step 0.92-0.96x of before in one piece)."""
    return rows.size // LAYER_NORM_PIECE


LAYER_NORM_PIECE = 1 << 18  # entries a layer norm's piece takes to be worth a thread (4 x MIN_PIECE)


def _layer_norm_forward(x, xhat, rstd, out, weight, bias, eps):
    """xhat, rstd and the output of LayerNorm on a piece of rows (x, xhat, out: (rows, C))."""
    C = x.shape[-1]
    xp.subtract(x, _row_sums(x) / C, out=xhat)  # centered
    xp.multiply(xhat, xhat, out=out)  # out holds the squares for a moment
    xp.sqrt(_row_sums(out) / C + eps, out=rstd)
    xp.reciprocal(rstd, out=rstd)
    xhat *= rstd
    if weight is None:
        out[...] = xhat
    else:
        xp.multiply(xhat, weight, out=out)
    if bias is not None:
        out += bias


def _layer_norm_backward(grad, xhat, rstd, gx, weight):
    """dx of LayerNorm on a piece of rows, into gx."""
    C = xhat.shape[-1]
    if weight is None:
        gx[...] = grad
    else:
        xp.multiply(grad, weight, out=gx)  # gxhat, then dx in place
    mean_gxhat_xhat = xp.einsum("ij,ij->i", gx, xhat)[:, None] / C
    gx -= _row_sums(gx) / C
    gx -= xhat * mean_gxhat_xhat
    gx *= rstd


def _row_sums(a):
    """Sums over the last axis, keepdims: ``a @ ones``, one matrix-vector product (BLAS), several
    times faster in NumPy than ``a.sum(axis=-1)`` on rows of a few hundred entries."""
    return (a.reshape(-1, a.shape[-1]) @ xp.ones(a.shape[-1], dtype=a.dtype)).reshape(a.shape[:-1] + (1,))


def _column_sums(rows):
    """Sums of a 2-D array over its rows: ``ones @ rows``, one vector-matrix product (BLAS)."""
    return xp.ones(rows.shape[0], dtype=rows.dtype) @ rows


class Dropout(Function):
    """Zero each entry with probability p and scale the rest by 1/(1-p); the mask comes from
    the given random generator, so a run is reproducible from its seed.

    A rank that holds only a piece of a tensor (tensor/sequence parallel) passes the serial
    tensor's ``full_shape`` and its own ``index``: the full mask is drawn, exactly as the serial
    model draws it, and only this rank's piece is kept — so the result equals the serial model's.
    """

    @staticmethod
    def forward(ctx, x, p, generator, full_shape=None, index=None):
        keep = generator.random(x.shape if full_shape is None else full_shape, dtype=xp.float32) >= p
        if index is not None:
            keep = keep[index].copy()  # a copy: a view would keep the whole mask alive for backward
        ctx.save_for_backward(keep)
        ctx.scale = x.dtype.type(1.0 / (1.0 - p))
        return x * keep * ctx.scale

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved
        return grad * keep * ctx.scale, None, None


class ScaledDotProductAttention(Function):
    """softmax(q·kᵀ·scale [+ causal mask])·v over the last two axes of (..., T, D) inputs.

    Backward, with p the attention probabilities and g the output gradient:
        dv = pᵀ·g,  dp = g·vᵀ,  ds = p ⊙ (dp − rowsum(dp ⊙ p)),  dq = ds·k·scale,  dk = dsᵀ·q·scale

    Computed in blocks of ``ATTENTION_BLOCK`` query rows. Why: with a causal mask, the queries of
    rows lo..hi-1 see keys 0..hi-1 only, so a block needs scores against those keys alone; the
    skipped part above the diagonal is up to half of the T x T scores, their exp and their softmax,
    which dominate a long context. Each block's probabilities are kept for backward (the lower
    triangle of p, block by block). Without a mask there is one block with every key.

    The batch axes (B, H, ...) are flattened into one axis of n independent attentions, and each
    core takes its share of them whole (:func:`~tinytrain.autograd.threads.in_pieces`): its
    matrix products, softmax and blocks, one after the other (:func:`_attention_forward`,
    :func:`_attention_backward`). Why not the cores within each block's softmax: a long context
    has many small blocks, and each hand-over to the other core, and the single-threaded small
    products between them, cost more than the softmax they split.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal=True, scale=None):
        T, S = q.shape[-2], k.shape[-2]
        if causal and T != S:
            raise ValueError(f"causal attention needs as many queries as keys, got {T} and {S}")
        # A low precision: the core runs in float32 on upcast q, k, v (scores and softmax are where
        # fp16 overflows and bf16 loses the small probabilities); kept for backward: q, k, v and the
        # probabilities rounded to it; the output is rounded once.
        kept, dtype = (q, k, v), v.dtype
        batch = numpy.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        q32 = _up(q)
        scale = q32.dtype.type(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
        # q scaled once here: (T, D) entries instead of (T, T) scores
        q3, k3, v3 = (_flat_batch(a, batch) for a in (q32 * scale, _up(k), _up(v)))
        blocks = _query_blocks(T, S, causal)
        out = xp.empty(q3.shape[:1] + (T, v.shape[-1]), dtype=v3.dtype)
        probs = [xp.empty((q3.shape[0], hi - lo, keys), dtype=v3.dtype) for lo, hi, keys in blocks]
        in_pieces(functools.partial(_attention_forward, blocks=blocks, causal=causal), q3, k3, v3, out, *probs)
        ctx.save_for_backward(*kept, *(_low(p, dtype) for p in probs))
        ctx.scale, ctx.blocks = scale, blocks
        return _low(out.reshape(batch + out.shape[1:]), dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, *probs = ctx.saved
        shapes, dtype = (q.shape, k.shape, v.shape), v.dtype
        batch = grad.shape[:-2]
        g3, q3, k3, v3 = (_flat_batch(_up(a), batch) for a in (grad, q, k, v))  # in float32, as forward
        dq, dk, dv = xp.empty_like(q3), xp.zeros_like(k3), xp.zeros_like(v3)
        kernel = functools.partial(_attention_backward, blocks=ctx.blocks, scale=ctx.scale)
        in_pieces(kernel, g3, q3, k3, v3, dq, dk, dv, *(_up(p) for p in probs))
        grads = (d.reshape(batch + d.shape[1:]) for d in (dq, dk, dv))
        return tuple(unbroadcast(_low(d, dtype), shape) for d, shape in zip(grads, shapes))


def _flat_batch(a, batch):
    """``a`` (..., T, D) broadcast to the ``batch`` axes and flattened to (n, T, D), contiguous
    (a copy where it is a view of another layout or broadcast)."""
    return xp.ascontiguousarray(xp.broadcast_to(a, batch + a.shape[-2:])).reshape((-1,) + a.shape[-2:])


def _attention_forward(q, k, v, out, *probs, blocks, causal):
    """One piece of n attentions (q already scaled): each block's probabilities into ``probs``,
    its output rows into ``out``."""
    k_t = xp.swapaxes(k, -1, -2)
    for (lo, hi, keys), p in zip(blocks, probs):
        xp.matmul(q[:, lo:hi], k_t[..., :keys], out=p)  # the block's scores
        if causal:  # the block's diagonal square: query lo + i sees keys up to lo + i
            p[..., lo:hi] += _causal_bias(hi - lo, p.dtype)
        _softmax_inplace(p)  # now the probabilities
        xp.matmul(p, v[:, :keys], out=out[:, lo:hi])


def _attention_backward(g, q, k, v, dq, dk, dv, *probs, blocks, scale):
    """One piece of n attentions: dq, dk, dv (dk, dv zero on entry) from the output gradient g."""
    v_t = xp.swapaxes(v, -1, -2)
    for (lo, hi, keys), p in zip(blocks, probs):
        g_rows = g[:, lo:hi]
        dv[:, :keys] += xp.swapaxes(p, -1, -2) @ g_rows
        ds = g_rows @ v_t[..., :keys]  # dp, then ds in place
        _softmax_backward_inplace(ds, p)
        xp.matmul(ds, k[:, :keys], out=dq[:, lo:hi])
        dk[:, :keys] += xp.swapaxes(ds, -1, -2) @ q[:, lo:hi]
    dq *= scale  # on (T, D) gradients rather than on each (T, T) ds
    dk *= scale


ATTENTION_BLOCK = 64  # query rows per block: small enough to skip most of the masked half


def _query_blocks(T, S, causal):
    """(first row, end row, keys seen) of each block of query rows: causal rows lo..hi-1 see
    keys 0..hi-1; without a mask one block sees all S keys."""
    if not causal:
        return [(0, T, S)]
    return [(lo, min(T, lo + ATTENTION_BLOCK), min(T, lo + ATTENTION_BLOCK)) for lo in range(0, T, ATTENTION_BLOCK)]


_bias_cache: dict = {}


def _causal_bias(T, dtype):
    """(T, T) matrix with 0 on and below the diagonal and -inf above (a query sees no future)."""
    key = (T, str(dtype))
    if key not in _bias_cache:
        _bias_cache[key] = xp.triu(xp.full((T, T), -xp.inf, dtype=dtype), k=1)
    return _bias_cache[key]


def _softmax_backward_inplace(dp, p):
    """dp becomes ds = p ⊙ (dp − rowsum(dp ⊙ p)): softmax's backward over the last axis, in place."""
    dp -= xp.einsum("...ij,...ij->...i", dp, p)[..., None]  # rowsum(dp ⊙ p), no temporary
    dp *= p


def _softmax_inplace(scores, axis=-1):
    """softmax along ``axis``, overwriting ``scores`` (shifted by the max, so exp never overflows).
    Multiplied by 1/sum rather than divided by the sum: one division per row, not per entry. Over
    the last axis of a contiguous array the sums are one matrix-vector product (:func:`_row_sums`:
    an attention block's rows of 256 keys, 35 against 140 us)."""
    scores -= xp.max(scores, axis=axis, keepdims=True)
    xp.exp(scores, out=scores)
    last = axis in (-1, scores.ndim - 1) and scores.flags.c_contiguous
    scores *= 1 / (_row_sums(scores) if last else xp.sum(scores, axis=axis, keepdims=True))
    return scores
