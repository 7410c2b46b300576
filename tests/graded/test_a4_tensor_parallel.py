"""Assignment 4 (tensor and sequence parallel), graded. Run: ``python -m grader --tasks 4.*``.

Every piece is checked against the serial computation it replaces, on shapes and values drawn
when the test runs (so only a real implementation passes): region functions against NumPy,
parallel layers against the serial layer whose weights they shard (outputs, input gradients and
each shard's gradient against the matching slice of the serial one), and the bytes each layer
sends against the ring formulas. Beyond the numbers: GatherFromRegion's backward sends nothing,
the vocab-parallel loss stays exact on logits of magnitude 1e4, each replica of a {dp, tp} mesh
drops its rows of the serial masks, and SP saves activation bytes for backward.

Besides the drawn shapes every test runs fixed hard cases, whatever the draw: a TP group of 3
ranks (the others sit the test out), strided (non-contiguous) inputs and gradients of the region
functions, one and two (and, on 3 ranks, two) heads per rank in attention and in the whole GPT,
a vocabulary split where only one rank owns the ids or the targets, and the vocab-parallel loss
on a {dp: 2, tp: 2} mesh (each replica its own rows, each TP group its own sums).
"""

from __future__ import annotations

import numpy as np
import pytest

from grader.seeds import grading_seed
from tinytrain import distributed as dist
from tinytrain import functional as F
from tinytrain import random as _random
from tinytrain.autograd import Tensor, saved_bytes
from tinytrain.backend import to_host, xp
from tinytrain.nn import GPT, GPTConfig
from tinytrain.nn.layers import Embedding, Linear
from tinytrain.nn.transformer import MLP, CausalSelfAttention
from tinytrain.testing import assert_close, assert_same_kind

RTOL, ATOL = 1e-4, 1e-6  # float32, sums in another order than serial


def shared_rng():
    """A generator every rank draws identically, from a seed drawn now (or TINYTRAIN_GRADER_SEED)."""
    seed = grading_seed()
    return np.random.default_rng(seed), seed


def close(got, want, what, scale=0.0):
    """``scale``: the largest gradient of the layer. Float32 rounding is relative to the sums'
    terms, so a gradient that should be 0 (a key bias: softmax ignores a per-query constant)
    holds noise relative to its neighbours' size, not its own."""
    assert_same_kind(got, want, what)
    got = to_host(got.data if isinstance(got, Tensor) else got)
    assert_close(got, to_host(want), rtol=RTOL, atol=ATOL + 1e-5 * scale, what=what)


def largest_gradient(model):
    return max(float(np.abs(to_host(p.grad)).max()) for p in model.parameters() if p.grad is not None)


def piece(arr, axis, t, r):
    return np.split(to_host(arr), t, axis=axis)[r]


def leaf(arr):
    return Tensor(xp.asarray(np.ascontiguousarray(arr, dtype=np.float32)), requires_grad=True)


def strided(arr):
    """The same float32 values in Fortran order: a strided view, not C-contiguous (as a transpose is)."""
    return xp.asarray(np.asfortranarray(np.asarray(arr, dtype=np.float32)))


def tp_group(case):
    """(group, t) of a case: the world of 4, or ranks 0-2 for "3-ranks" (group None on rank 3, which
    sits the test out)."""
    if case == "3-ranks":
        g = dist.new_group(range(3))
        return (g if dist.get_rank() < 3 else None), 3
    return dist.world(), 4


def ring_all_reduce_bytes(nbytes, t):
    return 2 * (t - 1) * nbytes // t


