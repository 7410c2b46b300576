"""Cutting a flat buffer into chunks, and combining chunks: what every algorithm uses besides ``c.exchange``."""

from __future__ import annotations

import math

import numpy

from tinytrain import backend

OPS = ("sum", "avg", "max", "min", "prod")
_UFUNC = {"sum": "add", "avg": "add", "max": "maximum", "min": "minimum", "prod": "multiply"}


def xp_of(arr):
    """The array module of ``arr`` (NumPy, or CuPy for device arrays)."""
    return numpy if isinstance(arr, numpy.ndarray) else backend.xp


def combine(acc, incoming, op: str, out=None) -> None:
    """out <- acc (op) incoming, elementwise (``out`` defaults to ``acc``: in place); ``"avg"`` adds,
    the caller divides at the end. One pass over memory, no temporary."""
    getattr(xp_of(acc), _UFUNC[op])(acc, incoming, out=acc if out is None else out)


def ring_neighbours(rank: int, size: int) -> tuple[int, int]:
    """(right, left): the ranks after and before ``rank`` on the ring 0 -> 1 -> ... -> size-1 -> 0.
    Every ring algorithm sends to its right neighbour and receives from its left one."""
    return (rank + 1) % size, (rank - 1) % size


def chunk_bounds(counts: list[int]) -> list[tuple[int, int]]:
    """(start, stop) of consecutive pieces with the given lengths."""
    out, start = [], 0
    for n in counts:
        out.append((start, start + n))
        start += n
    return out


def row_bounds(rows: list[int], tail: tuple) -> list[tuple[int, int]]:
    """(start, stop) in a flat buffer of consecutive pieces of ``rows`` rows each, a row of shape ``tail``."""
    row_len = math.prod(int(d) for d in tail)
    return chunk_bounds([r * row_len for r in rows])


def split_counts(length: int, parts: int) -> list[int]:
    """Split ``length`` into ``parts`` nearly equal counts, larger ones first.

    This is how every ring algorithm here chunks a buffer whose length is not divisible by the
    number of ranks: the first ``length % parts`` chunks get one extra element (like
    ``numpy.array_split``). Textbook volumes hold exactly when the length divides evenly; otherwise
    a rank's volume depends on which chunks it happens to send (see the per-algorithm notes).
    """
    q, r = divmod(length, parts)
    return [q + 1 if i < r else q for i in range(parts)]
