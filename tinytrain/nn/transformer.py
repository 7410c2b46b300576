"""A GPT: token + position embeddings, pre-LayerNorm transformer blocks, a tied output head.

    ids (B, T) ─ wte + wpe ─ dropout ─► [ Block ] × n_layer ─ ln_f ─ head ─► logits (B, T, vocab)

    Block:  x = x + dropout(proj(attention(ln_1(x))))
            x = x + dropout(fc_2(gelu(fc_1(ln_2(x)))))        (or a mixture of experts)

Every parallel strategy in ``tinytrain.parallel`` splits this same model, and its tests compare
against it, so it is deliberately plain: no fused QKV, no attention-probability dropout (dropout
is applied where a sequence-parallel rank can reproduce the serial mask), weight layout (in, out).

Inference has a second path beside ``forward``: ``GPT.decode`` with a ``KVCache`` keeps each
layer's keys and values, so a new token costs one position's work instead of the whole context's.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import partial

import numpy

from tinytrain import functional as F
from tinytrain.autograd import Tensor, checkpoint
from tinytrain.backend import xp
from tinytrain.nn.layers import MLP, Dropout, Embedding, LayerNorm, Linear  # noqa: F401 (MLP re-exported)
from tinytrain.nn.module import Module, ModuleList


@dataclass
class GPTConfig:
    vocab_size: int = 32
    block_size: int = 32
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True
    n_experts: int = 0  # > 0: every block's MLP is a mixture of this many experts
    moe_top_k: int = 2
    moe_capacity_factor: float = 0.0  # 0: no capacity limit (no token is dropped)
    moe_z_loss: float = 0.0  # weight of the router z-loss inside the MoE aux loss (0: off)
    moe_aux_weight: float = 0.01  # weight of the MoE load-balancing loss in GPT.loss (balance "aux")
    moe_balance: str = "aux"  # "aux" loss, "bias" (DeepSeek-V3's loss-free routing bias) or "none"
    moe_bias_rate: float = 1e-3  # balance "bias": how far a step moves an expert's bias

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}: each head gets "
                f"n_embd/n_head channels. Choose n_head among {_divisors(self.n_embd)}."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.moe_balance not in ("aux", "bias", "none"):
            raise ValueError(f"moe_balance must be aux, bias or none, got {self.moe_balance!r}")
        if self.n_experts < 0 or (self.n_experts and not 1 <= self.moe_top_k <= self.n_experts):
            raise ValueError(f"moe_top_k={self.moe_top_k} must be between 1 and n_experts={self.n_experts}")

    def to_dict(self) -> dict:
        return asdict(self)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class CausalSelfAttention(Module):
    """Multi-head attention where position t attends to positions ≤ t."""

    def __init__(self, config: GPTConfig, rng=None):
        super().__init__()
        C = config.n_embd
        self.n_head = config.n_head
        proj_std = 0.02 / math.sqrt(2 * config.n_layer)  # GPT-2: residual projections scaled down
        self.q = Linear(C, C, config.bias, rng=rng)
        self.k = Linear(C, C, config.bias, rng=rng)
        self.v = Linear(C, C, config.bias, rng=rng)
        self.proj = Linear(C, C, config.bias, std=proj_std, rng=rng)
        self.dropout = Dropout(config.dropout)
        # Pluggable attention over (B, H, T, D) q, k, v: None is causal softmax attention on the
        # whole sequence; context parallel sets a function over this rank's sequence positions.
        self.attention_fn = None

    def split_heads(self, x):
        B, T, C = x.shape
        return x.reshape(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.split_heads(self.q(x)), self.split_heads(self.k(x)), self.split_heads(self.v(x))
        y = attend(self.attention_fn, q, k, v)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.dropout(self.proj(y))

    def decode(self, x, keys, values, start: int):
        """Inference with a key/value cache: attention of ``x`` (B, T, C), the positions ``start``
        onwards, over the earlier positions' keys and values and their own. ``keys``/``values``
        (B, H, block_size, D) hold the earlier ones; this writes its own there. T tokens at once
        into an empty cache (``start`` 0: the same computation as ``forward``), else one."""
        B, T, C = x.shape
        q, k, v = self.split_heads(self.q(x)), self.split_heads(self.k(x)), self.split_heads(self.v(x))
        end = start + T
        keys[:, :, start:end] = k.data
        values[:, :, start:end] = v.data
        if start == 0:
            y = F.scaled_dot_product_attention(q, k, v, causal=True)
        elif T == 1:  # the newest position sees every key: no mask
            y = F.scaled_dot_product_attention(q, Tensor(keys[:, :, :end]), Tensor(values[:, :, :end]), causal=False)
        else:
            raise ValueError(f"decode takes {T} positions at once only into an empty cache (it holds {start})")
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.dropout(self.proj(y))


def attend(attention_fn, q, k, v):
    """``attention_fn(q, k, v)``, or causal attention over the whole sequence when it is None."""
    if attention_fn is None:
        return F.scaled_dot_product_attention(q, k, v, causal=True)
    return attention_fn(q, k, v)


class RecomputedAttention:
    """An ``attention_fn`` whose core, (q, k, v) -> softmax(q·kᵀ/√d)·v, is recomputed in backward
    (selective activation recomputation, ``tinytrain.nn.recompute``): the core is one checkpoint
    that keeps q, k, v and drops the (B, H, T, T) probabilities. ``inner``: the core, None for
    causal attention over the whole sequence, or a parallel chapter's function (context parallel)."""

    def __init__(self, inner=None):
        self.inner = inner

    def __call__(self, q, k, v):
        return checkpoint(partial(attend, self.inner), q, k, v)

    def __repr__(self):
        return f"RecomputedAttention({self.inner!r})"


