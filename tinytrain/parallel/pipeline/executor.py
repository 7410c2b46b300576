"""The executor: one training step of any schedule, each action turned into compute and messages.

``PipelineStep`` walks this stage's list of actions (``schedules.py``) in order. For an action on
chunk c of stage s (virtual stage k = c·p + s, of ``n = p·v``; ZB-V: ``stage.virtual``):

    F mb   k > 0:  recv the activation from k-1, as a leaf (this wait is bubble, not compute)
           k = 0:  embed micro-batch mb's tokens instead
           run the chunk's blocks; k = n-1: the loss; k < n-1: isend the output to k+1
    B mb   k < n-1: recv d(loss)/d(output) from k+1;  backward from the output (or the loss)
           k > 0:   isend the received leaf's .grad to k-1
           (ZB-V's V turns round on one rank, parts p-1 and p: that hand-over is a dict, no message)
    W mb   (zero-bubble schedules, whose B is the input's gradient only) the weight gradients
           B left for later (``autograd.backward_inputs``); no message
    end    wait for every isend; sum the tied weight's two gradients (first and last stage)

Keeping each output until its backward is what costs memory: ``memory`` records the activation
bytes held after each action (GPipe climbs to m micro-batches, 1F1B stays at p-s; under a split
backward the inputs of the weight ops stay until W). Each
micro-batch's summed loss is divided by the targets of the whole batch (``n_targets``), so the
gradients summed over micro-batches are the serial run's, and dropout keeps the micro-batch's
rows of the serial run's mask.

``share_parameters`` gives every rank every weight (each broadcast from the stage owning it), for
evaluation and checkpoints; training never needs it.
"""

from __future__ import annotations

from tinytrain import distributed as dist
from tinytrain import random as _random
from tinytrain import trace
from tinytrain.autograd import Tensor, backward_inputs, saved_bytes
from tinytrain.backend import xp
from tinytrain.parallel.pipeline.messages import (
    message_tag,
    recv_activation,
    recv_gradient,
    send_activation,
    send_gradient,
)
from tinytrain.parallel.pipeline.stage import PipelineStage


