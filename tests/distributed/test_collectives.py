"""Every hand-written collective against MPI's own, on random data.

Run under ``mpirun -n 4 python -m pytest``. Each test builds sub-groups of 1..4 ranks (ranks
outside a sub-group skip that round), so one run covers world sizes 1-4, including 3.
MPI's result is the reference; floats are compared with a tolerance (the summation order differs),
integers exactly.
"""

import numpy as np
import pytest

from tinytrain import distributed as dist
from tinytrain.distributed._mpi import MPI

DTYPES = [np.float32, np.float64, np.int64]
LENGTHS = [0, 1, 7, 1001, 20_011]  # empty, tiny, odd, and one above the 64 KiB algorithm switch
MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}


def rng_for(*key):
    """A generator seeded by the test's key and this rank: different data on every rank."""
    return np.random.default_rng([dist.get_rank(), *[hash(str(k)) % 2**31 for k in key]])


def random_array(rng, shape, dtype, op="sum"):
    if np.issubdtype(dtype, np.integer):
        lo, hi = (-2, 3) if op == "prod" else (-1000, 1000)
        return rng.integers(lo, hi, size=shape).astype(dtype)
    if op == "prod":
        return rng.uniform(0.5, 1.5, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def subgroups():
    """Groups of the first k world ranks, k = 1..world size; yields (group or None, k)."""
    for k in range(1, dist.get_world_size() + 1):
        g = dist.new_group(range(k), name=f"first{k}")
        yield (g if dist.get_rank() < k else None), k


def assert_matches(ours, ref, dtype):
    if np.issubdtype(dtype, np.integer):
        np.testing.assert_array_equal(ours, ref)
    else:
        tol = 1e-4 if dtype == np.float32 else 1e-10
        np.testing.assert_allclose(ours, ref, rtol=tol, atol=tol)


def assert_same_on_all_ranks(x, g):
    """Every rank of g must hold bit-identical results (data parallel relies on it)."""
    everyone = np.empty((g.size,) + x.shape, dtype=x.dtype)
    g.comm.Allgather(np.ascontiguousarray(x), everyone)
    for other in everyone:
        np.testing.assert_array_equal(other, x)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("algo", ["ring", "recursive_doubling", "halving_doubling", "naive", None])
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "prod"])
def test_all_reduce_matches_mpi(algo, op):
    for g, k in subgroups():
        if g is None:
            continue
        for dtype in DTYPES:
            if op == "avg" and np.issubdtype(dtype, np.integer):
                continue
            for n in LENGTHS:
                x = random_array(rng_for(algo, op, k, n, dtype), n, dtype, op)
                ref = np.empty_like(x)
                g.comm.Allreduce(x, ref, op=MPI_OPS[op])
                if op == "avg":
                    ref = ref / k
                out = dist.all_reduce(x, op=op, group=g, algo=algo)
                assert out is x  # in place, like torch
                assert_matches(x, ref, dtype)
                assert_same_on_all_ranks(x, g)


@pytest.mark.world_size(3)
def test_all_reduce_on_three_ranks_multidimensional():
    x = random_array(rng_for("3r"), (5, 3, 7), np.float64)
    ref = np.empty_like(x)
    dist.world().comm.Allreduce(x, ref)
    for algo in ["ring", "recursive_doubling", "halving_doubling", "naive"]:
        y = x.copy()
        dist.all_reduce(y, algo=algo)
        assert_matches(y, ref, np.float64)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("algo", ["tree", "naive"])
def test_broadcast_matches_mpi(algo):
    for g, k in subgroups():
        if g is None:
            continue
        for root in range(k):
            for dtype in DTYPES:
                for n in [0, 1, 7, 1001]:
                    x = random_array(rng_for("b", algo, k, root, n), n, dtype)
                    ref = x.copy()
                    g.comm.Bcast(ref, root=root)
                    assert dist.broadcast(x, src=root, group=g, algo=algo) is x
                    np.testing.assert_array_equal(x, ref)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("algo", ["tree", "naive"])
@pytest.mark.parametrize("op", ["sum", "max", "prod"])
def test_reduce_matches_mpi(algo, op):
    for g, k in subgroups():
        if g is None:
            continue
        for root in range(k):
            for dtype in DTYPES:
                for n in [0, 7, 1001]:
                    x = random_array(rng_for("r", algo, op, k, root, n, dtype), n, dtype, op)
                    before = x.copy()
                    ref = np.empty_like(x)
                    g.comm.Reduce(x, ref, op=MPI_OPS[op], root=root)
                    dist.reduce(x, dst=root, op=op, group=g, algo=algo)
                    if g.rank == root:
                        assert_matches(x, ref, dtype)
                    else:
                        np.testing.assert_array_equal(x, before)  # non-roots keep their input


