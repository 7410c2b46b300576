"""Data parallel without lock-step (``--dp-algo``): the parameter server, asynchronous or not, and
local SGD / DiLoCo, against the synchronous runs they must equal and the byte formulas.

* the asynchronous server with staleness bound 0 is the synchronous server, bit for bit, in
  either serving order; unbounded and seeded, its parameters are those of a one-process replay of
  the same schedule and its staleness is what the schedule implies; a bound k is never exceeded;
* a worker that dies ends the server's wait in seconds, naming it;
* local SGD with H = 1 and the plain outer SGD (lr 1) is synchronous data parallel; DiLoCo's outer
  step is Nesterov momentum on the averaged delta; the bytes per step fall by H exactly;
* ``tinytrain train --dp-algo ...`` prints the bytes per step, equal to the formula the test
  computes, and the parameter server trains the serial run's curve.
"""

from __future__ import annotations

import re
import time

import numpy as np
import parallel_cases
import pytest
from parallel_cases import global_batch, make_optimizer, tiny_gpt

from tinytrain import distributed as dist
from tinytrain import functional as F
from tinytrain.backend import to_host, xp
from tinytrain.cli import main
from tinytrain.data import AdditionDataset, shard_rows
from tinytrain.nn import GPT, GPTConfig
from tinytrain.parallel import costs
from tinytrain.parallel.data_parallel import (
    AsyncParameterServer,
    LocalSGD,
    NaiveDDP,
    ParameterServer,
    SparsePushServer,
    flatten,
)

ROWS = 4  # rows per rank


def loss_of(model, step, rank, n, seed=0):
    x, y = global_batch(step, ROWS * n, seed)
    return F.cross_entropy(model(xp.asarray(shard_rows(x, rank, n))), xp.asarray(shard_rows(y, rank, n)))


def train(wrapper, model, steps, step=None, max_norm=None):
    rank, n = dist.get_rank(), dist.get_world_size()
    for t in range(steps):
        for p in model.parameters():
            p.grad = None
        wrapper.backward(loss_of(wrapper, t, rank, n))
        if max_norm is not None:  # the asynchronous server clips each update it applies
            wrapper.clip_grad_norm_(max_norm)
        (step or wrapper.step)()


def params(model):
    return [to_host(p.data).copy() for p in model.parameters()]


# --- the asynchronous parameter server -------------------------------------------------------------


@pytest.mark.world_size(4)
@pytest.mark.parametrize("order", ["arrival", "seeded"])
def test_async_server_with_staleness_bound_0_is_the_synchronous_server_bit_for_bit(order):
    """AdamW (not linear in the gradient) and clipping on the server: the same numbers exactly."""
    sync_model = tiny_gpt()
    sync = ParameterServer(sync_model, make_optimizer("adamw", sync_model))
    for t in range(3):
        for p in sync_model.parameters():
            p.grad = None
        sync.backward(loss_of(sync, t, dist.get_rank(), 4))
        sync.clip_grad_norm_(0.5)  # pushes; the server clips the whole batch's gradient
        sync.step()
    model = tiny_gpt()
    server = AsyncParameterServer(model, make_optimizer("adamw", model), max_staleness=0, order=order, seed=3)
    train(server, model, 3, max_norm=0.5)
    for got, want in zip(params(model), params(sync_model)):
        assert np.array_equal(got, want), "bound 0 must be the synchronous server exactly"
    if server.rank == server.server:
        assert server.staleness == [0] * 12 and server.version == 3, (server.staleness, server.version)


def replay(steps: int, n: int, seed: int):
    """One process plays the seeded asynchronous schedule: the server's own gradient, then each
    worker's (computed on the parameters it last pulled) in the order drawn from (seed, step)."""
    model = tiny_gpt()
    opt = make_optimizer("sgd", model)
    pulled = {w: params(model) for w in range(1, n)}  # each worker's parameters
    version, seen, staleness = 0, {w: 0 for w in range(n)}, []

    def apply(rank, weights, t):
        nonlocal version
        current = params(model)
        for p, w in zip(model.parameters(), weights):
            p.data[...] = xp.asarray(w)
            p.grad = None
        loss_of(model, t, rank, n).backward()
        grads = [p.grad.copy() for p in model.parameters()]
        for p, c, g in zip(model.parameters(), current, grads):
            p.data[...] = xp.asarray(c)
            p.grad = g
        opt.step()
        staleness.append(version - seen[rank])
        version += 1
        seen[rank] = version

    for t in range(steps):
        seen[0] = version
        apply(0, params(model), t)
        for w in np.random.default_rng([seed, t + 1]).permutation(list(range(1, n))).tolist():
            apply(w, pulled[w], t)
            pulled[w] = params(model)
    return params(model), staleness


