"""Reverse-mode automatic differentiation: ``Function``, its ``Context`` and the backward engine.

A ``Function`` is one differentiable operation written with plain arrays::

    class Mul(Function):
        @staticmethod
        def forward(ctx, a, b):            # arrays in, one array out
            ctx.save_for_backward(a, b)
            return a * b

        @staticmethod
        def backward(ctx, grad):           # d(loss)/d(output) in, one gradient per input out
            a, b = ctx.saved
            return grad * b, grad * a

``Mul.apply(x, y)`` unwraps the ``Tensor`` arguments, runs ``forward`` and, when a gradient is
needed, records a ``Context`` on the output that points back at the inputs: that chain of contexts
is the graph. ``Tensor.backward()`` walks it from the loss back to the leaves.

The engine counts dependencies: before it starts, it counts how many graph edges lead into each
leaf. Each time a ``backward`` hands a gradient to a leaf it decrements the count, and when the
count reaches zero the leaf's gradient is complete: it is added to ``leaf.grad`` and the leaf's
post-accumulate hooks fire right then, in the middle of the backward pass. Data parallel training
uses that moment to start all-reducing a gradient while the rest of backward still runs.

A backward can also run in two phases (``backward_inputs``, below): B, the inputs' gradients,
now; W, the weight gradients, later, bit for bit the same numbers. Zero-bubble pipeline schedules
fill their bubbles with the W's.

Bytes saved for backward are counted while alive (``saved_bytes()``): that is the activation
memory that pipeline and sequence parallel reduce, measured rather than estimated.

A gradient has its tensor's dtype: the engine casts one that a backward returns in another (a
float32 loss hands its bfloat16 logits a float32 gradient). Loss scaling (fp16 training,
``tinytrain.optim.LossScaler``): inside ``loss_scaling(S)`` a scalar's ``backward()`` starts from S
instead of 1, exactly as if the loss had been multiplied by S, so every gradient comes out S times
larger, above float16's underflow; the optimizer divides by S again, in float32.
"""

from __future__ import annotations

import contextlib
import time

import numpy

from tinytrain.backend import xp

# --------------------------------------------------------------------------------------------
# Grad mode


class _GradMode:
    enabled = True
    loss_scale = 1.0  # where a scalar's backward() starts (loss_scaling)


def is_grad_enabled() -> bool:
    return _GradMode.enabled


@contextlib.contextmanager
def no_grad():
    """Run operations without recording the graph (evaluation, optimizer updates)."""
    previous = _GradMode.enabled
    _GradMode.enabled = False
    try:
        yield
    finally:
        _GradMode.enabled = previous


@contextlib.contextmanager
def loss_scaling(scale: float):
    """Inside: ``loss.backward()`` of a scalar without a given gradient starts from ``scale``
    instead of 1: the gradients of ``scale · loss`` (the loss itself is unchanged)."""
    previous = _GradMode.loss_scale
    _GradMode.loss_scale = float(scale)
    try:
        yield
    finally:
        _GradMode.loss_scale = previous


@contextlib.contextmanager
def enable_grad():
    previous = _GradMode.enabled
    _GradMode.enabled = True
    try:
        yield
    finally:
        _GradMode.enabled = previous


# --------------------------------------------------------------------------------------------
# Activation memory: bytes saved for backward that are still alive
#
# Two contexts that save the same buffer (or views of it) hold it once, so live bytes are counted
# per underlying buffer: id(base array) -> [number of saves holding it, nbytes]. Parameters are
# not activations and are never counted.

_saved_buffers: dict[int, list] = {}
_saved_total = [0, 0]  # [live bytes, peak bytes]


def _base(arr):
    base = arr
    while getattr(base, "base", None) is not None and hasattr(base.base, "nbytes"):
        base = base.base
    return base


