"""Argument checks of the public collectives: early, specific errors that say what to change."""

from __future__ import annotations

import numpy

from .chunks import OPS, xp_of
from .p2p import check_buffer


def check_op(op: str, dtype) -> str:
    if op not in OPS:
        raise ValueError(f"op={op!r} is not one of {', '.join(OPS)}")
    if op == "avg" and not numpy.issubdtype(numpy.dtype(dtype), numpy.floating):
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
    sizes = [int(s) for s in sizes]
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
