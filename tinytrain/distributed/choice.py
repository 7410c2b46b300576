"""Which algorithm a collective runs: all_reduce's choice by message size, and the module of
algorithms a :class:`~collectives.Collectives` calls, with the stand-ins of a student release.

The public functions (``collectives.py``) run the algorithms of one module, looked up by name at
every call (a test may replace one): the framework's ``algorithms.py``, or a student's assignment
copy of it. In a student release the framework's own ring, pairwise and tree algorithms are cut out
(TODO stubs); the framework then falls back to the stand-ins of ``rooted.py``, so later assignments
still have working collectives. An assignment copy never falls back: it raises its TODOs, so the
grader reports them instead of grading a stand-in.
"""

from __future__ import annotations

import sys

from . import rooted
from .hierarchical import balanced

# all_reduce picks its algorithm by buffer size (measured with `tinytrain bench collectives` on 4
# ranks sharing 2 cores, where every step costs a scheduling delay):
#   < SMALL_MESSAGE_BYTES   recursive doubling: log2(n) steps, but each sends the whole buffer
#   < LARGE_MESSAGE_BYTES   halving-doubling: the ring's volume in 2 log2(n) steps
#   otherwise               ring: 2(n-1) steps of 1/n of the buffer, bandwidth-optimal on any n
SMALL_MESSAGE_BYTES = 256 * 1024
LARGE_MESSAGE_BYTES = 4 * 1024 * 1024
ALL_REDUCE_ALGOS = ("ring", "recursive_doubling", "halving_doubling", "naive", "hierarchical")

# The framework's algorithms: the only module whose cut-out algorithms fall back to stand-ins.
FRAMEWORK_ALGORITHMS = "tinytrain.distributed.algorithms"


def choose_all_reduce_algo(nbytes: int, nodes: list[list[int]] | None = None) -> str:
    """The all_reduce algorithm used for a buffer of ``nbytes`` when ``algo`` is not given.

    ``nodes``: the group's ranks on each node of an emulated topology (``topology.py``); when the
    group spans several nodes with the same number of ranks (more than one) on each, the
    hierarchical all-reduce (``hierarchical.py``), whose own inter-node phase is chosen by size."""
    if nodes is not None and balanced(nodes):
        return "hierarchical"
    if nbytes < SMALL_MESSAGE_BYTES:
        return "recursive_doubling"
    return "halving_doubling" if nbytes < LARGE_MESSAGE_BYTES else "ring"


_stub_code: dict = {}  # code object -> is it a stub (asked on every collective call: keep it cheap)


def is_stub(fn) -> bool:
    """True for a function a student release replaced by ``raise NotImplementedError("TODO ...")``."""
    code = fn.__code__
    known = _stub_code.get(code)
    if known is None:
        known = _stub_code[code] = any(isinstance(k, str) and k.startswith("TODO ") for k in code.co_consts)
    return known


class AlgorithmSource:
    """The algorithms of module ``algorithms`` (a name in sys.modules), looked up at every call."""

    def __init__(self, algorithms: str):
        self.module = algorithms
        # Only the framework falls back to stand-ins (see rooted.py); an assignment raises its TODOs.
        self.stand_ins = algorithms == FRAMEWORK_ALGORITHMS

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.module!r})"

    def _alg(self, name: str):
        return getattr(sys.modules[self.module], name)

    def _cut_out(self, *names: str) -> bool:
        """True when a student release replaced one of these algorithms by a TODO stub (never in an assignment)."""
        return self.stand_ins and any(is_stub(self._alg(name)) for name in names)

    def _all_to_all(self):
        return rooted.all_to_all_standin if self._cut_out("_all_to_all_pairwise") else self._alg("_all_to_all_pairwise")
