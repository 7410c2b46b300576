"""Assignment 7 (context parallel), graded. Run: ``python -m grader --tasks 7.*``.

Every piece is checked against the serial computation, on shapes and values drawn when the test
runs (so only a real implementation passes): block attention and merges against softmax over all
keys, ring and all-to-all attention against causal attention on the whole sequence (outputs and
q, k, v gradients at this rank's positions), the GPT's loss and gradients summed over the CP group
against the serial GPT, the bytes each rank sends against the formulas of the handout, the q·k
products each rank computes against the causal skips, and the order in which the ring posts its
messages and computes (the overlap the handout asks for).

Besides the drawn shapes every test runs fixed hard cases, whatever the draw: both splits
(contiguous and zigzag, the zigzag one as the handout gives it, so 7.2, 7.3 and 7.5 score apart
from 7.4), 3 ranks (a ring that is not a power of two), strided q, k, v (the transposed views a
model hands over), one and two heads per rank (all-to-all), and scores of magnitude 1e4 (7.1).
"""

from __future__ import annotations

import importlib
import re
import sys

import numpy as np
import pytest

from grader.seeds import grading_seed
from tinytrain import distributed as dist
from tinytrain import functional as F
from tinytrain.autograd import Tensor
from tinytrain.backend import to_host, xp
from tinytrain.nn import GPT, GPTConfig
from tinytrain.testing import assert_close, assert_same_kind

N = 4  # the CP group: the whole world of these tests (or 3 of its ranks)


def shared_rng():
    """A generator every rank draws identically, and its seed (named in failure messages)."""
    seed = grading_seed()
    return np.random.default_rng(seed), seed


def host(a):
    return to_host(a.data if isinstance(a, Tensor) else a)


def leaf(a):
    return Tensor(xp.asarray(np.ascontiguousarray(a)), requires_grad=True)


def strided_leaf(a):
    """The same values as a (B, H, T, D) view of a (B, T, H, D) array: what attention gets from a model
    (q, k, v split into heads by a transpose), not contiguous."""
    return Tensor(xp.asarray(np.ascontiguousarray(np.swapaxes(a, 1, 2)).swapaxes(1, 2)), requires_grad=True)


def close(got, want, what, rtol=1e-9, atol=1e-11):
    """Shape and dtype first, then the values, naming the worst element."""
    assert_same_kind(got, want, what)
    assert_close(host(got), to_host(want), atol=atol, rtol=rtol, what=what)


def softmax_attention(q, k, v, scale, causal):
    """The serial model's attention (``F.scaled_dot_product_attention``) and NumPy's log-sum-exp of
    each row of scores (``np.logaddexp.reduce``)."""
    qkv = (Tensor(xp.asarray(a)) for a in (q, k, v))
    out = to_host(F.scaled_dot_product_attention(*qkv, causal=causal, scale=scale).data)
    s = scale * q @ k.swapaxes(-1, -2)
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], dtype=bool)), s, -np.inf)
    return out, np.logaddexp.reduce(s, axis=-1)


BLOCK_HINT = "exp(score) overflows (or every term underflows to 0) unless the row's maximum score is subtracted first"
MERGE_HINT = "exp(lse) overflows (or underflows to 0) unless the larger of the two log-sum-exps is subtracted first"


def finite(arrays, what, hint=BLOCK_HINT):
    for name, a in arrays.items():
        a = host(a)
        if not np.isfinite(a).all():
            raise AssertionError(
                f"{name} is not finite on scores of magnitude 1e4 ({int((~np.isfinite(a)).sum())} of {a.size} values "
                f"nan or inf): {hint}, {what}"
            )


# --- 7.1 one block and the online-softmax merge -----------------------------------------------------


def large_scores(rng, q, k, scale):
    """Scores of magnitude 1e4: query 0 sees only scores near +1e4, query 1 near -1e4, query 2 spread
    over ±1e4 (the last feature of every key is 1, so the last feature of a query shifts its row)."""
    k[..., -1] = 1.0
    q[..., 0, -1] = 1e4 / scale
    q[..., 1, -1] = -1e4 / scale
    q[..., 2, :] = rng.normal(size=q[..., 2, :].shape) * 3e3 / scale


