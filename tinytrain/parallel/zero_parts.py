"""The parts ZeRO (``zero.py``) is built from: a parameter's pieces, stage 3's units, and memory
accounting (what a ZeRO rank holds, and the unsharded figure it is compared against).

:class:`ShardedParam` is one trainable parameter and the piece of it this rank owns; ``zero.shards``
lists them in parameter order. A unit is (name, callable, parameters): stage 3 gathers the unit's
parameters, runs it and frees them again, so a rank holds at most one unit's full parameters at a
time. :class:`ShardedUnit` makes a unit one step of the autograd graph: its forward runs without a
graph (so the gathered parameters can really be freed) and its backward gathers them again and
recomputes the forward with a graph (activation checkpointing) before backpropagating through it.
"""

from __future__ import annotations

from tinytrain import distributed as dist
from tinytrain import trace
from tinytrain.autograd import Function, Tensor, enable_grad, no_grad


class ShardedParam:
    """One trainable parameter ``p`` and the piece ``[start, stop)`` of it (flattened) this rank owns.

    ``sizes``: every rank's piece length. ``grad``: my piece of the averaged gradient (None between
    steps). ``state``: the optimizer state of my piece (None before the first step). ``data``:
    stage 3 only, my piece of the parameter (``p.data`` is then empty except while gathered)."""

    def __init__(self, p, rank: int, n: int):
        self.p, self.shape = p, p.shape
        self.sizes = dist.split_counts(p.size, n)  # elements of piece 0, 1, ..., N-1
        self.start = sum(self.sizes[:rank])
        self.stop = self.start + self.sizes[rank]
        self.grad = None
        self.state = None
        self.data = None
        self.users = self.pending_users = 0  # stage 3: layers using p (tied: 2), not yet backpropagated

    def my_piece(self, full):
        return full.reshape(-1)[self.start : self.stop]


class ShardedUnit(Function):
    """One stage-3 layer as a single autograd step: gather, run, free; in backward gather again,
    recompute with a graph, backpropagate (the hooks reduce-scatter), free. ``anchor`` is a
    0-element tensor that requires grad, so the engine records this step even when ``x`` is token ids."""

    @staticmethod
    def forward(ctx, x, anchor, *, zero, fn, shards, name):
        ctx.zero, ctx.layer, ctx.shards, ctx.name = zero, fn, shards, name
        ctx.save_for_backward(x)  # the layer's input: the one activation a checkpoint keeps
        with zero.gathered(shards), no_grad(), trace.span(f"forward {name}", cat="compute"):
            return fn(Tensor(x)).data

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved
        with ctx.zero.gathered(ctx.shards), trace.span(f"backward {ctx.name}", cat="compute"):
            with enable_grad():
                inp = Tensor(x, requires_grad=x.dtype.kind == "f")
                out = ctx.layer(inp)
            out.backward(grad)
        return inp.grad, None


def gpt_units(model) -> list:
    """A GPT's layers for stage 3: embeddings, each block, final LayerNorm + (tied) head."""
    head = [model.wte.weight] if model.head is None else model.head.parameters()
    units = [("embed", model.embed, [model.wte.weight, model.wpe.weight])]
    units += [(f"block {i}", block, block.parameters()) for i, block in enumerate(model.blocks)]
    units.append(("head", model.logits, model.ln_f.parameters() + list(head)))
    return units


def unsharded_memory(module, optimizer) -> dict:
    """What a plain (serial or DDP) rank holds: the figure ZeRO is compared against."""
    params = [p for p in module.parameters() if p.requires_grad]
    return {
        "params": sum(p.nbytes for p in params),
        "grads": sum(p.grad.nbytes for p in params if p.grad is not None),
        "optimizer": optimizer.state_bytes(),
    }


def held_bytes(shards, params=(), gathered_peak: int = 0) -> dict:
    """What a ZeRO rank holds now, measured from its arrays, with no formula per stage: per parameter
    the full W and g where the rank has them, else its pieces (stage 1's piece of g is a view into
    p.grad, so it adds nothing); the optimizer state of its pieces; frozen ``params`` apart."""

    def held(full, piece):
        return full.nbytes if full is not None and full.size else getattr(piece, "nbytes", 0)

    return {
        "params": sum(held(s.p.data, s.data) for s in shards),
        "grads": sum(held(s.p.grad, s.grad) for s in shards),
        "optimizer": sum(a.nbytes for s in shards if s.state for a in s.state.values() if hasattr(a, "nbytes")),
        "gathered_peak": gathered_peak,
        "frozen": sum(p.nbytes for p in params if not p.requires_grad),
    }
