"""MPI's own collectives as the graded tests' reference, each with a deadline.

A graded test compares the student's collective with MPI's. MPI's blocking calls
(``comm.Allreduce``) have no deadline: when the student's code fails on one rank only, that rank
leaves the test while the others would wait in MPI forever. So the tests call MPI's *nonblocking*
form (``Iallreduce``) and wait for it with tinytrain's own loop (``watchdog.wait_until``), which has
the ``TINYTRAIN_TIMEOUT`` deadline and ends at once when another rank posted a failure notice.
The tests also compute the expected result *before* the student's code runs, so a rank that fails
in the student's code never leaves a peer inside a reference call.

    expected = np.empty_like(x)
    mpi(g, "Allreduce", x, expected, op=MPI.SUM)
"""

from __future__ import annotations

import numpy as np

from tinytrain import distributed as dist
from tinytrain.distributed import watchdog


def mpi(g, name: str, *args, **kwargs) -> None:
    """Run MPI's collective ``name`` ("Allreduce", "Reduce_scatter", "Bcast", ...) on ``g.comm`` as
    its nonblocking ``I`` form, waiting with a deadline; raises ``CommTimeout`` or ``PeerFailure``."""
    request = getattr(g.comm, "I" + name.lower())(*args, **kwargs)
    me = dist.get_rank()
    watchdog.wait_until(
        request.Test,
        lambda: f"the test's reference MPI {name} on {g.describe()} (MPI's own, before your code ran)",
        lambda: [("MPI's", r) for r in g.world_ranks if r != me],
    )


def agree_int(value: int) -> int:
    """``value`` as rank 0 of the world has it (a seed every rank must share), with a deadline."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return int(value)
    buf = np.array([value], dtype=np.int64)
    mpi(dist.world(), "Bcast", buf, root=0)
    return int(buf[0])