def _hold(arr) -> int:
    base = _base(arr)
    key = id(base)
    entry = _saved_buffers.get(key)
    if entry is None:
        _saved_buffers[key] = [1, base.nbytes, base]
        _saved_total[0] += base.nbytes
        if _saved_total[0] > _saved_total[1]:
            _saved_total[1] = _saved_total[0]
    else:
        entry[0] += 1
    return key


def _release(key: int) -> None:
    entry = _saved_buffers[key]
    entry[0] -= 1
    if entry[0] == 0:
        _saved_total[0] -= entry[1]
        del _saved_buffers[key]


def saved_bytes() -> int:
    """Bytes of arrays currently saved for backward by live graphs (each buffer counted once)."""
    return _saved_total[0]


def peak_saved_bytes() -> int:
    """The largest ``saved_bytes()`` seen since the last ``reset_peak_saved_bytes()``."""
    return _saved_total[1]


def reset_peak_saved_bytes() -> None:
    _saved_total[1] = _saved_total[0]


# --------------------------------------------------------------------------------------------
# Per-op timing: where a step's time goes (``tinytrain bench step --profile``)

_op_seconds: list = [None]  # [None], or [dict "Name forward" / "Name backward" -> seconds]


@contextlib.contextmanager
def op_timer():
    """Inside, add the wall seconds of every Function's forward and backward to the yielded dict,
    keyed ``"Linear forward"``, ``"Linear backward"``, ... Outside, it costs one check per op.
    On a GPU the arrays' work runs asynchronously: synchronize before trusting these figures."""
    previous = _op_seconds[0]
    seconds: dict = {}
    _op_seconds[0] = seconds
    try:
        yield seconds
    finally:
        _op_seconds[0] = previous


@contextlib.contextmanager
def timed(name: str):
    """Add this block's wall seconds under ``name`` to the running :func:`op_timer`, if any
    (the optimizer's step is timed so)."""
    seconds, start = _op_seconds[0], time.perf_counter()
    try:
        yield
    finally:
        if seconds is not None:
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start


def _add_seconds(seconds: dict, fn, phase: str, start: float) -> None:
    key = f"{fn.__name__} {phase}"
    seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - start


# --------------------------------------------------------------------------------------------
# Function and Context


class Context:
    """What one call of a Function remembers for its backward: inputs, saved arrays, options."""

    __slots__ = ("fn", "inputs", "needs_input_grad", "saved", "_saved_keys", "__dict__")

    def __init__(self, fn, inputs, needs_input_grad):
        self.fn = fn
        self.inputs = inputs  # the Tensor arguments (None where an argument was not a Tensor)
        self.needs_input_grad = needs_input_grad
        self.saved = ()
        self._saved_keys = ()

    def save_for_backward(self, *arrays) -> None:
        """Keep arrays for backward; counted in ``saved_bytes()`` unless they are parameters."""
        self.saved = arrays
        param_data = {id(t.data) for t in self.inputs if t is not None and t._is_param}
        self._saved_keys = tuple(
            _hold(a) for a in arrays if a is not None and hasattr(a, "nbytes") and id(a) not in param_data
        )

    def release(self) -> None:
        """Drop saved arrays once backward has used them (frees activation memory)."""
        for key in self._saved_keys:
            _release(key)
        self._saved_keys = ()
        self.saved = None

    def __del__(self):
        # A graph that is dropped without a backward (evaluation with grad on, an exception)
        # must not leave its bytes counted forever.
        try:
            if self._saved_keys:
                self.release()
        except Exception:
            pass


_tensor_class = [None]  # set by tinytrain.autograd.tensor (which imports this module)


