"""The backward engine: accumulation, graph order, hooks, retain_graph, no_grad, saved bytes."""

import gc

import numpy as np
import pytest

import tinytrain.functional as F
from tinytrain.autograd import (
    Function,
    Parameter,
    Tensor,
    enable_grad,
    is_grad_enabled,
    no_grad,
    op_timer,
    peak_saved_bytes,
    reset_peak_saved_bytes,
    saved_bytes,
    timed,
)
from tinytrain.testing import assert_close, gradcheck


def T(a, grad=True):
    return Tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


# --- gradients reach every use --------------------------------------------------------------


def test_tensor_used_twice_gets_both_gradients(rng):
    x = T(rng.standard_normal(4))
    (x * x).sum().backward()
    assert_close(x.grad, 2 * x.data, what="d(x*x)/dx")
    y = T(rng.standard_normal(4))
    (y.exp() + y * 3).sum().backward()  # two branches from one leaf
    assert_close(y.grad, np.exp(y.data) + 3, what="two branches")


def test_intermediate_used_by_its_own_descendant(rng):
    # out = h + exp(h): the second use of h is computed *from* h, so h's gradient is complete only
    # after exp's backward has run. The graph order must respect that whatever the input order.
    x, w = T(rng.standard_normal(3)), T(rng.standard_normal(3))
    h = x * w
    (h + h.exp()).sum().backward()
    assert_close(x.grad, w.data * (1 + np.exp(x.data * w.data)), what="h + exp(h)")
    x.grad = None
    h = x * w
    (h.exp() + h).sum().backward()
    assert_close(x.grad, w.data * (1 + np.exp(x.data * w.data)), what="exp(h) + h")


def test_random_graphs(rng):
    """Random DAGs of shared intermediates: every order of reuse must give the right gradient."""
    ops = [lambda a, b: a + b, lambda a, b: a * b, lambda a, b: (a - b).tanh(), lambda a, b: a * 0.5 + b.exp() * 0.1]
    plan = [(int(rng.integers(len(ops))), int(rng.integers(2**16)), int(rng.integers(2**16))) for _ in range(8)]

    def fn(x, y):
        nodes = [x, y]
        for op, i, j in plan:
            nodes.append(ops[op](nodes[i % len(nodes)], nodes[j % len(nodes)]))
        return nodes[-1] + nodes[-2] * nodes[-3]

    gradcheck(fn, [T(rng.standard_normal(3) * 0.5), T(rng.standard_normal(3) * 0.5)], what=f"plan {plan}")


def test_gradients_accumulate_across_backward_calls(rng):
    x = T(rng.standard_normal(3))
    (x * 2).sum().backward()
    (x * x).sum().backward()
    assert_close(x.grad, 2 + 2 * x.data, what="accumulated gradient")


def test_unbroadcasting():
    a, b = T(np.ones((3, 1))), T(np.ones(4))
    c = T(2.0)
    (a + b * c).sum().backward()
    assert a.grad.shape == (3, 1) and b.grad.shape == (4,) and c.grad.shape == ()
    assert_close(a.grad, np.full((3, 1), 4.0), atol=0, what="a, stretched over 4 columns")
    assert_close(b.grad, np.full(4, 6.0), atol=0, what="b, added over 3 rows, times c")
    assert_close(c.grad, 12.0, atol=0, what="0-d c")


def test_float32_stays_float32(rng):
    """A float32 model's gradients stay float32 all the way (no silent float64 promotion)."""
    x = Tensor(rng.standard_normal((2, 3, 4)).astype(np.float32), requires_grad=True)
    w = Tensor(rng.standard_normal((4, 4)).astype(np.float32), requires_grad=True)
    seen = []
    x.register_hook(lambda g: seen.append(g.dtype))
    w.register_hook(lambda g: seen.append(g.dtype))
    outs = [
        x + 1.5,
        x * 2.0,
        x / 3.0,
        2.0 / (x * x + 1),
        -x,
        (x * x + 1) ** 0.5,
        2.0**x,
        x @ w,
        x.sum(),
        x.mean(axis=1),
        x.max(axis=-1),
        x.max(),
        x.var(axis=(0, 2)),
        x.exp(),
        (x * x + 1).log(),
        (x * x + 1).sqrt(),
        x.tanh(),
        x.relu(),
        F.gelu(x),
        x.softmax(),
        F.log_softmax(x),
        F.cross_entropy(x, np.zeros((2, 3), dtype=np.int64)),
        x.reshape(-1),
        x.permute(2, 0, 1),
        x[0, 1:],
        x[np.array([1, 1])],
        F.concatenate([x, x], axis=1),
        F.stack([x, x]),
        x.split(2, axis=-1)[1],
        x.masked_fill(x.data > 0, 0.0),
        F.embedding(np.array([0, 3]), w),
        F.layer_norm(x, w[0], w[1]),
        F.dropout(x, 0.5),
        F.scaled_dot_product_attention(x, x, x),
        F.linear(x, w, w[0]),
        x.astype(np.float64).astype(np.float32),
    ]
    for i, out in enumerate(outs):
        assert out.dtype == np.float32, f"output {i} is {out.dtype}"
    total = outs[0].sum()
    for out in outs[1:]:
        total = total + out.sum()
    total.backward()
    assert set(seen) == {np.dtype(np.float32)}, seen
    assert x.grad.dtype == np.float32 and w.grad.dtype == np.float32


