"""Pipeline parallel: the model cut into stages, micro-batches flowing through, schedules as data.

A pipeline of ``p`` stages trains ``m`` micro-batches per step. Rank s of the pipeline group holds
stage s, a contiguous run of blocks (or v chunks of them); only activations and their gradients
cross between neighbouring stages:

              rank 0              rank 1         rank 2         rank 3
    tokens ─► embed, blocks 0-1 ─► blocks 2-3 ─► blocks 4-5 ─► blocks 6-7, head, loss
    forward:        activation ──►    activation ──►   activation ──►
    backward:       ◄── gradient      ◄── gradient     ◄── gradient

The chapter is split by job; read it in this order:

    schedules.py  what each stage runs when, as data: GPipe, 1F1B, interleaved 1F1B, zero-bubble
                  ZB-H1 and ZB-V (F, B = input gradient, W = weight gradients); the bubble
    stage.py      what each rank holds: split_layers, the StageModel protocol, PipelineStage,
                  the embedding tied between the first and last stage
    messages.py   what moves between stages: activations forward, gradients backward, with
                  autograd (the received activation is a leaf), and the message tags
    executor.py   one training step: PipelineStep turns a stage's actions into compute and
                  messages; share_parameters

``simulator.py`` (next to this package) plays a schedule on paper. Every name used elsewhere is
re-exported here: ``from tinytrain.parallel.pipeline import X``.
"""

from tinytrain.parallel.pipeline.executor import (
    PipelineStep,
    share_parameters,
    train_step,
)
from tinytrain.parallel.pipeline.messages import (
    recv_activation,
    recv_gradient,
    send_activation,
    send_gradient,
)
from tinytrain.parallel.pipeline.schedules import (
    SCHEDULES,
    chunks_of,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    placement_of,
    simulate_schedule,
    zb_h1,
    zb_v,
)
from tinytrain.parallel.pipeline.stage import (
    PipelineStage,
    StageModel,
    split_layers,
)
from tinytrain.parallel.simulator import Action

__all__ = [
    "SCHEDULES",
    "chunks_of",
    "Action",
    "PipelineStage",
    "PipelineStep",
    "StageModel",
    "gpipe",
    "interleaved_1f1b",
    "make_schedule",
    "one_f_one_b",
    "placement_of",
    "simulate_schedule",
    "zb_h1",
    "zb_v",
    "recv_activation",
    "recv_gradient",
    "send_activation",
    "send_gradient",
    "share_parameters",
    "split_layers",
    "train_step",
]