def all_reduce_bytes(nbytes, group=None, algo="ring") -> int:
    """What this rank sends in one all-reduce of ``nbytes`` over ``group`` by the framework's own
    ``algo`` (None: the one it picks by size), measured: 2(t-1)/t of the buffer by the ring, and
    in a student copy whose ring is still a TODO, whatever its stand-in sends (every rank of the
    group calls it at the same point)."""
    group = group or dist.world()
    with dist.comm_stats() as s:
        dist.all_reduce(xp.zeros(nbytes // 4, dtype=xp.float32), group=group, algo=algo)
    return sent(s, "all_reduce", group)


def sent(stats, op, group=None):
    return stats.sent(op, group=(group or dist.world()).name)


# --- 4.1 region functions --------------------------------------------------------------------------


@pytest.mark.task("4.1")
@pytest.mark.world_size(4)
@pytest.mark.parametrize("case", ["drawn", "strided", "3-ranks"])
def test_region_functions(impl, case):
    """``strided``: every input and every upstream gradient is a strided (Fortran-order) array, as
    a transpose hands over; the collectives want contiguous buffers."""
    rng, seed = shared_rng()
    g, t = tp_group(case)
    if g is None:
        return
    tp, r = impl.tensor_parallel, dist.get_rank(g)
    low = 2 if case == "strided" else 1  # every axis longer than 1: really strided
    shape = (int(rng.integers(low, 4)), int(rng.integers(low, 5)), t * int(rng.integers(low, 4)))
    per_rank = rng.normal(size=(t,) + shape).astype(np.float32)  # rank i's input is per_rank[i]
    upstream = rng.normal(size=(t,) + shape).astype(np.float32)  # rank i's output gradient
    what = f"{case}: shape {shape}, TP group of {t} ranks, rank {r} (seed {seed})"
    if case == "strided":
        what += ", inputs and gradients strided (not C-contiguous)"
    arr = strided if case == "strided" else xp.asarray

    def leaf_(a):
        return Tensor(arr(np.ascontiguousarray(a)), requires_grad=True)

    x = leaf_(per_rank[r])
    out = tp.CopyToRegion.apply(x, group=g)
    close(out, per_rank[r], f"CopyToRegion forward is the identity, {what}")
    out.backward(arr(upstream[r]))
    close(x.grad, upstream.sum(0), f"CopyToRegion backward sums every rank's gradient, {what}")

    x = leaf_(per_rank[r])
    out = tp.ReduceFromRegion.apply(x, group=g)
    close(out, per_rank.sum(0), f"ReduceFromRegion forward sums every rank's input, {what}")
    out.backward(arr(upstream[r]))
    close(x.grad, upstream[r], f"ReduceFromRegion backward is the identity, {what}")

    whole = per_rank[0]  # the same on every rank
    x = leaf_(piece(whole, -1, t, r))
    out = tp.GatherFromRegion.apply(x, group=g)
    close(out, whole, f"GatherFromRegion forward concatenates the pieces along the last axis, {what}")
    with dist.comm_stats() as s:
        out.backward(arr(upstream[0]))
    close(x.grad, piece(upstream[0], -1, t, r), f"GatherFromRegion backward keeps my piece, {what}")
    # The gathered tensor is whole and the same on every rank, so its gradient is too: backward
    # splits (0 bytes). An all-reduce or reduce-scatter (divided by t to fix the values) sends
    # 2(t-1)/t or (t-1)/t of the gradient's bytes for nothing.
    talk = {op: s.sent(op) for _, op in s.rows if op != "debug_check" and s.sent(op)}  # not the harness's checks
    assert not talk, (
        f"GatherFromRegion backward sent {sum(talk.values())} bytes ({', '.join(talk)}); it must only keep my "
        f"piece of the gradient (the same on every rank), sending nothing, {what}\n{s.table()}"
    )

    x = leaf_(whole)
    out = tp.ScatterToRegion.apply(x, group=g)
    close(out, piece(whole, -1, t, r), f"ScatterToRegion forward keeps my piece of the last axis, {what}")
    out.backward(arr(piece(upstream[0], -1, t, r)))
    close(x.grad, upstream[0], f"ScatterToRegion backward gathers the pieces' gradients, {what}")


# --- 4.2 column- and row-parallel linear ------------------------------------------------------------


def drawn_linear(rng, t, low=1):
    """``low``: the smallest batch and sequence length (2: a Fortran-order copy is really strided)."""
    n_in, n_out = t * int(rng.integers(1, 5)), t * int(rng.integers(1, 5))
    linear = Linear(n_in, n_out, rng=np.random.default_rng(int(rng.integers(1 << 30))))
    linear.bias.data[...] = xp.asarray(rng.normal(size=n_out).astype(np.float32))
    x = rng.normal(size=(int(rng.integers(low, 4)), int(rng.integers(low, 5)), n_in)).astype(np.float32)
    return linear, x, rng.normal(size=x.shape[:-1] + (n_out,)).astype(np.float32)


def serial_grads(linear, x, upstream):
    xs = leaf(x)
    y = linear(xs)
    y.backward(xp.asarray(upstream))
    return y, xs.grad


@pytest.mark.task("4.2")
@pytest.mark.world_size(4)
@pytest.mark.parametrize("gather_output", [False, True])
@pytest.mark.parametrize("case", ["drawn", "strided", "3-ranks"])
def test_column_parallel_linear(impl, gather_output, case):
    rng, seed = shared_rng()
    g, t = tp_group(case)
    if g is None:
        return
    tp, r = impl.tensor_parallel, dist.get_rank(g)
    linear, x, upstream = drawn_linear(rng, t, low=2 if case == "strided" else 1)
    what = (
        f"{case}: Linear({linear.in_features}, {linear.out_features}) over {t} ranks, rank {r} holding output "
        f"columns {r * linear.out_features // t}-{(r + 1) * linear.out_features // t - 1}, x {x.shape}"
        f"{' (strided)' if case == 'strided' else ''}, gather_output={gather_output} (seed {seed})"
    )
    col = tp.ColumnParallelLinear(linear, g, "fc", gather_output=gather_output)
    want, want_dx = serial_grads(linear, x, upstream)
    xs = Tensor(strided(x), requires_grad=True) if case == "strided" else leaf(x)
    y = col(xs)
    close(y, want.data if gather_output else piece(want.data, -1, t, r), f"output, {what}")
    y.backward(xp.asarray(upstream if gather_output else piece(upstream, -1, t, r)))
    close(xs.grad, want_dx, f"input gradient (summed over the ranks' columns), {what}")
    close(col.weight.grad, piece(linear.weight.grad, 1, t, r), f"weight shard gradient, {what}")
    close(col.bias.grad, piece(linear.bias.grad, 0, t, r), f"bias shard gradient, {what}")


@pytest.mark.task("4.2")
@pytest.mark.world_size(4)
@pytest.mark.parametrize("case", ["drawn", "strided", "3-ranks"])
def test_row_parallel_linear(impl, case):
    rng, seed = shared_rng()
    g, t = tp_group(case)
    if g is None:
        return
    tp, r = impl.tensor_parallel, dist.get_rank(g)
    linear, x, upstream = drawn_linear(rng, t, low=2 if case == "strided" else 1)
    what = (
        f"{case}: Linear({linear.in_features}, {linear.out_features}) over {t} ranks, rank {r} holding input rows "
        f"{r * linear.in_features // t}-{(r + 1) * linear.in_features // t - 1}, x {x.shape}"
        f"{' (my piece strided)' if case == 'strided' else ''} (seed {seed})"
    )
    row = tp.RowParallelLinear(linear, g, "proj")
    want, want_dx = serial_grads(linear, x, upstream)
    xs = Tensor(strided(piece(x, -1, t, r)), requires_grad=True) if case == "strided" else leaf(piece(x, -1, t, r))
    with dist.comm_stats() as s:
        y = row(xs)
    close(y, want.data, f"output (partial products all-reduced, bias added once), {what}")
    want_bytes = all_reduce_bytes(want.data.nbytes, g)
    assert sent(s, "all_reduce", g) == want_bytes, (
        f"the output's all-reduce sent {sent(s, 'all_reduce', g)} bytes, expected {want_bytes}: one ring all-reduce "
        f"of the {want.data.nbytes}-byte output, 2(t-1)/t of it, {what}\n{s.table()}"
    )
    y.backward(xp.asarray(upstream))
    close(xs.grad, piece(want_dx, -1, t, r), f"input gradient (my piece), {what}")
    close(row.weight.grad, piece(linear.weight.grad, 0, t, r), f"weight shard gradient, {what}")
    close(row.bias.grad, linear.bias.grad, f"bias gradient, {what}")


# --- 4.3 parallel MLP and attention --------------------------------------------------------------------


def check_layer(parallel, serial, x, upstream, t, what, group=None):
    xs, xp_ = leaf(x), leaf(x)
    want = serial(xs)
    want.backward(xp.asarray(upstream))
    with dist.comm_stats() as fwd:
        y = parallel(xp_)
    close(y, want.data, f"output, {what}")
    with dist.comm_stats() as bwd:
        y.backward(xp.asarray(upstream))
    close(xp_.grad, xs.grad, f"input gradient, {what}")
    named, scale = dict(serial.named_parameters()), largest_gradient(serial)
    for sh in parallel.shards():
        full = to_host(named[sh.name].grad)
        want = full if sh.replicated else np.take(full, range(sh.start, sh.stop), axis=sh.axis)
        close(sh.param.grad, want, f"gradient of {sh.name}, {what}", scale)
    one = all_reduce_bytes(x.nbytes, group)
    for label, s in (("forward", fwd), ("backward", bwd)):
        assert sent(s, "all_reduce", group) == one, (
            f"{label} sent {sent(s, 'all_reduce', group)} bytes by all-reduce, expected {one}: one ring all-reduce of "
            f"the {x.nbytes}-byte activations, {what}\n{s.table()}"
        )


@pytest.mark.task("4.3")
@pytest.mark.world_size(4)
@pytest.mark.parametrize("case", ["drawn", "3-ranks"])
def test_parallel_mlp(impl, case):
    rng, seed = shared_rng()
    g, t = tp_group(case)
    if g is None:
        return
    tp = impl.tensor_parallel
    C = t * int(rng.integers(1, 4))
    # With dropout (training mode): the parallel MLP must drop exactly the serial MLP's elements
    # (masks are keyed by the module's site and the seed, so both draw the same ones).
    mlp = MLP(C, 4 * C, dropout=0.3, rng=np.random.default_rng(int(rng.integers(1 << 30))))
    mlp.dropout.site = "dropout"  # the site ParallelMLP(mlp, g, "") keys its masks with
    for p in mlp.parameters():
        p.data[...] += xp.asarray(rng.normal(scale=0.1, size=p.shape).astype(np.float32))
    x = rng.normal(size=(2, int(rng.integers(1, 6)), C)).astype(np.float32)
    upstream = rng.normal(size=x.shape).astype(np.float32)
    _random.manual_seed(seed)
    what = f"{case}: MLP width {C} over {t} ranks with dropout 0.3, x {x.shape} (seed {seed})"
    check_layer(tp.ParallelMLP(mlp, g, ""), mlp, x, upstream, t, what, g)


# case: (ranks, heads per rank); None: drawn (1 or 2)
ATTENTION_CASES = {"drawn": (4, None), "1-head-per-rank": (4, 1), "2-heads-per-rank": (4, 2), "3-ranks": (3, 2)}


@pytest.mark.task("4.3")
@pytest.mark.world_size(4)
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_parallel_attention_splits_heads(impl, case):
    rng, seed = shared_rng()
    g, t = tp_group(case)
    if g is None:
        return
    tp, per_rank = impl.tensor_parallel, ATTENTION_CASES[case][1] or int(rng.integers(1, 3))
    heads, head_dim = t * per_rank, int(rng.integers(1, 4))
    # with dropout (training mode): the output's mask must be the serial module's, keyed by its site
    config = GPTConfig(vocab_size=8, block_size=8, n_layer=1, n_head=heads, n_embd=heads * head_dim, dropout=0.3)
    attn = CausalSelfAttention(config, rng=np.random.default_rng(int(rng.integers(1 << 30))))
    attn.dropout.site = "dropout"  # the site ParallelAttention(attn, g, "") keys its masks with
    for p in attn.parameters():
        p.data[...] += xp.asarray(rng.normal(scale=0.3, size=p.shape).astype(np.float32))
    x = rng.normal(size=(2, int(rng.integers(2, 9)), config.n_embd)).astype(np.float32)
    upstream = rng.normal(size=x.shape).astype(np.float32)
    r = dist.get_rank(g)
    _random.manual_seed(seed)
    what = (
        f"{case}: {heads} heads of {head_dim} over {t} ranks, {per_rank} head{'s' * (per_rank > 1)} per rank "
        f"(rank {r}: heads {r * per_rank}-{(r + 1) * per_rank - 1}), dropout 0.3, x {x.shape} (seed {seed})"
    )
    check_layer(tp.ParallelAttention(attn, g, ""), attn, x, upstream, t, what, g)
    bad = CausalSelfAttention(GPTConfig(vocab_size=8, block_size=8, n_layer=1, n_head=t + 2, n_embd=t + 2))
    with pytest.raises(ValueError, match="heads"):
        tp.ParallelAttention(bad, g, "")


# --- 4.4 vocab-parallel embedding and cross-entropy -----------------------------------------------------


@pytest.mark.task("4.4")
@pytest.mark.world_size(4)
@pytest.mark.parametrize("case", ["drawn", "ids-on-one-rank", "3-ranks"])
def test_vocab_parallel_embedding(impl, case):
    """``ids-on-one-rank``: every id is in the last rank's rows; the others look up nothing of theirs."""
    rng, seed = shared_rng()
    g, t = tp_group(case)
    if g is None:
        return
    tp, r = impl.tensor_parallel, dist.get_rank(g)
    V, C = t * int(rng.integers(1, 6)), int(rng.integers(1, 6))
    emb = Embedding(V, C, rng=np.random.default_rng(int(rng.integers(1 << 30))))
    ids = rng.integers(V - V // t if case == "ids-on-one-rank" else 0, V, size=(2, int(rng.integers(1, 8))))
    upstream = rng.normal(size=ids.shape + (C,)).astype(np.float32)
    what = (
        f"{case}: vocabulary {V} over {t} ranks, rank {r} holding rows {r * V // t}-{(r + 1) * V // t - 1}, ids "
        f"{ids.tolist()} (seed {seed})"
    )
    want = emb(xp.asarray(ids))
    want.backward(xp.asarray(upstream))
    par = tp.VocabParallelEmbedding(emb, g)
    y = par(xp.asarray(ids))
    close(y, want.data, f"lookup, {what}")
    y.backward(xp.asarray(upstream))
    close(par.weight.grad, piece(emb.weight.grad, 0, t, r), f"gradient of my rows, {what}")
    with pytest.raises(ValueError, match="vocabulary"):
        tp.VocabParallelEmbedding(Embedding(t + 1, 2), g)


@pytest.mark.task("4.4")
@pytest.mark.world_size(4)
@pytest.mark.parametrize("case", ["drawn", "targets-on-one-rank", "mesh-2x2", "3-ranks"])
def test_vocab_parallel_cross_entropy_never_sees_full_logits(impl, case):
    """``targets-on-one-rank``: every counted target is in rank 0's slice; ``mesh-2x2``: the TP groups
    of a {dp: 2, tp: 2} mesh, each replica with its own rows of logits (its sums stay in its group)."""
    rng, seed = shared_rng()
    if case == "mesh-2x2":
        mesh = dist.DeviceMesh({"dp": 2, "tp": 2})
        g, t, replica = mesh.get_group("tp"), 2, mesh.coords["dp"]
    else:
        (g, t), replica = tp_group(case), 0
        if g is None:
            return
    tp, r = impl.tensor_parallel, dist.get_rank(g)
    V, N = t * int(rng.integers(2, 6)), t * int(rng.integers(1, 4))
    logits = (rng.normal(size=(2, N, V)) * 5).astype(np.float32)[replica]  # each replica its own
    targets = rng.integers(0, V // t if case == "targets-on-one-rank" else V, size=(2, N))[replica]
    targets[rng.random(N) < 0.3] = -100
    targets[0] = int(rng.integers(0, V // t if case == "targets-on-one-rank" else V))  # at least one counted target
    what = (
        f"{case}: {N} rows of {V} logits over {t} ranks, rank {r} holding columns {r * V // t}-{(r + 1) * V // t - 1}"
    )
    what += f", DP replica {replica} of 2 with its own rows" if case == "mesh-2x2" else ""
    what += f" (seed {seed})"
    full = leaf(logits)
    want = F.cross_entropy(full, xp.asarray(targets))
    want.backward()
    mine = leaf(piece(logits, -1, t, r))
    with dist.comm_stats() as s:
        got = tp.vocab_parallel_cross_entropy(mine, targets, g, vocab_start=r * V // t)
    close(got, want.data, f"loss, {what}")
    # max, sum of exp and the target's logit: three all-reduces of N numbers, never N·V
    one = {all_reduce_bytes(4 * N, g, algo) for algo in ("ring", None)}  # either algorithm will do
    assert sent(s, "all_reduce", g) in {3 * b for b in one}, (
        f"the loss sent {sent(s, 'all_reduce', g)} bytes by all-reduce, expected "
        f"{' or '.join(str(3 * b) for b in sorted(one))}: three all-reduces of the {N} rows' numbers (max, "
        f"sum of exponentials, target logit), each {' or '.join(map(str, sorted(one)))} bytes, {what}\n{s.table()}"
    )
    assert s.sent("all_gather") == 0, (
        f"the loss sent {s.sent('all_gather')} bytes by all-gather: the logits are never gathered, {what}\n{s.table()}"
    )
    with dist.comm_stats() as s:
        got.backward()
    talk = s.sent("all_reduce") + s.sent("all_gather")
    assert talk == 0, f"backward sent {talk} bytes: it is local (softmax minus one-hot), {what}\n{s.table()}"
    close(mine.grad, piece(full.grad, -1, t, r), f"gradient of my logits, {what}")


@pytest.mark.task("4.4")
@pytest.mark.world_size(4)
def test_vocab_parallel_cross_entropy_is_stable_on_extreme_logits(impl):
    """Logits of magnitude 1e4 (rows all near +1e4, all near -1e4, one spike, ±1e4 spread): exp
    overflows (or every term underflows to 0) unless each row's global max is subtracted first.
    In float64, so the serial loss is exact enough to compare with."""
    tp, g, t, r = impl.tensor_parallel, dist.world(), 4, dist.get_rank()
    rng, seed = shared_rng()
    V, N = t * int(rng.integers(2, 5)), 8
    logits = rng.normal(size=(N, V)) * 5
    logits[0] += 1e4  # every logit near +1e4
    logits[1] -= 1e4  # every logit near -1e4
    logits[2, int(rng.integers(0, V))] = 1e4  # one spike
    logits[3] *= 2e3  # ±1e4 spread
    targets = rng.integers(0, V, size=N)
    what = f"{N} rows of {V} float64 logits, rows 0-3 of magnitude 1e4 (seed {seed})"
    full = Tensor(xp.asarray(logits), requires_grad=True)
    want = F.cross_entropy(full, xp.asarray(targets))
    want.backward()
    mine = Tensor(xp.asarray(np.ascontiguousarray(piece(logits, -1, t, r))), requires_grad=True)
    got = tp.vocab_parallel_cross_entropy(mine, targets, g, vocab_start=r * V // t)
    got.backward()
    loss, grad = to_host(got.data), to_host(mine.grad)
    assert np.isfinite(loss) and np.isfinite(grad).all(), (
        f"vocab-parallel cross-entropy is not finite on large logits (loss {loss}; {np.isfinite(grad).mean():.0%} "
        f"of the gradient finite): exp(logit) overflows; subtract each row's global max first, {what}"
    )
    close(got, want.data, f"loss on large logits, {what}")
    close(mine.grad, piece(full.grad, -1, t, r), f"gradient of my logits on large logits, {what}")


# --- 4.4 / 4.5 the whole GPT ------------------------------------------------------------------------------


def drawn_gpt(rng, t, dropout, replicas=1, per_rank=None):
    """``per_rank``: heads per TP rank, fixed, or drawn (1 or 2)."""
    heads = t * int(rng.integers(1, 3))
    heads = heads if per_rank is None else t * per_rank
    config = GPTConfig(
        vocab_size=t * int(rng.integers(2, 5)),
        block_size=2 * t,
        n_layer=int(rng.integers(1, 3)),
        n_head=heads,
        n_embd=heads * int(rng.integers(1, 3)),
        dropout=dropout,
    )
    seed = int(rng.integers(1 << 30))
    ids = rng.integers(0, config.vocab_size, size=(replicas * int(rng.integers(1, 4)), 2 * t))
    targets = rng.integers(0, config.vocab_size, size=ids.shape)
    return (lambda: GPT(config, seed=seed)), ids, targets


def check_gpt(tp, t, sp, dropout, group=None, replicas=1, replica=0, per_rank=None):
    """The TP model of ``group`` (t ranks) against the serial GPT. With ``replicas`` data-parallel
    replicas, this rank's replica computes only its rows of the batch (as the hybrid layout does)
    and must match the serial model's loss of those rows, run on the whole batch."""
    rng, seed = shared_rng()
    build, ids, targets = drawn_gpt(rng, t, dropout, replicas, per_rank)
    group = group or dist.world()
    serial, parallel = build(), tp.tensor_parallel_gpt(build(), group, sequence_parallel=sp)
    n = ids.shape[0] // replicas
    rows = slice(replica * n, (replica + 1) * n)
    h = serial.config.n_head // t
    what = f"{serial.config}, {h} head{'s' * (h > 1)} per rank, batch {ids.shape}, SP {sp}"
    if replicas > 1:
        what += (
            f", DP replica {replica} of {replicas} computing rows {rows.start}-{rows.stop - 1}: its dropout masks "
            f"must be those rows of the whole batch's masks (random.batch_rows)"
        )
    what += f" (seed {seed})"
    _random.manual_seed(seed)
    want = F.cross_entropy(serial(xp.asarray(ids))[rows], xp.asarray(targets[rows]))  # masks of the whole batch
    want.backward()
    _random.manual_seed(seed)
    with dist.comm_stats() as s, _random.batch_rows(rows.start, ids.shape[0]):
        got = parallel.loss(ids[rows], targets[rows])
        got.backward()  # SP's partial gradients are summed over the group by the model's hooks
    close(got, want.data, f"loss, {what}")
    named, scale = dict(serial.named_parameters()), largest_gradient(serial)
    for sh in parallel.shards():
        full = to_host(named[sh.name].grad)
        want = full if sh.replicated else np.take(full, range(sh.start, sh.stop), axis=sh.axis)
        close(sh.param.grad, want, f"gradient of {sh.name}, {what}", scale)
    return s


HEADS = pytest.mark.parametrize("per_rank", [None, 2], ids=["drawn", "2-heads-per-rank"])


@pytest.mark.task("4.4")
@pytest.mark.world_size(4)
@HEADS
def test_tensor_parallel_gpt_matches_serial(impl, per_rank):
    check_gpt(impl.tensor_parallel, 4, sp=False, dropout=0.0, per_rank=per_rank)


@pytest.mark.task("4.5")
@pytest.mark.world_size(4)
@HEADS
def test_sequence_parallel_gpt_with_dropout_matches_serial(impl, per_rank):
    s = check_gpt(impl.tensor_parallel, 4, sp=True, dropout=0.2, per_rank=per_rank)
    assert sent(s, "all_gather") > 0 and sent(s, "reduce_scatter") > 0, (
        f"SP runs all-gathers and reduce-scatters at the regions' edges, but the step sent {sent(s, 'all_gather')} "
        f"bytes by all-gather and {sent(s, 'reduce_scatter')} by reduce-scatter ({per_rank or 'drawn'} heads per rank)"
        f"\n{s.table()}"
    )


@pytest.mark.task("4.5")
@pytest.mark.world_size(4)
def test_dp_by_tp_replicas_drop_their_rows_of_the_serial_masks(impl):
    """Mesh {dp: 2, tp: 2} with dropout, SP on: replica d computes rows [d·B/2, (d+1)·B/2) of the
    batch (``random.batch_rows``, set by the hybrid layout), so its masks must be those rows of the
    serial run's masks, not a mask drawn for its own B/2 rows (replica 1 would repeat replica 0's)."""
    mesh = dist.DeviceMesh({"dp": 2, "tp": 2})
    check_gpt(
        impl.tensor_parallel, 2, sp=True, dropout=0.3, group=mesh.get_group("tp"), replicas=2, replica=mesh.coords["dp"]
    )


@pytest.mark.task("4.5")
@pytest.mark.world_size(4)
@HEADS
def test_sequence_parallel_block_sends_the_all_reduce_bytes_as_gather_and_reduce_scatter(impl, per_rank):
    tp, g, t, r = impl.tensor_parallel, dist.world(), 4, dist.get_rank()
    rng, seed = shared_rng()
    build, ids, _ = drawn_gpt(rng, t, 0.0, per_rank=per_rank)
    model = build()
    block = tp.ParallelBlock(model.blocks[0], g, "blocks.0", sequence_parallel=True)
    x = rng.normal(size=(ids.shape[0], ids.shape[1], model.config.n_embd)).astype(np.float32)
    h = model.config.n_head // t
    what = f"x {x.shape}, {h} head{'s' * (h > 1)} per rank, rank {r} holding positions {r * x.shape[1] // t}-"
    what += f"{(r + 1) * x.shape[1] // t - 1} (seed {seed})"
    want = model.blocks[0](leaf(x))
    xs = leaf(piece(x, 1, t, r))
    saved = saved_bytes()
    with dist.comm_stats() as fwd:
        y = block(xs)
    saved = saved_bytes() - saved
    close(y, piece(want.data, 1, t, r), f"my sequence shard of the block's output, {what}")
    # SP's point: the LayerNorms (and dropouts) between the parallel regions keep only this rank's
    # sequence shard for backward, where plain TP keeps the whole sequence: at least two (B, T, C)
    # activations shrink by (t-1)/t. Measured by autograd's saved-bytes counter, TP block alongside.
    plain = tp.ParallelBlock(build().blocks[0], g, "blocks.0", sequence_parallel=False)
    saved_tp = saved_bytes()
    y_tp = plain(leaf(x))
    saved_tp = saved_bytes() - saved_tp
    del y_tp
    want_saving = 2 * x.nbytes * (t - 1) // t
    assert saved_tp - saved >= want_saving, (
        f"{what}: a sequence-parallel block saved {saved} bytes for backward, plain TP {saved_tp}; SP must save at "
        f"least {want_saving} fewer (the two LayerNorms' inputs are sequence shards, not the whole sequence)"
    )
    with dist.comm_stats() as bwd:
        y.sum().backward()
    for label, s in (("forward", fwd), ("backward", bwd)):
        assert sent(s, "all_reduce") == 0, (
            f"the block's {label} sent {sent(s, 'all_reduce')} bytes by all-reduce; under SP a block has none (an "
            f"all-gather and a reduce-scatter per region instead), {what}\n{s.table()}"
        )
        for op in ("all_gather", "reduce_scatter"):
            want = ring_all_reduce_bytes(x.nbytes, t)
            assert sent(s, op) == want, (
                f"{what}: the block's {label} sent {sent(s, op)} bytes by {op}, expected {want} (two per block, one "
                f"per LayerNorm region, each (t-1)/t of the {x.nbytes}-byte activation)\n{s.table()}"
            )
