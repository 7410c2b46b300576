"""A small reverse-mode autograd engine on NumPy/CuPy arrays (see ``engine`` for how it works)."""

from tinytrain.autograd.checkpoint import checkpoint
from tinytrain.autograd.engine import (
    Context,
    Function,
    WeightGradients,
    backward_inputs,
    enable_grad,
    is_grad_enabled,
    loss_scaling,
    no_grad,
    op_timer,
    peak_saved_bytes,
    reset_peak_saved_bytes,
    saved_bytes,
    timed,
)
from tinytrain.autograd.tensor import Parameter, Tensor, ones, tensor, zeros

__all__ = [
    "Context",
    "Function",
    "Parameter",
    "Tensor",
    "WeightGradients",
    "backward_inputs",
    "checkpoint",
    "enable_grad",
    "is_grad_enabled",
    "loss_scaling",
    "no_grad",
    "op_timer",
    "ones",
    "peak_saved_bytes",
    "reset_peak_saved_bytes",
    "saved_bytes",
    "tensor",
    "timed",
    "zeros",
]
