"""Explicit, seeded randomness.

Two global generators, both reset by ``manual_seed``:

- the *host* generator (NumPy, whatever the backend) initializes parameters, so a CPU run and a GPU
  run of the same seed start from the same weights;
- the *device* generator (``xp``) draws dropout masks where they are used.

Code that needs its own stream (a data sampler, a tensor-parallel region) creates one with
``generator(seed)`` so that streams never disturb each other.
"""

from __future__ import annotations

import numpy

from tinytrain.backend import default_rng

_state = {"device": default_rng(0), "host": numpy.random.default_rng(0)}


def manual_seed(seed) -> None:
    """Reset both global generators from ``seed`` (an int, or a tuple such as ``(seed, step)``)."""
    _state["device"] = default_rng(seed)
    _state["host"] = numpy.random.default_rng(seed)


def generator(seed):
    """A new device (``xp``) generator from ``seed``, independent of the global ones."""
    return default_rng(seed)


def default_generator():
    """The global device generator (dropout masks when no generator is given)."""
    return _state["device"]


def host_generator():
    """The global host generator (parameter initialization when no ``rng`` is given)."""
    return _state["host"]
