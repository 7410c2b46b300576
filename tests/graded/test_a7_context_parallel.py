"""Assignment 7 (context parallel), graded. Run: ``python -m grader --tasks 7.*``.

Every piece is checked against the serial computation, on shapes and values drawn when the test
runs (so only a real implementation passes): block attention and merges against softmax over all
keys, ring and all-to-all attention against causal attention on the whole sequence (outputs and
q, k, v gradients at this rank's positions), the GPT's loss and gradients summed over the CP group
against the serial GPT, the bytes each rank sends against the formulas of the handout, and the
q·k products each rank computes against the causal skips.
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
from tinytrain.testing import assert_same_kind

N = 4  # the CP group: the whole world of these tests


def shared_rng():
    """A generator every rank draws identically, and its seed (named in failure messages)."""
    seed = grading_seed()
    return np.random.default_rng(seed), seed


def host(a):
    return to_host(a.data if isinstance(a, Tensor) else a)


def leaf(a):
    return Tensor(xp.asarray(np.ascontiguousarray(a)), requires_grad=True)


def close(got, want, what, rtol=1e-9, atol=1e-11):
    assert_same_kind(got, want, what)
    np.testing.assert_allclose(host(got), to_host(want), rtol=rtol, atol=atol, err_msg=what)


def softmax_attention(q, k, v, scale, causal):
    """NumPy: softmax(q·kᵀ·scale [+ causal mask])·v and the log-sum-exp of each row."""
    s = scale * q @ k.swapaxes(-1, -2)
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], dtype=bool)), s, -np.inf)
    m = s.max(-1, keepdims=True)
    lse = m[..., 0] + np.log(np.exp(s - m).sum(-1))
    return np.exp(s - lse[..., None]) @ v, lse


# --- 7.1 one block and the online-softmax merge -----------------------------------------------------


@pytest.mark.task("7.1")
def test_blocks_merged_in_any_order_equal_softmax_over_all_keys(impl):
    cp = impl.context_parallel
    rng, seed = shared_rng()
    b, h, D = int(rng.integers(1, 4)), int(rng.integers(1, 4)), int(rng.integers(1, 5))
    Tq = int(rng.integers(1, 7))
    Tk = int(rng.integers(2, 10))
    scale = float(rng.uniform(0.2, 1.5))
    q, k, v = rng.normal(size=(b, h, Tq, D)) * 2, rng.normal(size=(b, h, Tk, D)) * 2, rng.normal(size=(b, h, Tk, D))
    what = f"q {q.shape}, {Tk} keys, scale {scale:.3f} (seed {seed})"
    want, want_lse = softmax_attention(q, k, v, scale, causal=False)
    cuts = sorted(rng.choice(np.arange(1, Tk), size=int(rng.integers(1, min(3, Tk - 1) + 1)), replace=False))
    bounds = list(zip([0, *cuts], [*cuts, Tk]))
    parts = [
        cp.block_attention(xp.asarray(q), xp.asarray(k[..., a:e, :]), xp.asarray(v[..., a:e, :]), scale, False)
        for a, e in bounds
    ]
    for a, e in bounds[:1]:
        one, one_lse = softmax_attention(q, k[..., a:e, :], v[..., a:e, :], scale, causal=False)
        close(parts[0][0], one, f"block_attention output over keys [{a}, {e}), {what}")
        close(parts[0][1], one_lse, f"block_attention log-sum-exp over keys [{a}, {e}), {what}")
    order = rng.permutation(len(parts))
    out, lse = parts[order[0]]
    for i in order[1:]:
        out, lse = cp.merge_partials(out, lse, *parts[i])
    close(out, want, f"merged output of key blocks {bounds} in order {order.tolist()}, {what}")
    close(lse, want_lse, f"merged log-sum-exp, {what}")
    diag = rng.normal(size=(b, h, Tq, D))
    out, lse = cp.block_attention(xp.asarray(diag), xp.asarray(diag), xp.asarray(diag), scale, True)
    want, want_lse = softmax_attention(diag, diag, diag, scale, causal=True)
    close(out, want, f"diagonal block (causal mask), {what}")
    close(lse, want_lse, f"diagonal block's log-sum-exp, {what}")


# --- 7.2 / 7.3 / 7.5 attention against the serial computation ------------------------------------------


def drawn_attention(rng, split, heads_multiple=1):
    """q, k, v and an upstream gradient for the whole sequence (float64, the same on every rank),
    the serial results, and my positions."""
    B, H, D = int(rng.integers(1, 3)), heads_multiple * int(rng.integers(1, 3)), int(rng.integers(1, 5))
    T = 2 * N * int(rng.integers(1, 4))
    q, k, v, up = (rng.normal(size=(B, H, T, D)) for _ in range(4))
    serial = [leaf(a) for a in (q, k, v)]
    y = F.scaled_dot_product_attention(*serial, causal=True)
    y.backward(xp.asarray(up))
    return (q, k, v, up), host(y), [host(s.grad) for s in serial]


def run_attention(fn, arrays, pos, split):
    q, k, v, up = arrays
    mine = [leaf(a[:, :, pos]) for a in (q, k, v)]
    with dist.comm_stats() as fwd:
        y = fn(*mine, group=dist.world(), split=split)
    with dist.comm_stats() as bwd:
        y.backward(xp.asarray(up[:, :, pos]))
    return y, mine, fwd, bwd


def check_attention(y, mine, want_y, want_grads, pos, what, grads=True):
    close(y, want_y[:, :, pos], f"output at my positions {pos.tolist()}, {what}")
    if grads:
        for name, t, g in zip("qkv", mine, want_grads):
            close(t.grad, g[:, :, pos], f"d{name} at my positions {pos.tolist()}, {what}")


def record_sends_and_blocks(cp, monkeypatch) -> list[str]:
    """Record, in order, each K/V ``pass_on`` (S) and each ``block_attention`` (C) of the ring module."""
    ring = importlib.import_module(cp.__name__ + ".ring")
    events: list[str] = []
    pass_on, block = ring.pass_on, ring.block_attention

    def sending(buf, group, tag, *args, **kwargs):
        if tag == ring.TAG_KV:
            events.append("S")
        return pass_on(buf, group, tag, *args, **kwargs)

    def computing(*args, **kwargs):
        events.append("C")
        return block(*args, **kwargs)

    monkeypatch.setattr(ring, "pass_on", sending)
    monkeypatch.setattr(ring, "block_attention", computing)
    return events


def contiguous_positions(T):
    r, c = dist.get_rank(), T // N
    return np.arange(r * c, (r + 1) * c)


def handout_chunk_ids(rank, n, split):
    """The handout's split: contiguous, chunk r; zigzag, chunks r and 2n - 1 - r."""
    return [rank] if split == "contiguous" else [rank, 2 * n - 1 - rank]


