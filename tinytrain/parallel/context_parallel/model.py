"""How a model uses context parallel: swap each attention's function, feed each rank its positions.

CP shards *activations along the sequence*, never weights: every rank of the CP group keeps the
serial model's parameters and computes on T/N of the tokens. Only attention mixes positions, so
only attention talks; everything else (embeddings, LayerNorm, MLP, the loss) is per-token::

    cp = apply_context_parallel(model, group, algo="ring", split="zigzag")
    pos = cp.positions(T)                        # my T/N positions (sorted)
    loss = model.loss(x[:, pos], y[:, pos], denominator=<targets in the whole batch>, positions=pos)
    loss.backward()                              # then sum every gradient over the CP group

The position embedding takes ``positions`` (wpe rows), each ``attention_fn`` computes causal
attention over the whole sequence for my queries; so the losses of the N ranks add up to the
serial loss, and each weight's gradients, summed over the group, are the serial gradient.
Composes with tensor parallel: a ``TensorParallelGPT``'s attention runs CP on its local heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy

from tinytrain import distributed as dist
from tinytrain.nn.module import swapped
from tinytrain.nn.transformer import CausalSelfAttention
from tinytrain.parallel.context_parallel.ring import ring_attention
from tinytrain.parallel.context_parallel.split import check_split, positions
from tinytrain.parallel.context_parallel.ulysses import alltoall_attention, check_heads
from tinytrain.parallel.tensor_parallel.layers import ParallelAttention

ALGOS = ("ring", "alltoall")


@dataclass(frozen=True, eq=False)
class ContextParallel:
    """The CP settings of a model: its group, the attention algorithm and the sequence split."""

    group: object
    algo: str = "ring"
    split: str = "zigzag"
    modules: tuple = ()  # the attention modules whose attention_fn is ours

    def serial(self):
        """Inside: the modules attend over the whole sequence they are given (rank-local evaluation on
        full sequences, sampling), as the serial model does; their attention again on leaving."""
        return swapped(self.modules, "attention_fn", None)

    def active(self):
        """Inside: the modules run CP attention; their previous attention again on leaving. A
        training loop that evaluates the serial model on one rank turns CP on for its steps only."""
        return swapped(self.modules, "attention_fn", self.attention)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def positions(self, seq_len: int) -> numpy.ndarray:
        """This rank's sequence positions (sorted); a ValueError says what to change if they don't split."""
        return positions(seq_len, self.rank, self.size, self.split)

    def attention(self, q, k, v):
        """Causal attention over the whole sequence for my positions' q, k, v (B, H, T/N, D)."""
        if self.algo == "ring":
            return ring_attention(q, k, v, group=self.group, split=self.split)
        return alltoall_attention(q, k, v, group=self.group, split=self.split)


def apply_context_parallel(model, group, algo: str = "ring", split: str = "zigzag") -> ContextParallel:
    """Make every attention of ``model`` (a ``GPT`` or a ``TensorParallelGPT``) context parallel over
    ``group``; returns the :class:`ContextParallel` whose ``positions(T)`` say which tokens to feed."""
    if algo not in ALGOS:
        raise ValueError(f"algo={algo!r} is not a context-parallel attention; use one of {ALGOS}")
    check_split(split)
    attentions = [m for m in model.modules() if isinstance(m, (CausalSelfAttention, ParallelAttention))]
    cp = ContextParallel(group, algo, split, tuple(attentions))
    if not attentions:
        raise ValueError(f"{type(model).__name__} has no attention module to make context parallel")
    for attn in attentions:
        if algo == "alltoall":
            check_heads(attn.n_head, cp.size)  # refused now, not in the first forward
        attn.attention_fn = cp.attention
    return cp
