"""The one place that chooses the array library: NumPy on the CPU, CuPy on an NVIDIA GPU.

Everything else in tinytrain writes ``from tinytrain.backend import xp`` and calls ``xp.matmul``,
``xp.exp`` and so on; no other module imports cupy. The choice is made once, at import time, from
the environment variable ``TINYTRAIN_DEVICE``:

    cpu     NumPy (the default when no GPU is usable)
    gpu     CuPy; a missing CuPy or an unusable GPU is a clear error, never a CUDA traceback
    auto    CuPy when ``cupy.cuda.is_available()``, else NumPy          (the default setting)
    strict  the strict stand-in for CuPy (``strict.py``): every GPU code path below runs, on NumPy
            numbers, and host<->device copies must be explicit; for CI, which has no GPU

On a device (``gpu`` or ``strict``) arrays live in device memory: ``to_host`` copies them back,
``synchronize`` waits for queued work, and MPI gets device memory only through
:func:`device_buffer` (see ``tinytrain.distributed.p2p`` for when it is staged through the host).

Under MPI, each rank on a node gets its own GPU: ``tinytrain.distributed.init()`` calls
:func:`select_device_for_rank` with the rank's *local* rank (its rank among the ranks on the same
node), which uses GPU ``local_rank % number_of_gpus``. ``TINYTRAIN_GPU=<index>`` overrides that:
every rank of the process uses GPU ``<index>`` (of those ``CUDA_VISIBLE_DEVICES`` leaves visible).
On the CPU all of this is a no-op.
"""

from __future__ import annotations

import os

import numpy

from tinytrain.launcher import usable_cores  # noqa: F401 - the backend's callers ask it here

_CHOICES = ("cpu", "gpu", "auto", "strict")


class BackendError(RuntimeError):
    """The requested device cannot be used."""


def gpu_for_rank(local_rank: int, count: int) -> int:
    """The GPU index for node-local rank ``local_rank`` among ``count`` GPUs.

    ``local_rank % count``, unless ``TINYTRAIN_GPU`` is set: then that index, on every rank.
    """
    override = os.environ.get("TINYTRAIN_GPU", "").strip()
    if override:
        if not override.isdigit() or int(override) >= count:
            raise BackendError(
                f"TINYTRAIN_GPU={override!r} is not a GPU index of this machine (0..{count - 1}); "
                "unset it to give each rank its own GPU."
            )
        return int(override)
    return local_rank % count


def _launcher_local_rank() -> int:
    """The node-local rank the MPI launcher put in the environment (``tinytrain.launcher``), else 0."""
    from tinytrain import launcher

    return launcher.local_rank() or 0


def launcher_ranks_here() -> int:
    """How many ranks the MPI launcher started on this machine (``tinytrain.launcher``), else 1."""
    from tinytrain import launcher

    return launcher.ranks_here()


