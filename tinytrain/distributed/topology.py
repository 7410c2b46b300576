"""An emulated cluster on one machine: ranks grouped into nodes, a slow link out of every node.

On one machine every pair of ranks talks through shared memory at the same speed, so no run can
show why tensor parallelism across nodes is slow. ``TINYTRAIN_TOPOLOGY=2x2`` pretends otherwise:
4 ranks as 2 nodes of 2, and a message between nodes is held back in the point-to-point layer
(``p2p.Exchange``) as a link of the inter-node bandwidth and latency would deliver it. Inside a node
nothing changes. It is an **emulation**: the bytes still move through shared memory, only later.
Off by default (and then it costs one attribute test per message).

Placement, as launchers place ranks::

    TINYTRAIN_TOPOLOGY=2x2                     TINYTRAIN_PLACEMENT=cyclic
    (consecutive ranks share a node:           (round-robin, mpirun --map-by node)
     mpirun's default)
      node 0: ranks 0 1 | node 1: ranks 2 3      node 0: ranks 0 2 | node 1: ranks 1 3

The link model (the planner's ``Cluster``: one inter-node port per GPU). Every rank has its own
port out of its node. A message from rank r to a rank on another node enters r's port when the
port is free (it carries one message at a time: a second waits for the first to arrive) and
arrives ``latency + bytes / bandwidth`` later; only then is it handed to MPI, which adds shared
memory's own time (about a tenth). The receiving side is not modelled (a port receives from any
number of senders at once). A held send is handed to MPI by the first poll after its arrival
time, the poll of any step or handle on this rank (``p2p.post_held``): a pipeline stage that sent an
activation and now waits for a gradient still delivers it. A rank that computes without polling
hands it over late, as any async collective of it moves only when polled.

Settings (read when ``tinytrain.distributed`` is imported; ``install`` replaces them in a program):

    TINYTRAIN_TOPOLOGY=NxR           N nodes of R ranks (the run must have N·R ranks)
    TINYTRAIN_INTER_GBPS=1           inter-node bandwidth per port, GB/s (10^9 bytes)
    TINYTRAIN_INTER_LATENCY_US=100   inter-node latency, microseconds
    TINYTRAIN_PLACEMENT=block|cyclic which node a rank is on (block: the default)

The defaults make an inter-node link about 10x slower than this machine's shared memory: our
``send``/``recv`` between two ranks took 7 us one way for 8 bytes and moved 10-11 GB/s at 1-4 MiB
(2 ranks; with 4 ranks on the 2 cores, 16-30 us and 6-9 GB/s), so 100 us and 1 GB/s. The
deadlines and the peer-failure side channel of ``watchdog.py`` work as before: a held message is
a message not yet complete, so a wait for it times out and sees a failed peer.
"""

from __future__ import annotations

import os
import re
import time

from tinytrain.env import positive_number

from ._mpi import MPI

DEFAULT_INTER_GBPS = 1.0
DEFAULT_INTER_LATENCY_US = 100.0
PLACEMENTS = ("block", "cyclic")


