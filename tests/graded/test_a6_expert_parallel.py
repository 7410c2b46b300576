"""Assignment 6 (expert parallel), graded. Run: ``python -m grader --tasks 6.*``.

Every piece is checked against the serial MoE layer (``tinytrain.nn.moe``) on the whole batch, on
routing drawn when the test runs, skewed (one expert popular: drops) and near-uniform: the gate's
choices, weights and load-balancing loss (and its gradient, summed over ranks), the capacity drops,
dispatch and combine (outputs, input gradients) and the bytes each rank sends, and the gradients
after 6.4's synchronization on a dp 2 × ep 2 mesh; the routing bias of loss-free balancing (6.5)
against the paper's rule. The tasks are checked apart: each test uses only its own task's
functions.

Besides the drawn configuration every test runs fixed hard cases, whatever the draw: top-1
(Switch) and top-2 (GShard) routing, a dp 2 × ep 2 mesh (the data group is not the EP group),
3 ranks, empty pieces (a rank that sends nothing, a rank whose experts receive nothing, an expert
no token reached, a gradient no rank has) and strided (non-contiguous) inputs.
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
from tinytrain.testing import assert_close, assert_same_kind, clean_factor

N = 4  # the world of these tests: EP 4, or dp 2 × ep 2 (or 3 of the 4 ranks)


def host(a):
    return to_host(a.data if isinstance(a, Tensor) else a)


def close(got, want, what, rtol=1e-7, atol=0.0, dtype=None):
    """Shape and dtype (``dtype`` when the expected values were computed in another) first -- a
    float64 leak, a lost axis -- then the values, naming the worst element."""
    assert_same_kind(got, want, what, dtype=dtype)
    assert_close(host(got), host(want), atol=atol, rtol=rtol, what=what)


def same(got, want, what, dtype=None):
    """Integers or booleans, exactly: shape and dtype, then the first entry that differs."""
    got, want = np.asarray(got), np.asarray(want)
    assert_same_kind(got, want, what, dtype=dtype)
    bad = np.argwhere(got != want)
    if bad.size:
        i = tuple(int(j) for j in bad[0])
        raise AssertionError(
            f"{what}: {len(bad)} of {want.size} entries differ; first at index {i}: got {got[i]}, expected "
            f"{want[i]}\ngot\n{got.astype(int)}\nexpected\n{want.astype(int)}"
        )


def drawn_layer(
    skewed: bool,
    k: int | None = None,
    capacity_factor: float | None = None,
    dtype=np.float64,
    experts=None,
    size=N,
    width=None,
):
    """A MoE layer and a global batch of tokens drawn from the grading seed (the same on every rank):
    ``size`` ranks' blocks of rows."""
    seed = grading_seed()
    rng = np.random.default_rng(seed)
    E = int(rng.choice([4, 8]))
    E = E if experts is None else experts
    k = int(rng.integers(1, 3)) if k is None else k
    cf = float(rng.uniform(0.5, 1.0)) if capacity_factor is None else capacity_factor
    C, rows = int(rng.integers(3, 7)), size * int(rng.integers(2, 6))
    C = C if width is None else width
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


def rows_of(x, rank, size=N) -> str:
    s = my_rows(x, rank, size)
    return f"rows {s.start}-{s.stop - 1}"


def mesh_2x2():
    """(ep group, dp group, my data rank d·EP + e) of a dp 2 × ep 2 mesh: rank 2d + e."""
    mesh = dist.DeviceMesh({"dp": 2, "ep": 2})
    return mesh.get_group("ep"), mesh.get_group("dp"), 2 * mesh.coords["dp"] + mesh.coords["ep"]


def arrive_out_of_expert_order(moe, x, size=N) -> None:
    """Route the first token of every even data rank to expert 1 and of every odd one to expert 0,
    whatever the draw, so expert 0's owner (experts 0 and 1) receives an expert-1 row before an
    expert-0 row and must regroup. Left to the draw, about 1 in 18 runs (skewed and uniform both)
    needed no regrouping on any rank, and dispatch without it passed. The gate's last input column
    does it alone: zero for every other token, ±50 here, far above what the other columns add."""
    c, n = x.shape[1] - 1, x.shape[0] // size
    gate = host(moe.gate.weight).copy()
    gate[c] = 0.0
    gate[c, :2] = (-1.0, 1.0)
    x[:, c] = 0.0
    for d in range(size):
        x[d * n, c] = 50.0 if d % 2 == 0 else -50.0
    moe.gate.weight.data = xp.asarray(gate)


