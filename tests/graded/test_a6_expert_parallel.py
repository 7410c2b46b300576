"""Assignment 6 (expert parallel), graded. Run: ``python -m grader --tasks 6.*``.

Every piece is checked against the serial MoE layer (``tinytrain.nn.moe``) on the whole batch, on
routing drawn when the test runs, skewed (one expert popular: drops) and near-uniform: the gate's
choices, weights and load-balancing loss (and its gradient, summed over ranks), the capacity drops,
dispatch and combine (outputs, input gradients, expert gradients on their owners) and the bytes
each rank sends, and the gradients after 6.4's synchronization on a dp 2 × ep 2 mesh. The tasks
are checked apart: each test uses only its own task's functions.
"""

from __future__ import annotations

import numpy as np
import pytest

from grader.seeds import grading_seed
from tinytrain import distributed as dist
from tinytrain import functional as F
from tinytrain.autograd import Tensor
from tinytrain.backend import to_host, xp
from tinytrain.nn import GPT, GPTConfig, MoE
from tinytrain.nn.moe import dispatch_order, route, slot_counts
from tinytrain.testing import assert_same_kind

N = 4  # the world of these tests: EP 4, or dp 2 × ep 2


def host(a):
    return to_host(a.data if isinstance(a, Tensor) else a)


def close(got, want, what, rtol=1e-7, atol=0.0, dtype=None):
    """Shape and dtype (``dtype`` when the expected values were computed in another) first -- a
    float64 leak, a lost axis -- then the values."""
    assert_same_kind(got, want, what, dtype=dtype)
    np.testing.assert_allclose(host(got), host(want), rtol=rtol, atol=atol, err_msg=what)


def drawn_layer(
    skewed: bool, k: int | None = None, capacity_factor: float | None = None, dtype=np.float64, experts=None
):
    """A MoE layer and a global batch of tokens drawn from the grading seed (the same on every rank)."""
    seed = grading_seed()
    rng = np.random.default_rng(seed)
    E = int(rng.choice([4, 8]))
    E = E if experts is None else experts
    k = int(rng.integers(1, 3)) if k is None else k
    cf = float(rng.uniform(0.5, 1.0)) if capacity_factor is None else capacity_factor
    C, rows = int(rng.integers(3, 7)), N * int(rng.integers(2, 6))
    moe = MoE(C, 2 * C, E, top_k=k, capacity_factor=cf, rng=rng, z_loss=float(rng.uniform(0, 0.2)))
    gate = rng.normal(0, 0.1 if not skewed else 1.0, (C, E))
    x = rng.normal(size=(rows, C))
    if skewed:  # expert 0 is everyone's favourite
        x[:, 0] = np.abs(x[:, 0]) + 2.0
        gate[0, 0] = 3.0
    moe.gate.weight.data = xp.asarray(gate)
    for p in moe.parameters():
        p.data = p.data.astype(dtype)
    what = f"E={E}, k={k}, capacity factor {cf:.2f}, {rows} tokens, {'skewed' if skewed else 'uniform'} (seed {seed})"
    return moe, x, rng, what


def serial_probs(moe, x):
    logits = x @ host(moe.gate.weight)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def my_rows(x, rank=None, size=N):
    r = dist.get_rank() if rank is None else rank
    n = x.shape[0] // size
    return slice(r * n, (r + 1) * n)


def arrive_out_of_expert_order(moe, x) -> None:
    """Route rank 0's first token to expert 1 and rank 1's first to expert 0, whatever the draw, so
    expert 0's owner (experts 0 and 1) receives an expert-1 row before an expert-0 row and must
    regroup. Left to the draw, about 1 in 18 runs (skewed and uniform both) needed no regrouping on
    any rank, and dispatch without it passed. The gate's last input column does it alone: zero for
    every other token, ±50 here, far above what the other columns add to a logit."""
    c, n = x.shape[1] - 1, x.shape[0] // N
    gate = host(moe.gate.weight).copy()
    gate[c] = 0.0
    gate[c, :2] = (-1.0, 1.0)
    x[:, c] = 0.0
    x[0, c], x[n, c] = 50.0, -50.0
    moe.gate.weight.data = xp.asarray(gate)


