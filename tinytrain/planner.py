"""`tinytrain plan`: placeholder, filled in by its issue."""

from __future__ import annotations


def add_arguments(parser) -> None:
    pass


def run(args) -> int:
    raise ValueError("not built yet")
