"""Explicit, seeded randomness.

Two global generators, both reset by ``manual_seed``:

- the *host* generator (NumPy, whatever the backend) initializes parameters, so a CPU run and a GPU
  run of the same seed start from the same weights;
- the *device* generator (``xp``) draws dropout masks where they are used.

Code that needs its own stream (a data sampler) creates one with ``generator(seed)`` so that
streams never disturb each other.

Dropout under any parallel layout draws exactly the serial model's masks. Two things make it so:

- each dropout *site* (a named module: ``blocks.3.mlp.dropout``) draws from its own generator,
  keyed by (the seed given to ``manual_seed``, the site's name): ``dropout_generator(site)``. A
  mask therefore does not depend on which sites ran before it on this rank — a pipeline stage
  that never runs block 0, or ZeRO-3 recomputing a layer in backward, draws the same mask;
- a rank that computes only some rows of the global batch (a data-parallel replica, a pipeline
  micro-batch) says so with ``with batch_rows(first, total):``; dropout then draws the mask of the
  whole batch and keeps its rows (``functional.dropout``). A rank that holds only some positions
  of every sequence (context parallel) says so with ``with sequence_positions(positions, total):``.

Activation recomputation (``tinytrain.autograd.checkpoint``) runs a segment's forward again in
backward, where a pipeline is outside the micro-batch's ``batch_rows``: it keeps ``snapshot()`` of
these settings at forward time and recomputes inside ``restored(snapshot)``, so every site draws
its forward mask again. Inside a segment (``in_segment()``) a dropout must have a site: the global
generator has moved on by backward and could not draw the same mask twice.
"""

from __future__ import annotations

import contextlib
import zlib

import numpy

from tinytrain.backend import default_rng

_state = {
    "device": default_rng(0),
    "host": numpy.random.default_rng(0),
    "seed": (0,),
    "rows": None,
    "positions": None,
    "segments": 0,  # recomputed segments (tinytrain.autograd.checkpoint) now running
}


def manual_seed(seed) -> None:
    """Reset both global generators from ``seed`` (an int, or a tuple such as ``(seed, step)``)."""
    _state["device"] = default_rng(seed)
    _state["host"] = numpy.random.default_rng(seed)
    _state["seed"] = tuple(seed) if isinstance(seed, (tuple, list)) else (seed,)


def current_seed() -> tuple:
    """The seed given to the last ``manual_seed``, as a tuple: ``(seed, step)`` inside the training
    loop's step (federated averaging draws its round's clients and batches from it)."""
    return _state["seed"]


def dropout_generator(site: str):
    """The generator of one dropout site: a pure function of the current seed and ``site``."""
    return default_rng((*_state["seed"], zlib.crc32(site.encode())))


@contextlib.contextmanager
def _setting(key: str, value):
    """Inside, ``_state[key]`` is ``value``; the outer value comes back on leaving."""
    previous, _state[key] = _state[key], value
    try:
        yield
    finally:
        _state[key] = previous


def batch_rows(first: int, total: int):
    """Inside, the arrays this rank computes are rows ``first, first+1, ...`` of a batch of ``total``."""
    if not 0 <= first < total:
        raise ValueError(f"batch_rows: first row {first} is outside a batch of {total} rows")
    return _setting("rows", (first, total))


def current_batch_rows():
    """``(first, total)`` set by the innermost ``batch_rows``, or None (this rank has the whole batch)."""
    return _state["rows"]


def generator(seed):
    """A new device (``xp``) generator from ``seed``, independent of the global ones."""
    return default_rng(seed)


def default_generator():
    """The global device generator (dropout masks when no generator is given)."""
    return _state["device"]


def host_generator():
    """The global host generator (parameter initialization when no ``rng`` is given)."""
    return _state["host"]


def sequence_positions(positions, total: int):
    """Inside, the arrays this rank computes hold sequence positions ``positions`` (axis 1, sorted
    integers) of sequences of ``total`` positions."""
    positions = numpy.asarray(positions)
    if positions.size and not (0 <= positions.min() and positions.max() < total):
        raise ValueError(f"sequence_positions: positions outside a sequence of {total}")
    return _setting("positions", (positions, total))


def current_sequence_positions():
    """``(positions, total)`` set by the innermost ``sequence_positions``, or None."""
    return _state["positions"]


# --- activation recomputation: the same masks in a segment's forward and in its recompute -------

_MASK_SETTINGS = ("seed", "rows", "positions")


def snapshot() -> dict:
    """What a site's dropout mask depends on besides the site: the seed, ``batch_rows`` and
    ``sequence_positions`` in effect now (a checkpoint keeps it from its forward)."""
    return {key: _state[key] for key in _MASK_SETTINGS}


@contextlib.contextmanager
def restored(settings: dict):
    """Inside, the settings of ``snapshot()`` are ``settings``; the current ones come back on leaving."""
    previous = snapshot()
    _state.update(settings)
    try:
        yield
    finally:
        _state.update(previous)


@contextlib.contextmanager
def segment():
    """Inside: a recomputed segment runs (its forward, or its recompute in backward)."""
    _state["segments"] += 1
    try:
        yield
    finally:
        _state["segments"] -= 1


def in_segment() -> bool:
    """Whether a recomputed segment is running: a random draw here must be one it can repeat."""
    return _state["segments"] > 0