SKEW = pytest.mark.parametrize("skewed", [True, False], ids=["skewed", "uniform"])


# --- 6.1 the gate and the whole batch's aux loss -----------------------------------------------------

# case: (k, on a dp 2 × ep 2 mesh); k None: drawn. "biased": --balance bias, a drawn routing bias
GATE_CASES = {
    "drawn": (None, False),
    "top1": (1, False),
    "top2": (2, False),
    "mesh-2x2": (2, True),
    "biased": (2, True),
}


@pytest.mark.task("6.1")
@pytest.mark.world_size(N)
@SKEW
@pytest.mark.parametrize("case", list(GATE_CASES))
def test_gate_matches_the_serial_layer_on_the_whole_batch(impl, skewed, case):
    ep = impl.expert_parallel
    k, on_mesh = GATE_CASES[case]
    moe, x, rng, what = drawn_layer(skewed, k=k)
    E, k, D = moe.n_experts, moe.top_k, N
    bias = np.zeros(E)
    if case == "biased":  # the top-k choice ranks probs + bias; the combine weights stay the probs
        moe.balance, moe.route_bias = "bias", rng.normal(0, 0.3, E)
        bias = moe.route_bias.copy()
        what = f"routing bias {np.round(bias, 3).tolist()} (balance 'bias'), {what}"
    if on_mesh:
        ep_group, dp_group, me = mesh_2x2()
        what = f"dp 2 × ep 2 mesh, rank {dist.get_rank()} = data rank {me} (its {rows_of(x, me)}), {what}"
    else:
        ep_group, dp_group, me = dist.world(), None, dist.get_rank()
        what = f"ep {N}, rank {me} ({rows_of(x, me)}), {what}"
    serial = MoE(x.shape[1], 2, E, top_k=k, z_loss=moe.z_loss)
    serial.gate.weight.data = moe.gate.weight.data.copy()
    xs = Tensor(xp.asarray(x), requires_grad=True)
    logits = serial.gate(xs)
    probs = F.softmax(logits, axis=-1)
    experts_all = route(host(probs) + bias, k, None)[0]
    chosen = np.bincount(experts_all.reshape(-1), minlength=E)
    want_aux = serial.router_loss(logits, probs, chosen, x.shape[0])
    want_w = serial.combine_weights(probs, experts_all)
    want_aux.backward()
    mine = my_rows(x, me)
    xm = Tensor(xp.asarray(x[mine]), requires_grad=True)
    experts, weights, aux, gathered = ep.gate(moe, xm, ep_group, dp_group)
    same(experts, experts_all[mine], f"top-{k} choices (experts) of my tokens, {what}")
    close(weights, host(want_w)[mine], f"combine weights of my tokens, {what}", rtol=1e-10)
    counts = np.asarray(gathered)
    if counts.shape != (D, k, E + 1):
        raise AssertionError(
            f"gathered has shape {counts.shape}, expected (D, k, E + 1) = {(D, k, E + 1)}: every one of the D = {D} "
            f"ranks of the data group, in data-rank order, with its (k, E + 1) counts, {what}"
        )
    for d in range(D):
        rows = experts_all[my_rows(x, d)]
        same(
            counts[d, :, :E],
            slot_counts(rows, E),
            f"gathered[{d}, s, e]: data rank {d}'s number of choice-s assignments to expert e, {what}",
            dtype=counts.dtype,
        )
        same(
            counts[d, :, E],
            [rows.shape[0]] * k,
            f"gathered[{d}, :, E]: data rank {d}'s token count, {what}",
            dtype=counts.dtype,
        )
    assert_same_kind(aux, want_aux, f"my aux loss, {what}")
    total = np.array([aux.item() / D])
    dist.all_reduce(total)
    assert_close(
        total[0],
        want_aux.item(),
        rtol=1e-10,
        what=f"aux loss: the sum of the {D} ranks' aux / D (each rank's aux is D times its share), against the "
        f"serial aux loss of the whole batch (z-loss {moe.z_loss:.3f} included), {what}",
    )
    aux.backward()
    g = np.ascontiguousarray(host(moe.gate.weight.grad)) / D
    assert_same_kind(moe.gate.weight.grad, serial.gate.weight.grad, f"aux gradient of the gate weight, {what}")
    dist.all_reduce(g)
    close(
        g, host(serial.gate.weight.grad), f"aux gradient of the gate weight summed over ranks / D, {what}", 1e-8, 1e-12
    )
    close(host(xm.grad) / D, host(xs.grad)[mine], f"aux gradient of my tokens / D, {what}", 1e-8, 1e-12)


