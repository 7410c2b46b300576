"""Mixture of experts on one process: a top-k gate routes each token to k expert MLPs.

    tokens (N, C) ─ gate ─► logits (N, E) ─ softmax ─► probs ─ top-k ─► each token: k (expert, weight)
    capacity: keep an assignment if it fits in its expert's queue (first choices first)
    sort the kept assignments by expert  ─►  expert e runs on its contiguous block of tokens
    un-sort the outputs  ─►  y[token] = Σ_kept weight_slot · expert_slot(token)

Expert parallel (``tinytrain.parallel.expert_parallel``) puts different experts on different ranks:
the "sort by expert" step becomes an all-to-all that sends each block to the rank that holds its
expert, and the un-sort becomes the all-to-all back. It reuses the functions and methods below,
so there is one implementation of the routing.

Conventions (Switch Transformer for k = 1, GShard for k = 2):

- **Top-k.** Each token's k most probable experts, best first (slot 0 = first choice); ties go
  to the lower expert id.
- **Weights.** k = 1: the raw top probability p (Switch), so the task loss reaches the router
  through p (a renormalized p/p = 1 would give it no gradient). k ≥ 2: the top-k probabilities
  renormalized to sum to 1 (GShard); the router still gets a gradient through their ratios.
- **Load-balancing loss** ``aux = E · Σ_e f_e · P_e``: f_e is the share of the N·k top-k
  assignments that chose expert e (counted before capacity drops, not differentiable; for k > 1
  normalized by N·k so Σ f = 1), P_e the mean gate probability of e (differentiable). It is 1 when
  routing is uniform and grows towards E as everything goes to one expert.
- **Balancing** (``balance``): ``"aux"`` adds the load-balancing loss above to the training
  loss (``GPT.loss``). ``"bias"`` is DeepSeek-V3's loss-free balancing: no aux loss; a per-expert
  bias ``route_bias`` (not a parameter, no gradient) is added to the probabilities for the top-k
  *choice* only — the combine weights stay the unbiased probabilities — and after each optimizer
  step moves by steps of ``bias_rate`` against the whole batch's load
  (``expert_parallel.update_bias``, assignment 6.5).
  ``"none"``: neither (the aux value is still measured and logged).
- **Router z-loss** (ST-MoE), optional: ``z = mean_t logsumexp(logits_t)²``, added to the aux
  loss with weight ``z_loss`` (default 0). ``GPT.loss`` multiplies the aux loss by
  ``GPTConfig.moe_aux_weight`` (default 0.01), so ``z_loss = 0.1`` is ST-MoE's 1e-3 on the total loss.
- **Capacity.** With ``capacity_factor > 0`` each expert takes at most
  ``ceil(capacity_factor · N·k / E)`` assignments. Queues fill in GShard priority: every token's
  first choice (in token order), then every second choice, ... so a first choice is never
  dropped to make room for another token's second choice. A dropped assignment contributes
  nothing (its weight is not renormalized away); a token with all k dropped passes through the
  block's residual connection only.

After each forward: ``aux_loss`` (the Tensor added to the training loss), ``last_counts``
(assignments each expert processed) and ``stats`` = ``{"load": assignments that chose each
expert (NumPy), "dropped": share of the N·k assignments dropped, "aux": aux loss value}``.
"""

from __future__ import annotations

import math

import numpy

from tinytrain import functional as F
from tinytrain.autograd import Tensor
from tinytrain.backend import to_host, xp
from tinytrain.nn.layers import MLP, Linear
from tinytrain.nn.module import Module, ModuleList

BALANCES = ("aux", "bias", "none")

# --- routing on host arrays: pure functions the expert-parallel chapter reuses ----------------------


def top_k(probs: numpy.ndarray, k: int) -> numpy.ndarray:
    """Each token's k most probable experts, best first; ties go to the lower expert id. (N, k)."""
    # argsort of the negated probabilities; a stable sort breaks ties by the lower expert id
    return numpy.argsort(-probs, axis=1, kind="stable")[:, :k]


def slot_counts(experts: numpy.ndarray, n_experts: int) -> numpy.ndarray:
    """(k, E): how many tokens chose expert e as their choice number s."""
    return numpy.stack([numpy.bincount(experts[:, s], minlength=n_experts) for s in range(experts.shape[1])])


def queue_positions(experts: numpy.ndarray, ahead: numpy.ndarray) -> numpy.ndarray:
    """(N, k): each assignment's place in its expert's queue, GShard priority.

    ``ahead[s, e]`` assignments wait before this batch's choice-s assignments to expert e (on one
    process: all choices s' < s of every token); among themselves they queue in token order."""
    n, k = experts.shape
    pos = numpy.empty((n, k), dtype=numpy.int64)
    for s in range(k):
        col = experts[:, s]
        order = numpy.argsort(col, kind="stable")  # tokens grouped by expert, token order within
        counts = numpy.bincount(col, minlength=ahead.shape[1])
        starts = numpy.concatenate([[0], numpy.cumsum(counts)[:-1]])
        pos[order, s] = numpy.arange(n) - numpy.repeat(starts, counts)
        pos[:, s] += ahead[s, col]
    return pos


