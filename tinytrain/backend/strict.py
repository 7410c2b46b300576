"""A strict stand-in for CuPy (``TINYTRAIN_DEVICE=strict``): the GPU code paths, run without a GPU.

No GPU is lent to CI, yet the code that only runs on one (device buffers handed to MPI or staged
through the host, stream synchronization before MPI touches a buffer, binding a rank to its GPU)
must run somewhere. This module is an array library with CuPy's interface where bugs hide, and
NumPy underneath, so every number is exactly NumPy's:

    strict array            a wrapper around a NumPy array ("device memory"); operations on it
                            give strict arrays (reductions give 0-d arrays, as CuPy's do)
    numpy.asarray(x)        TypeError, as CuPy raises: a copy to the host is explicit,
                            ``xp.asnumpy(x)`` or ``x.get()``, and counted
    x + numpy_array         TypeError, as CuPy raises: host data enters the device explicitly,
                            ``xp.asarray(host)`` or ``x[...] = host``, and counted
    comm.Isend(x, ...)      TypeError: a strict array has no buffer MPI can read. ``device_buffer``
                            gives MPI the memory only if the last write to it was synchronized
    cuda.runtime / Device   a fake machine of ``TINYTRAIN_STRICT_GPUS`` GPUs (default 4)
    cuda.get_current_stream().synchronize()    counted

``counts`` holds what happened: host-to-device and device-to-host copies (and their bytes), stream
synchronizations. Tests read it to assert where copies happen.

What is *not* modelled: asynchrony itself (a "kernel" finishes before the call returns), so a
missing synchronization is caught by bookkeeping (:func:`device_buffer`), not by wrong numbers; and
CuPy functions that do not exist (anything NumPy has works here).
"""

from __future__ import annotations

import threading
import types
import weakref

import numpy
from numpy.lib.mixins import NDArrayOperatorsMixin


