"""The gate and the capacity of an expert-parallel MoE layer: the serial rules on the whole batch.

Each rank of the data group (dp × ep ranks) routes only its own rows, but the serial MoE's
numbers are whole-batch statistics. One all-gather of small per-rank tallies gives every rank
what it needs, exactly, in data-rank order d·EP + r (rank d·EP + r holds block d·EP + r of the
batch, so data-rank order is row order)::

    rank d·EP + r:  its tallies (k, E+1)  ─ all_gather over ep, then over dp ─►  gathered (D, k, E+1)
                    gathered[d, s, e]  data rank d's choice-s assignments to expert e  (e < E)
                    gathered[d, :, E]  data rank d's token count

    load balancing   the aux loss of the whole batch, each rank holding a share (6.1)
    capacity         the serial GShard queues of the whole batch, so the same tokens drop (6.2)
    loss-free        DeepSeek-V3's routing bias, moved after each step against the whole
      balancing      batch's load, the same on every rank (6.5)

The routing rules themselves (top-k, combine weights, queue positions, the loss formula) are
``tinytrain.nn.moe``'s: one implementation, used by the serial layer and by this chapter.
"""

from __future__ import annotations

import numpy

from tinytrain import distributed as dist
from tinytrain import functional as F
from tinytrain.backend import to_host
from tinytrain.nn.moe import expert_capacity, queue_positions, slot_counts, top_k


def gather_over(array: numpy.ndarray, ep_group, dp_group=None) -> numpy.ndarray:
    """Every data rank's ``array``, stacked in data-rank order d·EP + r (dp-major): (D, *shape)."""
    got = dist.all_gather(numpy.ascontiguousarray(array[None]), group=ep_group)  # (EP, ...)
    if dp_group is not None:
        got = dist.all_gather(got, group=dp_group)  # (DP·EP, ...): replica d's block after d - 1's
    return got


def batch_totals(moe, gathered) -> tuple[numpy.ndarray, int]:
    """(assignments that chose each expert (E,), tokens) of the whole batch, from ``gathered``."""
    E = moe.n_experts
    return gathered[:, :, :E].sum(axis=(0, 1)), int(gathered[:, 0, E].sum())


def gate(moe, tokens, ep_group, dp_group=None):
    """The top-k gate over my tokens (N_r, C), with the whole batch's load-balancing loss.

    Returns ``(experts (N_r, k) host, weights (N_r, k) Tensor, aux Tensor, gathered (D, k, E+1))``:
    ``aux`` is D times my share of the serial aux loss (z-loss included), so the average over the
    data group is the serial value and gradient; ``gathered`` holds every rank's counts per
    (choice, expert) and, in the last column, its token count."""
    E, k = moe.n_experts, moe.top_k
    # BEGIN SOLUTION 6.1 "This rank's rows routed as the serial layer routes them, and its share of the whole batch's balancing loss, as if the batch were on one rank." full="logits = moe.gate(tokens), probs = F.softmax; experts = nn.moe's top_k of moe.selection_scores(host probs); weights = moe.combine_weights. Counts per (choice, expert) plus my token count in column E, gather_over the data group; batch_totals of it go into moe.router_loss(..., scale=D)."
    logits = moe.gate(tokens)
    probs = F.softmax(logits, axis=-1)
    experts = top_k(moe.selection_scores(to_host(probs.data)), k)
    weights = moe.combine_weights(probs, experts)
    mine = numpy.zeros((k, E + 1), dtype=numpy.int64)
    mine[:, :E] = slot_counts(experts, E)
    mine[:, E] = tokens.shape[0]
    gathered = gather_over(mine, ep_group, dp_group)
    aux = moe.router_loss(logits, probs, *batch_totals(moe, gathered), scale=float(gathered.shape[0]))
    return experts, weights, aux, gathered
    # END SOLUTION


def global_capacity(moe, gathered) -> int | None:
    """The serial layer's capacity for the whole batch (None: unlimited)."""
    return expert_capacity(moe.capacity_factor, batch_totals(moe, gathered)[1], moe.top_k, moe.n_experts)


def keep(moe, experts, gathered, me: int) -> numpy.ndarray:
    """(N_r, k) bool: which of my assignments fit in their expert's capacity, exactly as the serial
    layer decides on the whole batch (GShard priority: all first choices of every rank, in row
    order, then all second choices, ...). ``me``: my data rank (d·EP + r)."""
    capacity = global_capacity(moe, gathered)
    if capacity is None:
        return numpy.ones(experts.shape, dtype=bool)
    # BEGIN SOLUTION 6.2 "Exactly the assignments the serial layer keeps on the whole batch, whichever rank holds them." full="counts = gathered[:, :, :E] (ranks, choice, expert). ahead[s, e] = every rank's choices s' < s to e + lower ranks' choice s to e; queue_positions(experts, ahead) < capacity."
    counts = gathered[:, :, : moe.n_experts]
    total = counts.sum(axis=0)  # (k, E) over the whole batch
    ahead = numpy.cumsum(total, axis=0) - total + counts[:me].sum(axis=0)
    return queue_positions(experts, ahead) < capacity
    # END SOLUTION


def global_load(moe, gathered):
    """(chosen per expert, kept per expert, dropped share) of the whole batch, from the counts alone:
    a queue keeps min(capacity, arrivals)."""
    chosen, n_total = batch_totals(moe, gathered)
    capacity = global_capacity(moe, gathered)
    kept = chosen if capacity is None else numpy.minimum(chosen, capacity)
    return chosen, kept, 1.0 - kept.sum() / max(n_total * moe.top_k, 1)


def update_bias(moe, load) -> None:
    """Loss-free balancing (DeepSeek-V3), after a step: ``moe.route_bias`` (one float per expert)
    moves by ``moe.bias_rate`` against ``load``, the whole batch's assignments per expert (any
    sequence of numbers). The rule is the paper's: handout §3, remedy 4."""
    # BEGIN SOLUTION 6.5 "Loss-free balancing: every expert's bias takes the paper's fixed-size step, decided by the whole batch's load." full="moe.route_bias += moe.bias_rate * numpy.sign(load.mean() - load)"
    load = numpy.asarray(load, dtype=numpy.float64)
    moe.route_bias += moe.bias_rate * numpy.sign(load.mean() - load)
    # END SOLUTION


def balance_experts(model) -> None:
    """After each optimizer step: ``update_bias`` of every MoE layer under balance "bias", from its
    last training forward's whole-batch load (``moe.stats``: the gathered counts under EP × DP)."""
    from tinytrain.nn.moe import MoE

    for moe in model.modules():
        if isinstance(moe, MoE) and moe.balance == "bias" and moe.stats is not None:
            update_bias(moe, moe.stats["load"])
