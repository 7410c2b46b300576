"""ZeRO: data parallel without N copies of everything (Rajbhandari et al., 2020).

Plain data parallel keeps, on every rank, the parameters (4Ψ bytes for Ψ fp32 numbers), the
gradients (4Ψ) and Adam's two moments (8Ψ): 16Ψ per rank. ZeRO cuts what each rank *owns* into
N pieces. Every trainable parameter is flattened and split into N nearly equal pieces
(``split_counts``: the first ``size % N`` pieces get one element more); rank r owns piece r of
every parameter and is the only one to update it::

    parameter p (flattened):  [ piece 0 | piece 1 | piece 2 | piece 3 ]     N = 4
                                rank 0    rank 1    rank 2    rank 3

    stage 1  optimizer state sharded      each rank: full W, full g,  m,v of its piece
    stage 2  + gradients sharded          each rank: full W,    g piece, m,v of its piece
    stage 3  + parameters sharded         each rank:    W piece, g piece, m,v of its piece

One step, per stage (forward → backward → step):

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

Bytes sent per rank and step (ring; exactly when N divides sizes): DDP's all-reduce 2(N-1)/N·4Ψ;
stages 1 and 2 send the same as reduce-scatter + all-gather; stage 3 gathers twice, 3(N-1)/N·4Ψ,
1.5x (a tied weight is gathered once per layer that uses it, so a little more).

Stage 3 and our autograd: a layer's graph keeps references to the arrays it computed with,
parameters included, until backward. Freeing W after forward would therefore free nothing, so a
stage-3 layer runs its forward without a graph and, in backward, gathers W again and recomputes
its forward with a graph (activation checkpointing). Dropout would draw a new mask in the
recompute, so stage 3 needs dropout 0.
"""

from __future__ import annotations

import contextlib
import math

from tinytrain import distributed as dist
from tinytrain import trace
from tinytrain.autograd import Function, Tensor, enable_grad, no_grad
from tinytrain.backend import xp
from tinytrain.parallel.data_parallel import Wrapper, broadcast_parameters, trainable

_EMPTY = xp.zeros(0, dtype=xp.float32)  # what a stage-3 parameter holds between uses


class ShardedParam:
    """One trainable parameter and the piece of it this rank owns."""

    def __init__(self, p, rank: int, n: int):
        self.p, self.shape = p, p.shape
        self.sizes = dist.split_counts(p.size, n)  # elements of piece 0, 1, ..., N-1
        self.start = sum(self.sizes[:rank])
        self.stop = self.start + self.sizes[rank]
        self.grad = None  # my piece of the averaged gradient
        self.state = None  # optimizer state of my piece
        self.data = None  # stage 3 only: my piece of the parameter (p.data is freed)
        self.users = 0  # stage 3: how many layers use p (a tied weight: 2)
        self.pending_users = 0  # stage 3: users whose backward has not run yet this step

    def my_piece(self, full):
        return full.reshape(-1)[self.start:self.stop]


