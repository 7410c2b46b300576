# Assignment 4: Tensor and sequence parallel (handout: assignments/a4_tensor_parallel.md).
# Generated from tinytrain/parallel/tensor_parallel/__init__.py by `python -m grader stubs`. Replace each
# `raise NotImplementedError("TODO ...")` with your code; grade it with `python -m grader`.

"""Tensor parallel (Megatron style) and sequence parallel: one GPT split across a TP group.

The chapter is split by job, as Megatron's ``tensor_parallel`` package is; read it in this order:

    mappings.py       region edges as autograd Functions: copy-to / reduce-from / gather-from /
                      scatter-to, and the sequence all-gather / reduce-scatter / scatter
    layers.py         who holds which shard: Shard, column- and row-parallel Linear, parallel MLP
                      and attention (heads split), replicated LayerNorm, block, vocab embedding
    cross_entropy.py  the loss of vocab-split logits, never gathering them
    model.py          TensorParallelGPT: the serial GPT with every layer swapped for its shard

Every name used elsewhere is re-exported here: ``from tinytrain.parallel.tensor_parallel import X``.
"""

from assignments.a4_tensor_parallel.cross_entropy import (
    VocabParallelCrossEntropy,
    vocab_parallel_cross_entropy,
)
from assignments.a4_tensor_parallel.layers import (
    ColumnParallelLinear,
    Parallel,
    ParallelAttention,
    ParallelBlock,
    ParallelMLP,
    ReplicatedLayerNorm,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
)
from assignments.a4_tensor_parallel.mappings import (
    CopyToRegion,
    GatherFromRegion,
    GatherFromSequenceRegion,
    ReduceFromRegion,
    ReduceScatterToSequenceRegion,
    ScatterToRegion,
    ScatterToSequenceRegion,
)
from assignments.a4_tensor_parallel.model import (
    TensorParallelGPT,
    tensor_parallel_gpt,
)

__all__ = [
    "ColumnParallelLinear",
    "CopyToRegion",
    "GatherFromRegion",
    "GatherFromSequenceRegion",
    "Parallel",
    "ParallelAttention",
    "ParallelBlock",
    "ParallelMLP",
    "ReduceFromRegion",
    "ReduceScatterToSequenceRegion",
    "ReplicatedLayerNorm",
    "RowParallelLinear",
    "ScatterToRegion",
    "ScatterToSequenceRegion",
    "Shard",
    "TensorParallelGPT",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "tensor_parallel_gpt",
    "vocab_parallel_cross_entropy",
]
