"""Argument checks of the public collectives: early, specific errors that say what to change.

Besides the checks of single arguments (``op``, ``algo``, a root rank, an ``out=`` buffer), the row
counts of the collectives that join or split along axis 0 are settled here: :func:`gather_sizes`
(all_gather), :func:`split_sizes` (reduce_scatter), :func:`all_to_all_sizes`, and the ``full``
buffer of a scatter (:func:`check_scatter_full`).
"""

from __future__ import annotations

import numpy

from tinytrain.backend import is_low_precision

from .chunks import OPS, xp_of
from .p2p import check_buffer


def check_op(op: str, dtype) -> str:
    if op not in OPS:
        raise ValueError(f"op={op!r} is not one of {', '.join(OPS)}")
    # ml_dtypes' bfloat16 is no numpy.floating subtype, but it divides as floats do (--precision bf16)
    if op == "avg" and not (numpy.issubdtype(numpy.dtype(dtype), numpy.floating) or is_low_precision(dtype)):
        raise ValueError(f"op='avg' needs a floating dtype, got {dtype}; use op='sum' and divide yourself")
    return op


def check_algo(op: str, algo, choices: tuple[str, ...], default: str) -> str:
    if algo is None:
        return default
    if algo not in choices:
        raise ValueError(f"{op}: algo={algo!r} is not one of {', '.join(choices)}")
    return algo


def check_root(g, root: int, role: str) -> int:
    if not 0 <= int(root) < g.size:
        raise ValueError(f"{role}={root} is not a rank of {g.describe()} (valid: 0..{g.size - 1})")
    return int(root)


def rows_of(x) -> tuple[int, tuple]:
    """(length of axis 0, shape of one row); a 0-d array counts as one row."""
    shape = tuple(x.shape) or (1,)
    return shape[0], shape[1:]


def signature(x, **extra) -> dict:
    return dict(shape=list(x.shape), dtype=str(x.dtype), **extra)


def check_sizes(g, sizes, what: str) -> list[int]:
    try:
        sizes = [int(s) for s in sizes]
    except (TypeError, ValueError):
        raise ValueError(
            f"{what}: sizes needs one non-negative row count per rank of {g.describe()}, got {sizes!r}"
        ) from None
    if len(sizes) != g.size or min(sizes, default=0) < 0:
        raise ValueError(f"{what}: sizes needs one non-negative row count per rank of {g.describe()}, got {sizes}")
    return sizes


def check_out(out, shape, dtype, what: str):
    if out is None:
        return None
    check_buffer(out, f"{what} (out)", writable=True)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise ValueError(
            f"{what}: out must have shape {tuple(shape)} and dtype {dtype}, got {tuple(out.shape)} {out.dtype}"
        )
    return out


def new_out(out, tensor, shape):
    return xp_of(tensor).empty(shape, dtype=tensor.dtype) if out is None else out


def gather_sizes(g, sizes, rows: int, what: str) -> list[int]:
    """Rows per rank of a gathered buffer: ``rows`` each, or ``sizes``, whose entry for this rank
    must be this rank's ``rows``."""
    sizes = [rows] * g.size if sizes is None else check_sizes(g, sizes, what)
    if sizes[g.rank] != rows:
        raise ValueError(f"{what}: sizes[{g.rank}]={sizes[g.rank]} but this rank's tensor has {rows} rows")
    return sizes


def split_sizes(g, sizes, rows: int, what: str) -> list[int]:
    """Rows per rank of a buffer of ``rows`` rows split over the group: equal, or ``sizes``."""
    if sizes is None:
        if rows % g.size:
            raise ValueError(
                f"{what}: {rows} rows do not split evenly over {g.size} ranks; "
                "pass sizes=[rows for each rank] (e.g. split_counts(rows, n))"
            )
        return [rows // g.size] * g.size
    sizes = check_sizes(g, sizes, what)
    if sum(sizes) != rows:
        raise ValueError(f"{what}: sizes {sizes} add up to {sum(sizes)}, but the tensor has {rows} rows")
    return sizes


def all_to_all_sizes(g, rows: int, send_sizes, recv_sizes) -> tuple[list[int], list[int] | None]:
    """(rows sent to each rank, rows received from each rank or None when they must be exchanged)."""
    if send_sizes is None:
        if rows % g.size:
            raise ValueError(f"all_to_all: {rows} rows do not split evenly over {g.size} ranks; pass send_sizes")
        send_sizes = [rows // g.size] * g.size
        recv_sizes = send_sizes if recv_sizes is None else recv_sizes
    send_sizes = check_sizes(g, send_sizes, "all_to_all (send_sizes)")
    if sum(send_sizes) != rows:
        raise ValueError(
            f"all_to_all: send_sizes {send_sizes} add up to {sum(send_sizes)}, but the tensor has {rows} rows"
        )
    if recv_sizes is not None:
        recv_sizes = check_sizes(g, recv_sizes, "all_to_all (recv_sizes)")
    return send_sizes, recv_sizes


def check_scatter_full(g, root: int, full, tensor) -> None:
    """On the source rank, ``full`` must be n pieces of ``tensor``'s shape stacked along axis 0."""
    if g.rank != root:
        return
    if full is None:
        raise ValueError(f"scatter: rank {root} is the source and must pass full=")
    check_buffer(full, "scatter (full)")
    rows, tail = rows_of(tensor)
    want = (rows * g.size,) + tail
    if tuple(full.shape) != want or full.dtype != tensor.dtype:
        raise ValueError(
            f"scatter: full must have shape {want} and dtype {tensor.dtype} "
            f"(n pieces of tensor's shape), got {tuple(full.shape)} {full.dtype}"
        )
