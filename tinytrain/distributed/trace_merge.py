"""``tinytrain.trace.merge()`` across ranks: every rank's spans gathered on rank 0 with our all-gather.

``tinytrain.trace`` sits below this package and may not import it, so this module registers the
merge with ``trace.set_merge`` when ``tinytrain.distributed`` is imported.
"""

from __future__ import annotations

import json

import numpy

from tinytrain import trace

from .algorithms import all_gather
from .group import get_rank, is_initialized


def merge_spans(spans: list[dict], group=None) -> list[dict] | None:
    """Every rank's ``spans`` on rank 0 of ``group`` (in rank order); None on the other ranks."""
    if not is_initialized():
        return list(spans)
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


trace.set_merge(merge_spans)