class Block(Module):
    def __init__(self, config: GPTConfig, rng=None):
        super().__init__()
        from tinytrain.nn.moe import MoE

        C = config.n_embd
        proj_std = 0.02 / math.sqrt(2 * config.n_layer)
        self.ln_1 = LayerNorm(C, bias=config.bias)
        self.attn = CausalSelfAttention(config, rng)
        self.ln_2 = LayerNorm(C, bias=config.bias)
        if config.n_experts:
            self.mlp = MoE(
                C,
                4 * C,
                config.n_experts,
                config.moe_top_k,
                config.moe_capacity_factor,
                config.dropout,
                config.bias,
                proj_std,
                rng,
                z_loss=config.moe_z_loss,
                balance=config.moe_balance,
                bias_rate=config.moe_bias_rate,
            )
        else:
            self.mlp = MLP(C, 4 * C, config.dropout, config.bias, proj_std, rng)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

    def decode(self, x, keys, values, start: int):
        """``forward`` with a key/value cache (``CausalSelfAttention.decode``)."""
        x = x + self.attn.decode(self.ln_1(x), keys, values, start)
        return x + self.mlp(self.ln_2(x))


def sequence_positions(T, positions, block_size):
    """The position of each of the ``T`` columns: ``arange(T)``, or the given ``positions`` (checked)."""
    if positions is None:
        return xp.arange(T)
    positions = xp.asarray(positions)
    if positions.shape != (T,):
        raise ValueError(f"positions has shape {positions.shape}, but ids have {T} columns: give one position each")
    if T and int(positions.max()) >= block_size:
        raise ValueError(f"position {int(positions.max())} is beyond block_size={block_size}")
    return positions


