# Assignment 10: Elastic training (handout: assignments/a10_elastic.md).
# Generated from tinytrain/elastic.py by `python -m grader stubs`. Replace each
# `raise NotImplementedError("TODO ...")` with your code; grade it with `python -m grader`.

"""Elastic training: ``tinytrain launch`` keeps a run going when a rank is lost.

The agent sits above ``mpirun`` (as torchrun's elastic agent sits above its workers) and restarts
the whole job, from the last checkpoint, on the ranks that are left::

    tinytrain launch -n 4 --min-ranks 2 --max-restarts 3 -- --dp 4 --steps 600 --ckpt-every 20

    launch ──► mpirun -n 4 tinytrain train --dp 4 ...            rank 1 is killed at step 47
           ◄── mpirun exits; the agent saw rank 1's process go first
    launch ──► mpirun -n 3 tinytrain train --dp 3 ... --resume   from the checkpoint of step 40
           ◄── exit 0 at step 600
    metrics.json: each step's world size and layout; "restarts": when, why, which rank, and the
    seconds from the fault to the first step after it

What must stay stays: ``--tp``, ``--pp``, ``--cp`` and ``--ep`` keep their sizes (or the agent
refuses, naming the smallest world that would do); ``--dp`` shrinks to the most replicas that the
ranks left hold and the global batch splits over, so every step still trains on the same global
batch and the loss curve is the uninterrupted run's (checkpoints load under any layout, batches
and dropout masks are functions of (seed, step)). Nothing is lost beyond the last checkpoint:
``--ckpt-every c`` bounds the steps done twice by c.

Which rank died: the agent watches the ranks' processes itself (``RankWatcher``: each rank's pid
and world rank, read from ``/proc`` every 0.1 s), because hydra (MPICH, Intel MPI) kills the others
within 0.1 s of the first death, before any of them can say who it was. The first to vanish is
the one lost. Under ``TINYTRAIN_TOPOLOGY`` (emulated nodes) the agent drops that rank's whole node.
With ``--hostfile`` the ranks there are the hostfile's slots, read again at every restart, and
a hostfile that grows during a healthy run makes the agent stop it after a step (with a
checkpoint) and relaunch it on more ranks (at most ``--max-ranks``).

Signals: SIGINT or SIGTERM to the agent stops the run after a step, with a checkpoint, and no
restart: the agent passes SIGUSR1 to ``mpirun`` (the signal every launcher passes on to its ranks
and waits for; Open MPI's ``prterun`` kills the job on SIGTERM). A refusal (exit 2) is not retried.

What it cannot survive: the loss of its own machine (it is one process), of the checkpoint folder
(on a node that is gone), or of so many ranks that fewer than ``--min-ranks`` are left.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tinytrain import launcher

# The world rank of a launched process, by the variable each launcher sets.
_RANK_VARIABLES = (b"PMI_RANK=", b"OMPI_COMM_WORLD_RANK=", b"PMIX_RANK=")
END_GRACE = (
    10.0  # seconds the ranks may outlive the first to end (they see a dead peer and stop) before the agent ends them
)
STOPPED_BY_SIGNAL = (130, 138, 143)  # a run that stopped after a step, with a checkpoint: SIGINT, SIGUSR1, SIGTERM


def killed(code: int) -> bool:
    """Did ``mpirun``'s exit code say a rank died of a signal? Hydra (MPICH) exits with the signal's
    number (9), Open MPI with 128 + it (137), Intel MPI's script with 255; a rank's Python error is 1."""
    return code not in STOPPED_BY_SIGNAL and (code == 255 or 3 <= code < 64 or code > 128)


@dataclass(frozen=True)
class Layout:
    """The ranks one launch uses: ``dp`` replicas of the fixed ``tp × pp × cp × ep``, each pipeline
    replica cutting its rows into ``microbatches`` (1 without a pipeline)."""

    dp: int
    fixed: int
    microbatches: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.fixed


def fixed_ranks(train_args) -> int:
    """The ranks one replica takes: what the agent never changes."""
    return train_args.tp * train_args.pp * train_args.cp * train_args.ep


def launch_microbatches(train_args) -> int:
    """The micro-batches a replica of the launch's own layout cuts its rows into."""
    return (train_args.microbatches or 2 * train_args.pp) if train_args.pp > 1 else 1