def handout_positions(T, rank, n, split):
    c = T // len(handout_chunk_ids(0, n, split) * n)
    return np.concatenate([np.arange(i * c, (i + 1) * c) for i in handout_chunk_ids(rank, n, split)])


def split_from_the_handout(cp, monkeypatch):
    """Run the split of task 7.4 as the handout gives it, not the student's: 7.2, 7.3 and 7.5 then
    score whether 7.4 is done or not (7.4's own tests check the student's split)."""
    for name, module in list(sys.modules.items()):  # every file of the package that uses them, by name
        if name == cp.__name__ or name.startswith(cp.__name__ + "."):
            for attr, fn in (("chunk_ids", handout_chunk_ids), ("positions", handout_positions)):
                if hasattr(module, attr):
                    monkeypatch.setattr(module, attr, fn)


@pytest.mark.task("7.2")
@pytest.mark.world_size(N)
def test_ring_forward_matches_serial_attention_with_causal_skips_and_ring_bytes(impl, monkeypatch):
    cp = impl.context_parallel
    rng, seed = shared_rng()
    arrays, want_y, _ = drawn_attention(rng, "contiguous")
    T = arrays[0].shape[2]
    pos = contiguous_positions(T)
    what = f"ring attention, contiguous split, q {arrays[0].shape} (seed {seed})"
    mine = [leaf(a[:, :, pos]) for a in arrays[:3]]
    events = record_sends_and_blocks(cp, monkeypatch)
    cp.WORK.reset()
    with dist.comm_stats() as s:
        y = cp.ring_attention(*mine, group=dist.world(), split="contiguous")
    check_attention(y, mine, want_y, None, pos, what, grads=False)
    order = "".join(events)
    assert re.fullmatch(f"(SC*){{{N - 1}}}C*", order), (
        f"{what}: rank {dist.get_rank()} posted the K/V sends (S) and computed blocks (C) in the order {order}; "
        f"post each step's send before computing on the block you hold (S, then its blocks C, {N - 1} times, "
        "then the last block's C), so the next block travels while you compute"
    )
    kv = 2 * mine[0].data.nbytes
    assert s.sent("send", group=dist.world().name) == (N - 1) * kv, (
        f"{what}: the K/V block ({kv} bytes) is sent N - 1 = {N - 1} times\n{s.table()}"
    )
    c, r = T // N, dist.get_rank()
    assert cp.WORK.reset() == (r + 1) * c * c, (
        f"{what}: rank {r} computes the blocks of ranks 0..{r} ({r + 1} blocks of {c}x{c} q·k products) and "
        "skips the blocks above the diagonal"
    )


