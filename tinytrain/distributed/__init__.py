"""tinytrain.distributed: process groups, point-to-point messages and collectives, by hand.

The API follows ``torch.distributed``::

    from tinytrain import distributed as dist
    dist.init()                                  # idempotent; also done on first use
    rank, n = dist.get_rank(), dist.get_world_size()
    dist.all_reduce(grad, op="avg")              # in place, like torch
    h = dist.all_reduce(grad, async_op=True)     # ... compute, calling dist.progress_all() ...
    h.wait()
    shards = dist.all_gather(x)                  # returns a new array (concatenated along axis 0)
    mesh = dist.DeviceMesh({"dp": 2, "tp": 2})   # TP innermost: rank = dp * 2 + tp
    tp = mesh.get_group("tp")

Files, in reading order: ``group.py`` (init, groups, mesh), ``p2p.py`` (send/recv, the
``Exchange`` step every algorithm is built from), ``collectives.py`` (the algorithms, with ring
diagrams), ``watchdog.py`` (deadlines, peer failure, debug checks), ``stats.py`` (bytes).

Environment: ``TINYTRAIN_TIMEOUT`` (seconds per wait, default 60), ``TINYTRAIN_DEBUG=1``
(cross-check collective signatures), ``TINYTRAIN_TRACE=1`` (record spans, see tinytrain.trace),
``TINYTRAIN_CUDA_AWARE_MPI=0|1`` (override detection), ``TINYTRAIN_SPIN`` (polls before a waiting
rank yields its core).
"""

from .collectives import (
    OPS,
    Work,
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    gather,
    progress_all,
    reduce,
    reduce_scatter,
    scatter,
    split_counts,
    start_progress_thread,
    stop_progress_thread,
)
from .group import (
    DeviceMesh,
    NonMember,
    ProcessGroup,
    get_rank,
    get_world_size,
    init,
    is_initialized,
    new_group,
    world,
)
from .p2p import P2PWork, cuda_aware, irecv, isend, recv, send, sendrecv
from .stats import CommStats, comm_stats, totals
from .watchdog import CollectiveMismatch, CommTimeout, DistributedError, PeerFailure, report_failure

__all__ = [name for name in dir() if not name.startswith("_")]
