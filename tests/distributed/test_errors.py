"""Bad inputs fail early with an error that says what to change; waits end with named errors."""

import time

import numpy as np
import pytest

from tinytrain import distributed as dist


def test_non_contiguous_buffer_is_rejected():
    x = np.ones((4, 6), dtype=np.float32).T
    with pytest.raises(ValueError, match="C-contiguous.*ascontiguousarray"):
        dist.all_reduce(x)
    with pytest.raises(ValueError, match="C-contiguous"):
        dist.all_gather(x)
    with pytest.raises(ValueError, match="C-contiguous"):
        dist.send(x, 0)


def test_non_arrays_and_bad_arguments_are_rejected():
    with pytest.raises(TypeError, match="tensor.data"):
        dist.all_reduce([1.0, 2.0])
    x = np.ones(4, dtype=np.float32)
    with pytest.raises(ValueError, match="op='median' is not one of"):
        dist.all_reduce(x, op="median")
    with pytest.raises(
        ValueError, match="algo='magic' is not one of ring, recursive_doubling, halving_doubling, naive"
    ):
        dist.all_reduce(x, algo="magic")
    with pytest.raises(ValueError, match="avg.*floating"):
        dist.all_reduce(np.ones(3, dtype=np.int64), op="avg")
    with pytest.raises(ValueError, match="src=3 is not a rank"):
        dist.broadcast(x, src=3)
    with pytest.raises(ValueError, match="read-only"):
        ro = np.ones(3)
        ro.flags.writeable = False
        dist.all_reduce(ro)
    with pytest.raises(ValueError, match="tag=5000"):
        dist.isend(x, 0, tag=5000)
    with pytest.raises(ValueError, match="out must have shape"):
        dist.all_gather(x, out=np.empty(3, dtype=np.float32))
    with pytest.raises(ValueError, match="sizes"):
        dist.all_gather(x, sizes=[5])


def test_checks_still_run_after_a_call_with_the_same_shape_succeeded():
    """A call keeps what its arguments gave (collectives._plans); a later call with the same shape
    but a bad out=, a read-only or strided buffer, another op or other sizes is still refused."""
    n = dist.get_world_size()
    x = np.ones((n, 3), dtype=np.float32)
    dist.all_gather(x, out=np.empty((n * n, 3), dtype=np.float32))
    dist.reduce_scatter(x)
    dist.all_reduce(x)
    with pytest.raises(ValueError, match="out must have shape"):
        dist.all_gather(x, out=np.empty((n * n, 2), dtype=np.float32))
    with pytest.raises(ValueError, match="out must have shape"):
        dist.reduce_scatter(x, out=np.empty((1, 3), dtype=np.float64))
    with pytest.raises(ValueError, match="sizes"):
        dist.reduce_scatter(x, sizes=[n + 1] * n)
    with pytest.raises(ValueError, match="op='median' is not one of"):
        dist.all_reduce(x, op="median")
    with pytest.raises(ValueError, match="read-only"):
        ro = x.copy()
        ro.flags.writeable = False
        dist.all_reduce(ro)
    with pytest.raises(ValueError, match="C-contiguous"):
        dist.all_gather(np.ones((3, 4), dtype=np.float32).T)
    with pytest.raises(ValueError, match="avg.*floating"):
        dist.all_reduce(np.ones((n, 3), dtype=np.int64), op="avg")
    with pytest.raises(ValueError, match="sizes needs one non-negative row count"):
        dist.all_gather(x, sizes=[[n]] * n)  # not even a key: checked, never kept


@pytest.mark.world_size(3)
def test_uneven_splits_need_sizes():
    with pytest.raises(ValueError, match="do not split evenly over 3 ranks; pass sizes"):
        dist.reduce_scatter(np.ones(8))
    with pytest.raises(ValueError, match="pass send_sizes"):
        dist.all_to_all(np.ones(8))
    with pytest.raises(ValueError, match="add up to 4, but the tensor has 8 rows"):
        dist.all_to_all(np.ones(8), send_sizes=[1, 1, 2])