def serial_ahead(counts: numpy.ndarray) -> numpy.ndarray:
    """``ahead`` for one process: for choice s, the assignments of all choices s' < s (k, E)."""
    return numpy.cumsum(counts, axis=0) - counts


def expert_capacity(capacity_factor: float, n_tokens: int, k: int, n_experts: int) -> int | None:
    """``ceil(capacity_factor · N·k / E)`` assignments per expert; None (unlimited) for factor 0."""
    if not capacity_factor:
        return None
    return math.ceil(capacity_factor * n_tokens * k / n_experts)


def dispatch_order(experts: numpy.ndarray, kept: numpy.ndarray, n_experts: int):
    """Kept assignment ids (token·k + slot) grouped by expert, lowest expert first, by id within;
    and how many each expert processes (E,)."""
    flat, keep = experts.reshape(-1), kept.reshape(-1)
    ids = numpy.flatnonzero(keep)
    order = ids[numpy.argsort(flat[ids], kind="stable")]
    return order, numpy.bincount(flat[ids], minlength=n_experts)


def route(probs: numpy.ndarray, k: int, capacity: int | None):
    """Serial routing: ``(experts (N, k), order, counts (E,), kept (N·k,))`` as in the module docstring."""
    experts = top_k(probs, k)
    kept = numpy.ones(experts.shape, dtype=bool)
    if capacity is not None:
        kept = queue_positions(experts, serial_ahead(slot_counts(experts, probs.shape[1]))) < capacity
    order, counts = dispatch_order(experts, kept, probs.shape[1])
    return experts, order, counts, kept.reshape(-1)


