"""How a GPT uses expert parallel: each MoE routes through the EP group, gradients meet in two groups.

    ep = apply_expert_parallel(model, ep_group, dp_group)     # dp_group None when dp = 1
    with ep.active():
        loss = model.loss(my_rows_x, my_rows_y, denominator=<targets in the global batch> / (DP·EP))
        loss.backward()
    ep.sync_gradients()                                       # 6.4
    optimizer over ep.parameters(model) ... step
    ep.gather_experts()                                       # every rank: every expert's weights

Who holds what (EP = P ranks, DP replicas, data group D = DP·P ranks, each with its own rows):

    non-expert weights (embeddings, attention, norms, gates)   replicated on all D ranks
    expert e                                                   trained by EP rank e // (E/P) of
                                                               each replica (the others keep a stale copy)

Gradients: rank (d, r)'s loss is D × its share of the serial loss; ``sync_gradients`` (6.4) makes
every gradient a rank updates the serial one (the handout's contract and worked case).
"""

from __future__ import annotations

import numpy

from tinytrain import distributed as dist
from tinytrain.backend import xp
from tinytrain.nn.module import swapped
from tinytrain.nn.moe import MoE, dispatch_order
from tinytrain.parallel.expert_parallel.dispatch import dropless, owned, padded, wire_bytes
from tinytrain.parallel.expert_parallel.routing import gate, global_capacity, global_load, keep

VARIANTS = ("dropless", "padded")