@pytest.mark.world_size(4)
def test_group_that_excludes_the_caller():
    g = dist.new_group([0, 2])
    x = np.ones(4)
    if dist.get_rank() in (0, 2):
        dist.all_reduce(x, group=g)
        assert (x == 2).all()
    else:
        with pytest.raises(
            ValueError, match=r"rank \d is not a member of group group_0_2.*call this only on ranks \[0, 2\]"
        ):
            dist.all_reduce(x, group=g)
    with pytest.raises(ValueError, match="outside the world of 4 ranks"):
        dist.new_group([0, 9])


@pytest.mark.world_size(4)
def test_dtype_and_shape_mismatch_across_ranks_named_in_words(monkeypatch):
    monkeypatch.setenv("TINYTRAIN_DEBUG", "1")
    dtype = np.float64 if dist.get_rank() == 3 else np.float32
    with pytest.raises(
        dist.CollectiveMismatch,
        match=r"rank 3 called all_reduce\(shape=\(8,\), float64.*"
        r"while rank 0 called all_reduce\(shape=\(8,\), float32.*differ in dtype",
    ):
        dist.all_reduce(np.ones(8, dtype=dtype))
    n = 9 if dist.get_rank() == 1 else 8
    with pytest.raises(
        dist.CollectiveMismatch,
        match=r"rank 1 called broadcast\(shape=\(9,\).*while rank 0 called broadcast\(shape=\(8,\).*differ in shape",
    ):
        dist.broadcast(np.ones(n))
    # and afterwards the group still works (the check itself left no messages behind)
    x = np.ones(4)
    dist.all_reduce(x)
    assert (x == 4).all()


@pytest.mark.world_size(2)
def test_timeout_names_operation_group_step_peer_and_time(monkeypatch):
    monkeypatch.setenv("TINYTRAIN_TIMEOUT", "1")
    monkeypatch.setenv("TINYTRAIN_DEBUG", "0")
    if dist.get_rank() == 0:  # rank 1 never joins this all_reduce
        start = time.monotonic()
        with pytest.raises(dist.CommTimeout) as err:
            dist.all_reduce(np.ones(10_000, dtype=np.float32), algo="ring")
        assert time.monotonic() - start < 5
        msg = str(err.value)
        for part in [
            "all_reduce(algo=ring)",
            "group world",
            "ring reduce-scatter step 1/1",
            "recv from rank 1",
            "timed out after 1.",
        ]:
            assert part in msg, (part, msg)
        # The abandoned all_reduce's messages may still arrive: the group refuses further use.
        with pytest.raises(dist.DistributedError, match="unusable after an earlier CommTimeout in all_reduce"):
            dist.barrier()


@pytest.mark.world_size(2)
def test_a_receive_given_up_on_keeps_its_buffer_until_its_message_lands(monkeypatch):
    """A wait abandoned at its deadline drops the handle, but MPI still owns the receive: freeing its
    buffer then lets the late message land in memory Python has reused (CI once aborted with glibc's
    "malloc(): unaligned tcache chunk detected" a few tests after a test of failures)."""
    import gc
    import weakref

    from tinytrain.distributed import watchdog

    monkeypatch.setenv("TINYTRAIN_DEBUG", "0")
    if dist.get_rank() == 1:
        time.sleep(1.0)  # well after rank 0 gave up
        dist.send(np.full(4096, 7.0), dst=0)
        return
    buf = np.zeros(4096)
    alive = weakref.ref(buf)
    handle = dist.irecv(buf, src=1)
    with pytest.raises(dist.CommTimeout):
        handle.wait(timeout=0.2)
    del buf, handle
    gc.collect()
    assert alive() is not None, "the buffer of a receive MPI may still complete was freed"
    deadline = time.monotonic() + 10
    while alive() is not None and time.monotonic() < deadline:  # polls MPI: the message lands, then
        watchdog._forget_completed()  # the completed request lets its buffer go
        time.sleep(0.01)
    assert alive() is None, "a receive that completed is kept forever"


