"""``mpirun -n N tinytrain bench collectives``: our collectives against MPI's own, nccl-tests style.

Which MPI is the baseline (``--mpi``). MPI reads its settings once, in ``MPI_Init``. tinytrain runs
MPI as it comes unless ``TINYTRAIN_MPI_THROTTLE=1`` asks for MPICH's progress throttle
(``distributed/_mpi.py``: it yields the core in blocking calls, and slows MPI's own small
collectives many times over). So:

* ``default`` (the default): MPI as it comes, what a user gets from ``mpirun`` without tinytrain.
  When this launch runs under MPI's own settings (tinytrain's default), that *is* this launch: MPI
  is timed here, interleaved with ours in the same processes on the same cores. (A second launch
  gave MPI lower busbw in 48 of 60 rows, a median 11% lower: ratios against it flattered us.)
  Only when this launch runs throttled (``TINYTRAIN_MPI_THROTTLE=1``) does rank 0 launch a second
  ``mpirun -n N`` of this module (``--baseline-worker``) with the throttle removed from its
  environment and drive it over a pipe. Rounds then alternate between the two launches (ours here,
  then MPI's there, ...), and the launch that is not measuring waits asleep (polling a non-blocking
  broadcast every millisecond, never spinning in MPI), so neither takes the cores from the other.
* ``here``: MPI in this launch, under this launch's settings (no second launch; with
  ``TINYTRAIN_MPI_THROTTLE=1`` these are the throttled figures).
* ``both``: both columns, three-way alternated, MPI as it comes always in a second launch (to
  compare the launches); ``ratio`` is against MPI as it comes.

The header says which MPICH settings each side ran under. Ours always runs in this launch, under
the settings it was started with (MPI as it comes unless ``TINYTRAIN_MPI_THROTTLE=1``).

For every collective and message size the implementations run interleaved (ours, MPI, ours, MPI,
...), best round of each kept. Reported per row:

* ``time``: seconds per call, the slowest rank's (a collective is done when the last rank is).
* ``algbw`` = size / time, where size is the nccl-tests "size": the buffer for all_reduce and
  broadcast, the *full* (gathered / pre-scatter) buffer for all_gather and reduce_scatter, the
  send buffer for all_to_all.
* ``busbw`` = algbw x factor, the bandwidth each link would need; the factor makes numbers
  comparable across collectives and rank counts: 2(n-1)/n for all_reduce, (n-1)/n for
  all_gather, reduce_scatter and all_to_all, 1 for broadcast.
* ``ratio`` = our busbw / MPI's busbw (above 1: ours is faster), against MPI as it comes unless
  ``--mpi here``; ``--mpi both`` adds ``ratio_here`` (against MPI in this launch).

``--receive-check`` also times ours with both always-on checks switched off (interleaved with the
rest): the per-receive byte-count check and the call's signature in the messages' tags (its bits,
and the probe a wait that did not end at once makes). It prints what they cost, in percent of our
time (``check %``; about 0 is the goal: one ``MPI_Get_count`` per message, a few integer
operations per call).
``--floor`` also times each algorithm as a bare mpi4py loop (``bench/floor.py``: post, poll with
``sched_yield``, combine; nothing else) and prints its time and its ratio to MPI: the best a Python
implementation of that algorithm reached here, so ours can be read against what is possible. The
loops add a third contender (and its buffers) to every round: on a 2-core machine we saw our 64 MiB
rows slow by up to 1.5x in a full sweep with ``--floor``, so read ours against MPI in a run without it.
``--overlap`` instead measures how much of an async all_reduce hides behind computation.
``--impl assignments`` benches a student's ``assignments/a1_collectives.py`` instead of tinytrain's
own collectives (collectives still at TODO are listed and left out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import subprocess
import sys
import time

import numpy

from tinytrain import launcher

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
_BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def _parse_size(text: str) -> int:
    """Bytes of ``--sizes`` entry ``text`` ("4096", "64K", "1M", "1GiB"): at least 4 (one float32)."""
    number = text.strip().upper().rstrip("B").rstrip("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(number[-1:], 1)
    try:
        value = float(number.rstrip("KMG")) * scale
    except ValueError:
        value = float("nan")
    if not math.isfinite(value):
        raise ValueError(f"--sizes {text}: not a message size (bytes, or with K, M or G: 1K 64K 1M)")
    if value < 4:
        raise ValueError(f"--sizes {text}: a message must hold at least one float32, 4 bytes (e.g. 1K 64K 1M)")
    return int(value)


def _sizes(args) -> list[int]:
    """The message sizes to bench, in bytes (``--sizes``, default 1K..64M in steps of 4x)."""
    return [_parse_size(s) for s in args.sizes] if args.sizes else [1 << k for k in range(10, 27, 2)]


# The buffers one rank holds for one collective at nccl-tests size S, in units of S, as functions of
# 1/n (a rank's piece): (ours, with the algorithm's scratch; MPI's own, with the temporary MPICH
# allocates for a reduction; the floor loop's). Counted from _ours_setup, the algorithms' c.scratch
# calls (recursive doubling: a whole buffer; ring reduce-scatter: two pieces), _mpi_setup and
# floor.setup. The scratch pool of tinytrain.distributed keeps earlier sizes' scratch too, and
# MPI's own connections and queues come on top: a lower bound, which is what a refusal may use.
_BUFFERS = {
    "all_reduce": (lambda p: 2, lambda p: 3, lambda p: 2),
    "all_gather": (lambda p: 1 + p, lambda p: 1 + p, lambda p: 1 + p),
    "reduce_scatter": (lambda p: 1 + 3 * p, lambda p: 2 + p, lambda p: 1 + 3 * p),
    "all_to_all": (lambda p: 2, lambda p: 2, lambda p: 2),
    "broadcast": (lambda p: 1, lambda p: 1, lambda p: 1),
}


def buffer_bytes(name: str, size: int, n: int, mpi_launches: int = 1, floor: bool = False) -> dict:
    """Bytes one rank's buffers take for ``name`` at ``size`` on ``n`` ranks, by whose they are:
    ``ours``, ``mpi`` (MPI's own, in each of ``mpi_launches`` launches: 2 for ``--mpi both``) and
    ``floor`` (``--floor``), and their ``total`` (see ``_BUFFERS``)."""
    whole = _counts(size, n)[0] * 4
    ours, mpi, bare = (f(1 / n) * whole for f in _BUFFERS[name])
    found = {"ours": ours, "mpi": mpi * mpi_launches, "floor": bare if floor else 0.0}
    found["total"] = sum(found.values())
    return found


def check_memory(args, sizes: list[int], n: int, ranks_here: int, share: float) -> None:
    """Refuse, before any buffer is allocated, a size whose buffers cannot fit in ``share``: the
    host memory available to one rank (this machine's, divided among its ``ranks_here`` ranks).
    Only one (collective, size) is set up at a time, so the largest decides."""
    mpi_launches = 2 if getattr(args, "mpi", "default") == "both" else 1
    floor = getattr(args, "floor", False)
    worst = max(
        ((name, size) for name in args.collectives for size in sizes),
        key=lambda ns: buffer_bytes(*ns, n, mpi_launches, floor)["total"],
    )
    need = buffer_bytes(*worst, n, mpi_launches, floor)
    if need["total"] <= share:
        return
    fits = 1 << max(2, int(math.log2(max(1.0, worst[1] * share / need["total"]))))
    parts = f"our buffers {_gib(need['ours'])}, MPI's {_gib(need['mpi'])}" + (
        f", the floor's {_gib(need['floor'])}" if floor else ""
    )
    raise ValueError(
        f"--sizes {_fmt_size(worst[1])} needs at least {_gib(need['total'])} per rank for {worst[0]} ({parts}), "
        f"{_gib(need['total'] * ranks_here)} for the {ranks_here} rank{'s' if ranks_here > 1 else ''} on this "
        f"machine, which has {_gib(share * ranks_here)} available (MemAvailable): use sizes up to {_fmt_size(fits)}"
    )


def _gib(nbytes: float) -> str:
    return f"{nbytes / (1 << 30):.3g} GiB"


def _fmt_size(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g}{unit}"
    return f"{n}B"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes", nargs="+", default=None, help="message sizes, e.g. 1K 64K 1M 64M (default: 1K..64M in steps of 4x)"
    )
    parser.add_argument("--collectives", nargs="+", default=list(COLLECTIVES), choices=COLLECTIVES)
    parser.add_argument(
        "--algo",
        default=None,
        help="force the all_reduce algorithm (ring, recursive_doubling, halving_doubling, naive)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved ours/MPI rounds per size (best is kept)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    parser.add_argument("--overlap", action="store_true", help="measure compute/communication overlap instead")
    parser.add_argument(
        "--device",
        action="store_true",
        help="our buffers on the device (TINYTRAIN_DEVICE=gpu or strict); MPI's own on the device if CUDA-aware",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also time each algorithm as a bare mpi4py loop (no checks, accounting or deadlines)",
    )
    parser.add_argument(
        "--receive-check",
        action="store_true",
        help="also time ours without the receive byte-count check and the tags' signatures (check %%: their cost)",
    )
    parser.add_argument(
        "--mpi",
        choices=("default", "here", "both"),
        default="default",
        help="the baseline: MPI as it comes (timed in this launch when it runs under MPI's own settings, "
        "else in a second mpirun launch without tinytrain's MPICH settings), MPI in this launch under its "
        "settings (TINYTRAIN_MPI_THROTTLE=1: throttled), or both (MPI as it comes in a second launch)",
    )
    parser.add_argument(
        "--impl",
        choices=("reference", "assignments"),
        default="reference",
        help="bench tinytrain's collectives (reference) or yours in assignments/a1_collectives.py",
    )


# --- one measurement -------------------------------------------------------------------------------


def _implementation(impl: str):
    """The module whose collectives are benched: tinytrain's, or the student's assignment file."""
    if impl == "assignments":
        import importlib

        return importlib.import_module("assignments.a1_collectives")
    from tinytrain import distributed

    return distributed


def _setups(name: str, size: int, n: int, comm, algo, dist=None, on_device=False):
    """(ours, mpi) zero-argument callables for one collective at nccl-tests size ``size`` bytes.

    ``on_device``: our buffers live on the backend's device (CuPy, or the strict stand-in); MPI's own
    get device memory too when MPI is CUDA-aware, else host memory (what it can read).
    """
    ours_zeros, mpi_zeros = _allocators(on_device)
    return _ours_setup(name, size, n, algo, dist or _implementation("reference"), ours_zeros), _mpi_setup(
        name, size, n, comm, mpi_zeros
    )


def _counts(size: int, n: int) -> tuple[int, int]:
    """(float32 elements of the whole buffer, of one rank's piece) for nccl-tests size ``size``."""
    count = max(1, size // 4)
    return count, max(1, count // n)


def _ours_setup(name: str, size: int, n: int, algo, dist, zeros):
    """A zero-argument call of our ``name`` on buffers from ``zeros`` (zeros: sums stay finite)."""
    count, piece = _counts(size, n)
    if name == "all_reduce":
        a = zeros(count)
        return lambda: dist.all_reduce(a, algo=algo)
    if name == "all_gather":
        x, out = zeros(piece), zeros(piece * n)
        return lambda: dist.all_gather(x, out=out)
    if name == "reduce_scatter":
        x, out = zeros(piece * n), zeros(piece)
        return lambda: dist.reduce_scatter(x, out=out)
    if name == "all_to_all":
        x, out = zeros(piece * n), zeros(piece * n)
        return lambda: dist.all_to_all(x, out=out)
    if name == "broadcast":
        a = zeros(count)
        return lambda: dist.broadcast(a, src=0)
    raise ValueError(name)


def _mpi_setup(name: str, size: int, n: int, comm, zeros):
    """A zero-argument call of MPI's own ``name`` on ``comm``, same buffers as :func:`_ours_setup`."""
    from tinytrain.distributed._mpi import MPI

    count, piece = _counts(size, n)
    if name == "all_reduce":
        b, c = zeros(count), zeros(count)
        return lambda: comm.Allreduce(b, c, op=MPI.SUM)
    if name == "all_gather":
        y, out = zeros(piece), zeros(piece * n)
        return lambda: comm.Allgather(y, out)
    if name == "reduce_scatter":
        y, out = zeros(piece * n), zeros(piece)
        return lambda: comm.Reduce_scatter_block(y, out)
    if name == "all_to_all":
        y, out = zeros(piece * n), zeros(piece * n)
        return lambda: comm.Alltoall(y, out)
    if name == "broadcast":
        b = zeros(count)
        return lambda: comm.Bcast(b, root=0)
    raise ValueError(name)


def _allocators(on_device: bool):
    """(zeros for our buffers, zeros for MPI's own buffers)."""

    def host(k):
        return numpy.zeros(k, dtype=numpy.float32)

    if not on_device:
        return host, host
    from tinytrain import backend
    from tinytrain.distributed import cuda_aware

    def device(k):
        return backend.xp.zeros(k, dtype=numpy.float32)

    def for_mpi(k):
        buf = device(k)
        backend.synchronize()  # MPI reads device memory outside any stream
        return backend.device_buffer(buf)

    return device, (for_mpi if cuda_aware() else host)


def _time(fn, iters: int, comm) -> float:
    """Seconds per call of ``fn`` on the slowest rank."""
    from tinytrain import backend
    from tinytrain.distributed._mpi import MPI

    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    backend.synchronize()  # on a GPU: queued work counts too
    elapsed = (time.perf_counter() - start) / iters
    return comm.allreduce(elapsed, op=MPI.MAX)


def _unchecked(fn):
    """``fn`` with the per-receive byte-count check of p2p and the signatures in the tags of work.py
    switched off (to measure what they cost)."""
    from tinytrain.distributed import p2p, work

    bits = work._SIG_BITS

    def call():
        p2p.check_receives, work._SIG_BITS = False, 0
        try:
            fn()
        finally:
            p2p.check_receives, work._SIG_BITS = True, bits

    return call


def _receive_check_ns(rounds: int = 15, messages: int = 2000) -> tuple[float, float]:
    """(ns the byte-count check adds to one received message, ns of one unchecked exchange), measured
    without the noise of other ranks.

    One process exchanges ``messages`` 1 KiB messages with itself through ``p2p.Exchange`` (what every
    collective step uses), with the check on and off, interleaved; the best round of each counts. Timed
    in CPU time of this thread, so that time spent descheduled on a busy machine does not count.
    """
    from tinytrain.distributed import p2p
    from tinytrain.distributed._mpi import MPI
    from tinytrain.distributed.group import ProcessGroup

    me = ProcessGroup(MPI.COMM_SELF.Dup(), "self", (0,))
    out, into = numpy.zeros(256, dtype=numpy.float32), numpy.empty(256, dtype=numpy.float32)

    def exchanges(checked: bool) -> float:
        p2p.check_receives = checked
        start = time.thread_time()
        try:
            for _ in range(messages):
                ex = p2p.Exchange(me, "bench", "receive check")
                ex.recv(into, 0, 1)
                ex.send(out, 0, 1)
                while not ex.test():
                    pass
        finally:
            p2p.check_receives = True
        return (time.thread_time() - start) / messages

    best = {True: float("inf"), False: float("inf")}
    try:
        for _ in range(rounds):
            for checked in best:
                best[checked] = min(best[checked], exchanges(checked))
    finally:
        me.comm.Free()
    return 1e9 * (best[True] - best[False]), 1e9 * best[False]


def _measure(
    name,
    size,
    n,
    comm,
    algo,
    rounds,
    dist=None,
    receive_check=False,
    on_device=False,
    mpi="here",
    baseline=None,
    floor_algo=None,
):
    """Best seconds per call of each side, by key: ``ours``; ``mpi_here`` (MPI in this launch, under
    its settings; ``--mpi here`` or ``both``); ``mpi_default`` (MPI as it comes: in the ``baseline``
    launch if there is one, else here; ``--mpi default`` or ``both``); ``unchecked`` (ours without
    the receive check, ``receive_check`` only); ``floor`` (algorithm ``floor_algo`` as a bare mpi4py loop, where
    ``bench/floor.py`` has it). Rounds alternate over all of them; the best of each is kept."""
    ours, mpi_here = _setups(name, size, n, comm, algo, dist, on_device)
    here = {"ours": ours}
    if mpi in ("here", "both"):
        here["mpi_here"] = mpi_here
    if mpi == "default" and baseline is None:  # this launch runs MPI as it comes: time it here
        here["mpi_default"] = mpi_here
    if receive_check:
        here["unchecked"] = _unchecked(ours)
    if floor_algo is not None and not on_device:
        from . import floor

        bare = floor.setup(name, floor_algo, *_counts(size, n), comm, _allocators(False)[0])
        if bare is not None:
            here["floor"] = bare
    for fn in here.values():
        fn()  # warm up: first-touch pages, MPI connection setup
    iters = max(2, min(100, (32 << 20) // max(size, 1)))
    request = {"name": name, "size": size, "iters": iters}
    if baseline is not None:
        baseline.ask(dict(request, op="setup"))  # its buffers and warm-up, untimed
    best = dict.fromkeys(list(here) + (["mpi_default"] if baseline is not None else []), float("inf"))
    for _ in range(rounds):  # interleaved, keep the best of each: noise only ever adds time
        for key, fn in here.items():
            best[key] = min(best[key], _time(fn, iters, comm))
        if baseline is not None:  # meanwhile this launch waits asleep
            best["mpi_default"] = min(best["mpi_default"], baseline.ask(dict(request, op="time"))["seconds"])
    return best


# --- under an emulated topology: hierarchical against the flat ring, measured and modelled ----------


def hierarchy(world, sizes: list[int], rounds: int) -> list[dict]:
    """Our all_reduce over ``world`` as the flat ring and as the hierarchical algorithm under the
    emulated topology (``distributed/topology.py``), interleaved, best of ``rounds``; next to each the
    α-β model's time (``costs``): the inter-node link is the emulated one in series with shared memory,
    whose α and bandwidth are fitted here to ring all-reduces inside each node (``planner.emulated.node_link``,
    as ``plan --measure`` calibrates). Printed on rank 0;
    returns the rows."""
    from tinytrain import distributed as dist
    from tinytrain.distributed import topology
    from tinytrain.distributed.choice import choose_all_reduce_algo
    from tinytrain.parallel import costs
    from tinytrain.planner.emulated import node_link

    links = topology.active
    nodes = links.nodes_of(world.world_ranks)
    local, comm = len(nodes[0]), world.comm
    intra = node_link(world, rounds)
    inter = costs.series_link((links.inter_latency, links.inter_bw), intra)
    rows = []
    if world.rank == 0:
        print(
            f"# hierarchical vs flat ring all_reduce, emulated {links.nodes} nodes x {local} ranks: inter-node "
            f"{links.inter_bw / 1e9:g} GB/s, {links.inter_latency * 1e6:g} us (+ shared memory under it); "
            f"shared memory fitted: {intra[0] * 1e6:.1f} us, {intra[1] / 1e9:.2f} GB/s"
        )
        print(f"# {'size':>7}{'ring us':>11}{'model':>9}{'hierarchical us':>17}{'model':>9}{'speedup':>9}{'model':>8}")
    for size in sizes:
        count = max(1, size // 4)
        a = numpy.zeros(count, dtype=numpy.float32)
        ring = costs.collective_time("all_reduce", 4 * count, len(world.world_ranks), *inter)
        algo = choose_all_reduce_algo(4 * count // local)
        hier = costs.hierarchical_all_reduce_time(4 * count, len(nodes), local, intra, inter, algo)
        iters = max(2, min(50, int(0.05 / ring)))
        best = {"ring": float("inf"), "hierarchical": float("inf")}
        for _ in range(rounds):
            for name in best:
                best[name] = min(best[name], _time(lambda: dist.all_reduce(a, algo=name), iters, comm))
        row = {
            "collective": "all_reduce",
            "size_bytes": 4 * count,
            "ranks": len(world.world_ranks),
            "topology": repr(links),
            "ring_us": best["ring"] * 1e6,
            "ring_model_us": ring * 1e6,
            "hierarchical_us": best["hierarchical"] * 1e6,
            "hierarchical_model_us": hier * 1e6,
        }
        rows.append(row)
        if world.rank == 0:
            print(
                f"  {_fmt_size(4 * count):>7}{row['ring_us']:11.1f}{ring * 1e6:9.1f}{row['hierarchical_us']:17.1f}"
                f"{hier * 1e6:9.1f}{best['ring'] / best['hierarchical']:9.2f}{ring / hier:8.2f}",
                flush=True,
            )
    return rows


# --- MPI as it comes: a second launch, driven by rank 0 over a pipe ---------------------------------

_REPLY = "@bench-baseline "  # marks the worker's replies among anything else it prints
_MESSAGE_BYTES = 4096
_WAIT_S = 600.0  # the longest a reply may take (a 64 MiB round on a busy machine takes seconds)


def mpich_settings(env=None) -> str:
    """The ``MPIR_CVAR_*`` settings in ``env`` (default: this process's, as MPI_Init read them)."""
    env = os.environ if env is None else env
    found = [f"{k}={v}" for k, v in sorted(env.items()) if k.startswith("MPIR_CVAR_")]
    return " ".join(found) or "none (MPICH's own defaults)"


def runs_as_it_comes() -> bool:
    """Does this launch run MPI as it comes? True unless tinytrain's throttle is in its MPICH
    settings (a setting the user exported is theirs: a plain ``mpirun`` would read it too)."""
    return mpich_settings() == mpich_settings(baseline_environment())


def baseline_environment() -> dict:
    """This environment without this launch's wiring and without tinytrain's MPICH throttle."""
    from tinytrain import launcher
    from tinytrain.distributed._mpi import MPICH_THROTTLE

    env = {k: v for k, v in launcher.nested_environment().items() if k not in MPICH_THROTTLE}
    env["TINYTRAIN_MPI_THROTTLE"] = "0"
    return env


def _mpirun() -> str:
    """The launcher on PATH, as a user would run it (``launcher.find_mpirun``)."""
    from tinytrain import launcher

    found = launcher.find_mpirun()
    if found:
        return found
    raise ValueError(
        "--mpi default launches MPI as it comes with mpirun, which is not on PATH: add it, or use --mpi here"
    )


def quiet_bcast(comm, message, what: str, timeout: float | None = _WAIT_S):
    """Rank 0's ``message`` (JSON) on every rank of ``comm``, waited for asleep: a non-blocking
    broadcast tested every millisecond, so a waiting rank leaves the cores to the launch that is
    measuring (a blocking MPI call as MPI comes would spin on one). Raises after ``timeout`` s."""
    buf = bytearray(_MESSAGE_BYTES)
    if comm.Get_rank() == 0:
        data = json.dumps(message).encode()[: _MESSAGE_BYTES - 1]
        buf[: len(data)] = data
    request = comm.Ibcast(buf, root=0)
    deadline = None if timeout is None else time.monotonic() + timeout
    while not request.Test():
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"rank {comm.Get_rank()}: waited {timeout:g} s for rank 0 in {what}")
        time.sleep(0.001)
    return json.loads(bytes(buf).rstrip(b"\0"))


class BaselineLaunch:
    """MPI as it comes, in its own ``mpirun -n N`` of this module (``--baseline-worker``).

    Rank 0 of this launch starts it and talks to the worker's rank 0 over its stdin/stdout, one JSON
    line each way; the other ranks wait asleep for the reply (:func:`quiet_bcast`). Every call of
    :meth:`ask` is made by every rank of this launch.
    """

    def __init__(self, comm, on_device: bool = False):
        self.comm, self.proc, self.pending = comm, None, b""
        if comm.Get_rank() == 0:
            try:
                launch = launcher.mpirun_command(comm.Get_size(), _mpirun())
                command = [*launch, sys.executable, "-m", __name__, "--baseline-worker"]
                self.proc = subprocess.Popen(
                    command + (["--device"] if on_device else []),
                    env=baseline_environment(),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                )
            except Exception as failure:  # no launcher, cannot start it: said by ask() on every rank
                self.proc = failure
        self.settings = self.ask({"op": "hello"})["settings"]

    def ask(self, request: dict) -> dict:
        """The worker's reply to ``request``, on every rank of this launch."""
        reply = None
        if self.comm.Get_rank() == 0:
            try:
                reply = self._exchange(request)
            except ValueError as bad:
                reply = {"bad_input": str(bad)}
            except Exception as failure:  # every rank raises it below, none is left waiting
                reply = {"error": f"{type(failure).__name__}: {failure}"}
        reply = quiet_bcast(self.comm, reply, "bench collectives (waiting for the MPI baseline launch)")
        if "bad_input" in reply:
            raise ValueError(reply["bad_input"])
        if "error" in reply:
            raise RuntimeError(f"the MPI-as-it-comes baseline launch failed: {reply['error']}")
        return reply

    def _exchange(self, request: dict) -> dict:
        if isinstance(self.proc, Exception):
            raise self.proc
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:  # it is gone already: say how it ended, as a late reply would
            raise RuntimeError(f"the worker exited (code {self.proc.wait()}) before replying") from None
        deadline = time.monotonic() + _WAIT_S
        while True:
            line = self._read_line(deadline)
            if line.startswith(_REPLY):
                return json.loads(line[len(_REPLY) :])
            sys.stderr.write(line + "\n")  # the worker's other output (warnings), passed on

    def _read_line(self, deadline: float) -> str:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"no reply from the worker in {_WAIT_S:g} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the worker exited (code {self.proc.wait()}) before replying")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line.decode(errors="replace")

    def close(self) -> None:
        """Tell the worker to quit and wait for it (rank 0); the other ranks have nothing to close."""
        if not isinstance(self.proc, subprocess.Popen):
            return
        try:
            self.proc.stdin.write(b'{"op": "quit"}\n')
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def _baseline_worker(on_device: bool) -> int:
    """The baseline launch's every rank: MPI's own collectives, timed on rank 0's request."""
    from tinytrain.distributed._mpi import MPI

    comm, calls = MPI.COMM_WORLD, {}
    n, rank = comm.Get_size(), comm.Get_rank()
    mpi_zeros = _allocators(on_device)[1]
    while True:
        request = None
        if rank == 0:
            line = sys.stdin.readline()  # EOF (the driver is gone) means quit
            request = json.loads(line) if line.strip() else {"op": "quit"}
        request = quiet_bcast(comm, request, "the baseline worker (waiting for the next request)", timeout=None)
        if request["op"] == "quit":
            return 0
        reply = {}
        if request["op"] == "hello":
            reply = {"settings": mpich_settings(), "ranks": n}
        elif request["op"] == "setup":
            key = (request["name"], request["size"])
            calls.clear()  # one size at a time: 64 MiB buffers add up
            calls[key] = _mpi_setup(request["name"], request["size"], n, comm, mpi_zeros)
            calls[key]()  # warm up
        elif request["op"] == "time":
            reply = {"seconds": _time(calls[(request["name"], request["size"])], request["iters"], comm)}
        if rank == 0:
            print(_REPLY + json.dumps(reply), flush=True)


# --- the benchmark ---------------------------------------------------------------------------------


def run(args) -> int:
    from tinytrain import backend
    from tinytrain import distributed as dist

    sizes = _sizes(args)  # a bad size is refused before MPI starts
    if args.rounds <= 0 and not args.overlap:
        raise ValueError(f"--rounds must be positive, got {args.rounds}")
    comm = dist.init().comm  # MPI's reference runs on the same ranks (the test harness's world too)
    n = comm.Get_size()
    if n < 2:  # one rank sends nothing: every bus bandwidth would be 0 (and their ratios 0/0)
        raise ValueError(
            "bench collectives measures ranks talking to each other and this run has one: "
            "run it under mpirun -n 2 or more (`mpirun -n 4 tinytrain bench collectives`)"
        )
    if args.overlap:
        return _overlap(comm)
    on_device = getattr(args, "device", False)
    if on_device and not backend.on_device:
        raise ValueError("--device needs a device: run with TINYTRAIN_DEVICE=gpu (or strict, the stand-in)")
    if not on_device:  # device buffers live in device memory: not counted here
        from tinytrain.distributed._mpi import MPI

        ranks_here = backend.launcher_ranks_here()
        available = backend.host_memory_available()
        share = math.inf if available is None else available / ranks_here
        # every rank decides on the same figure (the smallest share), so all refuse or none does
        check_memory(args, sizes, n, ranks_here, comm.allreduce(share, op=MPI.MIN))
    mpi = getattr(args, "mpi", "default")
    second_launch = mpi == "both" or (mpi == "default" and not runs_as_it_comes())
    baseline = BaselineLaunch(comm, on_device) if second_launch else None
    try:
        rows = _bench(args, comm, mpi, baseline)
    finally:
        if baseline is not None:
            baseline.close()
    from tinytrain.distributed import topology

    if topology.active is not None and "all_reduce" in args.collectives:
        rows += hierarchy(dist.world(), sizes, args.rounds)
    if comm.Get_rank() == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _header(args, n: int, mpi: str, baseline) -> None:
    """What ran where, under which MPICH settings, and which way the ratios point."""
    from tinytrain import backend
    from tinytrain import distributed as dist

    where = "host buffers"
    if getattr(args, "device", False):
        where = f"{backend.device} device buffers, MPI {'CUDA-aware' if dist.cuda_aware() else 'staged via host'}"
    impl = "assignments/a1_collectives.py" if getattr(args, "impl", "reference") == "assignments" else "tinytrain's"
    print(f"# tinytrain bench collectives: {n} ranks, float32, {where}, best of {args.rounds} alternating rounds")
    print(f"# ours ({impl} collectives): this launch, MPICH settings: {mpich_settings()}")
    if baseline is not None:
        print(f"# MPI as it comes: a second mpirun -n {n} launch, MPICH settings: {baseline.settings}")
    elif mpi == "default":
        print(f"# MPI as it comes: this launch, interleaved with ours (MPICH settings: {mpich_settings()})")
    if mpi in ("here", "both"):
        print(f"# MPI here: this launch, MPICH settings: {mpich_settings()}")
    from tinytrain.distributed import topology

    if topology.active is not None:
        print(
            f"# emulated topology {topology.active}: ours pays its inter-node link, MPI's own collectives do "
            "not (ratios compare nothing here; the hierarchical-vs-ring table below does)"
        )
    against = "MPI here" if mpi == "here" else "MPI as it comes"
    print(f"# ratio = our busbw / busbw of {against} (above 1: ours faster; below 1: MPI faster)")
    if mpi == "both":
        print("# ratio here = our busbw / busbw of MPI here (same direction)")
    print(
        f"# {'collective':<15}{'algo':<20}{'size':>7}{'time us':>11}{'algbw GB/s':>12}"
        f"{'busbw GB/s':>12}{'MPI busbw':>11}{'ratio':>7}"
        + (f"{'MPI here':>9}{'ratio here':>11}" if mpi == "both" else "")
        + (f"{'check %':>9}" if getattr(args, "receive_check", False) else "")
        + (f"{'floor us':>10}{'floor ratio':>12}" if getattr(args, "floor", False) else ""),
        flush=True,
    )
    if getattr(args, "floor", False):
        print(f"# floor = the same messages as a bare mpi4py loop; floor ratio = its busbw / busbw of {against}")


def _bench(args, comm, mpi: str, baseline) -> list:
    """Every (collective, size) measured and printed (rank 0); the rows."""
    from tinytrain.distributed import topology
    from tinytrain.distributed.collectives import choose_all_reduce_algo

    n, rank = comm.Get_size(), comm.Get_rank()
    sizes = _sizes(args)
    links = topology.active
    nodes = None if links is None else links.nodes_of(tuple(range(n)))
    receive_check, on_device = getattr(args, "receive_check", False), getattr(args, "device", False)
    floor = getattr(args, "floor", False)
    if rank == 0:
        _header(args, n, mpi, baseline)
    impl = _implementation(getattr(args, "impl", "reference"))
    rows = []
    for name in args.collectives:
        for size in sizes:
            algo = {
                "all_reduce": args.algo or choose_all_reduce_algo(max(1, size // 4) * 4, nodes),
                "all_gather": "ring",
                "reduce_scatter": "ring",
                "all_to_all": "pairwise",
                "broadcast": "tree",
            }[name]
            try:
                best = _measure(
                    name,
                    size,
                    n,
                    comm,
                    args.algo,
                    args.rounds,
                    impl,
                    receive_check,
                    on_device,
                    mpi,
                    baseline,
                    algo if floor else None,
                )
            except NotImplementedError as todo:  # every rank runs the same stub, so all skip it
                if rank == 0:
                    print(f"  {name:<15}not benched: {todo}", flush=True)
                break
            row = _row(name, algo, size, n, best, mpi)
            rows.append(row)
            if rank == 0:
                _print_row(row, mpi, receive_check, floor)
    if rank == 0:
        for line in reduce_scatter_vs_all_gather(rows):
            print(line, flush=True)
    if receive_check and rank == 0:
        extra, exchange = _receive_check_ns()
        print(
            f"# receive check: {extra:+.0f} ns per received message, on {exchange:.0f} ns for a whole 1 KiB "
            "exchange of one process with itself (CPU time, best of 15 interleaved rounds); check % above = our time "
            "with the check / without - 1, in percent"
        )
        rows.append({"receive_check_ns_per_message": extra, "exchange_ns": exchange})
    return rows


def _row(name: str, algo: str, size: int, n: int, best: dict, mpi: str) -> dict:
    """One JSON row: ours, the baseline (``mpi_*``: as it comes unless --mpi here), ratios."""
    factor = _BUS_FACTOR[name](n)
    ours, baseline = best["ours"], best["mpi_default" if mpi != "here" else "mpi_here"]
    row = {
        "collective": name,
        "algo": algo,
        "size_bytes": size,
        "ranks": n,
        "mpi_settings": "as it comes" if mpi != "here" else f"this launch's: {mpich_settings()}",
        "time_us": ours * 1e6,
        "mpi_time_us": baseline * 1e6,
        "algbw_gbps": size / ours / 1e9,
        "busbw_gbps": size / ours / 1e9 * factor,
        "mpi_algbw_gbps": size / baseline / 1e9,
        "mpi_busbw_gbps": size / baseline / 1e9 * factor,
        "ratio": baseline / ours,  # = busbw / mpi_busbw: above 1, ours is faster
    }
    if mpi == "both":
        here = best["mpi_here"]
        row["mpi_here_time_us"] = here * 1e6
        row["mpi_here_busbw_gbps"] = size / here / 1e9 * factor
        row["ratio_here"] = here / ours
    if "unchecked" in best:
        row["time_unchecked_us"] = best["unchecked"] * 1e6
        row["receive_check_pct"] = 100 * (ours / best["unchecked"] - 1)
    if "floor" in best:
        row["floor_time_us"] = best["floor"] * 1e6
        row["floor_ratio"] = baseline / best["floor"]
    return row


def reduce_scatter_vs_all_gather(rows: list) -> list[str]:
    """For every size both were benched at, a line with reduce_scatter's busbw over all_gather's:
    ours and MPI's. The ring reduce-scatter moves the all-gather's bytes plus a combine per chunk
    (``algorithms.py`` says where the bytes go), so on cores that also copy the messages it stays
    below 1; MPI's own pair, timed in the same run, shows how far below it stays for MPI."""
    found = {(r["collective"], r["size_bytes"]): r for r in rows if "collective" in r}
    lines = []
    for (name, size), rs in found.items():
        ag = found.get(("all_gather", size))
        if name == "reduce_scatter" and ag is not None:
            ours, mpis = rs["busbw_gbps"] / ag["busbw_gbps"], rs["mpi_busbw_gbps"] / ag["mpi_busbw_gbps"]
            lines.append(f"# reduce_scatter / all_gather busbw at {_fmt_size(size)}: ours {ours:.2f}, MPI's {mpis:.2f}")
    return lines


def _print_row(row: dict, mpi: str, receive_check: bool, floor: bool = False) -> None:
    line = (
        f"  {row['collective']:<15}{row['algo']:<20}{_fmt_size(row['size_bytes']):>7}{row['time_us']:>11.1f}"
        f"{row['algbw_gbps']:>12.3f}{row['busbw_gbps']:>12.3f}{row['mpi_busbw_gbps']:>11.3f}{row['ratio']:>7.2f}"
    )
    if mpi == "both":
        line += f"{row['mpi_here_busbw_gbps']:>9.3f}{row['ratio_here']:>11.2f}"
    if receive_check:
        line += f"{row['receive_check_pct']:>9.1f}"
    if floor:
        line += (
            f"{row['floor_time_us']:>10.1f}{row['floor_ratio']:>12.2f}"
            if "floor_time_us" in row
            else f"{'-':>10}{'-':>12}"
        )
    print(line, flush=True)


def _overlap(comm) -> int:
    """Does an async all_reduce progress while this rank computes? Timings are the slowest rank's.

    comm      all_reduce alone                compute   the compute alone
    no poll   start async, compute, wait      poll      ... calling progress_all() between chunks
    thread    ... with the progress thread polling in the background
    A perfect overlap takes max(comm, compute); no overlap takes comm + compute.

    Two kinds of compute: "cpu" (NumPy elementwise work, which needs the same cores that copy the
    messages: with no spare core there is nothing to gain) and "gpu-like" (the CPU sleeps while a
    device would compute, as in data parallel training on GPUs: the CPU is free to drive MPI).
    """
    from tinytrain import distributed as dist
    from tinytrain.distributed._mpi import MPI

    buf = numpy.zeros(4 << 20, dtype=numpy.float32)  # 16 MiB: many ring steps
    # Elementwise work, not matmuls: single-threaded (BLAS threads would fight over the cores) and,
    # like any large NumPy ufunc, it releases the GIL so a progress thread can run meanwhile.
    a = numpy.ones(1 << 18, dtype=numpy.float32)

    def cpu_chunk():
        numpy.multiply(a, 1.0000001, out=a)
        numpy.sqrt(a, out=a)

    def timed(fn, reps=3):
        best = float("inf")
        for _ in range(reps):
            comm.Barrier()
            start = time.perf_counter()
            fn()
            best = min(best, comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
        return best

    t_comm = timed(lambda: dist.all_reduce(buf, algo="ring"))
    t_cpu_chunk = timed(lambda: [cpu_chunk() for _ in range(20)]) / 20
    kinds = {
        "cpu": (cpu_chunk, max(4, int(t_comm / max(t_cpu_chunk, 1e-6)))),
        "gpu-like": (lambda: time.sleep(t_comm / 20), 20),
    }
    for kind, (chunk, chunks) in kinds.items():

        def compute(poll=False):
            for _ in range(chunks):
                chunk()
                if poll:
                    dist.progress_all()

        def overlapped(poll):
            h = dist.all_reduce(buf, algo="ring", async_op=True)
            compute(poll=poll)
            h.wait()

        t_compute = timed(compute)
        t_none = timed(lambda: overlapped(False))
        t_poll = timed(lambda: overlapped(True))
        dist.start_progress_thread()
        t_thread = timed(lambda: overlapped(False))
        dist.stop_progress_thread()
        if comm.Get_rank() == 0:
            ideal, serial = max(t_comm, t_compute), t_comm + t_compute
            print(
                f"# overlap of a 16 MiB ring all_reduce with {chunks} chunks of {kind} compute, {comm.Get_size()} ranks"
            )
            print(
                f"  comm alone {t_comm * 1e3:8.1f} ms   compute alone {t_compute * 1e3:8.1f} ms   "
                f"serial sum {serial * 1e3:8.1f} ms   perfect overlap {ideal * 1e3:8.1f} ms"
            )
            for label, t in (
                ("async, no polling", t_none),
                ("async + progress_all()", t_poll),
                ("async + progress thread", t_thread),
            ):
                hidden = (serial - t) / max(min(t_comm, t_compute), 1e-9)
                print(f"  {label:<26}{t * 1e3:8.1f} ms   hidden: {100 * max(0.0, hidden):5.0f}% of the shorter part")
    return 0


if __name__ == "__main__":  # the baseline launch: mpirun -n N python -m tinytrain.bench.collectives --baseline-worker
    if "--baseline-worker" not in sys.argv:
        sys.exit("run `tinytrain bench collectives` (this module's own entry is its MPI baseline worker)")
    sys.exit(_baseline_worker(on_device="--device" in sys.argv))
