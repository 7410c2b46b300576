"""Gathering what each rank recorded: ``tinytrain.trace.merge()`` (every rank's spans on rank 0,
with our all-gather) and ``comm_matrix`` (every rank's bytes per peer, as one matrix).

``tinytrain.trace`` sits below this package and may not import it, so this module registers the
merge with ``trace.set_merge`` when ``tinytrain.distributed`` is imported. A merged trace ends
with one ``"comm counters"`` record per rank (category ``"counters"``, zero length): the rank's
per-peer byte counters at the merge, ``args["peers"]`` = ``[[group, op, peer, sent, received], ...]``,
so a ``--trace`` file keeps the communication matrix of the run (``viz.comm_matrix_from_trace``).
"""

from __future__ import annotations

import json

import numpy

from tinytrain import trace

from . import stats as _stats
from .algorithms import all_gather
from .group import get_rank, get_world_size, is_initialized


def merge_spans(spans: list[dict], group=None) -> list[dict] | None:
    """Every rank's ``spans`` on rank 0 of ``group`` (in rank order); None on the other ranks."""
    now = trace.now()
    counters = {"name": "comm counters", "cat": "counters", "rank": get_rank() if is_initialized() else 0}
    counters.update(start=now, end=now, args={"peers": _stats.peer_records()})
    spans = [*spans, counters]
    if not is_initialized():
        return spans
    blob = numpy.frombuffer(json.dumps(spans).encode(), dtype=numpy.uint8).copy()
    length = numpy.array([blob.size], dtype=numpy.int64)
    lengths = all_gather(length, group=group)
    everything = all_gather(blob, group=group, sizes=[int(n) for n in lengths])
    if get_rank(group) != 0:
        return None
    merged, offset = [], 0
    for n in lengths:
        merged.extend(json.loads(everything[offset : offset + int(n)].tobytes().decode()))
        offset += int(n)
    return merged


def comm_matrix(stats: _stats.CommStats, op: str | None = None, group: str | None = None) -> numpy.ndarray:
    """The (sender, receiver) matrix of bytes, every world rank's row of ``stats`` (a ``comm_stats``
    block of the same region on every rank), on every rank. Collective: every rank calls it."""
    n = get_world_size()
    row = numpy.zeros(n, dtype=numpy.int64)
    for peer, nbytes in stats.sent_to(op, group).items():
        if peer >= n:
            raise ValueError(
                f"these counters include bytes sent to world rank {peer}, but the world has {n} ranks: "
                "measure a region of this run with comm_stats()"
            )
        row[peer] = nbytes
    return all_gather(row).reshape(n, n)


trace.set_merge(merge_spans)
