"""ZeRO: data parallel without N copies of everything (Rajbhandari et al., 2020).

Plain data parallel keeps, on every rank, the parameters (4Ψ bytes for Ψ fp32 numbers), the
gradients (4Ψ) and Adam's two moments (8Ψ): 16Ψ per rank. ZeRO cuts what each rank *owns* into
N pieces. Every trainable parameter is flattened and split into N nearly equal pieces
(``split_counts``: the first ``size % N`` pieces get one element more); rank r owns piece r of
every parameter and is the only one to update it::

    parameter p (flattened):  [ piece 0 | piece 1 | piece 2 | piece 3 ]     N = 4
                                rank 0    rank 1    rank 2    rank 3

    ZeroStage1  optimizer state sharded     each rank: full W, full g,  m,v of its piece
    ZeroStage2  + gradients sharded         each rank: full W,    g piece, m,v of its piece
    ZeroStage3  + parameters sharded        each rank:    W piece, g piece, m,v of its piece

Each stage is a class that builds on the one before and overrides only what changes; read them in
order. ``Zero(module, optimizer, stage=k)`` picks one. One step, per stage:

    stage 1, 2   forward/backward on full W (no communication in forward)
                 g ── reduce_scatter(avg) ──► my piece of the averaged g   (stage 2: right when
                 update my piece of W with my piece of m, v                 p.grad is ready, then
                 W pieces ── all_gather ──► full W on every rank             p.grad is dropped)
    stage 3      before each layer's forward:  all_gather its W, run it, free W again
                 before each layer's backward: all_gather its W again, backward, free W,
                 reduce_scatter its g into pieces; update my pieces (no all-gather after)

Bytes held per rank (fp32 + Adam; Ψ_r = Σ over parameters of rank r's piece, which is Ψ/N when N
divides every parameter's size and otherwise exceeds Ψ/N by less than the number of parameters):

    unsharded 16Ψ      stage 1: 8Ψ + 8Ψ_r      stage 2: 4Ψ + 12Ψ_r      stage 3: 16Ψ_r
    (+ stage 3 holds the parameters of the layer it is running: reported apart as "gathered")

With 16-bit parameters and gradients (``--precision fp16``) AdamW's state is float32 master weights,
m and v (``tinytrain.optim``): 2Ψ + 2Ψ + 12Ψ unsharded, and the master is sharded with the moments
(stage 1: 4Ψ + 12Ψ_r); every byte on the wire is 2 instead of 4.

Bytes sent per rank and step (ring; exactly when N divides sizes): DDP's all-reduce 2(N-1)/N·4Ψ;
stages 1 and 2 send the same as reduce-scatter + all-gather; stage 3 gathers twice, 3(N-1)/N·4Ψ,
1.5x (a tied weight is gathered once per layer that uses it, so a little more).

Stage 3 and our autograd: a layer's graph keeps references to the arrays it computed with,
parameters included, until backward. Freeing W after forward would therefore free nothing, so a
stage-3 layer runs its forward without a graph and, in backward, gathers W again and recomputes
its forward with a graph (activation checkpointing). The recompute draws the same dropout masks
as the forward did, because every mask is a pure function of (seed, step, the dropout's name)
(``tinytrain.random``).

Composed with the other strategies (``hybrid.parallelize``, as torchtitan composes FSDP), ZeRO shards
over the *data group* (the dp axis of the mesh, dp x cp under context parallel) and each rank shards
its own part of the model, which TP, PP and CP have already cut::

    mpirun -n 4 ... --dp 2 --tp 2 --zero 3          q of a block (C x C), column-parallel over tp:
        r0 (dp 0, tp 0)   r1 (dp 0, tp 1)          tp 0 holds q[:, :C/2], in pieces on r0 | r2
        r2 (dp 1, tp 0)   r3 (dp 1, tp 1)          tp 1 holds q[:, C/2:], in pieces on r1 | r3
    ZeRO's all-gather and reduce-scatter: r0 ↔ r2, r1 ↔ r3     TP's all-reduces: r0 ↔ r1, r2 ↔ r3

    --tp   the units are the TP model's (``gpt_units``: embeddings, blocks, head): a gathered unit is
           this rank's TP shard of the layer; its TP all-reduces run inside the unit, in forward and
           again in the recompute; the head unit computes the vocab-parallel loss (``last=``)
    --cp   context ranks see other positions of the same sequences, so they share pieces as replicas
           do (the group is dp x cp); the embedding unit takes my positions (``first=``), ring or
           all-to-all attention runs inside the blocks (again in the recompute)
    --pp   a stage's parameters are one unit, gathered when the step starts and kept for all its
           micro-batches (the pipeline runs them); their gradients accumulate whole and are
           reduce-scattered once, after the last micro-batch, then W is freed: between steps a rank
           holds pieces only, during a step its stage whole (torchtitan's FSDP under PP, which
           does not reshard after forward, does the same). All-gather once per step, not twice.

ZeRO-1 and 3 thus also take a plain list of parameters (a pipeline stage, whose forward and backward
the pipeline runs), and ``grad_square_sums`` gives a composed layout (tensor x data parallel) the
squares it needs to clip by one global norm. The pieces are public: ``zero.shards``
(list of :class:`ShardedParam`, in parameter order), whose ``.state`` and ``.data`` a checkpoint
reads and writes in place.
"""

