"""Tensor-parallel layers (Megatron style): each one a serial layer's shard plus its region edges.

Every rank builds the full serial layer from the same seed and keeps its *shard* of each weight, so
the parallel layer starts exactly where the serial one does. With t ranks and Linear weights
stored (in, out), rank r holds::

    column-parallel  W[:, r·out/t : (r+1)·out/t]   q, k, v (so whole heads), fc_1, the tied head
    row-parallel     W[r·in/t : (r+1)·in/t, :]     proj, fc_2         (bias: full, added once)
    vocab-parallel   wte[r·V/t : (r+1)·V/t, :]     token embedding = the head's columns (tied)
    replicated       LayerNorms, wpe, row-parallel biases

Each shard is recorded as a :class:`Shard` (serial name, split axis, [start, stop), partial), so
tests compare it with the serial gradient's slice and ``write_into`` gathers it back.

One block, tensor parallel (x: (B, T, C), the same on every rank)::

    x ─ ln ─ copy ─► [x @ W_col_r] ─ gelu ─► [· @ W_row_r] ─ reduce ─► dropout ─► + x
        fwd: identity               (local, no talk)       fwd: all-reduce (sum of t partials)

A column split gives each rank *some output features* of every token: to use them as a whole
activation they must be *gathered* (we do not: the row split after it wants exactly that split
input). A row split gives each rank a *partial sum* of every output feature: those must be
*all-reduced*. So each attention and each MLP costs one all-reduce forward and one backward.

Sequence parallel: LayerNorm, dropout and the residual add stay on sequence shards (B, T/t, C)
and the region edges become the two halves of a ring all-reduce (see ``mappings.py``)::

    x_r (B,T/t,C) ─ ln ─ all-gather(T) ─► column ─► row ─ reduce-scatter(T) ─► dropout ─► + x_r

Under SP a replicated weight (LayerNorm, row bias) sees only my tokens, so its gradient is a
partial sum: its Shard says ``partial`` and a hook the model registers sums it over the group as
backward produces it.

Dropout ("per-region RNG"): each layer keeps its serial dropout's name in ``dropout_site``; the
mask comes from a generator keyed by (seed, step, site) (``tinytrain.random``), is drawn for the
*full* serial shape and cut to this rank's piece (its sequence positions, its rows of the global
batch). The masks therefore equal the serial model's bit for bit, whatever t is; the price is
drawing t times more random numbers than used, cheap next to the matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinytrain import distributed as dist
from tinytrain import functional as F
from tinytrain.autograd import Parameter, Tensor
from tinytrain.backend import xp
from tinytrain.checkpoint import Placement
from tinytrain.nn.module import Module
from tinytrain.nn.transformer import CausalSelfAttention, attend
from tinytrain.parallel.tensor_parallel.mappings import (
    CopyToRegion,
    GatherFromRegion,
    GatherFromSequenceRegion,
    ReduceFromRegion,
    ReduceScatterToSequenceRegion,
    my_piece,
)

# --- shards of serial parameters -------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Shard:
    """Where a parallel parameter comes from: ``param`` is ``serial[name]``, or its [start, stop)
    along ``axis``; ``partial``: its gradient is a partial sum, to be summed over the group (SP)."""

    param: Parameter
    name: str
    axis: int | None = None
    start: int | None = None
    stop: int | None = None
    partial: bool = False

    @property
    def replicated(self) -> bool:
        return self.axis is None

    @property
    def placement(self) -> Placement:
        """Where it sits in the serial tensor, as checkpoints name it."""
        return Placement(self.name, self.axis, self.start, self.stop)


def split_size(total: int, what: str, group) -> int:
    """``total / t``, or a ValueError that says what to change."""
    n = dist.get_world_size(group)
    if total % n:
        raise ValueError(
            f"{what} = {total} does not split over a tensor-parallel group of {n} ranks; "
            f"choose a TP size that divides {total}, or change {what}"
        )
    return total // n


def shard(param, axis: int, group, serial_name: str) -> Shard:
    """My piece of a serial Parameter along ``axis``."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    size = param.shape[axis] // n
    return Shard(Parameter(my_piece(param.data, axis, group).copy()), serial_name, axis, r * size, (r + 1) * size)


def replicate(param, serial_name: str, sequence_parallel=False) -> Shard:
    """A copy of a serial Parameter. Under SP a replicated weight that works on sequence shards
    sees only my tokens, so its gradient is partial (summed over the group later)."""
    return Shard(Parameter(param.data.copy()), serial_name, partial=sequence_parallel)


def join(prefix: str, name: str) -> str:
    """The serial module's dotted name (``prefix`` empty for a layer built on its own)."""
    return f"{prefix}.{name}" if prefix else name