def schedule_takes(train_args, microbatches: int) -> bool:
    """Can the run's pipeline schedule play ``microbatches`` (interleaved 1F1B needs a multiple of --pp)?"""
    from tinytrain.parallel.pipeline.schedules import make_schedule

    try:
        make_schedule(train_args.schedule, train_args.pp, microbatches, train_args.chunks)
    except ValueError:
        return False
    return True


def layout_for(available: int, train_args) -> Layout:
    """The layout ``available`` ranks run the same training on (task 10.1).

    One replica is ``fixed_ranks(train_args)`` ranks, which never change. The global batch
    (``--batch-size``) never changes either, so every step of any layout trains on the same rows and
    the loss curve is the launch's. Of the layouts that keep both, the one with the most replicas
    that fit; a pipeline's replica then cuts its rows into the fewest micro-batches that its schedule
    plays (``schedule_takes``) and that hold no more rows each than a micro-batch of the launch's
    layout (``--dp``, ``launch_microbatches``): a replica given more rows runs more micro-batches,
    not bigger ones. Without a pipeline a replica takes all its rows at once (``microbatches`` 1).

    Refused (``ValueError``, one sentence): fewer ranks than one replica (naming the smallest world
    that would do), or a batch that no count of replicas splits.
    """
    fixed = fixed_ranks(train_args)
    if available < fixed:
        raise ValueError(
            f"{available} ranks are left, and one replica of this layout (--tp {train_args.tp} --pp {train_args.pp} "
            f"--cp {train_args.cp} --ep {train_args.ep}) needs {fixed}: the smallest world that would do is {fixed}"
        )
    raise NotImplementedError("TODO 10.1: The most replicas that fit and split the global batch evenly; for a pipeline, the fewest micro-batches its schedule plays, none bigger than the launch's.")
    raise ValueError(
        f"--batch-size {train_args.batch_size} splits over no count of replicas with --ep {train_args.ep}"
        + (f" and --schedule {train_args.schedule}" if train_args.pp > 1 else "")
        + f": use a multiple of {train_args.ep * launch_microbatches(train_args)}"
    )


def hostfile_slots(path: str) -> int:
    """The ranks a hostfile offers: the sum of its slots (``host:N`` or ``host slots=N``; a bare host: 1)."""
    total = 0
    for line in Path(path).read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        if "slots=" in line:
            total += int(line.split("slots=")[1].split()[0])
        elif ":" in line:
            total += int(line.rsplit(":", 1)[1])
        else:
            total += 1
    return total