class KVCache:
    """The keys and values of the positions a GPT has seen so far, per layer, for inference
    (``GPT.decode``): each layer's (B, H, block_size, D) arrays, filled up to ``length``."""

    def __init__(self, config: GPTConfig, batch: int, dtype):
        shape = (batch, config.n_head, config.block_size, config.n_embd // config.n_head)
        self.keys = [xp.zeros(shape, dtype=dtype) for _ in range(config.n_layer)]
        self.values = [xp.zeros(shape, dtype=dtype) for _ in range(config.n_layer)]
        self.length = 0


class GPT(Module):
    """A GPT built from ``config``; ``seed`` fixes every initial weight."""

    def __init__(self, config: GPTConfig, seed: int = 0):
        super().__init__()
        self.config = config
        rng = numpy.random.default_rng(seed)
        self.wte = Embedding(config.vocab_size, config.n_embd, rng=rng)
        self.wpe = Embedding(config.block_size, config.n_embd, rng=rng)
        self.drop = Dropout(config.dropout)
        self.blocks = ModuleList(Block(config, rng) for _ in range(config.n_layer))
        self.ln_f = LayerNorm(config.n_embd, bias=config.bias)
        # Tied: the output head reuses the token embedding (transposed), as GPT-2 does.
        self.head = None if config.tie_weights else Linear(config.n_embd, config.vocab_size, False, rng=rng)
        for name, module in self.named_modules():
            if isinstance(module, Dropout):
                module.site = name  # its masks are keyed by its name: the same under every layout

    def embed(self, ids, positions=None):
        """Token plus position embeddings of ``ids`` (B, T) -> (B, T, n_embd). ``positions``: the
        global sequence positions of ``ids``' columns (context parallel); None is ``arange(T)``."""
        ids = xp.asarray(ids.data if isinstance(ids, Tensor) else ids)
        if ids.ndim != 2:
            raise ValueError(f"GPT takes token ids of shape (batch, time), got {ids.shape}")
        T = ids.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}")
        positions = sequence_positions(T, positions, self.config.block_size)
        return self.drop(self.wte(ids) + self.wpe(positions))

    def logits(self, x):
        """Final LayerNorm and output head: (B, T, n_embd) -> (B, T, vocab_size)."""
        x = self.ln_f(x)
        if self.head is None:
            return F.linear(x, self.wte.weight.T)
        return self.head(x)

    def forward(self, ids):
        return self.logits(self.hidden(ids))

    # --- inference with a key/value cache (tinytrain.sample.generate) ---------------------------

    def kv_cache(self, batch: int):
        """An empty ``KVCache`` for ``decode`` over ``batch`` rows; None where this model cannot use
        one and gives the same numbers: experts with a capacity (a forward's capacity counts all its
        tokens: one token at a time would keep others), or attention that is not this module's
        (context parallel sets ``attention_fn``; a tensor-parallel layer is another class). Recomputing
        in backward (``RecomputedAttention``, a block's ``recompute_fn``) changes no number: cached."""
        if self.config.n_experts and self.config.moe_capacity_factor:
            return None
        for block in self.blocks:
            plain = type(block) is Block and type(block.attn) is CausalSelfAttention
            fn = block.attn.attention_fn
            if isinstance(fn, RecomputedAttention):  # the same attention, recomputed in backward
                fn = fn.inner
            if not plain or fn is not None:
                return None
        return KVCache(self.config, batch, self.wte.weight.data.dtype)

    def decode(self, ids, cache):
        """Inference with a key/value cache: the logits (B, T, vocab_size) of ``ids`` (B, T), the
        positions after the ``cache.length`` ones ``cache`` holds, which then holds these too. Many
        tokens into an empty cache (the prompt), then one at a time, up to block_size positions.
        For evaluation mode under ``no_grad``; the training ``forward`` is untouched by it."""
        ids = xp.asarray(ids.data if isinstance(ids, Tensor) else ids)
        start, T = cache.length, ids.shape[-1]
        if start + T > self.config.block_size:
            raise ValueError(f"the cache holds {start} positions; {T} more exceed block_size={self.config.block_size}")
        x = self.embed(ids, positions=xp.arange(start, start + T))
        for block, keys, values in zip(self.blocks, cache.keys, cache.values):
            x = block.decode(x, keys, values, start)
        cache.length = start + T
        return self.logits(x)

    # --- what the training loop and the parallel layouts call -----------------------------------

    def loss(self, ids, targets, denominator=None, positions=None):
        """Training loss: cross-entropy over the counted targets (divided by ``denominator`` when
        given, so that replicas holding parts of a batch add up to the batch's mean), plus the MoE
        load-balancing loss (weight ``config.moe_aux_weight``) with experts. ``positions``: see ``embed``."""
        return self.head_loss(self.hidden(ids, positions), targets, denominator)

    def hidden(self, ids, positions=None):
        """The last block's output (B, T, n_embd); ``positions``: see ``embed``."""
        x = self.embed(ids, positions)
        for block in self.blocks:
            x = block(x)
        return x

    def head_loss(self, x, targets, denominator=None):
        """The loss from the last block's output ``x`` (a pipeline's last stage starts here)."""
        targets = xp.asarray(targets.data if isinstance(targets, Tensor) else targets)
        if denominator is None:
            loss = F.cross_entropy(self.logits(x), targets)
        else:
            loss = F.cross_entropy(self.logits(x), targets, reduction="sum") / denominator
        if self.config.n_experts and self.config.moe_balance == "aux":
            loss = loss + self.config.moe_aux_weight * self.moe_aux_loss()
        return loss

    # --- the pipeline's stage protocol (tinytrain.parallel.pipeline.StageModel) -----------------

    def first_parameters(self) -> list:
        """Held by the first pipeline stage besides its blocks: the embeddings."""
        return self.wte.parameters() + self.wpe.parameters()

    def last_parameters(self) -> list:
        """Held by the last stage besides its blocks: final norm and head (the tied embedding)."""
        return self.ln_f.parameters() + (self.head.parameters() if self.head is not None else [self.wte.weight])

    def activation_shape(self, rows: int, seq_len: int) -> tuple:
        """Shape of what one block hands the next, for ``rows`` sequences of ``seq_len`` tokens."""
        return (rows, seq_len, self.config.n_embd)

    def moe_aux_loss(self):
        """Sum of the MoE layers' load-balancing losses from the last forward (0.0 without MoE)."""
        from tinytrain.nn.moe import MoE

        total = 0.0
        for m in self.modules():
            if isinstance(m, MoE) and m.aux_loss is not None:
                total = m.aux_loss + total
        return total
