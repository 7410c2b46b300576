"""Hierarchical all-reduce: fast links inside a node, the slow link between nodes crossed as little as possible.

A flat ring over 2 nodes of 2 ranks (world ranks 0 1 | 2 3) sends every one of its 2(n-1) steps
across the slow link somewhere (1 -> 2 and 3 -> 0), each step a 1/n piece of the buffer N:
2(n-1) inter-node latencies and 2(n-1)/n · N bytes through one rank's inter-node port. Done in three
phases, only the middle one leaves the node, and it carries a 1/local piece of the buffer::

      node 0            node 1
    rank 0  rank 1    rank 2  rank 3      N = [a b]: each rank's buffer, cut into `local` = 2 pieces

    1. reduce-scatter inside each node (ring over the node's ranks)
       rank 0 holds b summed over node 0, rank 1 holds a (rank 2: b over node 1, rank 3: a)
    2. all-reduce of that piece across the nodes, among the ranks that hold the same piece
       (0 <-> 2 for b, 1 <-> 3 for a: every rank uses its own port, at the same time)
    3. all-gather inside each node: every rank ends with [a b] summed over all four

Inter-node cost (α-β, nodes k, ranks per node L, ring in phase 2): 2(k-1) latencies and
2(k-1)/k · N/L bytes per port, against the flat ring's 2(kL-1) and 2(kL-1)/(kL) · N (about L times
the bytes and kL/k times the latencies). The intra-node phases add 2(L-1) fast steps of N/L.

``collectives.all_reduce`` chooses it when an emulated topology (``topology.py``) puts the group on
more than one node with the same number of its ranks on each, more than one per node; ``algo=
"hierarchical"`` asks for it anywhere (on one node it is the node's ring; with one rank per node,
the inter-node all-reduce). Phases 1 and 3 are the ring algorithms of ``algorithms.py``, phase 2
the all-reduce ``choice.choose_all_reduce_algo`` picks for the piece's size, each run over a *view*
of the call (:class:`Ranks`) that renumbers a subset of the group's ranks as 0..m-1.
"""

from __future__ import annotations

from .chunks import chunk_bounds, split_counts


class Ranks:
    """A call (``work.Call``) seen through a subset of its group's ranks, renumbered 0..m-1, so an
    algorithm written for a whole group runs on a node's ranks (or the ranks of one piece) inside
    the same call: same tag, same byte accounting, same deadlines."""

    __slots__ = ("call", "members", "rank", "size", "phase")

    def __init__(self, call, members: list[int], phase: str):
        self.call, self.members, self.phase = call, members, phase
        self.rank, self.size = members.index(call.rank), len(members)

    def scratch(self, count: int, like):
        return self.call.scratch(count, like)

    def exchange(self, what: str, sends=(), recvs=()):
        m = self.members
        return self.call.exchange(
            f"{self.phase}: {what}", [(buf, m[p]) for buf, p in sends], [(buf, m[p]) for buf, p in recvs]
        )


def balanced(nodes: list[list[int]]) -> bool:
    """Does the hierarchical all-reduce apply: more than one node, the same number of the group's
    ranks on each, more than one per node?"""
    return len(nodes) > 1 and len(nodes[0]) > 1 and all(len(ranks) == len(nodes[0]) for ranks in nodes)


def all_reduce_hierarchical(c, flat, op: str, nodes, reduce_scatter, all_gather, inter_all_reduce):
    """All-reduce ``flat`` in place in the three phases of the module docstring.

    ``nodes``: the group ranks on each node (``Topology.nodes_of``), the same number on each;
    ``reduce_scatter``/``all_gather``: the ring algorithms of ``algorithms.py`` (``_ring_reduce_scatter``,
    ``_ring_all_gather``); ``inter_all_reduce(view, piece, op)``: the all-reduce across nodes."""
    if len({len(ranks) for ranks in nodes}) != 1:
        raise ValueError(
            f"hierarchical all_reduce needs the same number of the group's ranks on every node, got "
            f"{[len(ranks) for ranks in nodes]}; use another algo"
        )
    mine = next(ranks for ranks in nodes if c.rank in ranks)
    node = Ranks(c, mine, "intra-node")
    local = node.size
    # phase 1: this rank ends with piece (i + 1) % local of the node's sum (the ring's shift=0)
    bounds = chunk_bounds(split_counts(flat.size, local))
    a, b = bounds[(node.rank + 1) % local]
    if local > 1:
        yield from reduce_scatter(node, flat, bounds, op, shift=0, out=flat[a:b])
    # phase 2: the ranks holding the same piece (the same place in their node) all-reduce it
    if len(nodes) > 1:
        peers = [ranks[node.rank] for ranks in nodes]
        yield from inter_all_reduce(Ranks(c, peers, "inter-node"), flat[a:b], op)
    # phase 3: the finished pieces travel the node's ring
    if local > 1:
        yield from all_gather(node, flat, bounds, shift=0)
