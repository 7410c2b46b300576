"""Elementwise kernels on every core, as PyTorch runs them.

NumPy runs each elementwise operation (``x * y``, ``exp``, ...) on one core; only its BLAS (the
matrix products) uses threads. PyTorch runs both on all cores. So a fused op whose work is
elementwise (GELU, layer norm, softmax) writes its arithmetic as a *kernel* over a piece of rows,
and :func:`in_pieces` cuts the arrays into one piece per thread and runs the kernel on all pieces at
once. The kernel is ordinary NumPy: NumPy lets go of Python's lock inside each operation on an
array, so the threads really run in parallel. Each row stays whole in one piece, so a per-row
reduction (a mean, a max) gives the same numbers in any number of pieces.

    arrays (rows, ...)   ──cut along rows──►   piece 0 → thread 0 (this one)
                                               piece 1 → thread 1
                                               ...        all at once; kernel(piece) writes in place

How many threads: ``OMP_NUM_THREADS`` when set (the setting BLAS and PyTorch read too), else the
CPUs divided among the ranks that the MPI launcher put on this machine (so 4 ranks on 2 cores do
not each start 2 threads). NumPy's BLAS (the matrix products) gets the same share, set when this
module loads (``backend.blas_threads``), unless ``OMP_NUM_THREADS`` or ``OPENBLAS_NUM_THREADS``
chose its pool already: OpenBLAS by itself starts one thread per core in every rank, and 2 ranks
on 2 cores then ran 4 BLAS threads that spin while they wait (``mpirun -n 2 tinytrain train --dp
2``: 9k tokens/s against 20-30k with one BLAS thread per rank).

On a GPU (CuPy) the kernel runs once on the whole arrays: the device is parallel already. Arrays
smaller than ``MIN_PIECE`` entries per thread run in one piece too: handing work to a thread costs
some tens of microseconds.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy

from tinytrain.backend import blas_threads, launcher_ranks_here, usable_cores, xp

MIN_PIECE = 1 << 16  # entries per thread below which one thread does it all


def thread_count() -> int:
    """Threads for elementwise kernels (see the module docstring)."""
    setting = os.environ.get("OMP_NUM_THREADS", "").strip()
    if setting.isdigit() and int(setting) > 0:
        return int(setting)
    return max(1, usable_cores() // launcher_ranks_here())


def blas_thread_count() -> int | None:
    """Threads for the BLAS: :data:`THREADS`, or None where the environment chose them already."""
    if any(os.environ.get(name, "").strip() for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")):
        return None
    return THREADS


THREADS = thread_count()
if blas_thread_count() is not None:
    blas_threads(blas_thread_count())
_pool: list = [None]  # the worker threads (THREADS - 1 of them; the caller is the first), made on first use


def in_pieces(kernel, *arrays) -> None:
    """Run ``kernel(*pieces)`` on pieces of ``arrays`` cut along their first axis (all have the same
    first axis), one piece per thread, at the same time; returns when every piece is done. The
    kernel writes its results into some of the arrays (``out=``, in place)."""
    rows = arrays[0].shape[0]
    pieces = min(THREADS, rows, arrays[0].size // MIN_PIECE)
    if xp is not numpy or pieces <= 1:
        kernel(*arrays)
        return
    if _pool[0] is None:
        _pool[0] = ThreadPoolExecutor(THREADS - 1, thread_name_prefix="tinytrain-elementwise")
    bounds = [rows * i // pieces for i in range(pieces + 1)]
    others = [_pool[0].submit(kernel, *(a[lo:hi] for a in arrays)) for lo, hi in zip(bounds[1:-1], bounds[2:])]
    kernel(*(a[: bounds[1]] for a in arrays))  # the first piece on this thread
    for done in others:
        done.result()  # waits; re-raises a kernel's error here