@pytest.mark.task("7.3")
@pytest.mark.world_size(N)
def test_ring_backward_matches_serial_gradients_and_sends_dkv_home(impl):
    cp = impl.context_parallel
    rng, seed = shared_rng()
    arrays, want_y, want_grads = drawn_attention(rng, "contiguous")
    pos = contiguous_positions(arrays[0].shape[2])
    what = f"ring attention, contiguous split, q {arrays[0].shape} (seed {seed})"
    y, mine, _, bwd = run_attention(cp.ring_attention, arrays, pos, "contiguous")
    check_attention(y, mine, want_y, want_grads, pos, what)
    kv = 2 * mine[0].data.nbytes
    assert bwd.sent("send", group=dist.world().name) == (2 * N - 1) * kv, (
        f"{what}: backward sends the K/V block N - 1 times and the dK/dV accumulator N times "
        f"(home), {(2 * N - 1) * kv} bytes\n{bwd.table()}"
    )


def drawn_gpt(rng, heads_multiple=1):
    heads = heads_multiple * int(rng.integers(1, 3))
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


def check_gpt(cp, algo, split, heads_multiple=1):
    rng, seed = shared_rng()
    build, ids, targets = drawn_gpt(rng, heads_multiple)
    serial, model = build(), build()
    what = f"{serial.config}, batch {ids.shape}, {algo} {split} (seed {seed})"
    want = serial.loss(ids, targets)
    want.backward()
    ctx = cp.apply_context_parallel(model, dist.world(), algo, split)
    pos = ctx.positions(ids.shape[1])
    loss = model.loss(ids[:, pos], targets[:, pos], denominator=int((targets != -100).sum()), positions=pos)
    loss.backward()
    total = np.array([loss.item()])
    dist.all_reduce(total)
    np.testing.assert_allclose(total[0], want.item(), rtol=1e-4, err_msg=f"sum of the ranks' losses, {what}")
    scale = max(float(np.abs(host(p.grad)).max()) for p in serial.parameters())
    for (name, s), p in zip(serial.named_parameters(), model.parameters()):
        g = np.ascontiguousarray(host(p.grad))
        dist.all_reduce(g)
        np.testing.assert_allclose(
            g, host(s.grad), rtol=1e-4, atol=2e-6 + 1e-5 * scale, err_msg=f"{name}'s gradient summed over CP, {what}"
        )


@pytest.mark.task("7.3")
@pytest.mark.world_size(N)
def test_ring_gpt_loss_and_gradients_sum_to_serial(impl):
    check_gpt(impl.context_parallel, "ring", "contiguous")


# --- 7.4 zigzag ----------------------------------------------------------------------------------------