@pytest.mark.world_size(4)
def test_all_gather_equal_and_uneven_matches_mpi():
    for g, k in subgroups():
        if g is None:
            continue
        for dtype in DTYPES:
            # equal pieces, 2-D rows
            x = random_array(rng_for("ag", k, dtype), (3, 5), dtype)
            ref = np.empty((3 * k, 5), dtype=dtype)
            g.comm.Allgather(x, ref)
            np.testing.assert_array_equal(dist.all_gather(x, group=g), ref)
            # uneven pieces (some empty); every rank knows the sizes
            sizes = [int(s) for s in np.random.default_rng(k).integers(0, 6, size=k)]
            y = random_array(rng_for("agu", k, dtype), (sizes[g.rank], 2), dtype)
            ref = np.empty((sum(sizes), 2), dtype=dtype)
            g.comm.Allgatherv(y, [ref, [s * 2 for s in sizes]])
            np.testing.assert_array_equal(dist.all_gather(y, group=g, sizes=sizes), ref)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_reduce_scatter_equal_and_uneven_matches_mpi(op):
    for g, k in subgroups():
        if g is None:
            continue
        for dtype in DTYPES:
            if op == "avg" and np.issubdtype(dtype, np.integer):
                continue
            x = random_array(rng_for("rs", op, k, dtype), (4 * k, 3), dtype)
            before = x.copy()
            ref = np.empty((4, 3), dtype=dtype)
            g.comm.Reduce_scatter_block(x, ref, op=MPI_OPS[op])
            if op == "avg":
                ref = ref / k
            assert_matches(dist.reduce_scatter(x, op=op, group=g), ref, dtype)
            np.testing.assert_array_equal(x, before)  # input untouched
            sizes = [int(s) for s in np.random.default_rng(k + 7).integers(0, 5, size=k)]
            y = random_array(rng_for("rsu", op, k, dtype), sum(sizes), dtype)
            ref = np.empty(sizes[g.rank], dtype=dtype)
            g.comm.Reduce_scatter(y, ref, recvcounts=sizes, op=MPI_OPS[op])
            if op == "avg":
                ref = ref / k
            assert_matches(dist.reduce_scatter(y, op=op, group=g, sizes=sizes), ref, dtype)


@pytest.mark.world_size(4)
def test_avg_takes_bfloat16_as_mpi_averages_its_values():
    """--precision bf16: op='avg' on ml_dtypes' bfloat16 (no numpy.floating subtype) is accepted; the
    result is MPI's float32 average of the same bf16 values, within bf16's rounding of each add."""
    from ml_dtypes import bfloat16

    for g, k in subgroups():
        if g is None:
            continue
        for n in (0, 7, 1001):
            x = random_array(rng_for("bf16", k, n), (k, n), np.float32).astype(bfloat16)
            ref = np.empty((k, n), dtype=np.float32)
            g.comm.Allreduce(x.astype(np.float32), ref, op=MPI.SUM)
            piece = dist.reduce_scatter(x, op="avg", group=g)
            assert piece.dtype == bfloat16
            np.testing.assert_allclose(piece.astype(np.float32), ref[g.rank : g.rank + 1] / k, rtol=0.03, atol=0.03)
            dist.all_reduce(x, op="avg", group=g)
            np.testing.assert_allclose(x.astype(np.float32), ref / k, rtol=0.03, atol=0.03)
            assert_same_on_all_ranks(x.view(np.uint16), g)


