"""``mpirun -n N tinytrain bench collectives``: our collectives against MPI's own, nccl-tests style.

For every collective and message size, both implementations run in the same process, interleaved
(ours, MPI, ours, MPI, ...), so a noisy machine slows both alike. Reported per row:

* ``time``: seconds per call, the slowest rank's (a collective is done when the last rank is).
* ``algbw`` = size / time, where size is the nccl-tests "size": the buffer for all_reduce and
  broadcast, the *full* (gathered / pre-scatter) buffer for all_gather and reduce_scatter, the
  send buffer for all_to_all.
* ``busbw`` = algbw x factor, the bandwidth each link would need; the factor makes numbers
  comparable across collectives and rank counts: 2(n-1)/n for all_reduce, (n-1)/n for
  all_gather, reduce_scatter and all_to_all, 1 for broadcast.
* ``ratio`` = our busbw / MPI's busbw (above 1: ours is faster).

``--receive-check`` also times ours with the per-receive byte-count check switched off (interleaved
with the rest) and prints what the check costs, in percent of our time (``check %``; about 0 is the
goal: the check is one ``MPI_Get_count`` per message).
``--overlap`` instead measures how much of an async all_reduce hides behind computation.
``--impl assignments`` benches a student's ``assignments/a1_collectives.py`` instead of tinytrain's
own collectives (collectives still at TODO are listed and left out).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
_BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def _parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B").rstrip("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


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
        "--receive-check",
        action="store_true",
        help="also time ours without the per-receive byte-count check and print its cost (check %%)",
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
    from tinytrain.distributed._mpi import MPI

    dist = dist or _implementation("reference")
    count = max(1, size // 4)
    ours_zeros, mpi_zeros = _allocators(on_device)  # zeros: sums stay finite
    if name == "all_reduce":
        a, b, c = ours_zeros(count), mpi_zeros(count), mpi_zeros(count)
        return (lambda: dist.all_reduce(a, algo=algo)), (lambda: comm.Allreduce(b, c, op=MPI.SUM))
    piece = max(1, count // n)
    if name == "all_gather":
        x, out1, y, out2 = ours_zeros(piece), ours_zeros(piece * n), mpi_zeros(piece), mpi_zeros(piece * n)
        return (lambda: dist.all_gather(x, out=out1)), (lambda: comm.Allgather(y, out2))
    if name == "reduce_scatter":
        x, out1, y, out2 = ours_zeros(piece * n), ours_zeros(piece), mpi_zeros(piece * n), mpi_zeros(piece)
        return (lambda: dist.reduce_scatter(x, out=out1)), (lambda: comm.Reduce_scatter_block(y, out2))
    if name == "all_to_all":
        x, out1, y, out2 = ours_zeros(piece * n), ours_zeros(piece * n), mpi_zeros(piece * n), mpi_zeros(piece * n)
        return (lambda: dist.all_to_all(x, out=out1)), (lambda: comm.Alltoall(y, out2))
    if name == "broadcast":
        a, b = ours_zeros(count), mpi_zeros(count)
        return (lambda: dist.broadcast(a, src=0)), (lambda: comm.Bcast(b, root=0))
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
    """``fn`` with the per-receive byte-count check of p2p switched off (to measure what it costs)."""
    from tinytrain.distributed import p2p

    def call():
        p2p.check_receives = False
        try:
            fn()
        finally:
            p2p.check_receives = True

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


def _measure(name, size, n, comm, algo, rounds, dist=None, receive_check=False, on_device=False):
    """Best seconds per call of (ours, MPI's, ours without the receive check or None)."""
    ours, mpi = _setups(name, size, n, comm, algo, dist, on_device)
    candidates = [ours, mpi] + ([_unchecked(ours)] if receive_check else [])
    for fn in candidates:
        fn()  # warm up: first-touch pages, MPI connection setup
    iters = max(2, min(100, (32 << 20) // max(size, 1)))
    best = [float("inf")] * len(candidates)
    for _ in range(rounds):  # interleaved, keep the best of each: noise only ever adds time
        best = [min(b, _time(fn, iters, comm)) for b, fn in zip(best, candidates)]
    return best[0], best[1], (best[2] if receive_check else None)


# --- the benchmark ---------------------------------------------------------------------------------


def run(args) -> int:
    from tinytrain import backend
    from tinytrain import distributed as dist
    from tinytrain.distributed.collectives import choose_all_reduce_algo

    comm = dist.init().comm  # MPI's reference runs on the same ranks (the test harness's world too)
    n, rank = comm.Get_size(), comm.Get_rank()
    if args.overlap:
        return _overlap(comm)
    sizes = [_parse_size(s) for s in args.sizes] if args.sizes else [1 << k for k in range(10, 27, 2)]
    rows = []
    receive_check, on_device = getattr(args, "receive_check", False), getattr(args, "device", False)
    if on_device and not backend.on_device:
        raise ValueError("--device needs a device: run with TINYTRAIN_DEVICE=gpu (or strict, the stand-in)")
    if rank == 0:
        where = "host buffers"
        if on_device:
            where = f"{backend.device} device buffers, MPI {'CUDA-aware' if dist.cuda_aware() else 'staged via host'}"
        print(f"# tinytrain bench collectives: {n} ranks, float32, {where}, best of {args.rounds} interleaved rounds")
        print(
            f"# {'collective':<15}{'algo':<20}{'size':>7}{'time us':>11}{'algbw GB/s':>12}"
            f"{'busbw GB/s':>12}{'MPI busbw':>11}{'ratio':>7}"
            + (f"{'check %':>9}" if getattr(args, "receive_check", False) else "")
        )
    impl = _implementation(getattr(args, "impl", "reference"))
    for name in args.collectives:
        for size in sizes:
            try:
                ours, mpi, unchecked = _measure(
                    name, size, n, comm, args.algo, args.rounds, impl, receive_check, on_device
                )
            except NotImplementedError as todo:  # every rank runs the same stub, so all skip it
                if rank == 0:
                    print(f"  {name:<15}not benched: {todo}", flush=True)
                break
            algo = {
                "all_reduce": args.algo or choose_all_reduce_algo(max(1, size // 4) * 4),
                "all_gather": "ring",
                "reduce_scatter": "ring",
                "all_to_all": "pairwise",
                "broadcast": "tree",
            }[name]
            factor = _BUS_FACTOR[name](n)
            row = {
                "collective": name,
                "algo": algo,
                "size_bytes": size,
                "ranks": n,
                "time_us": ours * 1e6,
                "mpi_time_us": mpi * 1e6,
                "algbw_gbps": size / ours / 1e9,
                "busbw_gbps": size / ours / 1e9 * factor,
                "mpi_algbw_gbps": size / mpi / 1e9,
                "mpi_busbw_gbps": size / mpi / 1e9 * factor,
            }
            row["ratio"] = mpi / ours  # = busbw / mpi_busbw
            check = ""
            if unchecked is not None:
                row["time_unchecked_us"] = unchecked * 1e6
                row["receive_check_pct"] = 100 * (ours / unchecked - 1)
                check = f"{row['receive_check_pct']:>9.1f}"
            rows.append(row)
            if rank == 0:
                print(
                    f"  {name:<15}{algo:<20}{_fmt_size(size):>7}{row['time_us']:>11.1f}"
                    f"{row['algbw_gbps']:>12.3f}{row['busbw_gbps']:>12.3f}{row['mpi_busbw_gbps']:>11.3f}"
                    f"{row['ratio']:>7.2f}{check}",
                    flush=True,
                )
    if receive_check and rank == 0:
        extra, exchange = _receive_check_ns()
        print(
            f"# receive check: {extra:+.0f} ns per received message, on {exchange:.0f} ns for a whole 1 KiB "
            "exchange of one process with itself (CPU time, best of 15 interleaved rounds); check % above = our time "
            "with the check / without - 1, in percent"
        )
        rows.append({"receive_check_ns_per_message": extra, "exchange_ns": exchange})
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


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