from __future__ import annotations

import contextlib

from tinytrain import distributed as dist
from tinytrain.autograd import Tensor
from tinytrain.backend import xp
from tinytrain.parallel.zero_parts import ShardedUnit, ShardedWrapper, gpt_units

_EMPTY = xp.zeros(0, dtype=xp.float32)  # what a stage-3 parameter holds between uses


# ================================================================================================
# Stage 1: optimizer state sharded
# ================================================================================================


class ZeroStage1(ShardedWrapper):
    """ZeRO-1 around ``module`` with the update rule of ``optimizer`` (SGD or AdamW).

    Use it like DDP: ``loss = zero(x) ...; zero.backward(loss); zero.step()`` (``optimizer.zero_grad()``
    as usual). ``module`` may also be a list of Parameters (a pipeline stage): then nothing wraps the
    forward; run backward yourself (gradients accumulate in ``p.grad``), then call
    ``finish_gradient_sync()``, optionally ``clip_grad_norm_``, and ``step()``.

    ``shards``: list[ShardedParam], one per trainable parameter in parameter order: ``.p``, the piece
    ``.start``/``.stop``/``.sizes``, ``.grad`` (my piece of the averaged gradient), ``.state`` (the
    optimizer state of my piece; None before the first step), ``.data`` (stage 3: my piece of W).

    What is not the algorithm (the list-of-parameters adapter, clipping over pieces, memory
    accounting, full parameters for a checkpoint) comes from :class:`ShardedWrapper` in zero_parts.py.
    """

    stage = 1

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation. Stage 1 skips communication inside; stages 2 and 3 still
        reduce-scatter every micro-batch (keeping only pieces is their point) and add the pieces
        (stage 3 over a pipeline stage: once per step, see the module docstring)."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    # --- gradients: reduce-scatter into pieces; the optimizer step on my pieces --------------------

    def _reduce_scatter(self, s, out=None, async_op: bool = False):
        """Average p.grad over the ranks; this rank keeps its piece (written into ``out`` if given)."""
        flat = s.p.grad.reshape(-1)
        # BEGIN SOLUTION 3.1 "Each rank ends with the average, over ranks, of its own piece of this gradient, written where the caller asks and, if asked, started without waiting." full="reduce_scatter flat with op='avg', sizes=s.sizes, group=self.group, out=out, async_op=async_op, and return the result."
        return dist.reduce_scatter(flat, op="avg", group=self.group, sizes=s.sizes, out=out, async_op=async_op)
        # END SOLUTION

    def after_backward(self) -> None:
        self.finish_gradient_sync()

    def finish_gradient_sync(self) -> None:
        """After it, every shard's ``s.grad`` is this rank's piece of the gradient averaged over the
        group, on every rank, whatever gradients this rank's backward produced (none included)."""
        if not self.require_sync:
            return  # accumulate full gradients; the last micro-batch reduce-scatters
        # BEGIN SOLUTION 3.1 "Make this rank's averaged gradient piece of every parameter final, stored inside the full gradient's own memory (no extra array); a parameter without a gradient counts as zeros." full="For every shard: zeros if p.grad is None; reduce-scatter it with out=s.my_piece(p.grad) and keep the piece in s.grad."
        for s in self.shards:
            if s.p.grad is None:
                s.p.grad = xp.zeros_like(s.p.data)
            s.grad = self._reduce_scatter(s, out=s.my_piece(s.p.grad))
        # END SOLUTION

    def _param_piece(self, s):
        return s.my_piece(s.p.data)  # a view: updating it updates p.data

    def step(self, optimizer=None) -> None:
        """Update my piece of every parameter, then share the result (stages 1, 2: all-gather)."""
        self.optimizer = optimizer or self.optimizer  # the training loop may hand it over late
        for s in self.shards:
            if s.grad is None:
                continue
            # BEGIN SOLUTION 3.1 "Only this rank's slice of the weights takes the serial rule's step, with that rule's state kept for the slice alone." full="Create s.state with optimizer.init_state on first use, then optimizer.update my piece of the parameter (self._param_piece(s)) with s.grad."
            piece = self._param_piece(s)
            if s.state is None:
                s.state = self.optimizer.init_state(piece)
            self.optimizer.update(piece, s.grad, s.state)
            # END SOLUTION
            s.grad = None  # used up (stage 1: a view of p.grad, which zero_grad() drops)
        self._after_update()

    def _after_update(self) -> None:
        for s in self.shards:
            # BEGIN SOLUTION 3.1 "Rebuild the full weights on every rank from everyone's updated piece, in place, with no extra copy." full="all_gather my piece (sizes=s.sizes) straight into p.data (out=p.data.reshape(-1))."
            dist.all_gather(s.my_piece(s.p.data), group=self.group, sizes=s.sizes, out=s.p.data.reshape(-1))
            # END SOLUTION


