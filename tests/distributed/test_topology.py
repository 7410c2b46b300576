"""The emulated topology (``distributed/topology.py``) and the hierarchical all-reduce on it.

Run under ``mpirun -n 4``: 2 nodes of 2 ranks. Correctness runs use a fast emulated link (the
delay is not what they check); the timing tests a slow one whose delays dwarf shared memory's.
"""

import time

import numpy as np
import pytest

from tinytrain import distributed as dist
from tinytrain import trace
from tinytrain.distributed import topology
from tinytrain.distributed._mpi import MPI
from tinytrain.distributed.mesh import axis_groups

MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX}
LENGTHS = [0, 1, 3, 1001, 20_011, 70_001]  # empty, fewer elements than ranks, odd, and past the size switches


@pytest.fixture
def emulated():
    """``emulated(...)`` installs a Topology for the test; the one before comes back afterwards."""
    before = []

    def use(nodes=2, per_node=2, gbps=100.0, latency_us=0.0, placement="block"):
        t = topology.Topology(nodes, per_node, gbps * 1e9, latency_us * 1e-6, placement)
        before.append(topology.install(t))
        return t

    yield use
    if before:
        topology.install(before[0])


def test_the_topology_is_off_by_default():
    assert topology.active is None
    assert topology.from_env() is None  # TINYTRAIN_TOPOLOGY is not set in the suite


@pytest.mark.parametrize(
    "variable,value,says",
    [
        ("TINYTRAIN_TOPOLOGY", "2by2", "nodes x ranks per node, such as 2x2"),
        ("TINYTRAIN_TOPOLOGY", "0x4", "nodes x ranks per node"),
        ("TINYTRAIN_INTER_GBPS", "fast", "a positive number (GB/s)"),
        ("TINYTRAIN_INTER_LATENCY_US", "-3", "a positive number (microseconds)"),
        ("TINYTRAIN_PLACEMENT", "random", "block or cyclic"),
    ],
)
def test_a_bad_topology_setting_is_one_sentence(monkeypatch, variable, value, says):
    monkeypatch.setenv("TINYTRAIN_TOPOLOGY", "2x2")
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=f"{variable}={value!r}.*{says}".replace("(", r"\(").replace(")", r"\)")):
        topology.from_env()


def test_a_topology_for_another_world_size_says_how_many_ranks():
    t = topology.Topology(2, 2)
    with pytest.raises(ValueError, match="describes 4 ranks but this run has 3: run mpirun -n 4"):
        t.check_world(3)


