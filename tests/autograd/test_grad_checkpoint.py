"""``autograd.checkpoint``: the same numbers as a plain call, fewer bytes kept, hooks, outputs,
constants, its context, and the dropout masks it must draw again (``tinytrain.random``)."""

from __future__ import annotations

import numpy as np
import pytest

import tinytrain.functional as F
from tinytrain import random
from tinytrain.autograd import Parameter, Tensor, checkpoint, no_grad, saved_bytes
from tinytrain.backend import to_host
from tinytrain.nn import Dropout, Linear


def mlp(rng, width=6):
    fc1, fc2 = Linear(width, 4 * width, rng=rng), Linear(4 * width, width, rng=rng)

    def fn(x):
        return fc2(F.gelu(fc1(x)))

    return fn, fc1.parameters() + fc2.parameters()


def grads_of(loss_fn, x, params):
    for p in params:
        p.grad = None
    x.grad = None
    loss = loss_fn()
    loss.backward()
    return loss.item(), x.grad.copy(), [p.grad.copy() for p in params]


def test_the_same_loss_and_gradients_bit_for_bit(rng):
    fn, params = mlp(rng)
    x = Tensor(rng.standard_normal((3, 5, 6)).astype(np.float32), requires_grad=True)
    plain = grads_of(lambda: (fn(x) * fn(x).tanh()).sum(), x, params)
    kept = grads_of(lambda: (checkpoint(fn, x) * checkpoint(fn, x).tanh()).sum(), x, params)
    assert plain[0] == kept[0]
    assert np.array_equal(plain[1], kept[1])
    assert all(np.array_equal(a, b) for a, b in zip(plain[2], kept[2]))


def test_only_the_inputs_are_kept_until_backward(rng):
    fn, _ = mlp(rng)
    x = Tensor(rng.standard_normal((4, 6)).astype(np.float32), requires_grad=True)
    before = saved_bytes()
    y = fn(x)
    plain = saved_bytes() - before
    del y
    y = checkpoint(fn, x)
    assert saved_bytes() - before == x.nbytes < plain  # x; the plain graph keeps x, gelu's arrays, ...
    y.sum().backward()
    assert saved_bytes() == before  # the recomputed graph is gone too


def test_parameters_get_their_gradients_and_hooks_from_the_recompute(rng):
    fn, params = mlp(rng)
    fired = []
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda p, i=i: fired.append(i))
    x = Tensor(rng.standard_normal((2, 6)).astype(np.float32), requires_grad=True)
    checkpoint(fn, x).sum().backward()
    assert sorted(fired) == list(range(len(params)))  # each once
    assert all(p.grad is not None for p in params)


def test_a_parameter_used_outside_its_segment_too_gets_the_sum_but_two_hook_calls(rng):
    """The documented limit: the recompute's backward finishes it, and so does the outer graph."""
    w = Parameter(rng.standard_normal(4).astype(np.float32))
    calls = []
    w.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.copy()))
    x = Tensor(rng.standard_normal(4).astype(np.float32), requires_grad=True)
    (checkpoint(lambda x: x * w, x) + w * 2).sum().backward()
    np.testing.assert_array_equal(to_host(w.grad), to_host(x.data) + 2)
    assert len(calls) == 2


def test_token_ids_as_the_only_input_still_train_the_segment(rng):
    """A constant input (ids) needs no gradient, but the segment's parameters do."""
    table = Parameter(rng.standard_normal((10, 3)).astype(np.float32))
    ids = np.array([[1, 2, 2]])
    checkpoint(lambda i: F.embedding(i, table), ids).sum().backward()
    want = np.zeros((10, 3), dtype=np.float32)
    want[1], want[2] = 1, 2
    np.testing.assert_array_equal(to_host(table.grad), want)


def test_a_tuple_of_outputs_each_carries_its_gradient(rng):
    w = Parameter(rng.standard_normal(5).astype(np.float32))
    x = Tensor(rng.standard_normal(5).astype(np.float32), requires_grad=True)

    def two(x):
        return x * w, (x * x).sum()

    a, b = checkpoint(two, x)
    ((a * 3).sum() + b * 2).backward()
    np.testing.assert_allclose(to_host(x.grad), to_host(3 * w.data + 4 * x.data), rtol=1e-6)
    np.testing.assert_allclose(to_host(w.grad), to_host(3 * x.data), rtol=1e-6)
    x.grad = w.grad = None
    a, b = checkpoint(two, x)
    (b * 2).backward()  # the first output unused: the second's gradient still comes through
    np.testing.assert_allclose(to_host(x.grad), to_host(4 * x.data), rtol=1e-6)
    assert w.grad is None


def test_context_wraps_the_forward_and_the_recompute_with_its_backward(rng):
    phases = []

    class Phase:
        def __init__(self, phase):
            self.phase = phase

        def __enter__(self):
            phases.append(f"enter {self.phase}")

        def __exit__(self, *exc):
            phases.append(f"exit {self.phase}")

    def fn(x):
        phases.append("run")
        return x * 2

    x = Tensor(np.ones(3, dtype=np.float32), requires_grad=True)
    y = checkpoint(fn, x, context=Phase)
    y.register_hook(lambda g: phases.append("grad arrives"))
    y.sum().backward()
    assert phases == ["enter forward", "run", "exit forward", "grad arrives", "enter backward", "run", "exit backward"]
    with no_grad():
        phases.clear()
        checkpoint(fn, x, context=Phase)
    assert phases == ["enter forward", "run", "exit forward"]  # evaluation: nothing to recompute


def test_nested_segments(rng):
    fn, params = mlp(rng)
    x = Tensor(rng.standard_normal((2, 6)).astype(np.float32), requires_grad=True)
    plain = grads_of(lambda: (fn(x) ** 2).sum(), x, params)
    nested = grads_of(lambda: (checkpoint(lambda x: checkpoint(fn, x) * 1.0, x) ** 2).sum(), x, params)
    assert plain[0] == nested[0] and np.array_equal(plain[1], nested[1])


def test_dropout_draws_the_forward_mask_again_outside_its_batch_rows(rng):
    """A pipeline runs a micro-batch's backward outside the ``batch_rows`` of its forward: the
    recompute restores them (and the seed), so the mask, and the gradient, are the forward's."""
    drop = Dropout(0.5)
    drop.site = "blocks.0.drop"
    x = Tensor(np.ones((2, 8), dtype=np.float32), requires_grad=True)
    random.manual_seed((3, 1))
    with random.batch_rows(2, 4):
        y = checkpoint(drop, x)
    random.manual_seed((3, 2))  # a later seed, and no rows: what the recompute must not see
    y.sum().backward()
    np.testing.assert_array_equal(to_host(x.grad), to_host(y.data))  # 2 where the mask kept, else 0


@pytest.mark.parametrize("how", ["no site", "own generator"])
def test_dropout_that_cannot_draw_its_mask_again_is_refused(how):
    x = Tensor(np.ones(4, dtype=np.float32), requires_grad=True)
    if how == "no site":
        fn = Dropout(0.5)
    else:

        def fn(x):
            return F.dropout(x, 0.5, generator=random.generator(0), site="a")

    with pytest.raises(ValueError, match="must draw from its site's generator"):
        checkpoint(fn, x)
    assert not random.in_segment()
    F.dropout(x, 0.5)  # outside a segment the global generator is fine