class Topology:
    """``nodes`` nodes of ``per_node`` ranks; ``inter_bw`` bytes/s and ``inter_latency`` seconds per
    inter-node port; ``placement`` "block" (consecutive ranks per node) or "cyclic" (round-robin)."""

    def __init__(
        self,
        nodes: int,
        per_node: int,
        inter_bw: float = DEFAULT_INTER_GBPS * 1e9,
        inter_latency: float = DEFAULT_INTER_LATENCY_US * 1e-6,
        placement: str = "block",
    ):
        if nodes < 1 or per_node < 1:
            raise ValueError(f"a topology needs at least 1 node of 1 rank, got {nodes}x{per_node}")
        if not inter_bw > 0 or not inter_latency >= 0:
            raise ValueError(
                f"inter-node bandwidth must be positive, latency at least 0: got {inter_bw}, {inter_latency}"
            )
        if placement not in PLACEMENTS:
            raise ValueError(f"placement is one of {', '.join(PLACEMENTS)}, got {placement!r}")
        self.nodes, self.per_node, self.placement = int(nodes), int(per_node), placement
        self.inter_bw, self.inter_latency = float(inter_bw), float(inter_latency)
        self.size = self.nodes * self.per_node
        self.node = [self._place(r) for r in range(self.size)]  # world rank -> node
        self.port_free_at = 0.0  # perf_counter time at which this rank's port is free again
        self._layouts: dict = {}

    def _place(self, rank: int) -> int:
        return rank // self.per_node if self.placement == "block" else rank % self.nodes

    def __repr__(self) -> str:
        return (
            f"Topology({self.nodes}x{self.per_node}, {self.placement}, inter-node "
            f"{self.inter_bw / 1e9:g} GB/s, {self.inter_latency * 1e6:g} us)"
        )

    def link(self, src: int, dst: int) -> str:
        """The link a message from world rank ``src`` to ``dst`` crosses: "node0" inside node 0,
        "node0->node1" between nodes."""
        a, b = self.node[src], self.node[dst]
        return f"node{a}" if a == b else f"node{a}->node{b}"

    def arrival(self, nbytes: int) -> float:
        """When (``time.perf_counter``) a message of ``nbytes`` sent now from this rank to another
        node arrives: after the messages already on this rank's port, latency + bytes/bandwidth."""
        start = max(time.perf_counter(), self.port_free_at)
        self.port_free_at = start + self.inter_latency + nbytes / self.inter_bw
        return self.port_free_at

    def nodes_of(self, world_ranks: tuple[int, ...]) -> list[list[int]]:
        """The group ranks of a group (its members' world ranks) on each node, nodes that hold some
        in ascending order; kept per group."""
        layout = self._layouts.get(world_ranks)
        if layout is None:
            by_node: dict[int, list[int]] = {}
            for i, w in enumerate(world_ranks):
                by_node.setdefault(self.node[w], []).append(i)
            layout = self._layouts[world_ranks] = [by_node[k] for k in sorted(by_node)]
        return layout

    def check_world(self, size: int) -> None:
        if size != self.size:
            raise ValueError(
                f"TINYTRAIN_TOPOLOGY={self.nodes}x{self.per_node} describes {self.size} ranks but this run has "
                f"{size}: run mpirun -n {self.size}, or set TINYTRAIN_TOPOLOGY to nodes x ranks per node of {size}"
            )


active: Topology | None = None  # the emulated topology, or None (off: p2p tests only this)


def install(topology: Topology | None) -> Topology | None:
    """Make ``topology`` the emulated one (None: off); returns the one it replaces."""
    global active
    if topology is not None:
        topology.check_world(MPI.COMM_WORLD.Get_size())
    previous, active = active, topology
    return previous


def from_env() -> Topology | None:
    """The topology the environment asks for (see the module docstring), or None."""
    text = os.environ.get("TINYTRAIN_TOPOLOGY", "").strip()
    if not text:  # its link settings alone would be ignored: say so
        stray = [
            n for n in ("TINYTRAIN_INTER_GBPS", "TINYTRAIN_INTER_LATENCY_US", "TINYTRAIN_PLACEMENT") if n in os.environ
        ]
        if stray:
            raise ValueError(
                f"{stray[0]} sets the emulated cluster of TINYTRAIN_TOPOLOGY, which is unset: set "
                "TINYTRAIN_TOPOLOGY=NxR (N nodes of R ranks), or unset " + " and ".join(stray)
            )
        return None
    match = re.fullmatch(r"(\d+)x(\d+)", text)
    if not match or min(int(match[1]), int(match[2])) < 1:
        raise ValueError(
            f"TINYTRAIN_TOPOLOGY={text!r} is not a setting it takes: nodes x ranks per node, such as 2x2, "
            "or leave it unset"
        )
    placement = os.environ.get("TINYTRAIN_PLACEMENT", "").strip() or "block"
    if placement not in PLACEMENTS:
        raise ValueError(f"TINYTRAIN_PLACEMENT={placement!r} is not a setting it takes: block or cyclic")
    return Topology(
        int(match[1]),
        int(match[2]),
        positive_number("TINYTRAIN_INTER_GBPS", DEFAULT_INTER_GBPS, "(GB/s)") * 1e9,
        positive_number("TINYTRAIN_INTER_LATENCY_US", DEFAULT_INTER_LATENCY_US, "(microseconds)") * 1e-6,
        placement,
    )
