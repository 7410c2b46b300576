"""``Module``: a container of parameters and sub-modules, found by attribute, like PyTorch's.

Assigning a ``Parameter`` or a ``Module`` to an attribute registers it; ``named_parameters()``
walks the tree in assignment order, which is also the order of ``state_dict()``. Parallel
strategies rely on that order being the same on every rank.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

from tinytrain.autograd import Parameter
from tinytrain.backend import to_host, xp


class Module:
    def __init__(self):
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "training", True)

    def __setattr__(self, name, value):
        if "_parameters" not in self.__dict__:
            raise RuntimeError(f"{type(self).__name__}.__init__ must call super().__init__() first")
        self._parameters.pop(name, None)
        self._modules.pop(name, None)
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        self._parameters.pop(name, None)
        self._modules.pop(name, None)
        object.__delattr__(self, name)

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} does not define forward()")

    # Activation recomputation (``tinytrain.nn.recompute``): None, or a function (module, *args)
    # that runs this module's forward as one recomputed segment (``autograd.checkpoint``).
    recompute_fn = None

    def __call__(self, *args, **kwargs):
        if self.recompute_fn is not None:
            return self.recompute_fn(self, *args, **kwargs)
        return self.forward(*args, **kwargs)

    # --- the tree ---------------------------------------------------------------------------

    def children(self):
        return iter(self._modules.values())

    def named_modules(self, prefix: str = ""):
        yield prefix, self
        for name, child in self._modules.items():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def modules(self):
        return (m for _, m in self.named_modules())

    def named_parameters(self, prefix: str = ""):
        """(dotted name, Parameter) pairs; a parameter shared by two modules appears once."""
        seen = set()
        for mod_name, module in self.named_modules(prefix):
            for name, p in module._parameters.items():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{mod_name}.{name}" if mod_name else name), p

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def num_parameters(self) -> int:
        return sum(p.size for p in self.parameters())

    # --- modes and gradients ----------------------------------------------------------------

    def train(self, mode: bool = True) -> Module:
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> Module:
        return self.train(False)

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def to(self, dtype) -> Module:
        """Cast every parameter to ``dtype`` in place (``--precision``: float16, or ml_dtypes'
        bfloat16), dropping gradients; the activations follow, since every op keeps its inputs'
        dtype. Returns the module."""
        for p in self.parameters():
            if p.data.dtype != dtype:
                p.data = p.data.astype(dtype)
            p.grad = None
        return self

    # --- state ------------------------------------------------------------------------------

    def state_dict(self) -> OrderedDict[str, object]:
        """Parameter name -> host (NumPy) copy of its values."""
        return OrderedDict((name, to_host(p.data).copy()) for name, p in self.named_parameters())

    def load_state_dict(self, state, strict: bool = True) -> None:
        params = dict(self.named_parameters())
        if strict:
            missing = sorted(set(params) - set(state))
            unexpected = sorted(set(state) - set(params))
            if missing or unexpected:
                raise KeyError(f"state_dict mismatch: missing {missing}, unexpected {unexpected}")
        for name, value in state.items():
            if name not in params:
                continue
            p = params[name]
            if tuple(value.shape) != p.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model shape {p.shape}")
            p.data[...] = xp.asarray(value, dtype=p.dtype)

    def extra_repr(self) -> str:
        return ""

    def __repr__(self):
        lines = [f"{type(self).__name__}({self.extra_repr()}"]
        for name, child in self._modules.items():
            lines.append("  (" + name + "): " + repr(child).replace("\n", "\n  "))
        return "\n".join(lines) + ")" if len(lines) > 1 else lines[0] + ")"


class ModuleList(Module):
    """A list of modules, registered under the names "0", "1", ..."""

    def __init__(self, modules=()):
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, module: Module) -> None:
        setattr(self, str(len(self._modules)), module)

    def __getitem__(self, i):
        return list(self._modules.values())[i]

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self):
        return len(self._modules)


@contextlib.contextmanager
def swapped(modules, attr: str, value):
    """Inside: every module's ``attr`` is ``value``; each gets its own value back on leaving. How a
    parallel chapter plugs into a serial model for one forward (``attention_fn``, ``forward_fn``)."""
    previous = [getattr(m, attr) for m in modules]
    for m in modules:
        setattr(m, attr, value)
    try:
        yield
    finally:
        for m, old in zip(modules, previous):
            setattr(m, attr, old)
