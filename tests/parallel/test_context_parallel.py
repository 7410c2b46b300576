"""Context parallel (ring and all-to-all attention, contiguous and zigzag splits) against the serial
computation: attention outputs and gradients, the whole GPT's loss and every gradient (summed over
the CP group) also after SGD steps and inside tensor parallel; bytes on the wire, bytes saved for
backward and attention work per rank against their formulas; overlap visible in the trace."""

from __future__ import annotations

import numpy as np
import pytest

from tinytrain import distributed as dist
from tinytrain import functional as F
from tinytrain import trace
from tinytrain.autograd import Tensor, saved_bytes
from tinytrain.backend import to_host, xp
from tinytrain.nn import GPT, GPTConfig
from tinytrain.optim import SGD
from tinytrain.parallel import context_parallel as cp
from tinytrain.parallel import tensor_parallel as tp

VOCAB, T, B = 16, 16, 2  # T = 16 cuts into 2N chunks for N = 2 and 4
RTOL, ATOL = 1e-4, 2e-6  # float32 GPT: sums in another order than serial
ALGOS = pytest.mark.parametrize("algo", ["ring", "alltoall"])
SPLITS = pytest.mark.parametrize("split", ["zigzag", "contiguous"])


def cp_size(n):
    return pytest.param(n, marks=pytest.mark.world_size(n), id=f"cp{n}")


SIZES = pytest.mark.parametrize("n", [cp_size(2), cp_size(4)])


def host(a):
    return to_host(a.data if isinstance(a, Tensor) else a)


def leaf(a):
    return Tensor(xp.asarray(np.ascontiguousarray(a)), requires_grad=True)


# --- splits and load balance --------------------------------------------------------------------------


@SIZES
@SPLITS
def test_positions_partition_the_sequence_and_zigzag_balances_the_causal_work(n, split):
    r = dist.get_rank()
    mine = cp.positions(T, r, n, split)
    assert mine.dtype.kind == "i" and np.all(np.diff(mine) > 0) and mine.size == T // n
    every = np.concatenate([cp.positions(T, p, n, split) for p in range(n)])
    assert sorted(every.tolist()) == list(range(T)), f"{split}: every position on exactly one rank"
    if split == "zigzag":
        c = T // (2 * n)
        assert mine.tolist() == list(range(r * c, (r + 1) * c)) + list(range(T - (r + 1) * c, T - r * c))
    # work actually computed by the ring's forward, gathered from every rank
    q = leaf(np.random.default_rng(0).normal(size=(1, 1, T // n, 2)))
    cp.WORK.reset()
    cp.ring_attention(q, q, q, group=dist.world(), split=split)
    measured = dist.all_gather(np.array([cp.WORK.reset()], dtype=np.int64)).tolist()
    assert measured == cp.attention_work(T, n, split)
    assert sum(measured) >= T * (T + 1) // 2  # at least the causal triangle
    if split == "zigzag":
        c = T // (2 * n)
        assert measured == [(2 * n + 1) * c * c] * n, f"zigzag: equal work on every rank, {measured}"
    else:
        c = T // n
        assert measured == [(p + 1) * c * c for p in range(n)], f"contiguous: rank r does r + 1 blocks, {measured}"


@pytest.mark.world_size(4)
def test_impossible_splits_say_what_to_change():
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=1, n_head=2, n_embd=8))
    ctx = cp.apply_context_parallel(model, dist.world(), "ring", "zigzag")
    with pytest.raises(ValueError, match="sequence length 12 does not cut into 8 equal chunks.*divisible by 8"):
        ctx.positions(12)
    assert cp.apply_context_parallel(model, dist.world(), "ring", "contiguous").positions(12).size == 3
    with pytest.raises(ValueError, match="2 attention heads.*4 ranks.*choose a CP size that divides 2.*algo='ring'"):
        cp.apply_context_parallel(model, dist.world(), "alltoall")
    with pytest.raises(ValueError, match="split='halves'"):
        cp.apply_context_parallel(model, dist.world(), split="halves")
    with pytest.raises(ValueError, match="algo='tree'"):
        cp.apply_context_parallel(model, dist.world(), algo="tree")


# --- the attention function against serial attention on the whole sequence ---------------------------


def attention_case(n, algo, split, heads=4, dim=3, seed=1):
    """My positions' q, k, v and upstream gradient (float64), and serial attention's results there."""
    rng = np.random.default_rng(seed)
    q, k, v, up = (rng.normal(size=(B, heads, T, dim)) for _ in range(4))
    serial = [leaf(a) for a in (q, k, v)]
    y = F.scaled_dot_product_attention(*serial, causal=True)
    y.backward(xp.asarray(up))
    pos = cp.positions(T, dist.get_rank(), n, split)
    mine = [leaf(a[:, :, pos]) for a in (q, k, v)]
    fn = cp.ring_attention if algo == "ring" else cp.alltoall_attention
    return fn, mine, up[:, :, pos], pos, host(y)[:, :, pos], [host(s.grad)[:, :, pos] for s in serial]


@SIZES
@ALGOS
@SPLITS
def test_attention_output_and_gradients_match_serial_attention(n, algo, split):
    fn, mine, up, _, want_y, want_grads = attention_case(n, algo, split)
    y = fn(*mine, group=dist.world(), split=split)
    np.testing.assert_allclose(host(y), want_y, rtol=1e-10, atol=1e-12, err_msg=f"{algo} {split}: output")
    y.backward(xp.asarray(up))
    for name, t, want in zip("qkv", mine, want_grads):
        np.testing.assert_allclose(host(t.grad), want, rtol=1e-10, atol=1e-12, err_msg=f"{algo} {split}: d{name}")


@SIZES
@SPLITS
def test_merging_partial_results_in_any_order_equals_softmax_over_all_keys(n, split):
    rng = np.random.default_rng(2)
    q, k, v = (rng.normal(size=(3, 5, 4)) for _ in range(3))
    out, lse = cp.block_attention(q, k, v, 0.5, causal=False)
    s = 0.5 * q @ k.swapaxes(-1, -2)
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), rtol=1e-12)
    parts = [cp.block_attention(q, k[:, a:b], v[:, a:b], 0.5, causal=False) for a, b in ((0, 1), (1, 3), (3, 5))]
    for order in ((0, 1, 2), (2, 0, 1)):
        o, lv = parts[order[0]]
        for i in order[1:]:
            o, lv = cp.merge_partials(o, lv, *parts[i])
        np.testing.assert_allclose(o, out, rtol=1e-12)
        np.testing.assert_allclose(lv, lse, rtol=1e-12)
    o, lv = cp.merge_partials(np.zeros_like(out), np.full(lse.shape, -np.inf), out, lse)  # nothing yet
    np.testing.assert_allclose(o, out, rtol=1e-12)


