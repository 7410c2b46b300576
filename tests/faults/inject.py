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

and one fault in the checkpoint write instead of the vote:

    killwrite  SIGKILL this rank while it writes its pieces of the checkpoint of step STEP, half a
               file on disk (with --ckpt-async: in the background thread, while training goes on)

``LOAD_FAULT=R`` (with ``LOAD_ONCE=PATH``), besides any of those: SIGKILL rank R while it loads the
checkpoint in the first run that resumes from one (a fault during a restart).

``ONCE=PATH``: the fault happens only in the first run that finds no file PATH (it creates it), so a
restarted run (``tinytrain launch``) goes on; without it every run faults at its STEP-th vote.
``TIMES=N`` with it: the first N runs fault (each at its own STEP-th vote), the others go on.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy

from tinytrain import checkpoint
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
    if FAULT == "killwrite" or _votes["n"] != STEP or self.rank not in (RANK, RANK + 1) or _done_once():
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
    """With ONCE: have earlier runs faulted TIMES times already (default 1)? The faulting rank marks
    each fault in the file PATH, just before it."""
    once = os.environ.get("ONCE")
    if not once:
        return False
    faults = Path(once).read_text().count("x") if os.path.exists(once) else 0
    if faults >= int(os.environ.get("TIMES", "1")):
        return True
    if _rank_of_this_process() == RANK:
        with open(once, "a") as marks:
            marks.write("x")
    return False


def _rank_of_this_process() -> int:
    from tinytrain import launcher

    return launcher.rank_and_size()[0]


_real_write = checkpoint.write_pieces


def write_pieces(folder, step, rank, pieces, scalars):
    if FAULT != "killwrite" or step != STEP or rank != RANK or _done_once():
        return _real_write(folder, step, rank, pieces, scalars)
    target = Path(folder) / checkpoint.step_folder(step)
    target.mkdir(parents=True, exist_ok=True)
    (target / f"rank-{rank:05d}.npz").write_bytes(b"PK\x03\x04 half a file")
    os.kill(os.getpid(), signal.SIGKILL)


_real_load = runners.MeshRunner.load


def load(self, reader, optimizer):
    once = os.environ.get("LOAD_ONCE")
    if self.rank == int(os.environ.get("LOAD_FAULT", "-1")) and not (once and os.path.exists(once)):
        if once:
            open(once, "w").close()  # noqa: SIM115
        os.kill(os.getpid(), signal.SIGKILL)
    return _real_load(self, reader, optimizer)


runners.MeshRunner.vote = vote
runners.MeshRunner.load = load
checkpoint.write_pieces = write_pieces
sys.exit(main())