class Parallel(Module):
    """Shared settings: the TP group and whether activations between regions are sequence shards."""

    def __init__(self, group, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.sources = {}  # my parameter's attribute -> its Shard

    def keep(self, attr: str, source: Shard | None) -> None:
        """Hold ``source.param`` as ``self.<attr>`` (None for a missing bias) and remember its Shard."""
        setattr(self, attr, None if source is None else source.param)
        if source is not None:
            self.sources[attr] = source

    def shards(self) -> list[Shard]:
        """The Shard of every parameter of this layer and the layers inside it."""
        return [
            Shard(getattr(m, attr), s.name, s.axis, s.start, s.stop, s.partial)
            for _, m in self.named_modules()
            for attr, s in getattr(m, "sources", {}).items()
        ]

    def enter(self, x):
        """Into a column-parallel region: all-gather the sequence (SP) or copy (TP)."""
        if self.sequence_parallel:
            return GatherFromSequenceRegion.apply(x, group=self.group)
        return CopyToRegion.apply(x, group=self.group)

    def leave(self, x):
        """Out of a row-parallel region: reduce-scatter the sequence (SP) or all-reduce (TP)."""
        if self.sequence_parallel:
            return ReduceScatterToSequenceRegion.apply(x, group=self.group)
        return ReduceFromRegion.apply(x, group=self.group)

    def dropout(self, x, p, training):
        """Dropout with the serial mask: my piece of the mask the serial module ``dropout_site``
        draws for the whole batch (see top): my sequence positions under SP; my rows of the
        global batch come from ``random.batch_rows``, which the data-parallel layout sets."""
        if not self.sequence_parallel:  # plain TP: every rank holds the whole sequence, and its mask
            return F.dropout(x, p, training, site=self.dropout_site)
        # BEGIN SOLUTION 4.5 "Under sequence parallelism, apply this rank's positions of the mask the serial module draws for the full shape." full="Under SP: functional.dropout with site=self.dropout_site and seq_shard=(my rank, group size)."
        seq_shard = (dist.get_rank(self.group), dist.get_world_size(self.group))
        return F.dropout(x, p, training, site=self.dropout_site, seq_shard=seq_shard)
        # END SOLUTION


# --- 4.2 column and row parallel linear -----------------------------------------------------------


class ColumnParallelLinear(Parallel):
    """y_r = x @ W[:, my columns] + b[my columns]; ``gather_output`` all-gathers the columns."""

    def __init__(self, linear, group, name="", gather_output=False, sequence_parallel=False):
        super().__init__(group, sequence_parallel)
        split_size(linear.out_features, f"{name or 'Linear'} output width", group)
        self.gather_output = gather_output
        self.keep("weight", shard(linear.weight, 1, group, join(name, "weight")))
        self.keep("bias", None if linear.bias is None else shard(linear.bias, 0, group, join(name, "bias")))

    def forward(self, x):
        # BEGIN SOLUTION 4.2 "Each rank computes its own output features from the whole input (entering the region once), and joins them into the full output only when asked to." full="enter(x) (copy, or all-gather under SP), local linear, gather_output: GatherFromRegion."
        y = F.linear(self.enter(x), self.weight, self.bias)
        return GatherFromRegion.apply(y, group=self.group) if self.gather_output else y
        # END SOLUTION


class RowParallelLinear(Parallel):
    """y = sum_r x_r @ W[my rows, :] + b; the input is already split along its last axis."""

    def __init__(self, linear, group, name="", sequence_parallel=False):
        super().__init__(group, sequence_parallel)
        split_size(linear.in_features, f"{name or 'Linear'} input width", group)
        self.keep("weight", shard(linear.weight, 0, group, join(name, "weight")))
        self.keep(
            "bias", None if linear.bias is None else replicate(linear.bias, join(name, "bias"), sequence_parallel)
        )

    def forward(self, x):
        # BEGIN SOLUTION 4.2 "The full output on every rank from the rows of the matrix this rank holds, with the replicated additive term counted exactly once." full="Local partial product, then leave() (all-reduce or reduce-scatter); add the bias once, after."
        y = self.leave(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias
        # END SOLUTION


# --- 4.3 parallel MLP and attention ----------------------------------------------------------------


class ParallelMLP(Parallel):
    """fc_1 column-parallel, gelu on my hidden columns, fc_2 row-parallel: no talk in between."""

    def __init__(self, mlp, group, name, sequence_parallel=False):
        super().__init__(group, sequence_parallel)
        self.fc_1 = ColumnParallelLinear(mlp.fc_1, group, join(name, "fc_1"), sequence_parallel=sequence_parallel)
        self.fc_2 = RowParallelLinear(mlp.fc_2, group, join(name, "fc_2"), sequence_parallel=sequence_parallel)
        self.p, self.dropout_site = mlp.dropout.p, join(name, "dropout")

    def forward(self, x):
        """The serial MLP's own composition on parallel layers (written for you: the example that
        4.3's attention follows): gelu acts on whole values of my hidden columns, so it needs no
        talk; fc_1 enters the region and fc_2 leaves it."""
        return self.dropout(self.fc_2(F.gelu(self.fc_1(x))), self.p, self.training)


class ParallelAttention(Parallel):
    """Heads split across ranks: q, k, v column-parallel (whole heads), proj row-parallel."""

    def __init__(self, attn, group, name, sequence_parallel=False):
        super().__init__(group, sequence_parallel)
        self.n_head = split_size(attn.n_head, "the number of attention heads", group)
        self.q = ColumnParallelLinear(attn.q, group, join(name, "q"), sequence_parallel=sequence_parallel)
        self.k = ColumnParallelLinear(attn.k, group, join(name, "k"), sequence_parallel=sequence_parallel)
        self.v = ColumnParallelLinear(attn.v, group, join(name, "v"), sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(attn.proj, group, join(name, "proj"), sequence_parallel=sequence_parallel)
        self.p, self.dropout_site = attn.dropout.p, join(name, "dropout")
        self.attention_fn = None  # None: causal attention on my heads; context parallel sets its own

    split_heads = CausalSelfAttention.split_heads  # the serial layout (B, heads, T, head size), my n_head heads

    def forward(self, x):
        # BEGIN SOLUTION 4.3 "The serial attention's output, random mask included, with this rank computing only its own heads: one all-reduce forward and one backward." full="Enter once (q, k, v share it), local linears, split_heads (my n_head/t heads), attend(self.attention_fn, q, k, v), merge the heads, proj, dropout."
        x = self.enter(x)  # once, not per projection: one all-reduce (or all-gather) for all three
        q, k, v = (self.split_heads(F.linear(x, lin.weight, lin.bias)) for lin in (self.q, self.k, self.v))
        y = attend(self.attention_fn, q, k, v)  # (B, my heads, T, head size)
        B, H, T, D = y.shape
        y = y.transpose(1, 2).reshape(B, T, H * D)  # my heads side by side: my columns of proj's input
        return self.dropout(self.proj(y), self.p, self.training)
        # END SOLUTION


class ReplicatedLayerNorm(Parallel):
    """The serial LayerNorm's weights on every rank (on my sequence shard under SP)."""

    def __init__(self, norm, group, name, sequence_parallel=False):
        super().__init__(group, sequence_parallel)
        self.keep("weight", replicate(norm.weight, join(name, "weight"), sequence_parallel))
        self.keep("bias", None if norm.bias is None else replicate(norm.bias, join(name, "bias"), sequence_parallel))
        self.eps = norm.eps

    def forward(self, x):
        return F.layer_norm(x, self.weight, self.bias, self.eps)


class ParallelBlock(Parallel):
    """x + attn(ln_1(x)), then + mlp(ln_2(x)): two regions, each entered once and left once."""

    def __init__(self, block, group, name, sequence_parallel=False):
        super().__init__(group, sequence_parallel)
        self.ln_1 = ReplicatedLayerNorm(block.ln_1, group, join(name, "ln_1"), sequence_parallel)
        self.ln_2 = ReplicatedLayerNorm(block.ln_2, group, join(name, "ln_2"), sequence_parallel)
        self.attn = ParallelAttention(block.attn, group, join(name, "attn"), sequence_parallel)
        self.mlp = ParallelMLP(block.mlp, group, join(name, "mlp"), sequence_parallel)

    def forward(self, x):
        """x: (B, T, C) under TP; my sequence shard (B, T/t, C) under SP."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


# --- 4.4 vocab-parallel embedding -------------------------------------------------------------------


class VocabParallelEmbedding(Parallel):
    """Rank r holds rows [r·V/t, (r+1)·V/t) of the table; every rank returns every token's vector,
    the serial lookup's, with one all-reduce of (B, T, C) (task 4.4)."""

    def __init__(self, embedding, group, name="wte"):
        super().__init__(group, sequence_parallel=False)
        rows = split_size(embedding.num_embeddings, "the vocabulary size", group)
        self.start, self.stop = dist.get_rank(group) * rows, (dist.get_rank(group) + 1) * rows
        self.keep("weight", shard(embedding.weight, 0, group, join(name, "weight")))

    def forward(self, ids):
        # BEGIN SOLUTION 4.4 "Look up only the tokens whose table rows this rank holds, zeros for the rest, so that summing over ranks gives every token its vector exactly once." full="Mask ids outside [start, stop), look up ids - start (0 where masked), zero masked rows, ReduceFromRegion."
        mine = (ids >= self.start) & (ids < self.stop)
        local = F.embedding(xp.where(mine, ids - self.start, 0), self.weight)
        local = local * Tensor(mine[..., None].astype(local.dtype))
        return ReduceFromRegion.apply(local, group=self.group)
        # END SOLUTION
