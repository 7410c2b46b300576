"""Point-to-point calls, groups, and the device mesh."""

import numpy as np
import pytest

from tinytrain import distributed as dist


@pytest.mark.world_size(4)
def test_ring_of_sendrecv_and_blocking_send_recv():
    r, n = dist.get_rank(), dist.get_world_size()
    rng = np.random.default_rng(r)
    mine = rng.standard_normal(513)
    got = np.empty_like(mine)
    dist.sendrecv(mine, (r + 1) % n, got, (r - 1) % n)
    np.testing.assert_array_equal(got, np.random.default_rng((r - 1) % n).standard_normal(513))
    # blocking send/recv: even ranks send first, odd ranks receive first
    x = np.arange(10, dtype=np.int64) + 100 * r
    if r % 2 == 0:
        dist.send(x, r + 1)
    else:
        y = dist.recv(np.empty(10, dtype=np.int64), r - 1)
        np.testing.assert_array_equal(y, np.arange(10) + 100 * (r - 1))


@pytest.mark.world_size(4)
def test_isend_irecv_with_tags_match_by_tag_not_order():
    r, _n = dist.get_rank(), dist.get_world_size()
    if r == 0:
        hs = [dist.isend(np.full(3, float(t)), 1, tag=t) for t in (1, 2, 3)]
        for h in hs:
            h.wait()
    elif r == 1:
        bufs = {t: np.empty(3) for t in (3, 1, 2)}
        hs = {t: dist.irecv(bufs[t], 0, tag=t) for t in (3, 1, 2)}  # posted in another order
        for t, h in hs.items():
            assert h.wait() is bufs[t]
            assert (bufs[t] == t).all()


@pytest.mark.world_size(4)
def test_p2p_inside_a_group_uses_group_ranks():
    g = dist.new_group([3, 1], name="pair")  # group rank 0 is world rank 3
    if dist.get_rank() == 3:
        assert dist.get_rank(g) == 0
        dist.send(np.array([42.0]), 1, group=g)
    elif dist.get_rank() == 1:
        assert dist.get_rank(g) == 1
        assert dist.recv(np.empty(1), 0, group=g)[0] == 42.0


@pytest.mark.world_size(4)
def test_device_mesh_layout_groups_and_rings():
    mesh = dist.DeviceMesh({"dp": 2, "tp": 2})
    r = dist.get_rank()
    assert mesh.coords == {"dp": r // 2, "tp": r % 2}  # TP innermost
    assert mesh.rank_at(dp=mesh.coords["dp"], tp=mesh.coords["tp"]) == r
    tp, dp = mesh.get_group("tp"), mesh.get_group("dp")
    assert tp.world_ranks == tuple(2 * (r // 2) + i for i in range(2))
    assert dp.world_ranks == tuple(i * 2 + r % 2 for i in range(2))
    assert dist.get_rank(tp) == r % 2 and dist.get_world_size(dp) == 2
    x = np.array([float(r)])
    dist.all_reduce(x, group=tp)
    assert x[0] == sum(tp.world_ranks)
    mesh3 = dist.DeviceMesh({"pp": 1, "dp": 1, "tp": 4})
    prev, nxt = mesh3.ring("tp")
    assert (prev, nxt) == ((r - 1) % 4, (r + 1) % 4)
    with pytest.raises(ValueError, match=r"needs 6 ranks but .* has 4; run with mpirun -n 6"):
        dist.DeviceMesh({"dp": 3, "tp": 2})
    with pytest.raises(ValueError, match="not 'pp'"):
        mesh.get_group("pp")
    mesh4 = dist.DeviceMesh({"dp": 2, "cp": 1, "tp": 2})
    both = mesh4.get_group("tp", "dp")  # flattened in mesh order: dp outer, tp inner
    assert both.world_ranks == (0, 1, 2, 3) and mesh4.get_group("dp", "tp") is both
    assert mesh4.get_group("dp", "cp").world_ranks == mesh4.get_group("dp").world_ranks


def test_init_is_idempotent_and_single_rank_world_works():
    assert dist.init() is dist.init()
    assert dist.get_world_size() == 1 and dist.get_rank() == 0
    x = np.arange(5.0)
    for fn in (dist.all_reduce, dist.broadcast, dist.reduce):
        np.testing.assert_array_equal(fn(x.copy()), x)
    np.testing.assert_array_equal(dist.all_gather(x), x)
    np.testing.assert_array_equal(dist.all_to_all(x), x)
    dist.barrier()


def test_cuda_aware_override(monkeypatch):
    from tinytrain.distributed import p2p

    for value, expected in (("1", True), ("0", False)):
        monkeypatch.setattr(p2p, "_cuda_aware", None)
        monkeypatch.setenv("TINYTRAIN_CUDA_AWARE_MPI", value)
        assert dist.cuda_aware() is expected
    monkeypatch.setattr(p2p, "_cuda_aware", None)