class Function:
    """Base class of differentiable operations; see the module docstring."""

    split_backward = True  # False: backward_inputs runs this op's backward whole in B (see there)

    @staticmethod
    def forward(ctx, *args, **kwargs):
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError

    @classmethod
    def apply(cls, *args, **kwargs):
        Tensor = _tensor_class[0]
        arrays = []
        inputs = []
        needs = []
        any_needs = False
        for a in args:
            if isinstance(a, Tensor):
                arrays.append(a.data)
                inputs.append(a)
                needs.append(a.requires_grad)
                any_needs = any_needs or a.requires_grad
            else:  # a constant; a host array goes to the device (CuPy refuses to mix them)
                arrays.append(xp.asarray(a) if xp is not numpy and isinstance(a, numpy.ndarray) else a)
                inputs.append(None)
                needs.append(False)
        record = any_needs and _GradMode.enabled
        ctx = Context(cls, tuple(inputs), tuple(needs))
        seconds = _op_seconds[0]
        start = time.perf_counter() if seconds is not None else 0.0  # the clock only while timing
        out = cls.forward(ctx, *arrays, **kwargs)
        if seconds is not None:
            _add_seconds(seconds, cls, "forward", start)
        if not record:
            ctx.release()
            return Tensor(out)
        result = Tensor(out, requires_grad=True)
        result._ctx = ctx
        return result


# --------------------------------------------------------------------------------------------
# The backward engine


def _topological_order(root):
    """Non-leaf tensors in an order where every tensor comes before the tensors it was made from,
    and the number of graph edges leading into each leaf (keyed by id)."""
    order = []
    leaf_edges: dict[int, int] = {}
    visited = set()
    stack = [(root, False)]
    while stack:
        t, expanded = stack.pop()
        if expanded:
            order.append(t)
            continue
        # Mark a tensor visited when it is expanded, not when it is pushed: a tensor pushed early
        # but reached again deeper down must be finished after (so ordered before) that deeper user.
        if id(t) in visited:
            continue
        visited.add(id(t))
        stack.append((t, True))
        for inp in t._ctx.inputs:
            if inp is None or not inp.requires_grad:
                continue
            if inp._ctx is None:
                leaf_edges[id(inp)] = leaf_edges.get(id(inp), 0) + 1
            elif id(inp) not in visited:
                stack.append((inp, False))
    order.reverse()
    return order, leaf_edges


def _accumulate(grads: dict, t, g) -> None:
    key = id(t)
    if key in grads:
        grads[key] = grads[key] + g
    else:
        grads[key] = g


def _finish_leaf(leaf, g) -> None:
    """The leaf's gradient for this backward is complete: hooks, accumulate into .grad, notify.

    Post-accumulate hooks fire even when no gradient reached the leaf (``g is None``), so code
    that waits for "every parameter is ready" is not left waiting for an unused one."""
    if g is not None:
        for hook in leaf._hooks:
            new = hook(g)
            if new is not None:
                g = new
    if g is not None:
        if g.dtype != leaf.data.dtype:
            g = g.astype(leaf.data.dtype)
        if leaf.grad is None:
            # Own the array: backward functions may hand the same array to several inputs.
            leaf.grad = g.copy()
        else:
            leaf.grad += g
    for hook in leaf._post_accumulate_hooks:
        hook(leaf)


def _seed(root, grad):
    """The gradient a backward starts from: the given one, or 1 (the loss scale) for a scalar."""
    if not root.requires_grad:
        if not is_grad_enabled():  # e.g. a recomputation inside a Function's backward
            raise RuntimeError(
                "backward() on a tensor that does not require grad, computed while gradients were off: "
                "the engine runs every Function's backward under no_grad() (so that a backward builds no "
                "graph of its own), and so does no_grad() itself. A backward that needs a graph of its own "
                "(a recomputed forward) must build it under enable_grad()."
            )
        raise RuntimeError(
            "backward() on a tensor that does not require grad: no parameter it depends on has "
            "requires_grad=True (or it was computed under no_grad())."
        )
    if grad is None:
        if root.data.size != 1:
            raise RuntimeError(
                f"backward() without a gradient needs a scalar output, got shape {root.shape}; "
                "pass grad= with the output's shape, or reduce the output first (e.g. .sum())."
            )
        return xp.full_like(root.data, _GradMode.loss_scale)  # 1, or the loss scale (loss_scaling)
    grad = grad.data if hasattr(grad, "_ctx") else xp.asarray(grad, dtype=root.data.dtype)
    if grad.shape != root.shape:
        raise ValueError(f"grad has shape {grad.shape}, but the output has shape {root.shape}")
    return grad