@pytest.mark.task("7.1")
@pytest.mark.parametrize("case", ["drawn", "large-scores"])
def test_blocks_merged_in_any_order_equal_softmax_over_all_keys(impl, case):
    cp = impl.context_parallel
    rng, seed = shared_rng()
    large = case == "large-scores"
    b, h, D = int(rng.integers(1, 4)), int(rng.integers(1, 4)), int(rng.integers(2 if large else 1, 5))
    Tq = int(rng.integers(3 if large else 1, 7))
    Tk = int(rng.integers(2, 10))
    scale = float(rng.uniform(0.2, 1.5))
    q, k, v = rng.normal(size=(b, h, Tq, D)) * 2, rng.normal(size=(b, h, Tk, D)) * 2, rng.normal(size=(b, h, Tk, D))
    if large:
        large_scores(rng, q, k, scale)
    what = f"{case}: q {q.shape}, {Tk} keys, scale {scale:.3f} (seed {seed})"
    want, want_lse = softmax_attention(q, k, v, scale, causal=False)
    cuts = sorted(rng.choice(np.arange(1, Tk), size=int(rng.integers(1, min(3, Tk - 1) + 1)), replace=False))
    bounds = list(zip([0, *cuts], [*cuts, Tk]))
    parts = [
        cp.block_attention(xp.asarray(q), xp.asarray(k[..., a:e, :]), xp.asarray(v[..., a:e, :]), scale, False)
        for a, e in bounds
    ]
    for a, e in bounds[:1]:
        one, one_lse = softmax_attention(q, k[..., a:e, :], v[..., a:e, :], scale, causal=False)
        if large:
            finite({"block_attention's output": parts[0][0], "block_attention's log-sum-exp": parts[0][1]}, what)
        close(parts[0][0], one, f"block_attention output over keys [{a}, {e}), {what}")
        close(parts[0][1], one_lse, f"block_attention log-sum-exp over keys [{a}, {e}), {what}")
    # The first merge of a ring starts from nothing: out 0, lse -inf (no keys yet).
    a, e = bounds[0]
    empty = xp.zeros_like(parts[0][0]), xp.full(parts[0][1].shape, -np.inf, dtype=parts[0][1].dtype)
    out, lse = cp.merge_partials(*empty, *parts[0])
    if large:
        finite(
            {"merge_partials' output": out, "its log-sum-exp": lse}, f"merged into an empty result, {what}", MERGE_HINT
        )
    close(out, one, f"merge_partials of an empty result (lse = -inf, no keys yet) and keys [{a}, {e}): output, {what}")
    close(lse, one_lse, f"merge_partials of an empty result (lse = -inf) and keys [{a}, {e}): log-sum-exp, {what}")
    order = rng.permutation(len(parts))
    out, lse = parts[order[0]]
    for i in order[1:]:
        out, lse = cp.merge_partials(out, lse, *parts[i])
    merged = f"key blocks {bounds} merged in order {order.tolist()}"
    if large:
        finite({"merge_partials' output": out, "its log-sum-exp": lse}, f"{merged}, {what}", MERGE_HINT)
    close(out, want, f"output of {merged}, {what}")
    close(lse, want_lse, f"log-sum-exp of {merged}, {what}")
    diag = rng.normal(size=(b, h, Tq, D)) * (1e2 if large else 1.0)
    out, lse = cp.block_attention(xp.asarray(diag), xp.asarray(diag), xp.asarray(diag), scale, True)
    want, want_lse = softmax_attention(diag, diag, diag, scale, causal=True)
    if large:
        finite({"the diagonal block's output": out, "its log-sum-exp": lse}, what)
    close(out, want, f"diagonal block (causal mask), {what}")
    close(lse, want_lse, f"diagonal block's log-sum-exp, {what}")


# --- 7.2 / 7.3 / 7.5 attention against the serial computation ------------------------------------------