@pytest.mark.world_size(4)
def test_all_to_all_equal_and_uneven_matches_mpi():
    for g, k in subgroups():
        if g is None:
            continue
        for dtype in DTYPES:
            x = random_array(rng_for("a2a", k, dtype), (2 * k, 3), dtype)
            ref = np.empty_like(x)
            g.comm.Alltoall(x, ref)
            np.testing.assert_array_equal(dist.all_to_all(x, group=g), ref)
            # uneven (MoE dispatch): each rank picks how many rows go where; receivers learn counts
            send = [int(s) for s in rng_for("a2au", k, dtype).integers(0, 4, size=k)]
            y = random_array(rng_for("a2auv", k, dtype), (sum(send), 3), dtype)
            counts = np.empty(k, dtype=np.int64)
            g.comm.Alltoall(np.array(send, dtype=np.int64), counts)
            ref = np.empty((int(counts.sum()), 3), dtype=dtype)
            g.comm.Alltoallv([y, [s * 3 for s in send]], [ref, [int(c) * 3 for c in counts]])
            np.testing.assert_array_equal(dist.all_to_all(y, send_sizes=send, group=g), ref)
            given = dist.all_to_all(y, send_sizes=send, recv_sizes=[int(c) for c in counts], group=g)
            np.testing.assert_array_equal(given, ref)


@pytest.mark.world_size(4)
def test_gather_and_scatter_match_mpi():
    for g, k in subgroups():
        if g is None:
            continue
        for root in range(k):
            for dtype in DTYPES:
                x = random_array(rng_for("g", k, root, dtype), (2, 3), dtype)
                ref = np.empty((2 * k, 3), dtype=dtype) if g.rank == root else None
                g.comm.Gather(x, ref, root=root)
                got = dist.gather(x, dst=root, group=g)
                if g.rank == root:
                    np.testing.assert_array_equal(got, ref)
                else:
                    assert got is None
                full = random_array(rng_for("s", k, root, dtype), (2 * k, 3), dtype)
                ref = np.empty((2, 3), dtype=dtype)
                g.comm.Scatter(full, ref, root=root)
                out = np.empty((2, 3), dtype=dtype)
                assert dist.scatter(out, full if g.rank == root else None, src=root, group=g) is out
                np.testing.assert_array_equal(out, ref)


@pytest.mark.world_size(4)
def test_barrier_waits_for_the_slowest_rank():
    import time

    for _ in range(3):
        dist.barrier()
    late = 0.3
    start = time.perf_counter()
    if dist.get_rank() == 2:
        time.sleep(late)
    dist.barrier()
    # Nobody leaves before rank 2 arrived (allow a little clock slack).
    assert time.perf_counter() - start >= late * 0.9


@pytest.mark.world_size(4)
def test_async_handles_progress_without_wait_and_several_in_flight():
    rng = rng_for("async")
    xs = [random_array(rng, n, np.float64) for n in (5, 40_000, 300)]
    refs = []
    for x in xs:
        ref = np.empty_like(x)
        dist.world().comm.Allreduce(x, ref)
        refs.append(ref)
    gathered_ref = np.empty(8, dtype=np.float64)
    piece = xs[0][:2].copy()
    dist.world().comm.Allgather(piece, gathered_ref)
    handles = [dist.all_reduce(x, async_op=True) for x in xs]
    h_gather = dist.all_gather(piece, async_op=True)
    # Poll only: no wait(). The algorithms must finish through progress_all alone.
    import time

    deadline = time.monotonic() + 10
    while not all(h.is_completed() for h in handles + [h_gather]):
        dist.progress_all()
        assert time.monotonic() < deadline, "async collectives did not progress when polled"
    for h, x, ref in reversed(list(zip(handles, xs, refs))):  # wait in a different order
        assert h.wait() is x
        assert_matches(x, ref, np.float64)
    np.testing.assert_array_equal(h_gather.wait(), gathered_ref)


@pytest.mark.world_size(4)
def test_progress_thread_completes_async_work():
    x = random_array(rng_for("thread"), 100_000, np.float32)
    ref = np.empty_like(x)
    dist.world().comm.Allreduce(x, ref)
    dist.start_progress_thread()
    try:
        h = dist.all_reduce(x, async_op=True)
        import time

        deadline = time.monotonic() + 10
        while not h._done:  # look, don't poll: only the helper thread advances it
            time.sleep(1e-3)
            assert time.monotonic() < deadline, "the progress thread did not advance the all_reduce"
        h.wait()
    finally:
        dist.stop_progress_thread()
    assert_matches(x, ref, np.float32)


@pytest.mark.world_size(2)
def test_one_rank_world_and_two_rank_world_are_consistent():
    x = np.arange(6, dtype=np.float32) * (dist.get_rank() + 1)
    g = dist.new_group([dist.get_rank()], name="self")  # a group of one: a no-op
    y = x.copy()
    dist.all_reduce(y, group=g)
    np.testing.assert_array_equal(y, x)
    assert dist.get_world_size(g) == 1 and dist.get_rank(g) == 0