class RankWatcher:
    """The ranks of one launch, by pid, and the first of them to vanish (a daemon thread)."""

    def __init__(self, launch_id: str, every: float = 0.002, world: int | None = None):
        self.marker = f"TINYTRAIN_LAUNCH_ID={launch_id}".encode()
        self.world = world  # ranks to find: /proc is rescanned every few ms until all are
        self.pids: dict[int, int] = {}  # pid -> world rank
        self.gone: dict[int, tuple[int, float]] = {}  # pid -> (world rank, when it was found ended)
        self.every, self.stopped = every, threading.Event()
        self.thread = threading.Thread(target=self._look, daemon=True)
        self.thread.start()

    def _ranks_now(self) -> dict[int, int]:
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                environ = b"\0" + Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:
                continue
            if self.marker not in environ:
                continue
            for variable in _RANK_VARIABLES:
                at = environ.find(b"\0" + variable)
                if at >= 0:
                    value = environ[at + 1 + len(variable) :].split(b"\0", 1)[0]
                    found[int(entry)] = int(value)
                    break
        return found

    def _look(self) -> None:
        """Rescan /proc for the launch's ranks now and then; look at the known ones often.

        Between looks the thread sleeps in ``poll`` on a pidfd of each rank (Linux), so a rank's
        end wakes it at once. Why: on a loaded machine a thread that only wakes on a timer may run
        late, find the lost rank and the survivors that ended after it gone in one look, and take
        the first it checks for the first to go."""
        last_scan, waiter, watched = 0.0, _ExitWaiter(), set()
        try:
            while not self.stopped.is_set():
                now = time.monotonic()
                # Until every rank is found, rescan every 20 ms: a rank that dies in its first half second
                # (a fault while it loads the checkpoint) must be known before it vanishes, or a survivor
                # that ends later would be taken for the lost one.
                searching = self.world is not None and len(set(self.pids.values())) < self.world
                if now - last_scan > (0.02 if searching else 0.5) and os.path.isdir("/proc"):
                    self.pids.update((pid, rank) for pid, rank in self._ranks_now().items() if pid not in self.gone)
                    last_scan = now
                    for pid in self.pids.keys() - watched:
                        waiter.watch(pid)
                        watched.add(pid)
                seen = time.time()  # one time for one look: ranks found gone in the same look tie
                for pid, rank in self.pids.items():
                    if pid not in self.gone and not launcher.alive(pid):
                        self.gone[pid] = (rank, seen)
                        waiter.forget(pid)
                waiter.wait(self.every)
        finally:
            waiter.close()

    @property
    def first_lost(self) -> tuple[int, int, float] | None:
        """(rank, pid, when) of the first rank to end, or None."""
        if not self.gone:
            return None
        pid, (rank, when) = min(self.gone.items(), key=lambda item: (item[1][1], item[1][0]))
        return rank, pid, when

    def stop(self) -> None:
        self.stopped.set()


class _ExitWaiter:
    """Sleep until one of the watched processes ends or ``timeout`` passes: ``poll`` on their
    pidfds (Linux 5.3+), else a plain sleep."""

    def __init__(self):
        self.poller = select.poll() if hasattr(os, "pidfd_open") else None
        self.fds: dict[int, int] = {}  # pid -> its pidfd, while it runs

    def watch(self, pid: int) -> None:
        if self.poller is None:
            return
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # gone already, or pidfds not allowed here: the looks still find it
            return
        self.fds[pid] = fd
        self.poller.register(fd, select.POLLIN)

    def forget(self, pid: int) -> None:
        """Stop waiting on ``pid`` (it has ended: its pidfd would wake every wait)."""
        fd = self.fds.pop(pid, None)
        if fd is not None:
            self.poller.unregister(fd)
            os.close(fd)

    def wait(self, timeout: float) -> None:
        if self.poller is None or not self.fds:
            time.sleep(timeout)
        else:
            self.poller.poll(timeout * 1000)

    def close(self) -> None:
        for pid in list(self.fds):
            self.forget(pid)


