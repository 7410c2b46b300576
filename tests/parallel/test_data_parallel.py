"""Data parallel (tinytrain/parallel/data_parallel.py): equivalence with the serial run, exact
communication volumes, the parameter server's bottleneck, gradient accumulation, overlap.

Tolerances against the serial run (which computes each gradient in one matmul over the whole
batch, where DDP adds N partial gradients): SGD atol 1e-6 (rounding of float32 sums), AdamW atol
2e-4 = 2% of one step at lr 1e-2 (Adam divides by sqrt(v), so where a gradient is near zero a
rounding difference becomes a visible change of the update). SGD is also the strict check that
gradients are *averaged*: Adam is nearly blind to a gradient scaled by N.
"""

from __future__ import annotations

import numpy as np
import pytest
from parallel_cases import (
    assert_params_close,
    assert_same_on_all_ranks,
    global_batch,
    make_optimizer,
    serial_params,
    tiny_gpt,
    train,
)

from tinytrain import distributed as dist
from tinytrain import functional as F
from tinytrain import trace
from tinytrain.backend import to_host, xp
from tinytrain.data import shard_rows
from tinytrain.parallel.data_parallel import BucketedDDP, NaiveDDP, ParameterServer, make_buckets, trainable

TOL = {"sgd": dict(rtol=1e-5, atol=1e-6), "adamw": dict(rtol=1e-4, atol=2e-4)}
STEPS, ROWS = 2, 16


def wrap(kind: str, model, opt, **kw):
    """(callable model, backward, step, no_sync) of a DDP variant."""
    if kind == "naive":
        s = NaiveDDP(model, **kw)
    elif kind == "bucketed":
        s = BucketedDDP(model, bucket_mb=0.01, poll=True, **kw)
    else:
        s = ParameterServer(model, opt, **kw)
        return s, s.backward, s.step, None
    return s, s.backward, opt.step, s.no_sync


def params_of(model) -> dict:
    return {n: p.data for n, p in model.named_parameters()}


@pytest.mark.world_size(4)
def test_each_rank_reads_its_rows_of_the_global_batch():
    rank, n = dist.get_rank(), dist.get_world_size()
    x, _ = global_batch(step=5, rows=8 * n)
    mine = np.ascontiguousarray(shard_rows(x, rank, n))
    assert mine.shape[0] == 8
    assert np.array_equal(dist.all_gather(mine), x), "the ranks' rows, in rank order, must be the global batch"


