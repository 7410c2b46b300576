"""``gradcheck`` and ``assert_close`` themselves: they pass right answers and explain wrong ones."""

import numpy as np
import pytest

from tinytrain.autograd import Function, Tensor
from tinytrain.testing import assert_close, gradcheck


class WrongMul(Function):
    """a * b with the gradient of b wrong at one element."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved
        gb = grad * a
        gb.flat[2] += 0.5
        return grad * b, gb


class WrongShape(Function):
    @staticmethod
    def forward(ctx, a):
        return a.sum(axis=0)

    @staticmethod
    def backward(ctx, grad):
        return (grad,)  # forgot to broadcast back to the input's shape


def test_gradcheck_names_the_input_and_element(rng):
    a, b = (Tensor(rng.standard_normal((2, 3)), requires_grad=True) for _ in range(2))
    with pytest.raises(AssertionError) as info:
        gradcheck(WrongMul.apply, [a, b], what="wrong mul")
    message = str(info.value)
    assert "wrong mul" in message and "input 1" in message and "index (0, 2)" in message
    assert "analytic" in message and "numeric" in message
    assert gradcheck(lambda x, y: x * y, [a, b])
    assert a.grad is None and a.dtype == np.float64, "the caller's tensors are not touched"


def test_gradcheck_checks_shapes_and_needs_an_input(rng):
    x = Tensor(rng.standard_normal((2, 3)), requires_grad=True)
    with pytest.raises(AssertionError, match="shape"):
        gradcheck(WrongShape.apply, [x])
    with pytest.raises(ValueError, match="requires grad"):
        gradcheck(lambda t: t * 2, [Tensor(np.ones(2))])


def test_gradcheck_runs_in_float64(rng):
    # float32 inputs are checked as float64 copies, so the tight default tolerance still holds
    x = Tensor(rng.standard_normal(5).astype(np.float32), requires_grad=True)
    assert gradcheck(lambda t: (t * t).tanh(), [x])
    # non-Tensor arguments pass through unchanged
    assert gradcheck(lambda t, k: t * k, [x, 3])


def test_assert_close_reports_the_worst_element():
    assert_close(np.ones(3), [1.0, 1.0, 1.0 + 1e-7], what="nearly equal")
    assert_close(Tensor(np.array([np.nan, np.inf])), np.array([np.nan, np.inf]), what="nan and inf")
    expected = np.zeros((2, 3))
    actual = expected.copy()
    actual[0, 1], actual[1, 2] = 1e-3, 5e-2
    with pytest.raises(AssertionError) as info:
        assert_close(actual, expected, atol=1e-4, rtol=0, what="grad of w")
    message = str(info.value)
    assert message.startswith("grad of w: 2 of 6 elements differ")
    assert "index (1, 2)" in message and "got 0.05" in message and "expected 0" in message
    with pytest.raises(AssertionError, match="shape"):
        assert_close(np.ones(3), np.ones(4))
    with pytest.raises(AssertionError, match="1 of 1"):
        assert_close(np.nan, 1.0, what="scalar")
