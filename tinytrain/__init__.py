"""tinytrain: learn distributed training by building it.

The layers, from the bottom: ``backend`` (NumPy or CuPy), ``autograd`` (Tensor, Function),
``nn`` and ``optim``, ``distributed`` (hand-written collectives), ``parallel`` (one file per
strategy). See the repository's README for the map.

The names below are imported on first use, not with the package: importing any submodule (the
``tinytrain`` command's ``tinytrain.cli`` above all) must not choose the device yet, so that a bad
``TINYTRAIN_DEVICE`` fails inside the command, which can say so in one sentence.
"""

import importlib

__version__ = "0.1.0"

# exported name -> the module that defines it
_EXPORTS = {
    "Function": "tinytrain.autograd",
    "Parameter": "tinytrain.autograd",
    "Tensor": "tinytrain.autograd",
    "no_grad": "tinytrain.autograd",
    "saved_bytes": "tinytrain.autograd",
    "tensor": "tinytrain.autograd",
    "manual_seed": "tinytrain.random",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tinytrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