SKEW = pytest.mark.parametrize("skewed", [True, False], ids=["skewed", "uniform"])


# --- 6.1 the gate and the whole batch's aux loss -----------------------------------------------------


@pytest.mark.task("6.1")
@pytest.mark.world_size(N)
@SKEW
def test_gate_matches_the_serial_layer_on_the_whole_batch(impl, skewed):
    ep = impl.expert_parallel
    moe, x, _, what = drawn_layer(skewed)
    serial = MoE(x.shape[1], 2, moe.n_experts, top_k=moe.top_k, z_loss=moe.z_loss)
    serial.gate.weight.data = moe.gate.weight.data.copy()
    xs = Tensor(xp.asarray(x), requires_grad=True)
    logits = serial.gate(xs)
    probs = F.softmax(logits, axis=-1)
    experts_all = route(host(probs), moe.top_k, None)[0]
    chosen = np.bincount(experts_all.reshape(-1), minlength=moe.n_experts)
    want_aux = serial.router_loss(logits, probs, chosen, x.shape[0])
    want_w = serial.combine_weights(probs, experts_all)
    want_aux.backward()
    mine = my_rows(x)
    xm = Tensor(xp.asarray(x[mine]), requires_grad=True)
    experts, weights, aux, gathered = ep.gate(moe, xm, dist.world())
    assert np.array_equal(np.asarray(experts), experts_all[mine]), f"top-{moe.top_k} choices of my tokens, {what}"
    close(weights, host(want_w)[mine], f"combine weights, {what}", rtol=1e-10)
    counts = np.asarray(gathered)
    assert counts.shape == (N, moe.top_k, moe.n_experts + 1), f"gathered counts shape {counts.shape}, {what}"
    for r in range(N):
        np.testing.assert_array_equal(
            counts[r, :, : moe.n_experts], slot_counts(experts_all[my_rows(x, r)], moe.n_experts)
        )
    total = np.array([aux.item() / N])
    dist.all_reduce(total)
    np.testing.assert_allclose(total[0], want_aux.item(), rtol=1e-10, err_msg=f"aux loss: the ranks' shares, {what}")
    aux.backward()
    g = np.ascontiguousarray(host(moe.gate.weight.grad)) / N
    dist.all_reduce(g)
    np.testing.assert_allclose(g, host(serial.gate.weight.grad), rtol=1e-8, atol=1e-12, err_msg=f"aux gradient, {what}")
    np.testing.assert_allclose(host(xm.grad) / N, host(xs.grad)[mine], rtol=1e-8, atol=1e-12, err_msg=what)


# --- 6.2 capacity ----------------------------------------------------------------------------------------


def gathered_counts(experts_all, E, size=N):
    rows = experts_all.shape[0] // size
    out = np.zeros((size, experts_all.shape[1], E + 1), dtype=np.int64)
    for r in range(size):
        out[r, :, :E] = slot_counts(experts_all[r * rows : (r + 1) * rows], E)
        out[r, :, E] = rows
    return out