@dataclass
class Agent:
    """One elastic run: launches, watches, decides, relaunches."""

    ranks: int
    train_argv: list[str]
    min_ranks: int = 1
    max_ranks: int | None = None
    max_restarts: int = 3
    hostfile: str | None = None
    entry: list[str] = field(default_factory=lambda: [sys.executable, "-m", "tinytrain.cli"])
    restarts: list[dict] = field(default_factory=list)
    stop_signal: int | None = None

    def __post_init__(self):
        from tinytrain.trainer.args import add_arguments, check_args

        parser = argparse.ArgumentParser(prog="tinytrain launch -- (train's options)")
        add_arguments(parser)
        self.train_args = parser.parse_args(self.train_argv)
        check_args(self.train_args, topology=False)  # (an emulated cluster must fit -n, not this process)
        if "--dp" not in self.train_argv:  # the launch's layout, which layout_for keeps a micro-batch of
            self.train_args.dp = max(1, self.ranks // fixed_ranks(self.train_args))
        emulated = _emulated()
        if emulated is not None:
            emulated.check_world(self.ranks)
        if self.max_ranks is None:
            self.max_ranks = self.ranks
        if not 1 <= self.min_ranks <= self.ranks:
            raise ValueError(f"--min-ranks {self.min_ranks} must be between 1 and -n {self.ranks}")
        if self.max_ranks < self.ranks:
            raise ValueError(f"--max-ranks {self.max_ranks} is below -n {self.ranks}: give at least {self.ranks}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        layout_for(self.ranks, self.train_args)  # a layout no world fits is refused before any launch
        self.out = Path(self.train_args.out)

    # --- what a launch runs ----------------------------------------------------------------------

    def capacity(self, lost: int) -> int:
        """The ranks there are now: the hostfile's slots, or -n less those lost; at most --max-ranks."""
        there = hostfile_slots(self.hostfile) if self.hostfile else self.ranks - lost
        return min(there, self.max_ranks)

    def command(self, layout: Layout) -> list[str]:
        argv = list(self.train_argv)
        if "--dp" in argv:
            del argv[argv.index("--dp") : argv.index("--dp") + 2]
        argv += ["--dp", str(layout.dp)]
        if self.train_args.pp > 1:  # a replica given more rows cuts them into more micro-batches
            if "--microbatches" in argv:
                del argv[argv.index("--microbatches") : argv.index("--microbatches") + 2]
            argv += ["--microbatches", str(layout.microbatches)]
        if (self.out / "ckpt").exists() and "--resume" not in argv:
            argv.append("--resume")
        launch = launcher.mpirun_command(layout.world, hostfile=self.hostfile)
        if launcher.kind(launch[0]) in ("mpich", "impi"):
            # hydra would kill the other ranks within a millisecond of the first death, and then the
            # agent could not tell which died first; told not to, it leaves them (stuck, waiting on
            # the dead one) and the agent ends them once it has seen who went
            launch.insert(1, "-disable-auto-cleanup")
        return [*launch, *self.entry, "train", *argv]

    # --- the loop -------------------------------------------------------------------------------

    def run(self) -> int:
        lost = 0
        previous = signal.signal(signal.SIGINT, self._stop), signal.signal(signal.SIGTERM, self._stop)
        try:
            while True:
                available = self.capacity(lost)
                if available < self.min_ranks:
                    return self._give_up(f"{available} ranks are left, below --min-ranks {self.min_ranks}")
                layout = layout_for(available, self.train_args)
                code, fault = self._launch(layout)
                if code == 0 or code == 2 or self.stop_signal is not None:
                    return code
                if fault.get("grow"):
                    self.restarts.append(fault)
                    continue
                if not fault:
                    return code  # stopped from outside (a scheduler's SIGUSR1): its checkpoint is written
                if len([r for r in self.restarts if not r.get("grow")]) >= self.max_restarts:
                    self.restarts.append(fault)
                    return self._give_up(
                        f"the run failed {len(self.restarts)} times (--max-restarts {self.max_restarts})", code
                    )
                lost += fault.get("lost_ranks", 0)
                self.restarts.append(fault)
                print(f"tinytrain launch: {fault['why']}; restarting from the last checkpoint", file=sys.stderr)
        finally:
            signal.signal(signal.SIGINT, previous[0])
            signal.signal(signal.SIGTERM, previous[1])
            self._record()

    def _stop(self, signum, frame) -> None:
        self.stop_signal = signum
        job = getattr(self, "job", None)
        if job is not None and job.poll() is None:
            job.send_signal(signal.SIGUSR1)  # every launcher passes it on and waits: a step, a checkpoint

    def _launch(self, layout: Layout) -> tuple[int, dict]:
        launch_id = uuid.uuid4().hex
        env = dict(launcher.nested_environment(), TINYTRAIN_LAUNCH_ID=launch_id)
        emulated = _emulated()
        if emulated is not None:  # the nodes left, each of its ranks
            env["TINYTRAIN_TOPOLOGY"] = f"{layout.world // emulated.per_node}x{emulated.per_node}"
        cmd = self.command(layout)
        print(f"tinytrain launch: {layout.world} ranks, --dp {layout.dp}: {' '.join(cmd)}", file=sys.stderr)
        watcher = RankWatcher(launch_id, world=layout.world)
        started, self.ended_it = time.time(), False
        self.job = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
        named = _NamedDeaths(self.job.stderr)
        grow = None
        while self.job.poll() is None:
            time.sleep(0.05)
            first = watcher.first_lost
            if first is not None and self.stop_signal is None and time.time() - first[2] > END_GRACE:
                self._end_job(watcher)  # the others outlived the first by long: end them
                break
            if grow is None and self.hostfile and self.stop_signal is None:
                more = min(hostfile_slots(self.hostfile), self.max_ranks)
                if layout_for(more, self.train_args).world > layout.world:
                    grow = more
                    self.job.send_signal(signal.SIGUSR1)  # stop after a step, with a checkpoint
        code = self.job.wait()
        if code < 0:  # mpirun itself died of a signal (Intel MPI's is a script that SIGUSR1 ends)
            code = 128 - code
        ranks_end = time.monotonic() + 60
        while any(launcher.alive(pid) for pid in watcher.pids) and time.monotonic() < ranks_end:
            time.sleep(0.05)  # a launcher may end before its ranks (they see it gone, and finish the step)
        watcher.stop()
        if grow is not None and code in STOPPED_BY_SIGNAL:
            return code, {"when": time.time(), "why": f"the hostfile offers {grow} ranks", "grow": True}
        if code in (0, 2, *STOPPED_BY_SIGNAL):
            return code, {}
        fault = {"when": time.time(), "started": started, "exit_code": code, "world": layout.world}
        named.thread.join(timeout=5)
        # A rank is lost when mpirun says one was killed, when the agent had to end the rest, or when
        # the survivors say one has died (they end themselves once its process is gone, with an
        # error of their own: then mpirun's code is theirs, not the signal's)
        lost = killed(code) or self.ended_it or named.first is not None
        if lost and (named.first or watcher.first_lost) is not None:
            rank, pid, when = watcher.first_lost or (*named.first, time.time())
            reported = None if self.ended_it else watcher.pids.get(named.reported_pid)
            if named.first is not None and named.first[0] != rank:
                # the survivors saw which process was gone (tinytrain's watchdog, by the start line's
                # pids); the watcher's order can tie when the machine is loaded and its looks come late
                rank, pid = named.first
                when = next((t for r, t in watcher.gone.values() if r == rank), when)
            elif named.first is None and reported is not None and reported != rank:
                # nobody named it, but the launcher saw which of its processes ended first (when the
                # agent ended the job itself, that report is of one the agent killed: not used)
                rank, pid = reported, named.reported_pid
                when = next((t for r, t in watcher.gone.values() if r == rank), when)
            node = _node_of(rank, layout.world)
            fault.update(when=when, rank=rank, pid=pid)
            if node is not None:
                fault.update(node=node[0], lost_ranks=node[1], why=f"node {node[0]} was lost (rank {rank} died first)")
            else:
                fault.update(lost_ranks=1, why=f"rank {rank} (pid {pid}) died")
        else:  # (a Python error on the ranks: the same world again, until --max-restarts)
            fault.update(lost_ranks=0, why=f"mpirun exited with {code}, no rank lost")
        return code, fault

    def _end_job(self, watcher) -> None:
        """A rank is lost: end the rest of the job (its launcher leaves them, waiting on the dead one)."""
        self.ended_it = True
        for pid in watcher.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            self.job.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.job.kill()

    def _give_up(self, why: str, code: int = 1) -> int:
        print(f"tinytrain launch: stopping: {why}", file=sys.stderr)
        return code or 1

    def _record(self) -> None:
        """The restarts into OUT/restarts.json and metrics.json (where a run wrote one), each with the
        seconds from its fault to the first step after it."""
        from tinytrain import checkpoint

        if self.restarts and self.out.is_dir():
            text = json.dumps(self.restarts, indent=1).encode()
            checkpoint.atomic_write(self.out / "restarts.json", lambda f: f.write(text))
        path = self.out / "metrics.json"
        if not path.exists():
            return
        metrics = json.loads(path.read_text())
        steps = metrics.get("steps", [])
        for restart in self.restarts:
            after = [s for s in steps if s.get("time", 0) > restart["when"]]
            if after:
                restart["first_step_after"] = after[0]["step"]
                restart["seconds_to_first_step"] = round(after[0]["time"] - restart["when"], 3)
        metrics["restarts"] = self.restarts
        checkpoint.atomic_write(path, lambda f: f.write(json.dumps(metrics, indent=1).encode()))
        checkpoint.atomic_write(
            self.out / "restarts.json", lambda f: f.write(json.dumps(self.restarts, indent=1).encode())
        )
        if (self.out / "loss.png").exists():
            from tinytrain.viz import plot_loss_curve

            title = f"elastic run: {len(self.restarts)} restart(s)"
            checkpoint.atomic_write(self.out / "loss.png", lambda f: plot_loss_curve(metrics, f, title=title))


class _NamedDeaths:
    """The job's stderr, passed on to ours line by line, and the first rank its survivors name as
    dead ("tinytrain: rank 1 (pid 9760 on vm) has died"), as (rank, pid); and the process the
    launcher itself reports as the first to end badly: hydra's (MPICH, Intel MPI) "BAD TERMINATION
    ... PID 9760 RUNNING AT vm", Open MPI's "process rank 1 with PID 9760 on node vm exited on
    signal", as its pid. Why the launcher's too: hydra SIGKILLs the survivors within about 0.1 s,
    before they can name anyone, and on a loaded machine the agent's watcher may look only after
    that, finding every rank gone at once."""

    PATTERN = re.compile(rb"rank (\d+) \(pid (\d+) on \S+\) has died")
    LAUNCHER_REPORTS = (
        re.compile(rb"PID (\d+) RUNNING AT \S+"),
        re.compile(rb"rank \d+ with PID (\d+) on node \S+ exited"),
    )

    def __init__(self, stream):
        self.first: tuple[int, int] | None = None
        self.reported_pid: int | None = None  # the launcher's first bad termination
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream) -> None:
        out = getattr(sys.stderr, "buffer", None)
        for line in iter(stream.readline, b""):
            if out is not None:
                out.write(line)
                out.flush()
            else:
                sys.stderr.write(line.decode(errors="replace"))
            found = self.PATTERN.search(line)
            if found and self.first is None:
                self.first = (int(found[1]), int(found[2]))
            for report in self.LAUNCHER_REPORTS:
                found = report.search(line)
                if found and self.reported_pid is None:
                    self.reported_pid = int(found[1])


def _emulated():
    from tinytrain.distributed import topology

    return topology.from_env()


def _node_of(rank: int, world: int) -> tuple[int, int] | None:
    """(node, its ranks) of ``rank`` under an emulated topology (nodes of equal size), else None."""
    emulated = _emulated()
    if emulated is None:
        return None
    return rank // emulated.per_node, emulated.per_node


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--ranks", type=int, required=True, help="ranks to start with")
    p.add_argument("--min-ranks", type=int, default=1, help="stop when fewer ranks than this are left")
    p.add_argument("--max-ranks", type=int, default=None, help="grow to at most this many ranks (default: -n)")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts after failures before giving up")
    p.add_argument("--hostfile", default=None, help="the hosts and their slots, read again at every restart")
    p.add_argument(
        "--entry",
        default=None,
        help="the command each rank runs, before `train ...` (default: this Python's `-m tinytrain.cli`)",
    )
    p.add_argument("train", nargs=argparse.REMAINDER, help="-- then `tinytrain train`'s options")


def run(args) -> int:
    argv = list(args.train)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if argv[:1] == ["train"]:
        argv = argv[1:]
    agent = Agent(
        args.ranks, argv, args.min_ranks, args.max_ranks, args.max_restarts, args.hostfile,
        **({"entry": args.entry.split()} if args.entry else {}),
    )  # fmt: skip
    return agent.run()
