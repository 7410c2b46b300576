"""Import mpi4py's MPI with tinytrain's defaults applied first.

MPI reads its settings from the environment once, inside ``MPI_Init``, and mpi4py calls
``MPI_Init`` when ``mpi4py.MPI`` is first imported. So every module in this package imports MPI
from here, and the defaults below are in place before that happens. ``os.environ.setdefault`` means
a value the user exported still wins.

Why these settings: a classroom laptop or a CI runner often runs 4 ranks on 2 cores. MPICH's
blocking calls busy-poll ("spin") while they wait, so a rank waiting in ``MPI_Barrier`` steals the
core from the rank it is waiting for. Our own waits never block inside MPI (they poll with
``MPI_Test`` and sleep, see ``watchdog.py``), but the test harness and the reference collectives do
call blocking MPI. The throttle makes MPICH's progress loop yield the core when nothing happens.

Measured on 2 cores, ``mpirun -n 4 python -m pytest tests/distributed``: 12.7-14.9 s with these
settings, 16.8-18.8 s without them (``TINYTRAIN_MPI_DEFAULTS=0``), 38 s when our own waits spin
too (``TINYTRAIN_SPIN`` huge). The throttle without heavy yield was worse (20 s).
"""

from __future__ import annotations

import os

MPICH_DEFAULTS = {
    # Yield the CPU inside MPICH's progress loop after polls that made no progress.
    "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1",
    # ...and make that yield a real sleep, not sched_yield (which on Linux may return at once).
    "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1",
}

if os.environ.get("TINYTRAIN_MPI_DEFAULTS", "1") != "0":
    for _key, _value in MPICH_DEFAULTS.items():
        os.environ.setdefault(_key, _value)

import mpi4py  # noqa: E402

# Our collectives may be advanced by a helper thread (see work.start_progress_thread), so
# ask for MPI_THREAD_MULTIPLE (mpi4py's default). All our own MPI calls happen under one lock, so
# MPI_THREAD_SERIALIZED would do as well.
mpi4py.rc.thread_level = "multiple"

from mpi4py import MPI  # noqa: E402,F401  (this import runs MPI_Init)

__all__ = ["MPI"]
