# Assignment 7: Context parallel (handout: assignments/a7_context_parallel.md).
# Generated from tinytrain/parallel/context_parallel/__init__.py by `python -m grader stubs`. Replace each
# `raise NotImplementedError("TODO ...")` with your code; grade it with `python -m grader`.

"""Context parallel: one sequence split across a CP group; only attention talks.

Every rank holds the serial weights and T/N of the sequence's positions (``split.py``: contiguous,
or zigzag for a balanced causal workload). Attention needs every earlier key for each query, so
it is the one layer that exchanges data, by one of two algorithms:

    ring (ring.py)          K/V blocks pass around the ring in N steps, each send posted before
                            the block's compute (overlap); partial results merged by the online
                            softmax (merge.py); backward sends dK/dV home around the ring
    alltoall (ulysses.py)   all-to-all from sequence shards to head shards, local attention on
                            the whole sequence, all-to-all back (DeepSpeed-Ulysses)

    rank r (of N)           ids[:, positions r] ─ embed(positions) ─ blocks ─ loss over my targets
                            attention: q, k, v (B, H, T/N, D) ─► ring / all-to-all ─► (B, H, T/N, D)
                            after backward: sum each weight's gradient over the CP group

Read in this order: ``merge.py``, ``split.py``, ``ring.py``, ``ulysses.py``, ``model.py``
(``apply_context_parallel``: how a GPT, or a tensor-parallel GPT, uses it).

Every name used elsewhere is re-exported here: ``from tinytrain.parallel.context_parallel import X``.
"""

from assignments.a7_context_parallel.merge import (
    WORK,
    block_attention,
    block_gradients,
    causal_bias,
    merge_partials,
)
from assignments.a7_context_parallel.model import (
    ALGOS,
    ContextParallel,
    apply_context_parallel,
)
from assignments.a7_context_parallel.ring import (
    RingAttention,
    pass_on,
    ring_attention,
    ring_backward,
    ring_bytes,
    ring_forward,
)
from assignments.a7_context_parallel.split import (
    SPLITS,
    attention_work,
    block_pairs,
    chunk_ids,
    chunk_size,
    n_chunks,
    positions,
)
from assignments.a7_context_parallel.ulysses import (
    HeadToSeq,
    SeqToHead,
    alltoall_attention,
    alltoall_bytes,
    check_heads,
    head_to_seq,
    seq_to_head,
)

__all__ = [
    "ALGOS",
    "SPLITS",
    "WORK",
    "ContextParallel",
    "HeadToSeq",
    "RingAttention",
    "SeqToHead",
    "alltoall_attention",
    "alltoall_bytes",
    "apply_context_parallel",
    "attention_work",
    "block_attention",
    "block_gradients",
    "block_pairs",
    "causal_bias",
    "check_heads",
    "chunk_ids",
    "chunk_size",
    "head_to_seq",
    "merge_partials",
    "n_chunks",
    "pass_on",
    "positions",
    "ring_attention",
    "ring_backward",
    "ring_bytes",
    "ring_forward",
    "seq_to_head",
]