def backward(root, grad=None, retain_graph: bool = False) -> None:
    """Compute d(root)/d(leaf) for every leaf that requires grad; add it to ``leaf.grad``."""
    grad = _seed(root, grad)
    if root._ctx is None:  # backward on a leaf: its gradient is the given one
        _finish_leaf(root, grad)
        return
    order, leaf_edges = _topological_order(root)
    _walk([(t, None, _ALL) for t in order], {id(root): grad}, leaf_edges, retain_graph)


# Which inputs of a node one pass of the walk hands gradients to.
_ALL, _INPUTS, _WEIGHTS = "all", "inputs", "weights"


def _walk(steps, grads: dict, leaf_edges: dict, retain_graph: bool, keep=None) -> None:
    """Run the backward of each step ``(tensor, given gradient or None, side)`` in order.

    ``side`` says which of the node's inputs get their gradient now: all of them, only those on
    the path to the inputs (B), or only the others (W). A node's gradient is complete when its
    turn comes (every node that uses it comes earlier in ``order``), so the walk is the same
    dependency count for any side. ``keep`` (B only) collects the steps whose W is still to run."""
    with no_grad():
        for t, given, side in steps:
            ctx = t._ctx
            g = given if given is not None else grads.pop(id(t), None)
            if g is not None and given is None:
                for hook in t._hooks:
                    new = hook(g)
                    if new is not None:
                        g = new
            if ctx.saved is None:
                raise RuntimeError(
                    f"backward through {ctx.fn.__name__} a second time: its saved arrays were "
                    "freed by the first backward. Pass retain_graph=True to the first call."
                )
            wanted = None if side == _ALL else _wanted(ctx, side)  # None: every input (a full backward)
            if g is None:
                in_grads = (None,) * len(ctx.inputs)
            else:
                seconds = _op_seconds[0]
                start = time.perf_counter() if seconds is not None else 0.0
                in_grads = _op_backward(ctx, g, wanted)
                if seconds is not None:
                    _add_seconds(seconds, ctx.fn, "backward", start)
                if not isinstance(in_grads, tuple):
                    in_grads = (in_grads,)
            later = keep is not None and any(
                inp is not None and inp.requires_grad and not w for inp, w in zip(ctx.inputs, wanted)
            )
            if later:
                keep.append((t, g, _WEIGHTS))  # its saved arrays stay until W has used them
            elif not retain_graph:
                ctx.release()
            for i, (inp, ig) in enumerate(zip(ctx.inputs, in_grads)):
                if inp is None or not inp.requires_grad or (wanted is not None and not wanted[i]):
                    continue
                if ig is not None:
                    if ig.dtype != inp.data.dtype:  # a gradient has its tensor's dtype
                        ig = ig.astype(inp.data.dtype)
                    _accumulate(grads, inp, ig)
                if inp._ctx is None:
                    key = id(inp)
                    leaf_edges[key] -= 1
                    if leaf_edges[key] == 0:
                        _finish_leaf(inp, grads.pop(key, None))


def _op_backward(ctx, g, wanted):
    """The op's backward; in one pass of a split backward it computes only the gradients of the
    ``wanted`` inputs (every op's backward honours ``ctx.needs_input_grad``)."""
    if wanted is None:
        return ctx.fn.backward(ctx, g)
    full = ctx.needs_input_grad
    ctx.needs_input_grad = tuple(n and w for n, w in zip(full, wanted))
    try:
        return ctx.fn.backward(ctx, g)
    finally:
        ctx.needs_input_grad = full


def _wanted(ctx, side) -> tuple:
    """Per input of ``ctx``: does it get its gradient in this pass (B: the inputs', W: the rest)?"""
    on_path = ctx.on_input_path
    return tuple(on_path[i] == (side == _INPUTS) for i in range(len(ctx.inputs)))