# case: (ranks, split, strided q, k, v)
RING_CASES = {
    "contiguous": (N, "contiguous", False),
    "zigzag": (N, "zigzag", False),
    "3-ranks": (3, "contiguous", False),
    "3-ranks-zigzag": (3, "zigzag", False),
    "strided": (N, "zigzag", True),
}


def cp_group(ranks):
    """The CP group of a case: the world, or ranks 0..ranks-1 (the others sit the test out: None)."""
    group = dist.new_group(range(ranks)) if ranks < N else dist.world()
    return group if dist.get_rank() < ranks else None


def drawn_attention(rng, n, heads=None):
    """q, k, v and an upstream gradient for the whole sequence (float64, the same on every rank), the
    serial results. ``heads``: fixed, or drawn (1 or 2)."""
    B, H, D = int(rng.integers(1, 3)), heads or int(rng.integers(1, 3)), int(rng.integers(1, 5))
    T = 2 * n * int(rng.integers(1, 4))
    q, k, v, up = (rng.normal(size=(B, H, T, D)) for _ in range(4))
    serial = [leaf(a) for a in (q, k, v)]
    y = F.scaled_dot_product_attention(*serial, causal=True)
    y.backward(xp.asarray(up))
    return (q, k, v, up), host(y), [host(s.grad) for s in serial]


def my_inputs(arrays, pos, strided):
    return [(strided_leaf if strided else leaf)(a[:, :, pos]) for a in arrays[:3]]


def run_attention(fn, arrays, pos, split, group, strided=False):
    q, k, v, up = arrays
    mine = my_inputs(arrays, pos, strided)
    with dist.comm_stats() as fwd:
        y = fn(*mine, group=group, split=split)
    with dist.comm_stats() as bwd:
        y.backward(xp.asarray(up[:, :, pos]))
    return y, mine, fwd, bwd


def check_attention(y, mine, want_y, want_grads, pos, what, grads=True):
    close(y, want_y[:, :, pos], f"output at my positions {pos.tolist()}, {what}")
    if grads:
        for name, t, g in zip("qkv", mine, want_grads):
            close(t.grad, g[:, :, pos], f"d{name} at my positions {pos.tolist()}, {what}")


class Waited:
    """A p2p handle that records the first wait on it (``w``) before waiting."""

    def __init__(self, work, log, label):
        self._work, self._log, self._label = work, log, label

    def wait(self, *args, **kwargs):
        if self._label not in self._log:
            self._log.append(self._label)
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def record_ring(cp, monkeypatch, compute="block_attention") -> list[str]:
    """Record, in order, each K/V ``pass_on`` (S), the first wait on the j-th S's handles (W0, W1, ...),
    each dK/dV ``pass_on`` (D0, D1, ...: the j-th), the first wait on the j-th D's handles (w0, w1,
    ...), and each ``compute`` of the ring module (C)."""
    ring = importlib.import_module(cp.__name__ + ".ring")
    events: list[str] = []
    pass_on, block = ring.pass_on, getattr(ring, compute)

    def sending(buf, group, tag, *args, **kwargs):
        incoming, works = pass_on(buf, group, tag, *args, **kwargs)
        if tag == ring.TAG_KV:
            j = events.count("S")
            events.append("S")
            works = [Waited(w, events, f"W{j}") for w in works]
        elif tag == ring.TAG_DKV:
            j = sum(e.startswith("D") for e in events)
            events.append(f"D{j}")
            works = [Waited(w, events, f"w{j}") for w in works]
        return incoming, works

    def computing(*args, **kwargs):
        events.append("C")
        return block(*args, **kwargs)

    monkeypatch.setattr(ring, "pass_on", sending)
    monkeypatch.setattr(ring, compute, computing)
    return events