class MoE(Module):
    def __init__(
        self,
        n_embd,
        hidden,
        n_experts,
        top_k=2,
        capacity_factor=0.0,
        dropout=0.0,
        bias=True,
        proj_std=0.02,
        rng=None,
        z_loss=0.0,
        balance="aux",
        bias_rate=1e-3,
    ):
        super().__init__()
        if balance not in BALANCES:
            raise ValueError(f"balance must be one of {', '.join(BALANCES)}, got {balance!r}")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
        if capacity_factor < 0:
            raise ValueError(f"capacity_factor must be >= 0 (0 means unlimited), got {capacity_factor}")
        if z_loss < 0:
            raise ValueError(f"z_loss must be >= 0 (0 turns the router z-loss off), got {z_loss}")
        self.n_experts, self.top_k, self.capacity_factor, self.z_loss = n_experts, top_k, capacity_factor, z_loss
        self.balance, self.bias_rate = balance, bias_rate
        self.route_bias = numpy.zeros(n_experts)  # balance "bias": added to the scores the top-k choice sees
        self.gate = Linear(n_embd, n_experts, bias=False, rng=rng)
        self.experts = ModuleList(MLP(n_embd, hidden, dropout, bias, proj_std, rng) for _ in range(n_experts))
        self.aux_loss = None
        self.last_counts = None  # assignments each expert processed in the last forward
        self.stats = None
        # Expert parallel sets a function (moe, x) -> y here while it is active; None: this file's forward.
        self.forward_fn = None

    def capacity(self, n_tokens: int) -> int | None:
        return expert_capacity(self.capacity_factor, n_tokens, self.top_k, self.n_experts)

    def forward(self, x):
        if self.forward_fn is not None:
            return self.forward_fn(self, x)
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # (N, C)
        n = tokens.shape[0]
        logits = self.gate(tokens)
        probs = F.softmax(logits, axis=-1)  # (N, E)
        experts, order, counts, kept = route(self.selection_scores(to_host(probs.data)), self.top_k, self.capacity(n))
        weights = self.combine_weights(probs, experts)
        outputs = self.run_experts(tokens[xp.asarray(order // self.top_k)], counts, range(self.n_experts))
        y = self.combine(outputs, order, weights)
        chosen = numpy.bincount(experts.reshape(-1), minlength=self.n_experts)
        self.aux_loss = self.router_loss(logits, probs, chosen, n)
        self.record(chosen, counts, 1.0 - kept.mean(), self.aux_loss.item())
        return y.reshape(*shape)

    # --- the pieces, shared with expert parallel -------------------------------------------------------

    def selection_scores(self, probs):
        """What the top-k choice ranks (host (N, E)): the probabilities, plus the routing bias under
        balance "bias". Only the choice sees the bias; the combine weights are the probabilities."""
        return probs + self.route_bias if self.balance == "bias" else probs

    def combine_weights(self, probs, experts):
        """(N, k) weight of each assignment: raw p for k = 1, renormalized over the top-k for k ≥ 2."""
        n = experts.shape[0]
        rows = numpy.repeat(numpy.arange(n), self.top_k)
        picked = probs[xp.asarray(rows), xp.asarray(experts.reshape(-1))].reshape(n, self.top_k)
        if self.top_k == 1:
            return picked
        return picked / picked.sum(axis=-1, keepdims=True)

    def run_experts(self, rows, counts, which):
        """Expert ``which[i]`` on the next ``counts[i]`` rows of ``rows``; their outputs concatenated."""
        outputs, start = [], 0
        for e, count in zip(which, counts):
            if count:
                outputs.append(self.experts[e](rows[start : start + int(count)]))
            start += int(count)
        if not outputs:  # no rows: still a piece of the graph (expert parallel's backward must run)
            return rows[:0]
        return F.concatenate(outputs, axis=0) if len(outputs) > 1 else outputs[0]

    def combine(self, outputs, order, weights):
        """y[t] = Σ_slot weight · output of the assignment; ``outputs[i]`` belongs to assignment
        ``order[i]``; an assignment not in ``order`` (dropped) reads a zero row."""
        n, k = weights.shape
        width = outputs.shape[-1]
        padded = F.concatenate([outputs, Tensor(xp.zeros((1, width), dtype=outputs.dtype))], axis=0)
        position = numpy.full(n * k, order.shape[0], dtype=numpy.int64)
        position[order] = numpy.arange(order.shape[0])
        per_slot = padded[xp.asarray(position)].reshape(n, k, width)
        return (per_slot * weights.reshape(n, k, 1)).sum(axis=1)

    def router_loss(self, logits, probs, chosen, n_total, scale=1.0):
        """``scale · (E · Σ_e f_e · P_e + z_loss · Σ_t lse_t² / n_total)`` over these tokens, with
        f_e = chosen[e] / (n_total·k) and P_e = Σ_t probs[t, e] / n_total. One process: n_total = N,
        scale 1 (the docstring's formulas)."""
        share = xp.asarray(chosen / (n_total * self.top_k), dtype=probs.dtype)
        loss = (probs.sum(axis=0) * share).sum() * (self.n_experts / n_total)
        if self.z_loss:
            m = xp.asarray(to_host(logits.data).max(axis=-1, keepdims=True))
            lse = F.log(F.exp(logits - m).sum(axis=-1)) + m.reshape(-1)
            loss = loss + (lse * lse).sum() * (self.z_loss / n_total)
        return loss * scale if scale != 1.0 else loss

    def load_balancing_loss(self, probs, experts):
        """E · Σ_e f_e · P_e (Switch Transformer) alone; equals 1 when routing is perfectly uniform."""
        chosen = numpy.bincount(experts.reshape(-1), minlength=self.n_experts)
        share = xp.asarray(chosen / (experts.shape[0] * self.top_k), dtype=probs.dtype)
        return (probs.mean(axis=0) * share).sum() * self.n_experts

    def record(self, chosen, processed, dropped, aux):
        self.last_counts = numpy.asarray(processed)
        self.stats = {"load": numpy.asarray(chosen), "dropped": float(dropped), "aux": float(aux)}

    def extra_repr(self):
        z = f", z_loss={self.z_loss}" if self.z_loss else ""
        b = f", balance={self.balance}" if self.balance != "aux" else ""
        return f"experts={self.n_experts}, top_k={self.top_k}, capacity_factor={self.capacity_factor}{z}{b}"


def moe_step_stats(model) -> dict:
    """The last forward's numbers of every MoE layer in ``model``, added up for a training log:
    ``load`` (assignments that chose each expert, summed over layers), ``dropped`` (mean share
    dropped by capacity), ``aux`` (the layers' load-balancing losses, summed); {} without MoE."""
    layers = [m.stats for m in model.modules() if isinstance(m, MoE) and m.stats is not None]
    if not layers:
        return {}
    return summarize_stats([s["load"] for s in layers], [s["dropped"] for s in layers], [s["aux"] for s in layers])


def summarize_stats(load, dropped, aux) -> dict:
    """Per-layer numbers (load: layers x experts) as one log record: load summed over layers, the
    mean dropped share, the summed aux loss."""
    return {
        "load": numpy.sum(load, axis=0).tolist(),
        "dropped": float(numpy.mean(dropped)),
        "aux": float(numpy.sum(aux)),
    }


def routing_biases(model) -> dict:
    """Every MoE layer's routing bias (balance "bias"), by module name, for a checkpoint."""
    return {
        name: m.route_bias.tolist() for name, m in model.named_modules() if isinstance(m, MoE) and m.balance == "bias"
    }


def load_routing_biases(model, saved: dict) -> None:
    """Set the routing biases a checkpoint saved (``routing_biases``)."""
    layers = dict(model.named_modules())
    for name, bias in saved.items():
        layers[name].route_bias = numpy.asarray(bias, dtype=numpy.float64)
