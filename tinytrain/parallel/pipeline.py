"""Pipeline parallel: the model cut into stages, micro-batches flowing through, schedules as data.

A pipeline of ``p`` stages trains ``m`` micro-batches per step. A *schedule* says, for each
stage, the order in which it runs forward (F) and backward (B) passes of micro-batches:

    GPipe, p=4, m=4 (time →; numbers are micro-batches; · is a bubble)

    stage 0  F0 F1 F2 F3 ·  ·  ·  ·  ·  ·  B0 B1 B2 B3
    stage 1  ·  F0 F1 F2 F3 ·  ·  ·  ·  B0 B1 B2 B3 ·
    stage 2  ·  ·  F0 F1 F2 F3 ·  ·  B0 B1 B2 B3 ·  ·
    stage 3  ·  ·  ·  F0 F1 F2 F3 B0 B1 B2 B3 ·  ·  ·     (B drawn as long as F here)

Every stage idles for p-1 slots of F and p-1 slots of B, so with equal costs the *bubble share*
(idle time / total time) is (p-1)/(m+p-1). More micro-batches shrink it.

1F1B runs the same work in another order: after p-1-s warm-up forwards, stage s alternates one
forward and one backward. The bubble is the same, but a stage never holds more than p-s
micro-batches' activations at once instead of all m: memory is what 1F1B buys.

Interleaved 1F1B gives each stage v model *chunks* (stage s holds chunks s, s+p, s+2p, ...), so a
micro-batch passes every stage v times, each pass 1/v as long. Filling and draining the pipe then
costs (p-1)/v of a full pass: the bubble share becomes (p-1)/(v·m+p-1), at the price of v times
as many messages.

An ``Action`` names one pass; a schedule is ``list[list[Action]]``, one list per stage
(``simulator.py`` plays one on paper: bubble share, peak activations, deadlocks). Chunk c of
stage s is *virtual stage* ``c·p + s``, and the executor below turns each action into messages:

    stage s-1                      stage s                          stage s+1
       F: ── activation ──► recv, make it a leaf ─ blocks ─ send ──► ...
       B: ◄── leaf.grad ─── send     backward(received grad) ◄── recv ◄── ...

The received activation is a fresh autograd *leaf*: backward inside the stage stops there, and
its ``.grad`` is exactly the gradient the previous stage needs. That one idea is all the autograd
a pipeline needs. The first stage also embeds the tokens, the last also computes the loss; with
tied embeddings both hold ``wte``, and their two gradients are summed across them after backward.

With tensor parallelism inside each stage (``--pp P --tp T``) the "model" is a
``TensorParallelGPT``: every TP rank of a stage runs the same actions on its shards, the
activations between stages are whole (B, T, C) tensors (the same on every TP rank of a stage), so
TP rank r of stage s talks to TP rank r of stage s±1 only (the pipeline group is the mesh's pp
axis), and the last stage's loss is the vocab-parallel cross-entropy (``head_loss``).
"""

from __future__ import annotations

from typing import Protocol

from tinytrain import distributed as dist
from tinytrain import random as _random
from tinytrain import trace
from tinytrain.autograd import Tensor, saved_bytes
from tinytrain.backend import xp
from tinytrain.parallel.simulator import Action

# ============================================================================================
# Schedules
# ============================================================================================


def _check(stages: int, microbatches: int, chunks: int = 1) -> None:
    if stages < 1 or microbatches < 1 or chunks < 1:
        raise ValueError(f"need stages, microbatches and chunks >= 1, got {stages}, {microbatches}, {chunks}")


def gpipe(stages: int, microbatches: int) -> list[list[Action]]:
    """All forwards, then all backwards, on every stage."""
    _check(stages, microbatches)
    # BEGIN SOLUTION 5.2 "Every stage: F0..F(m-1), then B0..B(m-1)."
    return [
        [Action("F", i) for i in range(microbatches)] + [Action("B", i) for i in range(microbatches)]
        for _ in range(stages)
    ]
    # END SOLUTION


def one_f_one_b(stages: int, microbatches: int) -> list[list[Action]]:
    """Warm up with p-1-s forwards, then alternate one forward and one backward, then drain."""
    _check(stages, microbatches)
    # BEGIN SOLUTION 5.3 "Stage s: min(p-1-s, m) warm-up forwards, then pairs (F next, B oldest), then the remaining B."
    schedule = []
    for s in range(stages):
        warmup = min(stages - 1 - s, microbatches)
        actions = [Action("F", i) for i in range(warmup)]
        for i in range(microbatches - warmup):
            actions += [Action("F", warmup + i), Action("B", i)]
        actions += [Action("B", i) for i in range(microbatches - warmup, microbatches)]
        schedule.append(actions)
    return schedule
    # END SOLUTION


