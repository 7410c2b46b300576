"""Process groups: the world, subgroups, and the checks every ``group=`` argument goes through.

A :class:`ProcessGroup` is a set of ranks that talk to each other: an MPI communicator plus the
bookkeeping our collectives need (a name for byte accounting and error messages, the world rank of
each member, and a counter of collectives issued so far). Ranks inside a group are numbered
``0..size-1``; every ``group=`` argument in this package takes *group* ranks for peers, roots and
sources (``send(x, dst=1, group=tp)`` sends to rank 1 of ``tp``).

``init()`` makes the world group from ``MPI_COMM_WORLD`` (duplicated, so our messages can never
match a message of another library on the same communicator). The test harness instead installs a
fresh communicator for every test with :func:`_install_world`. The named device mesh, groups along
the axes of a grid of ranks, is built on these in ``mesh.py``.
"""

from __future__ import annotations

import sys
import time
import zlib

from tinytrain import backend, launcher, trace

from . import topology, watchdog
from ._mpi import MPI

_world: ProcessGroup | None = None
_owned_comms: list = []  # communicators we created and must free when the world is replaced
_uninstall_hooks: list = []  # called whenever the world goes (work.py forgets its pending handles)


class ProcessGroup:
    """A communicator with a name. ``rank``/``size`` are this process's position in the group."""

    def __init__(self, comm, name: str, world_ranks: tuple[int, ...]):
        self.comm = comm
        self.name = name
        self.world_ranks = tuple(world_ranks)  # group rank i is world rank world_ranks[i]
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.seq = 0  # collectives issued on this group so far (same on every member)
        # Set after a timeout or peer failure: messages of the abandoned operation may still be in
        # flight and would be matched by the next one, so the group must not be used again.
        self.broken: str | None = None

    def world_rank(self, group_rank: int) -> int:
        return self.world_ranks[group_rank]

    def describe(self) -> str:
        return f"group {self.name} (world ranks {list(self.world_ranks)})"

    def __repr__(self) -> str:
        return f"ProcessGroup({self.name!r}, ranks={list(self.world_ranks)}, rank={self.rank})"


class NonMember:
    """What :func:`new_group` returns on a rank that is not in the group (like torch).

    Using it in a collective is an error that says which ranks may use it.
    """

    def __init__(self, name: str, world_ranks: tuple[int, ...]):
        self.name = name
        self.world_ranks = tuple(world_ranks)

    def __repr__(self) -> str:
        return f"NonMember({self.name!r}, ranks={list(self.world_ranks)})"


# --- the world -----------------------------------------------------------------------------------


def init(comm=None) -> ProcessGroup:
    """Start tinytrain.distributed (idempotent) and return the world group.

    ``comm`` defaults to ``MPI.COMM_WORLD``; it is duplicated, never used directly. On a GPU it binds
    this rank to its own GPU (:func:`tinytrain.backend.select_device_for_rank` with the node-local
    rank). (Importing this module installed the exception hook that ends the whole job when a rank
    dies of an uncaught exception: see :func:`_install_excepthook`.)
    """
    if _world is None:
        comm = MPI.COMM_WORLD if comm is None else comm
        watchdog.check_settings()  # a bad TINYTRAIN_TIMEOUT fails here, named, not in a wait
        if topology.active is None:
            topology.install(topology.from_env())  # TINYTRAIN_TOPOLOGY: an emulated cluster
        _install_world(comm)
        _bind_gpu(comm)
        if comm.Get_size() > 1:
            launcher.watch()  # a rank whose launcher is gone stops (SIGTERM to itself), never trains on
    return _world


def local_rank(comm) -> int:
    """This process's rank among the ranks of ``comm`` on the same node.

    From the launcher when it says (MPICH/Hydra: ``MPI_LOCALRANKID``; Open MPI:
    ``OMPI_COMM_WORLD_LOCAL_RANK``), else from MPI (a communicator split by shared memory; collective).
    """
    said = launcher.local_rank()
    if said is not None:
        return said
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank()
    finally:
        node.Free()


def _bind_gpu(comm) -> int | None:
    """Each rank on a node its own GPU (a no-op on the CPU). Returns the GPU index or None."""
    if not backend.on_device:
        return None
    return backend.select_device_for_rank(local_rank(comm))


def on_uninstall(hook) -> None:
    """Call ``hook()`` whenever the world is replaced or forgotten (lets upper layers reset state)."""
    _uninstall_hooks.append(hook)


def is_initialized() -> bool:
    return _world is not None


def _install_world(comm, name: str = "world", dup: bool = True) -> ProcessGroup:
    """Make ``comm`` the world (used by init, and by the test harness for every test).

    With ``dup=True`` a duplicate of ``comm`` is used; with ``dup=False`` we take ``comm`` over and
    free it with the world.
    """
    global _world
    _uninstall_world()
    data = comm.Dup() if dup else comm
    alert = comm.Dup()  # the failure side channel, see watchdog.py
    _owned_comms.extend([data, alert])
    _world = ProcessGroup(data, name, tuple(range(data.Get_size())))
    watchdog.install(alert)
    trace.set_rank(_world.rank)
    return _world


def _uninstall_world(free: bool = True) -> None:
    """Forget the world and (if ``free``) free every communicator we made."""
    global _world
    _world = None
    watchdog.uninstall()
    trace.set_rank(None)
    for hook in _uninstall_hooks:
        hook()
    while _owned_comms:
        comm = _owned_comms.pop()
        if free:
            _drain(comm)
            comm.Free()