# --------------------------------------------------------------------------------------------
# Backward in two phases: B (the inputs' gradients) now, W (the weights') later
#
# A backward is two different computations. From the output back to a stage's input, each op
# hands back d(loss)/d(its input): that chain is B, and the previous pipeline stage waits for its
# end. Each op with weights also computes d(loss)/d(weight) from the same output gradient and its
# saved input: that is W, and nobody waits for it until the optimizer step. ``backward_inputs``
# runs B only, keeping every node's output gradient that W needs, and returns the W work:
#
#     x ─► Linear(w1) ─► GELU ─► Linear(w2) ─► out        B:  out ─► g·w2ᵀ ─► GELU' ─► ·w1ᵀ ─► x.grad
#                                                         W:  xᵀ·g1 ─► w1.grad,  hᵀ·g2 ─► w2.grad
#
# Each op's backward already computes only what ``ctx.needs_input_grad`` asks for, so B asks each
# op on the path for its path inputs' gradients, W asks the same op (same output gradient) for
# the rest. Every op computes each input's gradient on its own, and W walks the nodes in the
# order the full backward does, so every gradient comes out bit for bit the one full backward
# gives (tests/autograd/test_split_backward.py). A Function whose backward cannot be cut in two
# (``split_backward = False``: a recomputed segment runs its whole block's backward at once)
# runs whole in B.


class WeightGradients:
    """The W half of a split backward: call it (once) to add the weight gradients to ``.grad``."""

    def __init__(self, steps, grads, leaf_edges, leaf=None):
        self.steps, self.grads, self.leaf_edges = steps, grads, leaf_edges
        self.leaf = leaf  # (leaf, gradient) when the root itself was a weight

    def __call__(self) -> None:
        if self.steps is None:
            raise RuntimeError("this backward's weight gradients were computed already (W runs once)")
        steps, self.steps = self.steps, None
        if self.leaf is not None:
            _finish_leaf(*self.leaf)
        _walk(steps, self.grads, self.leaf_edges, retain_graph=False)
        self.grads = self.leaf_edges = self.leaf = None


def backward_inputs(root, inputs, grad=None) -> WeightGradients:
    """B: d(root)/d(x) into ``x.grad`` for each leaf x in ``inputs``; returns W, the rest of the
    backward (every other leaf's gradient), to call later. Together they give exactly the
    gradients of ``backward(root, grad)``."""
    grad = _seed(root, grad)
    wanted = {id(x) for x in inputs}
    if root._ctx is None:  # a leaf: it is an input (B finishes it) or a weight (W does)
        if id(root) in wanted:
            _finish_leaf(root, grad)
            return WeightGradients([], {}, {})
        return WeightGradients([], {}, {}, leaf=(root, grad))
    order, leaf_edges = _topological_order(root)
    path = _mark_input_path(order, wanted)
    grads = {id(root): grad}
    deferred = []
    _walk([(t, None, _INPUTS) for t in order if id(t) in path], grads, leaf_edges, False, keep=deferred)
    # W: the nodes B left weight work on, and the nodes off the path, in the full backward's order
    position = {id(t): i for i, t in enumerate(order)}
    steps = deferred + [(t, None, _ALL) for t in order if id(t) not in path]
    steps.sort(key=lambda step: position[id(step[0])])
    return WeightGradients(steps, grads, leaf_edges)


def _mark_input_path(order, wanted: set) -> set:
    """Ids of the nodes from which one of the ``wanted`` leaves is reached; on each node's context,
    ``on_input_path[i]``: does input i lead there (it is such a node, or a wanted leaf)?"""
    path: set = set()
    for t in reversed(order):  # the tensors a node was made from come first
        ctx = t._ctx
        whole = not getattr(ctx.fn, "split_backward", True)
        ctx.on_input_path = tuple(
            inp is not None and (whole or id(inp) in wanted or id(inp) in path) for inp in ctx.inputs
        )
        if any(ctx.on_input_path):
            path.add(id(t))
    return path
