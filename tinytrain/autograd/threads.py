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

One pool does it all, matrix products included: NumPy's BLAS runs one thread per call
(``backend.blas_threads(1)``, set when this module loads), and :func:`matmul` cuts a product's
rows (or columns) into one piece per thread, each piece one single-threaded BLAS call. Why not
the BLAS's own threads for the products: after each product they keep spinning on their cores for
a while, waiting for the next one, and a kernel that runs in pieces next (the GELU after a linear,
the attention after q, k, v) then finds its second core taken: the long model's attention took
8.7 ms after a 512³ product instead of 4.1 ms. PyTorch has one pool too: its OpenMP threads run
both its products and its elementwise loops.

How many threads: ``OMP_NUM_THREADS`` when set (the setting PyTorch reads too), else the CPUs
divided among the ranks that the MPI launcher put on this machine (so 4 ranks on 2 cores do not
each start 2 threads: ``mpirun -n 2 tinytrain train --dp 2`` ran 9k tokens/s against 20-30k when
OpenBLAS started its own thread per core in every rank).

On a GPU (CuPy) the kernel runs once on the whole arrays: the device is parallel already. Arrays
smaller than ``MIN_PIECE`` entries per thread run in one piece too, and products of fewer than
``MIN_GEMM`` multiply-adds per thread: handing work to a thread costs some tens of microseconds.

A conversion between dtypes is an elementwise kernel too (:func:`cast`): ``--precision bf16|fp16``
converts every 16-bit activation to float32 where an op computes in float32, and back, and NumPy's
``astype`` runs on one core.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import numpy

from tinytrain.backend import blas_threads, launcher_ranks_here, usable_cores, xp

MIN_PIECE = 1 << 16  # entries per thread below which one thread does it all
MIN_CAST_PIECE = 1 << 16  # entries per thread below which one thread converts (a cast is one light pass)
MIN_GEMM = 1 << 20  # multiply-adds per thread below which one thread does a product


