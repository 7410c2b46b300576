"""Byte accounting: every algorithm moves exactly its textbook volume.

Formulas (N = buffer elements, n = ranks, c_i = chunk lengths from split_counts(N, n)):
  ring all-reduce        rank r sends 2N - c_(r+1) - c_(r+2)   (= 2(n-1)/n N when n | N)
  recursive doubling     log2(n) N per rank when n is a power of two
  naive all-reduce       root sends and receives (n-1) N; others N each way
  ring all-gather        rank r sends total - piece_(r+1)      (= (n-1)/n total for equal pieces)
  ring reduce-scatter    rank r sends N - piece_r              (= (n-1)/n N)
  pairwise all-to-all    everything except the piece for itself
  tree broadcast         every non-root receives N once; the root sends ceil(log2 n) N
"""

import math

import numpy as np
import pytest

from tinytrain import distributed as dist
from tinytrain.distributed.collectives import split_counts


def measure(fn):
    with dist.comm_stats() as s:
        fn()
    return s


def total_over_ranks(value):
    return int(dist.world().comm.allreduce(value))


@pytest.mark.world_size(4)
@pytest.mark.parametrize("n_elems", [4096, 4099, 3])
def test_ring_all_reduce_volume(n_elems):
    n, r = dist.get_world_size(), dist.get_rank()
    x = np.random.default_rng(r).standard_normal(n_elems).astype(np.float32)
    s = measure(lambda: dist.all_reduce(x, algo="ring"))
    c = split_counts(n_elems, n)
    assert s.sent("all_reduce") == 4 * (2 * n_elems - c[(r + 1) % n] - c[(r + 2) % n])
    assert s.recv("all_reduce") == 4 * (2 * n_elems - c[r] - c[(r + 1) % n])
    if n_elems % n == 0:
        assert s.sent("all_reduce") == 2 * (n - 1) * x.nbytes // n
    assert s.sent("all_reduce", group="world") == s.sent("all_reduce")
    assert s.messages("all_reduce") == 2 * (n - 1)


@pytest.mark.world_size(4)
def test_recursive_doubling_and_naive_volumes():
    n, r = dist.get_world_size(), dist.get_rank()
    x = np.ones(1000, dtype=np.float64)
    s = measure(lambda: dist.all_reduce(x, algo="recursive_doubling"))
    assert s.sent("all_reduce") == s.recv("all_reduce") == int(math.log2(n)) * x.nbytes
    s = measure(lambda: dist.all_reduce(x, algo="naive"))
    expected = (n - 1) * x.nbytes if r == 0 else x.nbytes
    assert s.sent("all_reduce") == s.recv("all_reduce") == expected


@pytest.mark.world_size(3)
def test_recursive_doubling_volume_on_three_ranks():
    # p = 2: rank 2 folds into rank 0 and gets the result back; ranks 0 and 1 do one round.
    r = dist.get_rank()
    x = np.ones(100, dtype=np.float32)
    s = measure(lambda: dist.all_reduce(x, algo="recursive_doubling"))
    assert s.sent("all_reduce") == {0: 2, 1: 1, 2: 1}[r] * x.nbytes
    assert s.recv("all_reduce") == {0: 2, 1: 1, 2: 1}[r] * x.nbytes


@pytest.mark.world_size(4)
def test_all_gather_and_reduce_scatter_volumes():
    n, r = dist.get_world_size(), dist.get_rank()
    piece = np.ones((5, 2), dtype=np.float32)
    s = measure(lambda: dist.all_gather(piece))
    assert s.sent("all_gather") == (n - 1) * piece.nbytes  # (n-1)/n of the gathered buffer
    assert s.recv("all_gather") == (n - 1) * piece.nbytes
    sizes = [3, 0, 5, 1]
    mine = np.ones((sizes[r], 2), dtype=np.float32)
    s = measure(lambda: dist.all_gather(mine, sizes=sizes))
    assert s.sent("all_gather") == (sum(sizes) - sizes[(r + 1) % n]) * 2 * 4
    assert s.recv("all_gather") == (sum(sizes) - sizes[r]) * 2 * 4
    full = np.ones(4 * n, dtype=np.float64)
    s = measure(lambda: dist.reduce_scatter(full))
    assert s.sent("reduce_scatter") == (n - 1) * full.nbytes // n
    s = measure(lambda: dist.reduce_scatter(np.ones(sum(sizes)), sizes=sizes))
    assert s.sent("reduce_scatter") == (sum(sizes) - sizes[r]) * 8


@pytest.mark.world_size(4)
def test_all_to_all_and_broadcast_volumes():
    n, r = dist.get_world_size(), dist.get_rank()
    x = np.ones((2 * n, 3), dtype=np.int64)
    s = measure(lambda: dist.all_to_all(x))
    assert s.sent("all_to_all") == (n - 1) * x.nbytes // n
    send = [(r + p) % 3 for p in range(n)]
    y = np.ones((sum(send), 3), dtype=np.int64)
    s = measure(lambda: dist.all_to_all(y, send_sizes=send, recv_sizes=[(p + r) % 3 for p in range(n)]))
    assert s.sent("all_to_all") == (sum(send) - send[r]) * 3 * 8
    b = np.ones(777, dtype=np.float32)
    for root in range(n):
        s = measure(lambda: dist.broadcast(b, src=root))
        assert s.recv("broadcast") == (0 if r == root else b.nbytes)
        assert total_over_ranks(s.sent("broadcast")) == (n - 1) * b.nbytes
        if r == root:
            assert s.sent("broadcast") == math.ceil(math.log2(n)) * b.nbytes


@pytest.mark.world_size(4)
def test_stats_are_per_group_and_debug_checks_are_not_counted_as_the_op():
    mesh = dist.DeviceMesh({"dp": 2, "tp": 2})
    x = np.ones(8, dtype=np.float32)
    with dist.comm_stats() as outer:
        with dist.comm_stats() as inner:
            dist.all_reduce(x, group=mesh.get_group("tp"), algo="ring")
        dist.all_reduce(x, group=mesh.get_group("dp"), algo="ring")
    assert inner.sent(group="tp", op="all_reduce") == x.nbytes  # 2(n-1)/n with n = 2
    assert inner.sent(group="dp") == 0
    assert outer.sent(op="all_reduce") == 2 * x.nbytes
    assert outer.sent(group="dp", op="all_reduce") == x.nbytes
    assert "all_reduce" in outer.table()


@pytest.mark.world_size(4)
def test_halving_doubling_moves_the_ring_volume_in_fewer_steps():
    n = dist.get_world_size()
    x = np.ones(4 * 1000, dtype=np.float32)
    ring = measure(lambda: dist.all_reduce(x.copy(), algo="ring"))
    hd = measure(lambda: dist.all_reduce(x.copy(), algo="halving_doubling"))
    assert hd.sent("all_reduce") == ring.sent("all_reduce") == 2 * (n - 1) * x.nbytes // n
    assert hd.messages("all_reduce") == 2 * int(math.log2(n)) < ring.messages("all_reduce") == 2 * (n - 1)


def test_default_algorithm_is_chosen_by_size():
    from tinytrain.distributed import choice as c

    assert c.choose_all_reduce_algo(1024) == "recursive_doubling"
    assert c.choose_all_reduce_algo(c.SMALL_MESSAGE_BYTES) == "halving_doubling"
    assert c.choose_all_reduce_algo(c.LARGE_MESSAGE_BYTES) == "ring"