def expect_sends_before_compute(events, n, what, label="forward"):
    """Each step with a K/V exchange runs post (S), compute (C, none where all is skipped), wait (W),
    in that order: the block travels while this step computes, not before or after."""
    order = "".join("W" if e.startswith("W") else e for e in events if e == "S" or e == "C" or e.startswith("W"))
    assert re.fullmatch(f"(SC*){{{n - 1}}}C*", order.replace("W", "")), (
        f"{label}: rank {dist.get_rank()} posted the K/V sends (S) and computed blocks (C) in the order "
        f"{order.replace('W', '')}; post each step's send before computing on the block you hold (S, then its "
        f"blocks C, {n - 1} times, then the last block's C), so the next block travels while you compute, {what}"
    )
    assert re.fullmatch(f"(SC*W){{{n - 1}}}C*", order), (
        f"{label}: rank {dist.get_rank()} waited for the K/V exchange (W) in the order {order} (S = post, C = a "
        f"block computed); wait for each step's exchange only after that step's blocks are computed (S, C..., W, "
        f"{n - 1} times, then the last step's C), else nothing travels under the compute, {what}"
    )


def expect_accumulators_overlap(events, n, what):
    """The dK/dV accumulator passed on at step j travels during step j + 1: it is not waited for
    before step j + 1 has posted its K/V exchange (for every j with such a step)."""
    shown = " ".join(events)
    passed = [e for e in events if e.startswith("D")]
    assert len(passed) == n, (
        f"backward: rank {dist.get_rank()} passed {len(passed)} dK/dV accumulators on with pass_on(..., TAG_DKV), "
        f"expected one per step, N = {n} (events: {shown}), {what}"
    )
    for j in range(n - 2):
        waited = events.index(f"w{j}") if f"w{j}" in events else len(events)
        next_kv = [i for i, e in enumerate(events) if e == "S"][j + 1]
        assert waited > next_kv, (
            f"backward: rank {dist.get_rank()} waited for the dK/dV accumulator it passed on at step {j} before step "
            f"{j + 1} posted its K/V exchange (events in order: {shown}; S = K/V pass_on, C = block_gradients, "
            f"Dj / wj = the j-th accumulator's pass_on / first wait): wait for it in step {j + 1}, after computing, "
            f"so it travels during that step's compute, {what}"
        )


# The zigzag split written out as the handout's table (chunk k's owner, k = 0 .. 2N - 1), for the
# group sizes the tests run: the expectation of 7.4 and the stand-in 7.2, 7.3 and 7.5 run on.
ZIGZAG_OWNERS = {
    1: [0, 0],
    2: [0, 1, 1, 0],
    3: [0, 1, 2, 2, 1, 0],
    4: [0, 1, 2, 3, 3, 2, 1, 0],
    5: [0, 1, 2, 3, 4, 4, 3, 2, 1, 0],
    6: [0, 1, 2, 3, 4, 5, 5, 4, 3, 2, 1, 0],
}


def handout_chunk_ids(rank, n, split):
    """The handout's split: contiguous, chunk r; zigzag, the chunks the table gives rank r."""
    owners = list(range(n)) if split == "contiguous" else ZIGZAG_OWNERS[n]
    return [k for k, owner in enumerate(owners) if owner == rank]