class PipelineStep:
    """Run one stage's actions for one step; the loss is averaged over all micro-batches.

    ``x`` and ``y`` are the (data-parallel replica's) batch; row block i is micro-batch i. Each
    micro-batch's loss is its summed cross-entropy divided by ``n_targets`` (default: the counted
    targets in ``y``), so the sum over micro-batches is the mean loss. ``x`` holds rows
    ``first_row...`` of a global batch of ``total_rows``: dropout keeps those rows of the serial mask.
    """

    def __init__(
        self,
        stage: PipelineStage,
        actions,
        x,
        y,
        microbatches: int,
        n_targets=None,
        first_row: int = 0,
        total_rows: int | None = None,
    ):
        if x.shape[0] % microbatches:
            raise ValueError(
                f"a batch of {x.shape[0]} rows does not split into {microbatches} micro-batches; "
                f"use a batch that is a multiple of {microbatches}"
            )
        self.stage, self.actions, self.m = stage, actions, microbatches
        rows = x.shape[0] // microbatches
        self.x = [x[i * rows : (i + 1) * rows] for i in range(microbatches)]
        self.y = [y[i * rows : (i + 1) * rows] for i in range(microbatches)]
        self.first_rows = [first_row + i * rows for i in range(microbatches)]
        self.total_rows = total_rows or x.shape[0]
        self.n_targets = n_targets or int((xp.asarray(y) != -100).sum())
        self.act_shape = stage.model.activation_shape(rows, x.shape[1])
        self.act_dtype = stage.parameters()[0].data.dtype  # activations have the weights' dtype (--precision)
        self.received: dict = {}  # (mb, chunk) -> leaf Tensor (not on virtual stage 0)
        self.outputs: dict = {}  # (mb, chunk) -> output Tensor, or the loss on the last virtual stage
        self.pending = []  # isend handles; their buffers must live until they complete
        self.turned: dict = {}  # (mb, "F" or "B") -> what a V's bottom hands its other chunk, no message
        self.split = any(a.kind == "W" for a in actions)  # B is the input's gradient only, W the rest
        self.weight_work: dict = {}  # a split backward's state from a B to its W (task 5.5: yours to define)
        self.loss = 0.0
        self.memory = []  # (time in us, bytes saved for backward) after each action

    def run(self) -> float | None:
        for action in self.actions:
            run = {"F": self.forward, "B": self.backward, "W": self.weights}[action.kind]
            run(action.microbatch, action.chunk)
            now, held = trace.now(), saved_bytes()
            self.memory.append((now, held))
            trace.record("activations", "memory", now, now, bytes=held)
        for handle in self.pending:
            handle.wait()
        self.stage.sync_tied_parameters()
        return self.loss if self.stage.is_last else None

    def forward(self, mb: int, chunk: int) -> None:
        st = self.stage
        k = st.virtual(chunk)
        if k > 0 and st.peer(k - 1) == st.rank:  # the bottom of a V: the part before is this rank's
            h = Tensor(self.turned.pop((mb, "F")), requires_grad=True)  # a leaf, as if it had come by message
            self.received[(mb, chunk)] = h
        elif k > 0:  # waiting for the input is a bubble, not work: it stays outside the compute span
            h = recv_activation(
                self.act_shape, self.act_dtype, st.peer(k - 1), message_tag(mb, k - 1, st.n_virtual, False), st.group
            )
            self.received[(mb, chunk)] = h
        rows = _random.batch_rows(self.first_rows[mb], self.total_rows)  # dropout: the serial mask's rows
        with rows, trace.span(f"F{mb}", cat="forward", microbatch=mb, chunk=chunk):
            if k == 0:
                h = st.model.embed(self.x[mb])
            out = st.run_chunk(chunk, h)
            if k == st.n_virtual - 1:
                out = st.loss(out, self.y[mb], self.n_targets)
                self.loss += out.item()
        if k < st.n_virtual - 1 and st.peer(k + 1) == st.rank:
            self.turned[(mb, "F")] = out.data
        elif k < st.n_virtual - 1:
            self.pending.append(send_activation(out, st.peer(k + 1), message_tag(mb, k, st.n_virtual, False), st.group))
        self.outputs[(mb, chunk)] = out

    def backward(self, mb: int, chunk: int) -> None:
        st = self.stage
        k = st.virtual(chunk)
        out = self.outputs.pop((mb, chunk))  # dropping it frees this micro-batch's activations
        grad = None
        if k < st.n_virtual - 1 and st.peer(k + 1) == st.rank:
            grad = self.turned.pop((mb, "B"))
        elif k < st.n_virtual - 1:
            grad = recv_gradient(out, st.peer(k + 1), message_tag(mb, k, st.n_virtual, True), st.group)
        leaf = self.received.pop((mb, chunk)) if k > 0 else None
        with trace.span(f"B{mb}", cat="backward", microbatch=mb, chunk=chunk):
            if self.split:
                # BEGIN SOLUTION 5.5 "Only the input gradient the previous stage waits for is computed now; the rest of this backward is left intact for this micro-batch's W." full="self.weight_work[(mb, chunk)] = backward_inputs(out, [leaf], grad), with no inputs on virtual stage 0."
                self.weight_work[(mb, chunk)] = backward_inputs(out, [leaf] if leaf is not None else [], grad)
                # END SOLUTION
            else:
                out.backward(grad)
        if leaf is not None and st.peer(k - 1) == st.rank:
            self.turned[(mb, "B")] = leaf.grad
        elif leaf is not None:
            self.pending.append(
                send_gradient(leaf, st.peer(k - 1), message_tag(mb, k - 1, st.n_virtual, True), st.group)
            )

    def weights(self, mb: int, chunk: int) -> None:
        """W: the weight gradients this micro-batch's B left (no message: nobody waits for them)."""
        with trace.span(f"W{mb}", cat="weights", microbatch=mb, chunk=chunk):
            # BEGIN SOLUTION 5.5 "This micro-batch's weight gradients, computed exactly once; nothing is kept for it afterwards." full="self.weight_work.pop((mb, chunk))()"
            self.weight_work.pop((mb, chunk))()
            # END SOLUTION


def train_step(
    stage: PipelineStage,
    actions,
    x,
    y,
    microbatches: int,
    n_targets=None,
    first_row: int = 0,
    total_rows: int | None = None,
):
    """Forward and backward of one batch under ``actions`` (this stage's list of the schedule).

    Returns ``(loss, step)``: the batch's mean loss on the last stage (None elsewhere) and the
    PipelineStep, whose ``memory`` holds the activation bytes after each action.
    """
    step = PipelineStep(stage, actions, x, y, microbatches, n_targets, first_row, total_rows)
    return step.run(), step


def share_parameters(stage: PipelineStage) -> None:
    """Give every rank every parameter's current values, each broadcast from the stage that owns
    it, so any rank can evaluate the whole model or save a checkpoint. (Not needed for training.)"""
    owner = {}
    for r in reversed(range(stage.stages)):  # the lowest rank holding a parameter owns it
        other = PipelineStage(
            stage.model, stage.stages, stage.chunks, rank=r, group=stage.group, placement=stage.placement
        )
        owner.update({id(p): r for p in other.parameters()})
    for p in stage.model.parameters():
        dist.broadcast(p.data, src=owner[id(p)], group=stage.group)