class Counts:
    """What crossed between host and "device", and how often the stream was synchronized."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.h2d = self.d2h = 0  # copies
        self.h2d_bytes = self.d2h_bytes = 0
        self.syncs = 0

    def snapshot(self) -> dict:
        return dict(vars(self))

    def since(self, before: dict) -> dict:
        """What happened after ``before = counts.snapshot()``."""
        return {k: v - before[k] for k, v in vars(self).items()}


counts = Counts()
_lock = threading.Lock()
_launches = 0  # operations queued on the "device" so far
_synced_at = 0  # _launches at the last stream synchronization
_last_write: dict[int, tuple] = {}  # id(base ndarray) -> (weak reference to it, _launches when last written)
_prune_at = 4096  # forget dead or synchronized entries when the table grows past this
_owners: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id(owning ndarray) -> its strict wrapper

_IMPLICIT = (
    "Implicit conversion to a NumPy array is not allowed (TINYTRAIN_DEVICE=strict behaves like CuPy here). "
    "Copy it to the host explicitly: tinytrain.backend.to_host(x), xp.asnumpy(x) or x.get()."
)


def _base(a: numpy.ndarray) -> numpy.ndarray:
    while isinstance(a.base, numpy.ndarray):
        a = a.base
    return a


def _written(a: numpy.ndarray) -> None:
    """Record that a queued operation wrote ``a`` (MPI may read it only after a synchronize)."""
    global _launches, _prune_at
    with _lock:
        _launches += 1
        base = _base(a)
        _last_write[id(base)] = (weakref.ref(base), _launches)
        if len(_last_write) > _prune_at:
            for key in [k for k, (ref, t) in _last_write.items() if t <= _synced_at or ref() is None]:
                del _last_write[key]
            _prune_at = max(4096, 2 * len(_last_write))


def _host_copy_in(obj) -> None:
    counts.h2d += 1
    counts.h2d_bytes += int(getattr(obj, "nbytes", 0))


def _host_copy_out(a: numpy.ndarray) -> None:
    counts.d2h += 1
    counts.d2h_bytes += int(a.nbytes)


# --- arrays ----------------------------------------------------------------------------------------


def _unwrap(obj, where: str):
    """Strict arrays -> their NumPy arrays; a host NumPy array in a device operation is an error."""
    if isinstance(obj, ndarray):
        return obj._a
    if isinstance(obj, numpy.ndarray):
        raise TypeError(
            f"{where}: got a host numpy.ndarray (shape {obj.shape}, {obj.dtype}) among device arrays; CuPy raises "
            "'Unsupported type <class numpy.ndarray>' here. Move it explicitly with xp.asarray(x)."
        )
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unwrap(o, where) for o in obj)
    if isinstance(obj, dict):
        return {k: _unwrap(v, where) for k, v in obj.items()}
    return obj


def _wrap(obj):
    """NumPy results -> strict arrays (a NumPy scalar becomes a 0-d array, as in CuPy)."""
    if isinstance(obj, numpy.ndarray):
        _written(obj)
        return ndarray(obj)
    if isinstance(obj, numpy.generic):
        return _wrap(numpy.asarray(obj))
    if isinstance(obj, tuple):
        return tuple(_wrap(o) for o in obj)
    if isinstance(obj, list):
        return [_wrap(o) for o in obj]
    return obj


_IN_PLACE_METHODS = {"fill", "sort", "put", "partition", "resize", "setflags"}
_HOST_METHODS = {"tolist", "item", "tobytes"}  # they hand data to the host (a copy, counted)
_HIDDEN = {"ctypes", "data", "tofile", "dump", "dumps", "__array_interface__", "__array_struct__"}


class ndarray(NDArrayOperatorsMixin):  # noqa: N801 - named like cupy.ndarray, which it stands in for
    """A "device" array: a NumPy array that only strict operations and explicit copies may touch."""

    __slots__ = ("_a", "__weakref__")
    __array_priority__ = 100

    def __init__(self, a: numpy.ndarray):
        self._a = a
        if a.base is None:  # it owns its memory: views find this wrapper as their .base
            _owners[id(a)] = self

    @property
    def base(self):
        """The array owning the memory of this view, or None (like CuPy: the same object every time)."""
        owner = self._a.base
        if not isinstance(owner, numpy.ndarray):
            return None
        wrapper = _owners.get(id(owner))
        return wrapper if wrapper is not None and wrapper._a is owner else ndarray(owner)

    # NumPy must not take it implicitly (CuPy: TypeError). numpy.asarray, numpy.testing, MPI all end here.
    def __array__(self, dtype=None, copy=None):
        raise TypeError(_IMPLICIT)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        where = f"numpy.{ufunc.__name__}"
        out = kwargs.get("out")
        args = _unwrap(inputs, where)
        if out is not None:
            kwargs["out"] = _unwrap(out, where)
        result = getattr(ufunc, method)(*args, **kwargs)
        if out is not None:
            for o in kwargs["out"]:
                _written(o)
            return out[0] if len(out) == 1 else out
        if method == "at":  # in place on inputs[0]
            _written(args[0])
            return None
        return _wrap(result)

    def __array_function__(self, func, types, args, kwargs):
        return _call(func, f"numpy.{func.__name__}", args, kwargs)

    # attributes and methods: NumPy's, on the wrapped array, results wrapped
    def __getattr__(self, name):
        if name in _HIDDEN or name.startswith("__"):  # no __dlpack__ etc.: MPI must not find a way in
            raise AttributeError(f"a strict device array has no {name!r} (a CuPy array has no host buffer either)")
        value = getattr(self._a, name)
        if not callable(value):
            return _wrap(value) if isinstance(value, numpy.ndarray) else value
        if name in _HOST_METHODS:

            def to_host(*args, **kwargs):
                _host_copy_out(self._a)
                return value(*args, **kwargs)

            return to_host

        def method(*args, **kwargs):
            result = value(*_unwrap(args, f"ndarray.{name}"), **_unwrap(kwargs, f"ndarray.{name}"))
            if name in _IN_PLACE_METHODS:
                _written(self._a)
            return _wrap(result)

        return method

    def get(self) -> numpy.ndarray:
        """A host copy (CuPy's ``ndarray.get``)."""
        _host_copy_out(self._a)
        return self._a.copy()

    def __getitem__(self, key):
        return _wrap(self._a[_index(key)])

    def __setitem__(self, key, value):
        if isinstance(value, numpy.ndarray):  # CuPy copies a host array into the device buffer
            _host_copy_in(value)
        else:
            value = _unwrap(value, "ndarray.__setitem__")
        self._a[_index(key)] = value
        _written(self._a)

    # Python's scalar conversions read the device (a copy to the host, like CuPy's)
    def _scalar(self, kind):
        _host_copy_out(self._a)
        return kind(self._a)

    def __float__(self):
        return self._scalar(float)

    def __int__(self):
        return self._scalar(int)

    def __bool__(self):
        return self._scalar(bool)

    def __index__(self):
        return self._scalar(int)

    def __complex__(self):
        return self._scalar(complex)

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        return (_wrap(row) for row in self._a)

    def __repr__(self):
        return "strict." + repr(self._a).replace("\n", "\n       ")

    def __str__(self):
        return str(self._a)

    def __reduce__(self):
        raise TypeError(f"a strict device array cannot be pickled. {_IMPLICIT}")

    @property
    def T(self):  # noqa: N802 - NumPy's name
        return _wrap(self._a.T)


def _index(key):
    """An index for a device array: strict arrays unwrap; host index arrays are copied in (CuPy does)."""
    if isinstance(key, tuple):
        return tuple(_index(k) for k in key)
    if isinstance(key, ndarray):
        return key._a
    if isinstance(key, numpy.ndarray):
        _host_copy_in(key)
        return key
    if isinstance(key, list):
        return [_index(k) for k in key]
    return key


# --- the module: numpy's functions over strict arrays ------------------------------------------------


def _call(fn, where: str, args, kwargs):
    """``fn`` (a NumPy function) on the arrays inside strict ones; results (or ``out=``) strict."""
    out = kwargs.get("out")
    result = fn(*_unwrap(args, where), **_unwrap(kwargs, where))
    if isinstance(out, ndarray):
        _written(out._a)
        return out
    return _wrap(result)


def _device_function(fn, name: str):
    def call(*args, **kwargs):
        return _call(fn, f"xp.{name}", args, kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"``numpy.{name}`` on strict device arrays."
    return call


def asarray(obj, dtype=None, order=None):
    """``cupy.asarray``: a device array; host data (NumPy arrays, lists, scalars) is copied in."""
    if isinstance(obj, ndarray):
        return obj if dtype is None or obj.dtype == dtype else obj.astype(dtype)
    host = numpy.asarray(_host_only(obj), dtype=dtype, order=order)
    _host_copy_in(host)
    return _wrap(host.copy() if host is obj else host)


def array(obj, dtype=None, copy=True, order="K", ndmin=0):
    """``cupy.array``: like :func:`asarray`, but copies a device array too."""
    if isinstance(obj, ndarray):
        return _wrap(numpy.array(obj._a, dtype=dtype, copy=copy, order=order, ndmin=ndmin))
    host = numpy.array(_host_only(obj), dtype=dtype, order=order, ndmin=ndmin)
    _host_copy_in(host)
    return _wrap(host)


def ascontiguousarray(obj, dtype=None):
    return asarray(obj, dtype=dtype, order="C") if not isinstance(obj, ndarray) else _device_ascontiguous(obj, dtype)


def _device_ascontiguous(obj, dtype):
    a = numpy.ascontiguousarray(obj._a, dtype=dtype)
    return obj if a is obj._a else _wrap(a)


def _host_only(obj):
    """Host data for asarray: nested lists of strict 0-d arrays are a CuPy error too."""
    if isinstance(obj, (list, tuple)) and any(isinstance(o, ndarray) for o in obj):
        raise TypeError(f"xp.asarray of a list holding device arrays; use xp.stack instead. {_IMPLICIT}")
    return obj


def asnumpy(a, stream=None, order="C", out=None):
    """``cupy.asnumpy``: a host copy (NumPy arrays pass through, as in CuPy)."""
    if isinstance(a, ndarray):
        _host_copy_out(a._a)
        host = numpy.array(a._a, order=order)
        if out is not None:
            out[...] = host
            return out
        return host
    return numpy.asarray(a, order=order)


def get_array_module(*args):
    return _module if any(isinstance(a, ndarray) for a in args) else numpy


# --- the fake CUDA runtime --------------------------------------------------------------------------


def _device_count() -> int:
    from tinytrain import env

    return env.positive_int("TINYTRAIN_STRICT_GPUS", 4, what="how many GPUs the strict stand-in has")


class _Runtime:
    @staticmethod
    def getDeviceCount() -> int:  # noqa: N802 - CuPy's name
        return _device_count()

    @staticmethod
    def runtimeGetVersion() -> int:  # noqa: N802
        return 0

    @staticmethod
    def getDeviceProperties(index: int) -> dict:  # noqa: N802
        return {"name": f"strict stand-in GPU {index}".encode(), "totalGlobalMem": 0}


_current = threading.local()


class Device:
    """``cupy.cuda.Device``: ``Device(i).use()`` makes GPU i current for this thread."""

    def __init__(self, device=None):
        self.id = current_device() if device is None else int(device)
        if not 0 <= self.id < _device_count():
            raise RuntimeError(f"CUDARuntimeError: cudaErrorInvalidDevice: invalid device ordinal {self.id}")

    def use(self) -> None:
        _current.device = self.id

    def synchronize(self) -> None:
        Stream().synchronize()

    def __repr__(self):
        return f"<CUDA Device {self.id}>"


def current_device() -> int:
    return getattr(_current, "device", 0)


class Stream:
    """The current stream: ``synchronize()`` waits for everything queued (counted)."""

    def synchronize(self) -> None:
        global _synced_at
        with _lock:
            counts.syncs += 1
            _synced_at = _launches


def _get_current_stream():
    return Stream()


def _is_available() -> bool:
    return _device_count() > 0


cuda = types.SimpleNamespace(
    runtime=_Runtime,
    Device=Device,
    Stream=Stream,
    get_current_stream=_get_current_stream,
    is_available=_is_available,
)


# --- MPI's view of a device buffer -------------------------------------------------------------------


class UnsynchronizedBuffer(RuntimeError):
    """A device buffer went to MPI while an operation writing it may still be queued."""


def device_buffer(a: ndarray) -> numpy.ndarray:
    """The memory of ``a`` for a CUDA-aware MPI (no copy), once its last write was synchronized.

    A real GPU kernel may still be writing when the host moves on; MPI reads memory directly, outside
    any stream, so it could read a half-written buffer. We cannot be late, so we keep the books:
    an array written after the last ``synchronize()`` is refused.
    """
    base = _base(a._a)
    entry = _last_write.get(id(base))
    if entry is not None and entry[0]() is base and entry[1] > _synced_at:
        raise UnsynchronizedBuffer(
            f"a device buffer (shape {a.shape}, {a.dtype}) was handed to MPI after an operation wrote it and "
            "before the stream was synchronized; call tinytrain.backend.synchronize() first."
        )
    return a._a


# --- random numbers and scatter_add -------------------------------------------------------------------


class Generator:
    """``cupy.random.Generator`` over NumPy's (same numbers as NumPy for the same seed)."""

    def __init__(self, seed):
        self._g = numpy.random.default_rng(seed)

    def __getattr__(self, name):
        fn = getattr(self._g, name)
        return _device_function(fn, f"random.Generator.{name}") if callable(fn) else fn


def _default_rng(seed=None):
    return Generator(seed)


def scatter_add(a: ndarray, slices, value) -> None:
    """``cupyx.scatter_add``: ``a[slices] += value`` with repeated indices summed, in place."""
    numpy.add.at(a._a, _index(slices), _unwrap(value, "scatter_add"))
    _written(a._a)


cupyx = types.SimpleNamespace(scatter_add=scatter_add)


class _Module(types.ModuleType):
    """``xp`` on the strict device: numpy's names, with functions that take and give device arrays."""

    def __getattr__(self, name):
        value = getattr(numpy, name)  # AttributeError for a name NumPy lacks
        if isinstance(value, types.ModuleType):
            wrapped = _Submodule(f"{__name__}.{name}", value)
        elif isinstance(value, type) or not callable(value):
            wrapped = value  # dtypes (xp.float32), constants (xp.pi, xp.newaxis)
        else:
            wrapped = _device_function(value, name)
        setattr(self, name, wrapped)
        return wrapped


class _Submodule(types.ModuleType):
    def __init__(self, name, inner):
        super().__init__(name)
        self._inner = inner

    def __getattr__(self, name):
        value = getattr(self._inner, name)
        wrapped = _device_function(value, f"{self.__name__}.{name}") if callable(value) else value
        setattr(self, name, wrapped)
        return wrapped


_module = _Module("tinytrain.backend.strict.xp", __doc__)
for _name, _value in {
    "ndarray": ndarray,
    "asarray": asarray,
    "array": array,
    "ascontiguousarray": ascontiguousarray,
    "asnumpy": asnumpy,
    "get_array_module": get_array_module,
    "cuda": cuda,
}.items():
    setattr(_module, _name, _value)
_module.random = _Submodule(f"{_module.__name__}.random", numpy.random)
_module.random.default_rng = _default_rng
_module.random.Generator = Generator
xp = _module
"""The strict device's array module: what ``tinytrain.backend.xp`` is under TINYTRAIN_DEVICE=strict."""
