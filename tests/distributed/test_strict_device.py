"""The GPU code paths of the collectives, run on the strict stand-in device (tinytrain.backend.strict).

Every collective and the point-to-point calls on device buffers, with a CUDA-aware MPI (device
memory handed to MPI) and without (staged through host memory), against MPI's own on host copies;
where the copies happen; that MPI never gets a buffer whose last write was not synchronized; and
the rank -> GPU binding on the stand-in's fake GPUs.

In the normal CPU run the collectives are switched onto the stand-in for each test (only
``backend`` and ``p2p`` decide where a buffer lives); under ``TINYTRAIN_DEVICE=strict`` (CI's second
run) it is the backend already; under ``TINYTRAIN_DEVICE=gpu`` the same tests run on CuPy and a real
GPU, without the copy counts (which only the stand-in keeps).
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from tinytrain import backend
from tinytrain import distributed as dist
from tinytrain.backend import strict
from tinytrain.bench import collectives as bench
from tinytrain.distributed import p2p
from tinytrain.distributed._mpi import MPI


@pytest.fixture
def on_device(monkeypatch):
    """Device buffers: the stand-in's, unless the backend is a real GPU."""
    if backend.device == "cpu":
        monkeypatch.setattr(backend, "xp", strict.xp)
        monkeypatch.setattr(backend, "device", "strict")
        monkeypatch.setattr(backend, "on_device", True)


@pytest.fixture(params=["cuda_aware", "staged"])
def path(request, monkeypatch, on_device):
    """Device buffers, and the MPI path under test."""
    monkeypatch.setattr(p2p, "_cuda_aware", request.param == "cuda_aware")
    return request.param


def counted():
    """Whether copies are counted here (the stand-in), not on a real GPU."""
    return backend.device == "strict"


def dev(host):
    return backend.xp.asarray(host)


def host(x):
    assert isinstance(x, backend.xp.ndarray), f"expected a device array, got {type(x).__name__}"
    return backend.to_host(x)


def data(shape, seed, dtype=np.float64):
    rng = np.random.default_rng([dist.get_rank(), seed])
    return rng.integers(-50, 50, size=shape).astype(dtype)  # integers: sums are exact in any order


@pytest.mark.world_size(4)
def test_every_collective_on_device_buffers_matches_mpi(path):
    comm = dist.world().comm
    n, r = comm.Get_size(), comm.Get_rank()
    x = data((8, 3), 1)
    for algo in ("ring", "recursive_doubling", "halving_doubling", "naive"):
        want = np.empty_like(x)
        comm.Allreduce(x, want)
        got = dev(x)
        assert dist.all_reduce(got, algo=algo) is got
        np.testing.assert_array_equal(host(got), want, err_msg=algo)
    for algo in ("tree", "naive"):
        want = x.copy()
        comm.Bcast(want, root=2)
        np.testing.assert_array_equal(host(dist.broadcast(dev(x), src=2, algo=algo)), want)
        want = np.empty_like(x)
        comm.Reduce(x, want, root=1)
        got = dist.reduce(dev(x), dst=1, algo=algo)
        np.testing.assert_array_equal(host(got), want if r == 1 else x)
    want = np.empty((8 * n, 3))
    comm.Allgather(x, want)
    np.testing.assert_array_equal(host(dist.all_gather(dev(x))), want)
    uneven = data((r + 1, 3), 2)
    want = np.concatenate(comm.allgather(uneven))
    np.testing.assert_array_equal(host(dist.all_gather(dev(uneven), sizes=[1, 2, 3, 4])), want)
    want = np.empty((2, 3))
    comm.Reduce_scatter_block(x, want)
    np.testing.assert_array_equal(host(dist.reduce_scatter(dev(x))), want)
    want = np.empty_like(x)
    comm.Alltoall(x, want)
    np.testing.assert_array_equal(host(dist.all_to_all(dev(x))), want)
    sends = [(r + p) % 3 for p in range(n)]  # rows this rank sends to each rank
    rows = data((sum(sends), 3), 3)
    pieces = np.split(rows, np.cumsum(sends)[:-1])
    want = np.concatenate(comm.alltoall(pieces))
    np.testing.assert_array_equal(host(dist.all_to_all(dev(rows), send_sizes=sends)), want)
    want = np.empty((8 * n, 3)) if r == 3 else None
    comm.Gather(x, want, root=3)
    got = dist.gather(dev(x), dst=3)
    if r == 3:
        np.testing.assert_array_equal(host(got), want)
    full = data((8 * n, 3), 4)
    want = np.empty_like(x)
    comm.Scatter(full, want, root=0)
    np.testing.assert_array_equal(host(dist.scatter(dev(np.zeros_like(x)), dev(full), src=0)), want)
    dist.barrier()


@pytest.mark.world_size(2)
def test_point_to_point_on_device_buffers(path):
    r = dist.get_rank()
    x = data(5, 5)
    got = dev(np.zeros(5))
    dist.sendrecv(dev(x), 1 - r, got, 1 - r)
    np.testing.assert_array_equal(host(got), MPI.COMM_WORLD.sendrecv(x, 1 - r))  # the peer's data
    if r == 0:
        dist.send(dev(np.arange(4.0)), 1, tag=3)
    else:
        np.testing.assert_array_equal(host(dist.recv(dev(np.zeros(4)), 0, tag=3)), np.arange(4.0))


