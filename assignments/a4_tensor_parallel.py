# Assignment 4: Tensor and sequence parallel (handout: assignments/a4_tensor_parallel.md).
# Generated from tinytrain/parallel/tensor_parallel.py by `python -m grader stubs`. Replace each
# `raise NotImplementedError("TODO ...")` with your code; grade it with `python -m grader`.

"""Tensor parallel (Megatron style) and sequence parallel: one GPT split across a TP group.

Every rank builds the full serial GPT from the same seed and keeps its *shard* of each weight, so
the parallel model starts exactly where the serial one does. With t ranks and Linear weights
stored (in, out), rank r holds::

    column-parallel  W[:, r·out/t : (r+1)·out/t]   q, k, v (so whole heads), fc_1, the tied head
    row-parallel     W[r·in/t : (r+1)·in/t, :]     proj, fc_2         (bias: full, added once)
    vocab-parallel   wte[r·V/t : (r+1)·V/t, :]     token embedding = the head's columns (tied)
    replicated       LayerNorms, wpe, row-parallel biases

One block, tensor parallel (x: (B, T, C), the same on every rank)::

    x ─ ln ─ copy ─► [x @ W_col_r] ─ gelu ─► [· @ W_row_r] ─ reduce ─► + x
        fwd: identity               (local, no talk)       fwd: all-reduce (sum of t partials)
        bwd: all-reduce (each rank's                       bwd: identity (every rank needs
             dx is a partial sum)                               the whole gradient)

A column split gives each rank *some output features* of every token: to use them as a whole
activation they must be *gathered* (we do not: the row split after it wants exactly that split
input). A row split gives each rank a *partial sum* of every output feature: those must be
*all-reduced*. So each attention and each MLP costs one all-reduce forward and one backward.

Sequence parallel: between the blocks' parallel regions, LayerNorm, dropout and the residual add
are replicated work on replicated (B, T, C) activations. SP keeps them on sequence shards
(B, T/t, C) instead, and swaps each all-reduce for the two halves of a ring all-reduce::

    x_r (B,T/t,C) ─ ln ─ all-gather(T) ─► column ─► row ─ reduce-scatter(T) ─► dropout ─► + x_r
                         bwd: reduce-scatter                bwd: all-gather

An all-reduce *is* a reduce-scatter followed by an all-gather, so the bytes are the same:
2·(t-1)/t·B·T·C·4 per all-reduce. What SP saves is activation memory (LayerNorm and dropout keep
1/t of their tensors) and the replicated work.

Dropout ("per-region RNG"): every rank seeds the global generator the same way (the training loop
calls ``manual_seed((seed, step))``), then each dropout draws the mask for the *full* serial shape
in the serial order and keeps the piece for its own rows/sequence positions. The masks therefore
equal the serial model's bit for bit, whatever t is; the price is drawing t times more random
numbers than used, cheap next to the matmuls.

Our collectives work along axis 0; the functions below move the split axis to the front and back.
"""

from __future__ import annotations

from tinytrain import distributed as dist
from tinytrain import functional as F
from tinytrain import random as _random
from tinytrain.autograd import Function, Parameter, Tensor, ops
from tinytrain.backend import xp
from tinytrain.nn.module import Module, ModuleList


# --- collectives along an axis -------------------------------------------------------------------


def _all_reduce(arr, group):
    out = xp.ascontiguousarray(arr).copy()  # never change an array autograd still holds
    return dist.all_reduce(out, group=group, algo="ring")  # ring: the textbook 2(t-1)/t bytes


def _all_gather(arr, axis, group):
    front = xp.ascontiguousarray(xp.moveaxis(arr, axis, 0))
    return xp.moveaxis(dist.all_gather(front, group=group), 0, axis)


def _reduce_scatter(arr, axis, group):
    front = xp.ascontiguousarray(xp.moveaxis(arr, axis, 0))
    return xp.moveaxis(dist.reduce_scatter(front, group=group), 0, axis)


def _my_piece(arr, axis, group):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    size = arr.shape[axis] // n
    index = [slice(None)] * arr.ndim
    index[axis] = slice(r * size, (r + 1) * size)
    return xp.ascontiguousarray(arr[tuple(index)])


# --- 4.1 communication as autograd functions -----------------------------------------------------


class CopyToRegion(Function):
    """Enter a tensor-parallel region: identity forward; backward all-reduces the partial dx."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("TODO 4.1: Forward: nothing to do. Remember the group for backward.")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("TODO 4.1: Each rank's dx covers only its columns' paths: sum them (all-reduce).")


class ReduceFromRegion(Function):
    """Leave a row-parallel region: all-reduce the partial sums forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("TODO 4.1: Sum the t partial outputs (all-reduce a copy).")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("TODO 4.1: Every rank's partial output fed the whole sum: it gets the whole gradient.")