# ================================================================================================
# Stage 2: + gradients sharded
# ================================================================================================


class ZeroStage2(ZeroStage1):
    """ZeRO-2: the gradients are sharded too. A full gradient lives only from the moment backward
    completes it (the engine's post-accumulate hook) until its piece is on its way; its communication
    overlaps the rest of backward, and ``finish_gradient_sync`` collects the pieces."""

    stage = 2

    def __init__(self, module, optimizer, group=None):
        super().__init__(module, optimizer, group)
        self.pending = []  # (shard, async reduce_scatter) not yet waited for
        # The one order in which every rank starts its reduce-scatters (the last layers' gradients
        # are ready first in backward), and this backward's progress through it (task 3.2).
        self.launch_order = self.shards[::-1]
        self.next_to_launch = 0
        self.ready: set[int] = set()  # ids of the parameters whose gradient is complete in this backward
        for s in self.shards:
            s.p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, p) -> None:
        """The engine's post-accumulate hook: ``p.grad`` is complete for this backward (it fires for a
        parameter no gradient reached too, whose ``p.grad`` is then None; never for one this rank's
        graph did not contain)."""
        self._complete(p)

    def _complete(self, p) -> None:
        """``p``'s gradient is complete for this backward (``p.grad``, None when none reached it)."""
        # BEGIN SOLUTION 3.2 "Each gradient's averaging into pieces starts as early as its turn allows, in the same turns on every rank whatever order this rank completes them in, and no full gradient outlives its turn; one complete again before a sync means another backward began." full="If id(p) is already in self.ready, self._close_turns(); add id(p) to self.ready; then while the next shard of self.launch_order is ready: zeros of its shape if its grad is None, append (s, self._reduce_scatter(s, async_op=True)) to self.pending, set its p.grad = None, advance self.next_to_launch."
        if id(p) in self.ready:
            self._close_turns()
        self.ready.add(id(p))
        order = self.launch_order
        while self.next_to_launch < len(order) and id(order[self.next_to_launch].p) in self.ready:
            s = order[self.next_to_launch]
            if s.p.grad is None:  # (stage 3 holds no full p.data here: zeros of its full shape)
                s.p.grad = xp.zeros(s.shape, dtype=s.p.data.dtype)
            self.pending.append((s, self._reduce_scatter(s, async_op=True)))
            s.p.grad = None  # the collective copied it: the full gradient is not kept
            self.next_to_launch += 1
        # END SOLUTION

    def _close_turns(self) -> None:
        """The backward whose gradients are being completed has ended (a sync, or another backward)."""
        # BEGIN SOLUTION 3.2 "Every parameter's reduce-scatter of the last backward has started, in its turn, a parameter that backward never completed counting as zeros, and the next backward starts from the first turn again." full="For each shard of self.launch_order from self.next_to_launch whose id is not in self.ready: self._complete(s.p); then clear self.ready and set self.next_to_launch = 0."
        for s in self.launch_order[self.next_to_launch :]:
            if id(s.p) not in self.ready:
                self._complete(s.p)
        self.ready.clear()
        self.next_to_launch = 0
        # END SOLUTION

    def finish_gradient_sync(self) -> None:
        """Start the reduce-scatters this backward did not (parameters this rank's loss never used),
        wait for all of them, and add each piece to the pieces of earlier micro-batches."""
        self._close_turns()
        for s, work in self.pending:
            if not hasattr(work, "wait"):
                raise TypeError(
                    f"ZeRO: a gradient's reduce-scatter was noted as {type(work).__name__}, not a handle to wait "
                    "for: start it without waiting (async_op=True) and keep what the collective returns"
                )
            piece = work.wait()
            s.grad = piece if s.grad is None else s.grad + piece
        self.pending = []


# ================================================================================================
# Stage 3: + parameters sharded, gathered one layer (unit) at a time
# ================================================================================================