def test_placement_is_the_launchers():
    assert topology.Topology(2, 2).node == [0, 0, 1, 1]  # consecutive ranks per node
    assert topology.Topology(2, 2, placement="cyclic").node == [0, 1, 0, 1]  # mpirun --map-by node
    assert topology.Topology(2, 4).link(3, 4) == "node0->node1"
    assert topology.Topology(2, 4).link(4, 7) == "node1"


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (2, 4)])
def test_the_mesh_keeps_tensor_parallel_groups_inside_a_node(nodes, per_node):
    """Every mesh a plan builds ({dp, pp, ep, cp, tp}, TP innermost) with TP no larger than a node:
    each TP group on one node; a group larger than a node spans whole nodes only."""
    t = topology.Topology(nodes, per_node)
    world = nodes * per_node
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4):
            if world % (tp * pp):
                continue
            shape = {"dp": world // (tp * pp), "pp": pp, "ep": 1, "cp": 1, "tp": tp}
            for members in axis_groups(shape, "tp"):
                on = {t.node[r] for r in members}
                if tp <= per_node:
                    assert len(on) == 1, (shape, members)
                else:
                    assert len(on) == tp // per_node, (shape, members)


@pytest.mark.world_size(4)
def test_the_mesh_of_dp2_tp2_puts_tp_on_one_node_and_dp_across(emulated):
    t = emulated()
    mesh = dist.DeviceMesh({"dp": 2, "tp": 2})
    assert len({t.node[r] for r in mesh.get_group("tp").world_ranks}) == 1
    assert len({t.node[r] for r in mesh.get_group("dp").world_ranks}) == 2


def _random(rng, n, dtype):
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-1000, 1000, size=n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def _algo_of_last_all_reduce() -> str:
    return next(s["args"]["algo"] for s in reversed(trace.spans()) if s["name"] == "all_reduce")


@pytest.mark.world_size(4)
@pytest.mark.parametrize("placement", ["block", "cyclic"])
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_hierarchical_all_reduce_matches_mpi_and_is_chosen_across_nodes(emulated, placement, op):
    emulated(placement=placement)
    world = dist.world()
    rng = np.random.default_rng([dist.get_rank(), len(op), len(placement)])
    trace.clear()
    trace.enable()
    try:
        for dtype in (np.float32, np.float64, np.int64):
            if op == "avg" and dtype == np.int64:
                continue
            for n in LENGTHS:
                x = _random(rng, n, dtype)
                ref = np.empty_like(x)
                world.comm.Allreduce(x, ref, op=MPI_OPS[op])
                if op == "avg":
                    ref /= 4
                ours = x.copy()
                dist.all_reduce(ours, op=op)
                assert _algo_of_last_all_reduce() == "hierarchical"
                if np.issubdtype(dtype, np.integer):
                    np.testing.assert_array_equal(ours, ref)
                else:
                    tol = 1e-4 if dtype == np.float32 else 1e-10
                    np.testing.assert_allclose(ours, ref, rtol=tol, atol=tol)
                everyone = np.empty((4, n), dtype=dtype)
                world.comm.Allgather(ours, everyone)
                assert (everyone == ours).all()  # bit-identical on every rank
    finally:
        trace.enable(False)
        trace.clear()


@pytest.mark.world_size(4)
def test_groups_the_hierarchy_does_not_fit_run_flat(emulated):
    """3 ranks (2 on node 0, 1 on node 1) and one rank per node: the size-chosen algorithms, same result."""
    emulated()
    r = dist.get_rank()
    three, pairs = dist.new_group([0, 1, 2], name="three"), dist.new_group([r % 2, r % 2 + 2], name=f"pair{r % 2}")
    trace.clear()
    trace.enable()
    try:
        for g, members in ((three, [0, 1, 2]), (pairs, [r % 2, r % 2 + 2])):
            if r not in members:
                continue
            x = np.arange(1001, dtype=np.float64) * (r + 1)
            dist.all_reduce(x, group=g)
            assert _algo_of_last_all_reduce() != "hierarchical"
            np.testing.assert_allclose(x, np.arange(1001) * sum(m + 1 for m in members))
    finally:
        trace.enable(False)
        trace.clear()


@pytest.mark.world_size(4)
def test_a_message_between_nodes_arrives_as_the_link_delivers_it(emulated):
    """30 ms + 100 KB at 10 MB/s = 40 ms across; inside a node as fast as shared memory; two messages
    on one port one after the other (80 ms), while another rank's port carries its own at once."""
    emulated(gbps=0.01, latency_us=30_000)
    r, world = dist.get_rank(), dist.world()
    x = np.ones(100_000 // 8)
    one = 0.030 + 100_000 / 1e7
    world.comm.Barrier()  # MPI's own: not delayed
    start = time.perf_counter()
    if r == 0:
        back = dist.irecv(np.empty_like(x), 1)  # posted first: rank 1's message inside the node needs no wait
        handles = [dist.isend(x, 2), dist.isend(x, 3)]  # one port: the second waits for the first
        for h in handles:
            h.wait()
        assert time.perf_counter() - start >= 2 * one
        back.wait()
    elif r == 1:
        dist.send(x, 2)  # its own port, at the same time as rank 0's first
        crossed = time.perf_counter() - start
        assert one <= crossed < 2 * one, crossed
        start = time.perf_counter()
        dist.send(x, 0)  # inside node 0
        assert time.perf_counter() - start < one / 2
    elif r == 2:
        for h in [dist.irecv(np.empty_like(x), 0), dist.irecv(np.empty_like(x), 1)]:
            h.wait()
    else:
        dist.recv(np.empty_like(x), 0)  # rank 0's second message
        assert time.perf_counter() - start >= 2 * one - 0.005


@pytest.mark.world_size(4)
@pytest.mark.parametrize("algo,inter,intra", [("ring", 1.5, 1.5), ("hierarchical", 0.5, 1.0)])
def test_byte_counters_and_traces_say_which_link_a_message_crossed(emulated, algo, inter, intra):
    """Bytes each rank sends per link, against the formulas (N: the buffer): the flat ring 2(n-1)/n N,
    on rank 1 and 3 all across (each sends to r+1); hierarchical: 2(L-1)/L N inside the node and
    2(k-1)/k N/L across, on every rank."""
    emulated()
    r = dist.get_rank()
    n_bytes = 4 * 4096
    trace.clear()
    trace.enable()
    try:
        with dist.comm_stats() as s:
            dist.all_reduce(np.ones(4096, dtype=np.float32), algo=algo)
        links = s.by_link(op="all_reduce")
        node = r // 2
        across, inside = f"node{node}->node{1 - node}", f"node{node}"
        if algo == "ring":
            expected = {across: inter * n_bytes} if r % 2 else {inside: intra * n_bytes}
        else:
            expected = {across: inter * n_bytes, inside: intra * n_bytes}
        assert links == expected
        on_link = [sp for sp in trace.spans() if sp["cat"] == "link" and sp["args"]["op"] == "all_reduce"]
        assert sum(sp["args"]["bytes"] for sp in on_link) == links.get(across, 0)
        assert all(sp["name"] == across for sp in on_link)
        steps = [sp for sp in trace.spans() if sp["cat"] == "comm.step" and sp["name"] == "all_reduce"]
        talked = set(s.sent_to("all_reduce")) | set(s.sent_to("all_reduce", received=True))
        t = topology.active
        assert {name for sp in steps for name in sp["args"]["link"]} == {t.link(r, p) for p in talked}
    finally:
        trace.enable(False)
        trace.clear()