# --- hooks ----------------------------------------------------------------------------------


def test_register_hook_replaces_the_gradient(rng):
    x = T(rng.standard_normal(3))
    handle = x.register_hook(lambda g: g * 10)
    (x * 2).sum().backward()
    assert_close(x.grad, np.full(3, 20.0), atol=0, what="leaf hook")
    handle.remove()
    x.grad = None
    (x * 2).sum().backward()
    assert_close(x.grad, np.full(3, 2.0), atol=0, what="after remove()")
    # a hook on an intermediate changes what flows further back; one returning None only observes
    x.grad = None
    h = x * 3
    seen = []
    h.register_hook(lambda g: seen.append(g.copy()))
    h.register_hook(lambda g: -g)
    h.sum().backward()
    assert_close(seen[0], np.ones(3), atol=0, what="observed gradient of h")
    assert_close(x.grad, np.full(3, -3.0), atol=0, what="leaf behind a negating hook")


def test_post_accumulate_hooks_fire_during_backward_in_order(rng):
    early, late = T(rng.standard_normal(3)), T(rng.standard_normal(3))
    x = T(rng.standard_normal(3), grad=False)
    events = []

    def record(name):
        def hook(t):
            # runs after t.grad is complete, and before backward has reached the other leaf
            events.append((name, t.grad is not None, early.grad is None))

        return hook

    early.register_post_accumulate_grad_hook(record("early"))
    late.register_post_accumulate_grad_hook(record("late"))
    h = (x * early).tanh()  # early: used only at the start of the chain
    h = (h * 2).exp() + h  # (h reused further down)
    loss = (h * late * late).sum()  # late: used only next to the loss, twice
    loss.backward()
    assert events == [("late", True, True), ("early", True, False)]
    assert_close(late.grad, 2 * late.data * h.data, what="late.grad when its hook fired")


def test_post_accumulate_hook_fires_for_a_leaf_without_gradient(rng):
    class FirstOnly(Function):  # passes the gradient to its first input only
        @staticmethod
        def forward(ctx, a, b):
            return a * 1.0

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    a, unused = T(rng.standard_normal(2)), T(rng.standard_normal(2))
    fired = []
    unused.register_post_accumulate_grad_hook(lambda t: fired.append(t.grad))
    FirstOnly.apply(a, unused).sum().backward()
    assert fired == [None] and unused.grad is None
    assert_close(a.grad, np.ones(2), atol=0, what="a.grad")
    with pytest.raises(RuntimeError, match="leaf"):
        (a * 2).register_post_accumulate_grad_hook(lambda t: None)


# --- graph lifetime -------------------------------------------------------------------------


def test_backward_twice_needs_retain_graph(rng):
    x = T(rng.standard_normal(3))
    loss = (x.exp() * 2).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()
    x.grad = None
    loss = (x.exp() * 2).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert_close(x.grad, 4 * np.exp(x.data), what="two backwards through a retained graph")


def test_no_grad_records_nothing(rng):
    x = T(rng.standard_normal(3))
    before = saved_bytes()
    with no_grad():
        assert not is_grad_enabled()
        y = (x.exp() * x).sum()
        with enable_grad():
            z = x * x
    assert is_grad_enabled()
    assert not y.requires_grad and y._ctx is None
    assert z.requires_grad  # enable_grad inside no_grad records again
    del z
    assert saved_bytes() == before
    with pytest.raises(RuntimeError, match="does not require grad"):
        y.backward()