def thread_count() -> int:
    """Threads for elementwise kernels (see the module docstring)."""
    setting = os.environ.get("OMP_NUM_THREADS", "").strip()
    if setting.isdigit() and int(setting) > 0:
        return int(setting)
    return max(1, usable_cores() // launcher_ranks_here())


THREADS = thread_count()
blas_threads(1)  # the products' threads are this module's (see the module docstring)
_pool: list = [None]  # the worker threads (THREADS - 1 of them; the caller is the first), made on first use


def in_pieces(kernel, *arrays, pieces: int | None = None) -> None:
    """Run ``kernel(*pieces)`` on pieces of ``arrays`` cut along their first axis (all have the same
    first axis), one piece per thread, at the same time; returns when every piece is done. The
    kernel writes its results into some of the arrays (``out=``, in place). How many pieces: at
    most ``pieces`` (default: by the first array's size, ``MIN_PIECE`` entries each at least)."""
    rows = arrays[0].shape[0]
    pieces = min(THREADS, rows, arrays[0].size // MIN_PIECE if pieces is None else pieces)
    if xp is not numpy or pieces <= 1:
        kernel(*arrays)
        return
    if _pool[0] is None:
        _pool[0] = ThreadPoolExecutor(THREADS - 1, thread_name_prefix="tinytrain-elementwise")
    bounds = [rows * i // pieces for i in range(pieces + 1)]
    # The caller's floating-point error settings (numpy.errstate) hold for every piece: a thread
    # does not inherit them, and would warn of what the caller ignores, or let pass what it raises.
    errors = numpy.geterr()
    others = [
        _pool[0].submit(_under, errors, kernel, *(a[lo:hi] for a in arrays)) for lo, hi in zip(bounds[1:-1], bounds[2:])
    ]
    kernel(*(a[: bounds[1]] for a in arrays))  # the first piece on this thread
    for done in others:
        done.result()  # waits; re-raises a kernel's error here


def _under(errors: dict, kernel, *pieces) -> None:
    with numpy.errstate(**errors):
        kernel(*pieces)


def matmul(a, b, bias=None):
    """``a @ b (+ bias)`` of 2-D arrays, on every core: the rows of a and of the result cut into
    one piece per thread (the columns of b and of the result where b is the wider), each piece one
    single-threaded BLAS call; ``bias`` (one entry per column) is added to each piece while it is
    still in cache, as a BLAS's C = A·B + C would."""
    (m, k), n = a.shape, b.shape[1]
    out = xp.empty((m, n), dtype=numpy.result_type(a.dtype, b.dtype))
    pieces = m * k * n // MIN_GEMM
    bias = () if bias is None else (bias,)
    if m >= n:
        in_pieces(functools.partial(_product_rows, b=b, bias=bias), a, out, pieces=pieces)
    else:  # b's columns are b.T's rows: cut b.T, out.T (and the bias) along their first axis
        in_pieces(functools.partial(_product_columns, a=a), b.T, out.T, *bias, pieces=pieces)
    return out


def _product_rows(a_rows, out_rows, b, bias):
    xp.matmul(a_rows, b, out=out_rows)
    for column_bias in bias:
        out_rows += column_bias


def _product_columns(b_columns_t, out_columns_t, *bias, a):
    out_columns = out_columns_t.T
    xp.matmul(a, b_columns_t.T, out=out_columns)
    for column_bias in bias:
        out_columns += column_bias


def cast(a, dtype, out=None):
    """``a`` converted to ``dtype`` on every core: into ``out`` (an array of ``a``'s shape) when
    given, else into a new array of ``a``'s layout (C order, or F order for a transposed 2-D view,
    so that the copy reads ``a`` in the order it lies in memory)."""
    if out is None:
        transposed = a.ndim == 2 and a.flags.f_contiguous and not a.flags.c_contiguous
        if transposed:
            return cast(a.T, dtype).T
        out = xp.empty(a.shape, dtype=dtype)
    if a.ndim == 0 or xp is not numpy:
        out[...] = a
        return out
    contiguous = a.flags.c_contiguous and out.flags.c_contiguous
    kernel, lighter = _kernel_for(a.dtype, out.dtype) if contiguous else (_convert, 1)
    in_pieces(kernel, a, out, pieces=a.size // (MIN_CAST_PIECE * lighter))
    return out


def _convert(src, dst):
    dst[...] = src


def _from_bfloat16(src, dst):
    """``dst[...] = src`` (bfloat16 to float32): a bfloat16 is the high half of a float32's bits, so
    its bits shifted up 16 are the float32's, exactly, NaNs included. Why not ``astype``: NumPy
    converts a type registered by a library (ml_dtypes) one entry at a time through its C function,
    about 2.5x the time of these two whole-array integer passes (measured 0.42 against 0.17 ns an entry)."""
    bits = dst.view(numpy.uint32)
    bits[...] = src.view(numpy.uint16)
    bits <<= numpy.uint32(16)


def _to_bfloat16(src, dst):
    """``dst[...] = src`` (float32 to bfloat16, rounded to nearest even, as ml_dtypes rounds) in
    integer passes over the bits, about twice as fast as ``astype`` (see :func:`_from_bfloat16`):
    adding 0x7FFF, plus 1 when the kept half is odd, carries into the kept half exactly when the
    dropped half is past the tie, or at the tie of an odd half. A NaN's carry could turn it into an
    infinity or flip its sign: a piece holding one is converted by ``astype`` instead. The passes run
    over ``BF16_BLOCK`` entries at a time, so that their scratch stays in the core's cache (an 8 M
    entry array in one go: 13.5 ms, slower than astype's 8.3; in blocks: 6.8 ms)."""
    if numpy.isnan(src).any():
        dst[...] = src
        return
    bits, kept = src.reshape(-1).view(numpy.uint32), dst.reshape(-1).view(numpy.uint16)
    scratch = numpy.empty(min(BF16_BLOCK, bits.size), dtype=numpy.uint32)
    for lo in range(0, bits.size, BF16_BLOCK):
        block = bits[lo : lo + BF16_BLOCK]
        rounded = scratch[: block.size]
        numpy.right_shift(block, numpy.uint32(16), out=rounded)
        rounded &= numpy.uint32(1)
        rounded += numpy.uint32(0x7FFF)
        rounded += block
        rounded >>= numpy.uint32(16)
        kept[lo : lo + BF16_BLOCK] = rounded


BF16_BLOCK = 1 << 17  # entries a pass of _to_bfloat16 takes at a time (its scratch: 512 KiB)


_F32_ABS, _F16_TINY = numpy.uint32(0x7FFFFFFF), numpy.uint32(0x38800000 - 1)


def _to_float16(src, dst):
    """``dst[...] = src`` (float32 to float16, rounded to nearest even, as NumPy rounds), fast where
    the result is subnormal. Why: NumPy converts a float32 that becomes a float16 subnormal (0 <
    |x| < 2^-14) and loses bits by raising the floating-point underflow flag, about 25x slower than
    any other entry (measured: 41 ns against 1.6 ns per entry), and activations (GELU's tail,
    small probabilities) and gradients hold such entries, a few per thousand. Those entries are
    made 0 in a copy that NumPy converts at its full speed, then written here: adding 0.5 to |x|
    in float32 rounds |x| to float32's spacing at 0.5, 2^-24, which is float16's subnormal step, so
    the sum's low bits are the float16's bits. Why not ``copyto(..., where=)`` past the tiny
    entries: a masked copy branches entry by entry (5.5 against 2.1 ns an entry on a step's arrays)."""
    bits = src.reshape(-1).view(numpy.uint32)
    tiny = bits & _F32_ABS
    tiny -= numpy.uint32(1)  # zero wraps around to the largest: it is not tiny
    where = numpy.flatnonzero(tiny < _F16_TINY)
    if where.size == 0:
        dst[...] = src
        return
    small = bits[where]
    cleaned = src.copy()
    cleaned.reshape(-1)[where] = 0.0
    dst[...] = cleaned
    half = ((small & _F32_ABS).view(numpy.float32) + numpy.float32(0.5)).view(numpy.uint32) - numpy.uint32(0x3F000000)
    half |= (small >> 16) & numpy.uint32(0x8000)  # the sign
    dst.reshape(-1).view(numpy.uint16)[where] = half


def _from_float16(src, dst):
    """``dst[...] = src`` (float16 to float32, exact) by looking each one up: a float16 has only
    65,536 bit patterns, and a table of their float32s (256 KiB, made once by NumPy's own cast, so
    NaN payloads and subnormals come out as NumPy makes them) stays in the core's cache. Why: NumPy
    converts one entry at a time (1.4 ns an entry); a lookup takes 0.8."""
    # mode="clip": a uint16 is always a valid index, and the default mode buffers ``out``
    numpy.take(_float16_table(), src.reshape(-1).view(numpy.uint16), out=dst.reshape(-1), mode="clip")


@functools.cache
def _float16_table():
    """Every float16 bit pattern's float32: entry i is float16 bits i as float32."""
    return numpy.arange(1 << 16, dtype=numpy.uint32).astype(numpy.uint16).view(numpy.float16).astype(numpy.float32)


# (from, to) dtype names -> (a kernel converting contiguous pieces faster than NumPy's cast, how many
# times MIN_CAST_PIECE a piece of it takes to be worth a thread). The bfloat16 passes are so light that
# handing a piece to the other core costs more than it saves below 2^19 entries down and 2^20 up
# (measured: 2^18 entries down 229 us on one core, 310 us in two pieces; 2^20 up 255 against 359).
_KERNELS = {
    ("float32", "float16"): (_to_float16, 1),
    ("float16", "float32"): (_from_float16, 2),
    ("float32", "bfloat16"): (_to_bfloat16, 8),
    ("bfloat16", "float32"): (_from_bfloat16, 16),
}
_kernels_by_dtype: dict = {}  # (from dtype, to dtype) -> its _KERNELS entry, or _convert's


def _kernel_for(source, target) -> tuple:
    """The (kernel, lightness) of a conversion, from the dtypes themselves: a dtype's ``name`` is
    computed in Python at each ask (2 us, against 50 ns for this dict), and every op of a 16-bit step
    converts."""
    known = _kernels_by_dtype.get((source, target))
    if known is None:
        known = _kernels_by_dtype[(source, target)] = _KERNELS.get((source.name, target.name), (_convert, 1))
    return known