@pytest.mark.task("7.4")
@pytest.mark.world_size(N)
def test_zigzag_positions_balance_the_causal_work(impl):
    cp = impl.context_parallel
    rng, seed = shared_rng()
    n, c = int(rng.integers(2, 7)), int(rng.integers(1, 5))
    T = 2 * n * c
    what = f"T = {T} over {n} ranks (seed {seed})"
    held = [cp.positions(T, r, n, "zigzag") for r in range(n)]
    for r, pos in enumerate(held):
        want = list(range(r * c, (r + 1) * c)) + list(range(T - (r + 1) * c, T - r * c))
        assert [int(i) for i in pos] == want, f"rank {r}: chunks {r} and {2 * n - 1 - r} of {c} positions, {what}"
    work = cp.attention_work(T, n, "zigzag")
    assert work == [(2 * n + 1) * c * c] * n, f"zigzag work per rank {work}: equal, {what}"
    contiguous = cp.attention_work(T, n, "contiguous")
    assert len(set(contiguous)) == n, f"contiguous work per rank {contiguous} is unbalanced, {what}"
    with pytest.raises(ValueError, match=str(2 * n)):
        cp.positions(T + n, 0, n, "zigzag")


@pytest.mark.task("7.3")
@pytest.mark.world_size(N)
def test_zigzag_ring_attention_matches_serial_with_equal_work(impl, monkeypatch):
    cp = impl.context_parallel
    split_from_the_handout(cp, monkeypatch)
    rng, seed = shared_rng()
    arrays, want_y, want_grads = drawn_attention(rng, "zigzag")
    T = arrays[0].shape[2]
    pos = handout_positions(T, dist.get_rank(), N, "zigzag")
    what = f"ring attention, zigzag split, q {arrays[0].shape} (seed {seed})"
    cp.WORK.reset()
    mine = [leaf(a[:, :, pos]) for a in arrays[:3]]
    y = cp.ring_attention(*mine, group=dist.world(), split="zigzag")
    work = dist.all_gather(np.array([cp.WORK.reset()], dtype=np.int64)).tolist()
    c = T // (2 * N)
    assert work == [(2 * N + 1) * c * c] * N, f"{what}: q·k products per rank {work}, want equal"
    y.backward(xp.asarray(arrays[3][:, :, pos]))
    check_attention(y, mine, want_y, want_grads, pos, what)
    check_gpt(cp, "ring", "zigzag")


# --- 7.5 all-to-all attention -----------------------------------------------------------------------------


@pytest.mark.task("7.5")
@pytest.mark.world_size(N)
def test_alltoall_attention_matches_serial_and_sends_four_all_to_alls_each_way(impl, monkeypatch):
    cp = impl.context_parallel
    split_from_the_handout(cp, monkeypatch)
    rng, seed = shared_rng()
    arrays, want_y, want_grads = drawn_attention(rng, "contiguous", heads_multiple=N)
    pos = contiguous_positions(arrays[0].shape[2])
    what = f"all-to-all attention, contiguous split, q {arrays[0].shape} (seed {seed})"
    y, mine, fwd, bwd = run_attention(cp.alltoall_attention, arrays, pos, "contiguous")
    check_attention(y, mine, want_y, want_grads, pos, what)
    one = (N - 1) * mine[0].data.nbytes // N  # what each rank sends in one all-to-all of a (B, H, T/N, D)
    for label, s in (("forward", fwd), ("backward", bwd)):
        assert s.sent("all_to_all", group=dist.world().name) == 4 * one, (
            f"{what}: {label} runs 4 all-to-alls (q, k, v and the output), {4 * one} bytes\n{s.table()}"
        )
    # Zigzag: the gathered positions are out of order, so the sort (and its inverse) must be right.
    # (The positions are the handout's, so this checks 7.5's sort, not 7.4's split.)
    arrays, want_y, want_grads = drawn_attention(rng, "zigzag", heads_multiple=N)
    pos = handout_positions(arrays[0].shape[2], dist.get_rank(), N, "zigzag")
    y, mine, _, _ = run_attention(cp.alltoall_attention, arrays, pos, "zigzag")
    check_attention(y, mine, want_y, want_grads, pos, f"all-to-all attention, zigzag split (seed {seed})")
    bad = [leaf(np.zeros((1, N + 1, 2, 1))) for _ in range(3)]
    with pytest.raises(ValueError, match="heads"):
        cp.alltoall_attention(*bad, group=dist.world(), split="contiguous")


@pytest.mark.task("7.5")
@pytest.mark.world_size(N)
def test_alltoall_gpt_loss_and_gradients_sum_to_serial(impl):
    check_gpt(impl.context_parallel, "alltoall", "contiguous", heads_multiple=N)