def test_a_backward_inside_a_functions_backward_says_gradients_are_off_there(rng):
    """Task 8.1's first error: a recomputation inside a Function's backward builds no graph, since
    every backward runs under no_grad(); the message says so and names enable_grad()."""
    seen = []

    class Recompute(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved
            again = T(x) * 2  # recomputed, but gradients are off in here
            try:
                again.sum().backward()
            except RuntimeError as exc:
                seen.append(str(exc))
            return grad * 2

    x = T(rng.standard_normal((2, 3)))
    Recompute.apply(x).sum().backward()
    assert seen and "runs every Function's backward under no_grad()" in seen[0] and "enable_grad()" in seen[0]


def test_backward_of_a_non_scalar(rng):
    x = T(rng.standard_normal((2, 3)))
    y = x * 2
    with pytest.raises(RuntimeError, match="scalar"):
        y.backward()
    with pytest.raises(ValueError, match="shape"):
        y.backward(np.ones(3))
    w = rng.standard_normal((2, 3))
    y.backward(w)
    assert_close(x.grad, 2 * w, what="backward with an explicit gradient")
    leaf = T(np.ones(2))
    leaf.backward(np.array([3.0, 4.0]))  # backward on a leaf: its gradient is the given one
    assert_close(leaf.grad, [3.0, 4.0], atol=0, what="leaf backward")


def test_detach(rng):
    x = T(rng.standard_normal(3))
    d = (x * 2).detach()
    assert not d.requires_grad and d.is_leaf
    assert x.detach().data is x.data  # shares the array
    (x * d).sum().backward()  # d is a constant: no gradient flows through it to x
    assert_close(x.grad, 2 * x.data, what="gradient past a detached tensor")


def test_requires_grad_needs_floating_point():
    with pytest.raises(TypeError, match="floating-point"):
        Tensor(np.arange(3), requires_grad=True)
    with pytest.raises(TypeError):
        Parameter(np.arange(3))
    with pytest.raises(RuntimeError, match="leaf"):
        (T(np.ones(2)) * 2).requires_grad_(False)
    assert Tensor(1.5).dtype == np.float32  # Python floats default to float32
    assert T(np.ones(2)).sum().dtype == np.float64  # a 0-d result keeps its dtype


# --- saved bytes ----------------------------------------------------------------------------


def test_saved_bytes_lifecycle(rng):
    gc.collect()
    start = saved_bytes()
    x = T(rng.standard_normal((8, 8)))
    h = x.exp()  # saves its output (512 bytes)
    after_exp = saved_bytes()
    assert after_exp == start + h.nbytes
    loss = (h * x).tanh().sum()
    assert saved_bytes() > after_exp
    reset_peak_saved_bytes()
    peak = peak_saved_bytes()
    assert peak == saved_bytes()
    del h
    loss.backward()
    assert saved_bytes() == start, "backward frees what it saved"
    assert peak_saved_bytes() == peak  # the peak remembers
    # a graph dropped without backward (evaluation with grad on) frees its bytes too
    loss = (x.exp() * x).tanh().sum()
    assert saved_bytes() > start
    del loss
    assert saved_bytes() == start, "dropping an un-backwarded graph frees its bytes"
    # retain_graph keeps them until the graph goes
    loss = x.exp().sum()
    loss.backward(retain_graph=True)
    assert saved_bytes() == start + x.nbytes
    del loss
    assert saved_bytes() == start


def test_saved_bytes_counts_a_buffer_once_and_skips_parameters(rng):
    gc.collect()
    start = saved_bytes()
    x = T(rng.standard_normal((4, 4)))
    y = x * x  # saves x twice in one context
    assert saved_bytes() == start + x.nbytes
    w1, w2 = T(rng.standard_normal((4, 4))), T(rng.standard_normal((4, 4)))
    a, b = x * w1, x * w2  # x saved again by two more contexts: still once
    assert saved_bytes() == start + x.nbytes + w1.nbytes + w2.nbytes
    del y, a, b
    assert saved_bytes() == start
    p = Parameter(rng.standard_normal((4, 4)))
    q = Parameter(rng.standard_normal(4))
    out = F.linear(x, p, q)  # saves x and the weight; the weight is a parameter
    assert saved_bytes() == start + x.nbytes
    z = x * p
    assert saved_bytes() == start + x.nbytes
    out.sum().backward()
    del z
    assert saved_bytes() == start


def test_op_timer_times_each_functions_forward_and_backward(rng):
    """The per-op timer behind ``bench step --profile``: inside, every Function's forward and
    backward (and blocks under ``timed``) add their seconds under their own names; outside, nothing."""
    x, w = T(rng.standard_normal((3, 4))), T(rng.standard_normal((4, 2)))
    with op_timer() as seconds:
        loss = F.gelu(F.linear(x, w)).sum()
        loss.backward()
        with timed("update"):
            pass
    assert set(seconds) == {
        "Linear forward",
        "GELU forward",
        "Sum forward",
        "Sum backward",
        "GELU backward",
        "Linear backward",
        "update",
    }
    assert all(s >= 0 for s in seconds.values())
    before = dict(seconds)
    F.gelu(x).sum().backward()
    assert seconds == before, "nothing is timed outside the block"