@pytest.mark.world_size(4)
def test_seeded_async_server_replays_its_schedule_and_measures_staleness():
    model = tiny_gpt()
    server = AsyncParameterServer(model, make_optimizer("sgd", model), order="seeded", seed=7)
    train(server, model, 3)
    if server.rank != server.server:
        return
    want, staleness = replay(3, 4, seed=7)
    assert server.staleness == staleness, (server.staleness, staleness)
    assert max(staleness) > 1  # asynchrony happened: some gradient was several updates old
    for got, expected in zip(params(model), want):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("bound", [1, 2])
def test_a_staleness_bound_is_never_exceeded_and_averages_what_waits(bound):
    model = tiny_gpt()
    server = AsyncParameterServer(model, make_optimizer("sgd", model), max_staleness=bound, order="seeded", seed=1)
    with dist.comm_stats() as stats:
        train(server, model, 4)
    if server.rank == server.server:
        assert len(server.staleness) == 16 and max(server.staleness) == bound, server.staleness
        assert 4 < server.version < 16  # some updates averaged several gradients, some did not
        assert stats.sent("send") + stats.recv("recv") == 4 * 2 * 3 * 4 * sum(p.size for p in model.parameters())


@pytest.mark.world_size(4)
def test_a_dead_worker_ends_the_servers_wait_naming_it(monkeypatch):
    monkeypatch.setenv("TINYTRAIN_TIMEOUT", "30")
    model = tiny_gpt()  # bound 0: every worker waits for its reply until all gradients are in
    server = AsyncParameterServer(model, make_optimizer("sgd", model), max_staleness=0)
    train(server, model, 1)
    rank = dist.get_rank()  # after the failure the world is unusable, as in a real job
    if rank == 2:
        time.sleep(0.1)
        dist.report_failure("worker 2 died on purpose")
        return
    start = time.monotonic()
    with pytest.raises(dist.PeerFailure, match="rank 2 failed.*died on purpose") as err:
        train(server, model, 1)
    if rank == 0:
        assert "asynchronous parameter server" in str(err.value) and "recv from rank 2" in str(err.value)
    assert time.monotonic() - start < 5  # far below the 30 s deadline


# --- sparse pushes ---------------------------------------------------------------------------------


@pytest.mark.world_size(4)
def test_sparse_pushes_send_the_touched_rows_and_change_no_number():
    """An untied 64-token table: a worker pushes 8 + k·(8 + 4D) bytes for its k distinct tokens; the
    position table (every row touched) goes dense; the parameters equal the dense server's exactly."""
    config = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=32, tie_weights=False)
    rank, n = dist.get_rank(), dist.get_world_size()
    batches = [np.random.default_rng([5, t]).integers(0, 64, size=(2, ROWS * n, 8)) for t in range(2)]
    runs = {}
    for kind in (ParameterServer, SparsePushServer):
        model = GPT(config, seed=1)
        server = kind(model, make_optimizer("adamw", model))
        for x, y in batches:
            for p in model.parameters():
                p.grad = None
            mine = [xp.asarray(shard_rows(a, rank, n)) for a in (x, y)]
            server.backward(F.cross_entropy(server(mine[0]), mine[1]))
            server.step()
        runs[kind] = (params(model), server)
    for got, want in zip(runs[SparsePushServer][0], runs[ParameterServer][0]):
        assert np.array_equal(got, want), "a sparse push must give the dense server's numbers exactly"
    if rank == 0:
        return
    touched = sum(len(np.unique(shard_rows(x, rank, n))) for x, _ in batches)
    tokens = 2 * 8 + touched * (8 + 4 * 32)  # per step a row count, then k indices and k rows
    positions = 2 * (8 + 8 * 32 * 4)  # every position is touched: dense, after its header (-1)
    assert runs[SparsePushServer][1].table_bytes == tokens + positions, (runs[SparsePushServer][1].table_bytes, touched)
    assert tokens < 2 * 64 * 32 * 4  # than the dense push of the token table
    assert tokens == sum(  # the handouts' formula, the same count
        costs.sparse_push_volume(len(np.unique(shard_rows(x, rank, n))), 4 * 32) for x, _ in batches
    )