@pytest.mark.world_size(4)
def test_staged_all_reduce_copies_each_chunk_once_each_way_and_cuda_aware_never(path):
    """Ring all_reduce of N floats on n ranks: 2(n-1) steps, each sending one chunk and receiving one.

    Staged through the host, every chunk sent is copied device->host once and every chunk received
    host->device once, the bytes being exactly the bytes MPI moved; CUDA-aware, nothing is copied.
    Either way the stream is synchronized before MPI touches each buffer (one per message).
    """
    if not counted():
        pytest.skip("copies are counted by the strict stand-in only")
    n, count = dist.get_world_size(), 4000
    x = dev(data(count, 6, np.float32))
    before = strict.counts.snapshot()
    with dist.comm_stats() as moved:
        dist.all_reduce(x, algo="ring")
    copies = strict.counts.since(before)
    steps = 2 * (n - 1)
    assert moved.sent("all_reduce") == moved.recv("all_reduce") == steps * (count // n) * 4
    assert copies["syncs"] == 2 * steps  # one send and one receive per step
    if path == "staged":
        assert (copies["d2h"], copies["h2d"]) == (steps, steps)
        assert copies["d2h_bytes"] == moved.sent("all_reduce")
        assert copies["h2d_bytes"] == moved.recv("all_reduce")
    else:
        assert (copies["d2h"], copies["h2d"], copies["d2h_bytes"], copies["h2d_bytes"]) == (0, 0, 0, 0)


@pytest.mark.world_size(2)
def test_mpi_never_gets_a_buffer_written_after_the_last_synchronize(on_device, monkeypatch):
    """Take the synchronize out of p2p: the stand-in refuses the unsynchronized device buffer."""
    if not counted():
        pytest.skip("the strict stand-in keeps the books of writes and synchronizations")
    monkeypatch.setattr(p2p, "_cuda_aware", True)
    monkeypatch.setattr(backend, "synchronize", lambda: None)
    x = dev(np.ones(3))
    x *= 2  # a "kernel" writes x after the last synchronize
    with pytest.raises(strict.UnsynchronizedBuffer, match="synchronize"):
        dist.all_reduce(x, algo="recursive_doubling")


def test_strict_arrays_refuse_implicit_host_conversion_and_count_copies(monkeypatch):
    xp = strict.xp
    a = np.arange(12.0).reshape(3, 4)
    before = strict.counts.snapshot()
    d = xp.asarray(a)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(d)
    with pytest.raises(TypeError, match="host numpy.ndarray"):
        d + a  # noqa: B018 - the error is the point
    with pytest.raises(TypeError):
        MPI.COMM_SELF.Isend(d, dest=0)  # MPI cannot read a device array without CUDA-aware staging
    product = d @ d.T
    assert isinstance(product, xp.ndarray) and isinstance(d.sum(), xp.ndarray)  # reductions stay on device
    np.testing.assert_array_equal(xp.asnumpy(product), a @ a.T)  # NumPy underneath: exact
    d[0] = a[1]  # a host row copied in
    assert float(d[0, 0]) == 4.0
    copies = strict.counts.since(before)
    assert (copies["h2d"], copies["d2h"]) == (2, 2)
    assert copies["h2d_bytes"] == a.nbytes + a[1].nbytes


def test_rank_binds_to_its_fake_gpu(on_device, monkeypatch):
    """select_device_for_rank's CuPy calls (getDeviceCount, Device(i).use(), Device().id) on the stand-in."""
    if not counted():
        pytest.skip("the fake GPU count is the stand-in's")
    monkeypatch.delenv("TINYTRAIN_GPU", raising=False)
    monkeypatch.setenv("TINYTRAIN_STRICT_GPUS", "3")
    bound = backend.current_gpu()
    try:
        assert backend.gpu_count() == 3
        assert backend.select_device_for_rank(4) == 1 and backend.current_gpu() == 1
        monkeypatch.setenv("TINYTRAIN_GPU", "2")
        assert backend.select_device_for_rank(4) == 2 and backend.current_gpu() == 2
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            strict.xp.cuda.Device(3).use()
    finally:
        strict.xp.cuda.Device(bound).use()


@pytest.mark.world_size(2)
def test_bench_collectives_on_device_buffers_with_the_cost_of_the_receive_check(path, capsys):
    """`tinytrain bench collectives --device --receive-check`: ours on device buffers, MPI's own on
    device memory when CUDA-aware, else on host buffers; and what checking each receive costs."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(
        "--device --receive-check --sizes 4K --collectives all_reduce all_gather --rounds 1".split()
    )
    assert bench.run(args) == 0
    if dist.get_rank() == 0:
        out = capsys.readouterr().out
        how = "CUDA-aware" if path == "cuda_aware" else "staged via host"
        assert f"{backend.device} device buffers, MPI {how}" in out and "check %" in out
        rows = [line for line in out.splitlines() if line.startswith(("  all_reduce", "  all_gather"))]
        assert len(rows) == 2
        for row in rows:
            float(row.split()[-1])  # the check's cost in percent of our time
        line = [line for line in out.splitlines() if line.startswith("# receive check:")][0]
        float(line.split()[3])  # ns per received message, measured on one process
