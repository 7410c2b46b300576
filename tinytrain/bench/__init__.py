"""Benchmarks, run as ``tinytrain bench NAME [options]``.

Every benchmark measures a reference in the same run (PyTorch on the same CPU, MPI's own
collective) and reports ratios, never bare times: these machines are shared and noisy.
Each benchmark is a module here with ``add_arguments(parser)`` and ``run(args)``.
"""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "step": "one GPT training step, tinytrain vs PyTorch on the CPU",
    "collectives": "hand-written collectives vs MPI's own (run under mpirun)",
    "strategies": "one training step under every parallel strategy: time, bytes, memory (mpirun -n 4)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="NAME")
    sub.required = True
    for name, help_text in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(f"tinytrain.bench.{name}").add_arguments(p)
        p.set_defaults(_bench=name)


def run(args) -> int:
    return int(importlib.import_module(f"tinytrain.bench.{args._bench}").run(args) or 0)