# --- the whole GPT: the sum of the CP ranks' losses and gradients is the serial one --------------------


def tiny_gpt(n_head=4, width=16, n_layer=2):
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=n_layer, n_head=n_head, n_embd=width), seed=5)


def batch(step):
    rng = np.random.default_rng([11, step])
    y = rng.integers(0, VOCAB, size=(B, T))
    y[:, :3] = -100  # ignored targets: the denominator counts only the others
    return rng.integers(0, VOCAB, size=(B, T)), y


def cp_step(model, ctx, step):
    """My positions' loss (summed, over the global target count), backward, gradients summed over CP."""
    x, y = batch(step)
    pos = ctx.positions(T)
    loss = model.loss(x[:, pos], y[:, pos], denominator=int((y != -100).sum()), positions=pos)
    loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=ctx.group)
    total = np.array([loss.item()])
    dist.all_reduce(total, group=ctx.group)
    return total[0]


def serial_step(model, step):
    x, y = batch(step)
    loss = model.loss(x, y)
    loss.backward()
    return loss.item()


def grad_atol(serial):
    # a gradient that should be 0 (the key bias) holds float32 noise relative to the largest one
    return ATOL + 1e-5 * max(float(np.abs(host(p.grad)).max()) for p in serial.parameters())


@SIZES
@ALGOS
@SPLITS
def test_gpt_loss_and_every_gradient_match_serial_after_sgd_steps(n, algo, split):
    serial, model = tiny_gpt(), tiny_gpt()
    ctx = cp.apply_context_parallel(model, dist.world(), algo, split)
    assert (ctx.group, ctx.algo, ctx.split) == (dist.world(), algo, split)
    with ctx.serial():  # rank-local, whole sequences: the serial model's numbers, no talk
        with dist.comm_stats() as quiet:
            np.testing.assert_allclose(model.loss(*batch(9)).item(), serial.loss(*batch(9)).item(), rtol=1e-6)
        assert quiet.sent() == 0 and all(m.attention_fn is None for m in ctx.modules)
    assert all(m.attention_fn == ctx.attention for m in ctx.modules) and len(ctx.modules) == 2
    opt_s, opt_p = SGD(serial.parameters(), lr=0.5, momentum=0.9), SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step in range(3):
        opt_s.zero_grad(), opt_p.zero_grad()
        want, got = serial_step(serial, step), cp_step(model, ctx, step)
        np.testing.assert_allclose(got, want, rtol=RTOL, err_msg=f"{algo} {split}: loss at step {step}")
        atol = grad_atol(serial)
        for (name, s), p in zip(serial.named_parameters(), model.parameters()):
            np.testing.assert_allclose(
                host(p.grad), host(s.grad), rtol=RTOL, atol=atol, err_msg=f"{algo} {split} step {step}: {name}"
            )
        opt_s.step(), opt_p.step()
    for (name, s), p in zip(serial.named_parameters(), model.parameters()):
        np.testing.assert_allclose(host(p), host(s), rtol=RTOL, atol=ATOL, err_msg=f"after 3 steps: {name}")


