"""Mixture of experts on one process: a top-k gate routes each token to k expert MLPs.

    tokens (N, C) ─ gate ─ softmax ─► probs (N, E) ─ top-k ─► for each token: k (expert, weight)
    sort the N·k assignments by expert  ─►  expert e runs on its contiguous block of tokens
    un-sort the outputs  ─►  y[token] = Σ_k weight_k · expert_k(token)

Expert parallel (later) puts different experts on different ranks: the "sort by expert" step
becomes an all-to-all that sends each block to the rank that holds its expert, and the un-sort
becomes the all-to-all back. Everything else is this file.

Load balancing, as in the lecture: an auxiliary loss (Switch Transformer)
``aux = E · Σ_e f_e · P_e`` where f_e is the share of assignments routed to expert e (counted,
not differentiable) and P_e the mean gate probability of e (differentiable); it is smallest when
both are uniform. With ``capacity_factor > 0`` each expert takes at most
``ceil(capacity_factor · N·k / E)`` assignments; the rest are dropped (their token passes through
the block's residual connection only).
"""

from __future__ import annotations

import math

import numpy

from tinytrain import functional as F
from tinytrain.autograd import Tensor
from tinytrain.backend import to_host, xp
from tinytrain.nn.layers import MLP, Linear
from tinytrain.nn.module import Module, ModuleList


def route(probs_host: numpy.ndarray, top_k: int, capacity: int | None):
    """Pick each token's top-k experts and group the assignments by expert.

    Returns ``(experts, order, counts, kept)``: ``experts`` (N, k) are each token's chosen
    experts, best first; ``order`` lists assignment ids (token·k + slot) grouped by
    expert, lowest expert first and, within an expert, in token order; ``counts[e]`` is how many
    of them expert e processes; ``kept`` marks assignments that fit in their expert's capacity.
    """
    n_tokens, n_experts = probs_host.shape
    # argsort of the negated probabilities; a stable sort breaks ties by the lower expert id
    experts = numpy.argsort(-probs_host, axis=1, kind="stable")[:, :top_k]  # (N, k)
    flat = experts.reshape(-1)
    order = numpy.argsort(flat, kind="stable")
    counts = numpy.bincount(flat, minlength=n_experts)
    kept = numpy.ones(flat.shape[0], dtype=bool)
    if capacity is not None:
        rank_in_expert = numpy.empty_like(order)
        starts = numpy.concatenate([[0], numpy.cumsum(counts)[:-1]])
        rank_in_expert[order] = numpy.arange(order.shape[0]) - numpy.repeat(starts, counts)
        kept = rank_in_expert < capacity
        counts = numpy.minimum(counts, capacity)
        order = order[kept[order]]
    return experts, order, counts, kept


class MoE(Module):
    def __init__(
        self, n_embd, hidden, n_experts, top_k=2, capacity_factor=0.0, dropout=0.0, bias=True, proj_std=0.02, rng=None
    ):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
        if capacity_factor < 0:
            raise ValueError(f"capacity_factor must be >= 0 (0 means unlimited), got {capacity_factor}")
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.gate = Linear(n_embd, n_experts, bias=False, rng=rng)
        self.experts = ModuleList(MLP(n_embd, hidden, dropout, bias, proj_std, rng) for _ in range(n_experts))
        self.aux_loss = None
        self.last_counts = None  # assignments per expert in the last forward (for plots/tests)

    def capacity(self, n_tokens: int) -> int | None:
        if not self.capacity_factor:
            return None
        return math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)

    def forward(self, x):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # (N, C)
        n = tokens.shape[0]
        probs = F.softmax(self.gate(tokens), axis=-1)  # (N, E)
        experts, order, counts, kept = route(to_host(probs.data), self.top_k, self.capacity(n))
        self.last_counts = counts

        # The weight of each (token, slot) assignment, renormalized over the token's top-k.
        rows = numpy.repeat(numpy.arange(n), self.top_k)
        picked = probs[xp.asarray(rows), xp.asarray(experts.reshape(-1))].reshape(n, self.top_k)
        weights = picked / picked.sum(axis=-1, keepdims=True)

        # Run each expert on its contiguous block of the sorted assignments.
        sorted_tokens = tokens[xp.asarray(order // self.top_k)]
        outputs, start = [], 0
        for e, expert in enumerate(self.experts):
            if counts[e]:
                outputs.append(expert(sorted_tokens[start : start + counts[e]]))
            start += counts[e]
        dropped = int((~kept).sum())
        if dropped:  # dropped assignments contribute zeros
            outputs.append(Tensor(xp.zeros((dropped, shape[-1]), dtype=x.dtype)))
        combined = F.concatenate(outputs, axis=0) if len(outputs) > 1 else outputs[0]

        # Un-sort: position of each assignment id in `combined` (dropped ones point at zeros).
        position = numpy.empty(n * self.top_k, dtype=numpy.int64)
        position[order] = numpy.arange(order.shape[0])
        position[~kept] = order.shape[0] + numpy.arange(dropped)
        per_slot = combined[xp.asarray(position)].reshape(n, self.top_k, shape[-1])
        y = (per_slot * weights.reshape(n, self.top_k, 1)).sum(axis=1)

        self.aux_loss = self.load_balancing_loss(probs, experts)
        return y.reshape(*shape)

    def load_balancing_loss(self, probs, experts):
        """E · Σ_e f_e · P_e (Switch Transformer); equals 1 when routing is perfectly uniform."""
        n = experts.shape[0]
        share = numpy.bincount(experts.reshape(-1), minlength=self.n_experts) / (n * self.top_k)
        mean_prob = probs.mean(axis=0)
        return (mean_prob * xp.asarray(share, dtype=probs.dtype)).sum() * self.n_experts

    def extra_repr(self):
        return f"experts={self.n_experts}, top_k={self.top_k}, capacity_factor={self.capacity_factor}"
