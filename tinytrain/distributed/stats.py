"""Byte accounting: how many bytes this rank sent and received, per group and operation.

Every message that :mod:`tinytrain.distributed` posts is counted here when it is posted, under the
name of the group it travels in and the public operation it belongs to (``"all_reduce"``,
``"send"``, ...). A received message is counted with the size of the buffer posted for it; our
collectives always post exactly the size the sender sends, so the two agree.

Use :func:`comm_stats` to measure a region of code::

    with dist.comm_stats() as s:
        dist.all_reduce(x)
    s.sent("all_reduce")     # bytes this rank sent for all_reduce calls inside the block
    s.recv(group="tp")       # bytes received in the group named "tp", any operation

The counters only grow; a ``comm_stats`` block reports the difference between its end and its
start, so blocks may nest.

Bytes are also counted per peer (the world rank at the other end), so a region has a
communication matrix: ``s.sent_to()`` is this rank's row, {peer: bytes}; ``comm_matrix(s)`` in
``trace_merge.py`` gathers every rank's row into the (sender, receiver) matrix, and a merged trace
carries each rank's per-peer counters (a ``"comm counters"`` record, see ``peer_records``).
Under an emulated topology (``topology.py``) ``s.by_link()`` says which link the bytes crossed:
``{"node0": 4096, "node0->node1": 1024}``.
"""

from __future__ import annotations

import contextlib

# (group name, op name, peer's world rank) -> [bytes sent to it, bytes received from it,
# messages sent to it, messages received from it]. One row per peer is all a message touches; the
# per-(group, op) totals are summed from these rows when asked for.
_by_peer: dict[tuple[str, str, int], list[int]] = {}


def _row(group: str, op: str, peer: int) -> list[int]:
    row = _by_peer.get((group, op, peer))
    if row is None:
        row = _by_peer[(group, op, peer)] = [0, 0, 0, 0]
    return row


def count_send(group: str, op: str, nbytes: int, peer: int) -> None:
    """Count one posted send of ``nbytes`` bytes to world rank ``peer``."""
    row = _row(group, op, peer)
    row[0] += nbytes
    row[2] += 1


def count_recv(group: str, op: str, nbytes: int, peer: int) -> None:
    """Count one posted receive of ``nbytes`` bytes from world rank ``peer``."""
    row = _row(group, op, peer)
    row[1] += nbytes
    row[3] += 1


def snapshot() -> dict[tuple[str, str], tuple[int, int, int, int]]:
    """Totals per (group, op): (bytes sent, bytes received, messages sent, messages received)."""
    rows: dict[tuple[str, str], list[int]] = {}
    for (group, op, _), counts in _by_peer.items():
        row = rows.setdefault((group, op), [0, 0, 0, 0])
        for i, n in enumerate(counts):
            row[i] += n
    return {key: tuple(row) for key, row in rows.items()}


def peer_snapshot() -> dict[tuple[str, str, int], tuple[int, int]]:
    """A copy of the per-peer counters: (group, op, peer world rank) -> (bytes sent, bytes received)."""
    return {key: (row[0], row[1]) for key, row in _by_peer.items()}


def peer_records(peers: dict | None = None) -> list[list]:
    """Per-peer counters as JSON-ready rows ``[group, op, peer, sent, received]`` (default: all so far)."""
    peers = peer_snapshot() if peers is None else peers
    return [[g, o, p, s, r] for (g, o, p), (s, r) in sorted(peers.items())]


def _delta(after: dict, before: dict) -> dict:
    """The rows of ``after`` that grew since ``before``, by how much."""
    out = {}
    for key, row in after.items():
        old = before.get(key, (0,) * len(row))
        delta = tuple(a - b for a, b in zip(row, old))
        if any(delta):
            out[key] = delta
    return out


class CommStats:
    """The bytes counted between two snapshots, with small query helpers."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], tuple[int, int, int, int]] = {}
        self.peers: dict[tuple[str, str, int], tuple[int, int]] = {}

    def _sum(self, column: int, op: str | None, group: str | None) -> int:
        return sum(
            row[column]
            for (g, o), row in self.rows.items()
            if (op is None or o == op) and (group is None or g == group)
        )

    def sent(self, op: str | None = None, group: str | None = None) -> int:
        """Bytes sent, optionally only for one operation and/or one group name."""
        return self._sum(0, op, group)

    def recv(self, op: str | None = None, group: str | None = None) -> int:
        """Bytes received, optionally only for one operation and/or one group name."""
        return self._sum(1, op, group)

    def messages(self, op: str | None = None, group: str | None = None) -> int:
        """Messages sent."""
        return self._sum(2, op, group)

    def sent_to(self, op: str | None = None, group: str | None = None, received: bool = False) -> dict[int, int]:
        """{peer world rank: bytes sent to it} (``received=True``: bytes received from it), optionally
        only for one operation and/or group: this rank's row of the communication matrix."""
        row: dict[int, int] = {}
        for (g, o, peer), counts in self.peers.items():
            if (op is None or o == op) and (group is None or g == group):
                row[peer] = row.get(peer, 0) + counts[1 if received else 0]
        return {peer: n for peer, n in sorted(row.items()) if n}

    def by_link(self, op: str | None = None, topology=None, me: int | None = None) -> dict[str, int]:
        """Bytes sent per link of an emulated topology (default: the active one, ``topology.py``):
        ``{"node0": bytes inside node 0, "node0->node1": bytes to node 1}``, this rank's sends
        (``me``: its world rank, default the world group's rank), optionally of one operation only.
        Worked out from the per-peer counters, so counting costs nothing more per message."""
        from . import group
        from . import topology as topologies

        links = topologies.active if topology is None else topology
        if links is None:
            raise ValueError("by_link needs an emulated topology: set TINYTRAIN_TOPOLOGY=2x2 or pass topology=")
        me = group.world().rank if me is None else me
        out: dict[str, int] = {}
        for peer, nbytes in self.sent_to(op).items():
            name = links.link(me, peer)
            out[name] = out.get(name, 0) + nbytes
        return out

    def table(self) -> str:
        """A small text table, one line per (group, op)."""
        lines = [f"{'group':<16}{'op':<16}{'sent':>14}{'recv':>14}{'msgs':>8}"]
        for (g, o), (s, r, m, _) in sorted(self.rows.items()):
            lines.append(f"{g:<16}{o:<16}{s:>14}{r:>14}{m:>8}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"CommStats(sent={self.sent()}, recv={self.recv()})"


@contextlib.contextmanager
def comm_stats():
    """Count the bytes sent and received inside the ``with`` block (see module docstring)."""
    before, peers_before = snapshot(), peer_snapshot()
    stats = CommStats()
    try:
        yield stats
    finally:
        stats.rows = _delta(snapshot(), before)
        stats.peers = _delta(peer_snapshot(), peers_before)


def totals() -> CommStats:
    """Everything counted since the process started."""
    stats = CommStats()
    stats.rows, stats.peers = snapshot(), peer_snapshot()
    return stats
