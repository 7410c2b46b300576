"""The whole GPT, tensor parallel: the serial model's layers swapped for their parallel shards.

Who holds what, and where ranks talk (t ranks in the TP group; SP: sequence parallel)::

    ids (B, T), the same on every rank
     │
     ├─ wte: VocabParallelEmbedding     my V/t rows; all-reduce of the t lookups
     ├─ + wpe (replicated)
     ├─ SP only: ScatterToSequenceRegion  keep my T/t positions
     ├─ dropout ("drop")                the serial mask, my piece of it
     │
     ├─ ParallelBlock × n_layer         per block: attention and MLP, each one region
     │                                  (TP: 2 all-reduces fwd + 2 bwd; SP: the same bytes as
     │                                   all-gathers and reduce-scatters)
     ├─ ln_f (replicated)
     ├─ enter (copy / all-gather T), then x @ wte_rᵀ: my V/t columns of the logits (tied head)
     └─ vocab_parallel_cross_entropy    3 all-reduces of B·T numbers; backward local

Under SP a replicated weight (LayerNorm, a row layer's bias) sees only my tokens, so its gradient
is partial: a hook sums each gradient over the group as backward produces it, so what lands in
``.grad`` is whole — for micro-batches (pipeline) and data parallel (DDP, ZeRO) as well. ``shards()`` lists every
parameter's :class:`Shard`; ``write_into`` all-gathers them back into a serial model.
"""

from __future__ import annotations

from tinytrain import distributed as dist
from tinytrain import functional as F
from tinytrain.backend import xp
from tinytrain.nn.module import ModuleList
from tinytrain.nn.transformer import sequence_positions
from tinytrain.parallel.tensor_parallel.cross_entropy import (
    vocab_parallel_cross_entropy,
)
from tinytrain.parallel.tensor_parallel.layers import (
    Parallel,
    ParallelBlock,
    ReplicatedLayerNorm,
    VocabParallelEmbedding,
    replicate,
    split_size,
)
from tinytrain.parallel.tensor_parallel.mappings import (
    ScatterToSequenceRegion,
    all_gather_along,
    all_reduce_copy,
)


class TensorParallelGPT(Parallel):
    """A serial ``GPT`` split over ``group``: ``loss(ids, targets)`` equals the serial loss. It
    also follows the pipeline's ``StageModel`` protocol, so a pipeline stage can be TP-sharded."""

    def __init__(self, model, group, sequence_parallel=False):
        super().__init__(group, sequence_parallel)
        config = model.config
        if config.n_experts or not config.tie_weights:
            raise ValueError(
                "tensor_parallel_gpt supports the plain GPT with tied weights: use n_experts=0, tie_weights=True"
            )
        self.config = config
        self.wte = VocabParallelEmbedding(model.wte, group)
        self.keep("wpe", replicate(model.wpe.weight, "wpe.weight"))
        self.blocks = ModuleList(
            ParallelBlock(b, group, f"blocks.{i}", sequence_parallel) for i, b in enumerate(model.blocks)
        )
        self.ln_f = ReplicatedLayerNorm(model.ln_f, group, "ln_f", sequence_parallel)
        self.head = None  # the output head is the (vocab-parallel) token embedding, tied
        self.p, self.dropout_site = config.dropout, "drop"
        for s in self.shards():
            if s.partial:  # SP: saw only my tokens; sum over the group as each gradient arrives
                s.param.register_hook(self._sum_over_group)

    def hidden(self, ids, positions=None):
        """The last block's output: (B, T, C), or my sequence shard under SP; ``positions``: see ``embed``."""
        x = self.embed(ids, positions)
        for block in self.blocks:
            x = block(x)
        return x

    def embed(self, ids, positions=None):
        """Token plus position embeddings, then dropout: (B, T, C), or my sequence shard under SP.
        ``positions``: the global sequence positions of ``ids``' columns (context parallel)."""
        ids = xp.asarray(ids)
        T = ids.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}")
        x = self.wte(ids) + F.embedding(sequence_positions(T, positions, self.config.block_size), self.wpe)
        if self.sequence_parallel:
            # Megatron fuses the embedding's all-reduce and this split into one reduce-scatter;
            # we keep them apart so the position embedding is added to whole sequences, as serial.
            split_size(T, "the sequence length (sequence parallel splits it)", self.group)
            x = ScatterToSequenceRegion.apply(x, group=self.group)
        return self.dropout(x, self.p, self.training)

    def logits(self, x):
        """My vocabulary columns of the logits (B, T, V/t): the tied head is column-parallel."""
        x = self.ln_f(x)
        return F.linear(self.enter(x), self.wte.weight.T)

    def forward(self, ids):
        return self.logits(self.hidden(ids))

    def loss(self, ids, targets, denominator=None, positions=None):
        return self.head_loss(self.hidden(ids, positions), targets, denominator)

    def head_loss(self, x, targets, denominator=None):
        """The loss from the last block's output ``x`` (a pipeline's last stage starts here)."""
        return vocab_parallel_cross_entropy(
            self.logits(x), targets, self.group, self.wte.start, denominator=denominator
        )

    # --- the pipeline's stage protocol (pipeline.StageModel) --------------------------------------

    def first_parameters(self) -> list:
        return [self.wte.weight, self.wpe]

    def last_parameters(self) -> list:
        return self.ln_f.parameters() + [self.wte.weight]  # the head is the tied embedding

    def activation_shape(self, rows: int, seq_len: int) -> tuple:
        """Between blocks: (rows, T, C), or my sequence shard (rows, T/t, C) under SP."""
        t = dist.get_world_size(self.group) if self.sequence_parallel else 1
        return (rows, seq_len // t, self.config.n_embd)

    def _sum_over_group(self, grad):
        """The hook of a partial (SP) gradient: the sum over the group, as a new array."""
        return all_reduce_copy(grad, self.group)

    def write_into(self, model):
        """Gather every shard into the serial ``model`` (every rank ends with the full model)."""
        serial = dict(model.named_parameters())
        for s in self.shards():
            full = s.param.data if s.replicated else all_gather_along(s.param.data, s.axis, self.group)
            serial[s.name].data[...] = full


def tensor_parallel_gpt(model, group, sequence_parallel=False) -> TensorParallelGPT:
    """``model`` (the same serial GPT on every rank) split over the tensor-parallel ``group``."""
    return TensorParallelGPT(model, group, sequence_parallel)
