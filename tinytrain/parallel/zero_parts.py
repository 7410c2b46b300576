"""The parts ZeRO (``zero.py``) is built from: a parameter's pieces, what every stage does besides
its algorithm (:class:`ShardedWrapper`), stage 3's units, and memory accounting (what a ZeRO rank
holds, and the unsharded figure it is compared against).

:class:`ShardedParam` is one trainable parameter and the piece of it this rank owns; ``zero.shards``
lists them in parameter order. A unit is (name, callable, parameters): stage 3 gathers the unit's
parameters, runs it and frees them again, so a rank holds at most one unit's full parameters at a
time. :class:`ShardedUnit` makes a unit one step of the autograd graph: its forward runs without a
graph (so the gathered parameters can really be freed) and its backward gathers them again and
recomputes the forward with a graph before backpropagating through it: activation recomputation,
the same ``autograd.checkpoint`` as ``--recompute``, with the gather as its context.
"""

from __future__ import annotations

import contextlib
import math

from tinytrain import distributed as dist
from tinytrain import trace
from tinytrain.autograd import checkpoint
from tinytrain.backend import xp
from tinytrain.parallel.wrapper import Wrapper


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


class ShardedUnit:
    """One stage-3 layer as a single autograd step: activation recomputation
    (``tinytrain.autograd.checkpoint``) whose context gathers the layer's parameters::

        forward    gather W ─ run fn(x) without a graph ─ free W           keeps x only
        backward   gather W ─ recompute fn(x) with a graph ─ backpropagate ─ free W
                   ─ zero.unit_backward_done: the unit's gradients are complete (reduce-scatters start)

    Without a graph the gathered W can really be freed after forward: a graph would keep
    references to it. ``anchor`` (a 0-element tensor that requires grad) is part of the call
    zero.py makes; the checkpoint records the step itself, also when ``x`` is token ids."""

    @staticmethod
    def apply(x, anchor, *, zero, fn, shards, name):
        @contextlib.contextmanager
        def gathered(phase):  # "forward", or "backward": the recompute and its backward
            with zero.gathered(shards), trace.span(f"{phase} {name}", cat="compute"):
                yield
            if phase == "backward":  # at the same point on every rank, whichever gradients it reached
                zero.unit_backward_done(shards)

        return checkpoint(fn, x, context=gathered)


def gpt_units(model) -> list:
    """A GPT's layers for stage 3: embeddings, each block, final LayerNorm + (tied) head. ``model``
    is a serial GPT or its tensor-parallel shard (each TP rank then gathers its own shards' pieces):
    both follow the pipeline's stage protocol, which names the parameters outside the blocks."""
    units = [("embed", model.embed, model.first_parameters())]
    units += [(f"block {i}", block, block.parameters()) for i, block in enumerate(model.blocks)]
    units.append(("head", model.logits, model.last_parameters()))
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


class ShardedWrapper(Wrapper):
    """What the ZeRO stages share besides their algorithm; ``ZeroStage1`` builds on it.

    It takes a module or a plain list of Parameters (a pipeline stage, whose forward and backward
    the pipeline runs), broadcasts rank 0's parameters so every rank starts identical, and makes
    ``shards``: a :class:`ShardedParam` per trainable parameter, in parameter order. On top of the
    pieces: clipping by one global norm (``grad_square_sums`` gives a composed layout the squares it
    needs), memory measured from the arrays (:func:`held_bytes`), and the full parameters a
    checkpoint or an evaluation asks for (stage 3 overrides ``_full`` and ``materialize``).
    """

    peak_gathered_bytes = 0  # stages 1, 2 hold every parameter whole: nothing is gathered

    def __init__(self, module, optimizer, group=None):
        if isinstance(module, (list, tuple)):
            super().__init__(None)
            self.named = [(str(i), p) for i, p in enumerate(module)]
        else:
            super().__init__(module)
            self.named = list(module.named_parameters())
        self.optimizer, self.group = optimizer, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        for _, p in self.named:  # same start everywhere, then shard
            dist.broadcast(p.data, src=0, group=group)
        self.shards = [ShardedParam(p, self.rank, self.world_size) for _, p in self.named if p.requires_grad]
        self.shard_of = {id(s.p): s for s in self.shards}
        self.require_sync = True

    def __call__(self, *args, **kwargs):
        if self.module is None:
            raise TypeError(
                "this ZeRO holds a list of parameters, not a module: run the forward and backward "
                "yourself, then call finish_gradient_sync() and step()"
            )
        return super().__call__(*args, **kwargs)

    # --- clipping my gradient pieces by the global norm ---------------------------------------------

    def grad_square_sums(self, is_sharded=lambda p: False) -> tuple[float, float]:
        """(Σ g² over parameters where ``is_sharded(p)``, Σ g² over the others), summed over this
        ZeRO group's pieces. A composed layout adds the first over its other (e.g. tensor-parallel)
        groups before taking the norm; call after finish_gradient_sync(), on every rank."""
        sq = xp.zeros(2, dtype=xp.float64)
        for s in self.shards:
            if s.grad is not None:
                sq[0 if is_sharded(s.p) else 1] += float((s.grad.astype(xp.float64) ** 2).sum())
        sq = dist.all_reduce(sq, group=self.group)
        return float(sq[0]), float(sq[1])

    def clip_grad_norm_(self, max_norm: float, total_norm: float | None = None) -> float:
        """Scale my gradient pieces so the global norm is at most ``max_norm``; return the norm.
        Without ``total_norm`` it is this group's (one all-reduce of the squares of the pieces)."""
        if total_norm is None:
            total_norm = math.sqrt(sum(self.grad_square_sums()))
        if max_norm > 0 and total_norm > max_norm:
            for s in self.shards:
                if s.grad is not None:
                    s.grad *= max_norm / (total_norm + 1e-6)
        return total_norm

    # --- what this rank holds -----------------------------------------------------------------------

    def memory(self) -> dict:
        """Bytes this rank holds now, measured from its arrays (:func:`held_bytes`): params, grads,
        optimizer; apart, the peak of temporarily gathered parameters (stage 3) and frozen ones."""
        return held_bytes(self.shards, [p for _, p in self.named], self.peak_gathered_bytes)

    def optimizer_bytes_per_element(self) -> int:
        """State bytes per parameter element (AdamW 8, SGD with momentum 4), measured."""
        return round(held_bytes(self.shards)["optimizer"] / max(1, sum(s.stop - s.start for s in self.shards)))

    def materialize(self) -> None:
        """Put every full parameter into the model (stages 1, 2 always hold them)."""

    def full_parameters(self) -> dict:
        """name -> full parameter array (stage 3 gathers them: all ranks must call). With a list
        of parameters the names are their positions, "0", "1", ..."""
        return {name: self._full(p) for name, p in self.named}

    def _full(self, p):
        return p.data.copy()
