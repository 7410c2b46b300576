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

Files, in reading order (each imports only files above it): ``watchdog.py`` (deadlines, peer
failure), ``topology.py`` (an emulated cluster: nodes, a slow link between them), ``group.py``
(init, groups), ``mesh.py`` (the device mesh), ``p2p.py`` (send/recv, the
``Exchange`` step every algorithm is built from; every receive checks the bytes that arrived),
``stats.py`` (bytes, per group, operation and peer), ``work.py`` (a call's
steps, async handles, progress, debug-mode signature checks), ``chunks.py``, ``doubling.py`` and
``rooted.py`` (the latency-optimal and the root-centred algorithms, the stand-ins),
``hierarchical.py`` (all-reduce inside the nodes, then across), ``checks.py``,
``choice.py`` and ``collectives.py`` (the public functions, their argument checks and choice of
algorithm, over a module of algorithms), ``algorithms.py`` (ring, pairwise and tree algorithms with
their diagrams: assignment 1 is made from it; ``all_reduce`` and the others exported here are bound
at its end), ``trace_merge.py`` (``tinytrain.trace.merge`` over our all-gather, and
``comm_matrix``: who sent how many bytes to whom in a ``comm_stats`` block).

Environment: ``TINYTRAIN_TIMEOUT`` (seconds per wait, default 20; ``TINYTRAIN_BUSY_TIMEOUT`` while
the awaited ranks compute, see ``watchdog.py``), ``TINYTRAIN_DEBUG=1`` (cross-check collective
signatures), ``TINYTRAIN_TRACE=1`` (record spans, see tinytrain.trace),
``TINYTRAIN_CUDA_AWARE_MPI=0|1`` (override detection; with ``TINYTRAIN_DEVICE=strict`` the GPU paths
run on a stand-in for CuPy, see ``tinytrain.backend``), ``TINYTRAIN_SPIN`` and ``TINYTRAIN_YIELD_FOR``
(how a waiting rank polls: spin, yield its core, then sleep; see ``watchdog.py``),
``TINYTRAIN_GPU=<index>`` (the GPU every rank of this process uses; by default ``init()`` gives
local rank r GPU r mod the number of GPUs, see ``tinytrain.backend``), ``TINYTRAIN_TOPOLOGY=NxR``
with ``TINYTRAIN_INTER_GBPS``, ``TINYTRAIN_INTER_LATENCY_US`` and ``TINYTRAIN_PLACEMENT`` (an
emulated cluster, see ``topology.py``).
"""

from . import trace_merge
from .algorithms import (
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    bytes_sent,
    gather,
    reduce,
    reduce_scatter,
    scatter,
)
from .chunks import OPS, split_counts
from .group import (
    NonMember,
    ProcessGroup,
    get_rank,
    get_world_size,
    init,
    is_initialized,
    new_group,
    world,
)
from .mesh import DeviceMesh
from .p2p import (
    CommError,
    MessageSizeMismatch,
    P2PWork,
    cuda_aware,
    cuda_aware_reason,
    irecv,
    isend,
    recv,
    send,
    sendrecv,
)
from .stats import CommStats, comm_stats, totals
from .trace_merge import comm_matrix
from .watchdog import CollectiveMismatch, CommTimeout, DistributedError, PeerDied, PeerFailure, report_failure
from .work import Work, progress_all, start_progress_thread, stop_progress_thread

__all__ = [name for name in dir() if not name.startswith("_")]
