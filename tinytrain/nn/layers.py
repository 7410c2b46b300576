"""The basic layers: Linear, Embedding, LayerNorm, Dropout, and the MLP built from them.

Weights are drawn on the host from a seeded NumPy generator (``rng``) and then moved to the
backend, so every rank and every device that uses the same seed starts from the same numbers.
``Linear`` stores its weight as (in_features, out_features) so that ``y = x @ W``: a *column*
split of W (tensor parallel) is then literally a split along W's columns.
"""

from __future__ import annotations

import numpy

from tinytrain import functional as F
from tinytrain import random as _random
from tinytrain.autograd import Parameter, Tensor
from tinytrain.backend import xp
from tinytrain.nn.module import Module


def _positive_int(name: str, value) -> int:
    if not isinstance(value, (int, numpy.integer)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def normal_parameter(shape, std: float, rng=None) -> Parameter:
    """A float32 Parameter with entries drawn from N(0, std²) on the host generator ``rng``."""
    rng = rng or _random.host_generator()
    return Parameter(xp.asarray(rng.normal(0.0, std, size=shape).astype(numpy.float32)))


class Linear(Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, std: float = 0.02, rng=None):
        super().__init__()
        self.in_features = _positive_int("in_features", in_features)
        self.out_features = _positive_int("out_features", out_features)
        self.weight = normal_parameter((in_features, out_features), std, rng)
        self.bias = Parameter(xp.zeros(out_features, dtype=xp.float32)) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self):
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}"


class Embedding(Module):
    def __init__(self, num_embeddings: int, dim: int, std: float = 0.02, rng=None):
        super().__init__()
        self.num_embeddings = _positive_int("num_embeddings", num_embeddings)
        self.dim = _positive_int("dim", dim)
        self.weight = normal_parameter((num_embeddings, dim), std, rng)

    def forward(self, ids):
        ids = xp.asarray(ids.data if isinstance(ids, Tensor) else ids)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(
                f"embedding ids must lie in [0, {self.num_embeddings}), got values in "
                f"[{int(ids.min())}, {int(ids.max())}]"
            )
        return F.embedding(ids, self.weight)

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.dim}"


class LayerNorm(Module):
    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.dim = _positive_int("dim", dim)
        self.eps = eps
        self.weight = Parameter(xp.ones(dim, dtype=xp.float32))
        self.bias = Parameter(xp.zeros(dim, dtype=xp.float32)) if bias else None

    def forward(self, x):
        if x.shape[-1] != self.dim:
            raise ValueError(f"LayerNorm({self.dim}) got input with last axis {x.shape[-1]}")
        return F.layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self):
        return f"{self.dim}"


class Dropout(Module):
    """``site``: this module's name in its model (``GPT`` sets it), which keys its masks so that
    every parallel layout draws the serial model's masks (see ``tinytrain.random``)."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.site = None

    def forward(self, x, generator=None):
        return F.dropout(x, self.p, self.training, generator, site=self.site)

    def extra_repr(self):
        return f"p={self.p}"


class MLP(Module):
    """fc_1, gelu, fc_2, dropout: the feed-forward half of a transformer block (and one MoE expert)."""

    def __init__(self, n_embd: int, hidden: int, dropout: float = 0.0, bias: bool = True, proj_std=0.02, rng=None):
        super().__init__()
        self.fc_1 = Linear(n_embd, hidden, bias, rng=rng)
        self.fc_2 = Linear(hidden, n_embd, bias, std=proj_std, rng=rng)
        self.dropout = Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.fc_2(F.gelu(self.fc_1(x))))