@pytest.mark.world_size(4)
@pytest.mark.parametrize("kind", ["naive", "bucketed", "ps"])
def test_n_ranks_with_b_rows_compute_the_gradient_of_one_process_with_n_b_rows(kind):
    rank, n = dist.get_rank(), dist.get_world_size()
    serial = tiny_gpt()
    x, y = global_batch(0, 4 * n)
    F.cross_entropy(serial(xp.asarray(x)), xp.asarray(y)).backward()
    model = tiny_gpt()
    s, backward, _, _ = wrap(kind, model, make_optimizer("sgd", model))
    backward(F.cross_entropy(s(xp.asarray(shard_rows(x, rank, n))), xp.asarray(shard_rows(y, rank, n))))
    if kind == "ps":
        s._push_and_average()  # the server now holds the averaged gradient
        if rank != s.server:
            return
    for (name, p), q in zip(model.named_parameters(), serial.parameters()):
        np.testing.assert_allclose(to_host(p.grad), to_host(q.grad), rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("opt_kind", ["sgd", "adamw"])
@pytest.mark.parametrize("kind", ["naive", "bucketed", "ps"])
def test_parameters_match_the_serial_run_with_gradient_accumulation(kind, opt_kind):
    rank, n = dist.get_rank(), dist.get_world_size()
    want = serial_params(opt_kind, STEPS, ROWS)
    model = tiny_gpt()
    opt = make_optimizer(opt_kind, model)
    s, backward, step, no_sync = wrap(kind, model, opt)
    train(s, backward, step, opt, STEPS, ROWS, rank, n, accum=2, no_sync=no_sync)
    assert_params_close(params_of(model), want, what=f"{kind} DDP, {opt_kind}, 2 micro-batches", **TOL[opt_kind])
    assert_same_on_all_ranks(params_of(model))


@pytest.mark.world_size(4)
@pytest.mark.parametrize("kind, tie", [("naive", True), ("bucketed", False)])
def test_frozen_parameters_stay_put_and_never_travel(kind, tie):
    rank, n = dist.get_rank(), dist.get_world_size()
    frozen = ("wpe", "blocks.0.ln_1")
    want = serial_params("sgd", STEPS, ROWS, tie=tie, freeze=frozen)
    model = tiny_gpt(tie=tie, freeze=frozen)
    start = {k: v.copy() for k, v in params_of(model).items()}
    opt = make_optimizer("sgd", model)
    s, backward, step, no_sync = wrap(kind, model, opt)
    with dist.comm_stats() as stats:
        train(s, backward, step, opt, STEPS, ROWS, rank, n)
    assert_params_close(params_of(model), want, **TOL["sgd"], what=f"{kind} DDP with frozen parameters (tied={tie})")
    for name, p in model.named_parameters():
        if name.startswith(frozen):
            assert np.array_equal(to_host(p.data), start[name]), f"frozen {name} changed"
            assert p.grad is None, f"frozen {name} got a gradient"
    psi = sum(p.size for p in trainable(model))
    total = int(dist.all_reduce(np.array([stats.sent("all_reduce")], dtype=np.int64))[0])
    assert total == STEPS * 2 * (n - 1) * 4 * psi, "all-reduce moved more or less than the trainable gradients"


def ring_bytes(length: int, n: int, rank: int, itemsize: int = 4) -> int:
    """Bytes rank ``rank`` sends in a ring all-reduce of ``length`` elements (collectives.py)."""
    c = dist.split_counts(length, n)
    return itemsize * (2 * length - c[(rank + 1) % n] - c[(rank + 2) % n])


@pytest.mark.world_size(4)
@pytest.mark.parametrize("kind", ["naive", "bucketed"])
def test_all_reduce_volume_is_the_rings_2_n_minus_1_over_n_of_all_gradients(kind):
    rank, n = dist.get_rank(), dist.get_world_size()
    model = tiny_gpt()
    s, backward, _, _ = wrap(kind, model, make_optimizer("sgd", model))
    x, y = global_batch(0, ROWS)
    with dist.comm_stats() as stats:
        backward(F.cross_entropy(s(xp.asarray(shard_rows(x, rank, n))), xp.asarray(shard_rows(y, rank, n))))
    pieces = [b.buffer.size for b in s.buckets] if kind == "bucketed" else [p.size for p in s.params]
    assert stats.sent("all_reduce") == sum(ring_bytes(k, n, rank) for k in pieces)
    assert stats.messages("all_reduce") == 2 * (n - 1) * len(pieces), "one ring per bucket (a tied weight once)"
    psi = sum(p.size for p in s.params)
    total = int(dist.all_reduce(np.array([stats.sent("all_reduce")], dtype=np.int64))[0])
    assert total == 2 * (n - 1) * 4 * psi  # = N ranks x 2(N-1)/N x 4Ψ bytes


def test_buckets_hold_at_most_the_cap_in_reverse_order():
    model = tiny_gpt()
    params = trainable(model)[::-1]
    buckets = make_buckets(params, 20_000)
    assert [p for b in buckets for p in b.params] == params
    for b in buckets:
        assert b.nbytes <= 20_000 or len(b.params) == 1
    assert len(make_buckets(params, 10**9)) == 1


@pytest.mark.world_size(4)
def test_no_sync_sends_nothing_and_the_next_backward_sends_the_sum_once():
    rank, n = dist.get_rank(), dist.get_world_size()
    model = tiny_gpt()
    s = BucketedDDP(model, bucket_mb=0.01)
    x, y = global_batch(0, ROWS)
    x, y = xp.asarray(shard_rows(x, rank, n)), xp.asarray(shard_rows(y, rank, n))
    with dist.comm_stats() as quiet:
        with s.no_sync():
            s.backward(F.cross_entropy(s(x), y))
    assert quiet.sent() == 0
    with dist.comm_stats() as loud:
        s.backward(F.cross_entropy(s(x), y))
    assert loud.messages("all_reduce") == 2 * (n - 1) * len(s.buckets)
    with pytest.raises(RuntimeError, match="no_sync"):
        loss = F.cross_entropy(s(x), y)
        loss.backward(retain_graph=True)
        loss.backward()


def moved(stats) -> int:
    """Bytes sent plus received, without the debug mode's signature checks."""
    return stats.sent() + stats.recv() - stats.sent("debug_check") - stats.recv("debug_check")


@pytest.mark.world_size(4)
def test_parameter_server_traffic_grows_with_workers_while_the_rings_does_not():
    """Groups of 2, 3 and 4 ranks: bytes through the server rank vs the busiest ring rank."""
    rank = dist.get_rank()
    model = tiny_gpt()
    psi_bytes = 4 * sum(p.size for p in trainable(model))
    rows = []
    for k in (2, 3, 4):
        group = dist.new_group(range(k))
        if rank >= k:
            rows.append(None)
            continue
        m = tiny_gpt()
        ps = ParameterServer(m, make_optimizer("sgd", m), group=group)
        ring = NaiveDDP(tiny_gpt(), group=group)
        x, y = global_batch(0, 4 * k)
        x, y = xp.asarray(shard_rows(x, rank, k)), xp.asarray(shard_rows(y, rank, k))
        with dist.comm_stats() as ps_stats:
            ps.backward(F.cross_entropy(ps(x), y))
            ps.step()
        with dist.comm_stats() as ring_stats:
            ring.backward(F.cross_entropy(ring(x), y))
        mine = np.array([moved(ps_stats), moved(ring_stats)], dtype=np.int64)
        per_rank = dist.all_gather(mine[None, :], group=group)
        rows.append((int(per_rank[0, 0]), int(per_rank[:, 1].max())))
    if rank != 0:
        return
    for k, (server, ring_max) in zip((2, 3, 4), rows):
        assert server == 2 * (k - 1) * psi_bytes, f"{k} ranks: server moved {server} bytes"
        assert ring_max < 4 * psi_bytes, f"{k} ranks: a ring rank moved {ring_max} >= 2 x (send + recv) of W"
    assert rows[0][0] < rows[1][0] < rows[2][0]


def overlap_us(spans: list[dict]) -> float:
    """Microseconds of all-reduce that *finished* inside a backward span of the same rank."""
    total = 0.0
    for b in (s for s in spans if s["name"] == "backward"):
        for c in spans:
            if c["name"] == "all_reduce" and c["rank"] == b["rank"] and b["start"] <= c["end"] <= b["end"]:
                total += c["end"] - max(c["start"], b["start"])
    return total


@pytest.mark.world_size(4)
@pytest.mark.parametrize("progress", ["thread", "poll"])
def test_bucketed_all_reduce_overlaps_backward_in_the_trace(progress, tmp_path):
    rank, n = dist.get_rank(), dist.get_world_size()
    model = tiny_gpt(n_layer=2)
    s = BucketedDDP(model, bucket_mb=0.02, poll=progress == "poll")
    x, y = global_batch(0, 16 * n)
    x, y = xp.asarray(shard_rows(x, rank, n)), xp.asarray(shard_rows(y, rank, n))
    trace.clear()
    trace.enable()
    if progress == "thread":
        dist.start_progress_thread()
    try:
        for _ in range(2):
            s.backward(F.cross_entropy(s(x), y))
    finally:
        dist.stop_progress_thread()
        trace.enable(False)
    spans = trace.merge()
    trace.clear()
    if rank != 0:
        return
    assert overlap_us(spans) > 0, "no all-reduce finished while backward was still running"
    if progress != "thread":
        return  # one figure is enough (matplotlib takes seconds on a busy machine)
    from tinytrain.viz import plot_timeline

    plot_timeline(spans, tmp_path / "timeline.png", title="bucketed DDP")
    assert (tmp_path / "timeline.png").stat().st_size > 1000


@pytest.mark.world_size(4)
def test_bad_bucket_size_is_refused():
    with pytest.raises(ValueError, match="bucket size"):
        BucketedDDP(tiny_gpt(), bucket_mb=0)
