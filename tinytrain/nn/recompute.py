"""Activation recomputation for a GPT: which segments are recomputed in backward (``--recompute``).

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"): a
layer's activations are kept from forward to backward unless recomputed. tinytrain's modes, each
a ``tinytrain.autograd.checkpoint`` around another segment::

    none        every activation of every block kept                    (the default)
    selective   per block the attention core recomputed:                keeps q, k, v, drops the
                (q, k, v) -> softmax(q·kᵀ/√d)·v                          (B, H, T, T) probabilities
    full        per block the whole block recomputed: x -> block(x)     keeps only x

    block, full:       x ─┬─ ln_1 ─ q,k,v ─ [core] ─ proj ─ dropout ─(+)─┬─ ln_2 ─ fc_1 ─ gelu ─ fc_2 ─ dropout ─(+)─► y
                          └──────────────────────────────────────────────┘└──────────────────────────────────────┘
                       └────────────────────────── one checkpoint: keeps x, recomputed in backward ───────────────┘
    block, selective:  [core] alone is a checkpoint: keeps q, k, v

``apply_recompute(model, mode)`` sets it on any model with ``blocks`` (a ``GPT``, a tensor-parallel
GPT): full through each block's ``recompute_fn`` (``Module.__call__``), selective through each
attention module's ``attention_fn`` (a :class:`~tinytrain.nn.transformer.RecomputedAttention` around
the one it had). Whoever calls a block or an attention (the serial model, a pipeline stage, ZeRO-3's
units) then recomputes. A parallel chapter that swaps ``attention_fn`` for a step (context parallel)
wraps its own in :func:`recomputed_attention` for that step.

The bytes each block keeps, per mode and layout, are ``parallel/costs.tinytrain_activation_bytes``
(the engine's ``saved_bytes()`` measures exactly that: ``tests/core/test_recompute.py``).
"""

from __future__ import annotations

import contextlib

from tinytrain.autograd import checkpoint
from tinytrain.nn.moe import MoE
from tinytrain.nn.transformer import RecomputedAttention

MODES = ("none", "selective", "full")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"--recompute takes none, selective or full, got {mode!r}")
    return mode


def apply_recompute(model, mode: str) -> None:
    """Make every block of ``model`` recompute in backward as ``mode`` says ("none" undoes it)."""
    check_mode(mode)
    for block in model.blocks:
        block.recompute_fn = recompute_block if mode == "full" else None
    for m in model.modules():
        if hasattr(m, "attention_fn"):
            inner = unwrapped(m.attention_fn)
            m.attention_fn = RecomputedAttention(inner) if mode == "selective" else inner


def unwrapped(attention_fn):
    """The attention function inside a ``RecomputedAttention`` (or the function itself)."""
    return attention_fn.inner if isinstance(attention_fn, RecomputedAttention) else attention_fn


@contextlib.contextmanager
def recomputed_attention(modules):
    """Inside: each module's current ``attention_fn`` runs as a recomputed core (context parallel
    sets its own for a step: this wraps it for that step); each gets its own back on leaving."""
    previous = [m.attention_fn for m in modules]
    for m in modules:
        m.attention_fn = RecomputedAttention(unwrapped(m.attention_fn))
    try:
        yield
    finally:
        for m, fn in zip(modules, previous):
            m.attention_fn = fn


def recompute_block(block, x):
    """``block(x)`` as one checkpoint (a block's ``recompute_fn`` under ``--recompute full``). A
    mixture of experts leaves a second output, its load-balancing loss (``MoE.aux_loss``, which
    ``GPT.loss`` adds): it leaves the checkpoint as an output too, so its gradient reaches the
    gate through the recompute."""
    moes = [m for m in block.modules() if isinstance(m, MoE)]
    if not moes:
        return checkpoint(block.forward, x)

    def forward_and_aux(x):
        return (block.forward(x), *(m.aux_loss for m in moes))

    y, *aux = checkpoint(forward_and_aux, x)
    for m, loss in zip(moes, aux):
        m.aux_loss = loss
    return y