@pytest.mark.world_size(4)
@ALGOS
def test_context_parallel_inside_tensor_parallel_matches_serial(algo):
    mesh = dist.DeviceMesh({"cp": 2, "tp": 2})  # TP innermost
    serial = tiny_gpt(n_head=4)
    model = tp.tensor_parallel_gpt(tiny_gpt(n_head=4), mesh.get_group("tp"))
    ctx = cp.apply_context_parallel(model, mesh.get_group("cp"), algo, "zigzag")
    assert all(a.attention_fn is not None for a in model.modules() if isinstance(a, tp.ParallelAttention))
    want, got = serial_step(serial, 0), cp_step(model, ctx, 0)
    np.testing.assert_allclose(got, want, rtol=RTOL, err_msg="loss")
    named, atol = dict(serial.named_parameters()), grad_atol(serial)
    for s in model.shards():
        full = host(named[s.name].grad)
        want = full if s.replicated else np.take(full, range(s.start, s.stop), axis=s.axis)
        np.testing.assert_allclose(host(s.param.grad), want, rtol=RTOL, atol=atol, err_msg=f"{algo}: {s.name}")


# --- measured, not claimed: bytes on the wire, bytes saved for backward, overlap ------------------------


def sent(stats, group, algo):
    return stats.sent("send", group=group.name) if algo == "ring" else stats.sent("all_to_all", group=group.name)