# --- 6.2 capacity ----------------------------------------------------------------------------------------


def gathered_counts(experts_all, E, size=N):
    rows = experts_all.shape[0] // size
    out = np.zeros((size, experts_all.shape[1], E + 1), dtype=np.int64)
    for r in range(size):
        out[r, :, :E] = slot_counts(experts_all[r * rows : (r + 1) * rows], E)
        out[r, :, E] = rows
    return out


def kept_message(me, got, want, capacity, what):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape == want.shape:
        bad = np.argwhere(got != want)
        if bad.size:
            t, s = (int(i) for i in bad[0])
            return (
                f"rank {me}'s kept assignments differ from the serial layer's drops on the whole batch, capacity "
                f"{capacity}: {len(bad)} differ, first my token {t}'s choice {s}: got kept={bool(got[t, s])}, "
                f"expected {bool(want[t, s])}, {what}:\ngot\n{got.astype(int)}\nwant\n{want.astype(int)}"
            )
    return ""


CAPACITY_CASES = {"drawn": (None, False), "top1": (1, False), "top2": (2, False), "mesh-2x2": (2, True)}


@pytest.mark.task("6.2")
@pytest.mark.world_size(N)
@SKEW
@pytest.mark.parametrize("case", list(CAPACITY_CASES))
def test_drops_are_the_serial_layers_drops(impl, skewed, case):
    ep = impl.expert_parallel
    k, on_mesh = CAPACITY_CASES[case]
    moe, x, rng, what = drawn_layer(skewed, k=k, capacity_factor=None)
    moe.capacity_factor = float(rng.uniform(0.3, 0.8))
    probs = serial_probs(moe, x)
    capacity = moe.capacity(x.shape[0])
    experts_all, _, _, kept_all = route(probs, moe.top_k, capacity)
    kept_all = kept_all.reshape(-1, moe.top_k)
    what = f"{case}: {what}"
    if on_mesh:  # my own counts, gathered over ep then dp: data-rank order is row order
        ep_group, dp_group, me = mesh_2x2()
        mine = experts_all[my_rows(x, me)]
        counts = np.zeros((moe.top_k, moe.n_experts + 1), dtype=np.int64)
        counts[:, : moe.n_experts] = slot_counts(mine, moe.n_experts)
        counts[:, moe.n_experts] = mine.shape[0]
        gathered = dist.all_gather(dist.all_gather(counts[None], group=ep_group), group=dp_group)
        got = ep.keep(moe, mine, gathered, me)
        want = kept_all[my_rows(x, me)]
        same(got, want, f"rank {dist.get_rank()} = data rank {me} of a dp 2 × ep 2 mesh, its kept assignments, {what}")
    else:
        gathered = gathered_counts(experts_all, moe.n_experts)
        for me in range(N):  # every rank checks every rank's decision: no communication here
            got = ep.keep(moe, experts_all[my_rows(x, me)], gathered, me)
            want = kept_all[my_rows(x, me)]
            message = kept_message(me, got, want, capacity, what)
            assert not message, message
            same(got, want, f"rank {me}'s kept assignments, {what}")
    if skewed:
        assert not kept_all.all(), f"the skewed case drops assignments, {what}"
    moe.capacity_factor = 0.0
    me = 0 if on_mesh else dist.get_rank()
    got = np.asarray(ep.keep(moe, experts_all[my_rows(x, me)], gathered_counts(experts_all, moe.n_experts), me))
    assert got.all(), f"capacity factor 0 (no capacity): no assignment is dropped, but {int((~got).sum())} were, {what}"


# --- 6.3 dispatch and combine ----------------------------------------------------------------------------