class Zero(Wrapper):
    """ZeRO stage 1, 2 or 3 around ``module`` with the update rule of ``optimizer`` (SGD or AdamW).

    Use it like DDP: ``loss = zero(x) ...; zero.backward(loss); zero.step()`` (and
    ``optimizer.zero_grad()`` as usual). ``units`` (stage 3) lists the layers gathered one at a
    time, as (name, callable, parameters); by default :func:`gpt_units` of a GPT.
    """

    def __init__(self, module, optimizer, stage: int = 1, group=None, units=None):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
        super().__init__(module)
        self.optimizer, self.stage, self.group = optimizer, stage, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        broadcast_parameters(module, group=group)  # same start everywhere, then shard
        self.shards = [ShardedParam(p, self.rank, self.world_size) for p in trainable(module)]
        self.shard_of = {id(s.p): s for s in self.shards}
        self.require_sync = True
        self.pending = []  # (shard, async reduce_scatter) not yet waited for
        self.gathered_bytes = self.peak_gathered_bytes = 0
        if stage == 2:
            for s in self.shards:
                s.p.register_post_accumulate_grad_hook(self._grad_ready)
        if stage == 3:
            self._shard_parameters(units if units is not None else gpt_units(module))

    def __call__(self, *args, **kwargs):
        return self._forward_stage3(*args) if self.stage == 3 else super().__call__(*args, **kwargs)

    # --- gradients: reduce-scatter into pieces --------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation. Stage 1 skips communication inside; stages 2 and 3 still
        reduce-scatter every micro-batch (keeping only pieces is their point) and add the pieces."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def _reduce_scatter(self, s, async_op: bool = False):
        """Average p.grad over the ranks; this rank keeps its piece. Stage 1 writes the piece
        into p.grad itself (no extra memory); stages 2, 3 make a new piece and drop p.grad."""
        flat = s.p.grad.reshape(-1)
        out = s.my_piece(flat) if self.stage == 1 else None
        # BEGIN SOLUTION 3.1 "reduce_scatter flat with op='avg', sizes=s.sizes, group=self.group, out=out, async_op=async_op, and return the result."
        return dist.reduce_scatter(flat, op="avg", group=self.group, sizes=s.sizes, out=out, async_op=async_op)
        # END SOLUTION

    def _keep_piece(self, s, piece) -> None:
        s.grad = piece if s.grad is None or self.stage == 1 else s.grad + piece

    def _grad_ready(self, p) -> None:
        """Stage 2: the engine says p.grad is complete; start its reduce-scatter and free p.grad."""
        s = self.shard_of[id(p)]
        # BEGIN SOLUTION 3.2 "If p.grad is None use zeros; launch an async reduce-scatter of p's gradient (self._reduce_scatter), append (s, work) to self.pending, then set p.grad = None."
        if p.grad is None:
            p.grad = xp.zeros_like(p.data)
        self.pending.append((s, self._reduce_scatter(s, async_op=True)))
        p.grad = None  # the collective copied it: the full gradient is not kept
        # END SOLUTION

    def after_backward(self) -> None:
        self.finish_gradient_sync()

    def finish_gradient_sync(self) -> None:
        """Make every rank's gradient pieces final for this backward."""
        if self.stage == 1:
            if not self.require_sync:
                return  # accumulate full gradients; the last micro-batch reduce-scatters
            # BEGIN SOLUTION 3.1 "For every shard, reduce-scatter its gradient (zeros if p.grad is None) and keep the piece in s.grad."
            for s in self.shards:
                if s.p.grad is None:
                    s.p.grad = xp.zeros_like(s.p.data)
                self._keep_piece(s, self._reduce_scatter(s))
            # END SOLUTION
            return
        for s, work in self.pending:
            self._keep_piece(s, work.wait())
        self.pending = []

    # --- the optimizer step on my pieces ---------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip by the global gradient norm: each rank sums the squares of its pieces, one
        all-reduce adds them up. Call after backward, before step(); returns the norm."""
        local = sum(float((s.grad.astype(xp.float64) ** 2).sum()) for s in self.shards if s.grad is not None)
        total = dist.all_reduce(xp.array([local], dtype=xp.float64), group=self.group)
        norm = math.sqrt(float(total[0]))
        if max_norm > 0 and norm > max_norm:
            for s in self.shards:
                if s.grad is not None:
                    s.grad *= max_norm / (norm + 1e-6)
        return norm

    def step(self, optimizer=None) -> None:
        """Update my piece of every parameter, then (stages 1, 2) all-gather the full parameters."""
        self.optimizer = optimizer or self.optimizer  # the training loop may hand it over late
        for s in self.shards:
            if s.grad is None:
                continue
            # BEGIN SOLUTION 3.1 "Create s.state with optimizer.init_state on first use, then optimizer.update my piece of the parameter (s.data in stage 3, else a view of p.data) with s.grad."
            piece = s.data if self.stage == 3 else s.my_piece(s.p.data)
            if s.state is None:
                s.state = self.optimizer.init_state(piece)
            self.optimizer.update(piece, s.grad, s.state)
            # END SOLUTION
            s.grad = None  # used up (stage 1: a view of p.grad, which zero_grad() drops)
        if self.stage < 3:
            for s in self.shards:
                # BEGIN SOLUTION 3.1 "all_gather my piece (sizes=s.sizes) straight into p.data (out=p.data.reshape(-1))."
                dist.all_gather(s.my_piece(s.p.data), group=self.group, sizes=s.sizes, out=s.p.data.reshape(-1))
                # END SOLUTION

    # --- stage 3: parameters live as pieces, gathered per layer ----------------------------------

    def _shard_parameters(self, units) -> None:
        if getattr(getattr(self.module, "config", None), "dropout", 0.0):
            raise ValueError("ZeRO-3 recomputes each layer's forward in backward, which would draw new "
                             "dropout masks; use dropout 0 (--dropout 0) with stage 3")
        self.units = [(name, fn, [self.shard_of[id(p)] for p in params if id(p) in self.shard_of])
                      for name, fn, params in units]
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
        self.anchor = Tensor(xp.zeros(0, dtype=xp.float32), requires_grad=True)

    @contextlib.contextmanager
    def gathered(self, shards):
        """The full values of ``shards``' parameters for the with-block; freed afterwards."""
        # BEGIN SOLUTION 3.3 "all_gather each shard's piece (sizes=s.sizes) and set s.p.data to the full array in s.shape; count the bytes in self.gathered_bytes (and peak); afterwards set p.data back to _EMPTY and uncount."
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

    def _unit_backward_done(self, shards) -> None:
        """A layer's backward ran: reduce-scatter the gradients no other layer still adds to."""
        for s in shards:
            s.pending_users -= 1
            if s.pending_users == 0:  # a tied weight waits for its last user
                s.pending_users = s.users
                if s.p.grad is None:
                    s.p.grad = xp.zeros(s.shape, dtype=s.data.dtype)
                self.pending.append((s, self._reduce_scatter(s, async_op=True)))
                s.p.grad = None

    def _forward_stage3(self, x):
        for name, fn, shards in self.units:
            x = _ShardedUnit.apply(x, self.anchor, zero=self, fn=fn, shards=shards, name=name)
        return x

    # --- memory ----------------------------------------------------------------------------------

    def memory(self) -> dict:
        """Bytes this rank holds now for trainable parameters, gradients, optimizer state; the
        peak of temporarily gathered parameters (stage 3) and frozen parameters apart."""
        if self.stage == 3:
            params = sum(s.data.nbytes for s in self.shards)
        else:
            params = sum(s.p.data.nbytes for s in self.shards)
        if self.stage == 1:  # full gradients; my piece is a view into them
            grads = sum(s.p.grad.nbytes for s in self.shards if s.p.grad is not None)
        else:
            grads = sum(s.grad.nbytes for s in self.shards if s.grad is not None)
        optimizer = sum(a.nbytes for s in self.shards if s.state for a in s.state.values() if hasattr(a, "nbytes"))
        frozen = sum(p.nbytes for p in self.module.parameters() if not p.requires_grad)
        return {"params": params, "grads": grads, "optimizer": optimizer,
                "gathered_peak": self.peak_gathered_bytes, "frozen": frozen}

    def optimizer_bytes_per_element(self) -> int:
        """State bytes per parameter element (AdamW 8, SGD with momentum 4), measured."""
        state = sum(a.nbytes for s in self.shards if s.state for a in s.state.values() if hasattr(a, "nbytes"))
        return round(state / max(1, sum(s.stop - s.start for s in self.shards)))

    def materialize(self) -> None:
        """Stage 3: gather every full parameter into the model (until the next forward frees it)."""
        for s in self.shards:
            s.p.data = dist.all_gather(s.data, group=self.group, sizes=s.sizes).reshape(s.shape)

    def full_parameters(self) -> dict:
        """name -> full parameter array (stage 3 gathers them; all ranks must call)."""
        out = {}
        for name, p in self.module.named_parameters():
            s = self.shard_of.get(id(p))
            if self.stage == 3 and s is not None:
                out[name] = dist.all_gather(s.data, group=self.group, sizes=s.sizes).reshape(s.shape)
            else:
                out[name] = p.data.copy()
        return out


class _ShardedUnit(Function):
    """One stage-3 layer as a single autograd step: gather, run, free; in backward gather again,
    recompute with a graph, backpropagate, free, reduce-scatter. ``anchor`` is a 0-element tensor
    that requires grad, so the engine records this step even when ``x`` is token ids."""

    @staticmethod
    def forward(ctx, x, anchor, *, zero, fn, shards, name):
        ctx.zero, ctx.layer, ctx.shards, ctx.name = zero, fn, shards, name
        ctx.save_for_backward(x)  # the layer's input: the one activation a checkpoint keeps
        with zero.gathered(shards), no_grad(), trace.span(f"forward {name}", cat="compute"):
            return fn(Tensor(x)).data

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved
        zero = ctx.zero
        with zero.gathered(ctx.shards), trace.span(f"backward {ctx.name}", cat="compute"):
            with enable_grad():
                inp = Tensor(x, requires_grad=x.dtype.kind == "f")
                out = ctx.layer(inp)
            out.backward(grad)
        zero._unit_backward_done(ctx.shards)
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
    return {"params": sum(p.nbytes for p in params),
            "grads": sum(p.grad.nbytes for p in params if p.grad is not None),
            "optimizer": optimizer.state_bytes()}