class GatherFromRegion(Function):
    """Column outputs to a whole tensor: all-gather along the last axis; backward keeps my piece."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("TODO 4.1: All-gather along axis -1 (move it to the front for our all_gather).")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("TODO 4.1: Only my columns came from me: keep my piece of the last axis.")


class ScatterToRegion(Function):
    """Whole tensor to my piece of the last axis; backward all-gathers the pieces' gradients."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("TODO 4.1: Keep my piece of the last axis.")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("TODO 4.1: Each piece's gradient is on its rank: all-gather them along axis -1.")


class GatherFromSequenceRegion(Function):
    """SP: sequence shards (B, T/t, C) to (B, T, C) by all-gather; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("TODO 4.5: All-gather along the sequence axis 1.")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("TODO 4.5: Every rank's grad is partial (its columns): reduce-scatter along axis 1.")


class ReduceScatterToSequenceRegion(Function):
    """SP: partial sums (B, T, C) to my summed shard (B, T/t, C); backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("TODO 4.5: Reduce-scatter along the sequence axis 1.")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("TODO 4.5: Every partial sum needs the whole gradient: all-gather along axis 1.")


class ScatterToSequenceRegion(Function):
    """SP, after the embedding: keep my sequence shard; backward all-gathers (no sum needed)."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("TODO 4.5: Keep my piece of the sequence axis 1.")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("TODO 4.5: All-gather the pieces' gradients along axis 1.")


# --- helpers for layers ---------------------------------------------------------------------------


def _split_size(total: int, what: str, group) -> int:
    n = dist.get_world_size(group)
    if total % n:
        raise ValueError(f"{what} = {total} does not split over a tensor-parallel group of {n} ranks; "
                         f"choose a TP size that divides {total}, or change {what}")
    return total // n


def _shard(param, axis: int, group, serial_name: str):
    """My piece of a serial Parameter along ``axis``, and where it came from (for tests, gathers)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    size = param.shape[axis] // n
    return Parameter(_my_piece(param.data, axis, group).copy()), (serial_name, axis, r * size, (r + 1) * size, False)


def _replicate(param, serial_name: str, sequence_parallel=False):
    """A copy of a serial Parameter. Under SP a replicated weight that works on sequence shards
    sees only my tokens, so its gradient is partial (``partial``: summed over the group later)."""
    return Parameter(param.data.copy()), (serial_name, None, None, None, sequence_parallel)


def _join(prefix: str, name: str) -> str:
    """The serial parameter's dotted name (``prefix`` empty for a layer built on its own)."""
    return f"{prefix}.{name}" if prefix else name


