"""Mixture of experts: routing against a brute-force per-token loop, capacity, the aux loss."""

from __future__ import annotations

import math

import numpy
import pytest

from tinytrain import functional as F
from tinytrain.autograd import Tensor
from tinytrain.backend import to_host, xp
from tinytrain.nn import GPT, GPTConfig, MoE
from tinytrain.nn.moe import route
from tinytrain.testing import assert_close, gradcheck


def host(t):
    return to_host(t.data if isinstance(t, Tensor) else t)


def np_gelu(x):
    return 0.5 * x * (1 + numpy.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def np_expert(mlp, x):
    h = np_gelu(x @ host(mlp.fc_1.weight).astype(numpy.float64) + host(mlp.fc_1.bias))
    return h @ host(mlp.fc_2.weight).astype(numpy.float64) + host(mlp.fc_2.bias)


def brute_force(moe, x, capacity=None):
    """y[t] = Σ_k w_k · expert_k(x[t]), one token at a time; assignments over an expert's capacity
    (first come, first served in token order) contribute nothing. Returns (y, counts, probs)."""
    x = x.astype(numpy.float64)
    logits = x @ host(moe.gate.weight).astype(numpy.float64)
    probs = numpy.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    y = numpy.zeros_like(x)
    counts = numpy.zeros(moe.n_experts, dtype=int)
    for t in range(x.shape[0]):
        # top-k, highest probability first, ties to the lower expert id
        chosen = sorted(range(moe.n_experts), key=lambda e: (-probs[t, e], e))[: moe.top_k]
        total = sum(probs[t, e] for e in chosen)
        for e in chosen:
            if capacity is not None and counts[e] >= capacity:
                continue
            counts[e] += 1
            y[t] += probs[t, e] / total * np_expert(moe.experts[e], x[t])
    return y, counts, probs


def random_moe(rng, C=8, E=4, k=2, capacity_factor=0.0):
    moe = MoE(C, 2 * C, E, top_k=k, capacity_factor=capacity_factor, rng=rng)
    # larger gate and bias values than the init so routing and biases really matter
    moe.gate.weight.data[...] = xp.asarray(rng.standard_normal(moe.gate.weight.shape).astype(numpy.float32))
    for expert in moe.experts:
        for lin in (expert.fc_1, expert.fc_2):
            lin.weight.data[...] = xp.asarray((0.3 * rng.standard_normal(lin.weight.shape)).astype(numpy.float32))
            lin.bias.data[...] = xp.asarray((0.3 * rng.standard_normal(lin.bias.shape)).astype(numpy.float32))
    return moe


@pytest.mark.parametrize("E,k", [(4, 1), (4, 2), (3, 3), (5, 2)])
def test_moe_matches_per_token_loop(E, k):
    rng = numpy.random.default_rng()
    moe = random_moe(rng, E=E, k=k)
    x = rng.standard_normal((3, 7, 8)).astype(numpy.float32)
    y = moe(Tensor(xp.asarray(x)))
    assert y.shape == x.shape
    expected, counts, _ = brute_force(moe, x.reshape(-1, 8))
    assert_close(y, expected.reshape(x.shape), atol=1e-5, rtol=1e-4, what=f"MoE E={E} k={k}")
    numpy.testing.assert_array_equal(moe.last_counts, counts)
    assert moe.last_counts.sum() == 21 * k


def test_route_groups_assignments_by_expert():
    rng = numpy.random.default_rng()
    probs = rng.dirichlet(numpy.ones(4), size=10)
    experts, order, counts, kept = route(probs, 2, None)
    assert kept.all() and counts.sum() == 20
    flat = experts.reshape(-1)
    # sorted by expert, then by assignment id
    assert list(order) == sorted(range(20), key=lambda a: (flat[a], a))
    for t in range(10):
        assert list(experts[t]) == list(numpy.argsort(-probs[t], kind="stable")[:2])


def test_capacity_drops_tokens_over_the_limit():
    rng = numpy.random.default_rng()
    C, E = 8, 4
    moe = random_moe(rng, C=C, E=E, k=1, capacity_factor=1.0)
    n = 12
    assert moe.capacity(n) == math.ceil(1.0 * n * 1 / E) == 3
    # make expert 0 everyone's first choice: feature 0 is large and positive and the gate reads it
    x = rng.standard_normal((n, C)).astype(numpy.float32)
    x[:, 0] = 5.0
    moe.gate.weight.data[...] = 0.0
    moe.gate.weight.data[0, :] = xp.asarray(numpy.array([4.0, 0, 0, 0], dtype=numpy.float32))
    y = host(moe(Tensor(xp.asarray(x))))
    expected, counts, _ = brute_force(moe, x, capacity=3)
    assert counts[0] == 3  # the brute force also saw expert 0 overflow
    numpy.testing.assert_array_equal(moe.last_counts, counts)
    assert (moe.last_counts <= 3).all()
    assert_close(y, expected, atol=1e-5, what="MoE with capacity")
    # tokens 3.. lost their only assignment: exactly zero output
    assert numpy.all(y[3:] == 0)
    assert numpy.abs(y[:3]).sum() > 0


def test_capacity_with_top2_against_brute_force():
    rng = numpy.random.default_rng()
    moe = random_moe(rng, E=4, k=2, capacity_factor=0.5)
    x = rng.standard_normal((16, 8)).astype(numpy.float32)
    cap = moe.capacity(16)
    assert cap == math.ceil(0.5 * 16 * 2 / 4)
    y = moe(Tensor(xp.asarray(x)))
    expected, counts, _ = brute_force(moe, x, capacity=cap)
    numpy.testing.assert_array_equal(moe.last_counts, counts)
    assert_close(y, expected, atol=1e-5, what="MoE top-2 capacity")
    # the gradient still reaches the gate and the experts that ran
    y.sum().backward()
    assert numpy.abs(host(moe.gate.weight.grad)).sum() > 0


def test_aux_loss_is_one_under_uniform_gate_and_differentiable():
    rng = numpy.random.default_rng()
    moe = random_moe(rng, E=4, k=2)
    moe.gate.weight.data[...] = 0.0  # every token: probability 1/E for every expert
    x = rng.standard_normal((10, 8)).astype(numpy.float32)
    moe(Tensor(xp.asarray(x)))
    assert moe.aux_loss.item() == pytest.approx(1.0, abs=1e-6)
    moe.aux_loss.backward()
    g = host(moe.gate.weight.grad)
    assert g.shape == moe.gate.weight.shape and numpy.abs(g).sum() > 0
    assert all(p.grad is None for e in moe.experts for p in e.parameters())  # aux touches the gate only


def test_aux_loss_formula_and_imbalance():
    rng = numpy.random.default_rng()
    moe = random_moe(rng, E=4, k=2)
    x = rng.standard_normal((20, 8)).astype(numpy.float32)
    moe(Tensor(xp.asarray(x)))
    _, counts, probs = brute_force(moe, x)
    share = counts / (20 * 2)
    expected = 4 * (share * probs.mean(0)).sum()
    assert moe.aux_loss.item() == pytest.approx(expected, rel=1e-5)
    # routing everything to one expert with high probability costs far more than uniform
    x[:, 0] = 5.0
    moe.gate.weight.data[...] = 0.0
    moe.gate.weight.data[0, :] = xp.asarray(numpy.array([6.0, 0, 0, 0], dtype=numpy.float32))
    moe(Tensor(xp.asarray(x)))
    assert moe.aux_loss.item() > 1.5


def test_moe_gradient_with_respect_to_input():
    rng = numpy.random.default_rng()
    moe = random_moe(rng, C=4, E=3, k=2)
    for p in moe.parameters():
        p.data = p.data.astype(xp.float64)
    x = Tensor(xp.asarray(rng.standard_normal((5, 4))), requires_grad=True)
    gradcheck(lambda t: moe(t), [x], what="MoE wrt input")


def test_moe_rejects_bad_arguments():
    with pytest.raises(ValueError, match="top_k"):
        MoE(8, 16, 2, top_k=3)
    with pytest.raises(ValueError, match="capacity_factor"):
        MoE(8, 16, 2, top_k=1, capacity_factor=-1.0)


def test_gpt_with_experts_every_parameter_gets_a_gradient():
    cfg = GPTConfig(vocab_size=9, block_size=8, n_layer=2, n_head=2, n_embd=16, n_experts=4, moe_top_k=2)
    model = GPT(cfg, seed=0)
    rng = numpy.random.default_rng()
    ids = rng.integers(0, 9, size=(4, 8))
    loss = F.cross_entropy(model(ids), xp.asarray(rng.integers(0, 9, size=(4, 8))))
    aux = model.moe_aux_loss()
    assert aux.item() == pytest.approx(sum(b.mlp.aux_loss.item() for b in model.blocks), rel=1e-6)
    (loss + 0.01 * aux).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert numpy.abs(host(p.grad)).sum() > 0, name
