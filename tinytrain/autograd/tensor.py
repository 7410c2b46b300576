"""``Tensor``: an ``xp`` array plus what autograd needs (``grad``, ``requires_grad``, hooks).

``tensor.data`` is the array itself (NumPy or CuPy); ``tensor.grad`` is a plain array of the same
shape once backward has reached the tensor (leaves only, like PyTorch). Operators and methods call
the Functions in ``ops``; anything else can be done on ``.data`` directly, outside autograd.
"""

from __future__ import annotations

import numpy

from tinytrain.autograd import engine as _engine
from tinytrain.autograd import ops
from tinytrain.autograd.engine import backward as _run_backward
from tinytrain.backend import is_low_precision, xp

DEFAULT_DTYPE = xp.float32


class Tensor:
    __slots__ = ("data", "grad", "requires_grad", "_ctx", "_hooks", "_post_accumulate_hooks", "name", "__weakref__")
    _is_param = False
    # NumPy must not treat a Tensor as an object to broadcast: ``array * tensor`` and
    # ``numpy.float64(2) * tensor`` then fall back to Tensor.__rmul__ instead of building an object array.
    __array_ufunc__ = None

    def __init__(self, data, requires_grad: bool = False, dtype=None, name: str | None = None):
        if isinstance(data, Tensor):
            data = data.data
        if not isinstance(data, xp.ndarray):
            has_dtype = hasattr(data, "dtype")  # a NumPy scalar (0-d op results) keeps its dtype
            data = xp.asarray(data)
            if dtype is None and not has_dtype and data.dtype.kind == "f" and data.dtype != DEFAULT_DTYPE:
                data = data.astype(DEFAULT_DTYPE)  # Python floats become float32, not float64
        if dtype is not None and data.dtype != dtype:
            data = data.astype(dtype)
        if requires_grad and data.dtype.kind not in "fc" and not is_low_precision(data.dtype):  # (bfloat16: "V")
            raise TypeError(f"only floating-point tensors can require grad, got {data.dtype}")
        self.data = data
        self.grad = None
        self.requires_grad = requires_grad
        self._ctx = None
        self._hooks = []
        self._post_accumulate_hooks = []
        self.name = name

    # --- what it is -------------------------------------------------------------------------

    shape = property(lambda self: self.data.shape)
    ndim = property(lambda self: self.data.ndim)
    dtype = property(lambda self: self.data.dtype)
    size = property(lambda self: self.data.size)
    nbytes = property(lambda self: self.data.nbytes)

    @property
    def is_leaf(self) -> bool:
        return self._ctx is None

    def __len__(self):
        return len(self.data)

    def __repr__(self):
        extra = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor({self.data!r}{extra})"

    def numpy(self) -> numpy.ndarray:
        """The values as a NumPy array on the host (a copy from the GPU)."""
        from tinytrain.backend import to_host

        return to_host(self.data)

    def item(self):
        return self.data.item()

    def detach(self) -> Tensor:
        """The same values, cut from the graph (shares the array)."""
        return Tensor(self.data)

    def requires_grad_(self, flag: bool = True) -> Tensor:
        if not self.is_leaf:
            raise RuntimeError("requires_grad can only be changed on a leaf tensor")
        self.requires_grad = flag
        return self

    # --- autograd ---------------------------------------------------------------------------

    def backward(self, grad=None, retain_graph: bool = False) -> None:
        _run_backward(self, grad, retain_graph=retain_graph)

    def register_hook(self, hook):
        """``hook(grad) -> grad or None`` runs when this tensor's gradient is computed; a returned
        array replaces the gradient. Returns a handle with ``remove()``."""
        return _HookHandle(self._hooks, hook)

    def register_post_accumulate_grad_hook(self, hook):
        """``hook(tensor)`` runs on a leaf right after backward has finished adding into its
        ``.grad``, while the rest of backward still runs. Returns a handle with ``remove()``."""
        if not self.is_leaf:
            raise RuntimeError("post-accumulate hooks can only be registered on leaf tensors")
        return _HookHandle(self._post_accumulate_hooks, hook)

    # --- arithmetic -------------------------------------------------------------------------

    def __add__(self, other):
        return ops.Add.apply(self, other)

    def __radd__(self, other):
        return ops.Add.apply(other, self)

    def __sub__(self, other):
        return ops.Sub.apply(self, other)

    def __rsub__(self, other):
        return ops.Sub.apply(other, self)

    def __mul__(self, other):
        return ops.Mul.apply(self, other)

    def __rmul__(self, other):
        return ops.Mul.apply(other, self)

    def __truediv__(self, other):
        return ops.Div.apply(self, other)

    def __rtruediv__(self, other):
        return ops.Div.apply(other, self)

    def __neg__(self):
        return ops.Neg.apply(self)

    def __pow__(self, exponent):
        return ops.Pow.apply(self, exponent)

    def __rpow__(self, base):
        return ops.Pow.apply(base, self)

    def __matmul__(self, other):
        return ops.MatMul.apply(self, other)

    def __rmatmul__(self, other):
        return ops.MatMul.apply(other, self)

    # --- reductions -------------------------------------------------------------------------

    def sum(self, axis=None, keepdims=False):
        return ops.Sum.apply(self, axis=axis, keepdims=keepdims)

    def mean(self, axis=None, keepdims=False):
        return ops.Mean.apply(self, axis=axis, keepdims=keepdims)

    def max(self, axis=None, keepdims=False):
        return ops.Max.apply(self, axis=axis, keepdims=keepdims)

    def var(self, axis=None, keepdims=False, correction=0):
        """Variance; ``correction=0`` (the default, like NumPy) divides by n, 1 by n - 1."""
        return ops.Var.apply(self, axis=axis, keepdims=keepdims, correction=correction)

    # --- elementwise ------------------------------------------------------------------------

    def exp(self):
        return ops.Exp.apply(self)

    def log(self):
        return ops.Log.apply(self)

    def sqrt(self):
        return ops.Sqrt.apply(self)

    def tanh(self):
        return ops.Tanh.apply(self)

    def relu(self):
        return ops.ReLU.apply(self)

    def softmax(self, axis=-1):
        return ops.Softmax.apply(self, axis=axis)

    def astype(self, dtype):
        return ops.Cast.apply(self, dtype=xp.dtype(dtype))

    # --- shape ------------------------------------------------------------------------------

    def reshape(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return ops.Reshape.apply(self, shape=shape)

    def transpose(self, axis0=-2, axis1=-1):
        """Swap two axes (the last two by default)."""
        axes = list(range(self.ndim))
        axes[axis0], axes[axis1] = axes[axis1], axes[axis0]
        return ops.Permute.apply(self, axes=tuple(axes))

    def permute(self, *axes):
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        return ops.Permute.apply(self, axes=axes)

    @property
    def T(self):
        return self.transpose()

    def __getitem__(self, index):
        return ops.GetItem.apply(self, index=_unwrap_index(index))

    def split(self, size_or_sizes, axis=0):
        """Pieces along ``axis``: equal pieces of ``size`` (the last may be shorter) or given sizes."""
        n = self.shape[axis]
        if isinstance(size_or_sizes, int):
            if size_or_sizes <= 0:
                raise ValueError(f"split size must be positive, got {size_or_sizes}")
            sizes = [min(size_or_sizes, n - start) for start in range(0, n, size_or_sizes)]
        else:
            sizes = list(size_or_sizes)
            if sum(sizes) != n:
                raise ValueError(f"split sizes {sizes} add up to {sum(sizes)}, but axis {axis} has {n}")
        lead = (slice(None),) * (axis % self.ndim)
        pieces, start = [], 0
        for size in sizes:
            pieces.append(self[lead + (slice(start, start + size),)])
            start += size
        return pieces

    def chunk(self, chunks, axis=0):
        """``chunks`` pieces along ``axis`` of size ceil(n/chunks) (the last ones may be smaller)."""
        if chunks <= 0:
            raise ValueError(f"chunks must be positive, got {chunks}")
        return self.split(max(1, -(-self.shape[axis] // chunks)), axis=axis)

    def masked_fill(self, mask, value):
        """This tensor with ``value`` wherever ``mask`` is True."""
        mask = mask.data if isinstance(mask, Tensor) else xp.asarray(mask)
        return ops.Where.apply(mask, value, self)


class Parameter(Tensor):
    """A leaf tensor that a Module owns and an optimizer updates (``requires_grad`` by default).

    Parameters are never counted as activation memory in ``saved_bytes()``.
    """

    __slots__ = ()
    _is_param = True

    def __init__(self, data, requires_grad: bool = True, name: str | None = None):
        super().__init__(data, requires_grad=requires_grad, name=name)

    def __repr__(self):
        return f"Parameter(shape={self.shape}, dtype={self.dtype})"


_engine._tensor_class[0] = Tensor


class _HookHandle:
    def __init__(self, hooks: list, hook):
        self._hooks, self._hook = hooks, hook
        hooks.append(hook)

    def remove(self) -> None:
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)


def _unwrap_index(index):
    if isinstance(index, Tensor):
        return index.data
    if isinstance(index, tuple):
        return tuple(i.data if isinstance(i, Tensor) else i for i in index)
    return index


def tensor(data, requires_grad: bool = False, dtype=None) -> Tensor:
    return Tensor(data, requires_grad=requires_grad, dtype=dtype)


def zeros(*shape, dtype=DEFAULT_DTYPE, requires_grad: bool = False) -> Tensor:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return Tensor(xp.zeros(shape, dtype=dtype), requires_grad=requires_grad)


def ones(*shape, dtype=DEFAULT_DTYPE, requires_grad: bool = False) -> Tensor:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return Tensor(xp.ones(shape, dtype=dtype), requires_grad=requires_grad)
