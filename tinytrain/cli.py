"""The ``tinytrain`` command: ``train``, ``sample``, ``bench``, ``plan`` and ``doctor``.

Each subcommand lives in its own module and is imported only when used, so ``tinytrain --help``
stays fast and never initialises MPI.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> module with ``add_arguments(parser)`` and ``run(args)``
_COMMANDS = {
    "train": ("tinytrain.trainer", "train a GPT (serial, or under mpirun with --dp/--tp/--pp)"),
    "sample": ("tinytrain.sample", "print text generated from a checkpoint"),
    "bench": ("tinytrain.bench", "benchmarks: `tinytrain bench step`, `tinytrain bench collectives`"),
    "plan": ("tinytrain.planner", "which layouts fit a model on a cluster, and which is fastest"),
    "doctor": ("tinytrain.doctor", "what this machine and its MPI offer: versions, device, settings"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinytrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except ValueError as exc:
        # A bad setting: say what to change, without a traceback (argparse's style, exit code 2).
        # Under mpirun every rank fails the same way; one message is enough.
        dist = sys.modules.get("tinytrain.distributed")
        quiet = dist is not None and dist.is_initialized() and dist.get_rank() != 0
        parser.exit(2, None if quiet else f"tinytrain {args.command}: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
