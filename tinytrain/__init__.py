"""tinytrain: learn distributed training by building it.

The layers, from the bottom: ``backend`` (NumPy or CuPy), ``autograd`` (Tensor, Function),
``nn`` and ``optim``, ``distributed`` (hand-written collectives), ``parallel`` (one file per
strategy). See the repository's README for the map.
"""

from tinytrain.autograd import Function, Parameter, Tensor, no_grad, saved_bytes, tensor
from tinytrain.random import manual_seed

__version__ = "0.1.0"
__all__ = ["Function", "Parameter", "Tensor", "manual_seed", "no_grad", "saved_bytes", "tensor"]