@pytest.mark.task("6.2")
@pytest.mark.world_size(N)
@SKEW
def test_drops_are_the_serial_layers_drops(impl, skewed):
    ep = impl.expert_parallel
    moe, x, rng, what = drawn_layer(skewed, k=2, capacity_factor=None)
    moe.capacity_factor = float(rng.uniform(0.3, 0.8))
    probs = serial_probs(moe, x)
    experts_all, _, _, kept_all = route(probs, moe.top_k, moe.capacity(x.shape[0]))
    kept_all = kept_all.reshape(-1, moe.top_k)
    gathered = gathered_counts(experts_all, moe.n_experts)
    for me in range(N):  # every rank checks every rank's decision: no communication here
        got = np.asarray(ep.keep(moe, experts_all[my_rows(x, me)], gathered, me))
        assert np.array_equal(got, kept_all[my_rows(x, me)]), (
            f"rank {me}'s kept assignments differ from the serial layer's on the whole batch, "
            f"capacity {moe.capacity(x.shape[0])}, {what}:\ngot\n{got.astype(int)}\n"
            f"want\n{kept_all[my_rows(x, me)].astype(int)}"
        )
    if skewed:
        assert not kept_all.all(), f"the skewed case drops assignments, {what}"
    moe.capacity_factor = 0.0
    assert np.asarray(ep.keep(moe, experts_all[my_rows(x)], gathered, dist.get_rank())).all(), "no capacity: no drop"


# --- 6.3 dispatch and combine ----------------------------------------------------------------------------


@pytest.mark.task("6.3")
@pytest.mark.world_size(N)
def test_all_to_all_function_forward_and_backward(impl):
    ep = impl.expert_parallel
    seed = grading_seed()
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 4, size=(N, N))  # sizes[src, dst]
    r, width = dist.get_rank(), int(rng.integers(1, 4))
    base = rng.normal(size=(N, int(sizes.sum(axis=1).max()), width))
    x = Tensor(xp.asarray(base[r, : sizes[r].sum()]), requires_grad=True)
    with dist.comm_stats() as s:
        y = ep.AllToAll.apply(x, send_sizes=sizes[r].tolist(), recv_sizes=sizes[:, r].tolist(), group=dist.world())
    starts = np.cumsum(sizes, axis=1) - sizes
    want = np.concatenate([base[p, starts[p, r] : starts[p, r] + sizes[p, r]] for p in range(N)])
    np.testing.assert_array_equal(host(y), want, err_msg=f"rows received, in rank order (seed {seed})")
    assert s.sent("all_to_all") == (sizes[r].sum() - sizes[r, r]) * width * 8, f"bytes sent (seed {seed})"
    ups = [rng.normal(size=(sizes[:, p].sum(), width)) for p in range(N)]  # every rank's upstream gradient
    (y * xp.asarray(ups[r])).sum().backward()
    # the rows I sent to p come home: p's upstream rows for them, in p's received order
    back = np.concatenate([ups[p][(np.cumsum(sizes[:, p]) - sizes[:, p])[r] :][: sizes[r, p]] for p in range(N)])
    np.testing.assert_array_equal(host(x.grad), back, err_msg=f"gradient: the reverse all-to-all (seed {seed})")