def interleaved_1f1b(stages: int, microbatches: int, chunks: int) -> list[list[Action]]:
    """1F1B over virtual stages (Megatron-LM's interleaved schedule).

    Forwards go in groups of p micro-batches per chunk: micro-batches 0..p-1 through chunk 0, then
    the same through chunk 1, ..., then micro-batches p..2p-1 through chunk 0, and so on. Backwards
    visit the chunks in reverse. Needs ``microbatches`` to be a multiple of ``stages``.
    """
    _check(stages, microbatches, chunks)
    if microbatches % stages:
        raise ValueError(
            f"interleaved 1F1B sends micro-batches in groups of {stages} (the number of stages); "
            f"{microbatches} micro-batches is not a multiple of {stages}: "
            f"choose e.g. {stages * max(1, microbatches // stages)}"
        )
    # BEGIN SOLUTION 5.4 "Number the passes k = 0..m·v-1: chunk (k mod pv)//p, micro-batch (k//pv)·p + k mod p; backwards reverse the chunk; warm-up 2(p-1-s) + (v-1)p."
    total = microbatches * chunks
    group = stages * chunks

    def nth(k: int, kind: str) -> Action:
        chunk = (k % group) // stages
        microbatch = (k // group) * stages + k % stages
        return Action(kind, microbatch, chunk if kind == "F" else chunks - 1 - chunk)

    schedule = []
    for s in range(stages):
        warmup = total if microbatches == stages else min(total, (stages - 1 - s) * 2 + (chunks - 1) * stages)
        actions = [nth(k, "F") for k in range(warmup)]
        for k in range(total - warmup):
            actions += [nth(warmup + k, "F"), nth(k, "B")]
        actions += [nth(k, "B") for k in range(total - warmup, total)]
        schedule.append(actions)
    return schedule
    # END SOLUTION


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b}


def make_schedule(name: str, stages: int, microbatches: int, chunks: int = 1) -> list[list[Action]]:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if name == "interleaved":
        return interleaved_1f1b(stages, microbatches, chunks)
    if chunks != 1:
        raise ValueError(f"--chunks {chunks} needs --schedule interleaved ({name} runs one chunk per stage)")
    return SCHEDULES[name](stages, microbatches)


# ============================================================================================
# Cutting the model into stages
# ============================================================================================


def split_layers(n_layer: int, stages: int, chunks: int = 1) -> list[range]:
    """The blocks of each virtual stage: as even as possible, earlier stages take the extra ones."""
    n_virtual = stages * chunks
    if n_layer < n_virtual:
        raise ValueError(
            f"{n_layer} transformer blocks cannot fill {stages} stages x {chunks} chunks = {n_virtual} "
            f"virtual stages (one would be empty): use --layers >= {n_virtual}, or fewer stages or chunks"
        )
    base, extra = divmod(n_layer, n_virtual)
    bounds, start = [], 0
    for k in range(n_virtual):
        size = base + (1 if k < extra else 0)
        bounds.append(range(start, start + size))
        start += size
    return bounds


class StageModel(Protocol):
    """What a model offers to be cut into stages (``GPT`` and ``TensorParallelGPT`` do)."""

    blocks: list  # the repeated layers; each virtual stage runs a contiguous run of them

    def embed(self, ids) -> Tensor: ...  # the first stage: token ids -> the first block's input

    def head_loss(self, x, targets, denominator) -> Tensor: ...  # the last stage: last block's output -> loss

    def first_parameters(self) -> list: ...  # held by the first stage besides its blocks

    def last_parameters(self) -> list: ...  # held by the last stage besides its blocks

    def activation_shape(self, rows: int, seq_len: int) -> tuple: ...  # what one block hands the next


class PipelineStage:
    """What one rank holds of a model: its chunks of blocks, plus the first or last stage's extras.

    Every rank builds the whole model from the same seed and keeps references to its part only, so
    a pipeline run starts from exactly the serial run's weights. ``model`` follows ``StageModel``.
    A parameter held by both the first and the last stage (a tied embedding) is *tied*: its two
    gradients are summed between those stages after backward.
    """

    def __init__(self, model: StageModel, stages: int, chunks: int = 1, rank: int | None = None, group=None):
        self.model, self.stages, self.chunks, self.group = model, stages, chunks, group
        self.rank = dist.get_rank(group) if rank is None else rank
        if dist.get_world_size(group) != stages:
            raise ValueError(
                f"a {stages}-stage pipeline needs a group of {stages} ranks, got {dist.get_world_size(group)}"
            )
        self.n_virtual = stages * chunks
        layers = split_layers(len(model.blocks), stages, chunks)
        self.blocks = {c: [model.blocks[i] for i in layers[c * stages + self.rank]] for c in range(chunks)}
        self.is_first = self.rank == 0  # holds virtual stage 0
        self.is_last = self.rank == stages - 1  # holds virtual stage n_virtual - 1
        first_ids = {id(p) for p in model.first_parameters()}
        self.tied = [p for p in model.last_parameters() if id(p) in first_ids] if stages > 1 else []

    def parameters(self):
        """This rank's parameters, each once."""
        params = self.model.first_parameters() if self.is_first else []
        for chunk in self.blocks.values():
            for block in chunk:
                params += block.parameters()
        if self.is_last:
            params += self.model.last_parameters()
        seen = set()
        return [p for p in params if not (id(p) in seen or seen.add(id(p)))]

    def virtual(self, chunk: int) -> int:
        return chunk * self.stages + self.rank

    def peer(self, virtual_stage: int) -> int:
        return virtual_stage % self.stages

    def loss(self, x, targets, n_targets):
        """The last virtual stage: summed loss of the last block's output / n_targets."""
        return self.model.head_loss(x, targets, denominator=n_targets)

    def run_chunk(self, chunk: int, x):
        for block in self.blocks[chunk]:
            x = block(x)
        return x

    def sync_tied_parameters(self) -> None:
        """Sum the two halves of a tied parameter's gradient (first stage: lookup; last: head)."""
        if not self.tied or not (self.is_first or self.is_last):
            return
        other = self.stages - 1 if self.is_first else 0
        for w in self.tied:
            mine = w.grad if w.grad is not None else xp.zeros_like(w.data)
            theirs = xp.empty_like(mine)
            dist.sendrecv(mine, other, theirs, other, group=self.group, tag=_TIED_TAG)
            w.grad = mine + theirs


