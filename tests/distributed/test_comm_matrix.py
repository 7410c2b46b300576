"""Per-peer byte accounting and the planner's bytes against a measured step of the layouts the CLI runs."""

from __future__ import annotations

import numpy as np
import pytest

from tinytrain import distributed as dist
from tinytrain import planner, trace, viz
from tinytrain.distributed.trace_merge import comm_matrix
from tinytrain.nn import GPT, GPTConfig
from tinytrain.optim import AdamW
from tinytrain.parallel import costs
from tinytrain.parallel.hybrid import parallelize
from tinytrain.parallel.plan import Plan

CONFIG = dict(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=32)


def one_step(plan: Plan):
    """Bytes each (group, op) sent in one forward_backward + step, summed over ranks."""
    model = GPT(GPTConfig(**CONFIG), seed=0)
    parallel = parallelize(model, plan)
    opt = AdamW(parallel.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 16, size=(8, 8)), rng.integers(0, 16, size=(8, 8))
    with dist.comm_stats() as stats:
        parallel.forward_backward(x, y)
        parallel.step(opt)
    keys = sorted(k for k in stats.rows if k[1] != "debug_check")  # the test harness's signature checks
    mine = np.array([stats.sent(op, group) for group, op in keys], dtype=np.int64)
    return dict(zip(keys, (int(v) for v in dist.all_reduce(mine)))), stats


@pytest.mark.world_size(4)
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_planner_bytes_equal_the_measured_bytes_of_a_data_parallel_step(zero):
    n = dist.get_world_size()
    measured, stats = one_step(Plan(dp=n, zero=zero))
    spec = planner.ModelSpec(layers=2, hidden=32, heads=2, vocab=16, seq=8, batch=8)
    want = planner.run_bytes(spec, dp=n, zero=zero)
    assert measured == want, f"ZeRO-{zero}: measured {measured}, planner {want}\n{stats.table()}"
    psi = sum(p.size for p in GPT(GPTConfig(**CONFIG), seed=0).parameters())
    assert spec.parameters == psi
    # the gradient sync alone (the loss average taken out) is the handout's 2Ψ, or 3Ψ for ZeRO-3
    grads = sum(measured.values()) - want[("dp", "all_reduce")] * (zero > 0)
    if zero == 0:
        grads -= n * costs.collective_bytes("all_reduce", 8, n, "recursive_doubling")
    tied = 16 * 32
    assert grads == n * costs.data_parallel_volume(psi, n, zero, tied) * 4