def _drain(comm, limit: float = 1.0) -> None:
    """Receive and discard messages nobody received (e.g. a send whose receive never came).

    MPI reuses a freed communicator's id for a later one; a stray message still waiting here could
    otherwise be matched by a receive on that later communicator. Called when all ranks are done
    with ``comm`` (the harness calls it after the ranks agreed on a test's outcome).
    """
    status = MPI.Status()
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        msg = comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
        if msg is None:
            return
        req = msg.Irecv(bytearray(status.Get_count(MPI.BYTE)))
        while not req.Test():
            if time.monotonic() > deadline:
                watchdog.abandon([req])  # it may still land: in its own buffer, never in freed memory
                return
            time.sleep(1e-4)


def _install_excepthook() -> None:
    """An uncaught exception on one rank of a job ends the whole job within seconds.

    Without this a rank that dies leaves the others waiting (20 s, then each raises, prints its own
    traceback and lives on) or computing until they exit by themselves. As ``python -m mpi4py``
    does: the failing rank prints its traceback once, under a line that names it, tells the others
    (the side channel of ``watchdog.py``) and aborts the job (``MPI_Abort``). A rank whose error
    only echoes another's (a peer failed, a wait timed out behind it) prints one line. A program
    that catches its own errors is untouched; on one rank this is Python's usual hook."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        world = MPI.COMM_WORLD
        if world.Get_size() == 1:
            return previous(kind, value, tb)
        rank, code = world.Get_rank(), 130 if issubclass(kind, KeyboardInterrupt) else 1
        echo = isinstance(value, (watchdog.PeerFailure, watchdog.CommTimeout)) or code == 130
        watchdog.report_failure(f"{kind.__name__}: {value}")  # first: the others stop waiting at once
        if not echo and rank != 0:  # two ranks may fail of one cause (a mismatch): the lower one tells
            echo = _lower_rank_failed(rank, 0.5)
        if isinstance(value, watchdog.PeerFailure) and value.echoes_a_report:
            sys.stderr.write(f"rank {rank}: stopped in {value.where}: rank {value.failed_rank} failed (see above)\n")
        elif echo:
            sys.stderr.write(f"rank {rank}: {kind.__name__}: {value}\n")
        else:
            sys.stderr.write(f"rank {rank} of {world.Get_size()} failed; aborting the job:\n")
            previous(kind, value, tb)
        sys.stderr.flush()
        # mpirun forwards our output through a pipe: give it (and the failing rank's own abort,
        # when this rank only echoes it) a moment before the job is ended.
        time.sleep(1.5 if echo else 0.3)
        world.Abort(code)

    sys.excepthook = hook


def _lower_rank_failed(rank: int, seconds: float) -> bool:
    """Did a rank below ``rank`` report a failure of its own (not an echo), within ``seconds``?"""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        known = watchdog.poll_failures()
        if any(r < rank and not text.startswith(("PeerFailure", "CommTimeout")) for r, text in known.items()):
            return True
        time.sleep(0.02)
    return False


_install_excepthook()  # at import: a rank may fail before its first collective


def world() -> ProcessGroup:
    """The world group (calls :func:`init` if needed)."""
    return init() if _world is None else _world


def resolve(group) -> ProcessGroup:
    """``group`` or the world; a clear error for groups this rank is not in."""
    if group is None:
        group = world()
    if isinstance(group, NonMember):
        me = world().rank
        raise ValueError(  # noqa: TRY004 - a usage error (wrong rank), as in torch
            f"rank {me} is not a member of group {group.name} (world ranks {list(group.world_ranks)}); "
            f"call this only on ranks {list(group.world_ranks)}, or build a group that includes "
            f"rank {me}."
        )
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup from new_group()/DeviceMesh or None, not {group!r}")
    if group.broken:
        raise watchdog.DistributedError(
            f"{group.describe()} is unusable after an earlier {group.broken} on this rank: its "
            "messages may still be in flight. Fix the cause of that error; a real job would restart."
        )
    return group


def get_rank(group=None) -> int:
    """This process's rank in ``group`` (default: the world)."""
    return resolve(group).rank


def get_world_size(group=None) -> int:
    """Number of ranks in ``group`` (default: the world)."""
    return resolve(group).size


def new_group(ranks, name: str | None = None):
    """A group of the given world ranks; group rank i is ``ranks[i]``.

    Like torch, every rank may call it; ranks outside ``ranks`` get a :class:`NonMember`. Only the
    members communicate while it is built (``MPI_Comm_create_group``), so calling it on members
    only is fine too.
    """
    w = world()
    ranks = tuple(int(r) for r in ranks)
    if not ranks:
        raise ValueError("new_group needs at least one rank")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"new_group ranks {list(ranks)} contain a duplicate")
    bad = [r for r in ranks if not 0 <= r < w.size]
    if bad:
        raise ValueError(f"new_group ranks {bad} are outside the world of {w.size} ranks (0..{w.size - 1})")
    name = name or "group" + "".join(f"_{r}" for r in ranks)
    if w.rank not in ranks:
        return NonMember(name, ranks)
    return _subgroup(w, list(ranks), name)


def _subgroup(base: ProcessGroup, members: list[int], name: str) -> ProcessGroup:
    """A group of ``members`` (ranks of ``base``), built only by those members."""
    # The tag keeps concurrent creations of different groups apart; it is the same on all members
    # (crc32, not hash(): Python salts string hashes differently in every process).
    tag = zlib.crc32(repr(members).encode()) % 30000
    comm = base.comm.Create_group(base.comm.Get_group().Incl(members), tag)
    _owned_comms.append(comm)
    return ProcessGroup(comm, name, tuple(base.world_rank(m) for m in members))