@pytest.mark.world_size(2)
def test_peer_failure_is_noticed_in_milliseconds(monkeypatch):
    monkeypatch.setenv("TINYTRAIN_TIMEOUT", "30")
    if dist.get_rank() == 1:
        time.sleep(0.1)
        dist.report_failure("rank 1 gave up on purpose")
    else:
        start = time.monotonic()
        with pytest.raises(dist.PeerFailure, match="rank 1 failed.*gave up on purpose") as err:
            dist.recv(np.empty(4), src=1)
        assert "recv from rank 1" in str(err.value)
        assert time.monotonic() - start < 5  # far below the 30 s deadline


@pytest.mark.world_size(2)
def test_heartbeats_tell_a_busy_peer_from_a_deadlock(monkeypatch):
    """With heartbeats (as `tinytrain train` runs), a wait past TINYTRAIN_TIMEOUT goes on while the
    peer computes, and ends soon after the deadline when the peer waits too (here: for this rank)."""
    from tinytrain.distributed import watchdog

    monkeypatch.setenv("TINYTRAIN_TIMEOUT", "1")
    monkeypatch.setenv("TINYTRAIN_DEBUG", "0")
    monkeypatch.setenv("TINYTRAIN_HEARTBEAT", "0.25")  # a rank silent for 1 s is taken as stopped
    watchdog.start_heartbeat()
    try:
        x = np.zeros(4)
        if dist.get_rank() == 1:
            time.sleep(2.5)  # computing: past the deadline, and past the 1 s a silent rank is given
            dist.send(np.ones(4), dst=0)
        else:
            dist.recv(x, src=1)  # an honest long wait: no error
            assert (x == 1).all()
        start = time.monotonic()
        with pytest.raises(dist.CommTimeout) as err:  # both receive first: a deadlock
            dist.recv(x, src=1 - dist.get_rank())
        # Each rank sees the cycle, or (if the other rank saw it first, raised and stopped beating)
        # a peer that has gone silent: a rank that left the wait will never send.
        message = str(err.value)
        assert "Ranks [0, 1] are all waiting, for each other" in message or "has sent no heartbeat" in message
        assert time.monotonic() - start < 7, message
    finally:
        watchdog.stop_heartbeat()


def test_a_wait_on_a_rank_whose_process_is_gone_raises_peer_died_naming_it(monkeypatch):
    """A rank killed outright posts no notice: a wait finds its process gone and names it, once it
    has been gone ``_DEAD_FOR`` seconds (so a launcher that watches the ranks sees it end first)."""
    import subprocess
    import sys

    from tinytrain.distributed import watchdog

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # ended and reaped: its pid names no process
    monkeypatch.setattr(watchdog, "local_pids", {1: gone.pid, 2: __import__("os").getpid()})
    monkeypatch.setattr(watchdog, "_found_dead", {})
    describe = lambda: "all_reduce(algo=ring) on group world, ring step 1/2"  # noqa: E731
    watchdog._check_dead(describe, lambda: [("recv from", 2)], 0.3)  # rank 2 (this process) runs
    watchdog._check_dead(describe, lambda: [("recv from", 1)], 0.3)  # gone, but only just found so
    monkeypatch.setattr(watchdog, "_DEAD_FOR", 0.0)
    with pytest.raises(dist.PeerDied, match=rf"ring step 1/2: rank 1 \(pid {gone.pid} on \S+\) has died") as e:
        watchdog._check_dead(describe, lambda: [("recv from", 1), ("recv from", 2)], 0.7)
    assert e.value.failed_rank == 1 and isinstance(e.value, dist.PeerFailure)
    assert "while this rank waited 0.7 s for recv from rank 1, recv from rank 2" in str(e.value)