@pytest.mark.world_size(4)
def test_ring_all_reduce_matrix_is_the_ring_and_sent_equals_received():
    n, r = dist.get_world_size(), dist.get_rank()
    x = np.ones(4096, dtype=np.float32)
    with dist.comm_stats() as stats:
        dist.all_reduce(x, algo="ring")
    # op="all_reduce": the test harness also cross-checks each call's signature ("debug_check")
    assert stats.sent_to("all_reduce") == {(r + 1) % n: 2 * (n - 1) * x.nbytes // n}
    assert stats.sent_to("all_reduce", received=True) == {(r - 1) % n: 2 * (n - 1) * x.nbytes // n}
    matrix = comm_matrix(stats, op="all_reduce")
    want = np.zeros((n, n), dtype=np.int64)
    for i in range(n):
        want[i, (i + 1) % n] = 2 * (n - 1) * x.nbytes // n
    np.testing.assert_array_equal(matrix, want)
    received = comm_matrix_received(stats)
    np.testing.assert_array_equal(received.T, matrix)  # what j received from i is what i sent to j


def comm_matrix_received(stats):
    n = dist.get_world_size()
    row = np.zeros(n, dtype=np.int64)
    for peer, nbytes in stats.sent_to("all_reduce", received=True).items():
        row[peer] = nbytes
    return dist.all_gather(row).reshape(n, n)


@pytest.mark.world_size(4)
def test_hybrid_matrix_has_the_tensor_and_data_parallel_partners_only():
    """dp 2 x tp 2: rank r's TP partner is r ^ 1 (neighbours), its DP partner r ^ 2; nothing else."""
    _, stats = one_step(Plan(dp=2, tp=2))
    matrix = comm_matrix(stats)
    r = dist.get_rank()
    assert set(np.flatnonzero(matrix[r])) == {r ^ 1, r ^ 2}
    assert matrix[r, r ^ 1] == stats.sent(group="tp") > 0
    assert matrix[r, r ^ 2] == stats.sent(group="dp") > 0
    assert matrix[r].sum() == stats.sent()


@pytest.mark.world_size(4)
def test_a_merged_trace_keeps_the_per_peer_counters():
    n, r = dist.get_world_size(), dist.get_rank()
    earlier = comm_matrix(dist.totals(), op="sendrecv")  # earlier tests in this process (pipelines) sent some
    trace.clear()
    trace.enable()
    try:
        dist.all_reduce(np.ones(1000, dtype=np.float32), algo="ring")
        dist.sendrecv(np.ones(8), (r + 1) % n, np.empty(8), (r - 1) % n)
    finally:
        trace.enable(False)
    counted = dist.totals()  # the counters the merge records (it snapshots them before it sends)
    spans = trace.merge()
    trace.clear()
    whole_run = comm_matrix(counted)
    if r == 0:
        np.testing.assert_array_equal(viz.comm_matrix_from_trace(spans), whole_run)
        sendrecv = viz.comm_matrix_from_trace(spans, op="sendrecv") - earlier
        np.testing.assert_array_equal(sendrecv, 64 * np.roll(np.eye(n, dtype=np.int64), 1, axis=1))


def traced(call):
    trace.clear()
    trace.enable()
    try:
        call()
    finally:
        trace.enable(False)
    spans = trace.merge()
    trace.clear()
    return spans


@pytest.mark.world_size(4)
def test_exchange_steps_of_a_traced_ring_are_the_rings_schedule():
    n = dist.get_world_size()
    spans = traced(lambda: dist.all_reduce(np.ones(4 * n, dtype=np.float32), algo="ring"))
    if dist.get_rank() != 0:
        return
    rows = viz.exchange_steps(spans)
    assert len(rows) == n * 2 * (n - 1)
    for row in rows:
        s, r = row["step"], row["rank"]
        assert row["to"] == (r + 1) % n
        if s < n - 1:  # reduce-scatter: rank r passes chunk r - s, the receiver adds it
            assert row["phase"] == "ring reduce-scatter" and row["chunk"] == (r - s) % n
        else:  # all-gather: finished chunks travel on
            assert row["phase"] == "ring all-gather" and row["chunk"] == (r + 1 - (s - n + 1)) % n


@pytest.mark.world_size(4)
def test_exchange_steps_of_recursive_doubling_and_the_tree():
    n = dist.get_world_size()
    spans = traced(lambda: dist.all_reduce(np.ones(16, dtype=np.float32), algo="recursive_doubling"))
    tree = traced(lambda: dist.broadcast(np.ones(16, dtype=np.float32), src=0))
    if dist.get_rank() != 0:
        return
    rows = viz.exchange_steps(spans)
    assert {(x["step"], x["rank"], x["to"]) for x in rows} == {(k, r, r ^ (1 << k)) for k in range(2) for r in range(n)}
    assert all(x["chunk"] is None for x in rows)
    edges = {(x["rank"], x["to"]) for x in viz.exchange_steps(tree)}
    assert edges == {(0, 2), (0, 1), (2, 3)}  # binomial tree from rank 0


@pytest.mark.world_size(4)
def test_bench_plan_sets_the_calibrated_planners_step_beside_a_measured_one(capsys):
    """`tinytrain bench plan` calibrates α-β, measures compute and a `--dp 4` step, and prints the
    planner's step (its parts adding up) next to the measured one. The ratio is a figure of the
    machine, read from the benchmark, not asserted here (a timed test flakes on a loaded machine)."""
    import re

    from tinytrain.cli import main

    assert main(["bench", "plan", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    if dist.get_rank() != 0:
        return
    parts = re.search(
        r"predicted step ([\d.]+) ms \(compute ([\d.]+), gradients ([\d.]+), loss average ([\d.]+)\)", out
    )
    assert parts, out
    step, compute, grads, loss = map(float, parts.groups())
    # The loss average is 8 bytes: where the fit puts alpha at 0 (a loaded machine's noisy rounds;
    # CI met one) its time prints as 0.00 ms, so it is only checked to be there and not negative.
    assert compute > 0 and grads > 0 and loss >= 0 and abs(step - (compute + grads + loss)) <= 0.015, out
    measured = re.search(r"measured step ([\d.]+) ms; ratio predicted / measured ([\d.]+)", out)
    assert measured and float(measured.group(1)) > 0, out
    assert abs(float(measured.group(2)) - step / float(measured.group(1))) < 0.01 + 0.01 * step, out


@pytest.mark.world_size(2)
def test_a_traced_training_run_keeps_its_communication_matrix(tmp_path):
    """`tinytrain train --dp 2 --trace`: the trace ends with each rank's per-peer counters; what they
    grew by during the run is its matrix: every step one ring all-reduce of the gradients (on 2
    ranks each sends 4Ψ bytes) and the 8-byte loss average, to the other rank only."""
    import json

    from tinytrain import cli

    r, steps = dist.get_rank(), 3
    # this rank's counters so far (earlier tests in this process included), on rank 0
    before = dist.world().comm.gather(dist.totals().sent_to("all_reduce", group="dp"))
    tmp_path = type(tmp_path)(dist.world().comm.bcast(str(tmp_path)))  # rank 0's: the ranks save one checkpoint
    path = tmp_path / "trace.json"
    argv = "train --dp 2 --layers 2 --width 32 --heads 2 --batch-size 8 --steps 3 --eval-every 100 --quiet --no-plot"
    assert cli.main([*argv.split(), "--out", str(tmp_path / "run"), "--trace", str(path)]) == 0
    if r != 0:
        return
    spans = trace.read_chrome(str(path))
    matrix = viz.comm_matrix_from_trace(spans, op="all_reduce", group="dp")
    config = json.loads((tmp_path / "run" / "ckpt" / "manifest.json").read_text())["model_config"]
    psi = sum(p.size for p in GPT(GPTConfig(**config)).parameters())
    for rank in (0, 1):
        for peer in range(matrix.shape[1]):
            grew = matrix[rank, peer] - before[rank].get(peer, 0)
            assert grew == (steps * (4 * psi + 8) if peer == 1 - rank else 0), (rank, peer, matrix)
