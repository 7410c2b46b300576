"""What every data-parallel strategy is built on: a wrapper around the model, and small helpers on
its parameters (one flat message of gradients, receiving one into arrays).

``NaiveDDP``, ``BucketedDDP`` and ``ParameterServer`` (``data_parallel.py``) and the ZeRO stages
(``zero.py``) all hold a whole model (or its pieces) and differ only in what they communicate and
when. :class:`Wrapper` is that common shape: ``wrapper(x)`` runs the model (traced as compute),
``wrapper.backward(loss)`` runs backward and then the strategy's :meth:`Wrapper.after_backward`, and
every other attribute (``config``, ``eval()``, ...) reaches the wrapped module.
"""

from __future__ import annotations

from tinytrain import distributed as dist
from tinytrain import trace
from tinytrain.backend import is_low_precision, xp


def broadcast_parameters(module, src: int = 0, group=None) -> None:
    """Copy rank ``src``'s parameters into every rank's model, so all replicas start identical."""
    for p in module.parameters():
        dist.broadcast(p.data, src=src, group=group)


def trainable(module) -> list:
    """The parameters that get gradients; frozen ones (requires_grad=False) never travel."""
    return [p for p in module.parameters() if p.requires_grad]


def grad_or_zeros(p):
    """A parameter that got no gradient on this rank still takes part: it contributes zeros."""
    if p.grad is None:
        p.grad = xp.zeros_like(p.data)
    return p.grad


def flat_grads(params):
    """This rank's gradients of ``params`` as one flat buffer (a copy; zeros where a parameter got
    none), in parameter order: what one message carries."""
    return flatten([grad_or_zeros(p) for p in params])


def average_op(buffer, group=None) -> str:
    """The reduce op that averages ``buffer`` over ``group``: ``"avg"`` (sum, then divide). A 16-bit
    buffer (``--precision bf16|fp16``) is divided by the group's size first, in place, and summed
    (``"sum"``): in float16 the sum of N loss-scaled gradients can overflow 65504 where their average
    does not (DeepSpeed's gradient pre-division); bfloat16 is treated alike, one rule for both. For a
    power-of-two group the division only lowers the exponent: the same numbers as "avg" (barring
    subnormals)."""
    if not is_low_precision(buffer.dtype):
        return "avg"
    buffer /= dist.get_world_size(group)
    return "sum"


def flatten(arrays):
    """One flat copy of ``arrays``, concatenated in order (what a single message carries)."""
    return xp.concatenate([a.reshape(-1) for a in arrays]) if arrays else xp.zeros(0, xp.float32)


def unflatten_into(flat, arrays) -> None:
    """Copy consecutive pieces of ``flat`` back into ``arrays``, in place (inverse of :func:`flatten`)."""
    offset = 0
    for a in arrays:
        a[...] = flat[offset : offset + a.size].reshape(a.shape)
        offset += a.size


def recv_into(arrays, src: int, group=None, tag: int = 0) -> None:
    """Receive one flat message from rank ``src`` and copy its consecutive pieces into ``arrays``
    (the receiving end of sending :func:`flatten` of arrays of the same sizes and dtype)."""
    flat = xp.empty(sum(a.size for a in arrays), dtype=arrays[0].dtype)
    dist.recv(flat, src, group=group, tag=tag)
    unflatten_into(flat, arrays)


class Wrapper:
    """Holds ``module``; ``wrapper(x)`` runs it and ``wrapper.config``, ``.eval()``... reach it."""

    def __init__(self, module):
        self.module = module

    def __call__(self, *args, **kwargs):
        with trace.span("forward", cat="compute"):
            return self.module(*args, **kwargs)

    def __getattr__(self, name):
        if name == "module":  # not set yet: no endless recursion
            raise AttributeError(name)
        return getattr(self.module, name)

    def backward(self, loss) -> None:
        with trace.span("backward", cat="compute"):
            loss.backward()
        self.after_backward()

    def after_backward(self) -> None:
        """What the strategy does once backward has finished (nothing by default)."""