def check_rows(got, want, recv, what):
    """Rows received in rank order: the first wrong row named by its source rank."""
    assert_same_kind(got, want, what)
    g, w = host(got), host(want)
    bad = np.flatnonzero(~np.all((g == w) | (np.isnan(g) & np.isnan(w)), axis=-1))
    if bad.size:
        i = int(bad[0])
        src = int(np.searchsorted(np.cumsum(recv), i, side="right"))
        raise AssertionError(
            f"{what}: {bad.size} of {w.shape[0]} rows differ; first row {i} (row {i - sum(recv[:src])} of the "
            f"{recv[src]} from rank {src}): got {g[i].tolist()}, expected {w[i].tolist()}"
        )


# case: a table sizes[src, dst] of rows, or how to draw one
A2A_EMPTY = [[2, 1, 0, 3], [0, 0, 0, 0], [1, 2, 0, 0], [3, 0, 0, 1]]  # rank 1 sends nothing, rank 2 gets nothing
A2A_CASES = ("drawn", "empty-pieces", "strided", "3-ranks")


def strided(a):
    """The same values as a non-contiguous (transposed) view, as a layer may hand them over."""
    return np.ascontiguousarray(np.asarray(a).T).T


@pytest.mark.task("6.3")
@pytest.mark.world_size(N)
@pytest.mark.parametrize("case", A2A_CASES)
def test_all_to_all_function_forward_and_backward(impl, case):
    ep = impl.expert_parallel
    seed = grading_seed()
    rng = np.random.default_rng(seed)
    size = 3 if case == "3-ranks" else N
    group = dist.new_group(range(size)) if case == "3-ranks" else dist.world()
    if dist.get_rank() >= size:
        return
    if case == "empty-pieces":
        sizes = np.array(A2A_EMPTY)
    else:  # strided: at least one row to every rank, so every view is really strided
        sizes = rng.integers(1 if case == "strided" else 0, 4, size=(size, size))  # sizes[src, dst]
    r, width = dist.get_rank(), int(rng.integers(2 if case == "strided" else 1, 4))
    base = rng.normal(size=(size, int(sizes.sum(axis=1).max()), width))
    what = f"{case}: {size} ranks, rows sizes[src, dst] = {sizes.tolist()}, width {width}, rank {r} (seed {seed})"
    mine = base[r, : sizes[r].sum()]
    x = Tensor(xp.asarray(strided(mine) if case == "strided" else mine), requires_grad=True)
    send, recv = sizes[r].tolist(), sizes[:, r].tolist()
    with dist.comm_stats() as s:
        y = ep.AllToAll.apply(x, send_sizes=send, recv_sizes=recv, group=group)
    starts = np.cumsum(sizes, axis=1) - sizes
    want = np.concatenate([base[p, starts[p, r] : starts[p, r] + sizes[p, r]] for p in range(size)])
    check_rows(y, want, recv, f"forward: the rows I received, in rank order, {what}")
    want_bytes = (sizes[r].sum() - sizes[r, r]) * width * 8
    assert s.sent("all_to_all") == want_bytes, (
        f"forward sent {s.sent('all_to_all')} bytes by all-to-all, expected {want_bytes}: my rows for the other "
        f"ranks ({sizes[r].sum() - sizes[r, r]} rows of {width * 8} bytes), {what}"
    )
    ups = [rng.normal(size=(sizes[:, p].sum(), width)) for p in range(size)]  # every rank's upstream gradient
    y.backward(xp.asarray(strided(ups[r]) if case == "strided" else ups[r]))
    # the rows I sent to p come home: p's upstream rows for them, in p's received order
    back = np.concatenate([ups[p][(np.cumsum(sizes[:, p]) - sizes[:, p])[r] :][: sizes[r, p]] for p in range(size)])
    check_rows(x.grad, back, send, f"backward: the gradient of my rows, sent home by the reverse all-to-all, {what}")


def route_nothing_to(moe, x, experts, col) -> None:
    """No token chooses ``experts``: input column ``col`` is 1 for every token, and the gate's row for
    it pushes those experts' logits down by 100."""
    gate = host(moe.gate.weight).copy()
    gate[col] = 0.0
    gate[col, list(experts)] = -100.0
    x[:, col] = 1.0
    moe.gate.weight.data = xp.asarray(gate)


