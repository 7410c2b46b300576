"""In a student release the ring, pairwise and tree algorithms are cut out (TODO stubs, see
``python -m grader release``); the collectives must then still work through their stand-ins.

Here the cut is simulated by replacing those functions with stubs, as the release does.
"""

import numpy as np
import pytest

from tinytrain import distributed as dist
from tinytrain.distributed import algorithms, choice

CUT = ["_ring_reduce_scatter", "_ring_all_gather", "_all_reduce_ring", "_all_to_all_pairwise", "_broadcast_tree"]


def _stub(*args, **kwargs):
    raise NotImplementedError("TODO 1.x: cut out of this student release")


@pytest.fixture
def released(monkeypatch):
    for name in CUT:
        monkeypatch.setattr(algorithms, name, _stub)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("n", [4, 3])
def test_collectives_fall_back_to_stand_ins_when_their_algorithm_is_cut_out(released, n):
    g = dist.new_group(range(n))
    if dist.get_rank() >= n:
        return
    rng = np.random.default_rng(dist.get_rank())
    x = rng.integers(-9, 9, size=(n * 5, 2)).astype(np.float64)

    want = np.empty_like(x)
    g.comm.Allreduce(x, want)
    got = dist.all_reduce(x.copy(), group=g, algo="ring")
    np.testing.assert_array_equal(got, want)

    rs = np.empty((5, 2))
    g.comm.Reduce_scatter(x, rs, [10] * n)
    np.testing.assert_array_equal(dist.reduce_scatter(x, group=g), rs)

    ag = np.empty((n * 5, 2))
    g.comm.Allgather(x[:5], ag)
    np.testing.assert_array_equal(dist.all_gather(x[:5].copy(), group=g), ag)

    a2a = np.empty_like(x)
    g.comm.Alltoall(x, a2a)
    np.testing.assert_array_equal(dist.all_to_all(x, group=g), a2a)
    sizes = [(g.rank + p) % 3 for p in range(n)]
    uneven = dist.all_to_all(x[: sum(sizes)].copy(), send_sizes=sizes, group=g)
    assert uneven.shape[0] == sum((p + g.rank) % 3 for p in range(n))

    b = x.copy() if g.rank == 1 else np.zeros_like(x)
    want = b.copy()
    g.comm.Bcast(want, root=1)
    np.testing.assert_array_equal(dist.broadcast(b, src=1, group=g), want)


def test_assignment_copies_never_fall_back():
    """The stand-ins are the framework's; an assignment must raise its TODOs for the grader."""
    import assignments.a1_collectives as a1

    assert algorithms._public.stand_ins and not a1._public.stand_ins
    assert not a1._public._cut_out("_ring_reduce_scatter")
    assert choice.is_stub(_stub) and not choice.is_stub(_a_real_algorithm)
    # (algorithms._ring_reduce_scatter itself is a stub in a student release, so it cannot serve here)


def _a_real_algorithm(c, flat):
    yield from ()
    return flat


def test_the_assignment_runs_its_own_algorithms_behind_the_framework_functions(monkeypatch):
    """``a1.all_reduce`` is the framework's all_reduce, driving the algorithms of the assignment file."""
    import assignments.a1_collectives as a1

    x = np.ones(4)
    monkeypatch.setattr(a1, "_all_reduce_ring", _stub)  # as unfinished, whatever the student has done
    with pytest.raises(NotImplementedError, match="TODO 1.x"):
        a1.all_reduce(x, algo="ring")
    np.testing.assert_array_equal(a1.all_reduce(x, algo="recursive_doubling"), np.full(4, dist.get_world_size()))
    called = []
    monkeypatch.setattr(a1, "_broadcast_tree", lambda c, flat, root: called.append(root) or iter(()))
    a1.broadcast(x, src=0, algo="tree")
    assert called == [0]


@pytest.mark.world_size(4)
@pytest.mark.parametrize("n", [4, 3])
@pytest.mark.parametrize("cut", [False, True], ids=["ring", "stand-in"])
def test_bytes_sent_is_what_the_algorithm_that_runs_sends(monkeypatch, n, cut):
    """Volume checks (ZeRO's, sequence parallel's) compare measured bytes with ``dist.bytes_sent``:
    uneven pieces, an empty one, by the ring and by the direct stand-ins of a student copy."""
    if cut:
        for name in CUT:
            monkeypatch.setattr(algorithms, name, _stub)
    elif choice.is_stub(algorithms._ring_all_gather):
        pytest.skip("student copy: the framework's ring is task 1.1/1.2 here (graded in tests/graded)")
    g = dist.new_group(range(n))
    if dist.get_rank() >= n:
        return
    sizes = [3, 0, 5, 2][:n]
    x = np.arange(sum(sizes) * 2, dtype=np.float32).reshape(-1, 2)
    with dist.comm_stats() as s:
        rs = dist.reduce_scatter(x, group=g, sizes=sizes)
    assert s.sent("reduce_scatter") == dist.bytes_sent("reduce_scatter", [2 * k for k in sizes], 4, group=g)
    np.testing.assert_array_equal(rs, n * x[sum(sizes[: g.rank]) : sum(sizes[: g.rank + 1])])
    mine = x[sum(sizes[: g.rank]) : sum(sizes[: g.rank + 1])].copy()
    with dist.comm_stats() as s:
        ag = dist.all_gather(mine, group=g, sizes=sizes)
    assert s.sent("all_gather") == dist.bytes_sent("all_gather", [2 * k for k in sizes], 4, group=g)
    np.testing.assert_array_equal(ag, x)
    ring = 4 * 2 * (sum(sizes) - sizes[(g.rank + 1) % n])  # every piece but piece r+1
    direct = 4 * 2 * (n - 1) * sizes[g.rank]  # my piece to each of the others
    assert s.sent("all_gather") == (direct if cut else ring)
    with pytest.raises(ValueError, match="one per rank"):
        dist.bytes_sent("all_gather", sizes[:-1], 4, group=g)


def test_ring_neighbours_on_fixed_rings():
    """The ring every ring algorithm (and the graded ring checks) uses: 0 -> 1 -> ... -> n-1 -> 0."""
    from tinytrain.distributed.chunks import ring_neighbours

    assert [ring_neighbours(r, 4) for r in range(4)] == [(1, 3), (2, 0), (3, 1), (0, 2)]
    assert [ring_neighbours(r, 3) for r in range(3)] == [(1, 2), (2, 0), (0, 1)]
    assert ring_neighbours(0, 1) == (0, 0)