class ExpertParallel:
    """The EP settings of a model: its groups, its MoE layers, what this rank owns; see the module doc."""

    def __init__(self, model, ep_group, dp_group=None, variant: str = "dropless"):
        if variant not in VARIANTS:
            raise ValueError(f"variant={variant!r} is not an expert-parallel dispatch; use one of {VARIANTS}")
        self.group, self.dp_group, self.variant = ep_group, dp_group, variant
        self.moes = [m for m in model.modules() if isinstance(m, MoE)]
        if not self.moes:
            raise ValueError(f"{type(model).__name__} has no MoE layer: build it with n_experts > 0")
        P = self.size
        for m in self.moes:
            if m.n_experts % P:
                divisors = [d for d in range(1, m.n_experts + 1) if m.n_experts % d == 0]
                raise ValueError(
                    f"n_experts={m.n_experts} does not split evenly over an expert-parallel group of {P} "
                    f"ranks: choose an EP size among {divisors}, or make n_experts a multiple of {P}"
                )
        self._expert = {id(p) for m in self.moes for e in m.experts for p in e.parameters()}
        mine = owned(self.rank, self.moes[0].n_experts, P)
        self._owned = {id(p) for m in self.moes for e in mine for p in m.experts[e].parameters()}
        self.last = [None] * len(self.moes)  # per layer: what the last EP forward exchanged and counted
        self._params = self.parameters(model)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def data_rank(self) -> int:
        """My place in the data group, d·EP + r: my rows are block ``data_rank`` of the batch."""
        d = 0 if self.dp_group is None else dist.get_rank(self.dp_group)
        return d * self.size + self.rank

    @property
    def data_size(self) -> int:
        return self.size * (1 if self.dp_group is None else dist.get_world_size(self.dp_group))

    # --- ownership ----------------------------------------------------------------------------------

    def is_expert(self, param) -> bool:
        return id(param) in self._expert

    def owns(self, param) -> bool:
        """An expert weight this rank trains."""
        return id(param) in self._owned

    def parameters(self, model) -> list:
        """What this rank's optimizer updates: dense parameters and my experts', in model order."""
        return [p for p in model.parameters() if not self.is_expert(p) or self.owns(p)]

    # --- forward --------------------------------------------------------------------------------------

    def active(self):
        """Inside: the MoE layers route over the EP group; their previous forward again on leaving."""
        return swapped(self.moes, "forward_fn", self.forward)

    def forward(self, moe, x):
        """The MoE layer on my rows ``x``, experts on their owners (set as ``moe.forward_fn``)."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        k = moe.top_k
        experts, weights, aux, gathered = gate(moe, tokens, self.group, self.dp_group)
        kept = keep(moe, experts, gathered, self.data_rank)
        order, counts = dispatch_order(experts, kept, moe.n_experts)
        rows = tokens[xp.asarray(order // k)]
        row_bytes = shape[-1] * x.data.dtype.itemsize
        if self.variant == "dropless":
            outputs, send, recv = dropless(moe, rows, counts, self.group)
            wire = wire_bytes("dropless", self.rank, self.size, moe.n_experts, row_bytes, send, recv)
            sent_rows, slots = sum(send), None
        else:
            slots = int(gathered[:, 0, moe.n_experts].max())  # a rank sends at most one row per token
            capacity = global_capacity(moe, gathered)
            slots = slots if capacity is None else min(slots, capacity)
            outputs = padded(moe, rows, counts, slots, self.group)
            wire = wire_bytes("padded", self.rank, self.size, moe.n_experts, row_bytes, slots=slots)
            sent_rows = moe.n_experts * slots
        y = moe.combine(outputs, order, weights)
        moe.aux_loss = aux
        chosen, kept_global, dropped = global_load(moe, gathered)
        moe.last_counts = kept_global
        moe.stats = {"load": chosen, "dropped": dropped, "aux": aux.item() / self.data_size}  # aux: my share
        i = self.moes.index(moe)
        self.last[i] = {"wire": wire, "kept_rows": int(counts.sum()), "sent_rows": sent_rows, "slots": slots}
        return y.reshape(*shape)

    def stats(self) -> dict:
        """This step's whole-batch numbers per MoE layer, the same on every rank (collective: every rank
        of the data group calls it): ``load`` (layers, E) assignments that chose each expert,
        ``dropped`` (layers,) share of assignments dropped, ``aux`` (layers,) the serial aux loss."""
        shares = numpy.array([m.stats["aux"] for m in self.moes], dtype=numpy.float64)
        dist.all_reduce(shares, group=self.group)
        if self.dp_group is not None:
            dist.all_reduce(shares, group=self.dp_group)
        return {
            "load": numpy.stack([m.stats["load"] for m in self.moes]),
            "dropped": numpy.array([m.stats["dropped"] for m in self.moes]),
            "aux": shares,
        }

    # --- after backward -------------------------------------------------------------------------------

    def sync_gradients(self, dense: bool = True) -> None:
        """Make every gradient this rank updates the serial one (see the module doc). ``dense=False``
        leaves the non-expert gradients to the caller (average them over the data group)."""
        mine = [p for p in self._params if p.requires_grad]
        experts = [p for p in mine if self.is_expert(p)]
        dense_params = [p for p in mine if not self.is_expert(p)] if dense else []
        # BEGIN SOLUTION 6.4 "Make every gradient this rank updates equal the serial one: shared weights averaged over the whole data mesh, expert weights over their replicas and rescaled for the expert ranks; a gradient no rank had stays missing." full="Pack each list into one flat buffer (flatten adds a has-gradient flag per parameter: a missing gradient is zeros there). Dense: average over the EP group, then over the DP group (if any). Experts: average over the DP group, then divide by the EP size. unflatten leaves None where no rank had a gradient."
        if dense_params:
            flat = flatten(dense_params)
            dist.all_reduce(flat, op="avg", group=self.group)
            if self.dp_group is not None:
                dist.all_reduce(flat, op="avg", group=self.dp_group)
            unflatten(flat, dense_params)
        if experts:
            flat = flatten(experts)
            if self.dp_group is not None:
                dist.all_reduce(flat, op="avg", group=self.dp_group)
            unflatten(flat, experts, scale=1.0 / self.size)
        # END SOLUTION

    def gather_experts(self) -> None:
        """Every rank ends with every expert's current weights: each broadcast from its owner."""
        per = self.moes[0].n_experts // self.size
        for m in self.moes:
            for e, expert in enumerate(m.experts):
                for p in expert.parameters():
                    dist.broadcast(p.data, src=e // per, group=self.group)


def flatten(params):
    """One buffer: every parameter's gradient (zeros if it has none), then one flag per parameter
    (1 if it has a gradient), so a collective over it is the same call on every rank."""
    dtype = params[0].data.dtype
    grads = [xp.zeros(p.data.size, dtype=dtype) if p.grad is None else p.grad.reshape(-1) for p in params]
    flags = xp.asarray([0.0 if p.grad is None else 1.0 for p in params], dtype=dtype)
    return xp.concatenate([*grads, flags]).astype(dtype, copy=False)


def unflatten(flat, params, scale: float = 1.0) -> None:
    """Gradients back from ``flatten``'s buffer (times ``scale``); None where no rank had one, as on
    one process when no token reached an expert (an optimizer then skips it, momentum included)."""
    flags, start = flat[flat.size - len(params) :], 0
    for i, p in enumerate(params):
        n = p.data.size
        if float(flags[i]) > 0:
            p.grad = (flat[start : start + n] * scale).reshape(p.data.shape).astype(p.data.dtype, copy=False)
        else:
            p.grad = None
        start += n


def apply_expert_parallel(model, ep_group, dp_group=None, variant: str = "dropless") -> ExpertParallel:
    """Route every MoE layer of ``model`` (a serial GPT with experts) over ``ep_group`` while
    ``with ep.active():``; ``dp_group``: the replicas of this EP group (None for dp = 1)."""
    return ExpertParallel(model, ep_group, dp_group, variant)
