"""Run ``tinytrain`` (as the program: errors end the job) with one fault injected on one rank.

    FAULT=skip RANK=3 STEP=2 mpirun -n 4 python tests/faults/inject.py train --dp 4 ...

The fault happens in the step-end vote every layout takes (``MeshRunner.vote``: "did a rank
get a signal?", an all-reduce over the world), on rank ``RANK`` at step ``STEP``:

    raise    raise RuntimeError before the vote's all-reduce
    skip     do not take part in the vote (the rank goes on to the next step's collectives)
    dtype    vote with an int64 array (the others: int32)
    shape    vote with 2 elements (the others: 1)
    sendsend ranks RANK and RANK+1 both send 4 MB to each other (synchronous sends), then receive: neither
             receive is posted
    kill     SIGKILL this rank
    stop     SIGSTOP this rank (frozen: alive to the OS, silent to MPI)
    spin     loop forever in pure Python
    slow     sleep SLOW seconds (default 6; an honest slow rank: the job must finish)
    compute  compute in NumPy for SLOW seconds (honest too)

``ONCE=PATH``: the fault happens only in the first run that finds no file PATH (it creates it), so a
restarted run (``tinytrain launch``) goes on; without it every run faults at its STEP-th vote.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy

from tinytrain.cli import main
from tinytrain.trainer import runners

FAULT, RANK, STEP = os.environ["FAULT"], int(os.environ.get("RANK", "1")), int(os.environ.get("STEP", "2"))
SLOW = float(os.environ.get("SLOW", "6"))
_real_vote = runners.MeshRunner.vote
_votes = {"n": 0}


def synchronous_send(buf, peer: int) -> None:
    """``dist.send`` in MPI's synchronous mode (Issend): done only once the peer receives. A standard
    send may be buffered, and Intel MPI completes one of 4 MB that no receive matches; both ranks in
    a synchronous send deadlock under every MPI."""
    from tinytrain.distributed.group import resolve
    from tinytrain.distributed.p2p import Exchange, P2PWork

    group = resolve(None)
    exchange = Exchange(group, "send", f"send to rank {peer}")
    exchange._post(group.comm.Issend, buf, peer, 0, "send to", None)
    P2PWork(exchange, buf).wait()


def vote(self, value: int) -> int:
    _votes["n"] += 1
    if _votes["n"] != STEP or self.rank not in (RANK, RANK + 1) or _done_once():
        return _real_vote(self, value)
    if FAULT == "sendsend":
        peer = RANK + 1 if self.rank == RANK else RANK
        big = numpy.ones(1 << 20, dtype=numpy.float32)
        synchronous_send(big, peer)
        self.dist.recv(big, src=peer)
        return _real_vote(self, value)
    if self.rank != RANK:
        return _real_vote(self, value)
    if FAULT == "raise":
        raise RuntimeError(f"injected fault on rank {self.rank} before the vote")
    if FAULT == "skip":
        return 0
    if FAULT in ("dtype", "shape"):
        votes = numpy.zeros(2 if FAULT == "shape" else 1, dtype=numpy.int64 if FAULT == "dtype" else numpy.int32)
        self.dist.all_reduce(votes, op="max")
        return int(votes[0])
    if FAULT == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if FAULT == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if FAULT == "spin":
        while True:
            pass
    if FAULT == "slow":
        time.sleep(SLOW)
    if FAULT == "compute":
        end, a = time.monotonic() + SLOW, numpy.ones((256, 256))
        while time.monotonic() < end:
            a = a @ a / 256
    return _real_vote(self, value)


def _done_once() -> bool:
    """With ONCE: has an earlier run faulted already? (The faulting rank marks it, just before.)"""
    once = os.environ.get("ONCE")
    if not once:
        return False
    if os.path.exists(once):
        return True
    if _rank_of_this_process() == RANK:
        open(once, "w").close()  # noqa: SIM115
    return False


def _rank_of_this_process() -> int:
    from tinytrain import launcher

    return launcher.rank_and_size()[0]


runners.MeshRunner.vote = vote
sys.exit(main())