@SIZES
@ALGOS
@SPLITS
def test_bytes_sent_per_layer_match_the_formula(n, algo, split):
    """Ring: forward passes K/V N − 1 times, backward K/V N − 1 times and dK/dV N times (home);
    all-to-all: q, k, v and the output, (N − 1)/N of each, both ways."""
    model, g = tiny_gpt(), dist.world()
    cp.apply_context_parallel(model, g, algo, split)
    pos = cp.positions(T, dist.get_rank(), n, split)
    x, y = batch(0)
    with dist.comm_stats() as fwd:
        loss = model.loss(x[:, pos], y[:, pos], denominator=B * T, positions=pos)
    with dist.comm_stats() as bwd:
        loss.backward()
    C, L = model.config.n_embd, model.config.n_layer
    kv = 2 * B * (T // n) * C * 4  # K and V of my positions, float32
    if algo == "ring":
        per_layer = ((n - 1) * kv, (2 * n - 1) * kv)
        assert per_layer == cp.ring_bytes((B, 4, T // n, C // 4), 4, n)
    else:
        per_layer = (4 * (n - 1) * (kv // 2) // n,) * 2
        assert per_layer == cp.alltoall_bytes((B, 4, T // n, C // 4), 4, n)
    for what, stats, want in (("forward", fwd, per_layer[0]), ("backward", bwd, per_layer[1])):
        assert sent(stats, g, algo) == L * want, f"{algo} {split} {what}:\n{stats.table()}"
        others = {op for _, op in stats.rows} - {"send", "recv", "all_to_all", "debug_check"}
        assert not others, f"{what}: only attention talks, got {others}\n{stats.table()}"


def attention_saved_bytes(fn, q, k, v):
    before = saved_bytes()
    y = fn(q, k, v)
    held = saved_bytes() - before
    del y
    return held


@SIZES
@ALGOS
def test_bytes_saved_for_backward_fall_as_one_over_n(n, algo):
    """Serial attention saves q, k, v (4BTC each, float32) and the probabilities 4BHT² (a context of up
    to 64 positions, one attention block; longer causal ones save only each block's visible part). Per rank,
    ring saves q, k, v and its output at T/N positions (4·4B(T/N)C) and the log-sum-exp 4BH(T/N);
    all-to-all saves its H/N heads' q, k, v over T (3·4BTC/N) and probabilities 4B(H/N)T²."""
    H, D = 4, 3
    C = H * D
    _, mine, *_ = attention_case(n, algo, "zigzag", heads=H, dim=D)
    mine = [Tensor(xp.asarray(host(t).astype(np.float32)), requires_grad=True) for t in mine]
    full = [Tensor(xp.zeros((B, H, T, D), dtype=np.float32), requires_grad=True) for _ in range(3)]
    serial = attention_saved_bytes(lambda *a: F.scaled_dot_product_attention(*a, causal=True), *full)
    assert serial == 3 * 4 * B * T * C + 4 * B * H * T * T
    fn = cp.ring_attention if algo == "ring" else cp.alltoall_attention
    got = attention_saved_bytes(lambda *a: fn(*a, group=dist.world(), split="zigzag"), *mine)
    if algo == "ring":
        assert got == 4 * 4 * B * (T // n) * C + 4 * B * H * (T // n), got
    else:
        assert got == serial // n, (got, serial)


@SIZES
def test_whole_model_saves_one_nth_of_the_serial_activations_besides_attention(n):
    """Everything but attention works per token: its saved bytes divide by N exactly, but for what
    every rank saves whole: the tied head's weight (the logits' matmul saves its transposed view)
    and the loss's 1/denominator scalar."""
    H, C, L = 4, 16, 2
    serial, model = tiny_gpt(), tiny_gpt()
    ctx = cp.apply_context_parallel(model, dist.world(), "ring", "zigzag")
    x, y = batch(0)
    pos = ctx.positions(T)
    before = saved_bytes()
    loss = serial.loss(x, y, denominator=B * T)
    whole = saved_bytes() - before
    del loss
    before = saved_bytes()
    loss = model.loss(x[:, pos], y[:, pos], denominator=B * T, positions=pos)
    mine = saved_bytes() - before
    del loss
    attn_serial = 3 * 4 * B * T * C + 4 * B * H * T * T
    attn_ring = 4 * 4 * B * (T // n) * C + 4 * B * H * (T // n)
    fixed = VOCAB * C * 4 + 4
    per_token = whole - L * attn_serial - fixed
    assert per_token % n == 0
    assert mine == per_token // n + L * attn_ring + fixed, (mine, whole)


@pytest.mark.world_size(4)
def test_ring_posts_each_transfer_before_the_block_it_overlaps():
    n = 4
    fn, mine, up, *_ = attention_case(n, "ring", "zigzag")
    trace.clear()
    trace.enable()
    try:
        y = fn(*mine, group=dist.world(), split="zigzag")
        y.backward(xp.asarray(up))
    finally:
        trace.enable(False)
    spans = list(trace.spans())
    trace.clear()
    compute = {
        which: [s for s in spans if s["name"] == "ring attention" and s["args"]["pass"] == which]
        for which in ("forward", "backward")
    }
    split_at = compute["backward"][0]["start"]
    recvs = {
        "forward": [s for s in spans if s["name"] == "recv" and s["end"] <= split_at],
        "backward": [s for s in spans if s["name"] == "recv" and s["start"] >= compute["forward"][-1]["end"]],
    }
    # forward: the next K/V block; backward: the next block and the dK/dV accumulators (the last goes home)
    assert [len(recvs["forward"]), len(recvs["backward"])] == [n - 1, 2 * n - 1]
    for which in ("forward", "backward"):
        assert [s["args"]["step"] for s in compute[which]] == list(range(n))
        for step, block in enumerate(compute[which][: n - 1]):
            assert any(r["start"] <= block["start"] and r["end"] >= block["end"] for r in recvs[which]), (
                f"{which} step {step}: no transfer in flight across the block's compute"
            )
