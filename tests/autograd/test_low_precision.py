"""Low precision in the autograd engine and its ops (``--precision bf16|fp16``, ``ops.py``'s docstring).

Every op returns its inputs' dtype and every gradient has its tensor's dtype; matmuls, sums and the
fused ops compute in float32 and round once, so a GPT's loss and gradients in bfloat16 and float16
stay within their rounding of the float32 ones; sums that NumPy would accumulate in the low dtype
(float16 overflows, bfloat16 stalls) do not; ``loss_scaling`` starts backward from the scale.
"""

from __future__ import annotations

import numpy as np
import pytest

from tinytrain import functional as F
from tinytrain import random
from tinytrain.autograd import Tensor, loss_scaling
from tinytrain.backend import device, precision_dtype, to_host, xp
from tinytrain.nn import GPT, GPTConfig

LOW = ["fp16"] + (["bf16"] if device == "cpu" else [])  # CuPy has no bfloat16
# bf16 keeps 8 significant bits (relative rounding 2^-9), fp16 11 (2^-12): what one rounding costs,
# with room for a few in a row
TOLERANCE = {"bf16": 0.03, "fp16": 0.005}


def config(**kw):
    return GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=4, n_embd=32, **kw)


def loss_and_grads(precision, dropout=0.1):
    model = GPT(config(dropout=dropout), seed=0).to(precision_dtype(precision))
    rng = np.random.default_rng(3)
    x, y = rng.integers(0, 16, size=(4, 8)), rng.integers(0, 16, size=(4, 8))
    random.manual_seed((0, 1))
    loss = model.loss(x, y)
    loss.backward()
    return loss, {n: p for n, p in model.named_parameters()}


@pytest.mark.parametrize("precision", LOW)
def test_a_gpt_in_low_precision_keeps_its_dtype_and_stays_near_float32(precision):
    dtype = precision_dtype(precision)
    ref_loss, ref = loss_and_grads("fp32")
    loss, params = loss_and_grads(precision)
    assert loss.dtype == np.float32, "the loss is a float32 statistic"
    assert abs(loss.item() - ref_loss.item()) < TOLERANCE[precision] * abs(ref_loss.item())
    for name, p in params.items():
        assert p.data.dtype == dtype and p.grad.dtype == dtype, (name, p.data.dtype, p.grad.dtype)
        want, got = to_host(ref[name].grad).astype(np.float64), to_host(p.grad).astype(np.float64)
        if name.endswith("attn.k.bias"):  # exactly zero in exact arithmetic (softmax ignores a shift)
            continue
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 4 * TOLERANCE[precision], f"{precision} {name}: gradient off by {err:.3g} of its largest entry"


EPS = {"bf16": 2.0**-7, "fp16": 2.0**-10}  # the spacing of the numbers in [1, 2): one ulp, relative


@pytest.mark.parametrize("precision", LOW)
def test_sums_accumulate_in_float32(precision):
    """Column sums of 1000 rows near 0.1, within one ulp of the exact sum: NumPy's own sum along an
    axis accumulates float16 in float16 (0.6% off here) and bfloat16 in bfloat16 (100k such values
    sum to 64); tinytrain's Sum, Mean, and the bias gradients of Linear and a broadcast Add do not."""
    dtype = precision_dtype(precision)
    values = np.random.default_rng(0).uniform(0.05, 0.15, size=(1000, 100)).astype(dtype)
    exact = values.astype(np.float64).sum(axis=0)
    x = Tensor(xp.asarray(values), requires_grad=True)

    def assert_exact_sums(got, want, what):
        got = to_host(got).astype(np.float64)
        assert np.all(np.abs(got - want) <= EPS[precision] * want), f"{what}: off by {np.abs(got / want - 1).max():.2g}"

    assert x.sum(axis=0).dtype == dtype and x.mean(axis=0).dtype == dtype
    assert_exact_sums(x.sum(axis=0).data, exact, "Sum")
    assert_exact_sums(x.mean(axis=0).data, exact / 1000, "Mean")
    w = Tensor(xp.eye(100, dtype=dtype), requires_grad=True)
    b = Tensor(xp.zeros(100, dtype=dtype), requires_grad=True)
    c = Tensor(xp.zeros(100, dtype=dtype), requires_grad=True)
    out = F.linear(Tensor(xp.ones((1000, 100), dtype=dtype)), w, b) + c
    out.backward(xp.asarray(values))  # d/db and d/dc: the column sums of the incoming gradient
    for g, what in ((b.grad, "Linear's bias gradient"), (c.grad, "a broadcast Add's gradient")):
        assert g.dtype == dtype
        assert_exact_sums(g, exact, what)


def test_a_gradient_has_its_tensors_dtype():
    """A float32 loss of float16 logits hands them a float16 gradient (the engine casts)."""
    logits = Tensor(xp.zeros((3, 5), dtype=np.float16), requires_grad=True)
    h = logits * 2.0  # a non-leaf: the cast happens between ops, not only at the leaf
    loss = F.cross_entropy(h, xp.asarray([0, 1, 2]))
    assert loss.dtype == np.float32 and h.dtype == np.float16
    loss.backward()
    assert logits.grad.dtype == np.float16
    assert np.allclose(to_host(logits.grad).astype(np.float32)[0], 2 * (np.full(5, 0.2) - np.eye(5)[0]) / 3, atol=1e-3)


def test_loss_scaling_starts_backward_from_the_scale():
    w = Tensor(xp.asarray([1.0, 2.0], dtype=np.float32), requires_grad=True)
    with loss_scaling(1024.0):
        (w * w).sum().backward()
    assert to_host(w.grad).tolist() == [2048.0, 4096.0]
    w.grad = None
    (w * w).sum().backward()  # outside: from 1 again
    assert to_host(w.grad).tolist() == [2.0, 4.0]
