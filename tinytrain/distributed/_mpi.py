"""Import mpi4py's MPI, with MPICH's progress throttle first if asked for.

MPI reads its settings from the environment once, inside ``MPI_Init``, and mpi4py calls
``MPI_Init`` when ``mpi4py.MPI`` is first imported. So every module in this package imports MPI
from here, and settings chosen here are in place before that happens.

By default tinytrain runs MPI as it comes (MPICH's own settings, or whatever the user exported).
``TINYTRAIN_MPI_THROTTLE=1`` adds :data:`MPICH_THROTTLE` (``os.environ.setdefault``: a value the
user exported still wins): MPICH's progress loop then sleeps when a poll made no progress, instead
of spinning. That helps blocking MPI calls when ranks outnumber cores (a rank spinning in
``MPI_Barrier`` takes the core from the rank it waits for), but none of our waits block inside MPI
(they poll with ``MPI_Test``, see ``watchdog.py``), and for them the throttle is ruinous: every
``MPI_Test`` that finds nothing sleeps about 60 us, so a 1 KiB all-reduce took 2-4x longer.
Measured on 2 cores, ``mpirun -n 4 python -m pytest tests/distributed``, alternating: 32 s and 39 s
as MPI comes, 40 s and 39 s throttled (it was the default until our waits learned to yield).
``tinytrain bench collectives`` can show MPI's own figures both ways (its ``--mpi`` option).
"""

from __future__ import annotations

import os

MPICH_THROTTLE = {
    # Yield the CPU inside MPICH's progress loop after polls that made no progress.
    "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1",
    # ...and make that yield a real sleep, not sched_yield (which on Linux may return at once).
    "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1",
}

if os.environ.get("TINYTRAIN_MPI_THROTTLE", "0") == "1":
    for _key, _value in MPICH_THROTTLE.items():
        os.environ.setdefault(_key, _value)

import mpi4py  # noqa: E402

# Our collectives may be advanced by a helper thread (see work.start_progress_thread), so
# ask for MPI_THREAD_MULTIPLE (mpi4py's default). All our own MPI calls happen under one lock, so
# MPI_THREAD_SERIALIZED would do as well.
mpi4py.rc.thread_level = "multiple"

from tinytrain import launcher  # noqa: E402

try:
    from mpi4py import MPI  # noqa: E402,F401  (this import runs MPI_Init)
except (ImportError, RuntimeError) as _exc:  # no MPI library mpi4py can load (RuntimeError lists each path)
    _lines = str(_exc).splitlines() or [type(_exc).__name__]
    _why = _lines[0] + (f" ({_lines[-1]})" if len(_lines) > 1 else "")  # its first line, its last path tried
    if launcher.world_size() > 1:  # a launcher started ranks that cannot talk: say what to install
        raise RuntimeError(f"{launcher.NO_MPI} mpi4py said: {_why}") from None
    from . import _nompi as MPI  # noqa: N812 - one process: serial commands need no MPI

    MPI.why = _why

__all__ = ["MPI"]