# ============================================================================================
# Messages between stages, with autograd
# ============================================================================================

_TIED_TAG = 1


def _tag(microbatch: int, boundary: int, n_virtual: int, backward: bool) -> int:
    """A tag per (micro-batch, stage boundary, direction): messages can never be confused."""
    return 2 + 2 * (microbatch * n_virtual + boundary) + int(backward)


def send_activation(output: Tensor, dst: int, tag: int, group=None):
    """Forward: hand this stage's output to the next stage (non-blocking; keep the handle)."""
    # BEGIN SOLUTION 5.1 "isend the output's array; backward starts from this tensor later, so keep it."
    return dist.isend(output.data, dst, group=group, tag=tag)
    # END SOLUTION


def recv_activation(shape, dtype, src: int, tag: int, group=None) -> Tensor:
    """Forward: receive the previous stage's output as a new autograd leaf that wants a gradient."""
    # BEGIN SOLUTION 5.1 "Receive into a fresh buffer and wrap it as Tensor(..., requires_grad=True)."
    buffer = xp.empty(shape, dtype=dtype)
    dist.recv(buffer, src, group=group, tag=tag)
    return Tensor(buffer, requires_grad=True)
    # END SOLUTION


def send_gradient(received: Tensor, dst: int, tag: int, group=None):
    """Backward: after backward reached the received leaf, its .grad goes to the previous stage."""
    # BEGIN SOLUTION 5.1 "The leaf's .grad is d(loss)/d(previous stage's output): isend it."
    return dist.isend(received.grad, dst, group=group, tag=tag)
    # END SOLUTION


def recv_gradient(output: Tensor, src: int, tag: int, group=None):
    """Backward: receive d(loss)/d(output) from the next stage, shaped like this stage's output."""
    # BEGIN SOLUTION 5.1 "Receive an array shaped like output.data and return it."
    grad = xp.empty_like(output.data)
    dist.recv(grad, src, group=group, tag=tag)
    return grad
    # END SOLUTION


# ============================================================================================
# The executor: one training step of any schedule
# ============================================================================================


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
        self.received: dict = {}  # (mb, chunk) -> leaf Tensor (not on virtual stage 0)
        self.outputs: dict = {}  # (mb, chunk) -> output Tensor, or the loss on the last virtual stage
        self.pending = []  # isend handles; their buffers must live until they complete
        self.loss = 0.0
        self.memory = []  # (time in us, bytes saved for backward) after each action

    def run(self) -> float | None:
        for action in self.actions:
            (self.forward if action.kind == "F" else self.backward)(action.microbatch, action.chunk)
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
        if k > 0:  # waiting for the input is a bubble, not work: it stays outside the compute span
            h = recv_activation(
                self.act_shape, xp.float32, st.peer(k - 1), _tag(mb, k - 1, st.n_virtual, False), st.group
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
        if k < st.n_virtual - 1:
            self.pending.append(send_activation(out, st.peer(k + 1), _tag(mb, k, st.n_virtual, False), st.group))
        self.outputs[(mb, chunk)] = out

    def backward(self, mb: int, chunk: int) -> None:
        st = self.stage
        k = st.virtual(chunk)
        out = self.outputs.pop((mb, chunk))  # dropping it frees this micro-batch's activations
        grad = None
        if k < st.n_virtual - 1:
            grad = recv_gradient(out, st.peer(k + 1), _tag(mb, k, st.n_virtual, True), st.group)
        with trace.span(f"B{mb}", cat="backward", microbatch=mb, chunk=chunk):
            out.backward(grad)
        if k > 0:
            leaf = self.received.pop((mb, chunk))
            self.pending.append(send_gradient(leaf, st.peer(k - 1), _tag(mb, k - 1, st.n_virtual, True), st.group))


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
        other = PipelineStage(stage.model, stage.stages, stage.chunks, rank=r, group=stage.group)
        owner.update({id(p): r for p in other.parameters()})
    for p in stage.model.parameters():
        dist.broadcast(p.data, src=owner[id(p)], group=stage.group)