def handout_positions(T, rank, n, split):
    chunks = handout_chunk_ids(rank, n, split)
    c = T // (len(chunks) * n)
    return np.array([p for p in range(T) if p // c in chunks], dtype=np.int64)


def split_from_the_handout(cp, monkeypatch):
    """Run the split of task 7.4 as the handout gives it, not the student's: 7.2, 7.3 and 7.5 then
    score whether 7.4 is done or not (7.4's own tests check the student's split)."""
    for name, module in list(sys.modules.items()):  # every file of the package that uses them, by name
        if name == cp.__name__ or name.startswith(cp.__name__ + "."):
            for attr, fn in (("chunk_ids", handout_chunk_ids), ("positions", handout_positions)):
                if hasattr(module, attr):
                    monkeypatch.setattr(module, attr, fn)


def ring_case(cp, monkeypatch, case):
    """(group, n, split, strided, arrays, serial output, serial gradients, my positions, what), or
    None on a rank outside the case's group."""
    ranks, split, strided = RING_CASES[case]
    split_from_the_handout(cp, monkeypatch)
    rng, seed = shared_rng()
    group = cp_group(ranks)
    if group is None:
        return None
    arrays, want_y, want_grads = drawn_attention(rng, ranks, heads=2 if strided else None)  # 2: really strided
    pos = handout_positions(arrays[0].shape[2], dist.get_rank(group), ranks, split)
    what = (
        f"ring attention over {ranks} ranks, {split} split{', strided q, k, v' if strided else ''}, q "
        f"{arrays[0].shape} (seed {seed})"
    )
    return group, ranks, split, strided, arrays, want_y, want_grads, pos, what


def expected_work(T, n, split, r):
    if split == "contiguous":
        c = T // n
        return (r + 1) * c * c, f"the blocks of ranks 0..{r} ({r + 1} blocks of {c}x{c} q·k products)"
    c = T // (2 * n)
    return (2 * n + 1) * c * c, f"2N + 1 = {2 * n + 1} blocks of {c}x{c} q·k products (zigzag: the same on every rank)"


@pytest.mark.task("7.2")
@pytest.mark.world_size(N)
@pytest.mark.parametrize("case", list(RING_CASES))
def test_ring_forward_matches_serial_attention_with_causal_skips_and_ring_bytes(impl, monkeypatch, case):
    cp = impl.context_parallel
    setup = ring_case(cp, monkeypatch, case)
    if setup is None:
        return
    group, n, split, strided, arrays, want_y, _, pos, what = setup
    T, r = arrays[0].shape[2], dist.get_rank(group)
    mine = my_inputs(arrays, pos, strided)
    events = record_ring(cp, monkeypatch)
    cp.WORK.reset()
    with dist.comm_stats() as s:
        y = cp.ring_attention(*mine, group=group, split=split)
    check_attention(y, mine, want_y, None, pos, what, grads=False)
    expect_sends_before_compute(events, n, what)
    kv = 2 * mine[0].data.nbytes
    assert s.sent("send", group=group.name) == (n - 1) * kv, (
        f"rank {r} sent {s.sent('send', group=group.name)} bytes; the K/V block ({kv} bytes) is sent N - 1 = {n - 1} "
        f"times, {(n - 1) * kv} bytes, {what}\n{s.table()}"
    )
    work, which = expected_work(T, n, split, r)
    got = cp.WORK.reset()
    assert got == work, (
        f"rank {r} computed {got} q·k products, expected {work}: {which}, skipping the blocks above the diagonal, "
        f"{what}"
    )


@pytest.mark.task("7.3")
@pytest.mark.world_size(N)
@pytest.mark.parametrize("case", list(RING_CASES))
def test_ring_backward_matches_serial_gradients_and_sends_dkv_home(impl, monkeypatch, case):
    cp = impl.context_parallel
    setup = ring_case(cp, monkeypatch, case)
    if setup is None:
        return
    group, n, split, strided, arrays, want_y, want_grads, pos, what = setup
    T, r = arrays[0].shape[2], dist.get_rank(group)
    mine = my_inputs(arrays, pos, strided)
    y = cp.ring_attention(*mine, group=group, split=split)
    events = record_ring(cp, monkeypatch, compute="block_gradients")
    cp.WORK.reset()
    with dist.comm_stats() as bwd:
        y.backward(xp.asarray(arrays[3][:, :, pos]))
    check_attention(y, mine, want_y, want_grads, pos, what)
    kv = 2 * mine[0].data.nbytes
    assert bwd.sent("send", group=group.name) == (2 * n - 1) * kv, (
        f"backward: rank {r} sent {bwd.sent('send', group=group.name)} bytes; it sends the K/V block N - 1 = {n - 1} "
        f"times and the dK/dV accumulator N = {n} times (home), {(2 * n - 1) * kv} bytes, {what}\n{bwd.table()}"
    )
    expect_sends_before_compute(events, n, what, label="backward")
    expect_accumulators_overlap(events, n, what)
    work, which = expected_work(T, n, split, r)
    got = cp.WORK.reset()
    assert got == work, (
        f"backward: rank {r} computed {got} q·k products in block_gradients, expected {work}: {which}, the "
        f"forward's blocks, {what}"
    )


def drawn_gpt(rng, heads_multiple=1, heads=None):
    heads = heads or heads_multiple * int(rng.integers(1, 3))
    config = GPTConfig(
        vocab_size=int(rng.integers(4, 17)),
        block_size=2 * N * int(rng.integers(1, 3)),
        n_layer=int(rng.integers(1, 3)),
        n_head=heads,
        n_embd=heads * int(rng.integers(1, 4)),
    )
    seed = int(rng.integers(1 << 30))
    ids = rng.integers(0, config.vocab_size, size=(int(rng.integers(1, 3)), config.block_size))
    targets = rng.integers(0, config.vocab_size, size=ids.shape)
    targets[rng.random(ids.shape) < 0.2] = -100
    targets[0, -1] = 0  # at least one counted target
    return (lambda: GPT(config, seed=seed)), ids, targets


def check_gpt(cp, algo, split, heads_multiple=1, heads=None):
    rng, seed = shared_rng()
    build, ids, targets = drawn_gpt(rng, heads_multiple, heads)
    serial, model = build(), build()
    what = f"{serial.config}, batch {ids.shape}, {algo} {split} (seed {seed})"
    want = serial.loss(ids, targets)
    want.backward()
    ctx = cp.apply_context_parallel(model, dist.world(), algo, split)
    pos = ctx.positions(ids.shape[1])
    loss = model.loss(ids[:, pos], targets[:, pos], denominator=int((targets != -100).sum()), positions=pos)
    assert_same_kind(loss, want, f"rank {dist.get_rank()}'s loss, {what}")
    loss.backward()
    total = np.array([loss.item()])
    dist.all_reduce(total)
    assert_close(
        total[0], want.item(), rtol=1e-4, what=f"the sum of the {N} ranks' losses against the serial loss, {what}"
    )
    scale = max(float(np.abs(host(p.grad)).max()) for p in serial.parameters())
    for (name, s), p in zip(serial.named_parameters(), model.parameters()):
        assert_same_kind(p.grad, s.grad, f"{name}'s gradient on rank {dist.get_rank()}, {what}")
        g = np.ascontiguousarray(host(p.grad))
        dist.all_reduce(g)
        close(g, host(s.grad), f"{name}'s gradient summed over the CP group, {what}", 1e-4, 2e-6 + 1e-5 * scale)


@pytest.mark.task("7.3")
@pytest.mark.world_size(N)
@pytest.mark.parametrize("split", ["contiguous", "zigzag"])
def test_ring_gpt_loss_and_gradients_sum_to_serial(impl, monkeypatch, split):
    split_from_the_handout(impl.context_parallel, monkeypatch)
    check_gpt(impl.context_parallel, "ring", split)


# --- 7.4 zigzag ----------------------------------------------------------------------------------------


@pytest.mark.task("7.4")
@pytest.mark.world_size(N)
def test_zigzag_positions_balance_the_causal_work(impl):
    cp = impl.context_parallel
    rng, seed = shared_rng()
    drawn = int(rng.integers(2, 7)), int(rng.integers(1, 5))
    for n, c in [drawn, (3, 1), (4, 2), (2, 3)]:  # the drawn size, then fixed ones (3: odd)
        T = 2 * n * c
        what = f"T = {T} over {n} ranks, chunks of {c} (seed {seed})"
        held = [[int(i) for i in cp.positions(T, r, n, "zigzag")] for r in range(n)]
        for r, got in enumerate(held):
            want = [int(p) for p in handout_positions(T, r, n, "zigzag")]
            chunks = handout_chunk_ids(r, n, "zigzag")
            assert got == want, (
                f"rank {r} holds positions {got}, expected {want}: chunks {chunks} of {c} positions (chunk k's "
                f"owners, k = 0..{2 * n - 1}: {ZIGZAG_OWNERS[n]}), sorted, {what}"
            )
        # the property, counted by brute force from the positions: every token once, and the same causal
        # work on every rank (query chunk a reads key chunks 0..a: a + 1 blocks of c x c)
        everyone = sorted(p for pos in held for p in pos)
        assert everyone == list(range(T)), f"positions {held} do not cover 0..{T - 1} once each, {what}"
        causal = [sum(a + 1 for a in {p // c for p in pos}) * c * c for pos in held]
        assert len(set(causal)) == 1, f"causal work per rank {causal} (q·k products) is unbalanced, {what}"
        work = cp.attention_work(T, n, "zigzag")
        assert work == [(2 * n + 1) * c * c] * n, (
            f"zigzag work per rank {work}, expected {(2 * n + 1) * c * c} q·k products on every rank, {what}"
        )
        contiguous = cp.attention_work(T, n, "contiguous")
        assert len(set(contiguous)) == n, f"contiguous work per rank {contiguous} is unbalanced, {what}"
        with pytest.raises(ValueError, match=str(2 * n)):
            cp.positions(T + n, 0, n, "zigzag")


# --- 7.5 all-to-all attention -----------------------------------------------------------------------------

# case: (ranks, split, heads per rank (None: drawn 1 or 2), strided q, k, v)
ALLTOALL_CASES = {
    "drawn": (N, "contiguous", None, False),
    "1-head-per-rank": (N, "contiguous", 1, False),
    "2-heads-per-rank": (N, "contiguous", 2, False),
    "zigzag": (N, "zigzag", 2, False),
    "3-ranks": (3, "zigzag", 2, False),
    "strided": (N, "zigzag", 2, True),
}


@pytest.mark.task("7.5")
@pytest.mark.world_size(N)
@pytest.mark.parametrize("case", list(ALLTOALL_CASES))
def test_alltoall_attention_matches_serial_and_sends_four_all_to_alls_each_way(impl, monkeypatch, case):
    cp = impl.context_parallel
    split_from_the_handout(cp, monkeypatch)  # the positions are the handout's: this checks 7.5's sort, not 7.4
    ranks, split, per_rank, strided = ALLTOALL_CASES[case]
    rng, seed = shared_rng()
    group = cp_group(ranks)
    if group is None:
        return
    per_rank = per_rank or int(rng.integers(1, 3))
    arrays, want_y, want_grads = drawn_attention(rng, ranks, heads=ranks * per_rank)
    pos = handout_positions(arrays[0].shape[2], dist.get_rank(group), ranks, split)
    what = (
        f"all-to-all attention over {ranks} ranks, {split} split, {per_rank} head(s) per rank"
        f"{', strided q, k, v' if strided else ''}, q {arrays[0].shape} (seed {seed})"
    )
    y, mine, fwd, bwd = run_attention(cp.alltoall_attention, arrays, pos, split, group, strided)
    check_attention(y, mine, want_y, want_grads, pos, what)
    one = (ranks - 1) * mine[0].data.nbytes // ranks  # what each rank sends in one all-to-all of a (B, H, T/N, D)
    for label, s in (("forward", fwd), ("backward", bwd)):
        got = s.sent("all_to_all", group=group.name)
        assert got == 4 * one, (
            f"{label}: rank {dist.get_rank()} sent {got} bytes by all-to-all, expected {4 * one}: 4 all-to-alls (q, k, "
            f"v and the output), each (N - 1)/N of a {mine[0].data.nbytes}-byte tensor, {what}\n{s.table()}"
        )
    bad = [leaf(np.zeros((1, ranks + 1, 2, 1))) for _ in range(3)]
    with pytest.raises(ValueError, match="heads"):
        cp.alltoall_attention(*bad, group=group, split="contiguous")


@pytest.mark.task("7.5")
@pytest.mark.world_size(N)
@pytest.mark.parametrize("per_rank", [1, 2], ids=["1-head-per-rank", "2-heads-per-rank"])
def test_alltoall_gpt_loss_and_gradients_sum_to_serial(impl, per_rank):
    check_gpt(impl.context_parallel, "alltoall", "contiguous", heads=N * per_rank)