class ZeroStage3(ZeroStage2):
    """ZeRO-3: parameters live as pieces. ``units`` lists the layers gathered one at a time, as
    (name, callable, parameters); by default :func:`gpt_units` of a GPT. The forward runs unit by
    unit (:class:`ShardedUnit`); a gradient is ready once every unit that uses it has run backward."""

    stage = 3

    def __init__(self, module, optimizer, group=None, units=None):
        super().__init__(module, optimizer, group)
        if units is None:  # a pipeline stage's list of parameters is one unit, gathered for the whole step
            units = gpt_units(module) if self.module is not None else [("stage", None, [p for _, p in self.named])]
        self.units = [
            (name, fn, [self.shard_of[id(p)] for p in params if id(p) in self.shard_of]) for name, fn, params in units
        ]
        for _, _, shards in self.units:
            for s in shards:
                s.users += 1
        unused = [s for s in self.shards if s.users == 0]
        if unused:
            raise ValueError(f"{len(unused)} trainable parameters belong to no unit; list every layer in units=")
        for s in self.shards:
            s.pending_users = s.users
            s.data = s.my_piece(s.p.data).copy()  # keep my piece ...
            s.p.data = _EMPTY  # ... and free the full parameter
        self.gathered_bytes = self.peak_gathered_bytes = 0
        self.anchor = Tensor(xp.zeros(0, dtype=xp.float32), requires_grad=True)

    def __call__(self, x, first=None, last=None):
        """Run the units on ``x``. ``first`` and ``last`` stand in, for this call, for the first and
        last unit's callable (their parameters stay the unit's): a composed layout passes the embedding
        at its context-parallel positions, and the head with its loss (TP: vocab-parallel)."""
        if self.module is None:
            return super().__call__(x)  # a list of parameters has no forward: ShardedWrapper says so
        callables = [fn for _, fn, _ in self.units]
        callables[0], callables[-1] = first or callables[0], last or callables[-1]
        for (name, _, shards), fn in zip(self.units, callables):
            x = ShardedUnit.apply(x, self.anchor, zero=self, fn=fn, shards=shards, name=name)
        return x

    @contextlib.contextmanager
    def gathered(self, shards):
        """The full values of ``shards``' parameters for the with-block; freed afterwards."""
        # BEGIN SOLUTION 3.3 "Inside the block every listed parameter holds its full value and the bytes held are counted (with their high-water mark); afterwards, even on error, they hold nothing again." full="all_gather each shard's piece (sizes=s.sizes) and set s.p.data to the full array in s.shape; count the bytes in self.gathered_bytes (and peak); afterwards set p.data back to _EMPTY and uncount."
        for s in shards:
            s.p.data = dist.all_gather(s.data, group=self.group, sizes=s.sizes).reshape(s.shape)
            self.gathered_bytes += s.p.data.nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        try:
            yield
        finally:
            for s in shards:
                self.gathered_bytes -= s.p.data.nbytes
                s.p.data = _EMPTY
        # END SOLUTION

    def _grad_ready(self, p) -> None:
        """Not the engine's hook here: a unit's gradients are complete when its backward is done
        (``unit_backward_done``), on every rank at the same point, also for a parameter this rank's
        recompute never reached. A pipeline stage's accumulate over micro-batches (finish_gradient_sync)."""

    def unit_backward_done(self, shards) -> None:
        """Called by each unit's backward once it is done (``ShardedUnit``): a gradient is complete
        after the backward of its last user (a tied weight has two)."""
        for s in shards:
            s.pending_users -= 1
            if s.pending_users == 0:
                s.pending_users = s.users
                self._complete(s.p)

    def finish_gradient_sync(self) -> None:
        """A pipeline stage: reduce-scatter the gradients its micro-batches accumulated, once per
        step, and drop the full ones (a module's were reduce-scattered as backward completed them)."""
        if self.module is None:
            for s in self.shards:
                self._complete(s.p)  # what stage 2 does with a complete gradient, now
        for s in self.shards:  # a layer whose backward never reached p on this rank: counted afresh
            s.pending_users = s.users
        super().finish_gradient_sync()

    def _param_piece(self, s):
        return s.data

    def _after_update(self) -> None:
        """Nothing to share: the next forward gathers each unit's parameters."""

    def materialize(self) -> None:
        """Gather every full parameter into the model (until the next forward frees it)."""
        for s in self.shards:
            s.p.data = self._full(s.p)

    def _full(self, p):
        s = self.shard_of.get(id(p))
        if s is None:  # frozen: every rank holds it whole
            return p.data.copy()
        return dist.all_gather(s.data, group=self.group, sizes=s.sizes).reshape(s.shape)


ZERO_STAGES = {1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}


def Zero(module, optimizer, stage: int = 1, group=None, units=None):
    """ZeRO stage 1, 2 or 3 around ``module`` (or, stages 1 and 2, a list of parameters)."""
    if stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
    if units is not None:
        return ZERO_STAGES[stage](module, optimizer, group=group, units=units)
    return ZERO_STAGES[stage](module, optimizer, group=group)