# --- local SGD and DiLoCo ------------------------------------------------------------------------


@pytest.mark.world_size(4)
def test_local_sgd_with_one_local_step_is_synchronous_data_parallel():
    model, ref = tiny_gpt(), tiny_gpt()
    opt, ref_opt = make_optimizer("sgd", model), make_optimizer("sgd", ref)  # momentum, weight decay
    local = LocalSGD(model, local_steps=1)
    local.optimizer = opt
    train(local, model, 3)
    train(NaiveDDP(ref), ref, 3, step=ref_opt.step)
    for got, want in zip(params(model), params(ref)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.world_size(4)
def test_diloco_outer_step_is_nesterov_on_the_averaged_delta():
    model = tiny_gpt()
    diloco = LocalSGD.diloco(model, local_steps=2)
    diloco.optimizer = make_optimizer("adamw", model)
    start, momentum = to_host(flatten([p.data for p in model.parameters()])), 0.0
    for outer in range(2):
        train(diloco, model, 1)  # the first inner step: no communication
        diloco.optimizer.step()  # the second, by hand, to see the replicas before the average
        diloco.inner_steps += 1
        mine = to_host(flatten([p.data for p in model.parameters()]))
        delta = (start - dist.all_gather(mine[None, :])).mean(axis=0)
        diloco.outer_step()
        momentum = 0.9 * momentum + delta
        start = start - 0.7 * (delta + 0.9 * momentum)
        got = to_host(flatten([p.data for p in model.parameters()]))
        np.testing.assert_allclose(got, start, rtol=1e-5, atol=1e-6, err_msg=f"outer step {outer + 1}")


@pytest.mark.world_size(4)
def test_local_sgd_bytes_per_step_fall_by_h():
    psi_bytes = 4 * sum(p.size for p in tiny_gpt().parameters())
    totals = {}
    for h in (1, 2, 4):
        model = tiny_gpt()
        local = LocalSGD(model, local_steps=h)
        local.optimizer = make_optimizer("sgd", model)
        train(local, model, 4)
        totals[h] = int(dist.all_reduce(np.array([local.moved], dtype=np.int64))[0])
    for h, total in totals.items():  # every rank sends and receives within the ring: 2 · 2(N-1)·Ψ per average
        assert total == (4 // h) * 2 * 2 * 3 * psi_bytes, (h, total)
    assert totals[1] == 2 * totals[2] == 4 * totals[4]


# --- tinytrain train --dp-algo ----------------------------------------------------------------------

TINY = (
    "--layers 2 --width 32 --heads 4 --batch-size 8 --steps 4 --eval-every 2 --eval-batches 1 --warmup 1 --quiet "
    "--no-plot"
).split()


def psi_of_tiny() -> int:
    return sum(p.size for p in GPT(GPTConfig(**tiny_config())).parameters())


def printed_bytes(err: str) -> tuple[float, float]:
    found = re.search(r"per step: ([\d,]+) measured over \d+ steps; formula [^=]*= ([\d,]+)", err)
    assert found, err
    return tuple(float(g.replace(",", "")) for g in found.groups())


@pytest.mark.world_size(4)
@pytest.mark.parametrize("algo", ["ps", "async-ps", "local-sgd --local-steps 2", "diloco --local-steps 4"])
def test_the_cli_prints_bytes_per_step_equal_to_the_formula(tmp_path, capfd, algo):
    out = parallel_cases.shared_dir(tmp_path) / "run"
    assert main(["train", *TINY, "--dp", "4", "--dp-algo", *algo.split(), "--out", str(out)]) == 0
    err = capfd.readouterr().err
    if dist.get_rank() != 0:
        return
    measured, printed = printed_bytes(err)
    psi_bytes, n = 4 * psi_of_tiny(), 4
    h = int(algo.split()[-1]) if "local-steps" in algo else 1
    want = 2 * (n - 1) * psi_bytes if algo.split()[0] in ("ps", "async-ps") else 2 * 2 * (n - 1) * psi_bytes / h
    assert measured == printed == want, (err, want)
    if algo == "async-ps":
        assert re.search(r"staleness \(updates behind\) of the 16 gradients applied: 0:", err), err


@pytest.mark.world_size(4)
@pytest.mark.parametrize("algo", ["ps", "async-ps --max-staleness 0 --ps-order seeded"])
def test_the_parameter_server_trains_the_serial_curve(tmp_path, algo):
    """With dropout. (The asynchronous server's grad_norm is rank 0's own gradient's: not compared.)"""
    from test_layouts import TINY as LAYOUT_TINY
    from test_layouts import assert_on_serial_curve, metrics, serial_metrics

    out = parallel_cases.shared_dir(tmp_path) / "run"
    assert main(["train", *LAYOUT_TINY, "--dp", "4", "--dp-algo", *algo.split(), "--out", str(out)]) == 0
    if dist.get_rank() != 0:
        return
    if algo == "ps":
        assert_on_serial_curve(out, tmp_path)
        return
    got, want = metrics(out), serial_metrics(tmp_path)
    np.testing.assert_allclose([s["loss"] for s in got["steps"]], [s["loss"] for s in want["steps"]], rtol=2e-5)
    np.testing.assert_allclose(got["final"]["val_loss"], want["final"]["val_loss"], rtol=2e-5)


@pytest.mark.world_size(4)
def test_bench_dp_algos_draws_every_algorithm_and_names_the_fewest_bytes(tmp_path, capsys):
    """4 steps of each; by a loss every run reaches at step 2, local SGD (H = 2) has sent the least."""
    import json

    out = parallel_cases.shared_dir(tmp_path) / "bench"
    flags = "--steps 4 --width 32 --local-steps 2 --target 10 --window 2".split()
    assert main(["bench", "dp-algos", *flags, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    if dist.get_rank() != 0:
        return
    runs = {r["algo"]: r for r in json.loads((out / "dp_algos.json").read_text())["runs"]}
    assert set(runs) == {"allreduce", "ps", "async-ps", "local-sgd", "diloco"}
    assert (out / "dp_algos.png").stat().st_size > 0
    assert len(runs["async-ps"]["staleness"]) == 16
    psi_bytes = 4 * psi_of_tiny()
    assert sum(runs["local-sgd"]["bytes"]) - sum(runs["allreduce"]["bytes"]) / 2 == pytest.approx(0, abs=200), runs
    assert sum(runs["allreduce"]["bytes"]) >= 4 * 2 * 3 * psi_bytes
    assert "fewest bytes to loss 10: local-sgd H=2" in printed, printed


def tiny_config() -> dict:
    task = AdditionDataset(2)
    return dict(vocab_size=task.vocab_size, block_size=task.block_size, n_layer=2, n_head=4, n_embd=32)


@pytest.mark.world_size(4)
def test_a_parameter_server_run_resumes_on_its_uninterrupted_curve(tmp_path):
    """Rank 0, the server, writes the parameters and the optimizer state: 3 steps + 3 resumed = 6."""
    base = [*TINY, "--dp", "4", "--dp-algo", "ps", "--warmup", "0", "--lr", "0.003", "--min-lr", "0.003"]
    base[base.index("--steps") : base.index("--steps") + 2] = []  # (given below)
    shared = parallel_cases.shared_dir(tmp_path)
    assert main(["train", *base, "--steps", "6", "--out", str(shared / "whole")]) == 0
    assert main(["train", *base, "--steps", "3", "--out", str(shared / "cut")]) == 0
    assert main(["train", *base, "--steps", "6", "--resume", "--out", str(shared / "cut")]) == 0
    if dist.get_rank() == 0:
        from test_layouts import metrics

        got, want = (metrics(shared / name)["steps"] for name in ("cut", "whole"))
        assert [s["loss"] for s in got] == [s["loss"] for s in want]
