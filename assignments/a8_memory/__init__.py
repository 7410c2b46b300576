# Assignment 8: Memory (handout: assignments/a8_memory.md).
# Generated from tinytrain/memory.py by `python -m grader stubs`. Replace each
# `raise NotImplementedError("TODO ...")` with your code; grade it with `python -m grader`.

"""The memory wall (显存墙): what a training step holds, and the three ways tinytrain holds less.

A model of Ψ parameters trained with AdamW in float32 holds 4Ψ bytes of weights, 4Ψ of gradients
and 8Ψ of optimizer state (two moments), before a single activation: GPT-3's 175 billion
parameters are 700 GB of weights alone. Activations grow with batch × sequence × layers besides.
Three techniques of this chapter trade something for memory, on one GPU, before any sharding::

    what is held                   how much less                       what it costs
    activations (each layer's)     activation recomputation:           one more forward of the
                                   keep a segment's inputs, drop its   segment in backward
                                   graph, recompute it in backward
                                   (``checkpoint``, autograd/checkpoint.py; ``--recompute``)
    weights, gradients,            mixed precision: 16-bit weights,    a float32 master copy of
    activations                    gradients and activations (2 bytes) every weight in the
                                   (``Optimizer.update``, optim.py;    optimizer state:
                                   ``--precision bf16|fp16``)          2Ψ + 2Ψ + 12Ψ bytes
    float16's small gradients      dynamic loss scaling: backward on   a step skipped (and the
    (below 2^-24 they round to 0)  loss × S, the optimizer divides by  scale halved) when S made
                                   S; an inf/NaN skips the step        a gradient overflow
                                   (``LossScaler``, optim.py)

The code lives where it runs: the checkpoint in the autograd package, the master weights and the
loss scaler in the optimizers. This module names the chapter's parts in one place; it is also the
front of assignment 8 (``assignments/a8_memory/``, handout ``assignments/a8_memory.md``), whose
package holds a copy of each of those files.
"""

from __future__ import annotations

from assignments.a8_memory.checkpoint import checkpoint
from assignments.a8_memory.optim import SGD, AdamW, LossScaler, Optimizer, grads_finite

__all__ = ["SGD", "AdamW", "LossScaler", "Optimizer", "checkpoint", "grads_finite"]