@pytest.mark.task("6.3")
@pytest.mark.world_size(N)
@SKEW
def test_dropless_dispatch_runs_every_row_on_its_expert_and_sends_the_formula(impl, skewed):
    ep = impl.expert_parallel
    # Two experts per rank, so the rows that arrive must be regrouped by expert before they run.
    moe, x, _, what = drawn_layer(skewed, capacity_factor=0.0, experts=2 * N)
    arrive_out_of_expert_order(moe, x)
    E, k, r = moe.n_experts, moe.top_k, dist.get_rank()
    experts_all = route(serial_probs(moe, x), k, None)[0]
    mine = my_rows(x)
    experts = experts_all[mine]
    order, counts = dispatch_order(experts, np.ones(experts.shape, dtype=bool), E)
    rows = Tensor(xp.asarray(x[mine][order // k]), requires_grad=True)
    with dist.comm_stats() as fwd:
        out, send, recv = ep.dropless(moe, rows, counts, dist.world())
    # the serial layer's experts, row by row
    want = (
        np.concatenate(
            [
                host(moe.experts[int(e)](Tensor(xp.asarray(x[mine][t // k][None]))))
                for t, e in zip(order, experts.reshape(-1)[order])
            ]
        )
        if order.size
        else np.zeros((0, x.shape[1]))
    )
    close(out, want, f"expert outputs back home, {what}", rtol=1e-10, atol=1e-12)
    per = E // N
    sent = np.bincount(experts.reshape(-1) // per, minlength=N)
    all_sent = np.stack([np.bincount(experts_all[my_rows(x, p)].reshape(-1) // per, minlength=N) for p in range(N)])
    assert list(send) == sent.tolist() and list(recv) == all_sent[:, r].tolist(), f"split sizes, {what}"
    row = x.shape[1] * 8
    moved = row * (sent.sum() - sent[r] + all_sent[:, r].sum() - all_sent[r, r])
    assert fwd.sent("all_to_all") == 8 * (N - 1) * per + moved, f"forward bytes: counts + dispatch + combine, {what}"
    up = np.random.default_rng(grading_seed()).normal(size=(N, *want.shape))[r] if want.size else np.zeros(want.shape)
    with dist.comm_stats() as bwd:
        (out * xp.asarray(up)).sum().backward()
    assert bwd.sent("all_to_all") == moved, f"backward bytes: the two exchanges reversed, {what}"
    # input gradient: each row's expert's vector-Jacobian product, computed locally
    for i, (t, e) in enumerate(zip(order, experts.reshape(-1)[order])):
        leaf = Tensor(xp.asarray(x[mine][t // k][None]), requires_grad=True)
        (moe.experts[int(e)](leaf) * xp.asarray(up[i][None])).sum().backward()
        close(host(rows.grad)[i], host(leaf.grad)[0], f"gradient of dispatched row {i}, {what}", rtol=1e-9, atol=1e-12)


# --- 6.4 gradients on a dp × ep mesh ---------------------------------------------------------------------


@pytest.mark.task("6.4")
@pytest.mark.world_size(N)
def test_sync_gradients_dense_over_the_data_group_experts_over_dp(impl):
    ep_mod = impl.expert_parallel
    seed = grading_seed()
    rng = np.random.default_rng(seed)
    E = 4
    cfg = GPTConfig(vocab_size=8, block_size=4, n_layer=1, n_head=1, n_embd=4, n_experts=E, moe_top_k=2)
    model = GPT(cfg, seed=int(rng.integers(1 << 30)))
    mesh = dist.DeviceMesh({"dp": 2, "ep": 2})
    ep = ep_mod.apply_expert_parallel(model, mesh.get_group("ep"), mesh.get_group("dp"))
    params = list(model.parameters())
    grads = rng.normal(size=(N, sum(p.data.size for p in params)))  # every rank's gradients, drawn alike
    missing = rng.random(size=(N, len(params))) < 0.2  # some ranks have no gradient for some weights
    r = dist.get_rank()
    coords = [(d, e) for d in range(2) for e in range(2)]

    def piece(rank, i):
        start = sum(q.data.size for q in params[:i])
        return grads[rank, start : start + params[i].data.size].reshape(params[i].shape)

    for i, p in enumerate(params):
        p.grad = None if missing[r, i] else xp.asarray(piece(r, i))
    ep.sync_gradients()
    mine = {id(p) for p in ep.parameters(model)}
    d, e = coords[r]
    for i, p in enumerate(params):
        if id(p) not in mine:
            continue
        name = [n for n, q in model.named_parameters() if q is p][0]
        if ep.is_expert(p):  # expert owned by (d', e) for every replica d': average over dp, / ep
            group = [d2 * 2 + e for d2 in range(2)]
            scale = 1 / (2 * 2)
        else:  # dense: average over all 4
            group, scale = list(range(N)), 1 / N
        present = [g for g in group if not missing[g, i]]
        if not present:
            assert p.grad is None, f"{name}: no rank had a gradient, so none after sync (seed {seed})"
            continue
        want = sum(piece(g, i) for g in present) * scale
        what = f"{name}'s gradient on rank {r} (seed {seed})"
        close(p.grad, want, what, rtol=1e-6, atol=1e-7, dtype=p.data.dtype)