def route_row_to(moe, x, row, expert, col) -> None:
    """Token ``row`` chooses ``expert`` first: column ``col`` is 50 for it, 0 for every other."""
    gate = host(moe.gate.weight).copy()
    gate[col] = 0.0
    gate[col, expert] = 1.0
    x[:, col] = 0.0
    x[row, col] = 50.0
    moe.gate.weight.data = xp.asarray(gate)


# case: (skewed, k, mesh, ranks); k None: drawn
DROPLESS_CASES = {
    "drawn-skewed": (True, None, False, N),
    "drawn-uniform": (False, None, False, N),
    "top1": (False, 1, False, N),
    "top2": (True, 2, False, N),
    "empty-pieces": (False, 2, False, N),
    "mesh-2x2": (True, 2, True, N),
    "3-ranks": (False, 2, False, 3),
}


@pytest.mark.task("6.3")
@pytest.mark.world_size(N)
@pytest.mark.parametrize("case", list(DROPLESS_CASES))
def test_dropless_dispatch_runs_every_row_on_its_expert_and_sends_the_formula(impl, case):
    """``empty-pieces``: rank 2 sends nothing at all (capacity dropped its every assignment), no token
    chooses rank 3's experts (it receives nothing) nor expert 2 (rank 1 runs only expert 3)."""
    ep = impl.expert_parallel
    skewed, k, on_mesh, ranks = DROPLESS_CASES[case]
    P = 2 if on_mesh else ranks  # the EP group
    # Two experts per rank, so the rows that arrive must be regrouped by expert before they run.
    width = 6 if case == "empty-pieces" else None
    moe, x, rng, what = drawn_layer(skewed, k=k, capacity_factor=0.0, experts=2 * P, size=ranks, width=width)
    arrive_out_of_expert_order(moe, x, ranks)
    n_rows = x.shape[0] // ranks
    if case == "empty-pieces":
        route_nothing_to(moe, x, [2, 6, 7], col=4)
        route_row_to(moe, x, n_rows + 1, 3, col=3)
    if on_mesh:
        group, _, me = mesh_2x2()  # my EP group: the two data ranks of my replica
        first = me - me % P  # data rank of EP rank 0 of my group
    else:
        group = dist.new_group(range(ranks)) if ranks < N else dist.world()
        if dist.get_rank() >= ranks:
            return
        me, first = dist.get_rank(), 0
    E, r = moe.n_experts, dist.get_rank(group)
    what = f"{case}: EP group of {P} ranks, my EP rank {r} ({rows_of(x, me, ranks)}), {what}"
    experts_all = route(serial_probs(moe, x), k or moe.top_k, None)[0]
    k = moe.top_k
    kept_all = np.ones(experts_all.shape, dtype=bool)
    if case == "empty-pieces":
        kept_all[my_rows(x, 2, ranks)] = False  # every assignment of rank 2 dropped: it sends nothing
    group_ranks = [first + p for p in range(P)]  # the data ranks of my EP group, in EP-rank order
    mine = my_rows(x, me, ranks)
    experts = experts_all[mine]
    order, counts = dispatch_order(experts, kept_all[mine], E)
    rows = Tensor(xp.asarray(x[mine][order // k]), requires_grad=True)
    with dist.comm_stats() as fwd:
        out, send, recv = ep.dropless(moe, rows, counts, group)
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
    close(out, want, f"expert outputs back home, one per dispatched row, {what}", rtol=1e-10, atol=1e-12)
    per = E // P

    def to_ranks(d):  # what data rank d sends each EP rank of its group: its kept rows per owner
        ex, keep = experts_all[my_rows(x, d, ranks)], kept_all[my_rows(x, d, ranks)]
        return np.bincount(ex[keep] // per, minlength=P)

    sent = to_ranks(me)
    all_sent = np.stack([to_ranks(d) for d in group_ranks])  # [EP rank p, EP rank q]
    assert list(send) == sent.tolist() and list(recv) == all_sent[:, r].tolist(), (
        f"split sizes: sent {list(send)} rows, expected {sent.tolist()} (my rows for each EP rank's experts); "
        f"received {list(recv)}, expected {all_sent[:, r].tolist()} (each EP rank's rows for my experts), {what}"
    )
    row = x.shape[1] * 8
    moved = row * (sent.sum() - sent[r] + all_sent[:, r].sum() - all_sent[r, r])
    counts_bytes = 8 * (P - 1) * per
    assert fwd.sent("all_to_all") == counts_bytes + moved, (
        f"forward sent {fwd.sent('all_to_all')} bytes by all-to-all, expected {counts_bytes + moved}: the counts "
        f"(8·(P−1)·E/P = {counts_bytes}) + the rows dispatched and combined, away from my rank ({moved}), {what}"
    )
    up = rng.normal(size=want.shape)  # my upstream gradient (the draws diverge across ranks from here)
    with dist.comm_stats() as bwd:
        (out * xp.asarray(up)).sum().backward()
    assert bwd.sent("all_to_all") == moved, (
        f"backward sent {bwd.sent('all_to_all')} bytes by all-to-all, expected {moved}: the two exchanges reversed "
        f"(no counts), {what}"
    )
    # input gradient: each row's expert's vector-Jacobian product, computed locally
    for i, (t, e) in enumerate(zip(order, experts.reshape(-1)[order])):
        leaf = Tensor(xp.asarray(x[mine][t // k][None]), requires_grad=True)
        (moe.experts[int(e)](leaf) * xp.asarray(up[i][None])).sum().backward()
        close(
            host(rows.grad)[i],
            host(leaf.grad)[0],
            f"gradient of dispatched row {i} (my token {t // k}'s choice {t % k}, expert {e}), {what}",
            rtol=1e-9,
            atol=1e-12,
        )


# --- 6.4 gradients on a dp × ep mesh ---------------------------------------------------------------------

SYNC_CASES = ("drawn", "all-present", "empty-pieces")


@pytest.mark.task("6.4")
@pytest.mark.world_size(N)
@pytest.mark.parametrize("case", SYNC_CASES)
def test_sync_gradients_dense_over_the_data_group_experts_over_dp(impl, case):
    """``empty-pieces``: experts 0 and 3 (one on each EP rank) and wpe have no gradient on any rank (no
    token reached them: they stay None), and ln_f.weight has one on rank 2 only."""
    ep_mod = impl.expert_parallel
    seed = grading_seed()
    rng = np.random.default_rng(seed)
    E = 4
    cfg = GPTConfig(vocab_size=8, block_size=4, n_layer=1, n_head=1, n_embd=4, n_experts=E, moe_top_k=2)
    model = GPT(cfg, seed=int(rng.integers(1 << 30)))
    mesh = dist.DeviceMesh({"dp": 2, "ep": 2})
    ep = ep_mod.apply_expert_parallel(model, mesh.get_group("ep"), mesh.get_group("dp"))
    params = list(model.parameters())
    names = {id(q): n for n, q in model.named_parameters()}
    grads = rng.normal(size=(N, sum(p.data.size for p in params)))  # every rank's gradients, drawn alike
    missing = rng.random(size=(N, len(params))) < 0.2  # some ranks have no gradient for some weights
    if case == "all-present":
        missing[...] = False
    elif case == "empty-pieces":
        for i, p in enumerate(params):
            name = names[id(p)]
            if ".experts.0." in name or ".experts.3." in name or name == "wpe.weight":
                missing[:, i] = True
            elif name == "ln_f.weight":
                missing[:, i] = True
                missing[2, i] = False
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
        name = names[id(p)]
        where = f"{name}'s gradient on rank {r} (dp {d}, ep {e}), {case} (seed {seed})"
        if ep.is_expert(p):  # expert owned by (d', e) for every replica d': average over dp, / ep
            group = [d2 * 2 + e for d2 in range(2)]
            scale, rule = 1 / (2 * 2), "the average over its 2 dp replicas, divided by ep = 2"
        else:  # dense: average over all 4
            group, scale, rule = list(range(N)), 1 / N, "the average over the 4 ranks of the data group"
        present = [g for g in group if not missing[g, i]]
        if not present:
            assert p.grad is None, (
                f"{where}: no rank of {group} had a gradient (no token reached it), so it must stay None after "
                f"sync, as on one process (an optimizer then skips it), but it is an array of "
                f"{'zeros' if not np.any(host(p.grad)) else 'numbers'}"
            )
            continue
        if p.grad is None:
            raise AssertionError(f"{where}: None after sync, but ranks {present} of {group} had one ({rule})")
        want = sum(piece(g, i) for g in present) * scale
        what = f"{where}: {rule}, a missing one counting as zeros (ranks {present} had one)"
        try:
            close(p.grad, want, what, rtol=1e-6, atol=1e-7, dtype=p.data.dtype)
        except AssertionError as exc:
            hint = clean_factor(host(p.grad), want, len(group))
            raise AssertionError(f"{exc}{'; it is ' + hint if hint else ''}") from None


# --- 6.5 loss-free balancing: the routing bias ---------------------------------------------------------

# Fixed hard cases: loads (assignments that chose each expert, the whole batch) and each expert's
# move in units of the rate, written out: all equal, one expert takes everything, loads exactly at
# the mean, a single expert, loads that are floats. A drawn load is checked by the rule's properties.
BIAS_CASES = {
    "equal": ([5, 5, 5, 5], [0, 0, 0, 0]),
    "one-hogs-all": ([0, 12, 0, 0, 0, 0], [1, -1, 1, 1, 1, 1]),
    "at-the-mean": ([7, 1, 4, 4], [-1, 1, 0, 0]),
    "one-expert": ([9], [0]),
    "floats": ([0.5, 2.25, 1.0], [1, -1, 1]),
}


def check_bias_moves(load, moves, what) -> None:
    """A drawn load: each expert moves by exactly one rate or not at all; a busier expert never moves
    up more than a quieter one; experts with equal loads move alike; and some move both ways unless
    all loads are equal (then none moves)."""
    assert np.all(np.isin(moves, (-1.0, 0.0, 1.0))), (
        f"{what}: route_bias moved by {moves.tolist()} rates; each expert moves by one rate or not at all"
    )
    for i in range(len(load)):
        for j in range(len(load)):
            if load[i] > load[j]:
                assert moves[i] <= moves[j], (
                    f"{what}: route_bias of expert {i} (load {load[i]}) moved up more than expert {j}'s (load "
                    f"{load[j]}): a busier expert is made less attractive, against the mean load"
                )
            if load[i] == load[j]:
                assert moves[i] == moves[j], f"{what}: route_bias of experts {i} and {j} (one load) moved differently"
    if len(set(load.tolist())) > 1:
        assert moves.max() == 1 and moves.min() == -1, (
            f"{what}: unequal loads, but route_bias moved by {moves.tolist()} rates: some experts are above the "
            "mean load and some below"
        )
    else:
        assert not moves.any(), f"{what}: every expert at the mean load, but route_bias moved by {moves.tolist()}"


@pytest.mark.task("6.5")
@pytest.mark.parametrize("case", ["drawn", *BIAS_CASES])
def test_bias_moves_each_expert_against_its_load(impl, case):
    seed = grading_seed()
    rng = np.random.default_rng(seed)
    if case == "drawn":
        load, want = rng.integers(0, 20, size=int(rng.integers(2, 9))), None
    else:
        load, want = np.array(BIAS_CASES[case][0]), np.array(BIAS_CASES[case][1], dtype=float)
    E, rate = load.shape[0], float(rng.uniform(1e-4, 0.1))
    moe = MoE(4, 8, E, top_k=1, balance="bias", bias_rate=rate)
    start = rng.normal(0, 0.1, E)  # a bias that has moved before
    moe.route_bias = start.copy()
    what = f"{case}: load {load.tolist()}, rate {rate:.4g} (seed {seed})"
    first = None
    for steps in (1, 2):  # it accumulates: each step one more nudge
        impl.expert_parallel.update_bias(moe, load)
        bias = np.asarray(moe.route_bias)
        assert bias.shape == (E,), f"{what}: route_bias has shape {bias.shape}, expected ({E},)"
        moves = np.round((bias - start) / (steps * rate), 9)
        first = moves if first is None else first
        if want is None:
            check_bias_moves(load, moves, what)
            want = first  # the second update must repeat the first's moves
        assert_close(
            bias,
            start + steps * rate * want,
            rtol=1e-12,
            atol=1e-15,
            what=f"{what}: route_bias after {steps} update(s); an expert above the mean load moves down by the rate, "
            "one below moves up, one at the mean stays",
        )