def host_memory_available() -> int | None:
    """Bytes of host memory new arrays can still get without swapping, for all the processes of this
    machine together: ``MemAvailable`` of /proc/meminfo (Linux), else the free pages the OS reports
    (``os.sysconf``), else None (unknown). Divide by :func:`launcher_ranks_here` for one rank's share."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # in kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def blas_threads(limit: int | None = None) -> int | None:
    """The threads of the OpenBLAS that NumPy loaded (its wheels bundle one), after setting them to
    ``limit`` when given; None where this process has no OpenBLAS to ask (another BLAS, a system
    without ``/proc``: there only ``OMP_NUM_THREADS``, set before the program starts, decides).

    OPENBLAS_NUM_THREADS is read once, when NumPy loads the library; the library's own call
    changes its pool at any time after, which is what a program that has imported NumPy needs."""
    lib = _openblas()
    if lib is None:
        return None
    if limit is not None:
        lib["set_num_threads"](int(limit))
    return int(lib["get_num_threads"]())


def blas_kernel() -> str | None:
    """The CPU kernels the OpenBLAS that NumPy loaded runs (``Haswell``, ``SkylakeX``, ``Zen``...),
    or None where there is no OpenBLAS to ask. A build for many CPUs picks them when it loads, from
    the CPU, unless ``OPENBLAS_CORETYPE`` names others: on a CPU with AVX-512, ``Haswell`` kernels
    run its products at about half the speed (``tinytrain bench step`` says so when it sees it)."""
    lib = _openblas()
    name = lib and lib.get("get_corename")
    return name().decode() if name else None


def _openblas() -> dict | None:
    """``set_num_threads``, ``get_num_threads`` and ``get_corename`` of the loaded OpenBLAS (its
    symbols carry the prefix and suffix of the build: ``scipy_openblas_set_num_threads64_`` in
    NumPy's wheels), or None."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in ("scipy_openblas", "openblas"):
            for suffix in ("64_", ""):
                calls = {
                    name: getattr(lib, f"{prefix}_{name}{suffix}", None)
                    for name in ("set_num_threads", "get_num_threads", "get_corename")
                }
                if calls["set_num_threads"] is not None and calls["get_num_threads"] is not None:
                    calls["set_num_threads"].argtypes = [ctypes.c_int]
                    calls["get_num_threads"].restype = ctypes.c_int
                    if calls["get_corename"] is not None:
                        calls["get_corename"].restype = ctypes.c_char_p
                    return calls
    return None


def _load_cupy():
    """Import CuPy and prove a GPU answers; return the module or raise BackendError with a fix."""
    try:
        import cupy  # the only cupy import in tinytrain
    except Exception as exc:  # ImportError, or a broken CUDA install raising at import
        raise BackendError(
            "TINYTRAIN_DEVICE=gpu but CuPy cannot be imported "
            f'({type(exc).__name__}: {exc}). Install it with `pip install -e ".[gpu]"` '
            "or run on the CPU with TINYTRAIN_DEVICE=cpu."
        ) from exc
    try:
        if not cupy.cuda.is_available():
            raise BackendError("no CUDA device is visible")
        # Pick this rank's GPU before the first touch (which creates a CUDA context on the current
        # device), so that ranks do not all start a context on GPU 0. init() confirms the choice.
        _use_launcher_gpu(cupy)
        cupy.zeros(1).sum().item()  # touch the device: fails here, not deep inside a model
    except BackendError as exc:
        raise BackendError(
            f"TINYTRAIN_DEVICE=gpu but {exc}. Check `nvidia-smi` and CUDA_VISIBLE_DEVICES, "
            "or run on the CPU with TINYTRAIN_DEVICE=cpu."
        ) from None
    except Exception as exc:
        raise BackendError(
            f"TINYTRAIN_DEVICE=gpu but the GPU is unusable ({type(exc).__name__}: {exc}). "
            "Check the driver and CUDA_VISIBLE_DEVICES, or use TINYTRAIN_DEVICE=cpu."
        ) from exc
    return cupy


def _use_launcher_gpu(module) -> None:
    """Make this rank's GPU current before the first touch (which creates a CUDA context on the
    current device), so that ranks do not all start a context on GPU 0. init() confirms the choice."""
    module.cuda.Device(gpu_for_rank(_launcher_local_rank(), module.cuda.runtime.getDeviceCount())).use()


def _choose():
    """(array module, device name, why it was chosen)."""
    setting = os.environ.get("TINYTRAIN_DEVICE", "auto").strip().lower() or "auto"
    if setting not in _CHOICES:
        raise BackendError(f"TINYTRAIN_DEVICE={setting!r} is not one of {', '.join(_CHOICES)}.")
    if setting == "cpu":
        return numpy, "cpu", "TINYTRAIN_DEVICE=cpu"
    if setting == "gpu":
        return _load_cupy(), "gpu", "TINYTRAIN_DEVICE=gpu"
    if setting == "strict":
        from . import strict

        _use_launcher_gpu(strict.xp)
        return strict.xp, "strict", "TINYTRAIN_DEVICE=strict (the strict stand-in for CuPy, NumPy underneath)"
    try:  # auto: a GPU if one really works, else quietly the CPU
        return _load_cupy(), "gpu", "TINYTRAIN_DEVICE=auto and CuPy found a working GPU"
    except BackendError as exc:
        cause = exc.__cause__
        found = f"{type(cause).__name__}: {cause}" if cause else "CuPy sees no CUDA device"
        return numpy, "cpu", f"TINYTRAIN_DEVICE=auto (the default) and no usable GPU ({found})"


xp, device, device_reason = _choose()
"""``xp`` is numpy, cupy or the strict stand-in; ``device`` is "cpu", "gpu" or "strict";
``device_reason`` says why (``tinytrain doctor`` prints it)."""


def keep_freed_host_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for the next arrays (True if it could be asked).

    A training step allocates the same big arrays every step (activations, saved tensors,
    gradients) and frees them again. By default glibc hands blocks above 128 KiB to the kernel
    with ``mmap`` and returns them with ``munmap`` when freed, so every step the kernel zeroes and
    maps the pages again, one page fault per 4 KiB: on the VMs this was measured on, a fresh 2 MB
    array cost 2-3 ms to fill, an already mapped one 0.09 ms. With ``mmap`` and trimming off,
    freed blocks stay in the process and the next step reuses them; the process then keeps its
    peak host memory. ``TINYTRAIN_KEEP_FREED_MEMORY=0`` leaves malloc as it is (as do
    ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` set by the user: theirs win)."""
    from tinytrain import env

    if not env.switch("TINYTRAIN_KEEP_FREED_MEMORY", default=True, what="keep freed memory, the default"):
        return False
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to ask
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    # Largest allowed mmap threshold: 32 MiB on 64-bit (bigger blocks are still mmapped, rarely).
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 1 << 30))


host_memory_kept = keep_freed_host_memory()

on_gpu = device == "gpu"  # real CuPy
on_device = device != "cpu"  # arrays live in (real or stand-in) device memory


# --- precision (``--precision``): the dtypes of parameters, activations and gradients ---------------

PRECISIONS = ("fp32", "bf16", "fp16")


def precision_dtype(name: str):
    """The dtype of ``--precision name``: float32, float16, or bfloat16 (NumPy has none: the
    ``ml_dtypes`` package registers it as a NumPy dtype). CuPy has no bfloat16, so on a device
    (``gpu``, and ``strict``, which stands in for CuPy) bf16 is refused with what to use instead."""
    if name not in PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {name!r}")
    if name == "fp32":
        return numpy.dtype(numpy.float32)
    if name == "fp16":
        return numpy.dtype(numpy.float16)
    if on_device:
        raise ValueError(
            "--precision bf16 runs on NumPy only (CuPy has no bfloat16 dtype); on a GPU use --precision fp16, "
            "or run on the CPU with TINYTRAIN_DEVICE=cpu"
        )
    import ml_dtypes

    return numpy.dtype(ml_dtypes.bfloat16)


def is_low_precision(dtype) -> bool:
    """True for the 16-bit floats of ``--precision`` (float16, bfloat16): arrays of them are
    computed on in float32 where NumPy would be slow or inexact (``tinytrain.autograd.ops``), and
    an optimizer keeps float32 master weights for parameters of them (``tinytrain.optim``).

    Asked several times by every op, fp32 runs included: the answer per dtype is kept."""
    known = _low_precision.get(dtype)
    if known is None:
        d = numpy.dtype(dtype)
        known = _low_precision[dtype] = d.itemsize == 2 and (d.kind == "f" or d.name == "bfloat16")
    return known


_low_precision: dict = {}  # dtype (or dtype-like) -> is_low_precision


def is_array(obj) -> bool:
    """True for an array of the active library (or a NumPy array, which every backend accepts)."""
    return isinstance(obj, (numpy.ndarray, xp.ndarray))


def asarray(obj, dtype=None):
    """An array of the active library (copies host data to the GPU when on CuPy)."""
    return xp.asarray(obj, dtype=dtype)


def to_host(arr) -> numpy.ndarray:
    """A NumPy array with the same values (a device-to-host copy on a device; no copy on the CPU)."""
    if on_device and isinstance(arr, xp.ndarray):
        return xp.asnumpy(arr)  # cupy.asnumpy: waits for the current stream, then copies
    return numpy.asarray(arr)


def synchronize() -> None:
    """Wait until all queued GPU work is done (a no-op on the CPU).

    MPI reads buffers directly, outside any CUDA stream, so a kernel that is still writing a buffer
    must finish before the buffer is handed to MPI.
    """
    if on_device:
        xp.cuda.get_current_stream().synchronize()


def device_buffer(arr):
    """What a CUDA-aware MPI is handed for device array ``arr``: the array itself for CuPy (mpi4py
    reads its ``__cuda_array_interface__``); the stand-in's memory, once synchronized, under strict."""
    if device == "strict":
        from . import strict

        return strict.device_buffer(arr)
    return arr


def _scatter_add():
    if on_gpu:
        import cupyx  # part of the cupy package

        return cupyx.scatter_add
    if device == "strict":
        from . import strict

        return strict.cupyx.scatter_add
    return None


_device_scatter_add = _scatter_add()


def index_add(target, index, values) -> None:
    """``target[index] += values`` with repeated indices summed (``np.add.at``), in place."""
    if _device_scatter_add is not None:
        _device_scatter_add(target, index, values)  # cupyx.scatter_add(a, slices, value)
    else:
        numpy.add.at(target, index, values)


def gpu_count() -> int:
    """How many GPUs this process sees (0 on the CPU backend)."""
    return xp.cuda.runtime.getDeviceCount() if on_device else 0


def current_gpu() -> int | None:
    """The index of this thread's current GPU, or None on the CPU."""
    return xp.cuda.Device().id if on_device else None


def select_device_for_rank(local_rank: int) -> int | None:
    """Bind this process to its GPU (:func:`gpu_for_rank`); return the index, or None on the CPU."""
    if not on_device:
        return None
    dev = gpu_for_rank(local_rank, gpu_count())
    xp.cuda.Device(dev).use()
    return dev


def default_rng(seed):
    """A seeded random Generator of the active library (``seed`` may be an int or a tuple)."""
    if on_device:
        # CuPy's Generator takes an int seed; fold a tuple into one deterministically.
        seed = int(numpy.random.SeedSequence(seed).generate_state(1)[0])
    return xp.random.default_rng(seed)