class Parallel(Module):
    """Shared settings: the TP group and whether activations between regions are sequence shards."""

    def __init__(self, group, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.rows = None  # (first row, global batch) for a data-parallel replica, else all rows
        self.sources = {}  # my parameter's attribute -> (serial name, axis, start, stop, partial)

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
        """Dropout with the serial mask: draw it for the full serial shape, keep my piece (see top).

        My piece: my sequence positions under SP, and my rows of the global batch when a
        data-parallel replica holds only ``self.rows = (first row, global batch)``."""
        if not training or p == 0.0:
            return x
        raise NotImplementedError("TODO 4.5: Full shape: (global batch, T·t under SP, C); index: my rows and (SP) my sequence positions; ops.Dropout with full_shape and index.")


# --- 4.2 column and row parallel linear -----------------------------------------------------------


class ColumnParallelLinear(Parallel):
    """y_r = x @ W[:, my columns] + b[my columns]; ``gather_output`` all-gathers the columns."""

    def __init__(self, linear, group, name="", gather_output=False, sequence_parallel=False):
        super().__init__(group, sequence_parallel)
        _split_size(linear.out_features, f"{name or 'Linear'} output width", group)
        self.gather_output = gather_output
        self.weight, self.sources["weight"] = _shard(linear.weight, 1, group, _join(name, "weight"))
        if linear.bias is not None:
            self.bias, self.sources["bias"] = _shard(linear.bias, 0, group, _join(name, "bias"))
        else:
            self.bias = None

    def forward(self, x):
        raise NotImplementedError("TODO 4.2: enter(x) (copy, or all-gather under SP), local linear, gather_output: GatherFromRegion.")


class RowParallelLinear(Parallel):
    """y = sum_r x_r @ W[my rows, :] + b; the input is already split along its last axis."""

    def __init__(self, linear, group, name="", sequence_parallel=False):
        super().__init__(group, sequence_parallel)
        _split_size(linear.in_features, f"{name or 'Linear'} input width", group)
        self.weight, self.sources["weight"] = _shard(linear.weight, 0, group, _join(name, "weight"))
        if linear.bias is not None:
            self.bias, self.sources["bias"] = _replicate(linear.bias, _join(name, "bias"), sequence_parallel)
        else:
            self.bias = None

    def forward(self, x):
        raise NotImplementedError("TODO 4.2: Local partial product, then leave() (all-reduce or reduce-scatter); add the bias once, after.")


# --- 4.3 parallel MLP and attention ----------------------------------------------------------------


class ParallelMLP(Parallel):
    """fc_1 column-parallel, gelu on my hidden columns, fc_2 row-parallel: no talk in between."""

    def __init__(self, mlp, group, name, sequence_parallel=False):
        super().__init__(group, sequence_parallel)
        self.fc_1 = ColumnParallelLinear(mlp.fc_1, group, _join(name, "fc_1"), sequence_parallel=sequence_parallel)
        self.fc_2 = RowParallelLinear(mlp.fc_2, group, _join(name, "fc_2"), sequence_parallel=sequence_parallel)
        self.p = mlp.dropout.p

    def forward(self, x):
        raise NotImplementedError("TODO 4.3: fc_1, gelu, fc_2, then self.dropout(y, self.p, self.training).")


class ParallelAttention(Parallel):
    """Heads split across ranks: q, k, v column-parallel (whole heads), proj row-parallel."""

    def __init__(self, attn, group, name, sequence_parallel=False):
        super().__init__(group, sequence_parallel)
        self.n_head = _split_size(attn.n_head, "the number of attention heads", group)
        self.q = ColumnParallelLinear(attn.q, group, _join(name, "q"), sequence_parallel=sequence_parallel)
        self.k = ColumnParallelLinear(attn.k, group, _join(name, "k"), sequence_parallel=sequence_parallel)
        self.v = ColumnParallelLinear(attn.v, group, _join(name, "v"), sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(attn.proj, group, _join(name, "proj"), sequence_parallel=sequence_parallel)
        self.p = attn.dropout.p

    def forward(self, x):
        raise NotImplementedError("TODO 4.3: Enter once (q, k, v share it), local linears, my n_head/t heads, proj, dropout.")


class ReplicatedLayerNorm(Parallel):
    """The serial LayerNorm's weights on every rank (on my sequence shard under SP)."""

    def __init__(self, norm, group, name, sequence_parallel=False):
        super().__init__(group, sequence_parallel)
        self.weight, self.sources["weight"] = _replicate(norm.weight, _join(name, "weight"), sequence_parallel)
        self.bias = None
        if norm.bias is not None:
            self.bias, self.sources["bias"] = _replicate(norm.bias, _join(name, "bias"), sequence_parallel)
        self.eps = norm.eps

    def forward(self, x):
        return F.layer_norm(x, self.weight, self.bias, self.eps)


class ParallelBlock(Parallel):
    def __init__(self, block, group, name, sequence_parallel=False):
        super().__init__(group, sequence_parallel)
        self.ln_1 = ReplicatedLayerNorm(block.ln_1, group, _join(name, "ln_1"), sequence_parallel)
        self.ln_2 = ReplicatedLayerNorm(block.ln_2, group, _join(name, "ln_2"), sequence_parallel)
        self.attn = ParallelAttention(block.attn, group, _join(name, "attn"), sequence_parallel)
        self.mlp = ParallelMLP(block.mlp, group, _join(name, "mlp"), sequence_parallel)

    def forward(self, x):
        """x: (B, T, C) under TP; my sequence shard (B, T/t, C) under SP."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


# --- 4.4 vocab-parallel embedding and cross-entropy -------------------------------------------------


class VocabParallelEmbedding(Parallel):
    """Rank r holds rows [r·V/t, (r+1)·V/t) of the table: it looks up the ids in its range, writes
    zeros for the others, and the all-reduce adds the t lookups (exactly one is non-zero)."""

    def __init__(self, embedding, group, name="wte"):
        super().__init__(group, sequence_parallel=False)
        rows = _split_size(embedding.num_embeddings, "the vocabulary size", group)
        self.start, self.stop = dist.get_rank(group) * rows, (dist.get_rank(group) + 1) * rows
        self.weight, self.sources["weight"] = _shard(embedding.weight, 0, group, _join(name, "weight"))

    def forward(self, ids):
        raise NotImplementedError("TODO 4.4: Mask ids outside [start, stop), look up ids - start (0 where masked), zero masked rows, ReduceFromRegion.")


class VocabParallelCrossEntropy(Function):
    """Cross-entropy of logits split along the vocabulary, without building the full logits.

    logits_r (N, V/t) on rank r. log-sum-exp needs the global max and the global sum of exp:
    two all-reduces of N numbers (max, then sum); the target's logit lives on one rank, so a third
    all-reduce (sum, zeros elsewhere) brings it to all. Backward is local: softmax_r - onehot_r.
    """

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, ignore_index=-100, denominator=None):
        raise NotImplementedError("TODO 4.4: all_reduce max of row maxes, all_reduce sum of exp, all_reduce the target logit; keep probs for backward.")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("TODO 4.4: d/dlogits_r = (probs_r - onehot_r(target)) · valid · grad / denom; no talk.")


def vocab_parallel_cross_entropy(logits, targets, group, vocab_start, ignore_index=-100, denominator=None):
    """Mean NLL of ``targets`` (over the non-ignored ones, or divided by ``denominator``)."""
    targets = xp.asarray(targets.data if isinstance(targets, Tensor) else targets)
    return VocabParallelCrossEntropy.apply(logits, targets, group=group, vocab_start=vocab_start,
                                           ignore_index=ignore_index, denominator=denominator)


# --- the whole GPT ------------------------------------------------------------------------------------


class TensorParallelGPT(Parallel):
    """A serial ``GPT`` split over ``group``: ``loss(ids, targets)`` equals the serial loss.

    ``rows``: (first row, global batch) when a data-parallel replica holds only some rows of the
    global batch, so dropout cuts the serial mask's rows too."""

    def __init__(self, model, group, sequence_parallel=False, rows=None):
        super().__init__(group, sequence_parallel)
        config = model.config
        if config.n_experts or not config.tie_weights:
            raise ValueError("tensor_parallel_gpt supports the plain GPT with tied weights: use n_experts=0, tie_weights=True")
        self.config = config
        self.wte = VocabParallelEmbedding(model.wte, group)
        self.wpe, self.sources["wpe"] = _replicate(model.wpe.weight, "wpe.weight")
        self.blocks = ModuleList(ParallelBlock(b, group, f"blocks.{i}", sequence_parallel) for i, b in enumerate(model.blocks))
        self.ln_f = ReplicatedLayerNorm(model.ln_f, group, "ln_f", sequence_parallel)
        self.head = None  # the output head is the (vocab-parallel) token embedding, tied
        self.p = config.dropout
        for m in self.modules():
            m.rows = rows  # every dropout cuts the same rows of the serial mask

    def hidden(self, ids):
        """The last block's output: (B, T, C), or my sequence shard under SP."""
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return x

    def embed(self, ids):
        """Token plus position embeddings, then dropout: (B, T, C), or my sequence shard under SP."""
        ids = xp.asarray(ids)
        T = ids.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}")
        x = self.wte(ids) + F.embedding(xp.arange(T), self.wpe)
        if self.sequence_parallel:
            # Megatron fuses the embedding's all-reduce and this split into one reduce-scatter;
            # we keep them apart so the position embedding is added to whole sequences, as serial.
            _split_size(T, "the sequence length (sequence parallel splits it)", self.group)
            x = ScatterToSequenceRegion.apply(x, group=self.group)
        return self.dropout(x, self.p, self.training)

    def logits(self, x):
        """My vocabulary columns of the logits (B, T, V/t): the tied head is column-parallel."""
        x = self.ln_f(x)
        return F.linear(self.enter(x), self.wte.weight.T)

    def forward(self, ids):
        return self.logits(self.hidden(ids))

    def loss(self, ids, targets, denominator=None):
        return self.head_loss(self.hidden(ids), targets, denominator)

    def head_loss(self, x, targets, denominator=None):
        """The loss from the last block's output ``x`` (a pipeline's last stage starts here)."""
        return vocab_parallel_cross_entropy(self.logits(x), targets, self.group, self.wte.start, denominator=denominator)

    def sync_sequence_parallel_grads(self):
        """Under SP a replicated weight (LayerNorm, row bias) saw only my tokens: sum over the group."""
        for p, _, _, _, _, partial in self.shards():
            if partial and p.grad is not None:
                dist.all_reduce(p.grad, group=self.group, algo="ring")

    def shards(self):
        """(parameter, serial name, axis, start, stop, partial) for every parameter (axis None:
        replicated; partial: its gradient must be summed over the group, see SP)."""
        return [(getattr(m, attr), *source) for _, m in self.named_modules()
                for attr, source in getattr(m, "sources", {}).items()]

    def write_into(self, model):
        """Gather every shard into the serial ``model`` (every rank ends with the full model)."""
        serial = dict(model.named_parameters())
        for p, name, axis, _, _, _ in self.shards():
            full = p.data if axis is None else _all_gather(p.data, axis, self.group)
            serial[name].data[...] = full


def tensor_parallel_gpt(model, group, sequence_parallel=False, rows=None) -> TensorParallelGPT:
    """``model`` (the same serial GPT on every rank) split over the tensor-parallel ``group``."""
    return TensorParallelGPT(model, group, sequence_parallel, rows)
