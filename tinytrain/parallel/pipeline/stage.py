"""Cutting the model into stages: which blocks each rank holds, and the weights two stages share.

Every rank builds the whole model from the same seed and keeps references to its part only. The
transformer blocks are cut into ``p·v`` contiguous runs (*virtual stages*, as even as possible);
rank s holds chunks s, s+p, s+2p, ... (v chunks; ZB-V's V holds s and 2p-1-s, so rank 0 holds both
ends of the model). With 4 ranks, 8 blocks and one chunk each:

              rank 0              rank 1         rank 2         rank 3
    tokens ─► embed, blocks 0-1 ─► blocks 2-3 ─► blocks 4-5 ─► blocks 6-7, head, loss
                   wte ◄──────────── tied: grad(wte) summed after backward ──────────► wte

The first stage also embeds the tokens (``first_parameters``), the last also computes the loss
(``last_parameters``, ``head_loss``). With tied embeddings both hold ``wte``: the first uses it
as the lookup table, the last as the head, and their two gradients are summed across the two
stages after backward (one ``sendrecv`` each way, tag ``TIED_TAG``), so both take the same step.

The model is anything that follows ``StageModel``: the serial ``GPT``, or with tensor parallelism
inside each stage a ``TensorParallelGPT`` (every TP rank of a stage holds the shards of the same
blocks, and the last stage's loss is the vocab-parallel cross-entropy, ``head_loss``).
"""

from __future__ import annotations

from typing import Protocol

from tinytrain import distributed as dist
from tinytrain.autograd import Tensor
from tinytrain.backend import xp
from tinytrain.parallel.pipeline.messages import TIED_TAG
from tinytrain.parallel.simulator import stage_of, virtual_stage


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

    def __init__(
        self,
        model: StageModel,
        stages: int,
        chunks: int = 1,
        rank: int | None = None,
        group=None,
        placement: str = "loop",
    ):
        self.model, self.stages, self.chunks, self.group = model, stages, chunks, group
        self.placement = placement  # which part each chunk is: simulator.virtual_stage (ZB-V: "v")
        self.rank = dist.get_rank(group) if rank is None else rank
        if dist.get_world_size(group) != stages:
            raise ValueError(
                f"a {stages}-stage pipeline needs a group of {stages} ranks, got {dist.get_world_size(group)}"
            )
        self.n_virtual = stages * chunks
        layers = split_layers(len(model.blocks), stages, chunks)
        self.blocks = {c: [model.blocks[i] for i in layers[self.virtual(c)]] for c in range(chunks)}
        self.is_first = self.peer(0) == self.rank  # holds virtual stage 0
        self.is_last = self.peer(self.n_virtual - 1) == self.rank  # holds virtual stage n_virtual - 1
        first_ids = {id(p) for p in model.first_parameters()}
        # (in a V, stage 0 holds both ends: the tied weight's two uses add into one .grad there)
        split = stages > 1 and not (self.is_first and self.is_last)
        self.tied = [p for p in model.last_parameters() if id(p) in first_ids] if split else []

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
        """Which model part (virtual stage) this rank's chunk ``chunk`` is."""
        return virtual_stage(self.rank, chunk, self.stages, self.placement)

    def peer(self, virtual: int) -> int:
        """The rank of the pipeline group holding virtual stage ``virtual``."""
        return stage_of(virtual, self.stages, self.placement)

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
        other = self.peer(self.n_virtual - 1) if self.is_first else self.peer(0)
        for w in self.tied:
            mine = w.grad if w.grad is not None else xp.zeros_like(w.data)
            theirs = xp.empty_like(mine)
            dist.sendrecv(mine, other, theirs, other, group=self.group, tag=TIED_TAG)
            w.grad = mine + theirs
