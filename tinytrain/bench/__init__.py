"""Benchmarks, run as ``tinytrain bench NAME [options]``.

``step`` and ``collectives`` measure a reference in the same run and report ratios, never bare
times: these machines are shared and noisy. The reference runs where ours cannot disturb it nor be
disturbed by it, as a user would get it: PyTorch in its own process (thread pools apart), MPI in
its own ``mpirun`` launch with MPICH's default settings (tinytrain's are read at ``MPI_Init``); the
two sides alternate, so load from elsewhere hits both alike. ``strategies`` compares the parallel
strategies with each other (and with serial) on the same model: time, bytes sent, memory. ``plan``
sets the calibrated planner's step time beside a measured one. ``scaling`` trains the same model
serially and on 2 ranks (DP, TP, PP), alternating, and reports the speedup. ``dp-algos`` trains
under every ``--dp-algo`` and draws loss against steps and against bytes sent; ``fed`` does the same
for federated averaging's settings (skew, participation, secure aggregation, noise); ``checkpoint``
times a step with a checkpoint every step, synchronous and asynchronous, against the step alone.
Each benchmark is a module here with ``add_arguments(parser)`` and ``run(args)``.
"""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "step": "one GPT training step, tinytrain vs PyTorch on the CPU",
    "collectives": "hand-written collectives vs MPI's own (run under mpirun)",
    "strategies": "one training step under every parallel strategy: time, bytes, memory (mpirun -n 4)",
    "plan": "the calibrated planner's data-parallel step time next to a measured one (mpirun -n N)",
    "scaling": "tokens/s serially and on 2 ranks per layout (DP, TP, PP): speedup, efficiency, comm (mpirun -n 2)",
    "dp-algos": "loss against steps and bytes for every --dp-algo, same seed (mpirun -n 4)",
    "fed": "federated averaging: iid vs skewed data, participation, secure aggregation, noise (mpirun -n 4)",
    "checkpoint": "a checkpoint every step, synchronous vs --ckpt-async, as a share of the step (any -n)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="NAME")
    sub.required = True
    for name, help_text in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(f"tinytrain.bench.{_module(name)}").add_arguments(p)
        p.set_defaults(_bench=name)


def _module(name: str) -> str:
    return name.replace("-", "_")  # dp-algos: tinytrain/bench/dp_algos.py


def run(args) -> int:
    return int(importlib.import_module(f"tinytrain.bench.{_module(args._bench)}").run(args) or 0)
